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
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import Agent, Bastion, Result

pytestmark = pytest.mark.skipif(not Path("/usr/bin/ssh").exists(), reason="no /usr/bin/ssh")


def run_agent(b: Bastion, label: str) -> Agent:
    """A long-lived agent started by `bastion run` (its pid is the run's)."""
    cli = (sys.executable, "-m", "bastion.cli", "--home", str(b.home.root))
    agent = Agent(b.config, launcher=(*cli, "run", "--label", label, "--"))
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
    """A short directory for control sockets (a unix socket path has at most 107 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="mx", dir="/tmp"))
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


def master_pid(path: Path) -> int | None:
    r = subprocess.run(
        ["ssh", "-F", "/dev/null", "-o", f"ControlPath={path}", "-O", "check", "web1"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    _, _, rest = r.stderr.partition("Master running (pid=")
    return int(rest.split(")")[0]) if rest else None


def assert_ran(result: Result, out: bytes) -> None:
    assert (result.rc, result.stdout) == (0, out), result.stderr


def assert_outsider_refused(result: Result) -> None:
    assert result.rc == 77, result.stderr
    assert result.code == "UNSUPPORTED_REQUEST", result.stderr
    assert result.error is not None and result.error["retryable"] is False
    message = result.error["message"]
    assert "ControlMaster of a registered run" in message, message
    assert "Nothing was sent" in message


def test_a_runs_own_processes_share_its_master(bastion: Bastion) -> None:
    a = approved(bastion, run_agent(bastion, "mux-a"))
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


def test_no_one_outside_the_run_rides_its_master(bastion: Bastion, tmp_path: Path) -> None:
    """The same client argv: from inside run A it runs (the positive control); from a
    process outside every run, and from run B, it is refused and nothing runs; B's
    own command asks B's own card -- A's approval covers nothing B sends."""
    a = approved(bastion, run_agent(bastion, "mux-a"))
    outside = bastion.agent()
    b = run_agent(bastion, "mux-b")
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
    its default transfer method (smart: sftp, then scp, then piped) and no pipelining."""
    assert ANSIBLE is not None
    a = approved(bastion, run_agent(bastion, "ansible"))
    inventory = tmp_path / "hosts.ini"
    inventory.write_text(
        "[targets]\n"
        f"web1 ansible_user={bastion.sshd.user} ansible_python_interpreter=/usr/bin/python3 "
        f"ansible_ssh_common_args='-F {bastion.config}'\n"
    )
    # A short control path directory of the run's own (ansible's default is ~/.ansible/cp).
    env = {
        "ANSIBLE_HOME": str(tmp_path / "ah"),
        "ANSIBLE_LOCAL_TEMP": str(tmp_path / "ah" / "tmp"),
        "ANSIBLE_SSH_CONTROL_PATH_DIR": tempfile.mkdtemp(prefix="acp", dir="/tmp"),
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
