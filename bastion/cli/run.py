"""`bastion run`: start an agent as a registered run, in a sandbox of its own.

The order is the promise: first the sandbox is checked (`sandbox.prepare`: the
tools are there, the kernel lets it make namespaces, the home overlay and the
network namespace), then this process registers itself as the run, naming what
the run was given (its project, each `--rw` ...), then CMD starts under
bubblewrap on the run's layer, and the run's network is given it before CMD
runs. Where the sandbox cannot be made, nothing registers and nothing starts;
`--no-sandbox` is the explicit way round, and its cards say so.

This process stays outside the sandbox, as its supervisor. SIGTERM, SIGHUP or a
SIGINT sent by a process is passed on to every process of the run, and after
END_GRACE whatever is left is killed (stopped and traced processes too); a
terminal's Ctrl-C is passed on and nothing more. When CMD exits it ends
whatever is left, and says what the run did to its project's git directory that
git would run code from (`sandbox.git_after_run`). If it is killed itself
(SIGKILL included), the kernel ends the sandbox: bwrap's `--die-with-parent`
kills the namespace's first process, and with it every process in the namespace.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from bastion import sandbox as sandbox_mod
from bastion.agent import proxy as proxy_mod
from bastion.agent import wire
from bastion.cli.agents import refresh_agent_files
from bastion.cli.common import fail, home_of
from bastion.home import Home
from bastion.sandbox.run_agent import ThrowawayAgent

if TYPE_CHECKING:
    from bastion.sandbox.isolation import Isolation

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
TERM_GRACE = 2.0  # seconds the rest of the tree has between SIGTERM and SIGKILL
KILL_PATIENCE = 10.0  # then give up on what will not die (uninterruptible sleep) and say so
ISOLATED_HOME = Path("/tmp/home")  # an isolated agent's HOME: in the run's own /tmp
GIVEN_WORDS, GIVEN_WORD = 16, 200  # what a registration may say it was given (the header's 4 KiB)
NESTED = "1"  # the run's SHLVL where it had none: see `nested`
KEPT_LABEL = re.compile(r"[A-Za-z0-9._-]{1,64}")  # a --keep-home label: its directory's name


def _prctl(option: int, arg: int) -> bool:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    args = (ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
    return bool(libc.prctl(ctypes.c_int(option), *args) == 0)


def _register(path: Path, label: str, given: list[str] | None) -> str:
    """Name this very process to the gateway as a run; the gateway reads who it is.
    `given`: what the sandbox was given beyond the defaults, or None: no sandbox.

    First it starts a thread that lives as long as the run: an exec of this process
    would end it, and the gateway can see that it lives where it may not read this
    process's memory (`run --isolated` runs as root, the gateway need not), so the
    run keeps its approval without being asked again (docs/architecture.md, "Who is
    asking")."""
    import socket
    import threading

    threading.Thread(target=threading.Event().wait, name="exec-witness", daemon=True).start()

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
        box = None if given is None else {"given": given}
        header = json.dumps({"register": "run", "label": label, "sandbox": box}).encode()
        sock.sendall(wire.PROTOCOL + header + b"\n")
        reply = proxy_mod.read_reply(sock).decode("utf-8", "replace").strip()
    except OSError as exc:
        fail(f"cannot reach the gateway at {path} ({exc.strerror}); is `bastion daemon` running?")
    finally:
        sock.close()
    if not reply.startswith("OK "):
        fail(f"the gateway refused to register the run: {reply or 'no reply'}")
    return reply[3:]


END_GRACE = 5.0  # seconds a run told to end has, after the signal is passed on, before SIGKILL
SI_KERNEL = 0x80  # siginfo's si_code for a signal the kernel sent: a terminal's Ctrl-C
WAKE = 10.0  # seconds the supervisor waits for a signal at most (SIGCHLD wakes it first)


def _reap(watch: int | None = None) -> int | None:
    """Collect every child that has exited (orphans of the tree are ours); the wait
    status of `watch`, if it was among them."""
    got = None
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return got
        if pid == 0:
            return got
        if pid == watch:
            got = status


def _end_tree(grace: float = TERM_GRACE, killed: frozenset[int] = frozenset()) -> None:
    """SIGTERM (and SIGCONT, so that a stopped process can act on it), then SIGKILL
    after `grace`, whatever is left below this process (the subreaper: detached
    processes were reparented here), and reap it. `killed`: processes already sent
    SIGKILL, not waited for (slirp4netns takes some 20 ms to die, tearing its tap
    device down: its zombie is reaped by whoever inherits it)."""
    import signal
    import time

    import psutil

    me = psutil.Process()
    termed: set[psutil.Process] = set()
    start = time.monotonic()
    while True:
        _reap()
        try:
            left = [p for p in me.children(recursive=True) if p.pid not in killed]
        except psutil.Error:
            left = []
        if not left:
            return
        waited = time.monotonic() - start
        if waited > grace + KILL_PATIENCE:
            pids = " ".join(str(p.pid) for p in left)
            click.echo(f"bastion: processes of the run would not die: {pids}", err=True)
            return
        if waited > grace:
            _kill([p.pid for p in left])
        for p in left:
            if p not in termed and waited <= grace:
                for n in (signal.SIGTERM, signal.SIGCONT):
                    with contextlib.suppress(psutil.Error):
                        p.send_signal(n)
                termed.add(p)
        time.sleep(0.02)


def _namespace_init(pid: int) -> bool:
    """Is `pid` the first process of a PID namespace below this process's (bwrap's
    namespace init: when it dies, the kernel kills every process of its namespace)?"""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    for line in status.splitlines():
        if line.startswith("NSpid:"):
            ids = line.split()[1:]
            return len(ids) > 1 and ids[-1] == "1"
    return False


def _kill(pids: list[int]) -> None:
    """SIGKILL these processes, the first process of each PID namespace among them
    first: the kernel then kills the rest of its namespace with it, stopped and traced
    processes too, and none of them can fork any more."""
    import signal

    for pid in sorted(pids, key=lambda p: not _namespace_init(p)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _kill_run() -> None:
    """SIGKILL every process of the run now: all below this process (bwrap, whatever
    is in its PID namespace, the run's slirp4netns; under --no-sandbox the whole tree,
    which this process is the subreaper of)."""
    import psutil

    try:
        tree = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    _kill([p.pid for p in tree])


def _sandboxed(pid: int) -> list[int]:
    """The processes of the run below bwrap (its namespace's first process is bwrap's
    own): where a signal meant for the agent goes, as a terminal would send it."""
    import psutil

    with contextlib.suppress(psutil.Error):
        tree = psutil.Process(pid).children(recursive=True)
        return [p.pid for p in tree if p.name() != sandbox_mod.BWRAP]
    return []


def _run_signals(sandboxed: bool) -> set[int]:
    """The signals `_supervise` waits for itself (SIGTSTP only for a sandbox, whose
    run has a session of its own: unsandboxed, Ctrl-Z stops the run's group as usual)."""
    import signal

    waited = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGWINCH, signal.SIGCHLD}
    return waited | ({signal.SIGTSTP} if sandboxed else set())


def _hold_signals(sandboxed: bool) -> None:
    """Block the run's signals in this thread before any thread of the run is started
    (every thread inherits its creator's mask), so that each one waits, pending, for
    `_supervise`'s sigtimedwait, with what sent it (a terminal, or a process), and none
    is taken by another thread. The throwaway agent's threads, started earlier, block
    every signal themselves (`run_agent.py`)."""
    import signal

    signal.pthread_sigmask(signal.SIG_BLOCK, _run_signals(sandboxed))


def _supervise(
    argv: list[str], sandboxed: bool, started: Callable[[int], Any] | None = None, **popen: Any
) -> int:
    """Run argv as this process's child; return its exit code (128+N for signal N).
    `started(pid)`: called once the child runs (the sandbox's network, `Sandbox.started`);
    what it returns is closed when the run ends; if it raises, the child is killed.

    This process is the child subreaper of the tree, so whatever the agent detaches
    (double fork, setsid) stays below it; when the child exits, the rest of the tree is
    ended and reaped: nothing the agent started outlives the registered run. It takes
    the run's signals itself (`_hold_signals`; sigtimedwait), and reads who sent each:

    - SIGTERM, SIGHUP, and a SIGINT a process sent (`kill -INT`) end the run: the signal
      is passed on to every process of the run (then SIGCONT, so that a stopped one can
      act on it: an agent that handles it may end cleanly), and END_GRACE later whatever
      is left is SIGKILLed (`_kill_run`), stopped and traced processes and a stopped
      bwrap included. `bastion run` then exits 128+N, as a shell reports a job that
      signal N ended. A signal that comes before CMD has started ends the run there.
    - a terminal's Ctrl-C (a SIGINT the kernel sent) is passed on and nothing more, as
      a shell passes it to its foreground job: an interactive agent takes it as "stop
      what you are doing", not as the end of the run. (Unsandboxed, the agent is in the
      terminal's foreground group already and has it from the terminal itself.)
    - SIGWINCH is passed on; in a sandbox, a terminal's Ctrl-Z stops the run with this
      process, and `fg` resumes both."""
    import signal
    import subprocess
    import time

    waited = _run_signals(sandboxed)
    ending = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    told = signal.sigpending() & set(ending)
    if told:
        info = signal.sigtimedwait(told, 0)
        if info is not None:
            name = signal.Signals(info.si_signo).name
            click.echo(f"bastion: {name} before {argv[0]} started: nothing started", err=True)
            return 128 + info.si_signo
    if not _prctl(PR_SET_CHILD_SUBREAPER, 1):
        click.echo("bastion: cannot adopt the agent's detached processes (prctl)", err=True)
    inner = popen.pop("preexec_fn", None)

    def preexec() -> None:  # the agent gets the signal mask this process started with
        signal.pthread_sigmask(signal.SIG_UNBLOCK, waited)
        if inner is not None:
            inner()

    try:
        child = subprocess.Popen(argv, preexec_fn=preexec, **popen)
    except (OSError, subprocess.SubprocessError) as exc:
        fail(f"cannot start {argv[0]}: {getattr(exc, 'strerror', None) or exc}", 127)
    held = None
    if started is not None:
        # What it starts (slirp4netns) gets the usual mask too; a signal meanwhile ends
        # this process as it would any (CMD waits for `started` to let it go).
        int_handler = signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, waited)
        try:
            held = started(child.pid)
        except OSError as exc:
            child.kill()
            child.wait()
            _end_tree()
            fail(f"cannot sandbox the agent: {exc.strerror or exc}. Nothing was started.", 127)
        finally:
            signal.pthread_sigmask(signal.SIG_BLOCK, waited)
            signal.signal(signal.SIGINT, int_handler)
    status: int | None = None

    def send(n: int, everyone: bool = False) -> None:
        if status is not None:  # until then the pid is the child's (alive or a zombie)
            return
        if sandboxed:
            pids = _sandboxed(child.pid) or [child.pid]
        elif everyone:
            pids = list(dict.fromkeys([child.pid, *_tree()]))
        else:
            pids = [child.pid]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, n)

    told_by: int | None = None  # the signal that ends the run
    deadline = killed = 0.0
    while True:
        status = _reap(child.pid)
        if status is not None:
            break
        now = time.monotonic()
        timeout: float | None = None
        if told_by is not None:
            if now >= deadline:
                killed = killed or now
                if now - killed > KILL_PATIENCE:
                    click.echo(f"bastion: the run's bwrap ({child.pid}) would not die", err=True)
                    break
                _kill_run()
                timeout = 0.05
            else:
                timeout = deadline - now
        info = signal.sigtimedwait(waited, WAKE if timeout is None else timeout)
        if info is None or info.si_signo == signal.SIGCHLD:
            continue
        n = info.si_signo
        if n == signal.SIGWINCH:
            send(n)
        elif n == signal.SIGTSTP:
            # Ctrl-Z reaches this process only (the run has a session of its own): stop the
            # run with it, so it does not read the terminal while the shell does; fg goes on.
            send(signal.SIGSTOP)
            os.kill(os.getpid(), signal.SIGSTOP)
            send(signal.SIGCONT)
        elif n == signal.SIGINT and info.si_code == SI_KERNEL and told_by is None:
            if sandboxed or not _in_my_group(child.pid):
                send(n)
        else:
            send(n, everyone=True)
            send(signal.SIGCONT, everyone=True)
            if told_by is None:
                told_by, deadline = n, time.monotonic() + END_GRACE
    if status is not None:
        child.returncode = os.waitstatus_to_exitcode(status)
    killed: frozenset[int] = frozenset()
    if held is not None:
        killed = frozenset({held.close()})
    _end_tree(TERM_GRACE if told_by is None else max(0.0, deadline - time.monotonic()), killed)
    if told_by is not None:
        return 128 + told_by
    code = child.returncode or 0
    return code if code >= 0 else 128 - code


def _tree() -> list[int]:
    """Every process below this one (an unsandboxed run's tree: it is their subreaper)."""
    import psutil

    with contextlib.suppress(psutil.Error):
        return [p.pid for p in psutil.Process().children(recursive=True)]
    return []


def _in_my_group(pid: int) -> bool:
    """Is `pid` in this process's group (where a terminal's signal reached it too)?"""
    try:
        return os.getpgid(pid) == os.getpgrp()
    except OSError:
        return False


def nested(env: Mapping[str, str]) -> dict[str, str]:
    """The run's environment with SHLVL at least 1, so ssh's ProxyCommand skips ~/.bashrc.

    ssh runs the ProxyCommand as `$SHELL -c "exec ..."` with a socket on its stdin
    (ProxyUseFdpass); Debian's bash then reads ~/.bashrc first, as if sshd had started it,
    unless SHLVL says it is nested (SHLVL >= 1 before bash adds its own 1). An agent that
    runs ssh straight from a program started without a shell (SHLVL unset, or 0 as
    `bash -c` leaves it) paid its whole rc on every call, which direct ssh never does.
    Clearing SSH_CLIENT is not enough (the socket alone makes bash read it), and
    SHELL=/bin/sh would change the shell the agent's own tools pick. SHLVL >= 1 is what
    a shell-started agent has already; bash treats a value that is not a number as 0."""
    try:
        level = int(env.get("SHLVL", "0"))
    except ValueError:
        level = 0
    return dict(env) if level >= 1 else {**env, "SHLVL": NESTED}


def agent_env(iso: Isolation, home_dir: Path) -> dict[str, str]:
    """The isolated agent's whole environment: nothing of the operator's."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "HOME": str(home_dir),
        "USER": iso.user,
        "LOGNAME": iso.user,
        "BASTION_SSH_CONFIG": str(iso.ssh_config),
    }


def _isolation(home: Home) -> Isolation:
    """Everything `run --isolated` needs before it registers: the record, root,
    fresh agent files, the checks as the agent user."""
    import grp
    import pwd

    from bastion.sandbox import isolation

    try:
        iso = isolation.load(home)
    except isolation.IsolationError as exc:
        fail(str(exc))
    if iso is None:
        fail(
            f"no isolation is set up for {home.root}: run `sudo bastion --home {home.root} "
            "isolate setup` first"
        )
    if os.geteuid() != 0:
        fail(
            f"`run --isolated` starts the agent as {iso.user} and needs root: "
            f"sudo bastion --home {home.root} run --isolated -- CMD..."
        )
    try:
        same = (
            pwd.getpwnam(iso.user).pw_uid == iso.uid and grp.getgrnam(iso.group).gr_gid == iso.gid
        )
    except KeyError:
        same = False
    if not same or not iso.socket_dir.is_dir():
        fail(
            f"{iso.user}:{iso.group} or {iso.socket_dir} changed or is gone (/run is emptied at "
            f"boot): run `sudo bastion --home {home.root} isolate setup` again"
        )
    try:
        warning = refresh_agent_files(home, iso)
        failed = [c for c in isolation.probe(home, iso) if not c.ok]
    except (OSError, isolation.IsolationError) as exc:
        fail(f"cannot prepare the agent's files in {iso.socket_dir}: {exc}")
    if warning:
        click.echo(f"bastion: {warning}", err=True)
    if failed:
        fail(
            f"refusing to start the agent as {iso.user}: "
            + "; ".join(c.detail for c in failed)
            + "; see `bastion isolate check`"
        )
    return iso


def _isolated_box(
    box: sandbox_mod.Sandbox, iso: Isolation, command: tuple[str, ...]
) -> sandbox_mod.Sandbox:
    """The isolated run's sandbox as its bwrap (running as the agent user) can make it,
    or fail, before anything registers, with why the agent user could not start CMD."""
    import dataclasses

    from bastion.sandbox import isolation

    try:
        why = isolation.command_refusal(iso, command, box.env.get("PATH", ""))
        argv = isolation.reachable_plan(box.argv, iso)
    except (OSError, isolation.IsolationError) as exc:
        fail(f"cannot check what {iso.user} can reach: {exc}. Nothing was started.")
    if why is not None:
        fail(f"refusing to start {command[0]} as {iso.user}: {why}. Nothing was started.", 127)
    return dataclasses.replace(box, argv=tuple(argv))


def _isolated_harden() -> None:
    """In the isolated agent's bwrap, after the switch to its uid: SIGKILL if the run
    dies first (bwrap's --die-with-parent does the same one level down)."""
    _prctl(PR_SET_PDEATHSIG, 9)


def _prepare(
    home: Home,
    agent_socket: Path,
    given: sandbox_mod.Given,
    iso: Isolation | None,
    keys: ThrowawayAgent | None = None,
    label: str = "",
) -> tuple[sandbox_mod.Sandbox, Path | None, str]:
    """The run's sandbox, its project (None: none given), and a note for the operator
    once the run starts (why it has no project), or fail with the reason and the fix:
    nothing has started. `keys`: the run's
    throwaway ssh agent, offered inside as SSH_AUTH_SOCK."""
    import dataclasses

    note = ""
    door: Path | None = None
    if iso is None:
        layout = sandbox_mod.layout_of(home.root, agent_socket, os.environ)
        project = sandbox_mod.project_of(layout.cwd)
        why = sandbox_mod.door_refusal(project, layout)
        if why is not None and project != layout.cwd:
            project, why = layout.cwd, sandbox_mod.door_refusal(layout.cwd, layout)
        if why is None:
            layout = dataclasses.replace(layout, project=project)
            door = project
        else:
            note = (
                f"bastion: the run's writes stay in its own home overlay: no project is "
                f"given, since {why}. Start the run in the project's directory, or give "
                "--rw DIR."
            )
        if given.keep_home:
            layout = dataclasses.replace(layout, kept=_kept_home(label))
        env: dict[str, str] = nested(os.environ)
        where: dict[str, Any] = {}
    else:
        # The agent user's own view: its HOME is a directory in the run's private /tmp
        # (no other run, and no other agent of that uid, can reach it).
        layout = sandbox_mod.Layout(
            bastion_home=home.root.absolute(),
            agent_dir=iso.socket_dir,
            home=ISOLATED_HOME,
            runtime_dir=None,
            cwd=ISOLATED_HOME,
            overlay=False,
        )
        env = agent_env(iso, ISOLATED_HOME)
        where = {"chdir": ISOLATED_HOME, "make_dir": True, "user": (iso.uid, iso.gid)}
    if keys is not None:
        where["agent_auth"] = (keys.directory, keys.inside.parent)
    try:
        return sandbox_mod.prepare(layout, env, given, **where), door, note
    except sandbox_mod.Unavailable as exc:
        fail(f"cannot sandbox the agent: {exc.reason}. Fix: {exc.fix}. Nothing was started.")
    except ValueError as exc:
        fail(f"cannot sandbox the agent: {exc}")


def _kept_home(label: str) -> Path:
    """The label's kept home overlay, made if new (`layer.kept_home`)."""
    from bastion.sandbox import layer

    if not KEPT_LABEL.fullmatch(label) or label in (".", ".."):
        fail(
            f"--keep-home names its directory after the label: {label!r} must be 1-64 "
            "letters, digits, '.', '_' or '-'"
        )
    path = layer.kept_home(os.geteuid(), label)
    try:
        layer.make_kept(path)
    except OSError as exc:
        fail(f"cannot keep the run's home in {path}: {exc.strerror or exc}")
    return path


def _paths(flag: str, help: str) -> Callable[[Any], Any]:
    """A repeatable path option of the sandbox's (`--hide`, `--ro`, `--rw`, `--expose`)."""
    return click.option(flag, flag[2:], multiple=True, type=click.Path(path_type=Path), help=help)


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--label", default="", help="Shown on the operator's cards.")
@click.option("--agent-socket", type=click.Path(path_type=Path), default=None)
@_paths(
    "--hide",
    "Hide one more path from the run (an empty directory, or /dev/null for a file). "
    "Repeatable; shown on the run's cards.",
)
@_paths(
    "--ro",
    "Give the run this path read-only (also one the defaults hide). Repeatable; shown "
    "on the run's cards.",
)
@click.option(
    "--private-home",
    is_flag=True,
    help="An empty HOME of the run's own instead of the overlay (the project stays). "
    "Shown on the run's cards.",
)
@_paths(
    "--rw",
    "Give the run this path read-write, as it is on the disk (besides the project). "
    "Not the home, its start-up files, the bastion home or bastion itself. Repeatable; "
    "shown on the run's cards.",
)
@_paths(
    "--expose",
    "Give the run back, read-only, a path the sandbox hides (a browser profile, a "
    "CLI's credentials, a key). Repeatable; shown on the run's cards.",
)
@click.option(
    "--rw-git",
    is_flag=True,
    help="Let the run change the project's .git/config, hooks and the other files git "
    "runs code from (read-only by default). Shown on the run's cards.",
)
@click.option(
    "--share-net",
    is_flag=True,
    help="Give the run the host's network, loopback included (the console, local "
    "services), instead of its own. Shown on the run's cards.",
)
@click.option(
    "--keep-home",
    is_flag=True,
    help="Keep the run's home overlay for the next run of the same --label (in "
    "/var/tmp/bastion-UID/homes/LABEL, outside the home). Shown on the run's cards.",
)
@click.option(
    "--no-sandbox",
    is_flag=True,
    help="Start CMD without a sandbox: it can reach everything your user can (the operator's "
    'tmux, terminal, session bus). Its cards say "not sandboxed".',
)
@click.option(
    "--isolated",
    is_flag=True,
    help="Start CMD as the agent user of `bastion isolate setup` (needs root), with a clean "
    "environment, in a sandbox of its own; the agent runs "
    "`ssh -F \"$BASTION_SSH_CONFIG\" HOST 'COMMAND'`.",
)
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.pass_context
def run(
    ctx: click.Context,
    label: str,
    agent_socket: Path | None,
    hide: tuple[Path, ...],
    ro: tuple[Path, ...],
    private_home: bool,
    rw: tuple[Path, ...],
    expose: tuple[Path, ...],
    rw_git: bool,
    share_net: bool,
    keep_home: bool,
    no_sandbox: bool,
    isolated: bool,
    command: tuple[str, ...],
) -> None:
    """Start an agent as a registered run, in a sandbox of its own: every ssh
    anywhere in its process tree is attributed to this one run (read from the
    live process tree by the gateway, never from an environment variable), and
    nothing it starts outlives it.

    The sandbox (bubblewrap, Landlock, no_new_privs) writes only where it was
    given: the system is read-only, HOME is an overlay whose writes are the run's
    own (gone at exit; --keep-home keeps them per --label), /tmp is its own, and
    the project -- the working directory's git work tree, or the working
    directory -- is the one real door (its .git/config and hooks read-only unless
    --rw-git; --rw gives more). It hides the bastion home but the agent socket,
    browser profiles, password stores and keyrings, ssh private keys, ~/.gnupg,
    cloud, container, kubernetes and git credentials, $XDG_RUNTIME_DIR, tmux and
    screen sockets (--expose gives one back); its network is its own, with the
    host's loopback out of reach (--share-net opts out); the run sees no process
    outside it and has no controlling terminal of yours. Where the sandbox cannot
    be made, nothing starts: the message says what to install or turn on.
    SSH_AUTH_SOCK inside names a throwaway agent of the run's own, with one
    key that identifies nothing, for clients that want a key (paramiko, fabric);
    --no-sandbox runs keep the environment as it is, but for SHLVL: every run has
    SHLVL=1 where it was unset or 0, because ssh runs the ProxyCommand through
    $SHELL, and bash, seeing a socket there and no SHLVL, would read ~/.bashrc on
    every call (an agent outside `bastion run` gets the same by running ssh with
    SHLVL=1 or SHELL=/bin/sh).

    With --isolated the agent runs as the agent user, in groups of that user's
    group only, in a private HOME, with PATH, LANG, LC_ALL, HOME, USER, LOGNAME
    and BASTION_SSH_CONFIG and nothing else."""
    home = home_of(ctx)
    given = sandbox_mod.Given(
        hide=tuple(p.absolute() for p in hide),
        ro=tuple(p.absolute() for p in ro),
        private_home=private_home,
        rw=tuple(p.absolute() for p in rw),
        expose=tuple(p.absolute() for p in expose),
        rw_git=rw_git,
        share_net=share_net,
        keep_home=keep_home,
    )
    if no_sandbox and given != sandbox_mod.Given():
        fail(
            "--hide, --ro, --rw, --expose, --rw-git, --share-net, --private-home and "
            "--keep-home shape the sandbox; --no-sandbox has none"
        )
    if keep_home and (not label or private_home or isolated):
        fail(
            "--keep-home keeps the home overlay of one --label: give --label NAME, "
            "without --private-home or --isolated"
        )
    iso = None
    if isolated:
        if agent_socket is not None:
            fail("--isolated uses the agent socket of isolation.json; leave out --agent-socket")
        if no_sandbox:
            fail("--isolated runs always get a sandbox; leave out --no-sandbox")
        iso = _isolation(home)
    socket_path = iso.agent_socket if iso else (agent_socket or home.agent_socket).absolute()
    words = given.words()
    if any(len(w) > GIVEN_WORD for w in words) or len(words) > GIVEN_WORDS:
        fail(
            f"the run's card shows what it was given: at most {GIVEN_WORDS} --hide/--ro/"
            f"--rw/--expose paths of at most {GIVEN_WORD - 10} characters each; give a "
            "shorter path (a parent directory)"
        )
    # The sandbox hides the user's keys and agent: it gets one of its own (none without a
    # sandbox, which sees the user's as they are).
    keys = None if no_sandbox else _throwaway_agent(iso)
    try:
        box, project, note = (
            (None, None, "") if no_sandbox else _prepare(home, socket_path, given, iso, keys, label)
        )
        if box is not None and iso is None:
            words = [f"project {project}" if project else "project: none", *words]
        doors = [] if box is None or given.rw_git else [*([project] if project else []), *given.rw]
        before = {d: sandbox_mod.git_before_run(d) for d in doors}
        code = _start(socket_path, label, words, box, iso, command, note)
    finally:
        if keys is not None:
            keys.close()
    for d, state in before.items():
        for said in sandbox_mod.git_after_run(d, state, f"run-{os.getpid()}"):
            click.echo(f"bastion: {said}", err=True)
    sys.exit(code)


def _throwaway_agent(iso: Isolation | None) -> ThrowawayAgent:
    try:
        return ThrowawayAgent(iso.uid if iso is not None else None)
    except OSError as exc:
        fail(f"cannot start the run's ssh agent: {exc.strerror or exc}. Nothing was started.")


def _start(
    socket_path: Path,
    label: str,
    words: list[str],
    box: sandbox_mod.Sandbox | None,
    iso: Isolation | None,
    command: tuple[str, ...],
    note: str = "",
) -> int:
    """Register, then start CMD in its sandbox (or without one) and supervise it. An
    isolated CMD the agent user could not start is refused first: nothing registers."""
    if box is not None and iso is not None:
        box = _isolated_box(box, iso, command)
    _hold_signals(box is not None)
    run_id = _register(socket_path, label, None if box is None else words)
    what = "unsandboxed" if box is None else "in its sandbox"
    who = f" as {iso.user} (uid {iso.uid})" if iso else ""
    click.echo(
        f"bastion: registered {run_id} (pid {os.getpid()}); starting {command[0]} {what}{who}",
        err=True,
    )
    if note:
        click.echo(note, err=True)
    if box is None:
        return _supervise(list(command), False, env=nested(os.environ))
    popen: dict[str, Any] = {
        "env": box.env,
        # Its own session, without the operator's terminal as its controlling
        # terminal: it cannot push keystrokes into it (TIOCSTI).
        "start_new_session": True,
        "preexec_fn": box.preexec,
        "pass_fds": box.pass_fds,
    }
    if iso is not None:
        popen |= {"user": iso.uid, "group": iso.gid, "extra_groups": [iso.gid], "cwd": "/"}

        def preexec() -> None:
            _isolated_harden()
            box.preexec()

        popen["preexec_fn"] = preexec
    try:
        return _supervise(box.command(command), True, box.started, **popen)
    finally:
        box.close()
