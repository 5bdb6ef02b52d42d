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

Paths: the agent's path is made absolute against the home the target reported
(`realpath(".")`, which every sftp client asks first) and folded lexically; then, right
before the operation leaves, the walk (`core/files.walk`, asked through `Broker.walk`:
one batch of lstats, a readlink per symlink) finds where it leads on the target, and
the gate decides on that (`gate.file_resolved`): a path whose end cannot be told
exactly (more than `MAX_LINKS` links, a dangling link, a link it cannot read) is
refused, and the operation is sent for the walked path, which has no symlink left in
it, so nothing the target resolves can move it. sftp-server's own `realpath` is never
asked for a decision: it gives up at a smaller depth than the kernel's `open()`.

The turn (`Broker.turn`, `Service.file_turns`): one target account's file operations,
from every agent channel of this gateway, are carried one at a time from their walk to
the target's answer, so none of bastion's own (a rename of a symlink into place) lands
between another's walk and its use. What remains: a process on the target -- a command
bastion let run, still running, included -- that swaps a walked directory for a symlink
between the walk and the use can still redirect an operation (TOCTOU); the sftp
protocol has no open-beneath or no-follow open, and bastion cannot close that from
outside the target. An account whose commands are not trusted to run unwatched should
not also have files rules wider than those commands.

Nothing here serves the gateway's own files: `Brokered` overrides every method of
asyncssh's `SFTPServer` (a unit test checks that none is left to the base class), and
its client relays reads and writes concurrently (`_Handler`): the agent's client
decides how many it keeps in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
import logging
import stat
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
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

from bastion.core.contract import Failure
from bastion.core.defaults import MAX_FILE_CARD_BYTES, MAX_HELD_BYTES_PER_TENANT
from bastion.core.events import Outcome, Result
from bastion.core.files import (
    FileKind,
    FileOp,
    Lstat,
    Node,
    Resolution,
    absolute,
    follows_last,
    sftp_status,
    walk,
)
from bastion.core.gate import Channel, Dispatch, Request, file_resolved
from bastion.core.policy import Account, ApprovalMode, Host, Policy
from bastion.core.refusals import Fact, lost, refusal
from bastion.gateway.intent import Intent
from bastion.gateway.mux import MuxView
from bastion.gateway.service import AgentConn, Service, new_request_id
from bastion.gateway.tenants import Tenant
from bastion.gateway.trim import TRIMMER

log = logging.getLogger("bastion.sftp")

MAX_RELAYED = 64  # reads and writes of one channel in flight at once
WRITE_CHUNK = 256 * 1024  # a held write goes to the target in pieces this size


@dataclass(frozen=True)
class Later:
    """An sftp channel opened after another on its connection: who was seen connected
    to a run's ControlMaster as it opened, and whether only its own client can send
    through the connection (`senders.own_connection`); the gate decides on both."""

    opened: MuxView | None
    own: bool | None


class SubsystemProcess(asyncssh.SSHServerProcess):  # type: ignore[type-arg]
    """The agent's session: every subsystem request reaches the gateway's own process
    factory (`agent_ssh._serve`), which serves `sftp` here and refuses the rest with
    the agent-facing error; asyncssh's own sftp server (the gateway's files) never runs."""

    def subsystem_requested(self, subsystem: str) -> bool:
        return True

    def session_started(self) -> None:
        chan = self._chan
        stdin = asyncssh.SSHReader[bytes](self, chan)  # type: ignore[arg-type]
        stdout = asyncssh.SSHWriter[bytes](self, chan)  # type: ignore[arg-type]
        stderr = asyncssh.SSHWriter[bytes](self, chan, asyncssh.EXTENDED_DATA_STDERR)  # type: ignore[arg-type]
        handler = self._start_process(stdin, stdout, stderr)  # type: ignore[arg-type]
        if inspect.isawaitable(handler):
            assert self._conn is not None
            self._conn.create_task(handler, stdin.logger)


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
    later: Later | None = None,
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


OpenSftp = Callable[
    [Host, Account, int], Awaitable[tuple[asyncssh.SFTPClient, Callable[[], Awaitable[None]]]]
]


def _err(code: int, reason: str) -> asyncssh.SFTPError:
    return asyncssh.SFTPError(code, reason)


@dataclass(eq=False)
class _Lease:
    """The sftp channel operations ride, for one vault epoch's connection."""

    client: asyncssh.SFTPClient
    give_back: Callable[[], Awaitable[None]]
    epoch: int


@dataclass(eq=False)
class _Box:
    """What one operation produced, for the agent's answer."""

    value: Any = None
    error: asyncssh.SFTPError | None = None


class Broker:
    """One sftp channel's state: who asks, the home the target reported, the channel
    to the target, and each operation's trip through the request path."""

    def __init__(
        self,
        service: Service,
        conn: AgentConn,
        conversation: str | None,
        ssh_user: str,
        stderr: asyncssh.SSHWriter[bytes],
        open_sftp: OpenSftp,
    ) -> None:
        self.service = service
        self.conn = conn
        self.conversation = conversation
        self.ssh_user = ssh_user
        self.stderr = stderr
        self.open_sftp = open_sftp
        self.wait_line: str | None = None  # the agent's BASTION_WAIT_LINE, if it sent one
        self.holding = 0  # bytes this channel's open files hold for their file cards
        self.later: Later | None = None  # a later channel of its connection (`serve`)
        self.home: str | None = None
        self.ending = False
        self._lease: _Lease | None = None
        self._lease_lock = asyncio.Lock()

    # -- the target's channel ------------------------------------------------------------

    async def client(self, host: Host, account: Account) -> asyncssh.SFTPClient:
        """The sftp channel on a connection of the vault's current epoch: one opened
        before the vault changed state is given back, never reused."""
        epoch = self.service.vault.epoch
        async with self._lease_lock:
            lease = self._lease
            if lease is not None and lease.epoch != epoch:
                self._lease = None
                await lease.give_back()
                lease = None
            if lease is None:
                client, give_back = await self.open_sftp(host, account, epoch)
                lease = self._lease = _Lease(client, give_back, epoch)
            return lease.client

    # -- uploads held for their file cards ------------------------------------------

    def hold(self, size: int) -> bool:
        """Count `size` more bytes held for a file card against the tenant's share
        (`Service.held`); False when the share is then over its cap (the gate refuses)."""
        tenant = Tenant.of_subject(self.conn.peer.subject)
        self.service.held[tenant] += size
        self.holding += size
        return self.service.held[tenant] <= MAX_HELD_BYTES_PER_TENANT

    def release(self, size: int) -> None:
        """Held bytes given back: written, refused, abandoned, or cut."""
        size = min(size, self.holding)
        tenant = Tenant.of_subject(self.conn.peer.subject)
        self.holding -= size
        self.service.held[tenant] -= size
        if self.service.held[tenant] <= 0:
            del self.service.held[tenant]

    async def close(self) -> None:
        self.release(self.holding)  # files the agent never closed hold nothing any more
        lease, self._lease = self._lease, None
        if lease is not None:
            with contextlib.suppress(Exception):
                await lease.give_back()

    # -- paths --------------------------------------------------------------------------

    def path(self, raw: bytes) -> str:
        """The agent's path as the gate reads it: absolute and folded where it can be;
        one that cannot be carried exactly (not UTF-8, a NUL, relative before the home
        is known) goes to the gate as sent, which refuses it in its words, journaled."""
        text = raw.decode("utf-8", "surrogateescape")
        if not text or "\0" in text:
            return text
        return absolute(text, self.home) or text

    async def walk(self, client: asyncssh.SFTPClient, op: FileOp) -> tuple[Resolution, ...]:
        """Where the target's answers say each of the operation's paths leads
        (`core/files.walk` decides; this only asks): a batch of lstats at once, a
        readlink per symlink."""
        if op.kind is FileKind.REALPATH:
            return ()
        found = []
        for path in op.paths:
            steps = walk(path, follows_last(op))
            try:
                ask = next(steps)
                while True:
                    if isinstance(ask, Lstat):
                        nodes = await asyncio.gather(*(_node(client, p) for p in ask.paths))
                        ask = steps.send(tuple(nodes))
                    else:
                        ask = steps.send(await _link_text(client, ask.path))
            except StopIteration as end:
                found.append(end.value)
        return tuple(found)

    def turn(self, host: Host, account: Account) -> asyncio.Lock:
        """The target account's turn: its file operations are carried one at a time
        from their walk to the target's answer, so that none of them (a rename of a
        symlink into place, on another channel too) lands between another's walk and
        its use (`Service.file_turns`)."""
        key = (host.address, host.port, account.user)
        turns = self.service.file_turns
        lock = turns.get(key)
        if lock is None:
            lock = turns[key] = asyncio.Lock()
        return lock

    # -- one request --------------------------------------------------------------------

    async def request(
        self,
        op: FileOp,
        carry: Carry,
        moved: Callable[[], tuple[int, str] | None] = lambda: None,
        opened_at: str | None = None,
    ) -> Any:
        """One operation through the request path; its value, or an SFTP error (with
        the agent-facing JSON line on stderr when the gateway ended it). `opened_at`: the
        operation acts on an open file's handle, which holds the file its open found
        there; there is no path to walk."""
        op = replace(op, home=self.home)
        req = Request(
            new_request_id(),
            self.conn.host,
            self.conn.user,
            b"",
            self.conn.peer.subject.key,
            None,
            Channel.SFTP,
            self.ssh_user or None,
            file=op,
            later=self.later is not None,
        )
        log.info("%s: sftp %s for %s@%s", req.request_id, op.summary(), req.user, req.host)
        box = _Box()

        async def perform(decided: Dispatch, intent: Intent) -> Result:
            client = await self.client(decided.host, decided.account)
            at = At(self.turn(decided.host, decided.account))
            await at.take()
            try:
                try:
                    if opened_at is not None:
                        found: tuple[Resolution, ...] = (Resolution(opened_at),)
                    else:
                        found = await self.walk(client, op)
                except (OSError, asyncssh.Error) as exc:
                    raise refusal(Fact.WALK_CUT, host=decided.host.alias, why=exc) from None
                refused = file_resolved(decided.account, op, found)
                if refused is not None:
                    raise refused
                at.place(op, tuple(r.path for r in found if r.path is not None))
                intent.acts_on = at.moved(op)
                await intent.prepare()
                intent()  # the gate's last word, the grant spent, the intent durable
                try:
                    box.value = await carry(client, at)
                except asyncssh.SFTPError as exc:
                    box.error = exc
                    return Result(Outcome.COMPLETED, exit_status=exc.code, message=str(exc.reason))
                except (OSError, asyncssh.Error) as exc:
                    box.error = _err(asyncssh.FX_CONNECTION_LOST, "the target's connection failed")
                    return lost(decided.host.alias, f"the connection failed mid-operation: {exc}")
            finally:
                at.landed()
            if self.ending and op.kind in (FileKind.READ, FileKind.WRITE):
                box.error = _err(asyncssh.FX_CONNECTION_LOST, "the agent left")
                return replace(
                    lost(decided.host.alias, "the agent's connection ended with the file open"),
                    transferred=moved(),
                )
            return Result(Outcome.COMPLETED, exit_status=0, transferred=moved())

        result = await self.service.handle(
            self.conn,
            req,
            self.conversation,
            None,
            perform=perform,
            tell=self.stderr.write,
            wait_line=self.wait_line,
            opened=self.later.opened if self.later else None,
            own_at_open=self.later.own if self.later else None,
        )
        if isinstance(result, Failure):
            with contextlib.suppress(OSError, asyncssh.Error):
                self.stderr.write(result.json_line())
            raise _err(sftp_status(result.code.exit_status), result.message)
        if box.error is not None:
            raise box.error
        return box.value


async def _node(client: asyncssh.SFTPClient, path: str) -> Node:
    """What the target says `path` is, without following it: an answer for the walk.
    A failed connection is raised; every other failure is the target's own answer."""
    try:
        attrs = await client.lstat(path)
    except (asyncssh.SFTPNoSuchFile, asyncssh.SFTPNoSuchPath):
        return Node.MISSING
    except (asyncssh.SFTPConnectionLost, asyncssh.SFTPNoConnection):
        raise
    except asyncssh.SFTPError:
        return Node.UNKNOWN
    if attrs.permissions is None:
        return Node.UNKNOWN
    if stat.S_ISDIR(attrs.permissions):
        return Node.DIRECTORY
    return Node.LINK if stat.S_ISLNK(attrs.permissions) else Node.OTHER


async def _link_text(client: asyncssh.SFTPClient, path: str) -> str | None:
    """A symlink's text as the target reads it, or None when it will not say."""
    try:
        return _text(await client.readlink(path))
    except (asyncssh.SFTPError, UnicodeError):
        return None


Carry = Callable[[asyncssh.SFTPClient, "At"], Awaitable[Any]]


@dataclass(eq=False)
class At:
    """Where one operation acts on the target -- the paths the walk found, which have no
    symlink in them -- and the target account's turn (`Broker.turn`), held from the
    walk until the target answered the request that names them (`landed`)."""

    _turn: asyncio.Lock
    path: str = ""
    to: str = ""
    _held: bool = False

    async def take(self) -> None:
        await self._turn.acquire()
        self._held = True

    def place(self, op: FileOp, found: tuple[str, ...]) -> None:
        self.path = found[0] if found else op.path
        self.to = found[1] if len(found) > 1 else ""

    def moved(self, op: FileOp) -> tuple[str, ...]:
        """The paths acted on where they are not the paths asked (for the intent's
        record), else nothing."""
        acting = (self.path,) if op.to is None else (self.path, self.to)
        return acting if acting != op.paths else ()

    def landed(self) -> None:
        """The target answered the request that names the paths (an open holds its
        file from here on): the next operation's walk may begin."""
        if self._held:
            self._held = False
            self._turn.release()


def _text(name: str | bytes) -> str:
    return name.decode("utf-8", "surrogateescape") if isinstance(name, bytes) else name


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
            raise _err(asyncssh.FX_FAILURE, "the file was not opened")
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
            raise _err(asyncssh.FX_PERMISSION_DENIED, "this file was not opened for reading")
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
            raise _err(asyncssh.FX_PERMISSION_DENIED, "this file was not opened for writing")
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
            await self.broker.request(op, _never)
        except asyncssh.SFTPError as exc:
            return exc
        finally:
            self.broker.release(len(f.held or b"") + (growth if size <= MAX_FILE_CARD_BYTES else 0))
            f.held = bytearray()
        return _err(asyncssh.FX_FAILURE, "refused")  # pragma: no cover -- the gate refuses

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
            raise _err(asyncssh.FX_FAILURE, "not an open file")
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
            raise _err(asyncssh.FX_FAILURE, "this file is not open")
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
        await self.broker.request(FileOp(FileKind.LINK, self.broker.path(newpath)), _never)

    def open56(self, *args: Any) -> None:
        raise _err(asyncssh.FX_OP_UNSUPPORTED, "bastion speaks SFTP version 3")

    def lock(self, *args: Any) -> None:
        raise _err(asyncssh.FX_OP_UNSUPPORTED, "bastion does not lock files")

    def unlock(self, *args: Any) -> None:
        raise _err(asyncssh.FX_OP_UNSUPPORTED, "bastion does not lock files")

    def statvfs(self, path: bytes) -> None:
        raise _err(asyncssh.FX_OP_UNSUPPORTED, "bastion does not report file systems")

    def fstatvfs(self, file_obj: object) -> None:
        raise _err(asyncssh.FX_OP_UNSUPPORTED, "bastion does not report file systems")

    def exit(self) -> None:
        return None


async def _never(client: asyncssh.SFTPClient, at: At) -> None:
    raise AssertionError("the gate refuses this operation before it is carried")


def _bytes(name: str | bytes) -> bytes:
    return name if isinstance(name, bytes) else name.encode("utf-8", "surrogateescape")


def _as_sftp(exc: Exception) -> asyncssh.SFTPError:
    if isinstance(exc, asyncssh.SFTPError):
        return exc
    return _err(asyncssh.FX_CONNECTION_LOST, f"the target's connection failed: {exc}")
