"""Strong isolation the easy way: `bastion isolate setup`, `bastion run --isolated`,
`bastion isolate check`, with a real second uid, the real ssh client and sshd.

The acceptance line: "`bastion isolate setup` then `bastion run --isolated --
sh -c 'ssh … ; cat $BASTION_HOME/vault.json'`: the command runs after
approval, the vault read fails, and `status` says `strong`." The isolated
agent's environment has no BASTION_HOME (that is the point of the clean
environment), so the test writes the vault's path into the command itself.

Also here: `bastion run` is the subreaper of its tree -- a process detached
with `setsid -f` stays below the run while it runs and is ended with it.

The bastion lives under a fresh /tmp/bastion-iso-* directory (mode 0755), not
under pytest's /tmp/pytest-of-root (0700): there the agent user could not
reach the socket directory, and the home's own mode would protect nothing the
checks could show. One test puts a second bastion's home under a 0700 directory,
as a 0700 home directory holds `~/.local/share/bastion`, with its socket directory
beside it: `run --isolated` still works there.

And a run ends when told: an isolated agent that ptrace-stops its own bwrap is ended
by a SIGTERM of `bastion run` all the same; a CMD the agent user cannot reach (a
script in a 0700 directory, or in the host's /tmp) is refused before it registers.
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import pwd
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bastion.cli.run import END_GRACE
from bastion.sandbox import isolation
from tests.harness import USER, Bastion, Terminal, make_bastion, policy_toml, remove_user, wait_for

ISO_USER = "bastion-test-iso"
SYSTEM_PYTHON = "/usr/bin/python3"


def _processes(*argv: str) -> list[int]:
    """Pids whose command line is exactly argv (read from /proc)."""
    want = ("\0".join(argv) + "\0").encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if Path(f"/proc/{entry}/cmdline").read_bytes() == want:
                    found.append(int(entry))
    return found


def _ppid(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def _below(pid: int, ancestor: int) -> bool:
    """Is `ancestor` among pid's ancestors (a run's sandbox adopts orphans in its own
    PID namespace, below `bastion run`; an unsandboxed run adopts them itself)?"""
    while pid > 1:
        pid = _ppid(pid)
        if pid == ancestor:
            return True
    return False


def _cli(b: Bastion, *args: str, **kw: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "bastion.cli", "--home", str(b.home.root), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def _finish(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(30)
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


@dataclass
class Isolated:
    b: Bastion
    socket_dir: Path
    first_setup: subprocess.CompletedProcess[str]


@pytest.fixture(scope="module")
def isolated(sshd_server: Any, client_key: tuple[Path, str]) -> Iterator[Isolated]:
    """`isolate setup` for a fresh bastion, then its gateway (started as the
    harness always does: no --agent-group), unlocked."""
    if os.geteuid() != 0 or not shutil.which("useradd") or not os.path.exists(SYSTEM_PYTHON):
        pytest.skip("needs root, useradd and /usr/bin/python3 to run agents as another uid")
    remove_user(ISO_USER)  # so that setup creates it
    root = Path(tempfile.mkdtemp(prefix="bastion-iso-"))
    root.chmod(0o755)
    b = make_bastion(root, sshd_server.info, client_key[0], start=False)
    socket_dir = root / "door"
    try:
        first = b.cli("isolate", "setup", "--user", ISO_USER, "--socket-dir", str(socket_dir))
        b.start_daemon()
        b.unlock()
        yield Isolated(b, socket_dir, first)
    finally:
        b.close()
        shutil.rmtree(root, ignore_errors=True)
        remove_user(ISO_USER)


def test_setup_creates_the_user_and_the_door_and_checks_them(isolated: Isolated) -> None:
    b, door = isolated.b, isolated.socket_dir
    out = isolated.first_setup.stdout
    pw = pwd.getpwnam(ISO_USER)
    group = grp.getgrgid(pw.pw_gid).gr_name
    assert pw.pw_shell == "/usr/sbin/nologin" and pw.pw_uid not in (0, os.getuid())
    assert f"agent user:  {ISO_USER} (uid {pw.pw_uid}), group {group}" in out
    assert "(created now)" in out
    for line in (
        "ok    cannot list the home",
        "ok    cannot read the vault",
        "ok    cannot read or change the policies",
        "ok    cannot read or change the journal",
        "ok    cannot read the gateway's host key",
        "ok    cannot connect to the operator socket",
        "ok    can reach the socket directory, the proxy, the ssh config and /usr/bin/python3",
        "ok    cannot change the socket directory, the proxy or the ssh config",
    ):
        assert line in out, out
    assert "FAIL" not in out
    record = json.loads(b.home.isolation.read_text())
    assert record == {
        "user": ISO_USER,
        "uid": pw.pw_uid,
        "group": group,
        "gid": pw.pw_gid,
        "operator_uid": os.getuid(),
        "socket_dir": str(door),
        "agent_socket": str(door / "agent.sock"),
        "ssh_config": str(door / "ssh_config"),
        "proxy": str(door / "proxy.py"),
        "wire": str(door / "wire.py"),
        "python": SYSTEM_PYTHON,
    }
    st = os.stat(door)
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (os.getuid(), pw.pw_gid, 0o2750)
    modes = {p.name: (p.stat().st_gid, p.stat().st_mode & 0o777) for p in door.iterdir()}
    assert modes["proxy.py"] == modes["wire.py"] == (pw.pw_gid, 0o644)
    assert modes["ssh_config"] == (pw.pw_gid, 0o640)
    assert modes["agent.sock"] == (pw.pw_gid, 0o660)  # the gateway read isolation.json
    config = (door / "ssh_config").read_text()
    assert f"Host web1\n    User {USER}\n" in config
    proxy = f"{SYSTEM_PYTHON} -I -S {door}/proxy.py --socket {door}/agent.sock %h %p %r"
    assert f"    ProxyCommand {proxy}\n" in config
    pinned = " ".join(b.home.known_hosts.read_text().split()[:3])
    assert f"    KnownHostsCommand /bin/echo {pinned}\n" in config
    assert "strong isolation" in b.log.read_text()

    # Idempotent: again, the same record, nothing created.
    again = b.cli("isolate", "setup", "--user", ISO_USER, "--socket-dir", str(door))
    assert "(created now)" not in again.stdout and "FAIL" not in again.stdout
    assert json.loads(b.home.isolation.read_text()) == record
    assert modes == {p.name: (p.stat().st_gid, p.stat().st_mode & 0o777) for p in door.iterdir()}


def test_an_isolated_agent_runs_after_approval_and_cannot_read_the_vault(
    isolated: Isolated,
) -> None:
    b = isolated.b
    pw = pwd.getpwnam(ISO_USER)
    script = "; ".join(
        [
            'echo "env: $(env | cut -d= -f1 | sort | tr "\\n" " ")"',
            'echo "home: $HOME cwd: $(pwd)"',
            'echo "ids: $(id -u) $(id -G)"',
            "ssh -F \"$BASTION_SSH_CONFIG\" web1 'echo via-isolated'",
            'echo "ssh: $?"',
            "setsid -f sleep 302.5 </dev/null >/dev/null 2>&1",
            f"cat {shlex.quote(str(b.home.vault))}",
            'echo "cat: $?"',
        ]
    )
    run = _cli(b, "run", "--isolated", "--label", "iso", "--", "sh", "-c", script)
    card = b.next_card()
    assert card["subject"]["pid"] == run.pid and card["subject"]["run"] == "iso", card
    b.answer(card, True)
    out, err = run.communicate(timeout=60)
    assert run.returncode == 0, (out, err)
    lines = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)
    assert set(lines["env"].split()) - {"PWD"} == {
        "BASTION_SSH_CONFIG",
        "HOME",
        "LANG",
        "LC_ALL",
        "LOGNAME",
        "PATH",
        "SSH_AUTH_SOCK",  # the run's throwaway agent (bastion/sandbox/run_agent.py)
        "USER",
    }, out
    home, cwd = lines["home"].split(" cwd: ")
    # HOME is a directory of the run's own /tmp: no other run (nor agent of this uid) sees it.
    assert home == cwd == "/tmp/home" and not os.path.exists(home)
    assert lines["ids"] == f"{pw.pw_uid} {pw.pw_gid}"
    assert "via-isolated" in out.splitlines() and lines["ssh"] == "0", (out, err)
    # Hidden by the run's sandbox (and denied by its modes, test_isolation.py checks).
    assert f"cat: {b.home.vault}: No such file or directory" in err and lines["cat"] == "1", err
    assert _processes("sleep", "302.5") == [], "a detached process outlived the run"
    status = json.loads(b.cli("status", "--json").stdout)
    assert status["isolation"] == "strong", status
    check = b.cli("isolate", "check", "--json")
    doc = json.loads(check.stdout)
    assert doc["mode"] == "strong" and doc["checked"] == f"tried as {ISO_USER}"
    assert [g for g in doc["guarantees"] if not g["held"]] == [], doc
    assert doc["checks"]["gateway_memory"] is True and doc["checks"]["agent_socket"] is True
    human = b.cli("isolate", "check").stdout
    assert "NOT HELD" not in human
    assert (
        "ok        agents cannot read the gateway's memory, where the unlocked keys live" in human
    )


def test_file_modes_and_the_agent_user_agree(isolated: Isolated) -> None:
    """What `status` can say without privileges is what the agent user finds."""
    b = isolated.b
    iso = isolation.load(b.home)
    assert iso is not None
    pid = b.op("status")["pid"]
    tried = {c.key: c.ok for c in isolation.probe(b.home, iso, pid)}
    assert tried == isolation.permission_checks(b.home, iso, pid)
    assert all(tried.values()) and len(tried) == 10, tried
    sentences = isolation.status_guarantees(b.home, "strong", pid)
    assert all(held for _, held in sentences), sentences


def test_run_isolated_refreshes_the_ssh_config_from_the_policy(isolated: Isolated) -> None:
    b = isolated.b
    two = policy_toml(b.sshd) + policy_toml(b.sshd, alias="web2")
    b.write_policy(two)
    try:
        r = b.cli("run", "--isolated", "--", "true")
        assert "Host web2\n" in (isolated.socket_dir / "ssh_config").read_text(), r.stderr
    finally:
        b.write_policy(policy_toml(b.sshd))


def test_a_loosened_home_fails_the_checks_and_no_agent_starts(isolated: Isolated) -> None:
    b = isolated.b
    b.home.root.chmod(0o755)
    b.home.vault.chmod(0o644)
    try:
        check = b.cli("isolate", "check", check=False)
        assert check.returncode == 1
        assert (
            "NOT HELD  agents cannot read or copy the home: vault.json, the journal, "
            "the gateway's host key" in check.stdout
        ), check.stdout
        run = b.cli("run", "--isolated", "--", "touch", "/tmp/bastion-iso-ran", check=False)
        assert run.returncode == 1 and not os.path.exists("/tmp/bastion-iso-ran")
        assert f"refusing to start the agent as {ISO_USER}: list {b.home.root}: ok" in run.stderr
        setup = b.cli(
            "isolate",
            "setup",
            "--user",
            ISO_USER,
            "--socket-dir",
            str(isolated.socket_dir),
            check=False,
        )
        assert setup.returncode == 1
        assert f"FAIL  cannot list the home\n        list {b.home.root}: ok\n" in setup.stdout
        assert f"fix: chmod 700 {b.home.root}\n" in setup.stdout
        assert f"fix: chmod 600 {b.home.vault}; chmod 700 {b.home.root}\n" in setup.stdout
        assert not b.home.isolation.exists(), "a failed setup left isolation.json behind"
    finally:
        b.home.root.chmod(0o700)
        b.home.vault.chmod(0o600)
        b.cli("isolate", "setup", "--user", ISO_USER, "--socket-dir", str(isolated.socket_dir))


def test_the_isolated_agent_cannot_type_into_the_operators_terminal(isolated: Isolated) -> None:
    """It gets the terminal as stdin but not as its controlling terminal: TIOCSTI
    (pushing keystrokes the operator's shell would read after the run) is refused."""
    b = isolated.b
    term = Terminal(
        [
            sys.executable, "-m", "bastion.cli", "--home", str(b.home.root),
            "run", "--isolated", "--",
            SYSTEM_PYTHON, "-c",
            "import fcntl, termios\n"
            "try:\n fcntl.ioctl(0, termios.TIOCSTI, b'x'); print('pushed')\n"
            "except OSError as e:\n print('refused', e.errno)",
        ]
    )  # fmt: skip
    try:
        term.expect("refused 1")  # EPERM
        assert term.proc.wait(30) == 0
    finally:
        term.close()


def test_run_keeps_detached_processes_in_its_tree_and_ends_them(bastion: Bastion) -> None:
    """`setsid -f` below `bastion run`: adopted by the run while it lives, ended with it --
    when the agent exits, and when the run is signalled."""
    script = "setsid -f sleep 301.5 </dev/null >/dev/null 2>&1; echo started; read line; exit 0"
    run = _cli(bastion, "run", "--label", "reaper", "--", "sh", "-c", script, stdin=subprocess.PIPE)
    assert run.stdout is not None and run.stdin is not None
    try:
        assert run.stdout.readline() == "started\n"
        wait_for(lambda: len(_processes("sleep", "301.5")) == 1)
        (sleeper,) = _processes("sleep", "301.5")
        wait_for(lambda: _below(sleeper, run.pid))  # adopted in the run, not by pid 1
        run.stdin.write("\n")
        run.stdin.close()
        assert run.wait(30) == 0
        assert not os.path.exists(f"/proc/{sleeper}"), "the detached sleep outlived the run"
    finally:
        _finish(run)

    script = "setsid -f sleep 303.5 </dev/null >/dev/null 2>&1; echo started; sleep 304.5"
    run = _cli(bastion, "run", "--", "sh", "-c", script)
    assert run.stdout is not None
    try:
        assert run.stdout.readline() == "started\n"
        wait_for(lambda: _processes("sleep", "303.5") and _processes("sleep", "304.5"))
        run.send_signal(signal.SIGTERM)
        assert run.wait(30) == 128 + signal.SIGTERM  # the child's status: killed by SIGTERM
        assert _processes("sleep", "303.5") == [] and _processes("sleep", "304.5") == []
    finally:
        _finish(run)


PAIR_A = """
set -e
cfg="$BASTION_SSH_CONFIG"
echo a-secret > /tmp/a-secret
echo a-home > "$HOME/a-file"
ssh -F "$cfg" -M -S {cp} -o ControlPersist=60 -N -f web1
ssh -F "$cfg" -S {cp} web1 'echo a-rides'
echo "$$" > {ready}
sleep 300
"""

PAIR_B = """
a={a_pid}
echo "proc: $(ls /proc | grep -c '^[0-9]')"
kill -0 "$a" 2>/dev/null && echo "signal: sent" || echo "signal: refused"
test -e "/proc/$a" && echo "see: yes" || echo "see: no"
cat /tmp/a-secret 2>/dev/null && echo "tmp: read" || echo "tmp: no"
echo b > /tmp/a-secret; echo b > "$HOME/a-file"
ssh -F "$BASTION_SSH_CONFIG" -S {cp} web1 'touch {marker}'
echo "ssh: $?"
"""


def test_two_isolated_runs_share_a_uid_not_a_view(isolated: Isolated, tmp_path: Path) -> None:
    """Runs A and B both as the agent user: B cannot see, signal or trace A, reach A's
    /tmp or HOME, or send through A's ControlMaster (its socket in a directory both may
    use); A's approval covers nothing B sends. The controls: root outside sees A and
    reads A's /tmp through /proc, and A's own client rides its master."""
    b = isolated.b
    shared = Path(tempfile.mkdtemp(prefix="pair", dir="/var/tmp/bt"))
    shared.chmod(0o1777)
    cp, ready, marker = shared / "cm", shared / "ready", shared / "b-ran"
    script_a = PAIR_A.format(cp=cp, ready=ready)
    given = ("--rw", str(shared))  # the directory both runs are given: a run writes only there
    run_a = _cli(b, "run", "--isolated", "--label", "pair-a", *given, "--", "sh", "-c", script_a)
    try:
        card = b.next_card()
        assert card["subject"]["pid"] == run_a.pid and card["subject"]["sandboxed"] is True
        b.answer(card, True)
        wait_for(lambda: ready.exists() and ready.read_text().strip(), timeout=60)
        assert run_a.stdout is not None and run_a.stdout.readline() == "a-rides\n"
        a_pid = int(ready.read_text())  # as A's namespace numbers it
        a_sh = next(p for p in _processes("sleep", "300") if _below(p, run_a.pid))
        # The controls, from outside: root sees A's shell and reads its private /tmp.
        assert Path(f"/proc/{a_sh}/root/tmp/a-secret").read_text() == "a-secret\n"
        script_b = PAIR_B.format(a_pid=a_sh, cp=cp, marker=marker)
        run_b = _cli(
            b, "run", "--isolated", "--label", "pair-b", *given, "--", "sh", "-c", script_b
        )
        out, err = run_b.communicate(timeout=120)
        lines = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)
        assert lines["see"] == "no" and lines["signal"] == "refused", out
        assert lines["tmp"] == "no", out  # B's /tmp is its own
        assert int(lines["proc"]) <= 6, out  # its own few: bwrap, sh, a subshell, ls, grep
        assert lines["ssh"] == "77" and "UNSUPPORTED_REQUEST" in err, (out, err)
        assert not marker.exists(), "B's command ran on A's approval"
        assert Path(f"/proc/{a_sh}/root/tmp/a-secret").read_text() == "a-secret\n"
        assert Path(f"/proc/{a_sh}/root/tmp/home/a-file").read_text() == "a-home\n"
        assert a_pid != a_sh  # A's own numbering is its namespace's
        assert [c["id"] for c in b.op("pending")] == []  # B asked nothing on A's behalf
    finally:
        _finish(run_a)
        shutil.rmtree(shared, ignore_errors=True)


def _registered_runs(b: Bastion) -> int:
    lines = b.cli("audit", "export").stdout.splitlines()
    return sum(1 for line in lines if json.loads(line).get("type") == "run_registered")


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _namespace_init(run: subprocess.Popen[str]) -> int:
    """bwrap's first process in the run's PID namespace (pid 1 there), seen from here."""
    import psutil

    for p in psutil.Process(run.pid).children(recursive=True):
        for line in Path(f"/proc/{p.pid}/status").read_text().splitlines():
            if line.startswith("NSpid:") and line.split()[1:][-1:] == ["1"]:
                return p.pid
    raise AssertionError("no namespace init below the run")


# The agent stops its own bwrap (pid 1 of the run's namespace) with ptrace, which a signal
# from inside cannot do to a namespace's init, and stays deaf to the signals that end a run.
PTRACE_STOP = """
import ctypes, signal, time
for n in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(n, signal.SIG_IGN)
libc = ctypes.CDLL(None, use_errno=True)
seized = libc.ptrace(0x4206, 1, 0, 0)  # PTRACE_SEIZE
stopped = libc.ptrace(0x4207, 1, 0, 0)  # PTRACE_INTERRUPT
print("traced", seized, stopped, ctypes.get_errno(), flush=True)
time.sleep(1006.5)
"""


def test_an_isolated_run_whose_bwrap_is_ptrace_stopped_still_ends(isolated: Isolated) -> None:
    b = isolated.b
    run = _cli(b, "run", "--isolated", "--", SYSTEM_PYTHON, "-c", PTRACE_STOP)
    assert run.stdout is not None
    try:
        assert run.stdout.readline() == "traced 0 0 0\n"
        init = _namespace_init(run)
        wait_for(lambda: _state(init) == "t", timeout=30)  # bwrap is in a tracing stop
        (agent,) = [p for p in _processes(SYSTEM_PYTHON, "-c", PTRACE_STOP) if _below(p, run.pid)]
        # The control: so held, the run does not end by itself.
        time.sleep(END_GRACE + 1)
        assert run.poll() is None and _state(init) == "t"
        sent = time.monotonic()
        run.send_signal(signal.SIGTERM)
        assert run.wait(END_GRACE + 15) == 128 + signal.SIGTERM
        assert time.monotonic() - sent >= END_GRACE - 0.5
        assert not os.path.exists(f"/proc/{init}") and not os.path.exists(f"/proc/{agent}")
    finally:
        _finish(run)


@pytest.fixture
def private_home(
    isolated: Isolated, sshd_server: Any, client_key: tuple[Path, str]
) -> Iterator[Bastion]:
    """A second bastion whose home is under a 0700 directory (the agent user cannot pass
    through it), its socket directory beside it, set up for the same agent user."""
    root = Path(tempfile.mkdtemp(prefix="bastion-iso-private-"))
    root.chmod(0o755)
    private = root / "private"
    private.mkdir(mode=0o700)
    b = make_bastion(private, sshd_server.info, client_key[0], start=False)
    try:
        b.cli("isolate", "setup", "--user", ISO_USER, "--socket-dir", str(root / "door"))
        b.start_daemon()
        b.unlock()
        yield b
    finally:
        b.close()
        shutil.rmtree(root, ignore_errors=True)


def test_run_isolated_works_with_the_home_under_a_0700_directory(private_home: Bastion) -> None:
    b = private_home
    assert b.home.root.parent.stat().st_mode & 0o777 == 0o700
    script = "ssh -F \"$BASTION_SSH_CONFIG\" web1 'echo via-private-home'"
    run = _cli(b, "run", "--isolated", "--label", "private", "--", "sh", "-c", script)
    try:
        card = b.next_card()
        assert card["subject"]["pid"] == run.pid, card
        b.answer(card, True)
        out, err = run.communicate(timeout=60)
        assert run.returncode == 0 and "via-private-home" in out.splitlines(), (out, err)
    finally:
        _finish(run)


def test_run_isolated_refuses_a_script_the_agent_user_cannot_reach(isolated: Isolated) -> None:
    b = isolated.b
    root = Path(tempfile.mkdtemp(prefix="bastion-iso-scripts-"))
    host_tmp = Path(tempfile.mkdtemp(prefix="bastion-iso-script-", dir="/tmp"))
    try:
        root.chmod(0o755)
        (root / "private").mkdir(mode=0o700)
        (root / "open").mkdir(mode=0o755)
        host_tmp.chmod(0o755)
        for d in (root / "private", root / "open", host_tmp):
            (d / "script.sh").write_text("echo script-ran\n")
            (d / "script.sh").chmod(0o644)
        before = _registered_runs(b)
        hidden = root / "private" / "script.sh"
        r = b.cli("run", "--isolated", "--", "bash", str(hidden), check=False)
        assert r.returncode == 127 and "script-ran" not in r.stdout, r
        assert f"refusing to start bash as {ISO_USER}: {ISO_USER} cannot reach {hidden}" in r.stderr
        assert f"it cannot pass through {root / 'private'} (drwx------ root:root)" in r.stderr
        r = b.cli("run", "--isolated", "--", "sh", str(host_tmp / "script.sh"), check=False)
        assert r.returncode == 127 and f"{host_tmp}/script.sh is in /tmp" in r.stderr, r
        r = b.cli("run", "--isolated", "--", "no-such-agent-program", check=False)
        assert r.returncode == 127 and "finds no program no-such-agent-program" in r.stderr, r
        assert _registered_runs(b) == before, "a refused run registered"
        # The control: the same script where the agent user can read it runs.
        r = b.cli("run", "--isolated", "--", "bash", str(root / "open" / "script.sh"))
        assert r.stdout == "script-ran\n", r
        assert _registered_runs(b) == before + 1
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(host_tmp, ignore_errors=True)
