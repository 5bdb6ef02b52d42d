"""Same-uid mode, as hard as it can be (issue 9): an agent below `bastion run`
cannot escape its tree to answer for the operator, and the gateway's memory
is closed to processes of its own uid that hold no privilege -- and so is the
memory of every CLI command that reads the passphrase (issue 18)."""

from __future__ import annotations

import array
import contextlib
import fcntl
import os
import select
import signal
import subprocess
import sys
import termios
from collections.abc import Iterator
from pathlib import Path

import click
import psutil
import pytest

from bastion.cli.main import main as cli_main
from bastion.devtools.sshd_fixture import Sshd, SshdInfo
from tests.harness import (
    PASSPHRASE,
    Agent,
    Bastion,
    cli_argv,
    make_bastion,
    subcommands,
    wait_for,
)

PR_SET_DUMPABLE_READER = """
import ctypes, sys
pid = int(sys.argv[1])
try:
    open(f"/proc/{pid}/mem", "rb").close()
    mem = "readable"
except OSError as exc:
    mem = type(exc).__name__
libc = ctypes.CDLL(None, use_errno=True)
if libc.ptrace(16, pid, 0, 0) == 0:  # PTRACE_ATTACH
    trace = "attached"
    libc.ptrace(17, pid, 0, 0)  # PTRACE_DETACH
else:
    trace = "errno %d" % ctypes.get_errno()
print(mem, trace)
"""


def unprivileged(*argv: str) -> list[str]:
    """Run as the same uid with every capability gone: what a same-uid process has
    when it is not root (no CAP_SYS_PTRACE, no CAP_DAC_OVERRIDE)."""
    return ["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--no-new-privs", *argv]


def probe(pid: int) -> str:
    r = subprocess.run(
        unprivileged("/usr/bin/python3", "-c", PR_SET_DUMPABLE_READER, str(pid)),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_the_gateway_memory_is_closed_to_its_own_uid(
    tmp_path: Path, sshd: SshdInfo, client_key: tuple[Path, str]
) -> None:
    """The gateway and the prober run as the same uid with no capabilities -- a
    same-uid process that is not root. (Two processes of uid 0 with full
    capabilities could read each other whatever the gateway did.)"""
    b = make_bastion(tmp_path, sshd, client_key[0], start=False)
    with open(b.log, "ab") as log:
        daemon = subprocess.Popen(
            unprivileged(sys.executable, "-m", "bastion.cli", "--home", str(b.home.root), "daemon"),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for(lambda: b.home.operator_socket.exists(), timeout=30)
        gateway = b.op("status")["pid"]
        # The gateway is the child `bastion daemon` forked once its memory was closed;
        # the first process only waits for it. Neither can be read.
        assert psutil.Process(gateway).ppid() == daemon.pid
        assert probe(gateway) == "PermissionError errno 1"  # EPERM: not dumpable
        assert probe(daemon.pid) == "PermissionError errno 1"
        # The same probe reads an ordinary process of the same uid and no privilege.
        with subprocess.Popen(unprivileged("sleep", "60")) as ordinary:
            try:
                assert probe(ordinary.pid) == "readable attached"
            finally:
                ordinary.kill()
    finally:
        daemon.terminate()
        daemon.wait(20)


def test_a_double_forked_child_under_bastion_run_cannot_approve_its_card(
    bastion: Bastion, tmp_path: Path
) -> None:
    cli = [sys.executable, "-m", "bastion.cli", "--home", str(bastion.home.root)]
    # Unsandboxed, so the operator socket is there to try: the rule that refuses a run's
    # tree is what stops it (a sandboxed run does not even see the socket: test_authority).
    launcher = (*cli, "run", "--no-sandbox", "--label", "escaper", "--")
    agent = Agent(bastion.config, launcher=launcher)
    bastion.agents.append(agent)
    rid = agent.start("echo should-not-run")
    card = bastion.next_card()
    assert card["subject"]["pid"] == agent.pid and card["subject"]["kind"] == "registered run"
    out = tmp_path / "escape"
    escape = f"{' '.join(cli)} decide {card['id']} approve > {out} 2>&1; echo rc=$? >> {out}"
    # setsid -f: the child is re-parented away from the agent -- to the run, its subreaper.
    agent.run([], argv=["setsid", "-f", "sh", "-c", escape])
    wait_for(lambda: out.exists() and "rc=" in out.read_text(), timeout=30)
    text = out.read_text()
    assert "rc=1" in text and "inside an agent's process tree" in text, text
    assert [c["id"] for c in bastion.op("pending")] == [card["id"]]  # still waiting
    bastion.answer(card, False)
    assert agent.wait(rid).code == "SESSION_DENIED"


def test_lock_leaves_no_key_object_in_the_gateway(bastion: Bastion) -> None:
    """The claim docs/sandbox.md makes: after lock, nothing in the gateway references a
    key (copies Python made and freed may still sit in memory nobody reused; only
    root or CAP_SYS_PTRACE could look, per the test above)."""
    agent = bastion.agent()
    rid = agent.start("echo hi")
    bastion.approve_next()
    assert agent.wait(rid).rc == 0
    held = bastion.op("status")["keys_held"]
    assert held["vault_keys"] >= 1 and held["connections"] >= 1  # the counters can tell
    bastion.cli("lock")
    assert bastion.op("status")["keys_held"] == {"vault_keys": 0, "connections": 0}


# -- the operator's own processes (issue 18) -------------------------------------------------

# How to make each command that takes --passphrase-stdin wait for the passphrase, with
# no gateway running. A meta-test keeps the table complete.
WAITING_FOR_THE_PASSPHRASE: dict[tuple[str, ...], list[str]] = {
    ("init",): ["--home", "{fresh}", "init", "--passphrase-stdin"],
    ("unlock",): ["unlock", "--passphrase-stdin"],
    ("key", "generate"): ["key", "generate", "k2", "--passphrase-stdin"],
    ("key", "import"): ["key", "import", "k3", "{key}", "--passphrase-stdin"],
    ("key", "remove"): ["key", "remove", "deploy-key", "--passphrase-stdin"],
    ("ca", "init"): ["ca", "init", "--passphrase-stdin"],
    ("ca", "rotate"): ["ca", "rotate", "--passphrase-stdin"],
    ("ca", "retire"): ["ca", "retire", "bastion-ca-1", "--passphrase-stdin"],
    ("ca", "openbao-login"): ["ca", "openbao-login", "--passphrase-stdin"],
    ("audit", "activity"): ["audit", "activity", "--passphrase-stdin"],
    ("audit", "sessions"): ["audit", "sessions", "--passphrase-stdin"],
    ("audit", "export"): ["audit", "export", "--passphrase-stdin"],
    ("operator", "enroll"): ["operator", "enroll", "--passphrase-stdin", "--no-open"],
    ("operator", "remove"): ["operator", "remove", "alice", "--passphrase-stdin"],
}


def passphrase_commands(
    command: click.Command = cli_main, path: tuple[str, ...] = ()
) -> Iterator[tuple[str, ...]]:
    """Every leaf command of the CLI that takes --passphrase-stdin."""
    if isinstance(command, click.Group):
        for name, sub in subcommands(command):
            yield from passphrase_commands(sub, (*path, name))
    elif any(p.name == "passphrase_stdin" for p in command.params):
        yield path


def tree(pid: int) -> list[int]:
    """A process and its descendants (read as root, whatever their dumpability)."""
    found = [pid]
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            for child in Path(f"/proc/{pid}/task/{task}/children").read_text().split():
                found += tree(int(child))
    return found


def reading_stdin(pid: int) -> bool:
    """Is some process of this tree blocked in read(0, ...)? (/proc/PID/syscall)"""
    for p in tree(pid):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{p}/syscall").read_text().split()[:2] == ["0", "0x0"]:
                return True
    return False


def unread(pipe_end: int) -> int:
    """Bytes written to a pipe that nobody has read yet."""
    n = array.array("i", [0])
    fcntl.ioctl(pipe_end, termios.FIONREAD, n)
    return n[0]


def test_every_command_that_takes_a_passphrase_is_in_the_table() -> None:
    assert sorted(passphrase_commands()) == sorted(WAITING_FOR_THE_PASSPHRASE)


@pytest.fixture(scope="module")
def offline_home(
    tmp_path_factory: pytest.TempPathFactory, sshd_server: Sshd, client_key: tuple[Path, str]
) -> Iterator[Bastion]:
    """A home with a CA and keys, and no gateway: every command asks for the passphrase."""
    assert sshd_server.info is not None
    b = make_bastion(
        tmp_path_factory.mktemp("offline"), sshd_server.info, client_key[0], start=False
    )
    b.cli("ca", "init", "--passphrase-stdin", stdin=PASSPHRASE + "\n")
    yield b


@pytest.mark.parametrize("path", sorted(WAITING_FOR_THE_PASSPHRASE), ids=lambda p: "-".join(p))
def test_a_command_waiting_for_the_passphrase_is_closed_to_its_own_uid(
    offline_home: Bastion, client_key: tuple[Path, str], tmp_path: Path, path: tuple[str, ...]
) -> None:
    """Started as the operator would, the passphrase not typed yet: a same-uid process
    without privilege can neither open /proc/PID/mem nor PTRACE_ATTACH, whichever
    process of the command it tries; an ordinary process of that uid it can."""
    args = [
        a.format(fresh=tmp_path / "fresh", key=client_key[0])
        for a in WAITING_FOR_THE_PASSPHRASE[path]
    ]
    argv = [sys.executable, "-m", "bastion.cli", "--home", str(offline_home.home.root), *args]
    with subprocess.Popen(
        unprivileged(*argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    ) as cli:
        try:
            wait_for(lambda: reading_stdin(cli.pid) or cli.poll() is not None, timeout=30)
            assert cli.poll() is None, cli.communicate()
            for pid in tree(cli.pid):
                assert probe(pid) == "PermissionError errno 1", (pid, path)
        finally:
            cli.kill()
    with subprocess.Popen(unprivileged("sleep", "60")) as ordinary:
        try:
            assert probe(ordinary.pid) == "readable attached"
        finally:
            ordinary.kill()


# Run as a same-uid process with no privilege: start the command itself, stopped at its
# exec (PTRACE_TRACEME), open its /proc/PID/mem and maps while that is still allowed,
# let it go, and later look through them for the passphrase. "detach": let it run
# untraced; "stay": remain its tracer (and resume it at every stop).
EARLY_READER = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
how, control, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
pid = os.fork()
if pid == 0:
    libc.ptrace(0, 0, 0, 0)  # PTRACE_TRACEME: stop at the exec
    os.execv(argv[0], argv)
_, status = os.waitpid(pid, 0)
assert os.WIFSTOPPED(status), status
mem = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
maps = os.open(f"/proc/{pid}/maps", os.O_RDONLY)
print(os.getpid(), flush=True)
if how == "stay":
    libc.ptrace(7, pid, 0, 0)  # PTRACE_CONT
    while True:
        _, status = os.waitpid(pid, 0)
        if not os.WIFSTOPPED(status):
            break
        libc.ptrace(7, pid, 0, os.WSTOPSIG(status))
    print("exit", os.waitstatus_to_exitcode(status), flush=True)
    sys.exit(0)
libc.ptrace(17, pid, 0, 0)  # PTRACE_DETACH
# Told, in hex (a raw key may hold a newline), once the command has read them.
secrets = [bytes.fromhex(word.decode()) for word in os.read(control, 65536).split()]
assert secrets and all(secrets), secrets
text = b""
while chunk := os.pread(maps, 65536, len(text)):
    text += chunk
found = False
for line in text.decode().splitlines():
    span, perms = line.split()[:2]
    start, end = (int(x, 16) for x in span.split("-"))
    if perms[0] != "r":
        continue
    for at in range(start, end, 1 << 20):
        try:
            data = os.pread(mem, min(1 << 20, end - at) + 64, at)
            found |= any(secret in data for secret in secrets)
        except OSError:
            break
print("found" if found else "not found", flush=True)
os.waitpid(pid, 0)
"""


def early_reader(b: Bastion, how: str) -> tuple[subprocess.Popen[bytes], int, int]:
    """`ca openbao-login --passphrase-stdin` (the vault passphrase, then a token, both
    on stdin) under EARLY_READER; returns it, the command's stdin and the control pipe."""
    stdin_r, stdin_w = os.pipe()
    control_r, control_w = os.pipe()
    argv = cli_argv(b.home.root, "ca", "openbao-login", "--passphrase-stdin")
    reader = subprocess.Popen(
        unprivileged("/usr/bin/python3", "-c", EARLY_READER, how, str(control_r), *argv),
        stdin=stdin_r,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        pass_fds=(control_r,),
    )
    os.close(stdin_r)
    os.close(control_r)
    return reader, stdin_w, control_w


def test_a_memory_opened_before_the_command_closed_it_never_holds_the_passphrase(
    offline_home: Bastion,
) -> None:
    """PR_SET_DUMPABLE does not revoke a /proc/PID/mem opened earlier: a same-uid
    process that opened it as the command started reads only a process that never
    reads the passphrase (it waits for its child, which does)."""
    reader, stdin_w, control_w = early_reader(offline_home, "detach")
    assert reader.stdout is not None
    try:
        prober = int(reader.stdout.readline())  # the command runs below it
        secret = PASSPHRASE.encode()
        os.write(stdin_w, secret + b"\n")  # the vault passphrase; the token is not given yet
        wait_for(lambda: unread(stdin_w) == 0 and reading_stdin(prober), timeout=30)
        os.write(control_w, secret.hex().encode())
        assert reader.stdout.readline().strip() == b"not found"
    finally:
        os.close(stdin_w)  # the token never comes: the command stops
        os.close(control_w)
        _, err = reader.communicate(timeout=30)
    assert reader.returncode == 0, err


def journal_identity_seed(b: Bastion) -> bytes:
    """The journal identity's private key, which the gateway uses at every unlock."""
    from cryptography.hazmat.primitives import serialization

    from bastion.journal import IDENTITY_LABEL
    from bastion.ops import unlocked
    from bastion.vault import Vault

    with unlocked(Vault.open(b.home.vault), PASSPHRASE.encode()) as vault:
        return vault.private_key(IDENTITY_LABEL).pyca_key.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )


def test_a_memory_opened_before_the_gateway_closed_it_never_holds_a_key(
    tmp_path: Path, sshd: SshdInfo, client_key: tuple[Path, str]
) -> None:
    """The same race against the gateway: a same-uid process opens /proc/PID/mem of
    `bastion daemon` as it starts, before its PR_SET_DUMPABLE. Once the vault is
    unlocked (the passphrase, and the journal identity's key certifying the journal),
    that handle still reads only a process that never held either: the gateway runs in
    a child forked after the prctl. (Before, the handle read the gateway itself.)"""
    b = make_bastion(tmp_path, sshd, client_key[0], start=False)
    control_r, control_w = os.pipe()
    argv = cli_argv(b.home.root, "daemon", *b.daemon_args)
    with open(b.log, "ab") as log:
        reader = subprocess.Popen(
            unprivileged("/usr/bin/python3", "-c", EARLY_READER, "detach", str(control_r), *argv),
            stdout=subprocess.PIPE,
            stderr=log,
            pass_fds=(control_r,),
        )
    os.close(control_r)
    assert reader.stdout is not None
    gateway = 0
    try:
        reader.stdout.readline()  # it holds the daemon's memory, opened before the prctl
        wait_for(lambda: b.home.operator_socket.exists(), timeout=30)
        gateway = b.op("status")["pid"]
        b.unlock()  # the passphrase, and the journal identity that certifies at unlock
        told = [PASSPHRASE.encode(), journal_identity_seed(b)]
        os.write(control_w, b"\n".join(secret.hex().encode() for secret in told))
        assert reader.stdout.readline().strip() == b"not found"
    finally:
        os.close(control_w)
        if gateway:
            with contextlib.suppress(ProcessLookupError):
                os.kill(gateway, signal.SIGTERM)
        reader.communicate(timeout=60)
        b.close()


def test_a_process_tracing_the_command_gets_no_passphrase(offline_home: Bastion) -> None:
    """Attached before the command could close itself, a tracer sees all it does: so
    the command refuses to read the passphrase, and leaves it unread on stdin."""
    reader, stdin_w, control_w = early_reader(offline_home, "stay")
    assert reader.stdout is not None
    try:
        reader.stdout.readline()
        secret = PASSPHRASE.encode() + b"\n"
        os.write(stdin_w, secret)
        said = select.poll()
        said.register(reader.stdout, select.POLLIN)
        wait_for(lambda: said.poll(0) or unread(stdin_w) == 0, timeout=30)
        assert unread(stdin_w) == len(secret), "the passphrase was read"
        assert reader.stdout.readline().strip() == b"exit 1"
    finally:
        os.close(stdin_w)
        os.close(control_w)
        _, err = reader.communicate(timeout=30)
    assert b"is tracing this one" in err, err
