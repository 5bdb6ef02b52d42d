"""An agent's side of bastion, for programs that are not a shell: run one command
through the stock ssh client, and ask the gateway the questions `bastion mcp`
answers (which hosts, what became of a request).

The command goes exactly the way an agent's `ssh -F CONFIG HOST 'COMMAND'` goes
-- the same ProxyCommand, agent socket, gate, cards and journal -- so nothing
here is trusted by the gateway: it reads who is asking from the kernel, as
always. What this module adds is what a model needs in place of a terminal:
bounded output with its true size, the bytes kept exact, and the gateway's
JSON error picked out of stderr.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shlex
import signal
import socket
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from bastion.agent.proxy import connect, reason
from bastion.agent.wire import ENDINGS, MAX_HEADER, PROTOCOL, read_refusal
from bastion.core.contract import NOT_SENT, Code, Exit
from bastion.core.errors import BastionError
from bastion.core.refusals import AGENT_SIDE, Observed

# What OpenSSH takes as a destination and a login name, and nothing that ssh could
# read as an option (a leading "-") or that needs quoting in SetEnv.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
USER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,31}")
ACTION_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/+=-]{0,199}")
REPLY_LIMIT = 1 << 20  # a query's answer (the hosts and their rules)
KILL_GRACE = 2.0  # seconds between SIGTERM and SIGKILL for an ssh past its time
ASK_TIMEOUT = 10.0
GATEWAY_EXITS = frozenset(int(e) for e in Exit)  # the gateway ended it: stderr's last line
SHOWN = 80  # characters of a refused value quoted back


class AgentError(BastionError):
    """The gateway could not be asked, or its answer is unusable; the message says
    which. Each class names what it `observed`; `core/refusals.py` chooses the `code`
    the agent is told."""

    observed: ClassVar[Observed] = Observed.GATEWAY_UNUSABLE

    @property
    def code(self) -> Code:
        return AGENT_SIDE[self.observed]


class Unsupported(AgentError):
    """Input refused before anything is sent: the message says what is wrong and
    what to send instead. The model's mistake, not a fault of the gateway."""

    observed = Observed.ARGUMENT


class Busy(AgentError):
    """The gateway did not answer in time (overloaded or stuck): nothing was sent,
    and the same call a little later may work."""

    observed = Observed.GATEWAY_SLOW


class Declined(AgentError):
    """The gateway answered, and the answer was no (an unknown request id, ...)."""

    observed = Observed.GATEWAY_DECLINED


def shown(value: str) -> str:
    """A refused value quoted back to the model, bounded."""
    return repr(value[:SHOWN]) + ("..." if len(value) > SHOWN else "")


def name_problem(field: str, value: str, pattern: re.Pattern[str], what: str) -> str | None:
    """Why `value` cannot be given to ssh as `field` (None: it can). A leading "-"
    is named for what it is: ssh would read it as an option of its own."""
    if pattern.fullmatch(value):
        return None
    if value.startswith("-"):
        why = "begins with '-', which ssh would read as an option of its own"
    else:
        why = f"is not {what} (letters, digits, '.', '_' and '-' only)"
    return f"`{field}` {shown(value)} {why}: send {what} as ssh_hosts lists it. {NOT_SENT}"


@dataclass(frozen=True)
class Command:
    """One command as a model asks for it."""

    host: str
    command: str
    user: str | None = None
    stdin: bytes = b""
    timeout_s: float = 600.0
    action_key: str | None = None
    ack_unknown: bool = False

    def checked(self) -> Command:
        """This command, or Unsupported saying what is wrong with it."""
        problem = name_problem("host", self.host, NAME, "a host alias") or (
            None if self.user is None else name_problem("user", self.user, USER, "an account")
        )
        if problem:
            raise Unsupported(problem)
        if self.action_key is not None and not ACTION_KEY.fullmatch(self.action_key):
            raise Unsupported(
                f"`action_key` {shown(self.action_key)} is not an action key: send 1-200 "
                f"letters, digits and . _ : / + = -, starting with a letter or digit. {NOT_SENT}"
            )
        if not self.command.strip():
            raise Unsupported(f"`command` is empty: send the command to run. {NOT_SENT}")
        if "\0" in self.command:
            raise Unsupported(
                "`command` contains a NUL byte, which ssh cannot send: send text without "
                f"one. {NOT_SENT}"
            )
        if not 0 < self.timeout_s <= 86400:
            raise Unsupported(
                f"`timeout_s` must be more than 0 and at most 86400 seconds. {NOT_SENT}"
            )
        return self


@dataclass(frozen=True)
class Kept:
    """One output stream, bounded: its first and last bytes, and how many it had."""

    head: bytes
    tail: bytes
    total: int

    @property
    def truncated(self) -> bool:
        return self.total > len(self.head) + len(self.tail)

    @property
    def data(self) -> bytes:
        if not self.truncated:
            return self.head + self.tail
        cut = self.total - len(self.head) - len(self.tail)
        return self.head + f"\n[... {cut} bytes not kept ...]\n".encode() + self.tail

    def as_json(self, name: str) -> dict[str, Any]:
        """Text when the kept bytes are UTF-8, else base64 of them, byte for byte."""
        data = self.data
        out: dict[str, Any] = {f"{name}_bytes": self.total, f"{name}_truncated": self.truncated}
        try:
            out[name] = data.decode("utf-8")
        except UnicodeDecodeError:
            import base64

            out[name] = None
            out[f"{name}_base64"] = base64.b64encode(data).decode()
        return out


class Keeper:
    """Keeps at most `limit` bytes of a stream: half from its start, half from its end."""

    def __init__(self, limit: int) -> None:
        self.half = max(limit // 2, 1)
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.half - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self.tail += chunk
            del self.tail[: max(len(self.tail) - self.half, 0)]

    def kept(self) -> Kept:
        return Kept(bytes(self.head), bytes(self.tail), self.total)


@dataclass(frozen=True)
class Ran:
    """What the ssh client gave back. `error` is the gateway's error object when the
    gateway ended the request (or the proxy could not reach it)."""

    stdout: Kept
    stderr: Kept
    exit_status: int | None
    error: dict[str, Any] | None
    timed_out: bool
    action_key: str


Progress = Callable[[int, int, float], Awaitable[None]]  # stdout bytes, stderr bytes, seconds


def gateway_error(stderr: bytes, exit_status: int | None) -> dict[str, Any] | None:
    """The gateway's JSON line, when the exit status says the gateway ended it (or
    ssh failed, 255, after the proxy printed one): the last such line on stderr."""
    if exit_status not in GATEWAY_EXITS and exit_status != 255:
        return None
    return error_line(stderr)


def error_line(stderr: bytes) -> dict[str, Any] | None:
    """The error object of the last JSON error line among stderr's last lines."""
    for line in reversed(stderr.decode("utf-8", "replace").splitlines()[-8:]):
        with contextlib.suppress(ValueError):
            doc = json.loads(line)
            if isinstance(doc, dict) and doc.get("ok") is False and "error" in doc:
                err = doc["error"]
                return err if isinstance(err, dict) else None
    return None


def ssh_argv(config: Path, cmd: Command, action_key: str) -> list[str]:
    """ssh's argv for `cmd`: options, then `--`, the destination and the command.

    ssh parses options again after the destination unless `--` ended them (ssh.c,
    `opt_terminated`): without it a command `-oProxyCommand=...` or `-F FILE` would
    run a local command. `-T`: no pty, so no escape character reads `stdin` either."""
    env = f"BASTION_ACTION_KEY={action_key}" + (" BASTION_ACK_UNKNOWN=1" if cmd.ack_unknown else "")
    env += " BASTION_WAIT_LINE=0"  # MCP tells of a waiting card as progress: not twice
    argv = ["ssh", "-F", str(config), "-T", "-o", f"SetEnv={env}"]
    if cmd.user is not None:
        argv += ["-l", cmd.user]
    return [*argv, "--", cmd.host, cmd.command]


def sftp_argv(config: Path, host: str, user: str | None) -> list[str]:
    """ssh's argv for one sftp channel (`sftp_wire`): `-s`, then `--`, the checked
    host alias and the literal subsystem name. Nothing a model sends is in it but
    the host and the account, both checked names; its paths travel inside SFTP
    packets only. `BASTION_WAIT_LINE=0`: MCP tells of a waiting card as progress."""
    argv = ["ssh", "-F", str(config), "-T", "-o", "SetEnv=BASTION_WAIT_LINE=0"]
    if user is not None:
        argv += ["-l", user]
    return [*argv, "-s", "--", host, "sftp"]


def ssh_env() -> dict[str, str]:
    """ssh runs the ProxyCommand as `$SHELL -c`; bash given a socket (ProxyUseFdpass)
    reads ~/.bashrc first unless SHLVL says it is nested. /bin/sh reads nothing."""
    return {**os.environ, "SHELL": "/bin/sh"}


async def run(
    config: Path, cmd: Command, limit: int, progress: Progress | None = None, every: float = 1.0
) -> Ran:
    """Run `cmd` through `ssh -F config`; kill ssh when `timeout_s` runs out (the
    gateway then records how far it got: ask `request_state` by the action key)."""
    cmd = cmd.checked()
    action_key = cmd.action_key or f"mcp:{uuid.uuid4()}"
    proc = await asyncio.create_subprocess_exec(
        *ssh_argv(config, cmd, action_key),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=ssh_env(),
        start_new_session=True,
    )
    out, err = Keeper(limit), Keeper(limit)
    # The gateway's JSON line is the last line of stderr: kept whole, beside the bound.
    err_end = bytearray()

    async def pump(stream: asyncio.StreamReader, keeper: Keeper, end: bytearray | None) -> None:
        while chunk := await stream.read(65536):
            keeper.add(chunk)
            if end is not None:
                end += chunk
                del end[: max(len(end) - 8192, 0)]

    async def feed() -> None:
        assert proc.stdin is not None
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            if cmd.stdin:
                proc.stdin.write(cmd.stdin)
                await proc.stdin.drain()
            proc.stdin.close()

    assert proc.stdout is not None and proc.stderr is not None
    work = asyncio.gather(feed(), pump(proc.stdout, out, None), pump(proc.stderr, err, err_end))
    loop = asyncio.get_running_loop()
    started = loop.time()
    timed_out = False
    while True:
        left = started + cmd.timeout_s - loop.time()
        if left <= 0:
            timed_out = True
            await stop(proc)
            break
        done, _ = await asyncio.wait({work}, timeout=min(every, left))
        if done:
            break
        if progress is not None:
            await progress(out.total, err.total, loop.time() - started)
    with contextlib.suppress(Exception):
        await asyncio.wait_for(work, 10)
    status = await proc.wait()
    exit_status = None if timed_out or status < 0 else status
    return Ran(
        out.kept(),
        err.kept(),
        exit_status,
        None if timed_out else gateway_error(bytes(err_end), exit_status),
        timed_out,
        action_key,
    )


async def stop(proc: asyncio.subprocess.Process) -> None:
    """SIGTERM ssh's process group (ssh and its proxy), SIGKILL after KILL_GRACE."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            await asyncio.wait_for(proc.wait(), KILL_GRACE)
            return
        except TimeoutError:
            continue


# -- the agent socket ------------------------------------------------------------------------


def _converse(sock_path: Path, fields: dict[str, str], limit: int) -> str:
    """One header line to the agent socket, one reply line back."""
    header = PROTOCOL + json.dumps(fields).encode() + b"\n"
    if len(header) > MAX_HEADER:
        raise AgentError("the question is too long")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            connect(sock, str(sock_path), ASK_TIMEOUT)
            sock.sendall(header)
            data = bytearray()
            while not data.endswith(b"\n") and len(data) <= limit:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
        except FileNotFoundError:
            raise AgentError(
                f"The bastion gateway is not running (no socket at {sock_path}); "
                "ask the operator to start `bastion daemon`."
            ) from None
        except (TimeoutError, BlockingIOError):  # no answer, or a queue full as long (EAGAIN)
            raise Busy(
                f"The bastion gateway at {sock_path} did not answer within {ASK_TIMEOUT:g} s "
                f"(it is overloaded or stuck). {NOT_SENT} Retry in a moment, and if it persists "
                "ask the operator to check `bastion status`."
            ) from None
        except OSError as exc:
            raise AgentError(
                f"Could not talk to the bastion gateway at {sock_path}: {reason(exc)}; "
                "ask the operator to check `bastion status`."
            ) from None
    reply = data.decode("utf-8", "replace").strip()
    if not reply.startswith("OK"):
        code, text = read_refusal(data)
        if code in ENDINGS and ENDINGS[code][2]:  # retryable: the gateway is full
            raise Busy(f"The bastion gateway is busy: {text}. {NOT_SENT}")
        raise Declined(text or "the gateway gave no answer")
    return reply[2:].strip()


def ask(sock_path: Path, fields: dict[str, str]) -> dict[str, Any]:
    """A query (`hosts`, `request`) and its JSON answer."""
    reply = _converse(sock_path, {"query": fields.pop("query"), **fields}, REPLY_LIMIT)
    try:
        answer = json.loads(reply)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        raise AgentError(
            "The bastion gateway's answer is not a JSON object; ask the operator to check "
            "`bastion status`."
        )
    return answer


def register_front(sock_path: Path) -> str:
    """Tell the gateway this process acts for its parent (the agent program that
    started it); the gateway reads who this process is from the kernel."""
    return _converse(sock_path, {"register": "front"}, MAX_HEADER)


def socket_of(config: Path) -> Path | None:
    """The agent socket an agents' ssh_config (`bastion ssh-config`) names in its
    ProxyCommand, so `bastion mcp --ssh-config FILE` needs nothing else."""
    for line in config.read_text().splitlines():
        words = line.strip().split(None, 1)
        if len(words) == 2 and words[0].lower() == "proxycommand":
            argv = shlex.split(words[1])
            if "--socket" in argv[:-1]:
                return Path(argv[argv.index("--socket") + 1])
    return None
