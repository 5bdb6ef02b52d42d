"""A run's sandbox starts whole or not at all, and dies with `bastion run`.

- Where the kernel will not make the namespaces (turned off with the sysctl, in a
  throwaway user namespace of its own) or bwrap is missing, `bastion run` fails with the
  reason and the fix, registers nothing and starts nothing. The positive control runs
  the same command where the sandbox can be made.
- SIGKILL of `bastion run` leaves no process of the run: a marker process that would
  write after 2 s never writes, detached (setsid, double fork) or not. The control is
  `--no-sandbox`, whose tree outlives a SIGKILL (the limit its cards state).
- SIGTERM, SIGINT or SIGHUP to `bastion run` end every process of the run within
  END_GRACE and a margin, however deaf the agent is to them (`trap ''`, in a child, in a
  stopped child), sandboxed or not; it exits 128+N. The controls: without the signal the
  same agent keeps running; an agent that handles the signal gets it and ends itself; a
  terminal's Ctrl-C is passed on without ending the run.
- Nothing of a SIGKILLed run is left in the temporary directory: the throwaway ssh
  agent's directory, there while the run lives, is gone a moment after it dies.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from bastion.cli.run import END_GRACE
from tests.harness import Bastion, Terminal, cli_argv, wait_for

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")

NAMESPACE_SWITCHES = ("user.max_user_namespaces", "user.max_pid_namespaces")


def _registered_runs(b: Bastion) -> int:
    lines = b.cli("audit", "export").stdout.splitlines()
    return sum(1 for line in lines if json.loads(line).get("type") == "run_registered")


def given(tmp_path: Path) -> Path:
    """A directory of the test's that a run is given (`--rw`): a run writes only there."""
    d = tmp_path / "given"
    d.mkdir(exist_ok=True)
    return d


def _in_throwaway_namespace(
    b: Bastion, marker: Path, turn_off: bool
) -> subprocess.CompletedProcess:
    """`bastion run -- touch MARKER` in a user namespace of its own, where the namespace
    limits can be set to 0 without touching the machine's."""
    off = "".join(f"echo 0 > /proc/sys/{n.replace('.', '/')}; " for n in NAMESPACE_SWITCHES)
    # --private-home: what is tried is the namespaces' message, not the home's overlay
    # (a home with mounts below it, as a running container's, cannot be overlaid in a
    # user namespace: `sandbox.prepare` says so, tested in test_run_writes.py).
    argv = ("run", "--label", "nons", "--private-home", "--rw", str(marker.parent), "--")
    argv += ("touch", str(marker))
    run = " ".join(cli_argv(b.home.root, *argv))
    script = (off if turn_off else "") + "exec " + run
    return subprocess.run(
        ["unshare", "--user", "--map-root-user", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.skipif(shutil.which("unshare") is None, reason="util-linux unshare is missing")
def test_without_namespaces_nothing_starts_and_the_message_says_the_fix(
    bastion: Bastion, tmp_path: Path
) -> None:
    before = _registered_runs(bastion)
    control = given(tmp_path) / "control"
    r = _in_throwaway_namespace(bastion, control, turn_off=False)
    assert r.returncode == 0 and control.exists(), r.stderr  # the sandbox can be made here
    assert _registered_runs(bastion) == before + 1

    marker = given(tmp_path) / "marker"
    r = _in_throwaway_namespace(bastion, marker, turn_off=True)
    assert r.returncode != 0
    assert "cannot sandbox the agent" in r.stderr and "namespaces are turned off" in r.stderr
    assert "sudo sysctl -w user.max_" in r.stderr and "Nothing was started" in r.stderr
    assert not marker.exists()
    assert _registered_runs(bastion) == before + 1  # nothing registered either


def test_without_bubblewrap_nothing_starts(bastion: Bastion, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    r = subprocess.run(
        cli_argv(bastion.home.root, "run", "--", "/usr/bin/touch", str(marker)),
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PATH": str(tmp_path)},
    )
    assert r.returncode != 0 and not marker.exists()
    assert "bubblewrap (bwrap) is not installed" in r.stderr
    assert "apt install bubblewrap" in r.stderr and "--no-sandbox" in r.stderr


def _namespace_members(ns: str) -> list[int]:
    """Processes (seen from here) whose PID namespace is `ns`."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/ns/pid") == ns:
                    out.append(int(entry))
            except OSError:
                continue
    return out


def _start_marked(b: Bastion, tmp_path: Path, *flags: str) -> tuple[subprocess.Popen, Path]:
    """A run whose agent detaches two marker processes (setsid, and a double fork),
    each of which would write after 2 s, then waits."""
    marker = given(tmp_path) / "late"
    ready = given(tmp_path) / "ready"
    script = (
        f"setsid sh -c 'sleep 2; echo setsid >> {marker}' & "
        f"( sh -c 'sleep 2; echo forked >> {marker}' & ) ; "
        f"echo $$ > {ready}; sleep 60"
    )
    rw = () if "--no-sandbox" in flags else ("--rw", str(given(tmp_path)))
    run = subprocess.Popen(
        cli_argv(b.home.root, "run", *flags, *rw, "--", "sh", "-c", script),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    wait_for(lambda: ready.exists() and ready.read_text().strip(), timeout=30)
    return run, marker


def test_sigkill_of_bastion_run_leaves_no_process_of_the_run(
    bastion: Bastion, tmp_path: Path
) -> None:
    run, marker = _start_marked(bastion, tmp_path)

    def sleeper() -> int | None:  # `sleep 60` starts just after the ready file is written
        kids = psutil.Process(run.pid).children(recursive=True)
        return next((p.pid for p in kids if p.name() == "sleep"), None)

    wait_for(sleeper, timeout=30)
    inner = sleeper()
    assert inner is not None
    ns = os.readlink(f"/proc/{inner}/ns/pid")
    assert ns != os.readlink("/proc/self/ns/pid")
    assert len(_namespace_members(ns)) >= 4  # bwrap's first process, sh, two markers, sleep
    run.send_signal(signal.SIGKILL)
    run.wait(timeout=30)
    wait_for(lambda: not _namespace_members(ns), timeout=30)
    time.sleep(3)  # past the markers' 2 s: they must not have written (nothing to wait on)
    assert not marker.exists()


def test_without_the_sandbox_a_sigkill_lets_the_tree_outlive_the_run(
    bastion: Bastion, tmp_path: Path
) -> None:
    """The control: the same agent under `--no-sandbox` outlives a SIGKILL of its run."""
    run, marker = _start_marked(bastion, tmp_path, "--no-sandbox")
    run.send_signal(signal.SIGKILL)
    run.wait(timeout=30)
    wait_for(lambda: marker.exists() and marker.read_text().count("\n") == 2, timeout=30)
    subprocess.run(["pkill", "-f", str(given(tmp_path) / "ready")], check=False)


def _ns_pid(pid: int) -> str:
    """The pid as the innermost PID namespace of `pid` numbers it ("" when gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return line.split()[-1]
    except OSError:
        pass
    return ""


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_a_terminals_ctrl_z_and_ctrl_c_reach_the_run(bastion: Bastion, tmp_path: Path) -> None:
    """The run has a session of its own (so no TIOCSTI into the operator's terminal), so
    the terminal's job control signals reach `bastion run` alone: Ctrl-Z stops the run
    with it and `fg` resumes both; Ctrl-C ends the agent."""
    ready = given(tmp_path) / "ready"
    script = f"echo $$ > {ready}; exec sleep 300"
    run = shlex.join(
        cli_argv(bastion.home.root, "run", "--rw", str(ready.parent), "--", "sh", "-c", script)
    )
    term = Terminal(["setsid", "--ctty", "bash", "--norc", "--noprofile", "-i"])
    try:
        term.type(f"PS1='$ '; {run}\n")
        wait_for(lambda: ready.exists() and ready.read_text().strip(), timeout=30)
        inner = ready.read_text().strip()  # its pid as the run's PID namespace numbers it
        sleeper = next(
            p.pid
            for p in psutil.process_iter(["name", "cmdline"])
            if p.info["cmdline"] == ["sleep", "300"] and _ns_pid(p.pid) == inner
        )  # this run's, not another test's `sleep 300`
        term.type("\x1a")  # Ctrl-Z
        wait_for(lambda: _state(sleeper) == "T", timeout=30)
        term.expect("Stopped")
        term.type("fg\n")
        wait_for(lambda: _state(sleeper) in ("S", "R"), timeout=30)
        term.type("\x03")  # Ctrl-C
        wait_for(lambda: not psutil.pid_exists(sleeper), timeout=30)
        term.type("echo rc=$?\n")
        term.expect("rc=130")
    finally:
        term.close()


# An agent deaf to the signals that end a run: itself, a child, and a child that stopped
# itself (ignored signals are inherited across fork and exec). Each is found from the host
# by its exact command line. It says "ready" on stdout: a default run writes no file here.
DEAF = (
    "trap '' TERM INT HUP; sleep 1001.5 & sh -c 'kill -STOP $$; exec sleep 1002.5' & "
    "echo ready; exec sleep 1003.5"
)
DEAF_PROCESSES = (
    ("sleep", "1001.5"),
    ("sh", "-c", "kill -STOP $$; exec sleep 1002.5"),
    ("sleep", "1003.5"),
)
MARGIN = 15.0  # seconds on top of END_GRACE: a loaded 2-core machine


def _processes(*argv: str) -> list[int]:
    """Pids whose command line is exactly argv (read from /proc)."""
    want = ("\0".join(argv) + "\0").encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if Path(f"/proc/{entry}/cmdline").read_bytes() == want:
                    found.append(int(entry))
            except OSError:
                continue
    return found


def _start_deaf(b: Bastion, *flags: str) -> tuple[subprocess.Popen[str], dict[str, int]]:
    """A run of DEAF, once each of its processes is there (the stopped one stopped)."""
    run = subprocess.Popen(
        cli_argv(b.home.root, "run", *flags, "--", "sh", "-c", DEAF),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,  # nothing of the run in pytest's process group
    )
    assert run.stdout is not None and run.stdout.readline() == "ready\n"
    found: dict[str, int] = {}

    def all_there() -> bool:
        for argv in DEAF_PROCESSES:
            pids = _processes(*argv)
            if len(pids) != 1:
                return False
            found[argv[-1]] = pids[0]
        return _state(found[DEAF_PROCESSES[1][-1]]) == "T"

    wait_for(all_there, timeout=30)
    return run, found


def _end_deaf(run: subprocess.Popen[str], found: dict[str, int]) -> None:
    """Cleanup, whatever the test left: the run and (unsandboxed) its processes."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(run.pid, signal.SIGKILL)
    run.wait(30)
    for pid in found.values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert run.stdout is not None
    run.stdout.close()


@pytest.mark.parametrize("flags", [(), ("--no-sandbox",)], ids=["sandboxed", "unsandboxed"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=str)
def test_a_run_told_to_end_ends_every_process_within_the_grace(
    bastion: Bastion, sig: signal.Signals, flags: tuple[str, ...]
) -> None:
    run, found = _start_deaf(bastion, *flags)
    try:
        agent = found["1003.5"]
        ns = os.readlink(f"/proc/{agent}/ns/pid")
        assert (ns != os.readlink("/proc/self/ns/pid")) == (not flags)
        sent = time.monotonic()
        run.send_signal(sig)
        assert run.wait(END_GRACE + MARGIN) == 128 + sig
        took = time.monotonic() - sent
        assert took >= END_GRACE - 0.5, took  # the signal was passed on, and waited for
        for argv in DEAF_PROCESSES:
            assert _processes(*argv) == [], f"{argv} outlived the run"
        if not flags:
            assert _namespace_members(ns) == []
    finally:
        _end_deaf(run, found)


def test_without_a_signal_the_deaf_agent_keeps_running(bastion: Bastion) -> None:
    """The control: the same agent, not told to end, is still there past the grace."""
    run, found = _start_deaf(bastion)
    try:
        time.sleep(END_GRACE + 1)
        assert run.poll() is None
        assert all(_processes(*argv) for argv in DEAF_PROCESSES)
    finally:
        _end_deaf(run, found)


def test_an_agent_that_handles_the_signal_gets_it_first(bastion: Bastion) -> None:
    """The first signal is passed on: an agent that handles SIGINT ends cleanly, at once."""
    script = "trap 'echo graceful; exit 0' INT; echo ready; while :; do sleep 0.1; done"
    run = subprocess.Popen(
        cli_argv(bastion.home.root, "run", "--", "sh", "-c", script),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        assert run.stdout is not None and run.stdout.readline() == "ready\n"
        sent = time.monotonic()
        run.send_signal(signal.SIGINT)
        assert run.wait(END_GRACE + MARGIN) == 128 + signal.SIGINT
        assert time.monotonic() - sent < END_GRACE
        assert run.stdout.read() == "graceful\n"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(run.pid, signal.SIGKILL)
        run.wait(30)
        assert run.stdout is not None
        run.stdout.close()


def test_a_terminals_ctrl_c_is_passed_on_and_does_not_end_the_run(
    bastion: Bastion, tmp_path: Path
) -> None:
    """An interactive agent takes Ctrl-C as "stop what you are doing": bastion run passes
    it on and keeps the run, past the grace; SIGTERM then ends it."""
    # What it prints is computed, so that the screen's echo of the command is not it.
    script = "trap 'echo caught-$((1+1))' INT; echo ready-$((40+2)); while :; do sleep 0.1; done"
    run = shlex.join(cli_argv(bastion.home.root, "run", "--", "sh", "-c", script))
    term = Terminal(["setsid", "--ctty", "bash", "--norc", "--noprofile", "-i"])
    try:
        term.type(f"PS1='$ '; {run}\n")
        term.expect("ready-42")
        (supervisor,) = [
            p.pid
            for p in psutil.process_iter(["cmdline"])
            if (p.info["cmdline"] or [])[-1:] == [script] and "bastion.cli" in p.info["cmdline"]
        ]
        term.type("\x03")  # Ctrl-C
        term.expect("caught-2")
        time.sleep(END_GRACE + 1)
        assert psutil.Process(supervisor).status() != psutil.STATUS_ZOMBIE
        os.kill(supervisor, signal.SIGTERM)
        term.type("echo rc=$?\n")
        term.expect(f"rc={128 + signal.SIGTERM}", timeout=END_GRACE + MARGIN)
    finally:
        term.close()


def _agent_directory(run: subprocess.Popen[str]) -> Path:
    """The host directory of the run's throwaway ssh agent, read from bwrap's command
    line (`--ro-bind DIR /tmp/.bastion-ssh-agent`)."""
    from bastion.sandbox.run_agent import INSIDE

    for p in psutil.Process(run.pid).children():
        argv = p.cmdline()
        for i, word in enumerate(argv[:-2]):
            if word == "--ro-bind" and argv[i + 2] == str(INSIDE):
                return Path(argv[i + 1])
    raise AssertionError("no throwaway agent bound into the run")


def test_a_sigkilled_run_leaves_nothing_in_the_temporary_directory(bastion: Bastion) -> None:
    run = subprocess.Popen(
        cli_argv(bastion.home.root, "run", "--", "sh", "-c", "echo ready; exec sleep 1005.5"),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert run.stdout is not None and run.stdout.readline() == "ready\n"
        directory = _agent_directory(run)
        # The control: the run has it while it lives, in the temporary directory.
        assert directory.parent == Path(tempfile.gettempdir())
        assert (directory / "agent.sock").exists()
        run.send_signal(signal.SIGKILL)
        run.wait(30)
        wait_for(lambda: not directory.exists(), timeout=10)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(run.pid, signal.SIGKILL)
        run.wait(30)
        assert run.stdout is not None
        run.stdout.close()
