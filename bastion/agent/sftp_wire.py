"""`bastion mcp`'s file tools: one file up or down through the stock ssh client's
`sftp` subsystem channel, speaking SFTP version 3 here.

Why the protocol and not the `sftp` program: a batch for `sftp -b` is a command
language (`!cmd` runs a LOCAL shell, a leading `-` changes what an error does, quotes,
globs and newlines change what a line means), so a model's path would have to be
quoted for it exactly, and one mistake runs a command on the agent's machine. Here
a path is only ever the length-prefixed string of one SFTP packet: it reaches no
shell, no batch and no argv. ssh's argv is fixed (`client.sftp_argv`: `-s`, `--`,
the checked host alias, the literal subsystem name), so the gateway sees what an
agent's `sftp` would show it -- the same subject, gate, file cards and journal.

The client side of SFTP v3 that one transfer needs is small: init, realpath, open,
read, write, fstat, fsetstat, close. Reads and writes are pipelined (`WINDOW` in
flight) and every answer is matched to its request by id.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import struct
import unicodedata
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bastion.agent.client import (
    NAME,
    USER,
    Unsupported,
    error_line,
    name_problem,
    sftp_argv,
    shown,
    ssh_env,
    stop,
)
from bastion.core.contract import NOT_SENT
from bastion.core.errors import BastionError

MAX_FILE_BYTES = 64 * 1024 * 1024  # core/defaults.MAX_FILE_CARD_BYTES (a unit test ties them)
MAX_PATH_BYTES = 4096  # core/files.MAX_PATH
CHUNK = 32 * 1024  # bytes per read or write request (what OpenSSH's sftp asks)
WINDOW = 32  # reads or writes in flight at once
MAX_PACKET = 256 * 1024 + 1024  # the longest answer taken (a DATA of CHUNK, a NAME)
ERR_KEPT = 8192  # bytes of ssh's stderr kept: the gateway's JSON line is the last

# SFTP v3 (draft-ietf-secsh-filexfer-02)
INIT, VERSION, OPEN, CLOSE, READ, WRITE = 1, 2, 3, 4, 5, 6
FSTAT, FSETSTAT, REALPATH = 8, 10, 16
STATUS, HANDLE, DATA, NAME_REPLY, ATTRS = 101, 102, 103, 104, 105
FXF_READ, FXF_WRITE, FXF_CREAT, FXF_TRUNC = 0x1, 0x2, 0x8, 0x10
ATTR_SIZE, ATTR_UIDGID, ATTR_PERMISSIONS, ATTR_ACMODTIME, ATTR_EXTENDED = 1, 2, 4, 8, 1 << 31
FX_OK, FX_EOF = 0, 1
STATUS_NAMES = {
    1: "end of file",
    2: "no such file",
    3: "permission denied",
    4: "failure",
    5: "bad message",
    6: "no connection",
    7: "connection lost",
    8: "operation unsupported",
}


def path_problem(path: str) -> str | None:
    """Why `path` cannot be sent as the file's path (None: it can). Absolute only: a
    relative path would mean the target's idea of a home, which the model cannot see."""
    if "\0" in path or any(unicodedata.category(c) == "Cc" for c in path):
        why = "contains a NUL, newline or other control character"
    elif not path.startswith("/"):
        why = "is not an absolute path (it must begin with '/')"
    else:
        try:
            size = len(path.encode("utf-8"))
        except UnicodeEncodeError:
            size = -1
        if size < 0:
            why = "is not valid Unicode text (a lone surrogate)"
        elif size > MAX_PATH_BYTES:
            why = f"is longer than {MAX_PATH_BYTES} bytes"
        else:
            return None
    return f"`path` {shown(path)} {why}: send the file's absolute path. {NOT_SENT}"


def _checked_common(host: str, user: str | None, path: str, timeout_s: float) -> None:
    problem = (
        name_problem("host", host, NAME, "a host alias")
        or (None if user is None else name_problem("user", user, USER, "an account"))
        or path_problem(path)
    )
    if problem:
        raise Unsupported(problem)
    if not 0 < timeout_s <= 86400:
        raise Unsupported(f"`timeout_s` must be more than 0 and at most 86400 seconds. {NOT_SENT}")


@dataclass(frozen=True)
class Put:
    """One file to write, whole, as a model asks for it."""

    host: str
    path: str
    data: bytes
    user: str | None = None
    mode: int | None = None
    timeout_s: float = 600.0

    @classmethod
    def of(
        cls,
        host: str,
        path: str,
        content: str | None,
        content_base64: str | None,
        user: str | None = None,
        mode: str | None = None,
        timeout_s: float = 600.0,
    ) -> Put:
        """The model's arguments read: exactly one of `content` (text, sent as UTF-8)
        and `content_base64`; `mode` as octal digits ("0644")."""
        if (content is None) == (content_base64 is None):
            raise Unsupported(
                "send exactly one of `content` (text) and `content_base64` (any bytes). " + NOT_SENT
            )
        if content is not None:
            try:
                data = content.encode("utf-8")
            except UnicodeEncodeError:
                raise Unsupported(
                    f"`content` is not valid Unicode text: send it as `content_base64`. {NOT_SENT}"
                ) from None
        else:
            assert content_base64 is not None
            try:
                data = base64.b64decode(content_base64, validate=True)
            except ValueError:
                raise Unsupported(
                    f"`content_base64` is not base64 (A-Z a-z 0-9 + / and = padding). {NOT_SENT}"
                ) from None
        bits = None
        if mode is not None:
            if not (3 <= len(mode) <= 5 and all(c in "01234567" for c in mode)):
                raise Unsupported(
                    f'`mode` {shown(mode)} is not octal permission bits: send e.g. "0644". '
                    + NOT_SENT
                )
            bits = int(mode, 8)
            if bits > 0o7777:
                raise Unsupported(f"`mode` {shown(mode)} is more than 07777. {NOT_SENT}")
        return cls(host, path, data, user, bits, timeout_s).checked()

    def checked(self) -> Put:
        _checked_common(self.host, self.user, self.path, self.timeout_s)
        if len(self.data) > MAX_FILE_BYTES:
            raise Unsupported(
                f"the content is {len(self.data)} bytes, more than the {MAX_FILE_BYTES} bytes "
                f"a file card holds: write a smaller file. {NOT_SENT}"
            )
        return self


@dataclass(frozen=True)
class Get:
    """One file to read, up to `max_bytes` of it."""

    host: str
    path: str
    user: str | None = None
    max_bytes: int = 256 * 1024
    timeout_s: float = 600.0

    def checked(self) -> Get:
        _checked_common(self.host, self.user, self.path, self.timeout_s)
        if not 0 < self.max_bytes <= MAX_FILE_BYTES:
            raise Unsupported(
                f"`max_bytes` must be more than 0 and at most {MAX_FILE_BYTES}. {NOT_SENT}"
            )
        return self


# -- the protocol ----------------------------------------------------------------------------


class WireClosed(BastionError):
    """The channel ended (or sent what is not SFTP) before the answer came."""


class Status(BastionError):
    """An SFTP status other than OK: the target's answer, or the gateway's refusal
    (which then also wrote its JSON error line on the channel's stderr)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"{STATUS_NAMES.get(code, f'status {code}')}: {message}")
        self.code = code
        self.message = message


def _string(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def _attrs(size: int | None = None, mode: int | None = None) -> bytes:
    flags, body = 0, b""
    if size is not None:
        flags |= ATTR_SIZE
        body += struct.pack(">Q", size)
    if mode is not None:
        flags |= ATTR_PERMISSIONS
        body += struct.pack(">I", mode)
    return struct.pack(">I", flags) + body


class _Reader:
    """Fields of one packet, in order; WireClosed when it is shorter than they say."""

    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    def take(self, n: int) -> bytes:
        if self.at + n > len(self.data):
            raise WireClosed("a short SFTP packet")
        out = self.data[self.at : self.at + n]
        self.at += n
        return out

    def uint32(self) -> int:
        value: int = struct.unpack(">I", self.take(4))[0]
        return value

    def uint64(self) -> int:
        value: int = struct.unpack(">Q", self.take(8))[0]
        return value

    def string(self) -> bytes:
        return self.take(self.uint32())

    def attrs(self) -> dict[str, int]:
        flags = self.uint32()
        out: dict[str, int] = {}
        if flags & ATTR_SIZE:
            out["size"] = self.uint64()
        if flags & ATTR_UIDGID:
            out["uid"], out["gid"] = self.uint32(), self.uint32()
        if flags & ATTR_PERMISSIONS:
            out["permissions"] = self.uint32()
        if flags & ATTR_ACMODTIME:
            out["atime"], out["mtime"] = self.uint32(), self.uint32()
        if flags & ATTR_EXTENDED:
            for _ in range(self.uint32()):
                self.string(), self.string()
        return out


class Wire:
    """An SFTP v3 client over a byte stream pair (ssh's stdout and stdin)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.ids = iter(range(1, 1 << 32))
        self.waiting: dict[int, asyncio.Future[tuple[int, _Reader]]] = {}
        self.pump: asyncio.Task[None] | None = None
        self.sent = 0  # bytes of file content sent

    async def _packet(self) -> tuple[int, _Reader]:
        try:
            head = await self.reader.readexactly(4)
            (size,) = struct.unpack(">I", head)
            if not 1 <= size <= MAX_PACKET:
                raise WireClosed(f"an SFTP packet of {size} bytes")
            body = await self.reader.readexactly(size)
        except asyncio.IncompleteReadError:
            raise WireClosed("the channel ended") from None
        return body[0], _Reader(body[1:])

    async def start(self) -> None:
        self.writer.write(struct.pack(">IBI", 5, INIT, 3))
        await self.writer.drain()
        kind, r = await self._packet()
        if kind != VERSION:
            raise WireClosed(f"SFTP packet type {kind} in place of the version")
        if r.uint32() < 3:
            raise WireClosed("the server speaks an SFTP version before 3")
        self.pump = asyncio.ensure_future(self._answers())

    async def _answers(self) -> None:
        try:
            while True:
                kind, r = await self._packet()
                rid = r.uint32()
                fut = self.waiting.pop(rid, None)
                if fut is not None and not fut.done():
                    fut.set_result((kind, r))
        except (WireClosed, OSError) as exc:
            for fut in self.waiting.values():
                if not fut.done():
                    fut.set_exception(WireClosed(str(exc)))
            self.waiting.clear()

    def _send(self, kind: int, body: bytes) -> asyncio.Future[tuple[int, _Reader]]:
        rid = next(self.ids)
        fut: asyncio.Future[tuple[int, _Reader]] = asyncio.get_running_loop().create_future()
        if self.pump is None or self.pump.done():
            fut.set_exception(WireClosed("the channel ended"))
            return fut
        self.waiting[rid] = fut
        payload = struct.pack(">BI", kind, rid) + body
        self.writer.write(struct.pack(">I", len(payload)) + payload)
        return fut

    async def _ask(self, kind: int, body: bytes, want: int) -> _Reader:
        fut = self._send(kind, body)
        with contextlib.suppress(ConnectionError):
            await self.writer.drain()
        return _expect(await fut, want)

    async def realpath(self, path: str) -> str:
        r = await self._ask(REALPATH, _string(path.encode()), NAME_REPLY)
        if r.uint32() < 1:
            raise WireClosed("a realpath answer without a name")
        return r.string().decode("utf-8", "replace")

    async def open(self, path: str, pflags: int, mode: int | None = None) -> bytes:
        body = _string(path.encode()) + struct.pack(">I", pflags) + _attrs(mode=mode)
        return (await self._ask(OPEN, body, HANDLE)).string()

    async def close(self, handle: bytes) -> None:
        await self._ask(CLOSE, _string(handle), STATUS)

    async def fstat(self, handle: bytes) -> dict[str, int]:
        return (await self._ask(FSTAT, _string(handle), ATTRS)).attrs()

    async def fsetstat(self, handle: bytes, mode: int) -> None:
        await self._ask(FSETSTAT, _string(handle) + _attrs(mode=mode), STATUS)

    async def write_all(self, handle: bytes, data: bytes) -> None:
        """`data` at offset 0 on, WINDOW writes in flight; the first failure raises."""
        flight: set[asyncio.Future[tuple[int, _Reader]]] = set()
        for at in range(0, len(data), CHUNK):
            piece = data[at : at + CHUNK]
            body = _string(handle) + struct.pack(">Q", at) + _string(piece)
            fut = self._send(WRITE, body)
            flight.add(fut)
            self.sent = at + len(piece)
            with contextlib.suppress(ConnectionError):
                await self.writer.drain()
            if len(flight) >= WINDOW:
                done, flight = await asyncio.wait(flight, return_when=asyncio.FIRST_COMPLETED)
                for d in done:
                    _expect(d.result(), STATUS)
        for fut in flight:
            _expect(await fut, STATUS)

    async def read_upto(self, handle: bytes, limit: int) -> bytes:
        """The file's bytes from offset 0, at most `limit` of them (short reads asked
        again for their rest), WINDOW reads in flight."""
        got: dict[int, bytes] = {}
        todo = [(at, min(CHUNK, limit - at)) for at in range(0, limit, CHUNK)]
        todo.reverse()
        eof = limit
        flight: dict[asyncio.Future[tuple[int, _Reader]], tuple[int, int]] = {}
        while todo or flight:
            while todo and len(flight) < WINDOW:
                at, n = todo.pop()
                if at >= eof:
                    continue
                body = _string(handle) + struct.pack(">QI", at, n)
                flight[self._send(READ, body)] = (at, n)
            if not flight:
                break
            with contextlib.suppress(ConnectionError):
                await self.writer.drain()
            done, _ = await asyncio.wait(flight, return_when=asyncio.FIRST_COMPLETED)
            for d in done:
                at, n = flight.pop(d)
                kind, r = d.result()
                if kind == STATUS:
                    code, message = r.uint32(), r.string().decode("utf-8", "replace")
                    if code != FX_EOF:
                        raise Status(code, message)
                    eof = min(eof, at)
                    continue
                data = _expect((kind, r), DATA).string()[:n]
                got[at] = data
                if not data:
                    eof = min(eof, at)
                elif len(data) < n:
                    todo.append((at + len(data), n - len(data)))
        out = bytearray()
        while len(out) in got and got[len(out)] and len(out) < eof:
            out += got[len(out)]
        return bytes(out[: min(limit, eof)])


def _expect(answer: tuple[int, _Reader], want: int) -> _Reader:
    """The answer's body when it is the `want` kind; Status for a failed status."""
    kind, r = answer
    if kind == STATUS:
        code, message = r.uint32(), r.string().decode("utf-8", "replace")
        if code != FX_OK or want != STATUS:
            raise Status(code, message)
        return r
    if kind != want:
        raise WireClosed(f"SFTP answer type {kind} in place of {want}")
    return r


# -- one transfer through ssh ----------------------------------------------------------------


@dataclass(frozen=True)
class Moved:
    """What one transfer came to. `error` is the gateway's error object (its JSON line
    on the channel's stderr), `status` the SFTP failure the target answered, `broken`
    why the channel ended without one; at most one of them is set."""

    data: bytes = b""  # a get's bytes (at most max_bytes)
    size: int | None = None  # a get: the file's size the target reported
    truncated: bool = False
    error: dict[str, Any] | None = None
    status: Status | None = None
    broken: str | None = None
    timed_out: bool = False
    opened: bool = False  # the file's open was sent: past this, a put may have changed it
    stderr: bytes = b""


Progress = Callable[[int, float], Awaitable[None]]  # content bytes sent, seconds


async def put(wire: Wire, req: Put, state: dict[str, bool]) -> Moved:
    await wire.realpath(".")  # the home: `~/` rules mean it (the gateway learns it here)
    state["opened"] = True
    handle = await wire.open(req.path, FXF_WRITE | FXF_CREAT | FXF_TRUNC, req.mode)
    await wire.write_all(handle, req.data)
    if req.mode is not None:
        await wire.fsetstat(handle, req.mode)  # exact bits: open's mode meets the umask
    await wire.close(handle)  # a per-command account's file card is decided here
    return Moved(opened=True)


async def get(wire: Wire, req: Get, state: dict[str, bool]) -> Moved:
    await wire.realpath(".")
    state["opened"] = True
    handle = await wire.open(req.path, FXF_READ)
    size = (await wire.fstat(handle)).get("size")
    data = await wire.read_upto(handle, req.max_bytes + 1)
    await wire.close(handle)
    truncated = len(data) > req.max_bytes
    return Moved(
        data[: req.max_bytes],
        size if truncated and size is not None else min(len(data), req.max_bytes),
        truncated,
        opened=True,
    )


async def transfer(
    config: Path,
    req: Put | Get,
    progress: Progress | None = None,
    every: float = 1.0,
    argv: list[str] | None = None,
) -> Moved:
    """Carry `req` on one `ssh -s ... sftp` channel; kill ssh when its time runs out.
    The gateway's error, when it ended an operation, is read once ssh has exited, so
    its stderr line is whole."""
    argv = argv or sftp_argv(config, req.host, req.user)
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=ssh_env(),
        start_new_session=True,
    )
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    err = bytearray()

    async def drain_err() -> None:
        assert proc.stderr is not None
        while chunk := await proc.stderr.read(65536):
            err.extend(chunk)
            del err[: max(len(err) - ERR_KEPT, 0)]

    wire = Wire(proc.stdout, proc.stdin)  # type: ignore[arg-type]
    state = {"opened": False}

    async def work() -> Moved:
        await wire.start()
        return await (put(wire, req, state) if isinstance(req, Put) else get(wire, req, state))

    errs = asyncio.ensure_future(drain_err())
    task = asyncio.ensure_future(work())
    loop = asyncio.get_running_loop()
    started = loop.time()
    timed_out = False
    try:
        while True:
            left = started + req.timeout_s - loop.time()
            if left <= 0:
                timed_out = True
                task.cancel()
                break
            done, _ = await asyncio.wait({task}, timeout=min(every, left))
            if done:
                break
            if progress is not None:
                await progress(wire.sent, loop.time() - started)
    except BaseException:  # the call itself was cancelled: ssh does not outlive it
        task.cancel()
        await stop(proc)
        raise
    outcome: Moved | BaseException
    try:
        outcome = await task
    except (asyncio.CancelledError, WireClosed, Status, OSError) as exc:
        outcome = exc
    # The end of the channel: the gateway's last words are on stderr once ssh exits.
    with contextlib.suppress(OSError):
        proc.stdin.close()
    if timed_out:
        await stop(proc)
    else:
        try:
            await asyncio.wait_for(proc.wait(), 30)
        except TimeoutError:
            await stop(proc)
    with contextlib.suppress(Exception):
        await asyncio.wait_for(errs, 10)
    if wire.pump is not None:
        wire.pump.cancel()
    tail = bytes(err)
    opened = state["opened"]
    if timed_out:
        return Moved(timed_out=True, opened=opened, stderr=tail)
    if isinstance(outcome, Moved):
        return outcome
    error = error_line(tail)
    if error is not None:
        return Moved(error=error, opened=opened, stderr=tail)
    if isinstance(outcome, Status):
        return Moved(status=outcome, opened=opened, stderr=tail)
    return Moved(broken=str(outcome) or type(outcome).__name__, opened=opened, stderr=tail)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
