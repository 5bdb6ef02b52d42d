"""Backpressure: how many commands are in flight, per target and in all, and who goes next.

Two limits hold a decided command before its dispatch:

- its target's **lane** (per host and account): a limit learned from how long the
  target's commands take (`core/concurrency.py`), so a burst of pooled commands a
  target would only queue is not sent at once -- the burst direct ssh's staggered
  handshakes would not have sent either;
- the **ceiling** over every target (`[limits] inflight`), which no lane exceeds.

Past a limit a command waits, and a freed slot goes to the waiters in turn: the
tenants (a registered run, or a uid outside every run) round robin, and within a
tenant its processes round robin -- not to whoever sent the most, so one busy run
or agent cannot starve the others. A command that waits longer than `wait` seconds
in all gets `NoSlot`, what was observed; the gate words it (`gate.no_slot`:
`GATEWAY_BUSY`, retryable, nothing was sent) unless the world as it is now refuses
first (`gate.after_wait`). Nothing hangs and nothing is lost: a command either gets
a slot or that answer, and is journaled either way.

The wait happens after the gate's decision and before the dispatch, whose final
check decides again: a lock or revoke while a command waits still stops it.

The same fair slots hold the agent socket's identity walks (`agent_doors.py`: a few
worker threads, shared per tenant, no lanes), so a flood of connections from one
run waits behind its own walks, not in front of everyone's.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Hashable
from typing import Any

from bastion.core.concurrency import Estimate, bounded, held_back, observe, slow_start
from bastion.core.defaults import MAX_INFLIGHT, QUEUE_WAIT
from bastion.core.errors import BastionError


class NoSlot(BastionError):
    """No slot freed up within the wait; the text says how full the slots were."""


class Turns:
    """Waiting futures, handed out in turn: groups round robin, and within a group
    its members round robin. A done future (a wait that ran out or was cancelled)
    is skipped."""

    def __init__(self) -> None:
        # group -> member -> its waiters; dict order is the members' turn order.
        self._groups: dict[Hashable, dict[Hashable, collections.deque[asyncio.Future[None]]]] = {}
        self._order: collections.deque[Hashable] = collections.deque()  # groups, in turn

    def __len__(self) -> int:
        return sum(not f.done() for m in self._groups.values() for q in m.values() for f in q)

    def __bool__(self) -> bool:
        return bool(self._groups)

    def add(self, group: Hashable, member: Hashable, fut: asyncio.Future[None]) -> None:
        members = self._groups.get(group)
        if members is None:
            members = self._groups[group] = {}
            self._order.append(group)
        members.setdefault(member, collections.deque()).append(fut)

    def of(self, group: Hashable) -> list[asyncio.Future[None]]:
        """A group's waiters, in its members' turn order."""
        return [f for q in self._groups.get(group, {}).values() for f in q]

    def pop(self) -> asyncio.Future[None] | None:
        """The next live waiter in turn, or None."""
        while self._order:
            group = self._order.popleft()
            members = self._groups[group]
            found = None
            while members and found is None:
                member = next(iter(members))
                q = members.pop(member)
                while q and q[0].done():
                    q.popleft()
                if q:
                    found = q.popleft()
                    if q:
                        members[member] = q  # its next waiter comes after the others'
            if members:
                self._order.append(group)
            else:
                del self._groups[group]
            if found is not None:
                return found
        return None

    def forget(self, group: Hashable, member: Hashable, fut: asyncio.Future[None]) -> None:
        members = self._groups.get(group)
        q = members.get(member) if members is not None else None
        if members is None or q is None:
            return
        with contextlib.suppress(ValueError):
            q.remove(fut)
        if not q:
            del members[member]
        if not members:
            del self._groups[group]
            with contextlib.suppress(ValueError):
                self._order.remove(group)


class Slots:
    """One limit (None: none) and its waiters."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.inflight = 0
        self.turns = Turns()

    def open(self) -> bool:
        return self.limit is None or self.inflight < self.limit

    async def take(self, group: Hashable, member: Hashable, timeout: float) -> bool:
        """Hold a slot: at once if one is free and nobody waits, else in turn within
        `timeout` seconds. False: the wait ran out (nothing is held)."""
        if self.open() and not self.turns:
            self.inflight += 1
            return True
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.turns.add(group, member, fut)
        try:
            await asyncio.wait_for(fut, max(timeout, 0.0))
        except TimeoutError:
            if fut.done() and not fut.cancelled():
                return True  # the slot was handed over as the wait ran out: it is ours
            self.turns.forget(group, member, fut)
            return False
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.give()  # handed over, but the command is gone: pass it on
            else:
                self.turns.forget(group, member, fut)
            raise
        return True

    def give(self) -> None:
        """A slot comes back: it goes to the next waiter in turn if the limit allows."""
        self.inflight -= 1
        self.fill()

    def fill(self) -> None:
        """Hand out slots to waiters while the limit allows (it may have grown)."""
        while self.open():
            fut = self.turns.pop()
            if fut is None:
                return
            self.inflight += 1
            fut.set_result(None)


class Lane:
    """One target's learned limit and its slots."""

    def __init__(self, name: str, ceiling: int | None) -> None:
        self.name = name
        self.estimate = Estimate(limit=bounded(Estimate().limit, ceiling))
        self.slots = Slots(self.estimate.limit)
        self.graduated = 0  # commands that left their slot and still run at the target

    def learn(self, seconds: float, started_with: int, ceiling: int | None) -> None:
        self.estimate = observe(self.estimate, seconds, started_with, ceiling)
        self.slots.limit = self.estimate.limit
        self.slots.fill()

    def status(self) -> dict[str, Any]:
        base = self.estimate.baseline
        return {
            "target": self.name,
            "limit": self.estimate.limit,
            "inflight": self.slots.inflight,
            "waiting": len(self.slots.turns),
            "baseline_ms": None if base is None else round(base * 1e3, 1),
        }


class Admission:
    def __init__(
        self,
        limit: int | None = MAX_INFLIGHT,
        wait: float = QUEUE_WAIT,
        what: str = "commands",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ceiling = Slots(limit)  # None: no ceiling (lanes still learn)
        self.wait = wait
        self.what = what  # what holds the slots, for the `NoSlot` text
        self.clock = clock
        self.lanes: dict[str, Lane] = {}
        self.refused = 0  # commands that waited `wait` in vain, since start

    @property
    def limit(self) -> int | None:
        return self.ceiling.limit

    @property
    def inflight(self) -> int:
        return self.ceiling.inflight

    def waiting(self) -> int:
        return len(self.ceiling.turns) + sum(len(lane.slots.turns) for lane in self.lanes.values())

    def targets(self) -> list[dict[str, Any]]:
        """Each target's learned limit, in flight and queue (`bastion status`)."""
        return [self.lanes[name].status() for name in sorted(self.lanes)]

    def lane(self, target: str) -> Lane:
        found = self.lanes.get(target)
        if found is None:
            found = self.lanes[target] = Lane(target, self.ceiling.limit)
        return found

    @contextlib.asynccontextmanager
    async def slot(
        self, owner: Hashable, group: Hashable | None = None, target: str | None = None
    ) -> AsyncIterator[None]:
        """Hold a slot of `target`'s lane (if named) and of the ceiling for the body;
        wait for them, in turn, when none is free: `group` (the tenant) round robin,
        and `owner` (its process) within it. A body that ends normally is a sample of
        the target's time (`core/concurrency.observe`)."""
        group = owner if group is None else group
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait
        lane = self.lane(target) if target is not None else None
        if lane is not None:
            if not lane.slots.open() or lane.slots.turns:
                lane.estimate = held_back(lane.estimate)
            if not await lane.slots.take(group, owner, self.wait):
                raise self._refused(lane)
        try:
            if not await self.ceiling.take(group, owner, deadline - loop.time()):
                raise self._refused(None)
        except BaseException:
            if lane is not None:
                lane.slots.give()
            raise
        graduated = False

        def graduate() -> None:  # running long: not waiting at the start (concurrency.py)
            nonlocal graduated
            graduated = True
            assert lane is not None
            lane.graduated += 1
            lane.slots.give()

        graduation = lane.estimate.graduation if lane else 0.0
        timer = loop.call_later(graduation, graduate) if lane else None
        # What the target runs of this lane as the command starts: a graduated command
        # left its slot but not the target, and a command beside it is not alone there.
        started = self.clock()
        started_with = lane.slots.inflight + lane.graduated if lane else 0
        ended = False
        try:
            yield
            ended = True
        finally:
            self.ceiling.give()
            took = self.clock() - started
            if lane is not None and graduated:
                lane.graduated -= 1
                if ended and slow_start(took, graduation):  # slow, not long: a sample
                    lane.learn(took, started_with, self.ceiling.limit)
            elif lane is not None and timer is not None:
                timer.cancel()
                lane.slots.give()
                if ended:
                    lane.learn(took, started_with, self.ceiling.limit)

    def _refused(self, lane: Lane | None) -> NoSlot:
        self.refused += 1
        if lane is not None:
            s = lane.slots
            return NoSlot(
                f"{s.inflight} {self.what} to {lane.name} are in flight (the limit learned "
                f"for that target) and {len(s.turns)} wait; none finished within {self.wait:g}s"
            )
        return NoSlot(
            f"{self.inflight} {self.what} are in flight (the limit) and {self.waiting()} wait; "
            f"none finished within {self.wait:g}s"
        )
