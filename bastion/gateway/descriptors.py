"""Descriptors: what each door may hold, and the operator socket's reserve.

Every connection holds a descriptor, and a process has RLIMIT_NOFILE of them (the
daemon raises its soft limit to the hard one at start: `lifetime.harden_process`).
Two rules keep `bastion lock` and `bastion status` answered whatever floods the
agent socket or the console:

- **The doors stop well before the limit.** `budget()` splits the limit: the
  reserve below, `KEPT_DESCRIPTORS` for the gateway's own files, watches and
  outbound connections, and of what is left at most a half for the agent socket
  and an eighth for the console (each also under its own ceiling in
  `core/defaults`). Past its share a door closes new connections at once
  (`tenants.Caps`, `console_door.ConsoleDoor`).
- **The operator socket keeps a reserve.** `Reserve` holds `RESERVE_SLOTS` times
  `RESERVE_PER_SLOT` descriptors open on /dev/null. When its accept fails with
  EMFILE (or ENFILE), one slot is closed, the waiting operator connection is
  accepted into that room and served, and the slot is opened again when the
  connection ends; meanwhile the other doors do not accept (`settled`) for
  `LENT_PAUSE`, so the request itself finds the descriptors it opens. asyncio's
  and libuv's own servers cannot do this: on EMFILE libuv accepts and closes every
  waiting connection (a reset for `bastion lock`), so `serve_unix` accepts itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import resource
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bastion.core.defaults import (
    CONSOLE_CONNECTIONS,
    KEPT_DESCRIPTORS,
    MAX_AGENT_CONNECTIONS,
    RESERVE_PER_SLOT,
    RESERVE_SLOTS,
)

log = logging.getLogger(__name__)

OUT_OF_DESCRIPTORS = {errno.EMFILE, errno.ENFILE}
LENT_PAUSE = 1.0  # seconds the other doors wait after a reserve slot is lent
ACCEPT_RETRY = (0.05, 1.0)  # seconds: first and longest pause after a failed accept
_ONE_CONNECTION_LOST = {errno.ECONNABORTED, errno.EPROTO, errno.EINTR, errno.EAGAIN}

Client = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@dataclass(frozen=True)
class Budget:
    """Connections each door may hold open, from the descriptor limit."""

    limit: int  # RLIMIT_NOFILE's soft limit
    agent: int
    console: int

    def as_json(self) -> dict[str, int]:
        return {"limit": self.limit, "agent": self.agent, "console": self.console}


def budget(limit: int | None = None) -> Budget:
    """The doors' shares of `limit` (the process's soft RLIMIT_NOFILE by default)."""
    if limit is None:
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if limit == resource.RLIM_INFINITY:
            limit = 1 << 20
    spare = limit - RESERVE_SLOTS * RESERVE_PER_SLOT - KEPT_DESCRIPTORS
    return Budget(
        limit,
        agent=min(MAX_AGENT_CONNECTIONS, max(8, spare // 2)),
        console=min(CONSOLE_CONNECTIONS, max(4, spare // 8)),
    )


class Reserve:
    """Descriptors held so an operator connection can be served with none left."""

    def __init__(self, slots: int = RESERVE_SLOTS, per_slot: int = RESERVE_PER_SLOT) -> None:
        self.per_slot = per_slot
        self._slots: list[list[int]] = [[] for _ in range(slots)]
        self._lent_at = 0.0
        self.lent = 0  # slots lent now
        self.lendings = 0  # connections served on the reserve, ever
        self.refill()

    def whole(self) -> int:
        """Slots held in full now."""
        return sum(len(s) == self.per_slot for s in self._slots)

    def refill(self) -> None:
        """Open what the slots not lent lack (a failure leaves it for the next call)."""
        for held in self._slots:
            while len(held) < self.per_slot:
                try:
                    held.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
                except OSError:
                    return

    def lend(self) -> list[int] | None:
        """Close one held slot, to make room now; None when every slot is out."""
        for held in self._slots:
            if held:
                self._slots.remove(held)
                for fd in held:
                    os.close(fd)
                self.lent += 1
                self.lendings += 1
                self._lent_at = time.monotonic()
                return held
        return None

    def give_back(self, slot: list[int]) -> None:
        slot.clear()
        self._slots.append(slot)
        self.lent -= 1
        self.refill()

    def pausing(self) -> float:
        """Seconds the other doors should still wait before they accept again."""
        if not self.lent:
            return 0.0
        return max(0.0, LENT_PAUSE - (time.monotonic() - self._lent_at))

    def close(self) -> None:
        for held in self._slots:
            for fd in held:
                with contextlib.suppress(OSError):
                    os.close(fd)
            held.clear()


_reserve: Reserve | None = None  # the operator socket's, while it listens


async def settled() -> None:
    """Wait while the operator socket has just used its reserve (a door calls this
    before each accept): the room made for the operator's request is its own."""
    while _reserve is not None and (left := _reserve.pausing()) > 0:
        await asyncio.sleep(left)


def reserve_status() -> dict[str, Any] | None:
    if _reserve is None:
        return None
    return {"slots": _reserve.whole(), "lent": _reserve.lent, "lendings": _reserve.lendings}


class UnixServer:
    """A listening unix socket whose accept loop uses the reserve; `sockets`,
    `is_serving` and `close` as asyncio's servers have them."""

    def __init__(self, sock: socket.socket, client: Client, limit: int, health: Any) -> None:
        global _reserve
        self.sockets = [sock]
        self._client = client
        self._limit = limit
        self._health = health  # opserver.ListenerHealth: counts what failed
        self._reserve = _reserve = Reserve()
        self._tasks: set[asyncio.Task[None]] = set()
        self._accepting = asyncio.get_running_loop().create_task(self._serve())

    def is_serving(self) -> bool:
        return not self._accepting.done()

    def close(self) -> None:
        global _reserve
        self._accepting.cancel()
        self.sockets[0].close()
        self._reserve.close()
        if _reserve is self._reserve:
            _reserve = None

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        sock = self.sockets[0]
        pause = 0.0
        while True:
            slot: list[int] | None = None
            try:
                conn, _ = await loop.sock_accept(sock)
            except OSError as exc:
                if sock.fileno() < 0:
                    return
                self._health.failed("accept", exc)
                if exc.errno in OUT_OF_DESCRIPTORS and (slot := self._reserve.lend()) is not None:
                    try:
                        conn, _ = sock.accept()  # into the room just made
                    except OSError as again:
                        self._reserve.give_back(slot)
                        if not isinstance(again, BlockingIOError):
                            self._health.failed("accept", again)
                        continue
                elif exc.errno in _ONE_CONNECTION_LOST:
                    continue
                else:
                    pause = min(max(2 * pause, ACCEPT_RETRY[0]), ACCEPT_RETRY[1])
                    await asyncio.sleep(pause)
                    continue
            pause = 0.0
            self._reserve.refill()  # a slot an earlier give-back could not fill
            task = loop.create_task(self._serve_one(conn, slot))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _serve_one(self, conn: socket.socket, slot: list[int] | None) -> None:
        loop = asyncio.get_running_loop()
        try:
            reader = asyncio.StreamReader(limit=self._limit)
            protocol = asyncio.StreamReaderProtocol(reader)
            try:
                conn.setblocking(False)
                transport, _ = await loop.connect_accepted_socket(lambda: protocol, conn)
            except OSError as exc:
                self._health.failed("connection", exc)
                conn.close()
                return
            writer = asyncio.StreamWriter(transport, protocol, reader, loop)
            await self._client(reader, writer)  # it answers, counts and closes
        finally:
            if slot is not None:
                self._reserve.give_back(slot)


async def serve_unix(path: Path, client: Client, limit: int, health: Any) -> UnixServer:
    """Listen on `path` (mode 0600 is the caller's: it sets the umask) and serve each
    connection with `client(reader, writer)`, as `asyncio.start_unix_server` would."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
        sock.listen(128)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return UnixServer(sock, client, limit, health)
