"""Outbound connections to real hosts, the byte relay, and honest outcomes.

Only this module talks to targets. It trusts exactly one host key per host
(the pinned one from the policy), offers exactly one client key (from the
vault, in memory), reads no ssh config, uses no agent and forwards nothing.

Outcomes are classified by what is *known*: before the exec request leaves,
a failure means nothing ran, and `Dispatcher.run` raises a `Refusal` (journaled
`not_started`; the agent may retry when its code says so); after it, `run`
returns a `Result`, and only an exit status or an exit signal from the target
is an answer -- any other ending is `unknown`. This module observes what
happened; `core/refusals.py` chooses the code and the words.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import asyncssh

from bastion.ca.vault_ca import Issued
from bastion.core.contract import Refusal
from bastion.core.defaults import KEEPALIVE_COUNT_MAX, KEEPALIVE_INTERVAL
from bastion.core.errors import BastionError
from bastion.core.events import Outcome, Result
from bastion.core.policy import Account, Host
from bastion.core.refusals import Fact, lost, refusal, rejected
from bastion.core.terminal import Terminal, modes_of
from bastion.gateway.acks import ACK_AT_ONCE
from bastion.gateway.pool import Connect, Pool
from bastion.gateway.stdin import CHANNEL_REQUESTS, Fed
from bastion.gateway.trim import TRIMMER
from bastion.gateway.warm import Opening, Parked, Warm
from bastion.gateway.window import hold
from bastion.vault import VaultError, VaultLocked

log = logging.getLogger(__name__)

CHUNK = 64 * 1024
OUTBOUND_CIPHERS = [
    "aes128-gcm@openssh.com",
    "aes256-gcm@openssh.com",
    "chacha20-poly1305@openssh.com",
    "aes128-ctr",
    "aes256-ctr",
]
# Channel refusals (MaxSessions) one command rides out: each lowers a connection's
# capacity for good, so a burst learns the target's limit within a few of them.
REFUSED_RETRIES = 16


class _ChannelRefused(BastionError):
    """The target refused an exec channel on a connection that carries others
    (sshd's MaxSessions): another connection may take it."""


class _IntentProcess(asyncssh.SSHClientProcess):  # type: ignore[type-arg]
    """Runs the intent at the last moment before the exec request is sent.

    asyncssh calls `connection_made` after the exec channel is confirmed
    and then sends the exec request without yielding to the event loop, so
    nothing (a lock, a revoke) can happen between the final decision and the
    request leaving. If the intent refuses, the channel is closed unused.

    With a terminal, a `pty-req` goes first and its answer is awaited: the intent
    then runs as the exec request is made, again with no await in between, and a
    terminal the target refuses leaves nothing decided or sent.
    """

    def __init__(self, intent: Callable[[], None], terminal: bool = False) -> None:
        super().__init__()
        self._intent = intent
        self._terminal = terminal

    def connection_made(self, chan: asyncssh.SSHClientChannel) -> None:  # type: ignore[type-arg]
        super().connection_made(chan)
        if not self._terminal:
            self._decide(chan)
            return
        make_request = chan._make_request

        async def intent_first(request: bytes, *args: bytes) -> bool | None:
            if request == b"exec":
                self._decide(chan)
            return await make_request(request, *args)

        chan._make_request = intent_first  # type: ignore[method-assign]

    def _decide(self, chan: asyncssh.SSHClientChannel) -> None:  # type: ignore[type-arg]
        try:
            self._intent()
        except BaseException:
            chan.close()
            raise


class _Tracked(asyncssh.SSHClient):
    """Knows when its connection is gone, so the pool never hands out a dead one."""

    def __init__(self) -> None:
        self.lost = False

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True


@dataclass(frozen=True)
class Streams:
    """The agent side of one exec: where bytes come from and go to. `stdin` is the
    agent's stream, or the bytes a command card showed and a yes is bound to
    (`stdin.Fed`: read whole before the card, then EOF)."""

    stdin: asyncssh.SSHReader[bytes] | Fed
    stdout: asyncssh.SSHWriter[bytes]
    stderr: asyncssh.SSHWriter[bytes]


@dataclass(frozen=True)
class Job:
    """One decided command, as the outbound side carries it out (`Dispatcher.run`).

    `intent` runs once the session channel is open and immediately before the exec
    request is sent, with no await in between: it re-decides and journals, and refuses
    by raising. `prepare` (a witness must hold the intent) runs once the connection is
    up and before the exec channel opens. With `certify` (a certificate account) the
    login is its certificate; with `terminal` the command runs with that terminal."""

    host: Host
    account: Account
    vault_epoch: int
    command: bytes
    streams: Streams  # the agent's channel: stdin, stdout, stderr
    intent: Callable[[], None]
    # Given the client process once the exec request left (to resize it, to signal it).
    on_exec: Callable[[asyncssh.SSHClientProcess[bytes]], None]
    abandon: asyncio.Event | None = None  # set: stop waiting for an ending (`kill`)
    certify: Callable[[], Awaitable[Issued]] | None = None
    prepare: Callable[[], Awaitable[None]] | None = None
    terminal: Terminal | None = None


PoolKey = tuple[str, int, str, str, str, int]


class Dispatcher:
    """Opens (and reuses) outbound connections; runs one command per call."""

    def __init__(
        self,
        private_key: Callable[[str], asyncssh.SSHKey],
        keepalive_interval: float = KEEPALIVE_INTERVAL,
        keepalive_count_max: int = KEEPALIVE_COUNT_MAX,
        pool: Pool | None = None,
        warm: Warm | None = None,
    ) -> None:
        self._private_key = private_key
        self.keepalive_interval = keepalive_interval
        self.keepalive_count_max = keepalive_count_max
        self.pool = pool or Pool()
        self.warm = warm or Warm()

    def _vault_key(self, host: Host, account: Account) -> asyncssh.SSHKey:
        try:
            return self._private_key(account.credential)
        except VaultLocked as exc:
            raise refusal(Fact.KEY_LOCKED) from exc
        except VaultError as exc:
            raise refusal(
                Fact.KEY_UNAVAILABLE,
                credential=account.credential,
                user=account.user,
                host=host.alias,
                why=exc,
            ) from exc

    async def _connect(self, host: Host, account: Account) -> asyncssh.SSHClientConnection:
        """Log in with the account's vault key (a pooled connection)."""
        client = _Tracked()
        try:
            return await asyncio.wait_for(
                asyncssh.connect(
                    host.address,
                    host.port,
                    **self._options(host, account),
                    client_factory=lambda: client,
                    client_keys=[self._vault_key(host, account)],
                    connect_timeout=host.connect_timeout,
                ),
                host.connect_timeout + 1,
            )
        except (OSError, TimeoutError, asyncssh.Error) as exc:
            offered = {"credential": account.credential}
            raise _failed(exc, host, account, Fact.KEY_REFUSED, offered) from exc

    def _options(self, host: Host, account: Account) -> dict[str, Any]:
        """asyncssh's options for every outbound connection: the pinned host key only,
        public keys only, nothing forwarded, no ssh config."""
        pinned = asyncssh.import_public_key(host.host_key)  # validated when the policy loaded
        return {
            "username": account.user,
            "known_hosts": ([pinned], [], []),
            "agent_path": None,
            "agent_forwarding": False,
            "x11_forwarding": False,
            "password": None,
            "kbdint_auth": False,
            "gss_auth": False,
            "host_based_auth": False,
            "preferred_auth": "publickey",
            "config": None,
            # AES-GCM first (one AEAD call per packet); chacha20 only if the
            # target offers nothing else. No compression.
            "encryption_algs": OUTBOUND_CIPHERS,
            "compression_algs": ["none"],
            "keepalive_interval": self.keepalive_interval,
            "keepalive_count_max": self.keepalive_count_max,
            # TCP whose reads are acknowledged at once: sshd before its first session
            # waits for each ACK, which Linux would delay 40 ms (gateway/acks.py).
            "tunnel": ACK_AT_ONCE,
        }

    def _open_parked(self, host: Host, account: Account) -> Opening:
        """Start a connection that exchanges keys, checks the pin, and stops at the auth
        step until it is given a certificate (`gateway/warm.py`). asyncssh's
        `connect_timeout` would bound the whole login, parked time included, so it is
        off: key exchange is bounded by `_parked_within`, the login by `_login`. Its
        `login_timeout` (from the TCP connect) closes one left parked past the warm
        set's recycling, before the target's LoginGraceTime would."""
        client = Parked()
        task = asyncio.ensure_future(
            asyncssh.connect(
                host.address,
                host.port,
                **self._options(host, account),
                client_factory=lambda: client,
                client_keys=None,  # none loaded: asyncssh asks the client for one
                connect_timeout=None,
                login_timeout=self.warm.recycle + 2 * host.connect_timeout,
            )
        )
        opening = Opening(client, task)
        opening.watch = asyncio.ensure_future(_parked_within(opening, host.connect_timeout))
        return opening

    async def _login(
        self, host: Host, account: Account, vault_epoch: int, issued: Issued
    ) -> asyncssh.SSHClientConnection:
        """A connection logged in with `issued`: the warm one parked for this target if
        it is still there, else one of its own (as before the warm set). A warm one
        found gone before the certificate left is replaced; after, it is a failure to
        connect, as on a fresh connection (the certificate may have been seen)."""
        opener = partial(self._open_parked, host, account)
        warm = self.warm.take(_warm_key(host, account), vault_epoch, opener)
        conn = None
        if warm is not None:
            try:
                conn = await self._given(warm, host, account, issued)
            except Refusal:
                if warm.client.sent:
                    raise
        if conn is None:
            conn = await self._given(opener(), host, account, issued)
        return conn

    async def _given(
        self, opening: Opening, host: Host, account: Account, issued: Issued
    ) -> asyncssh.SSHClientConnection:
        opening.client.give((issued.key, issued.certificate))
        try:
            return await asyncio.wait_for(asyncio.shield(opening.task), host.connect_timeout)
        except BaseException as exc:
            opening.close()
            if not isinstance(exc, (OSError, TimeoutError, asyncssh.Error)):
                raise
            offered = {"key_id": issued.key_id, "serial": issued.serial}
            raise _failed(exc, host, account, Fact.CERTIFICATE_REFUSED, offered) from exc

    def held(self) -> int:
        """Connections that still hold the key they authenticated with."""
        return self.pool.held()

    def close_all(self) -> None:
        """Drop every outbound connection (gateway stopping)."""
        self.pool.close_all()
        self.warm.retire_all()

    def retire_all(self) -> None:
        """The vault changed state: no pooled connection is reused. Idle ones
        close now; busy ones finish the command they were decided for. Every warm
        connection closes now (none carries a command yet)."""
        self.pool.retire_all()
        self.warm.retire_all()

    async def run(self, job: Job) -> Result:
        """Connect, exec, relay, classify (`service.Job` says what each part is for).
        With `certify` (a certificate account) the login is its certificate, on a
        connection of its own that closes after this one command.

        Raises `Refusal` for every ending before the exec request left (the intent's,
        the signer's and the witness's pass through unchanged); returns the `Result`
        once it was sent."""
        if job.certify is not None:
            return await self._run_certified(job, job.certify)
        host = job.host
        key, connect = self._pooled(host, job.account, job.vault_epoch)

        why = "open failed"
        for _ in range(REFUSED_RETRIES):
            slot = await self.pool.acquire(key, connect)
            try:
                await (job.prepare or _nothing)()
                return await self._exec(job, slot.conn)
            except _ChannelRefused as exc:
                why = str(exc)
                if slot.active <= 1:
                    break  # refused on a connection that carries nothing else
                self.pool.refused(slot)  # its MaxSessions is lower: another connection
            finally:
                await self.pool.release(slot)
        raise refusal(Fact.SESSION_REFUSED, host=host.alias, why=why)

    def _pooled(self, host: Host, account: Account, vault_epoch: int) -> tuple[PoolKey, Connect]:
        """The pool's key for this target, account and vault epoch, and how to open a
        connection for it (and know when it is gone)."""
        key: PoolKey = (
            host.address,
            host.port,
            account.user,
            account.credential,
            host.host_key,
            vault_epoch,
        )

        async def connect() -> tuple[asyncssh.SSHClientConnection, Callable[[], bool]]:
            conn = await self._connect(host, account)
            tracked: _Tracked = conn.get_owner()  # type: ignore[assignment]
            return conn, lambda: tracked.lost

        return key, connect

    async def open_sftp(
        self, host: Host, account: Account, vault_epoch: int
    ) -> tuple[asyncssh.SFTPClient, Callable[[], Awaitable[None]]]:
        """An sftp channel to the target on a pooled connection of this account's key (in
        this vault epoch), and what gives it back. Raises a `Refusal` when none can be
        opened: nothing was sent. Certificate accounts have no file access (`core/files`)."""
        key, connect = self._pooled(host, account, vault_epoch)

        slot = await self.pool.acquire(key, connect)
        try:
            client = await slot.conn.start_sftp_client()
        except (OSError, asyncssh.Error) as exc:
            await self.pool.release(slot)
            why = getattr(exc, "reason", None) or str(exc)
            raise refusal(Fact.SESSION_REFUSED, host=host.alias, why=why) from exc

        async def give_back() -> None:
            client.exit()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.wait_closed(), 5)
            await self.pool.release(slot)

        return client, give_back

    async def _run_certified(self, job: Job, certify: Callable[[], Awaitable[Issued]]) -> Result:
        """No pool: the certificate pins one command, so its connection carries only
        that one, and the key and certificate are dropped with it. The connection may be
        a warm one, opened (key exchange and pin done) before this command was asked."""
        host, account = job.host, job.account
        conn = await self._login(host, account, job.vault_epoch, await certify())
        try:
            await (job.prepare or _nothing)()
            return await self._exec(job, conn)
        except _ChannelRefused as exc:
            raise refusal(Fact.SESSION_REFUSED, host=host.alias, why=str(exc)) from exc
        finally:
            conn.close()
            # The target let this one in: park the next command's connection now (after
            # this command, so its key exchange does not compete with this one's run).
            self.warm.fill(_warm_key(host, account), job.vault_epoch)

    async def _exec(self, job: Job, conn: asyncssh.SSHClientConnection) -> Result:
        host = job.host
        try:
            _, proc = await conn.create_session(
                lambda: _IntentProcess(job.intent, job.terminal is not None),
                job.command,
                encoding=None,  # type: ignore[arg-type]
                **_terminal_args(job.terminal),
            )
            await proc.redirect(asyncssh.PIPE, asyncssh.PIPE, asyncssh.PIPE)
        except asyncssh.ChannelOpenError as exc:
            if exc.code == asyncssh.OPEN_REQUEST_SESSION_FAILED:
                return rejected(host.alias)
            if exc.code == asyncssh.OPEN_REQUEST_PTY_FAILED:  # before the intent: none sent
                raise refusal(Fact.TERMINAL_REFUSED, host=host.alias) from exc
            # The channel itself was refused, before the intent: nothing was decided
            # or sent. sshd says "open failed" when MaxSessions is reached.
            raise _ChannelRefused(exc.reason) from exc
        except (OSError, asyncssh.Error) as exc:
            return lost(host.alias, f"the connection failed while the command was sent: {exc}")
        job.on_exec(proc)
        relay = asyncio.ensure_future(_relay(host, proc, job.streams))
        if job.abandon is None:
            return await relay
        stop = asyncio.ensure_future(job.abandon.wait())
        try:
            await asyncio.wait({relay, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if relay.done():
            return relay.result()
        # The operator ended it and the target did not report an ending in
        # time (a remote child may still hold the channel open): stop
        # waiting, close our side, and say what is known -- nothing.
        relay.cancel()
        proc.close()
        return lost(host.alias, "the operator ended it before the target reported an exit status")


async def _relay(host: Host, proc: asyncssh.SSHClientProcess[bytes], agent: Streams) -> Result:
    hold(proc.channel)  # a slow agent holds the target back, not the gateway's memory
    agent_gone = asyncio.Event()

    async def to_agent(
        reader: asyncssh.SSHReader[bytes], writer: asyncssh.SSHWriter[bytes]
    ) -> None:
        # Drain the target even when the agent has left: the real outcome
        # still has to be observed and recorded.
        while data := await reader.read(CHUNK):
            TRIMMER.relayed(len(data))
            if agent_gone.is_set():
                continue
            try:
                writer.write(data)
                await writer.drain()
            except (OSError, asyncssh.Error):
                agent_gone.set()

    async def to_target() -> None:
        try:
            while True:
                try:
                    data = await agent.stdin.read(CHUNK)
                except CHANNEL_REQUESTS:  # not data: agent_channel refuses these first
                    continue
                if not data:
                    break
                TRIMMER.relayed(len(data))
                proc.stdin.write(data)
                await proc.stdin.drain()
        except (OSError, asyncssh.Error):
            agent_gone.set()
        with contextlib.suppress(OSError, asyncssh.Error):
            proc.stdin.write_eof()

    feeder = asyncio.create_task(to_target())
    try:
        await asyncio.gather(
            to_agent(proc.stdout, agent.stdout), to_agent(proc.stderr, agent.stderr)
        )
        await proc.wait_closed()
    except (OSError, asyncssh.Error) as exc:
        return lost(host.alias, f"the connection to the target was lost ({exc})")
    finally:
        feeder.cancel()
        TRIMMER.ended()
    if proc.exit_signal is not None:
        return Result(Outcome.SIGNALLED, signal=proc.exit_signal)
    if proc.exit_status is not None:  # None: the channel closed without one
        return Result(Outcome.COMPLETED, exit_status=proc.exit_status)
    return lost(host.alias, "the connection to the target ended before it reported an exit status")


def _warm_key(host: Host, account: Account) -> tuple[str, int, str, str]:
    """What a parked connection is for (in one vault epoch): a target, the user it asked
    to log in as, and the pin its key exchange checked."""
    return (host.address, host.port, account.user, host.host_key)


def _failed(
    exc: BaseException, host: Host, account: Account, refused: Fact, offered: dict[str, object]
) -> Refusal:
    """The refusal for a connection that did not log in: the pin did not match, the
    target refused the login (`refused`, with what was `offered`), or the network."""
    if isinstance(exc, asyncssh.HostKeyNotVerifiable):
        return refusal(Fact.HOST_KEY_CHANGED, host=host.alias, address=host.address, port=host.port)
    if isinstance(exc, asyncssh.PermissionDenied):
        return refusal(refused, host=host.alias, user=account.user, **offered)
    reason = getattr(exc, "strerror", None) or getattr(exc, "reason", None) or "timed out"
    return refusal(Fact.NETWORK, host=host.alias, address=host.address, port=host.port, why=reason)


async def _parked_within(opening: Opening, timeout: float) -> None:
    """A connection that has not reached the auth step within `timeout` (the host's
    connect timeout) is closed; one given its login meanwhile is `_given`'s to bound."""
    parked = asyncio.ensure_future(opening.client.parked.wait())
    try:
        await asyncio.wait({parked, opening.task}, timeout=timeout)
    finally:
        parked.cancel()
    if not (opening.client.parked.is_set() or opening.client.given or opening.task.done()):
        opening.close()


def _terminal_args(terminal: Terminal | None) -> dict[str, Any]:
    """create_session's arguments for the terminal the agent's client asked for, exactly
    as asked (`core/terminal` checked it can be), or for none."""
    if terminal is None:
        return {"request_pty": False}
    return {
        "request_pty": "force",
        "term_type": terminal.term_type.decode("ascii"),
        "term_size": terminal.size,
        "term_modes": modes_of(terminal.modes) or {},
    }


async def _nothing() -> None:
    """No step before the exec channel opens (no witness to wait for)."""
