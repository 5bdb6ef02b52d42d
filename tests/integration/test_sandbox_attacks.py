"""Attacks from inside a default `bastion run` (issue 20, acceptance 1): every deputy outside
the run that could answer the operator's card, or read what the operator holds, is out of
reach.

Each test starts a run whose agent has a session card pending (`touch MARKER` on web1,
`harness.held_card`), tries one attack from inside the run (a program the run's agent
starts, `harness.inside`), and checks the card is still pending and nothing ran. Each has a
positive control: the same action from outside the run works -- and where the action
answers cards, the control really does answer it and the command runs. On the base tree
(c64f1d8, where `bastion run` has no sandbox) the attacks succeed, so these tests fail there.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import termios
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from bastion.cli.promptkeys import GUARD
from tests.harness import (
    TRACE_PROBE,
    Bastion,
    HeldCard,
    Terminal,
    cli_argv,
    held_card,
    inside,
    pending_ids,
    readable_address,
    ssh_agent,
    wait_for,
)

PY = sys.executable


def sh(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The same program run outside any run: the positive control."""
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})}
    )


def decide(b: Bastion, card: dict[str, object]) -> str:
    """The operator's `bastion decide CARD approve`, as one shell command line."""
    return shlex.join(cli_argv(b.home.root, "decide", str(card["id"]), "approve"))


@pytest.fixture
def held(bastion: Bastion, tmp_path: Path) -> Iterator[HeldCard]:
    h = held_card(bastion, tmp_path / "marker")
    yield h


# -- terminal multiplexers ---------------------------------------------------------------


@pytest.mark.parametrize(
    "where",
    [
        "default",
        "tmux_tmpdir",
        "socket_flag",
    ],
)
@pytest.mark.parametrize("attack", ["send-keys", "new-window"])
def test_tmux_from_inside_a_run_cannot_answer_the_card(
    bastion: Bastion, tmp_path: Path, attack: str, where: str
) -> None:
    """The operator's tmux runs `bastion approve` in a pane, and `bastion run` was started
    from another pane of it ($TMUX names the server's socket). `where`: the socket in the
    default /tmp/tmux-UID, or under TMUX_TMPDIR in the test's directory (visible from the
    run unless the sandbox hides what $TMUX names), or given with `tmux -S PATH` (the
    socket only $TMUX names)."""
    if not shutil.which("tmux"):
        pytest.skip("tmux is not installed")
    name = f"bt-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ)
    if where == "tmux_tmpdir":
        (tmp_path / "tx").mkdir()
        env["TMUX_TMPDIR"] = str(tmp_path / "tx")
    tmux = ["tmux", "-L", name]
    if where == "socket_flag":
        tmux = ["tmux", "-S", str(tmp_path / "op.sock")]
    approve = shlex.join(cli_argv(bastion.home.root, "approve"))
    subprocess.run(
        [*tmux, "new-session", "-d", "-s", "op", "-x", "200", "-y", "50", approve],
        env=env, check=True, timeout=30,
    )  # fmt: skip
    try:
        info = subprocess.run(
            [*tmux, "display", "-p", "-t", "op", "#{socket_path},#{pid},#{pane_id}"],
            env=env, check=True, timeout=30, capture_output=True, text=True,
        ).stdout.strip()  # fmt: skip
        sock, server_pid, pane = info.split(",")
        run_env = {"TMUX": f"{sock},{server_pid},0", "TMUX_PANE": pane}
        if where == "tmux_tmpdir":
            run_env["TMUX_TMPDIR"] = env["TMUX_TMPDIR"]
        h = held_card(bastion, tmp_path / "marker", env=run_env)

        def screen() -> str:
            return sh(*tmux, "capture-pane", "-p", "-t", "op", env=env).stdout

        wait_for(lambda: "approve? [y/n then Enter" in screen(), timeout=30)
        verb = ["send-keys", "-t", "op", "y"]
        if attack == "new-window":
            verb = ["new-window", "-d", decide(bastion, h.card)]
        attempts = [
            ["tmux", *verb],  # through $TMUX
            ["tmux", "-S", sock, *verb],
            ["tmux", "-L", name, *verb],
        ]
        for argv in attempts:
            r = inside(h.agent, *argv)
            assert r.rc != 0, f"{argv} from inside the run: {r.stderr}"
        h.assert_held()
        # Positive control: the same from outside the run answers the card (a key then,
        # once the prompt asks for it, Enter: `bastion approve` confirms an answer).
        time.sleep(GUARD + 0.2)
        assert sh("tmux", "-S", sock, *verb).returncode == 0
        if attack != "new-window":
            wait_for(lambda: "press Enter to confirm" in screen(), timeout=30)
            assert sh("tmux", "-S", sock, "send-keys", "-t", "op", "Enter").returncode == 0
        h.wait_ran()
    finally:
        subprocess.run([*tmux, "kill-server"], env=env, timeout=30, capture_output=True)


def test_screen_stuff_from_inside_a_run_cannot_answer_the_card(
    bastion: Bastion, held: HeldCard
) -> None:
    if not shutil.which("screen"):
        pytest.skip("screen is not installed (apt-get install screen)")
    name = f"bt-{uuid.uuid4().hex[:8]}"
    subprocess.run(["screen", "-dmS", name, "sh"], check=True, timeout=30)
    try:
        wait_for(lambda: name in sh("screen", "-ls").stdout, timeout=30)
        stuff = ["screen", "-S", name, "-X", "stuff", decide(bastion, held.card) + "\n"]
        r = inside(held.agent, *stuff)
        assert r.rc != 0, r.stderr
        said = r.stdout.decode(errors="replace") + r.stderr
        assert "No screen session found" in said, said
        held.assert_held()
        assert sh(*stuff).returncode == 0  # positive control: outside, the shell runs it
        held.wait_ran()
    finally:
        subprocess.run(["screen", "-S", name, "-X", "quit"], timeout=30, capture_output=True)


# -- the terminal `bastion run` was started from ------------------------------------------

TIOCSTI_ATTACK = r"""
import fcntl, json, os, pathlib, subprocess, sys, termios, time
payload, go, done = sys.argv[1], sys.argv[2], sys.argv[3]
ssh = None
if len(sys.argv) > 4:  # first ask for the card the payload would answer
    ssh = subprocess.Popen(sys.argv[4:], stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.05)
    payload = payload.replace("CARD", pathlib.Path(go).read_text())
tried = {}
def push(name, fd):
    try:
        for ch in payload.encode():
            fcntl.ioctl(fd, termios.TIOCSTI, bytes([ch]))
        tried[name] = "pushed"
    except OSError as exc:
        tried[name] = exc.errno
for fd in (0, 1, 2):
    push(f"fd{fd}", fd)
try:
    tty = os.open("/dev/tty", os.O_RDWR)
except OSError as exc:
    tried["/dev/tty"] = f"open {exc.errno}"
else:
    push("/dev/tty", tty)
print("TRIED " + json.dumps(tried), flush=True)
deadline = time.monotonic() + 60
while not os.path.exists(done) and time.monotonic() < deadline:
    time.sleep(0.05)
if ssh is not None:
    ssh.wait(60)
"""


class ControllingTerminal(Terminal):
    """`harness.Terminal`, but the pty is the program's controlling terminal, as the
    terminal an operator types `bastion run` into is."""

    def __init__(self, argv: list[str]) -> None:
        self.master, slave = os.openpty()
        self.proc = subprocess.Popen(
            argv,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            start_new_session=True,
            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),
        )
        os.close(slave)
        self.seen = b""
        self.raw = b""


def _tiocsti_shell(tmp_path: Path, program: list[str], payload: str, *ssh: str) -> list[str]:
    """The operator's shell: runs PROGRAM (the attacker, in a run or not), then reads the
    next line typed on its terminal -- where pushed keystrokes would land."""
    script = tmp_path / "tiocsti.py"
    script.write_text(TIOCSTI_ATTACK)
    attacker = [*program, PY, str(script), payload, str(tmp_path / "go"), str(tmp_path / "done")]
    line = shlex.join([*attacker, *ssh])
    return ["sh", "-c", f'{line}; IFS= read -r line; echo "shell-read:$line"']


def test_tiocsti_from_inside_a_run_cannot_type_into_the_operators_terminal(
    bastion: Bastion, tmp_path: Path
) -> None:
    legacy = Path("/proc/sys/dev/tty/legacy_tiocsti")
    if legacy.exists() and legacy.read_text().strip() != "1":
        pytest.skip("this kernel refuses TIOCSTI to everyone (dev.tty.legacy_tiocsti = 0)")
    marker = tmp_path / "marker"
    run = cli_argv(bastion.home.root, "run", "--label", "tty", "--")
    ssh = ["ssh", "-F", str(bastion.config), "web1", f"touch {marker}"]
    payload = shlex.join(cli_argv(bastion.home.root, "decide", "CARD", "approve")) + "\n"
    term = ControllingTerminal(_tiocsti_shell(tmp_path, run, payload, *ssh))
    try:
        card = bastion.next_card(timeout=30)
        (tmp_path / "go").write_text(card["id"])
        shown = term.expect("TRIED ")
        tried = json.loads(_line_after(term))
        assert "pushed" not in tried.values(), tried
        assert pending_ids(bastion) == [card["id"]] and not marker.exists()
        bastion.answer(card, False)
        (tmp_path / "done").write_text("")
        term.type("nothing-pushed\n")
        term.expect("shell-read:nothing-pushed")
        assert not marker.exists(), shown
    finally:
        term.close()
    # Positive control: the same program on the same kind of terminal, not in a run.
    (tmp_path / "done").write_text("")
    term = ControllingTerminal(_tiocsti_shell(tmp_path, [], "echo control\n"))
    try:
        term.expect("TRIED ")
        assert json.loads(_line_after(term))["fd0"] == "pushed"
        term.expect("shell-read:echo control")
    finally:
        term.close()


def _line_after(term: Terminal) -> str:
    """The rest of the line the terminal's last `expect` stopped in."""
    term.expect("\n")
    return term.raw.decode("utf-8", "replace").split("TRIED ")[-1].splitlines()[0]


# -- the session bus, its keyring, the systemd user instance ------------------------------

SECRET = "hunter2-in-the-keyring"
ITEM = "/org/freedesktop/secrets/collection/login/1"

SECRET_SERVICE = f"""
import sys
from jeepney import DBusAddress, HeaderFields, MessageType, new_method_return
from jeepney.bus_messages import message_bus
from jeepney.io.blocking import open_dbus_connection
conn = open_dbus_connection(bus=sys.argv[1])
assert conn.send_and_get_reply(message_bus.RequestName("org.freedesktop.secrets")).body[0] == 1
print("ready", flush=True)
while True:
    msg = conn.receive()
    if msg.header.message_type == MessageType.method_call:
        conn.send(new_method_return(msg, "s", ({SECRET!r},)))
"""


@pytest.fixture
def session_bus(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A session bus where the desktop keeps it ($XDG_RUNTIME_DIR/bus), a second one on
    an abstract address, a stand-in Secret Service on the first (it answers every call
    with the secret), and a socket where the systemd user instance listens. Yields the
    environment the operator's shell would have, plus the two addresses."""
    pytest.importorskip("jeepney")
    xdg = tmp_path / "xdg"
    (xdg / "systemd").mkdir(parents=True)
    xdg.chmod(0o700)
    path_bus = f"unix:path={xdg}/bus"
    abstract_bus = f"unix:abstract=/bt/dbus-{uuid.uuid4().hex}"
    procs = []
    systemd = socket.socket(socket.AF_UNIX)
    try:
        for address in (path_bus, abstract_bus):
            daemon = subprocess.Popen(
                ["dbus-daemon", "--session", "--nofork", "--nopidfile", "--print-address",
                 f"--address={address}"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            )  # fmt: skip
            procs.append(daemon)
            assert daemon.stdout is not None and daemon.stdout.readline().startswith("unix:")
        service = subprocess.Popen(
            [PY, "-c", SECRET_SERVICE, path_bus], stdout=subprocess.PIPE, text=True
        )
        procs.append(service)
        assert service.stdout is not None and service.stdout.readline() == "ready\n"
        systemd.bind(str(xdg / "systemd" / "private"))
        systemd.listen()
        yield {
            "XDG_RUNTIME_DIR": str(xdg),
            "DBUS_SESSION_BUS_ADDRESS": path_bus,
            "path_bus": path_bus,
            "abstract_bus": abstract_bus,
        }
    finally:
        systemd.close()
        for p in procs:
            p.kill()
            p.wait(10)


def _bus_calls(bus: dict[str, str]) -> dict[str, list[str]]:
    names = ["--print-reply", "--dest=org.freedesktop.DBus", "/", "org.freedesktop.DBus.ListNames"]
    secret = [
        "--print-reply", "--dest=org.freedesktop.secrets", ITEM,
        "org.freedesktop.Secret.Item.GetSecret", "objpath:/",
    ]  # fmt: skip
    return {
        "session": ["dbus-send", "--session", *names],
        "path": ["dbus-send", f"--bus={bus['path_bus']}", *names],
        "abstract": ["dbus-send", f"--bus={bus['abstract_bus']}", *names],
        "secret": ["dbus-send", f"--bus={bus['path_bus']}", *secret],
    }


def test_the_session_bus_and_its_keyring_are_out_of_reach(
    bastion: Bastion, tmp_path: Path, session_bus: dict[str, str]
) -> None:
    env = {k: session_bus[k] for k in ("XDG_RUNTIME_DIR", "DBUS_SESSION_BUS_ADDRESS")}
    h = held_card(bastion, tmp_path / "marker", env=env)
    calls = _bus_calls(session_bus)
    for what, argv in calls.items():
        r = inside(h.agent, *argv)
        assert r.rc != 0, f"{what} from inside the run: {r.stdout!r}"
        assert SECRET not in r.stdout.decode(errors="replace")
    # $XDG_RUNTIME_DIR itself (the bus, the keyring, systemd's socket) is hidden.
    look = f"import os; print(os.path.exists({session_bus['XDG_RUNTIME_DIR'] + '/bus'!r}))"
    assert inside(h.agent, PY, "-c", look).stdout == b"False\n"
    h.assert_held()
    # Positive control: from outside, every call is answered, the secret comes back.
    for what, argv in calls.items():
        r = sh(*argv, env=env)
        assert r.returncode == 0, (what, r.stderr)
    assert SECRET in sh(*calls["secret"]).stdout
    h.deny()


def test_systemd_run_user_from_inside_a_run_cannot_reach_the_user_manager(
    bastion: Bastion, tmp_path: Path, session_bus: dict[str, str]
) -> None:
    """There is no systemd user instance in CI (no systemd as pid 1), so this shows what
    can be shown: from outside `systemd-run --user` reaches the user bus (and fails only
    because no manager answers there); from inside it cannot even connect, and the
    manager's socket ($XDG_RUNTIME_DIR/systemd/private) is not there."""
    if not shutil.which("systemd-run"):
        pytest.skip("systemd-run is not installed")
    env = {k: session_bus[k] for k in ("XDG_RUNTIME_DIR", "DBUS_SESSION_BUS_ADDRESS")}
    h = held_card(bastion, tmp_path / "marker", env=env)
    argv = ["systemd-run", "--user", "touch", str(tmp_path / "via-systemd")]
    explicit = ["env", *(f"{k}={v}" for k, v in env.items()), *argv]  # the names are known
    for attempt in (argv, explicit):
        r = inside(h.agent, *attempt)
        assert r.rc != 0 and "Failed to connect to bus" in r.stderr, r.stderr
    private = f"{session_bus['XDG_RUNTIME_DIR']}/systemd/private"
    probe = (
        "import socket; s = socket.socket(socket.AF_UNIX)\n"
        f"try: s.connect({private!r}); print('connected')\n"
        "except OSError as e: print(e.errno)"
    )
    assert inside(h.agent, PY, "-c", probe).stdout.strip() != b"connected"
    h.assert_held()
    h.deny()
    try:  # it gets to the bus, and fails (or waits) only because no manager answers there
        outside = subprocess.run(
            argv, capture_output=True, text=True, timeout=5, env={**os.environ, **env}
        )
        assert "Failed to connect to bus" not in outside.stderr, outside.stderr
    except subprocess.TimeoutExpired:
        pass
    assert sh(PY, "-c", probe).stdout.strip() == "connected"


# -- cron and at --------------------------------------------------------------------------


@contextlib.contextmanager
def _kept_crontab() -> Iterator[None]:
    """Root's crontab as it was, put back after the test."""
    before = sh("crontab", "-l")
    try:
        yield
    finally:
        if before.returncode == 0:
            subprocess.run(["crontab", "-"], input=before.stdout, text=True, timeout=30)
        else:
            subprocess.run(["crontab", "-r"], capture_output=True, timeout=30)


def test_crontab_and_at_from_inside_a_run_schedule_nothing(
    bastion: Bastion, held: HeldCard, tmp_path: Path
) -> None:
    if not (shutil.which("crontab") and shutil.which("at")):
        pytest.skip("cron and at are not installed (apt-get install cron at)")
    line = f"* * * * * {decide(bastion, held.card)} # bt-{uuid.uuid4().hex}"
    job = f"{decide(bastion, held.card)}\n"
    with _kept_crontab():
        jobs_before = sh("atq").stdout
        inside(held.agent, "sh", "-c", f"(crontab -l; echo {shlex.quote(line)}) | crontab -")
        inside(held.agent, "sh", "-c", f"echo {shlex.quote(job)} | at now + 30 minutes")
        assert line not in sh("crontab", "-l").stdout
        assert sh("atq").stdout == jobs_before
        held.assert_held()
        # Positive control: the same from outside lands in the real spools.
        subprocess.run(
            ["sh", "-c", f"(crontab -l; echo {shlex.quote(line)}) | crontab -"], timeout=30
        )
        assert line in sh("crontab", "-l").stdout
        subprocess.run(
            ["sh", "-c", f"echo {shlex.quote(job)} | at now + 30 minutes"],
            capture_output=True, timeout=30,
        )  # fmt: skip
        added = set(sh("atq").stdout.splitlines()) - set(jobs_before.splitlines())
        assert added, "the control's at job is not queued"
        for entry in added:
            subprocess.run(["atrm", entry.split()[0]], timeout=30)
    held.deny()


# -- abstract unix sockets and the X display ----------------------------------------------

CONNECT = """
import socket, sys
s = socket.socket(socket.AF_UNIX)
name = sys.argv[1].replace("@", "\\0", 1)
try:
    s.connect(name)
    print("connected")
except OSError as exc:
    print("errno", exc.errno)
"""


@pytest.fixture
def abstract_listener() -> Iterator[str]:
    sock = socket.socket(socket.AF_UNIX)
    name = f"@bt-abstract-{uuid.uuid4().hex}"
    sock.bind("\0" + name[1:])
    sock.listen(8)
    try:
        yield name
    finally:
        sock.close()


@pytest.fixture
def xvfb(tmp_path: Path) -> Iterator[int]:
    """A real X server (Xvfb): it listens on the abstract @/tmp/.X11-unix/XN and on the
    path /tmp/.X11-unix/XN. Yields N."""
    if not shutil.which("Xvfb"):
        pytest.skip("Xvfb is not installed (apt-get install xvfb)")
    read, write = os.pipe()
    proc = subprocess.Popen(
        ["Xvfb", "-displayfd", str(write), "-nolisten", "tcp", "-screen", "0", "64x64x8"],
        pass_fds=(write,), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    os.close(write)
    try:
        with os.fdopen(read) as f:
            display = int(f.readline())
        yield display
    finally:
        proc.kill()
        proc.wait(10)


def test_abstract_sockets_outside_the_run_are_unreachable(
    held: HeldCard, abstract_listener: str, xvfb: int
) -> None:
    names = [abstract_listener, f"@/tmp/.X11-unix/X{xvfb}", f"/tmp/.X11-unix/X{xvfb}"]
    for name in names:
        r = inside(held.agent, PY, "-c", CONNECT, name)
        assert r.stdout.startswith(b"errno"), (name, r.stdout, r.stderr)
        # Positive control: the same connect from outside the run.
        assert sh(PY, "-c", CONNECT, name).stdout == "connected\n", name
    if shutil.which("xdpyinfo"):
        r = inside(held.agent, "env", f"DISPLAY=:{xvfb}", "xdpyinfo")
        assert r.rc != 0
    held.assert_held()
    held.deny()


# -- the operator's processes -------------------------------------------------------------


@pytest.fixture
def operator_unlock(bastion: Bastion) -> Iterator[list[int]]:
    """The operator's `bastion unlock`, waiting for the passphrase: its processes."""
    proc = subprocess.Popen(
        cli_argv(bastion.home.root, "unlock", "--passphrase-stdin"),
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        # It closes its memory and goes on in a forked child (`bastion.memory`).
        wait_for(lambda: psutil.Process(proc.pid).children(), timeout=30)
        yield [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children())]
    finally:
        proc.kill()
        proc.wait(10)


def test_the_operators_processes_cannot_be_read_traced_or_signalled(
    bastion: Bastion, held: HeldCard, operator_unlock: list[int]
) -> None:
    prompt = Terminal(cli_argv(bastion.home.root, "approve"))
    try:
        prompt.expect("approve? [y/n then Enter")  # the card of the run is on the operator's screen
        targets = [*operator_unlock, bastion.gateway_pid]
        for pid in targets:
            addr = readable_address(pid)
            doc = json.loads(inside(held.agent, PY, "-c", TRACE_PROBE, str(pid), addr).stdout)
            assert doc["proc"] is False, (pid, doc)
            assert doc["vm_readv"] < 0 and doc["ptrace"] < 0 and doc["kill0"] < 0, (pid, doc)
        # Positive control: from outside (root, as the tests run) the unlock's memory is
        # read and it is traced; the gateway's and the unlock's pids are there.
        for pid in operator_unlock:
            doc = json.loads(sh(PY, "-c", TRACE_PROBE, str(pid), readable_address(pid)).stdout)
            assert doc == {"proc": True, "vm_readv": 64, "ptrace": 0, "kill0": 0}, (pid, doc)
        if shutil.which("gdb"):
            pid = str(operator_unlock[-1])
            gdb = ["gdb", "-nx", "-batch", "-p", pid, "-ex", "info inferiors"]
            assert f"process {pid}" not in inside(held.agent, *gdb).stdout.decode()
            assert f"process {pid}" in sh(*gdb).stdout
        # kill -STOP of the operator's prompt.
        r = inside(held.agent, "kill", "-STOP", str(prompt.proc.pid))
        assert r.rc != 0
        assert psutil.Process(prompt.proc.pid).status() != psutil.STATUS_STOPPED
        held.assert_held()
        os.kill(prompt.proc.pid, signal.SIGSTOP)  # positive control
        wait_for(lambda: psutil.Process(prompt.proc.pid).status() == psutil.STATUS_STOPPED)
        os.kill(prompt.proc.pid, signal.SIGCONT)
    finally:
        prompt.close()
    held.deny()


LIST_PROC = """
import json, os
out = {}
for name in os.listdir("/proc"):
    if name.isdigit():
        try:
            out[name] = open(f"/proc/{name}/cmdline", "rb").read().replace(b"\\0", b" ").decode()
        except OSError:
            pass
print(json.dumps(out))
"""


def test_proc_inside_lists_only_the_runs_processes(bastion: Bastion, held: HeldCard) -> None:
    seen = json.loads(inside(held.agent, PY, "-c", LIST_PROC).stdout)
    # The run: its init (bwrap, or what stands in), the helper, ssh and its proxy, the
    # lister. Nothing of the gateway, the test or the operator.
    assert len(seen) < 12, seen
    gateway = f"--home {bastion.home.root} daemon"
    for needle in (gateway, "-m pytest", "approve"):
        assert not [c for c in seen.values() if needle in c], (needle, seen)
    outside = json.loads(sh(PY, "-c", LIST_PROC).stdout)  # positive control
    assert [c for c in outside.values() if gateway in c], outside
    assert str(os.getpid()) in outside
    held.assert_held()
    held.deny()


# -- the operator's files and sockets ----------------------------------------------------

READ = """
import json, os, socket, sys
out = {}
for path in sys.argv[1:]:
    try:
        if path.endswith(".sock"):
            s = socket.socket(socket.AF_UNIX); s.connect(path); s.close()
        elif os.path.isdir(path):
            if not os.listdir(path):
                out[path] = "empty"
                continue
        else:
            open(path, "rb").read()
        out[path] = "ok"
    except OSError as exc:
        out[path] = exc.errno
print(json.dumps(out))
"""


def test_the_home_the_operator_socket_and_private_keys_are_hidden(
    bastion: Bastion, tmp_path: Path
) -> None:
    """The run is started from the operator's shell: its HOME has ~/.ssh with private keys
    and a config, ~/.gnupg, and an ssh-agent in SSH_AUTH_SOCK."""
    home = tmp_path / "operator-home"
    ssh_dir, gnupg = home / ".ssh", home / ".gnupg" / "private-keys-v1.d"
    ssh_dir.mkdir(parents=True, mode=0o700)
    gnupg.mkdir(parents=True, mode=0o700)
    for name in ("id_ed25519", "id_rsa", "id_ecdsa_sk"):
        (ssh_dir / name).write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nsecret\n")
        (ssh_dir / name).chmod(0o600)
        (ssh_dir / f"{name}.pub").write_text("ssh-ed25519 AAAA public\n")
    (ssh_dir / "config").write_text("Host example\n    User someone\n")
    (gnupg / "ABCDEF.key").write_text("secret key\n")
    hidden = [
        bastion.home.vault,
        bastion.home.journal,
        bastion.home.policies,
        bastion.home.operator_socket,
        ssh_dir / "id_ed25519",
        ssh_dir / "id_rsa",
        ssh_dir / "id_ecdsa_sk",
        gnupg / "ABCDEF.key",
        home / ".gnupg",
    ]
    hidden += [p for p in bastion.home.root.iterdir() if p.name not in ("run",)]
    shown = [ssh_dir / "config", ssh_dir / "id_ed25519.pub", bastion.home.agent_socket]
    with ssh_agent(tmp_path) as agent_sock:
        env = {"HOME": str(home), "SSH_AUTH_SOCK": str(agent_sock)}
        h = held_card(bastion, tmp_path / "marker", env=env)
        paths = [str(p) for p in [*hidden, *shown, agent_sock]]
        seen = json.loads(inside(h.agent, PY, "-c", READ, *paths).stdout)
        assert {p: seen[str(p)] for p in hidden if seen[str(p)] == "ok"} == {}, seen
        assert {str(p): "ok" for p in shown} == {str(p): seen[str(p)] for p in shown}, seen
        assert seen[str(agent_sock)] != "ok", seen
        # SSH_AUTH_SOCK inside names the run's throwaway agent: its one key, not the user's.
        r = inside(h.agent, "ssh-add", "-l")
        assert r.rc == 0 and b"held" not in r.stdout, r.stdout
        assert r.stdout.count(b"\n") == 1 and b"throwaway key" in r.stdout, r.stdout
        r = inside(h.agent, "env", f"SSH_AUTH_SOCK={agent_sock}", "ssh-add", "-l")
        assert r.rc != 0 and b"held" not in r.stdout, r.stdout
        r = inside(h.agent, *cli_argv(bastion.home.root, "status"))
        assert r.rc != 0, r.stdout
        h.assert_held()
        # Positive control: outside every one of them is there.
        outside = json.loads(sh(PY, "-c", READ, *paths).stdout)
        assert set(outside.values()) == {"ok"}, outside
        assert "held" in sh("ssh-add", "-l", env={"SSH_AUTH_SOCK": str(agent_sock)}).stdout
        h.deny()


# -- what the operator runs later ------------------------------------------------------------

PLANT = """
import json, sys
out = {}
for path in sys.argv[1:]:
    try:
        with open(path, "a") as f:
            f.write("bastion decide ANY approve\\n")
        out[path] = "written"
    except OSError as exc:
        out[path] = exc.strerror
print(json.dumps(out))
"""


def test_a_run_cannot_plant_what_the_operator_runs_next(bastion: Bastion, tmp_path: Path) -> None:
    """The operator's shell start-up files and a systemd user unit are in the run's
    home overlay, bastion's own code is read-only: appending `bastion decide ...
    approve` to any of them never reaches the disk (the code's append fails outright).
    The control appends to the same files from outside, where it works."""
    import bastion as package

    home = tmp_path / "operator-home"
    (home / ".config" / "systemd" / "user").mkdir(parents=True)
    targets = [home / ".bashrc", home / ".profile", home / ".zshrc"]
    targets.append(home / ".config" / "systemd" / "user" / "agent.service")
    for t in targets:
        t.write_text("# the operator's\n")
    code = Path(package.__file__).parent / "cli" / "run.py"
    h = held_card(bastion, tmp_path / "marker", env={"HOME": str(home)})
    paths = [str(p) for p in [*targets, code]]
    seen = json.loads(inside(h.agent, PY, "-c", PLANT, *paths).stdout)
    assert seen[str(code)] == "Read-only file system", seen
    assert all("ANY" not in Path(p).read_text() for p in paths), seen
    h.assert_held()
    # The control: the same writes from outside the run land (not on bastion's own code).
    control = subprocess.run(
        [PY, "-c", PLANT, *paths[:-1]], capture_output=True, text=True, check=True
    )
    assert set(json.loads(control.stdout).values()) == {"written"}
    h.deny()


SETUID = """
import json, os
out = {}
try:
    with open("/etc/bastion-planted", "w") as f:
        f.write("x")
    out["etc"] = "written"
except OSError as exc:
    out["etc"] = exc.strerror
try:
    os.setresuid(65534, 65534, 65534)
    out["setuid"] = "became nobody"
except OSError as exc:
    out["setuid"] = exc.strerror
print(json.dumps(out))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="what a run started by root keeps")
def test_a_run_started_by_root_cannot_become_another_user_or_change_the_system(
    bastion: Bastion, tmp_path: Path
) -> None:
    """Root's run has no user namespace (ssh as root must set its groups), so it keeps
    CAP_SETGID alone: it cannot switch to another user (and read their keys), and /etc
    is read-only. The control, outside, does both."""
    h = held_card(bastion, tmp_path / "marker")
    seen = json.loads(inside(h.agent, PY, "-c", SETUID).stdout)
    assert seen == {"setuid": "Operation not permitted", "etc": "Read-only file system"}, seen
    control = subprocess.run(
        [PY, "-c", SETUID.replace("/etc/bastion-planted", str(tmp_path / "etc-planted"))],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(control.stdout) == {"setuid": "became nobody", "etc": "written"}
    assert not Path("/etc/bastion-planted").exists()
    h.deny()
