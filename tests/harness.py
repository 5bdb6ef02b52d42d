"""The integration harness: a real gateway, real ssh clients, driven as an operator would.

The pytest process plays the operator. Agents are `tests/agent_helper.py`
processes that run the stock OpenSSH client with the config `bastion
ssh-config` prints. Every wait is bounded, and waits on events (a card
appearing, a socket answering) rather than on the clock. The fixtures that
build these are in `conftest.py`; `bench/` uses this module too.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import fcntl
import getpass
import grp
import itertools
import json
import os
import pwd
import queue
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from cryptography.hazmat.primitives import serialization

from bastion import journal
from bastion.cli.agents import home_ssh_config
from bastion.cli.promptkeys import GUARD
from bastion.devtools.sshd_fixture import Sshd, SshdInfo
from bastion.home import Home
from bastion.ops import opsock

PASSPHRASE = "correct horse battery staple"
HELPER = Path(__file__).with_name("agent_helper.py")
USER = getpass.getuser()


@dataclass(frozen=True)
class Result:
    rc: int | None
    stdout: bytes
    stdout_len: int
    stdout_sha256: str
    stderr: str

    @property
    def error(self) -> dict[str, Any] | None:
        """The gateway's agent-facing JSON error: the last stderr line that is one (only
        when the gateway is unreachable does ssh print lines of its own after it)."""
        for line in reversed(self.stderr.strip().splitlines()):
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if isinstance(doc, dict) and "error" in doc:
                return doc["error"]
        return None

    @property
    def code(self) -> str | None:
        return self.error["code"] if self.error else None


class Agent:
    """A separate, long-lived process that runs ssh commands on request."""

    def __init__(
        self,
        config: Path,
        env: dict[str, str] | None = None,
        python: str = sys.executable,
        launcher: tuple[str, ...] = (),
    ) -> None:
        """`launcher` runs the helper under another program (e.g. `bastion run --`);
        `pid` is then the launcher's."""
        self.config = config
        self.proc = subprocess.Popen(
            [*launcher, python, str(HELPER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            # ssh runs the ProxyCommand as `$SHELL -c`, and bash with a socket on stdin
            # (ProxyUseFdpass) and no SHLVL reads ~/.bashrc first: on a machine whose rc
            # starts pyenv that is ~150 ms per command and a lock 64 agents queue on.
            env={**os.environ, "SHELL": "/bin/sh", **(env or {})},
        )
        self._ids = itertools.count(1)
        self._replies: dict[int, queue.Queue[dict[str, Any]]] = {}
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._ready()

    def _ready(self) -> None:
        self._replies.setdefault(0, queue.Queue()).get(timeout=30)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            reply = json.loads(line)
            self._replies.setdefault(reply["id"], queue.Queue()).put(reply)

    def start(
        self,
        command: str | list[str],
        host: str = "web1",
        ssh_args: tuple[str, ...] = (),
        stdin_path: Path | None = None,
        env: dict[str, str] | None = None,
        argv: list[str] | None = None,
    ) -> int:
        cmd = [command] if isinstance(command, str) else list(command)
        if argv is None:
            argv = ["ssh", "-F", str(self.config), *ssh_args, host, *cmd]
        rid = next(self._ids)
        self._replies.setdefault(rid, queue.Queue())
        assert self.proc.stdin is not None
        self.proc.stdin.write(
            json.dumps(
                {
                    "id": rid,
                    "argv": argv,
                    "env": env,
                    "stdin_path": str(stdin_path) if stdin_path else None,
                }
            )
            + "\n"
        )
        self.proc.stdin.flush()
        return rid

    def finished(self, rid: int) -> bool:
        """Has the ssh call `rid` ended (its result is waiting)?"""
        return self._replies[rid].qsize() > 0

    def wait(self, rid: int, timeout: float = 90) -> Result:
        reply = self._replies[rid].get(timeout=timeout)
        return Result(
            reply["rc"],
            base64.b64decode(reply["stdout"]),
            reply["stdout_len"],
            reply["stdout_sha256"],
            reply["stderr"],
        )

    def exec(self, argv: list[str]) -> None:
        """Replace this agent's program in place (same pid and start time)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"exec": argv}) + "\n")
        self.proc.stdin.flush()
        self._ready()

    def rename(self, name: str) -> None:
        """Set this agent's process name (what `ps` and /proc/PID/comm show)."""
        rid = next(self._ids)
        self._replies.setdefault(rid, queue.Queue())
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"id": rid, "rename": name}) + "\n")
        self.proc.stdin.flush()
        self._replies[rid].get(timeout=30)

    def run(self, command: str | list[str], **kw: Any) -> Result:
        return self.wait(self.start(command, **kw))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


WAITING_LINE = "bastion: waiting for approval of card "


def after_waiting(stderr: str, *cards: dict[str, Any]) -> str:
    """An agent's stderr less the line the gateway wrote as each of `cards` was raised
    (`core/waiting`), asserted there, first and in order: what is left came from the target."""
    lines = stderr.splitlines(keepends=True)
    for i, card in enumerate(cards):
        assert i < len(lines) and lines[i].startswith(f"{WAITING_LINE}{card['id']} "), stderr
    return "".join(lines[len(cards) :])


def policy_toml(
    sshd: SshdInfo,
    host_key: str | None = None,
    port: int | None = None,
    alias: str = "web1",
    **account: Any,
) -> str:
    """A one-host policy (`alias` -> the test sshd) with one account."""
    acct = {"user": USER, "credential": "deploy-key", "approval": "session", **account}
    lines = [
        f"[hosts.{alias}]",
        f'address = "{sshd.address}"',
        f"port = {port or sshd.port}",
        f'host_key = "{host_key or sshd.host_key}"',
        "connect_timeout = 5",
        "",
        f"[[hosts.{alias}.accounts]]",
    ]
    lines += [f"{k} = {toml_value(v)}" for k, v in acct.items()]
    return "\n".join(lines) + "\n"


def toml_value(value: object) -> str:
    """A policy value in TOML: JSON's spelling, but a table inline (`files = { read = [...]
    }`), which JSON's braces are not."""
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + " }"
    return json.dumps(value)


def cli_argv(home: Path, *args: str) -> list[str]:
    """The bastion CLI on a home, as an operator types it."""
    return [sys.executable, "-m", "bastion.cli", "--home", str(home), *args]


def bastion_cli(
    home: Path, *args: str, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the CLI on a home whatever its exit (no gateway object needed)."""
    return subprocess.run(
        cli_argv(home, *args),
        capture_output=True,
        text=True,
        timeout=60,
        input=stdin,
        stdin=None if stdin is not None else subprocess.DEVNULL,
    )


@dataclass
class Bastion:
    """One bastion home and its gateway, driven as an operator would."""

    root: Path
    sshd: SshdInfo
    home: Home = field(init=False)
    daemon: subprocess.Popen[bytes] | None = None
    agents: list[Agent] = field(default_factory=list)
    daemon_args: tuple[str, ...] = ("--approval-timeout", "20")

    def __post_init__(self) -> None:
        self.home = Home(self.root / "home")
        self.log = self.root / "gateway.log"
        self.config = self.root / "agent_ssh_config"

    def cli(
        self, *args: str, stdin: str | bytes | None = None, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        data = stdin.encode() if isinstance(stdin, str) else stdin
        r = subprocess.run(
            cli_argv(self.home.root, *args),
            input=data,
            capture_output=True,
            timeout=timeout,
        )
        out = subprocess.CompletedProcess(
            r.args, r.returncode, r.stdout.decode(), r.stderr.decode()
        )
        if check and r.returncode != 0:
            raise AssertionError(f"bastion {' '.join(args)} -> {r.returncode}: {out.stderr}")
        return out

    def op(self, name: str, **args: Any) -> Any:
        return opsock.call(self.home.operator_socket, name, timeout=60, **args)

    def write_policy(self, text: str, name: str = "test.toml") -> Path:
        path = self.home.policies / name
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
        return path

    def start_daemon(self, *extra: str, preexec_fn: Callable[[], None] | None = None) -> None:
        with open(self.log, "ab") as out:
            self.daemon = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "bastion.cli",
                    "--home",
                    str(self.home.root),
                    "daemon",
                    *self.daemon_args,
                    *extra,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=preexec_fn,
            )
        deadline = time.monotonic() + 20
        while True:
            try:
                self.op("status")
                return
            except opsock.OperatorError:
                assert self.daemon.poll() is None, self.log.read_text()
                assert time.monotonic() < deadline, "gateway did not start"
                time.sleep(0.02)

    def check_command(self, host: str, command: str, user: str = USER) -> dict[str, Any]:
        """`bastion check-command --json`, in process (the same click command)."""
        from click.testing import CliRunner

        from bastion.cli.main import main as cli_main

        argv = ["--home", str(self.home.root), "check-command", "--json", host, user, command]
        result = CliRunner().invoke(cli_main, argv)
        assert result.exit_code in (0, 1), result.output
        return json.loads(result.output)

    @property
    def gateway_pid(self) -> int:
        """The process that is the gateway: the child `bastion daemon` forks once its
        memory is closed (`bastion.memory`), not `daemon.pid`, which only waits for it."""
        pid = int(self.op("status")["pid"])
        assert self.daemon is not None and psutil.Process(pid).ppid() == self.daemon.pid
        return pid

    def kill_daemon(self) -> None:
        """SIGKILL `bastion daemon`, and wait until the gateway it forked is gone too
        (its PR_SET_PDEATHSIG kills it a moment after): a daemon started next must not
        find the dying gateway still answering on the old sockets."""
        assert self.daemon is not None
        try:
            forked = psutil.Process(self.daemon.pid).children()
        except psutil.NoSuchProcess:
            forked = []
        self.daemon.send_signal(signal.SIGKILL)
        self.daemon.wait(20)
        psutil.wait_procs(forked, timeout=20)
        assert not [p for p in forked if p.is_running()], forked

    def stop_daemon(self) -> None:
        if self.daemon is not None and self.daemon.poll() is None:
            self.daemon.terminate()
            self.daemon.wait(20)
        self.daemon = None

    def unlock(self) -> None:
        self.cli("unlock", "--passphrase-stdin", stdin=PASSPHRASE + "\n")

    def agent(self, **env: str) -> Agent:
        a = Agent(self.config, env or None)
        self.agents.append(a)
        return a

    def next_card(self, timeout: float = 20) -> dict[str, Any]:
        cards = self.op("pending", wait=timeout)
        assert cards, "no card arrived"
        return cards[0]

    def answer(self, card: dict[str, Any] | str, approve: bool) -> None:
        """Answer a card as `bastion decide` does."""
        card_id = card if isinstance(card, str) else card["id"]
        self.op("answer", card=card_id, approve=approve)

    def approve_next(self, timeout: float = 20) -> dict[str, Any]:
        card = self.next_card(timeout)
        self.answer(card, True)
        return card

    def close(self) -> None:
        for a in self.agents:
            a.close()
        self.stop_daemon()
        _open_copies.discard(self.home.root)


def _init_home(b: Bastion, key_file: Path) -> None:
    """`bastion init` and `bastion key import deploy-key KEY_FILE`, as an operator types them."""
    b.cli("init", "--passphrase-stdin", stdin=PASSPHRASE + "\n")
    b.cli(
        "key", "import", "deploy-key", str(key_file), "--passphrase-stdin", stdin=PASSPHRASE + "\n"
    )


# A bastion is a copy of a home `_init_home` made once per pytest process and key file,
# unless another copy is open: the two CLI processes cost about 1.5 s of CPU a bastion,
# hundreds of times a run. A home's files name no path, so the copy is what `init` makes
# there, but with the random keys of every other copy. No two open bastions share them:
# while one copy is open (a test's first bastion, a module's shared one), every other is
# made afresh. A copy under a test's own tmp_path is let go when that test ends, closed or
# not, and every copy when its module's last test ends (`release_copies`, conftest.py).
# Outside pytest (bench/) every home is made afresh.
_made_homes: dict[tuple[str, bytes], Path] = {}
_open_copies: set[Path] = set()


def _copy_made_home(b: Bastion, key_file: Path) -> bool:
    if "PYTEST_CURRENT_TEST" not in os.environ or _open_copies:
        return False
    key = (str(key_file.resolve()), key_file.read_bytes())
    made = _made_homes.get(key)
    if made is None:
        scratch = Bastion(Path(tempfile.mkdtemp(prefix="made-home-")), b.sshd)
        _init_home(scratch, key_file)
        atexit.register(shutil.rmtree, scratch.root, True)
        made = _made_homes[key] = scratch.home.root
    shutil.copytree(made, b.home.root, symlinks=True)
    _open_copies.add(b.home.root)
    return True


def release_copies(under: Path) -> None:
    """The end of what made the copies under `under` (a test's tmp_path, or `/` at the end
    of a module): they are no longer open."""
    for home in [h for h in _open_copies if h.is_relative_to(under)]:
        _open_copies.discard(home)


def make_bastion(
    root: Path, sshd: SshdInfo, key_file: Path, policy: str | None = None, start: bool = True
) -> Bastion:
    """A bastion home for `sshd` holding `key_file` as deploy-key, the agents' ssh_config,
    and (`start`) its gateway running and unlocked. What `bastion ssh-config` and `bastion
    unlock` do is done here in this process (`home_ssh_config`, the operator request):
    the setup of hundreds of tests starts no interpreter for them; the commands themselves
    run as processes in the tests of them (test_cli_matrix.py, `Bastion.unlock`)."""
    b = Bastion(root, sshd)
    if not _copy_made_home(b, key_file):
        _init_home(b, key_file)
    b.write_policy(policy if policy is not None else policy_toml(sshd))
    b.config.write_text(home_ssh_config(b.home))
    if start:
        b.start_daemon()
        unlocked = b.op("unlock", passphrase=base64.b64encode(PASSPHRASE.encode()).decode())
        assert unlocked["vault_epoch"], unlocked
    return b


CERT = {"auth": "certificate", "source_address": ["127.0.0.1"]}  # a certificate account


def ca_bastion(
    tmp_path: Path, server: Sshd, client_key: Path, with_ca: bool = True, **account: Any
) -> Bastion:
    """A bastion for `server` (one account, `account`'s fields) whose vault has a user CA
    that `server` trusts (`with_ca`), started and unlocked."""
    from bastion.ca import vault_ca  # the CA's code only where a test wants one
    from bastion.ops import unlocked
    from bastion.vault import Vault

    info = server.info
    assert info is not None
    b = make_bastion(tmp_path, info, client_key, policy_toml(info, **account), start=False)
    if with_ca:
        with unlocked(Vault.open(b.home.vault), PASSPHRASE.encode()) as vault:
            vault_ca.init(vault)
            server.trust_user_cas(vault_ca.public(vault.list_keys())["trusted_user_ca_keys"])
    b.start_daemon()
    b.unlock()
    return b


def unchecked_proxy(b: Bastion) -> tuple[str, str]:
    """ssh options for the config's ProxyCommand run through a shell that does not exec
    it: the proxy's parent is then no ssh, so it does not check the ssh's argv
    (`proxy.ssh_problem`), and what the ssh asks for reaches the gateway."""
    line = next(x for x in b.config.read_text().splitlines() if "ProxyCommand" in x)
    wrapped = line.split(None, 1)[1].replace(" %h %p %r", ' "$@"; :')
    return ("-o", f"ProxyCommand=/bin/sh -c '{wrapped}' sh %h %p %r")


def wait_for(predicate: Callable[[], object], timeout: float = 10.0) -> None:
    """Poll a condition the gateway exposes no event for, with a deadline."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def stop(proc: subprocess.Popen[Any], timeout: float = 30.0) -> None:
    """SIGTERM, then SIGKILL if it was not heeded within `timeout`. OpenSSH 9.2's client
    loop can miss a SIGTERM that lands between its quit check and ppoll (seen on CI with
    `ssh -N`, which then waits forever), so no test may rely on one alone."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)


def through_local_forward(
    argv: Callable[[list[str]], list[str]],
    port: int,
    err_path: Path,
    env: dict[str, str] | None = None,
    timeout: float = 30.0,
) -> tuple[bytes, str]:
    """Run the ssh `argv(options)` makes with `-N -L` to 127.0.0.1:`port`, connect once
    through it, and return what came back (sshd's banner where the forward works, b""
    where sshd refused the channel, then only once ssh said "open failed") and ssh's
    stderr."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        local = probe.getsockname()[1]
    options = ["-N", "-L", f"127.0.0.1:{local}:127.0.0.1:{port}", "-o", "ExitOnForwardFailure=yes"]
    with err_path.open("w") as err:
        client = subprocess.Popen(
            argv(options), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, env=env
        )
    try:
        conn: list[socket.socket] = []

        def connected() -> bool:
            assert client.poll() is None, err_path.read_text()
            try:
                conn.append(socket.create_connection(("127.0.0.1", local), timeout=2))
            except ConnectionRefusedError:
                return False
            return True

        wait_for(connected, timeout=timeout)
        with conn[0] as sock:
            sock.settimeout(timeout)
            got = sock.recv(64)  # b"" once ssh closes the refused channel's socket
        if not got:
            # The client reports the refusal just before it closes our socket.
            wait_for(lambda: "open failed" in err_path.read_text(), timeout=timeout)
    finally:
        stop(client, timeout=10)
    return got, err_path.read_text()


def secret_needles(key_file: Path) -> list[bytes]:
    """Every form in which the deploy key's secret could leak."""
    private = serialization.load_ssh_private_key(key_file.read_bytes(), None)
    seed = private.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    body = key_file.read_text().strip().splitlines()[1:-1]
    return [
        seed,
        seed.hex().encode(),
        base64.b64encode(seed)[:40],
        *(line.encode() for line in body[2:-1] if len(line) > 40),
    ]


ANSI = re.compile(rb"\x1b\[[0-9;]*m")


class Terminal:
    """A program on the slave side of a pty; we read its screen and type keys."""

    def __init__(self, argv: list[str], columns: int = 200, rows: int = 80) -> None:
        self.master, slave = os.openpty()
        # A size, as every terminal has (a new pty's is 0x0): the prompt fits its lines
        # to it. 200x80 is the pyte screen the tests read it with.
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
        self.proc = subprocess.Popen(
            argv, stdin=slave, stdout=slave, stderr=slave, start_new_session=True
        )
        os.close(slave)
        self.seen = b""
        self.raw = b""  # every byte the program wrote, escape sequences and all

    def expect(self, text: str, timeout: float = 20) -> str:
        """Wait until `text` appears on the screen after what was already matched."""
        deadline = time.monotonic() + timeout
        while True:
            plain = ANSI.sub(b"", self.seen)
            idx = plain.find(text.encode())
            if idx >= 0:
                self.seen = plain[idx + len(text) :]
                return plain[: idx + len(text)].decode("utf-8", "replace")
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{text!r} not shown; screen: {plain.decode()[-2000:]}")
            ready, _, _ = select.select([self.master], [], [], left)
            if ready:
                with contextlib.suppress(OSError):  # the program exited, closing the pty
                    chunk = os.read(self.master, 65536)
                    self.raw += chunk
                    self.seen += chunk

    def type(self, keys: str) -> None:
        os.write(self.master, keys.encode())

    def answer(self, key: str) -> None:
        """Answer the card `bastion approve` shows as a person does: past the guard time
        after it appeared, the key (`y` or `n`), then Enter when the prompt asks for it."""
        time.sleep(GUARD + 0.2)
        self.type(key)
        self.expect("press Enter to confirm")
        self.type("\r")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(10)
        os.close(self.master)


def python_copy(tmp_path: Path, name: str) -> Path:
    """A runnable python with another sha256 (ELF ignores trailing bytes)."""
    copy = tmp_path / name
    copy.write_bytes(Path(sys.executable).resolve().read_bytes() + name.encode())
    copy.chmod(0o755)
    return copy


# -- resilience helpers (tests/integration/test_resilience.py, test_control_master.py) ----


def start_daemon_limited(b: Bastion, nofile: int, *extra: str) -> None:
    """`b.start_daemon(*extra)` with the daemon's descriptor limit set to `nofile`,
    soft and hard alike (the daemon raises its soft limit to the hard one)."""
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    b.start_daemon(*extra, preexec_fn=limit)


def open_fds(pid: int) -> int:
    """How many descriptors process `pid` has open now."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def approved_agent(b: Bastion) -> Agent:
    """A new agent whose session card for web1 has been approved (by one command)."""
    agent = b.agent()
    rid = agent.start("true")
    b.approve_next()
    result = agent.wait(rid)
    assert result.rc == 0, result.stderr
    return agent


# -- witness helpers (tests/integration/test_witness.py) ----------------------------------


def write_bastion_toml(b: Bastion, text: str) -> None:
    """The gateway's own settings (`$BASTION_HOME/bastion.toml`), read at its start."""
    b.home.config.write_text(text)
    os.chmod(b.home.config, 0o600)


def witness_caught_up(b: Bastion, timeout: float = 30.0) -> dict[str, Any]:
    """Wait until every record written is durable (so the witness has been told of
    it) and every witness has confirmed every entry; returns `status`'s witness."""

    def done() -> bool:
        s = b.op("status")
        return s["journal"]["synced_seq"] == s["journal"]["seq"] and s["witness"]["waiting"] == 0

    wait_for(done, timeout)
    return b.op("status")["witness"]


def remove_user(name: str) -> None:
    """Remove a test's system user and group, if they exist (root only)."""
    with contextlib.suppress(KeyError):
        pwd.getpwnam(name)
        subprocess.run(["userdel", name], capture_output=True, timeout=60)
    with contextlib.suppress(KeyError):
        grp.getgrnam(name)
        subprocess.run(["groupdel", name], capture_output=True, timeout=60)


# -- certificate tests (test_certificate_*.py, test_openbao_*.py) --------------------------


@contextlib.contextmanager
def ssh_agent(directory: Path, timeout: float = 30.0) -> Iterator[Path]:
    """A real ssh-agent holding one key commented "held", so `ssh -A` has something to
    forward; yields its socket."""
    sock = directory / "agent.sock"
    agent = subprocess.Popen(
        ["ssh-agent", "-D", "-a", str(sock)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_for(sock.exists, timeout=timeout)
        held = directory / "held_key"
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "held", "-f", str(held)],
            check=True, timeout=timeout, capture_output=True,
        )  # fmt: skip
        subprocess.run(
            ["ssh-add", str(held)], env={**os.environ, "SSH_AUTH_SOCK": str(sock)},
            stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout, check=True,
        )  # fmt: skip
        yield sock
    finally:
        stop(agent, timeout)


@contextlib.contextmanager
def journal_frozen(home: Home) -> Iterator[None]:
    """The journal's live segment made immutable (chattr +i) for the block: every append
    fails. Skips the test where the filesystem cannot do it."""
    import pytest

    segment = journal.segments(home.journal)[-1]
    if subprocess.run(["chattr", "+i", str(segment)], capture_output=True).returncode != 0:
        pytest.skip("this filesystem cannot make the journal unwritable (chattr +i)")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(segment)], check=True)


# -- sandboxed runs (tests/integration/test_sandbox_attacks.py, test_sandbox_runs.py) ------


def run_agent(
    b: Bastion,
    *run_args: str,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> Agent:
    """An `Agent` whose helper runs inside `bastion run [RUN_ARGS] --` (the agent's pid is
    that of `bastion run`); `cwd` is the run's working directory (the project)."""
    chdir = ("env", "-C", str(cwd)) if cwd is not None else ()
    launcher = (*chdir, *cli_argv(b.home.root, "run", *run_args, "--"))
    agent = Agent(b.config, env, launcher=launcher)
    b.agents.append(agent)
    return agent


def inside(agent: Agent, *argv: str, timeout: float = 120) -> Result:
    """Run one program inside `agent`'s run (not through ssh) and wait for it."""
    return agent.wait(agent.start([], argv=list(argv)), timeout=timeout)


def pending_ids(b: Bastion) -> list[str]:
    return [c["id"] for c in b.op("pending")]


@dataclass
class HeldCard:
    """A run whose session card is pending: `touch MARKER` on the target is waiting for
    the operator. Attacks from inside the run try to get it answered."""

    b: Bastion
    agent: Agent
    rid: int
    card: dict[str, Any]
    marker: Path

    def assert_held(self) -> None:
        """The card is still the one pending and nothing ran on the target."""
        assert pending_ids(self.b) == [self.card["id"]], "the card was answered"
        assert not self.marker.exists(), "the command ran on the target"

    def deny(self) -> None:
        self.b.answer(self.card, False)
        assert self.agent.wait(self.rid).code == "SESSION_DENIED"
        assert not self.marker.exists()

    def wait_ran(self) -> None:
        """The card was answered yes by someone (a positive control): the command ran."""
        result = self.agent.wait(self.rid)
        assert result.rc == 0, result.stderr
        assert self.marker.exists()


def held_card(
    b: Bastion, marker: Path, *run_args: str, env: dict[str, str] | None = None
) -> HeldCard:
    """Start a default `bastion run` whose agent asks to `touch MARKER` on web1, and wait
    for its session card."""
    agent = run_agent(b, "--label", "attacker", *run_args, env=env)
    rid = agent.start(f"touch {marker}")
    card = b.next_card()
    assert card["subject"]["pid"] == agent.pid, card
    return HeldCard(b, agent, rid, card, marker)


# What a process may do to another: read its memory, trace it, signal it, see it in /proc;
# with a path, also read the file through its /proc/PID/root, and every command line seen.
TRACE_PROBE = """
import ctypes, json, os, sys
pid, addr = int(sys.argv[1]), int(sys.argv[2], 16)
libc = ctypes.CDLL(None, use_errno=True)
class iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
buf = ctypes.create_string_buffer(64)
local, remote = iovec(ctypes.addressof(buf), 64), iovec(addr, 64)
n = libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
out = {"proc": os.path.exists(f"/proc/{pid}"), "vm_readv": n if n >= 0 else -ctypes.get_errno()}
attach = libc.ptrace(16, pid, 0, 0)  # PTRACE_ATTACH
out["ptrace"] = 0 if attach == 0 else -ctypes.get_errno()
if attach == 0:
    libc.ptrace(17, pid, 0, 0)  # PTRACE_DETACH
try:
    os.kill(pid, 0); out["kill0"] = 0
except OSError as exc:
    out["kill0"] = -exc.errno
if len(sys.argv) > 3:
    try:
        out["root_tmp"] = open(f"/proc/{pid}/root{sys.argv[3]}").read()
    except OSError as exc:
        out["root_tmp"] = -exc.errno
    out["cmdlines"] = [
        open(f"/proc/{p}/cmdline", "rb").read().decode(errors="replace")
        for p in os.listdir("/proc") if p.isdigit() and os.path.exists(f"/proc/{p}/cmdline")
    ]
print(json.dumps(out))
"""


def readable_address(pid: int) -> str:
    """The start of a readable mapping of `pid` (for TRACE_PROBE's process_vm_readv)."""
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        span, perms = line.split()[:2]
        if perms.startswith("r"):
            return span.split("-")[0]
    raise AssertionError(f"no readable mapping in {pid}")


def master_pid(path: Path) -> int | None:
    """The pid of the ControlMaster listening on `path`, or None."""
    r = subprocess.run(
        ["ssh", "-F", "/dev/null", "-o", f"ControlPath={path}", "-O", "check", "web1"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    found = re.search(r"Master running \(pid=(\d+)\)", r.stderr)
    return int(found.group(1)) if found else None


def subcommands(group: Any) -> list[tuple[str, Any]]:
    """A click group's commands by name, through click's API: `bastion`'s own group
    imports its other modules' commands only when asked (`cli.main.Commands`)."""
    import click

    ctx = click.Context(group)
    return [(name, group.get_command(ctx, name)) for name in group.list_commands(ctx)]


# A stand-in for the operator socket's server (tests/integration/test_home_held.py,
# test_run_writes.py): argv PATH OUT; it answers like an unlocked gateway and writes to
# OUT every byte it was sent (an empty file: the CLI sent nothing).
FAKE_OPERATOR = r"""
import socket, sys
path, out = sys.argv[1], sys.argv[2]
server = socket.socket(socket.AF_UNIX)
server.bind(path)
server.listen(1)
server.settimeout(60)
got = b""
try:
    conn, _ = server.accept()
    conn.settimeout(10)
    while chunk := conn.recv(65536):
        got += chunk
        conn.sendall(b'{"ok": true, "result": {"locked": false, "vault_epoch": 99}}\n')
except OSError:
    pass
finally:
    open(out, "wb").write(got)
"""
