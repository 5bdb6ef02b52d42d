"""ControlMaster inside one `bastion run` (issue 20): shared by the run, by no one else.

A registered run is one subject, so a ControlMaster that only the run's own
processes use carries their commands (ansible's default ControlMaster=auto);
a process outside the run, or of another run, that reaches the same control
socket is refused, and nothing it sends runs on the run's approval. On the
base tree every command through a master was refused, inside a run too: the
positive controls here (the run's own clients run) failed there.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.harness import Agent, Bastion, Result, master_pid, policy_toml, wait_for

# Control sockets live where every process sees them (a run's /tmp is its own), on a
# short path (a unix socket path has at most 107 bytes), given to each sandboxed run
# with --rw (a run writes only where it was given).
SHORT = "/var/tmp/bt/mx"
pytestmark = pytest.mark.skipif(not Path("/usr/bin/ssh").exists(), reason="no /usr/bin/ssh")


MODES = [pytest.param((), id="sandboxed"), pytest.param(("--no-sandbox",), id="no-sandbox")]


def run_agent(b: Bastion, label: str, flags: tuple[str, ...] = ()) -> Agent:
    """A long-lived agent started by `bastion run` (its pid is the run's): in a sandbox
    of its own by default (`flags` may say --no-sandbox)."""
    cli = (sys.executable, "-m", "bastion.cli", "--home", str(b.home.root))
    os.makedirs(SHORT, exist_ok=True)
    given = () if "--no-sandbox" in flags else ("--rw", SHORT)
    agent = Agent(b.config, launcher=(*cli, "run", *flags, *given, "--label", label, "--"))
    b.agents.append(agent)
    return agent


def approved(b: Bastion, agent: Agent) -> Agent:
    rid = agent.start("true")
    card = b.approve_next()
    assert card["subject"]["kind"] == "registered run", card
    assert agent.wait(rid).rc == 0
    return agent


@contextlib.contextmanager
def control_dir() -> Iterator[Path]:
    """A short directory for control sockets, outside the runs' private /tmp."""
    os.makedirs(SHORT, exist_ok=True)
    d = Path(tempfile.mkdtemp(prefix="mx", dir=SHORT))
    try:
        yield d
    finally:
        for sock in d.iterdir():
            subprocess.run(
                ["ssh", "-F", "/dev/null", "-o", f"ControlPath={sock}", "-O", "exit", "web1"],
                capture_output=True,
                timeout=30,
            )
        shutil.rmtree(d, ignore_errors=True)


def assert_ran(result: Result, out: bytes) -> None:
    assert (result.rc, result.stdout) == (0, out), result.stderr


def assert_outsider_refused(result: Result) -> None:
    assert result.rc == 77, result.stderr
    assert result.code == "UNSUPPORTED_REQUEST", result.stderr
    assert result.error is not None and result.error["retryable"] is False
    message = result.error["message"]
    assert "ControlMaster of a registered run" in message, message
    assert "Nothing was sent" in message


@pytest.mark.parametrize("flags", MODES)
def test_a_runs_own_processes_share_its_master(bastion: Bastion, flags: tuple[str, ...]) -> None:
    a = approved(bastion, run_agent(bastion, "mux-a", flags))
    with control_dir() as d:
        cp = d / "a"
        master = ["-M", "-S", str(cp), "-o", "ControlPersist=60", "-N", "-f"]
        started = a.run([], argv=["ssh", "-F", str(bastion.config), *master, "web1"])
        assert started.rc == 0, started.stderr
        pid = master_pid(cp)
        assert pid is not None
        for n in range(3):  # more than one: later channels on the one connection
            assert_ran(a.run(f"echo rode-{n}", ssh_args=("-S", str(cp))), f"rode-{n}\n".encode())
        assert master_pid(cp) == pid  # through the master, not new connections
        assert bastion.op("pending") == []  # the run's approval, asked once


def test_a_master_running_its_own_command_carries_the_runs_next_ones(bastion: Bastion) -> None:
    """ControlMaster=auto with ControlPersist (ansible's default): the first ssh becomes
    the master, and each later ssh of the run rides it."""
    a = approved(bastion, run_agent(bastion, "mux-auto"))
    with control_dir() as d:
        cp = d / "auto"
        auto = ("-o", "ControlMaster=auto", "-o", f"ControlPath={cp}", "-o", "ControlPersist=60")
        assert_ran(a.run("echo first", ssh_args=auto), b"first\n")
        pid = master_pid(cp)
        assert pid is not None
        assert_ran(a.run("echo second", ssh_args=auto), b"second\n")
        assert_ran(a.run("echo third", ssh_args=auto), b"third\n")
        assert master_pid(cp) == pid


@pytest.mark.parametrize("flags", MODES)
def test_no_one_outside_the_run_rides_its_master(
    bastion: Bastion, tmp_path: Path, flags: tuple[str, ...]
) -> None:
    """The same client argv: from inside run A it runs (the positive control); from a
    process outside every run, and from run B, it is refused and nothing runs; B's
    own command asks B's own card -- A's approval covers nothing B sends."""
    a = approved(bastion, run_agent(bastion, "mux-a", flags))
    outside = bastion.agent()
    b = run_agent(bastion, "mux-b", flags)
    by_outside, by_b = tmp_path / "by-outside", tmp_path / "by-b"
    with control_dir() as d:
        cp = d / "a"
        master = ["-M", "-S", str(cp), "-o", "ControlPersist=60", "-N", "-f"]
        assert a.run([], argv=["ssh", "-F", str(bastion.config), *master, "web1"]).rc == 0
        ride = ("-S", str(cp))
        assert_ran(a.run("echo inside", ssh_args=ride), b"inside\n")

        assert_outsider_refused(outside.run(f"touch {by_outside}", ssh_args=ride))
        assert_outsider_refused(b.run(f"touch {by_b}", ssh_args=ride))
        assert bastion.op("pending") == []  # nobody was asked on A's behalf

        # A's master still works for A afterwards.
        assert_ran(a.run("echo still", ssh_args=ride), b"still\n")

        # B on its own connection: its own card, as run B.
        rid = b.start(f"touch {by_b}")
        card = bastion.next_card()
        assert card["subject"]["pid"] == b.pid and card["subject"]["run"] is not None
        bastion.answer(card, False)
        assert b.wait(rid).code == "SESSION_DENIED"
    assert not by_outside.exists() and not by_b.exists()


def test_a_master_outside_any_run_still_carries_nothing(bastion: Bastion, tmp_path: Path) -> None:
    """Only a run's connection may be shared: a plain agent's master refuses even its own
    second command, with words that say where sharing works."""
    agent = bastion.agent()
    rid = agent.start("true")
    bastion.approve_next()
    assert agent.wait(rid).rc == 0
    marker = tmp_path / "ridden"
    with control_dir() as d:
        cp = d / "p"
        master = ["-M", "-S", str(cp), "-o", "ControlPersist=60", "-N", "-f"]
        assert agent.run([], argv=["ssh", "-F", str(bastion.config), *master, "web1"]).rc == 0
        r = agent.run(f"touch {marker}", ssh_args=("-S", str(cp)))
        assert r.rc == 77 and r.code == "UNSUPPORTED_REQUEST", r.stderr
        assert "Inside one `bastion run`" in r.error["message"]  # type: ignore[index]
    assert not marker.exists()


# -- ansible, with its default settings -----------------------------------------------------

ANSIBLE = shutil.which("ansible", path=os.path.dirname(sys.executable)) or shutil.which("ansible")


@pytest.mark.skipif(ANSIBLE is None, reason="ansible-core is not installed (pip: the test extra)")
def test_ansible_ad_hoc_with_default_settings_runs_inside_one_run(
    bastion: Bastion, tmp_path: Path
) -> None:
    """Three modules through ansible's default ControlMaster=auto / ControlPersist=60s,
    its default transfer method (smart: sftp, then scp, then piped) and no pipelining: its
    modules run under -tt, so the account has `pty = true` (without it, nothing runs:
    tests/clients/test_ansible.py)."""
    assert ANSIBLE is not None
    bastion.write_policy(policy_toml(bastion.sshd, pty=True))
    a = approved(bastion, run_agent(bastion, "ansible"))
    inventory = tmp_path / "hosts.ini"
    inventory.write_text(
        "[targets]\n"
        f"web1 ansible_user={bastion.sshd.user} ansible_python_interpreter=/usr/bin/python3 "
        f"ansible_ssh_common_args='-F {bastion.config}'\n"
    )
    # A short control path directory of the run's own (ansible's default is ~/.ansible/cp).
    ansible_home = tempfile.mkdtemp(prefix="ah", dir=SHORT)
    env = {
        "ANSIBLE_HOME": ansible_home,
        "ANSIBLE_LOCAL_TEMP": os.path.join(ansible_home, "tmp"),
        "ANSIBLE_SSH_CONTROL_PATH_DIR": tempfile.mkdtemp(prefix="acp", dir=SHORT),
        "ANSIBLE_HOST_KEY_CHECKING": "False",
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_FORCE_COLOR": "0",
    }
    marker = "/tmp/bastion-ansible-marker"
    modules = [
        ("ping", ""),
        ("command", "echo from-command"),
        ("shell", f"echo from-shell > {marker} && cat {marker}"),
    ]
    masters: set[int | None] = set()
    for module, args in modules:
        argv = [ANSIBLE, "-i", str(inventory), "web1", "-o", "-m", module]
        if args:
            argv += ["-a", args]
        r = a.run([], argv=argv, env=env)
        out = r.stdout.decode()
        assert r.rc == 0, (module, out[-3000:], r.stderr[-3000:])
        if module == "ping":  # web1 | SUCCESS => {... "ping": "pong"}
            assert out.startswith("web1 | SUCCESS => ") and '"ping": "pong"' in out, out
        else:  # web1 | CHANGED | rc=0 | (stdout) from-command
            assert out.startswith("web1 | CHANGED | rc=0 | (stdout) from-"), out
            assert f"(stdout) from-{module}" in out, out
        cps = list(Path(env["ANSIBLE_SSH_CONTROL_PATH_DIR"]).iterdir())
        masters |= {master_pid(p) for p in cps}
    # One master (ControlPersist) carried all of it, and nobody was asked again.
    assert len(masters) == 1 and None not in masters, masters
    assert bastion.op("pending") == []


# -- a gateway that is not root ---------------------------------------------------------------

SBXTEST = 1001  # the machine's unprivileged test user (tests run as root)
RUN_TREE = """
import os, socket, subprocess, sys, time
d = sys.argv[1]
if sys.argv[2] == "run":  # the run's root: a master and a client below it
    m = subprocess.Popen([d + "/ssh", __file__, d, "master"], stdout=subprocess.PIPE)
    assert m.stdout.readline() == b"listening\\n"
    c = subprocess.Popen([sys.executable, __file__, d, "client"], stdout=subprocess.PIPE)
    assert c.stdout.readline() == b"connected\\n"
    print("ready", flush=True)
    time.sleep(600)
elif sys.argv[2] == "master":  # holds the gateway's connection, serves a control socket
    conn = socket.socket(socket.AF_UNIX); conn.connect(d + "/gw")
    ctl = socket.socket(socket.AF_UNIX); ctl.bind(d + "/cp"); ctl.listen(8)
    print("listening", flush=True)
    held = []
    while True:
        held.append(ctl.accept()[0])
else:  # a mux client
    s = socket.socket(socket.AF_UNIX); s.connect(d + "/cp")
    print("connected", flush=True)
    time.sleep(600)
"""
READER = """
import json, sys
from bastion.gateway.mux import mux_clients
view = mux_clients(int(sys.argv[1]), int(sys.argv[2]), 0)
print(json.dumps([view.in_run, view.seen]))
"""


def read_as_sbxtest(run_pid: int, inode: int) -> tuple[bool | None, str]:
    """`mux.mux_clients` in a process of uid 1001, as a gateway that is not root runs it."""
    r = subprocess.run(
        ["/usr/bin/python3", "-c", READER, str(run_pid), str(inode)],
        capture_output=True,
        text=True,
        timeout=60,
        user=SBXTEST,
        group=SBXTEST,
        env={"PYTHONPATH": str(Path(__file__).resolve().parents[2]), "PATH": "/usr/bin:/bin"},
    )
    assert r.returncode == 0, r.stderr
    in_run, seen = json.loads(r.stdout)
    return in_run, seen


BWRAP = ["/usr/bin/bwrap", "--unshare-user", "--unshare-pid", "--die-with-parent"]
BWRAP += ["--dev-bind", "/", "/", "--"]


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to start processes as uid 1001")
@pytest.mark.parametrize(
    "tree_uid,box",
    [(SBXTEST, []), (SBXTEST, BWRAP), (0, [])],
    ids=["same-uid", "same-uid-in-a-user-namespace", "other-uid"],
)
def test_the_reader_needs_no_root_for_its_own_uid(
    tmp_path: Path, tree_uid: int, box: list[str]
) -> None:
    """A gateway of uid 1001 reads a run of its own uid (a sandboxed run: the gateway's uid
    in a child user namespace): a client of the run's master is seen to be the run's, an
    outside one is seen not to be (the positive control: the same reader, the same
    master). A run of another uid (--isolated) cannot be read: unseen, so refused."""
    if subprocess.run(["/usr/bin/python3", "-c", "import psutil"]).returncode != 0:
        pytest.skip("/usr/bin/python3 lacks psutil (Debian: python3-psutil)")
    d = Path(tempfile.mkdtemp(prefix="mxu", dir=SHORT))
    os.chmod(d, 0o777)
    shutil.copy("/usr/bin/python3", d / "ssh")  # the master's executable is named ssh
    script = d / "tree.py"
    script.write_text(RUN_TREE)
    gw = socket.socket(socket.AF_UNIX)
    gw.bind(str(d / "gw"))
    os.chmod(d / "gw", 0o777)
    gw.listen(8)
    ids = {"user": tree_uid, "group": tree_uid}
    if box and not Path(box[0]).exists():
        pytest.skip("no bubblewrap")
    run = subprocess.Popen(
        [*box, "/usr/bin/python3", str(script), str(d), "run"], stdout=subprocess.PIPE, **ids
    )
    outsider = socket.socket(socket.AF_UNIX)
    try:
        assert run.stdout is not None and run.stdout.readline() == b"ready\n"
        ours, _ = gw.accept()
        inode = os.fstat(ours.fileno()).st_ino
        in_run, seen = read_as_sbxtest(run.pid, inode)
        if tree_uid != SBXTEST:
            assert in_run is None and "cannot be read by the gateway (uid 1001)" in seen, seen
            return
        assert in_run is True, seen
        outsider.connect(str(d / "cp"))  # this test process: outside the run's tree
        wait_for(lambda: read_as_sbxtest(run.pid, inode)[0] is False, timeout=20)
        assert "outside the run" in read_as_sbxtest(run.pid, inode)[1]
    finally:
        outsider.close()
        for p in psutil.Process(run.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                p.kill()
        run.kill()
        run.wait(10)
        gw.close()
        shutil.rmtree(d, ignore_errors=True)
