"""Backpressure: the in-flight limit, the fair queue, the bounded wait."""

from __future__ import annotations

import asyncio

import pytest

from bastion.core.contract import Code
from bastion.core.gate import no_slot
from bastion.gateway.admission import Admission, NoSlot

pytestmark = pytest.mark.unit


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


class Runs:
    """Commands that hold their slot until the test ends them."""

    def __init__(self, admission: Admission) -> None:
        self.admission = admission
        self.started: list[str] = []
        self.ends: dict[str, asyncio.Event] = {}

    def start(self, owner: str, name: str) -> asyncio.Task[None]:
        self.ends[name] = asyncio.Event()

        async def run() -> None:
            async with self.admission.slot(owner):
                self.started.append(name)
                await self.ends[name].wait()

        return asyncio.create_task(run())

    async def end(self, name: str) -> None:
        self.ends[name].set()
        await settle()


async def test_never_more_than_the_limit_in_flight() -> None:
    a = Admission(limit=2, wait=30)
    runs = Runs(a)
    tasks = [runs.start("agent", f"c{i}") for i in range(5)]
    await settle()
    assert runs.started == ["c0", "c1"] and a.inflight == 2 and a.waiting() == 3
    await runs.end("c0")
    assert runs.started == ["c0", "c1", "c2"] and a.inflight == 2
    for name in ("c1", "c2", "c3", "c4"):
        await runs.end(name)
    await asyncio.gather(*tasks)
    assert a.inflight == 0 and a.waiting() == 0


async def test_a_busy_agent_cannot_starve_the_others() -> None:
    """The greedy agent queued 10 commands before the others asked; freed slots still
    go to each waiting subject in turn."""
    a = Admission(limit=1, wait=30)
    runs = Runs(a)
    tasks = [runs.start("greedy", "g0")]
    await settle()
    tasks += [runs.start("greedy", f"g{i}") for i in range(1, 10)]
    await settle()
    tasks += [runs.start("quiet", "q0"), runs.start("other", "o0")]
    await settle()
    for name in ("g0", "g1", "q0", "o0"):
        await runs.end(name)
    assert runs.started[:5] == ["g0", "g1", "q0", "o0", "g2"]
    for i in range(2, 10):
        await runs.end(f"g{i}")
    await asyncio.gather(*tasks)


async def test_a_wait_past_the_bound_is_a_retryable_busy() -> None:
    a = Admission(limit=1, wait=0.05)
    runs = Runs(a)
    first = runs.start("agent", "c0")
    await settle()
    with pytest.raises(NoSlot) as caught:
        async with a.slot("other"):
            pytest.fail("got a slot past the limit")
    failure = no_slot(str(caught.value)).failure("req_1")
    assert failure.code is Code.GATEWAY_BUSY and failure.code.retryable
    assert "Nothing was sent" in failure.message and "retry" in failure.message
    assert a.refused == 1 and a.waiting() == 0 and a.inflight == 1
    await runs.end("c0")
    await first
    assert a.inflight == 0
    async with a.slot("other"):  # nothing stale left in the queue: straight in
        assert a.inflight == 1


async def test_a_cancelled_waiter_leaves_no_trace_and_a_handed_slot_passes_on() -> None:
    a = Admission(limit=1, wait=30)
    runs = Runs(a)
    first = runs.start("a", "c0")
    await settle()
    gone = runs.start("b", "never")
    nxt = runs.start("c", "c1")
    await settle()
    gone.cancel()
    await settle()
    assert a.waiting() == 1
    await runs.end("c0")
    assert runs.started == ["c0", "c1"]
    await runs.end("c1")
    await asyncio.gather(first, nxt)
    assert a.inflight == 0


async def test_no_limit_means_no_queue() -> None:
    a = Admission(limit=None)
    runs = Runs(a)
    tasks = [runs.start("x", f"c{i}") for i in range(50)]
    await settle()
    assert len(runs.started) == 50 and a.waiting() == 0
    for i in range(50):
        runs.ends[f"c{i}"].set()
    await asyncio.gather(*tasks)


async def test_a_wait_that_runs_out_as_a_slot_frees_is_skipped_not_crashed() -> None:
    """The release sees the waiter's future already cancelled by its timeout, before
    the waiter itself has run: the slot goes to the next one, nobody errs."""
    a = Admission(limit=1, wait=30)
    runs = Runs(a)
    first = runs.start("a", "c0")
    await settle()
    late = runs.start("b", "late")
    nxt = runs.start("c", "c1")
    await settle()
    queued = a.ceiling.turns.of("b")[0]  # the wait_for inside `late` cancels exactly this
    queued.cancel()
    await runs.end("c0")  # releases before `late` has seen its cancellation
    await first
    assert "c1" in runs.started and "late" not in runs.started
    await runs.end("c1")
    await nxt
    with pytest.raises(asyncio.CancelledError):
        await late
    assert a.inflight == 0 and a.waiting() == 0


async def test_the_same_fair_slots_hold_identity_walks_per_tenant() -> None:
    """The agent socket's walkers: a tenant with many walks queued waits behind its
    own; another tenant's walk gets the next turn; a wait past the bound says what
    it waited for."""
    walks = Admission(limit=1, wait=30, what="identity walks")
    runs = Runs(walks)
    tasks = [runs.start("flooding run", f"w{i}") for i in range(5)]
    await settle()
    tasks.append(runs.start("other run", "theirs"))
    await settle()
    await runs.end("w0")
    await runs.end("w1")
    assert runs.started == ["w0", "w1", "theirs"]  # not behind the flood's three others
    for name in ("theirs", "w2", "w3", "w4"):
        await runs.end(name)
    await asyncio.gather(*tasks)
    short = Admission(limit=1, wait=0.01, what="identity walks")
    held = Runs(short)
    first = held.start("a", "x")
    await settle()
    with pytest.raises(NoSlot, match="1 identity walks are in flight"):
        async with short.slot("b"):
            pytest.fail("got a slot past the limit")
    await held.end("x")
    await first
