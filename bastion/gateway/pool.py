"""Outbound connections per (target, account, key, pin, vault epoch), and their channels.

One authenticated connection can carry only as many sessions as the target's sshd
allows (`MaxSessions`, 10 by default): past that, sshd refuses the channel. So a
key's channels are spread over up to `max_connections` connections of at most
`max_sessions` channels each; a command waits (in arrival order) when all are
full. The least loaded connection is used first. When a command takes the last
free channel, the next connection is opened ahead of demand, so a burst does not
pay a handshake per connection in its critical path; one idle for `idle_close`
seconds is closed (the first is kept: it is what makes a lone command fast).

A target with a lower `MaxSessions` than assumed refuses a channel; `refused`
then lowers that connection's capacity to what it carries, and the command asks
again: nothing was sent (the intent runs only once a channel is open).

Why connections are per vault epoch: a lock or unlock retires them all
(`retire_all`); a busy one finishes the command it was decided for, and no new
command rides a connection authenticated before the vault changed state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import asyncssh

log = logging.getLogger(__name__)

MAX_SESSIONS = 10  # OpenSSH's default MaxSessions
MAX_CONNECTIONS = 8  # per key: 80 commands at once to one (target, account)
IDLE_CLOSE = 60.0  # seconds an extra connection may sit idle


@dataclass(eq=False)
class Slot:
    """One connection in the pool and how many of its channels are in use."""

    conn: asyncssh.SSHClientConnection
    lost: Callable[[], bool]
    capacity: int
    active: int = 0
    idle_since: float = field(default_factory=time.monotonic)

    @property
    def free(self) -> int:
        return self.capacity - self.active if not self.lost() else 0


@dataclass(eq=False)
class _Key:
    slots: list[Slot] = field(default_factory=list)
    opening: int = 0  # connections being opened
    cond: asyncio.Condition = field(default_factory=asyncio.Condition)
    retired: bool = False  # the vault changed state: what opens now closes when idle


Connect = Callable[[], Awaitable[tuple[asyncssh.SSHClientConnection, Callable[[], bool]]]]


class Pool:
    def __init__(
        self,
        max_sessions: int = MAX_SESSIONS,
        max_connections: int = MAX_CONNECTIONS,
        idle_close: float = IDLE_CLOSE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_sessions = max_sessions
        self.max_connections = max_connections
        self.idle_close = idle_close
        self.clock = clock
        self._keys: dict[Any, _Key] = {}
        self._retired: set[Slot] = set()
        self._owner: dict[Slot, _Key] = {}

    async def acquire(self, key: Any, connect: Connect) -> Slot:
        """A channel's worth of a live connection for `key`; waits while all are full.
        A failure to connect is raised to every command waiting for that connection."""
        k = self._keys.setdefault(key, _Key())
        async with k.cond:
            while True:
                for gone in [s for s in k.slots if s.lost()]:
                    k.slots.remove(gone)  # its commands' release forgets it
                    if gone.active <= 0:
                        self._owner.pop(gone, None)
                best = max(k.slots, key=lambda s: s.free, default=None)
                if best is not None and best.free > 0:
                    best.active += 1
                    if all(s.free == 0 for s in k.slots):
                        self._open_ahead(k, connect)
                    return best
                if len(k.slots) + k.opening < self.max_connections:
                    slot = await self._open(k, connect)  # raises on failure
                    slot.active += 1
                    return slot
                await k.cond.wait()

    async def _open(self, k: _Key, connect: Connect, reserved: bool = False) -> Slot:
        """Open one connection, holding `k.cond` only while counting (the handshake
        runs unlocked, so other commands can take channels meanwhile). `reserved`:
        the caller already counted it in `k.opening`."""
        if not reserved:
            k.opening += 1
        k.cond.release()
        try:
            conn, lost = await connect()
        except BaseException:
            await k.cond.acquire()
            k.opening -= 1
            k.cond.notify_all()  # a waiter may open one itself now
            raise
        await k.cond.acquire()
        k.opening -= 1
        slot = Slot(conn, lost, self.max_sessions)
        self._owner[slot] = k
        if k.retired:
            self._retired.add(slot)  # carries its command, then closes
        else:
            k.slots.append(slot)
        k.cond.notify_all()
        return slot

    def _open_ahead(self, k: _Key, connect: Connect) -> None:
        if len(k.slots) + k.opening >= self.max_connections or k.opening:
            return
        k.opening += 1  # counted now: no one opens past the limit meanwhile

        async def ahead() -> None:
            async with k.cond:
                with contextlib.suppress(Exception):  # the next command connects itself
                    slot = await self._open(k, connect, reserved=True)
                    if slot in self._retired:  # retired while it opened: no one will use it
                        self._retired.discard(slot)
                        self._owner.pop(slot, None)
                        slot.conn.close()

        asyncio.get_running_loop().create_task(ahead())

    async def release(self, slot: Slot) -> None:
        """The command is done with its channel."""
        slot.active -= 1
        slot.idle_since = self.clock()
        k = self._owner.get(slot)
        if slot.active <= 0 and (k is None or slot not in k.slots):
            # Retired, refused out or lost: its last command is done.
            self._retired.discard(slot)
            self._owner.pop(slot, None)
            slot.conn.close()
        if k is None:
            return
        async with k.cond:
            self._close_idle(k)
            k.cond.notify_all()  # a channel is free

    def refused(self, slot: Slot) -> None:
        """The target refused a channel on this connection: it allows no more than
        it carries now (at least one, or the connection is useless and dropped)."""
        slot.capacity = max(slot.active - 1, 0)
        if slot.capacity == 0:
            k = self._owner.get(slot)
            if k is not None:
                k.slots = [s for s in k.slots if s is not slot]
            self._retired.add(slot)
        log.info("target refused a channel: capacity of a connection now %d", slot.capacity)

    def _close_idle(self, k: _Key) -> None:
        now = self.clock()
        keep = []
        for i, s in enumerate(k.slots):
            if i > 0 and s.active == 0 and now - s.idle_since >= self.idle_close:
                s.conn.close()
                self._owner.pop(s, None)
            else:
                keep.append(s)
        k.slots = keep

    def held(self) -> int:
        """Connections that still hold the key they authenticated with."""
        return sum(len(k.slots) for k in self._keys.values()) + len(self._retired)

    def slots(self, key: Any) -> list[Slot]:
        k = self._keys.get(key)
        return list(k.slots) if k else []

    def retire_all(self) -> None:
        """No pooled connection is reused. Idle ones close now; busy ones finish the
        command they were decided for."""
        for k in self._keys.values():
            k.retired = True
            for s in k.slots:
                if s.active > 0:
                    self._retired.add(s)
                else:
                    s.conn.close()
                    self._owner.pop(s, None)
            k.slots = []
        self._keys.clear()  # the next command of any key starts a fresh entry

    def close_all(self) -> None:
        """Drop every outbound connection (gateway stopping)."""
        for k in self._keys.values():
            for s in k.slots:
                s.conn.close()
        for s in self._retired:
            s.conn.close()
        self._keys.clear()
        self._retired.clear()
        self._owner.clear()
