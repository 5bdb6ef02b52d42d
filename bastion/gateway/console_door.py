"""The console's TCP door: its two loopback listeners, who is at the other end of
each connection, and how many each peer may hold.

The operator socket knows its peer from the kernel (SO_PEERCRED); this door finds
the console's the same way a unix socket would have told it: the process holding
the other end of the connection (`identity/tcp_peers`), found before a byte of
HTTP is read. That process is judged as the operator socket judges its peer: a
process in another PID or user namespace than the gateway's (a sandbox,
`procs.in_other_namespaces`) or at or below a process the gateway knows as an
agent -- a registered `bastion run` above all (`Gateway.agent_processes`,
`identity.descends_from`) -- is refused, and so is a peer that cannot be found (in
another network namespace, or held by a process the gateway cannot read). A
refused connection is reset unread, and the log says once per process why.

Every connection counts from accept to close, and beyond a bound it is reset at
once, unread: `CONSOLE_IDENTIFYING` waiting for their peer, `per_peer` per peer
process (pid and start), `ceiling` in all (the console's share of the descriptor
limit: `descriptors.budget`). An idle connection -- no request within
`idle_seconds` of its accept or of its last answer, a half-sent request included --
is closed by aiohttp's keep-alive timer; an event stream is not idle while it
sends, and one whose writes stop draining is closed by `Console._events`.

The listeners set SO_REUSEADDR, so sockets in TIME-WAIT on the port do not keep
the console out; a port another process listens on does, and the gateway starts
without its console and says so (`failure`).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import errno
import logging
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bastion.core import opguard
from bastion.core.defaults import CONSOLE_CONNECTIONS_PER_PEER, CONSOLE_IDENTIFYING
from bastion.gateway import descriptors
from bastion.identity import descends_from, procs, tcp_peers

log = logging.getLogger(__name__)

LOOPBACKS = ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1"))
HINTS = 8  # peer processes admitted last, whose descriptors are read first
LOGGED = 1024  # (reason, process) pairs logged once; beyond, the oldest are forgotten
ACCEPT_RETRY = (0.05, 1.0)  # seconds: first and longest pause after a failed accept
RETRY = 5.0  # seconds between two tries to listen, while the console's port is taken
_ONE_CONNECTION_LOST = {errno.ECONNABORTED, errno.EPROTO, errno.EINTR, errno.EAGAIN}
_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close sends RST, leaves no TIME-WAIT

INSIDE_A_RUN = (
    "it is inside a `bastion run` or an agent's process tree; nothing inside a run "
    "may use the operator's console"
)

AgentProcesses = Callable[[], set[tuple[int, float]]]


@dataclass(frozen=True)
class Seen:
    """What one connection's peer turned out to be."""

    pid: int | None
    start_ticks: int
    name: str  # /proc/PID/comm
    refusal: str | None  # why it is refused, in words; None: admitted
    kind: str  # "admitted", "inside_run", "sandboxed", "unidentified"
    read: int  # descriptors read to find it
    took: float  # seconds

    def who(self) -> str:
        return f"pid {self.pid} ({self.name})" if self.pid is not None else "an unknown peer"


@dataclass
class Refused:
    inside_run: int = 0
    sandboxed: int = 0
    unidentified: int = 0
    full: int = 0  # the console's ceiling
    peer_full: int = 0  # the peer's own cap
    busy: int = 0  # too many waiting to be identified

    def as_json(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class _Costs:
    count: int = 0
    seconds: float = 0.0
    most: float = 0.0
    fds: int = 0

    def add(self, seen: Seen) -> None:
        self.count += 1
        self.seconds += seen.took
        self.most = max(self.most, seen.took)
        self.fds += seen.read

    def as_json(self) -> dict[str, float | int]:
        mean = self.seconds / self.count if self.count else 0.0
        return {
            "count": self.count,
            "mean_ms": round(mean * 1000, 3),
            "max_ms": round(self.most * 1000, 3),
            "descriptors_read_mean": round(self.fds / self.count, 1) if self.count else 0,
        }


class _Counted(asyncio.Protocol):
    """aiohttp's protocol for one connection, told to the door when it ends."""

    def __init__(self, inner: asyncio.Protocol, ended: Callable[[], None]) -> None:
        self._inner = inner
        self._ended = ended

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        try:
            self._inner.connection_lost(exc)
        finally:
            self._ended()


class ConsoleDoor:
    """Both loopback listeners of one console and every connection they accept."""

    def __init__(
        self,
        protocol: Callable[[], asyncio.Protocol],
        agent_processes: AgentProcesses,
        ceiling: int,
        per_peer: int = CONSOLE_CONNECTIONS_PER_PEER,
        identifying: int = CONSOLE_IDENTIFYING,
    ) -> None:
        self._protocol = protocol
        self._agents = agent_processes
        self.ceiling = ceiling
        self.per_peer = per_peer
        self.identifying_max = identifying
        self.open = 0  # connections held: being identified, or served
        self.identifying = 0
        self.refused = Refused()
        self.costs = _Costs()
        self.accept_errors = 0
        self._per_peer: collections.Counter[tuple[int, int]] = collections.Counter()
        self._hints: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._logged: collections.OrderedDict[tuple[str, Any], None] = collections.OrderedDict()
        self._listeners: list[socket.socket] = []
        self.serving = False
        self.failure: str | None = None  # why it does not listen (yet)
        self._tasks: set[asyncio.Task[None]] = set()
        self._peers = tcp_peers.PeerSockets()  # used by the one walker thread only
        self._pool = concurrent.futures.ThreadPoolExecutor(1, "bastion-console-peer")

    # -- listening ---------------------------------------------------------------------

    def start(self, port: int, started: Callable[[], None]) -> None:
        """Listen now; or say why not (`failure`, logged once per reason) and try again
        every RETRY seconds -- a socket left in TIME-WAIT by another program that did
        not allow reuse keeps even SO_REUSEADDR out, for a minute. `started` is called
        once it listens."""
        if self._open_now(port, started):
            return
        task = asyncio.get_running_loop().create_task(self._retry(port, started))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _open_now(self, port: int, started: Callable[[], None]) -> bool:
        failure = self.listen(port)
        if failure is not None:
            if failure != self.failure:  # once per reason, not once per try
                log.warning(
                    "console: not started: %s; the gateway goes on without it, and tries "
                    "again every %g s",
                    failure,
                    RETRY,
                )
            self.failure = failure
            return False
        self.failure, self.serving = None, True
        started()
        return True

    async def _retry(self, port: int, started: Callable[[], None]) -> None:
        while True:
            await asyncio.sleep(RETRY)
            if self._open_now(port, started):
                return

    def listen(self, port: int) -> str | None:
        """Listen on 127.0.0.1:PORT and [::1]:PORT, or say why not (nothing listens
        then: a console on one address only could be impersonated on the other)."""
        for family, address in LOOPBACKS:
            try:
                self._listeners.append(_listener(family, address, port))
            except OSError as exc:
                if family == socket.AF_INET6 and exc.errno in (
                    errno.EADDRNOTAVAIL,
                    errno.EAFNOSUPPORT,
                ):
                    continue  # no IPv6 loopback here: then nobody can listen on it either
                for sock in self._listeners:
                    sock.close()
                self._listeners.clear()
                return _why_not(family, address, port, exc)
        loop = asyncio.get_running_loop()
        for sock in self._listeners:
            task = loop.create_task(self._serve(sock))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return None

    async def close(self) -> None:
        for sock in self._listeners:
            sock.close()
        for task in list(self._tasks):
            task.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._peers.close()

    def status(self) -> dict[str, Any]:
        return {
            "connections": self.open,  # held: being identified, judged, or served
            "served": sum(self._per_peer.values()),  # handed to aiohttp, open now
            "identifying": self.identifying,
            "limit": self.ceiling,
            "limit_per_peer": self.per_peer,
            "accept_errors": self.accept_errors,
            "refused": self.refused.as_json(),
            "identify": self.costs.as_json(),
        }

    # -- accepting ---------------------------------------------------------------------

    async def _serve(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        pause = 0.0
        while True:
            await descriptors.settled()  # the operator's request first
            try:
                conn, _ = await loop.sock_accept(listener)
            except OSError as exc:
                if listener.fileno() < 0:
                    return
                self.accept_errors += 1
                self._once(("accept", exc.errno), "console: accept failed: %s", exc)
                if exc.errno not in _ONE_CONNECTION_LOST:
                    pause = min(max(2 * pause, ACCEPT_RETRY[0]), ACCEPT_RETRY[1])
                    await asyncio.sleep(pause)
                continue
            pause = 0.0
            if self.open >= self.ceiling:
                self.refused.full += 1
                self._once(
                    ("full",),
                    "console: %d connections open, its limit: new ones are reset unread",
                    self.open,
                )
                _reset(conn)
                continue
            if self.identifying >= self.identifying_max:
                self.refused.busy += 1
                self._once(
                    ("busy",),
                    "console: %d connections wait for their peer to be found: new ones "
                    "are reset unread until they are",
                    self.identifying,
                )
                _reset(conn)
                continue
            self.open += 1
            task = loop.create_task(self._admit(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _admit(self, conn: socket.socket) -> None:
        """Find the peer (in the walker thread), then refuse it or hand it to aiohttp."""
        loop = asyncio.get_running_loop()
        served = False
        key: tuple[int, int] | None = None
        counted: tuple[int, int] | None = None  # the peer whose share this connection took
        self.identifying += 1
        try:
            agents, hints = self._agents(), list(reversed(self._hints))
            try:
                seen = await loop.run_in_executor(self._pool, self._identify, conn, agents, hints)
            finally:
                self.identifying -= 1
            self.costs.add(seen)
            if seen.refusal is not None:
                setattr(self.refused, seen.kind, getattr(self.refused, seen.kind) + 1)
                where = seen.who() if seen.pid is not None else _address(conn)
                self._once(
                    (seen.kind, seen.pid, seen.start_ticks),
                    "console: refused a connection from %s: %s",
                    where,
                    seen.refusal,
                )
                return
            assert seen.pid is not None
            key = (seen.pid, seen.start_ticks)
            if self._per_peer[key] >= self.per_peer:
                self.refused.peer_full += 1
                self._once(
                    ("peer_full", *key),
                    "console: %s holds %d connections, the limit per process: new ones are "
                    "reset unread",
                    seen.who(),
                    self._per_peer[key],
                )
                return
            self._hints[seen.pid] = None
            self._hints.move_to_end(seen.pid)
            while len(self._hints) > HINTS:
                self._hints.popitem(last=False)
            self._per_peer[key] += 1
            counted = key
            conn.setblocking(False)
            ended = _once_call(lambda: self._ended(key))
            await loop.connect_accepted_socket(lambda: _Counted(self._protocol(), ended), conn)
            served = True
        except (OSError, RuntimeError) as exc:  # the pool shut down, the peer left
            self._once(("failed", type(exc).__name__), "console: a connection failed: %s", exc)
        finally:
            if not served:
                if counted is not None:
                    self._ended(counted)
                else:
                    self.open -= 1
                _reset(conn)

    def _ended(self, key: tuple[int, int]) -> None:
        self.open -= 1
        self._per_peer[key] -= 1
        if self._per_peer[key] <= 0:
            del self._per_peer[key]

    def _identify(
        self, conn: socket.socket, agents: set[tuple[int, float]], hints: list[int]
    ) -> Seen:
        """Who holds the other end of `conn`, judged as the operator socket judges its
        peer (in the walker thread: /proc reads)."""
        began = time.perf_counter()

        def seen(pid: int | None, kind: str, refusal: str | None, read: int = 0) -> Seen:
            st = procs.stat(pid) if pid is not None else None
            name = _comm(pid) if pid is not None else ""
            ticks = st.start_ticks if st is not None else 0
            return Seen(pid, ticks, name, refusal, kind, read, time.perf_counter() - began)

        try:
            peer = self._peers.peer_of(conn)
        except OSError as exc:
            return seen(None, "unidentified", f"it cannot be identified: {exc}")
        if isinstance(peer, str):
            return seen(None, "unidentified", f"it cannot be identified: {peer}")
        pid, read = tcp_peers.holder(peer.inode, hints)
        if pid is None:
            return seen(
                None,
                "unidentified",
                f"it cannot be identified: no process this gateway can read holds its "
                f"socket (uid {peer.uid} made it)",
                read,
            )
        if procs.in_other_namespaces(pid):
            return seen(pid, "sandboxed", opguard.INSIDE_A_SANDBOX, read)
        if descends_from(pid, agents):
            return seen(pid, "inside_run", INSIDE_A_RUN, read)
        return seen(pid, "admitted", None, read)

    def _once(self, key: tuple[Any, ...], message: str, *args: Any) -> None:
        """Log `message` the first time `key` is seen (a flood is not a flood of lines)."""
        if key in self._logged:
            log.debug(message, *args)
            return
        self._logged[key] = None
        while len(self._logged) > LOGGED:
            self._logged.popitem(last=False)
        log.warning(message + " (logged once; `bastion status` counts the rest)", *args)


def _listener(family: int, address: str, port: int) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # TIME-WAIT sockets on the port do not keep the console out; a listener does
        # (no SO_REUSEPORT: nobody can listen beside it).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((address, port))
        sock.listen(128)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def _why_not(family: int, address: str, port: int, exc: OSError) -> str:
    shown = f"[{address}]:{port}" if family == socket.AF_INET6 else f"{address}:{port}"
    if exc.errno != errno.EADDRINUSE:
        return f"cannot listen on {shown}: {exc.strerror or exc}"
    states = _on_port(family, port)
    if LISTENING in states:
        pid, uid = states[LISTENING]
        who = f"pid {pid}, {_comm(pid)}" if pid is not None else f"uid {uid}, unseen"
        return f"{shown} is taken by another process ({who})"
    if TIME_WAIT in states:
        return (
            f"{shown} is held by a socket in TIME-WAIT that another program made without "
            "SO_REUSEADDR (it frees itself within a minute)"
        )
    return f"{shown} is taken by another socket (bound, not listening)"


LISTENING, TIME_WAIT = "0A", "06"  # /proc/net/tcp's st


def _on_port(family: int, port: int) -> dict[str, tuple[int | None, str]]:
    """The states of the sockets whose own port is `port`, each with the process that
    holds one (None where it cannot be seen, or none does) and its uid."""
    path = "/proc/net/tcp" if family == socket.AF_INET else "/proc/net/tcp6"
    found: dict[str, tuple[int | None, str]] = {}
    with contextlib.suppress(OSError, ValueError), open(path, encoding="ascii") as f:
        next(f, None)
        for line in f:
            fields = line.split()
            if len(fields) < 10 or int(fields[1].rsplit(":", 1)[1], 16) != port:
                continue
            if fields[3] not in found:
                inode = int(fields[9])
                pid = tcp_peers.holder(inode)[0] if inode else None
                found[fields[3]] = (pid, fields[7])
    return found


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return "?"


def _address(conn: socket.socket) -> str:
    try:
        host, port = conn.getpeername()[:2]
    except OSError:
        return "a peer that left"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _reset(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
    conn.close()


def _once_call(fn: Callable[[], None]) -> Callable[[], None]:
    done = False

    def call() -> None:
        nonlocal done
        if not done:
            done = True
            fn()

    return call
