"""One sftp channel's broker: each operation's trip from the agent's request to the
target's answer -- the walk, the turn, the gate, the intent, the outcome.

`gateway/sftp.py` is the SFTP server surface the agent's client talks to; it asks
this broker for every operation and answers with what it returns.

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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import stat
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import asyncssh

from bastion.core.contract import Failure
from bastion.core.defaults import MAX_HELD_BYTES_PER_TENANT
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
from bastion.core.policy import Account, Host
from bastion.core.refusals import Fact, lost, refusal
from bastion.gateway.intent import Intent
from bastion.gateway.service import AgentConn, Case, Opened, Service, new_request_id
from bastion.gateway.tenants import Tenant

log = logging.getLogger(__name__)


OpenSftp = Callable[
    [Host, Account, int], Awaitable[tuple[asyncssh.SFTPClient, Callable[[], Awaitable[None]]]]
]


def sftp_error(code: int, reason: str) -> asyncssh.SFTPError:
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
        # Of a channel opened after another on its connection: what was seen as it opened
        # (`serve`); None for the connection's first.
        self.later: Opened | None = None
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
                    lost_it = "the target's connection failed"
                    box.error = sftp_error(asyncssh.FX_CONNECTION_LOST, lost_it)
                    return lost(decided.host.alias, f"the connection failed mid-operation: {exc}")
            finally:
                at.landed()
            if self.ending and op.kind in (FileKind.READ, FileKind.WRITE):
                box.error = sftp_error(asyncssh.FX_CONNECTION_LOST, "the agent left")
                return replace(
                    lost(decided.host.alias, "the agent's connection ended with the file open"),
                    transferred=moved(),
                )
            return Result(Outcome.COMPLETED, exit_status=0, transferred=moved())

        case = Case(
            self.conn,
            req,
            self.conversation,
            opened=self.later or Opened(),
            tell=self.stderr.write,
            wait_line=self.wait_line,
            perform=perform,
        )
        result = await self.service.handle(case)
        if isinstance(result, Failure):
            with contextlib.suppress(OSError, asyncssh.Error):
                self.stderr.write(result.json_line())
            raise sftp_error(sftp_status(result.code.exit_status), result.message)
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
        return name_text(await client.readlink(path))
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


def name_text(name: str | bytes) -> str:
    return name.decode("utf-8", "surrogateescape") if isinstance(name, bytes) else name


async def never(client: asyncssh.SFTPClient, at: At) -> None:
    raise AssertionError("the gate refuses this operation before it is carried")
