"""File transfer, brokered: the sftp subsystem served to agents, each operation carried
to the target on an sftp channel of a pooled connection.

Every operation the agent's client asks is one request through the service's request
path (`Service.handle` with a `perform`): the gate decides it (`core/gate`, step 5 asks
`core/files.check_file`), a card is raised where it says so, the intent
(`dispatch_started`, durable and witnessed) is written with no await before the
operation leaves, and its outcome is journaled -- path, size, sha256 and the target's
SFTP status, never the bytes. One request is one open..close of a file, one listing,
one stat, one remove, rename, mkdir, rmdir or setstat; reads journal as writes do.

A per-command account's write is held here (up to `MAX_FILE_CARD_BYTES`) until the
agent closes the file; the file card then shows its path, size, sha256 and mode, and
only the approved bytes are written, whole, on the target. A session account's write
streams: its path is decided at open, and what went through is journaled at close.

Nothing here serves the gateway's own files: `Brokered` overrides every method of
asyncssh's `SFTPServer` (a unit test checks that none is left to the base class), and
its client relays reads and writes concurrently (`_Handler`): the agent's client
decides how many it keeps in flight. Where an operation acts (the walk) and when (the
turn) are the broker's (`gateway/sftp_broker.py`); this is the server surface.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import asyncssh
from asyncssh.constants import (
    FXF_APPEND,
    FXF_CREAT,
    FXF_READ,
    FXF_TRUNC,
    FXF_WRITE,
    FXP_READ,
    FXP_WRITE,
)
from asyncssh.packet import PacketDecodeError, SSHPacket
from asyncssh.sftp import SFTPServerHandler

from bastion.core.defaults import MAX_FILE_CARD_BYTES
from bastion.core.files import (
    FileKind,
    FileOp,
)
from bastion.core.policy import ApprovalMode, Policy
from bastion.gateway.service import AgentConn, Opened, Service
from bastion.gateway.sftp_broker import At, Broker, OpenSftp, never, sftp_error
from bastion.gateway.trim import TRIMMER

log = logging.getLogger(__name__)


MAX_RELAYED = 64  # reads and writes of one channel in flight at once


WRITE_CHUNK = 256 * 1024  # a held write goes to the target in pieces this size


class _Handler(SFTPServerHandler):
    """asyncssh's server handler answers one request at a time; this one relays reads
    and writes concurrently (their offsets say where they go), and lets every other
    request wait until those in flight are done, so a close follows its writes."""

    def __init__(self, broker: Broker, end: Callable[[], None], *args: Any) -> None:
        super().__init__(*args)
        self._broker = broker
        self._end = end
        self._flight: set[asyncio.Task[None]] = set()
        self._room = asyncio.Semaphore(MAX_RELAYED)

    async def recv_packets(self) -> None:
        try:
            while self._reader:
                packet = await self.recv_packet()
                pkttype = packet.get_byte()
                pktid = packet.get_uint32()
                self.log_received_packet(pkttype, pktid, packet)
                if pkttype in (FXP_READ, FXP_WRITE):
                    await self._room.acquire()
                    task = asyncio.ensure_future(self._relay(pkttype, pktid, packet))
                    self._flight.add(task)
                    task.add_done_callback(self._flight.discard)
                    continue
                await self._drain()
                await self._process_packet(pkttype, pktid, packet)
        except PacketDecodeError as exc:
            await self._drain()
            await self._cleanup(asyncssh.SFTPBadMessage(str(exc)))
        except EOFError:
            await self._drain()
            await self._cleanup(None)
        except (OSError, asyncssh.Error) as exc:
            await self._drain()
            await self._cleanup(exc)

    async def _relay(self, pkttype: int, pktid: int, packet: SSHPacket) -> None:
        try:
            await self._process_packet(pkttype, pktid, packet)
        finally:
            self._room.release()

    async def _drain(self) -> None:
        if self._flight:
            await asyncio.gather(*list(self._flight), return_exceptions=True)

    async def _cleanup(self, exc: Exception | None) -> None:
        """Files still open now were cut off, not closed; the channel's exit status
        goes out before asyncssh closes it (a client that gets none exits -1)."""
        self._broker.ending = True
        for file_obj in list(self._file_handles.values()):
            with contextlib.suppress(Exception):
                await self._server.close(file_obj)
        self._file_handles = {}
        self._end()
        await super()._cleanup(exc)


async def serve(
    service: Service,
    conn: AgentConn,
    process: asyncssh.SSHServerProcess[bytes],
    conversation: str | None,
    ssh_user: str,
    open_sftp: OpenSftp,
    later: Opened | None = None,
) -> None:
    """Serve one sftp channel to its end; every operation is a request of its own.
    `later`: the channel came after another on its connection, and what was seen of who
    can send through it as it opened; each operation is decided as a later channel's."""
    broker = Broker(service, conn, conversation, ssh_user, process.stderr, open_sftp)
    broker.later = later
    broker.wait_line = process.env.get("BASTION_WAIT_LINE")  # a file card's waiting line
    server = Brokered(process.channel, broker)  # type: ignore[arg-type]

    def end() -> None:
        with contextlib.suppress(OSError, asyncssh.Error):
            process.exit(0)

    handler = _Handler(broker, end, server, process.stdin, process.stdout, 3)
    try:
        await handler.run()
    finally:
        end()
        await broker.close()
        TRIMMER.ended()  # a transfer's pages go back once the gateway is quiet


@dataclass(eq=False)
class _Stream:
    """Bytes that went through one open file, in order: their count and sha256 (for a
    write whose pieces arrived out of order, the sha256 of none)."""

    size: int = 0
    sha: Any = field(default_factory=hashlib.sha256)
    ordered: bool = True

    def add(self, offset: int, data: bytes) -> None:
        if offset != self.size:
            self.ordered = False
        if self.ordered:
            self.sha.update(data)
        self.size = max(self.size, offset + len(data))

    def moved(self) -> tuple[int, str]:
        return self.size, self.sha.hexdigest() if self.ordered else "out-of-order"


@dataclass(eq=False)
class _File:
    """One file the agent opened: streamed through a target file (`remote`), or held
    whole for a file card (`held`)."""

    path: str
    kind: FileKind
    pflags: int
    attrs: asyncssh.SFTPAttrs
    remote: Any = None
    held: bytearray | None = None
    stream: _Stream = field(default_factory=_Stream)
    opened: asyncio.Future[None] | None = None
    closing: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Task[Any] | None = None
    refused: asyncssh.SFTPError | None = None
    read_len: int = 0  # a file only read: the most the target reads at once
    at: str | None = None  # where its open found the file (the walk's path)


async def read_through(remote: Any, read_len: int, offset: int, size: int) -> bytes:
    """An agent's read: one target request when the target reads that much at once (an
    OpenSSH client asks as much as we advertise, 255 KiB of an OpenSSH target), without
    asyncssh's machinery for splitting one read into many (a task, a buffer, two copies);
    else in the target's pieces at once, the bytes up to the first short piece."""
    if size <= read_len:
        one: bytes = await remote.read(size, offset)
        return one
    ats = range(offset, offset + size, read_len)
    parts = await asyncio.gather(
        *(remote.read(min(read_len, offset + size - at), at) for at in ats)
    )
    out = bytearray()
    for part in parts:
        out += part
        if len(part) < read_len:
            break
    return bytes(out)


def _mode(attrs: asyncssh.SFTPAttrs) -> int | None:
    return None if attrs.permissions is None else attrs.permissions & 0o7777


def _perms(attrs: asyncssh.SFTPAttrs) -> asyncssh.SFTPAttrs:
    """Of an open's or a mkdir's attributes, the mode alone: what sshd uses of them, and
    all the card shows."""
    return asyncssh.SFTPAttrs(permissions=_mode(attrs))


def _owner(attrs: asyncssh.SFTPAttrs) -> tuple[int, int] | None:
    return None if attrs.uid is None or attrs.gid is None else (attrs.uid, attrs.gid)


def _times(attrs: asyncssh.SFTPAttrs) -> tuple[int, int] | None:
    if attrs.atime is None or attrs.mtime is None:
        return None
    return (int(attrs.atime), int(attrs.mtime))


def _setstat_op(path: str, attrs: asyncssh.SFTPAttrs, follow: bool = True) -> FileOp:
    """A setstat as the gate, the card and the journal see it: every change it makes."""
    return FileOp(
        FileKind.SETSTAT,
        path,
        size=attrs.size,
        mode=_mode(attrs),
        owner=_owner(attrs),
        times=_times(attrs),
        follow=follow,
    )


def _change(attrs: asyncssh.SFTPAttrs) -> asyncssh.SFTPAttrs:
    """The attributes a setstat sends: those `_setstat_op` shows, and no other (an
    extended attribute, a v4+ field, nanoseconds the card would not show)."""
    owner, times = _owner(attrs), _times(attrs)
    return asyncssh.SFTPAttrs(
        size=attrs.size,
        uid=owner[0] if owner else None,
        gid=owner[1] if owner else None,
        permissions=_mode(attrs),
        atime=times[0] if times else None,
        mtime=times[1] if times else None,
    )


class Brokered(asyncssh.SFTPServer):
    """The agent's sftp server: every method carries one operation to the target
    through `Broker.request`, or refuses it; none touches the gateway's files."""

    def __init__(self, chan: asyncssh.SSHServerChannel[bytes], broker: Broker) -> None:
        super().__init__(chan)
        self.broker = broker

    # -- names ---------------------------------------------------------------------------

    def format_user(self, uid: int | None) -> str:
        return str(uid or 0)

    def format_group(self, gid: int | None) -> str:
        return str(gid or 0)

    def format_longname(self, name: asyncssh.SFTPName) -> None:
        return None  # the target's own longname, or none

    def map_path(self, path: bytes) -> bytes:
        return path

    def reverse_map_path(self, path: bytes) -> bytes:
        return path

    async def realpath(self, path: bytes) -> bytes:
        b = self.broker
        text = path.decode("utf-8", "surrogateescape")
        op = FileOp(FileKind.REALPATH, text if text else ".")

        async def carry(client: asyncssh.SFTPClient, at: At) -> bytes:
            return _bytes(await client.realpath(path or b"."))

        found: bytes = await b.request(op, carry)
        if b.home is None and path in (b".", b""):
            b.home = found.decode("utf-8", "surrogateescape")
        return found

    # -- files ---------------------------------------------------------------------------

    async def open(self, path: bytes, pflags: int, attrs: asyncssh.SFTPAttrs) -> _File:
        b = self.broker
        where = b.path(path)
        writes = bool(pflags & (FXF_WRITE | FXF_APPEND | FXF_CREAT | FXF_TRUNC))
        # Held whole (a per-command account's) unless it appends: the file is then written
        # truncated, so it holds exactly the bytes the card shows.
        whole = not pflags & FXF_APPEND
        f = _File(where, FileKind.WRITE if writes else FileKind.READ, pflags, _perms(attrs))
        if writes and self._held(where) and whole:
            f.held = bytearray()  # decided at close, on its file card
            return f
        op = FileOp(f.kind, where, mode=_mode(attrs), whole=whole)
        loop = asyncio.get_running_loop()
        f.opened = loop.create_future()

        async def carry(client: asyncssh.SFTPClient, at: At) -> None:
            # A file only read is read one target request per agent read (`read_through`).
            block = -1 if writes else 0
            f.remote = await client.open(at.path, pflags, f.attrs, encoding=None, block_size=block)
            at.landed()  # the handle holds the file the walk found
            f.at = at.path
            f.read_len = 0 if writes else client.limits.max_read_len
            assert f.opened is not None
            f.opened.set_result(None)
            try:
                await f.closing.wait()
            finally:
                await f.remote.close()

        f.done = asyncio.ensure_future(b.request(op, carry, f.stream.moved))
        await asyncio.wait({f.done, f.opened}, return_when=asyncio.FIRST_COMPLETED)
        if not f.opened.done():
            f.done.result()  # raises the request's SFTP error
            raise sftp_error(asyncssh.FX_FAILURE, "the file was not opened")
        return f

    def _held(self, path: str) -> bool:
        """A per-command account's write: held whole for its file card (the gate decides
        it at close; a policy that changes meanwhile is read again then)."""
        policy = self.broker.service.policy.current()
        host = policy.host(self.broker.conn.host) if isinstance(policy, Policy) else None
        account = host.account(self.broker.conn.user) if host is not None else None
        return account is not None and account.approval is ApprovalMode.PER_COMMAND

    async def read(self, file_obj: object, offset: int, size: int) -> bytes:
        f = self._file(file_obj)
        if f.remote is None or not f.pflags & FXF_READ:
            raise sftp_error(asyncssh.FX_PERMISSION_DENIED, "this file was not opened for reading")
        try:
            if f.read_len:
                data = await read_through(f.remote, f.read_len, offset, size)
            else:
                data = await f.remote.read(size, offset)
        except (OSError, asyncssh.Error) as exc:
            raise _as_sftp(exc) from None
        f.stream.add(offset, data)
        return data

    async def write(self, file_obj: object, offset: int, data: bytes) -> int:
        f = self._file(file_obj)
        if f.kind is not FileKind.WRITE:
            raise sftp_error(asyncssh.FX_PERMISSION_DENIED, "this file was not opened for writing")
        if f.refused is not None:
            raise f.refused
        if f.held is not None:
            end = offset + len(data)
            await self._grow(f, end)
            f.held[offset:end] = data
            return len(data)
        f.stream.add(offset, data)
        try:
            await f.remote.write(data, offset)
        except (OSError, asyncssh.Error) as exc:
            raise _as_sftp(exc) from None
        return len(data)

    async def _grow(self, f: _File, end: int) -> None:
        """A held file grown to `end` bytes, within the card's bound and the tenant's
        share of held bytes; past either, the gate's refusal, as it happens."""
        assert f.held is not None
        growth = end - len(f.held)
        if growth <= 0:
            return
        if end > MAX_FILE_CARD_BYTES or not self.broker.hold(growth):
            f.refused = await self._refuse_held(f, end, growth)
            raise f.refused
        f.held.extend(bytes(growth))

    async def _refuse_held(self, f: _File, size: int, growth: int) -> asyncssh.SFTPError:
        """The gate's refusal of a held write past the card's bound or the tenant's share
        (its world sees the share counted with this growth); then the bytes are let go."""
        op = FileOp(FileKind.WRITE, f.path, size=size, mode=_mode(f.attrs))
        try:
            await self.broker.request(op, never)
        except asyncssh.SFTPError as exc:
            return exc
        finally:
            self.broker.release(len(f.held or b"") + (growth if size <= MAX_FILE_CARD_BYTES else 0))
            f.held = bytearray()
        return sftp_error(asyncssh.FX_FAILURE, "refused")  # pragma: no cover -- the gate refuses

    async def close(self, file_obj: object) -> None:
        f = self._file(file_obj)
        if f.held is not None:
            if f.refused is not None:
                raise f.refused
            if self.broker.ending:
                self.broker.release(len(f.held))
                f.held = None  # cut off before its close: no card, nothing written
                return
            await self._write_held(f)
            return
        f.closing.set()
        if f.done is not None:
            await f.done

    async def _write_held(self, f: _File) -> None:
        """The file card: the exact bytes' size and sha256, written whole if approved."""
        data = bytes(f.held or b"")
        f.held = None
        digest = hashlib.sha256(data).hexdigest()
        op = FileOp(FileKind.WRITE, f.path, size=len(data), sha256=digest, mode=_mode(f.attrs))

        async def carry(client: asyncssh.SFTPClient, at: At) -> None:
            flags = FXF_WRITE | FXF_CREAT | FXF_TRUNC
            async with client.open(at.path, flags, f.attrs, encoding=None) as remote:
                at.landed()
                await asyncio.gather(
                    *(
                        remote.write(data[pos : pos + WRITE_CHUNK], pos)
                        for pos in range(0, len(data), WRITE_CHUNK)
                    )
                )

        try:
            await self.broker.request(op, carry, lambda: (len(data), digest))
        finally:
            self.broker.release(len(data))  # held until its card was answered and written

    def _file(self, file_obj: object) -> _File:
        if not isinstance(file_obj, _File):
            raise sftp_error(asyncssh.FX_FAILURE, "not an open file")
        return file_obj

    async def fstat(self, file_obj: object) -> asyncssh.SFTPAttrs:
        f = self._file(file_obj)
        if f.held is not None:
            return asyncssh.SFTPAttrs(size=len(f.held), permissions=f.attrs.permissions)
        try:
            attrs: asyncssh.SFTPAttrs = await f.remote.stat()
        except (OSError, asyncssh.Error) as exc:
            raise _as_sftp(exc) from None
        return attrs

    async def fsetstat(self, file_obj: object, attrs: asyncssh.SFTPAttrs) -> None:
        f = self._file(file_obj)
        if f.held is not None:
            # A held file is written with this mode and cut to this size (OpenSSH's scp
            # and sftp truncate so); its owner and times are the target's.
            if attrs.permissions is not None:
                f.attrs = _perms(attrs)
            if attrs.size is not None:
                if attrs.size < len(f.held):
                    self.broker.release(len(f.held) - attrs.size)
                    del f.held[attrs.size :]
                else:
                    await self._grow(f, attrs.size)
            return
        if f.remote is None:
            raise sftp_error(asyncssh.FX_FAILURE, "this file is not open")
        # On the handle: the file its open found, whatever its path leads to now.
        change = _change(attrs)
        remote = f.remote

        async def carry(client: asyncssh.SFTPClient, at: At) -> None:
            await remote.setstat(change)

        await self.broker.request(_setstat_op(f.path, attrs), carry, opened_at=f.at)

    async def fsync(self, file_obj: object) -> None:
        f = self._file(file_obj)
        if f.remote is not None:
            with contextlib.suppress(asyncssh.SFTPOpUnsupported):
                await f.remote.fsync()

    # -- paths ---------------------------------------------------------------------------

    async def _stat(self, path: bytes, follow: bool) -> asyncssh.SFTPAttrs:
        b = self.broker
        where = b.path(path)

        async def carry(client: asyncssh.SFTPClient, at: At) -> asyncssh.SFTPAttrs:
            return await (client.stat(at.path) if follow else client.lstat(at.path))

        op = FileOp(FileKind.STAT, where, follow=follow)
        result: asyncssh.SFTPAttrs = await b.request(op, carry)
        return result

    async def stat(self, path: bytes) -> asyncssh.SFTPAttrs:
        return await self._stat(path, True)

    async def lstat(self, path: bytes) -> asyncssh.SFTPAttrs:
        return await self._stat(path, False)

    async def readlink(self, path: bytes) -> bytes:
        b = self.broker
        where = b.path(path)

        async def carry(client: asyncssh.SFTPClient, at: At) -> bytes:
            return _bytes(await client.readlink(at.path))

        found: bytes = await b.request(FileOp(FileKind.STAT, where, follow=False), carry)
        return found

    async def scandir(self, path: bytes) -> AsyncIterator[asyncssh.SFTPName]:
        b = self.broker
        where = b.path(path)

        async def carry(client: asyncssh.SFTPClient, at: At) -> list[asyncssh.SFTPName]:
            return list(await client.readdir(at.path))

        names: list[asyncssh.SFTPName] = await b.request(FileOp(FileKind.LIST, where), carry)
        for name in names:
            yield name

    async def _mutate(
        self, kind: FileKind, path: bytes, act: Callable[[asyncssh.SFTPClient, str], Any]
    ) -> None:
        b = self.broker
        where = b.path(path)

        async def carry(client: asyncssh.SFTPClient, at: At) -> None:
            await act(client, at.path)

        await b.request(FileOp(kind, where), carry)

    async def remove(self, path: bytes) -> None:
        await self._mutate(FileKind.REMOVE, path, lambda c, p: c.remove(p))

    async def rmdir(self, path: bytes) -> None:
        await self._mutate(FileKind.RMDIR, path, lambda c, p: c.rmdir(p))

    async def mkdir(self, path: bytes, attrs: asyncssh.SFTPAttrs) -> None:
        b = self.broker
        where = b.path(path)
        perms = _perms(attrs)

        async def carry(client: asyncssh.SFTPClient, at: At) -> None:
            await client.mkdir(at.path, perms)

        await b.request(FileOp(FileKind.MKDIR, where, mode=_mode(attrs)), carry)

    async def setstat(self, path: bytes, attrs: asyncssh.SFTPAttrs) -> None:
        await self._setstat(path, attrs, follow=True)

    async def lsetstat(self, path: bytes, attrs: asyncssh.SFTPAttrs) -> None:
        await self._setstat(path, attrs, follow=False)

    async def _setstat(self, path: bytes, attrs: asyncssh.SFTPAttrs, follow: bool) -> None:
        """Exactly what the card and the journal show is sent: the size, mode, owner and
        times asked, nothing else the client put in the attributes."""
        b = self.broker
        change = _change(attrs)

        async def carry(client: asyncssh.SFTPClient, at: At) -> None:
            await client.setstat(at.path, change, follow_symlinks=follow)

        await b.request(_setstat_op(b.path(path), attrs, follow), carry)

    async def rename(self, oldpath: bytes, newpath: bytes) -> None:
        await self._rename(oldpath, newpath, posix=False)

    async def posix_rename(self, oldpath: bytes, newpath: bytes) -> None:
        await self._rename(oldpath, newpath, posix=True)

    async def _rename(self, oldpath: bytes, newpath: bytes, posix: bool) -> None:
        b = self.broker
        old, new = b.path(oldpath), b.path(newpath)

        async def carry(client: asyncssh.SFTPClient, at: At) -> None:
            await (client.posix_rename if posix else client.rename)(at.path, at.to)

        await b.request(FileOp(FileKind.RENAME, old, to=new), carry)

    # -- never ---------------------------------------------------------------------------

    async def symlink(self, oldpath: bytes, newpath: bytes) -> None:
        await self._link(newpath)

    async def link(self, oldpath: bytes, newpath: bytes) -> None:
        await self._link(newpath)

    async def _link(self, newpath: bytes) -> None:
        """A request the gate always refuses (`NO_LINKS`), so it is journaled and the
        agent reads why: never carried."""
        await self.broker.request(FileOp(FileKind.LINK, self.broker.path(newpath)), never)

    def open56(self, *args: Any) -> None:
        raise sftp_error(asyncssh.FX_OP_UNSUPPORTED, "bastion speaks SFTP version 3")

    def lock(self, *args: Any) -> None:
        raise sftp_error(asyncssh.FX_OP_UNSUPPORTED, "bastion does not lock files")

    def unlock(self, *args: Any) -> None:
        raise sftp_error(asyncssh.FX_OP_UNSUPPORTED, "bastion does not lock files")

    def statvfs(self, path: bytes) -> None:
        raise sftp_error(asyncssh.FX_OP_UNSUPPORTED, "bastion does not report file systems")

    def fstatvfs(self, file_obj: object) -> None:
        raise sftp_error(asyncssh.FX_OP_UNSUPPORTED, "bastion does not report file systems")

    def exit(self) -> None:
        return None


def _bytes(name: str | bytes) -> bytes:
    return name if isinstance(name, bytes) else name.encode("utf-8", "surrogateescape")


def _as_sftp(exc: Exception) -> asyncssh.SFTPError:
    if isinstance(exc, asyncssh.SFTPError):
        return exc
    return sftp_error(asyncssh.FX_CONNECTION_LOST, f"the target's connection failed: {exc}")
