"""Backpressure: at most `limit` commands in flight, the rest wait their turn.

Past the limit a decided command waits in a queue of its own subject's, and a
freed slot goes to the subjects in turn (round robin), not to whoever sent the
most: one busy agent cannot starve the others. A command that waits longer than
`wait` seconds gets `NoSlot`, what was observed; the gate words it
(`gate.no_slot`: `GATEWAY_BUSY`, retryable, nothing was sent) unless the world
as it is now refuses first (`gate.after_wait`). Nothing hangs and nothing is
lost: a command either gets a slot or that answer, and is journaled either way.

The wait happens after the gate's decision and before the dispatch, whose final
check decides again: a lock or revoke while a command waits still stops it.

The same fair slots hold the agent socket's identity walks (`agent_doors.py`:
a few worker threads, shared per tenant), so a flood of connections from one
run waits behind its own walks, not in front of everyone's.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator, Hashable

from bastion.core.defaults import MAX_INFLIGHT, QUEUE_WAIT
from bastion.core.errors import BastionError


class NoSlot(BastionError):
    """No slot freed up within the wait; the text says how full the slots were."""


class Admission:
    def __init__(
        self, limit: int | None = MAX_INFLIGHT, wait: float = QUEUE_WAIT, what: str = "commands"
    ) -> None:
        self.limit = limit  # None: no limit
        self.wait = wait
        self.what = what  # what holds the slots, for the `NoSlot` text
        self.inflight = 0
        self._queues: dict[Hashable, collections.deque[asyncio.Future[None]]] = {}
        self._turns: collections.deque[Hashable] = collections.deque()  # subjects, in turn
        self.refused = 0  # commands that waited `wait` in vain, since start

    def waiting(self) -> int:
        return sum(not f.done() for q in self._queues.values() for f in q)

    @contextlib.asynccontextmanager
    async def slot(self, owner: Hashable) -> AsyncIterator[None]:
        """Hold one in-flight slot for the body; wait for one, fairly, when none is free."""
        if self.limit is None or (self.inflight < self.limit and not self._queues):
            self.inflight += 1
        else:
            await self._queue(owner)
        try:
            yield
        finally:
            self._release()

    async def _queue(self, owner: Hashable) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if owner not in self._queues:
            self._queues[owner] = collections.deque()
            self._turns.append(owner)
        self._queues[owner].append(fut)
        try:
            await asyncio.wait_for(fut, self.wait)
        except TimeoutError:
            if fut.done() and not fut.cancelled():
                return  # the slot was handed over as the wait ran out: it is ours
            self._forget(owner, fut)
            self.refused += 1
            raise NoSlot(
                f"{self.inflight} {self.what} are in flight (the limit) and {self.waiting()} wait; "
                f"none finished within {self.wait:g}s"
            ) from None
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._release()  # handed over, but the command is gone: pass it on
            else:
                self._forget(owner, fut)
            raise

    def _forget(self, owner: Hashable, fut: asyncio.Future[None]) -> None:
        q = self._queues.get(owner)
        if q is None:
            return
        with contextlib.suppress(ValueError):
            q.remove(fut)
        if not q and self._queues.get(owner) is q:
            del self._queues[owner]
            with contextlib.suppress(ValueError):
                self._turns.remove(owner)

    def _release(self) -> None:
        """Hand the slot to the next subject in turn, or free it."""
        while self._turns:
            owner = self._turns.popleft()
            q = self._queues[owner]
            # A wait that just ran out is cancelled here before its owner forgets it.
            while q and q[0].done():
                q.popleft()
            if not q:
                del self._queues[owner]
                continue
            fut = q.popleft()
            if q:
                self._turns.append(owner)  # its next command waits for its next turn
            else:
                del self._queues[owner]
            fut.set_result(None)  # the slot passes on: inflight is unchanged
            return
        self.inflight -= 1
