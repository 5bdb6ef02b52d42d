"""Each target's learned limit (core/concurrency.py, gateway/admission.Lane).

The behaviour tests drive the real `Admission` with closed-loop clients against a
fake target in virtual time: a command's time there depends on how many of its
commands run at once, as a target that serialises somewhere does. No real time is
measured; the clock is the simulation's.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
import statistics
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bastion.core import concurrency
from bastion.core.concurrency import FLOOR, WINDOW, Estimate, bounded, held_back, observe
from bastion.gateway.admission import Admission

pytestmark = pytest.mark.unit

TARGET = "deploy@web1"


def knee(base: float, at: int) -> Callable[[int], float]:
    """A target that serves `at` commands at once in `base` seconds each, and past
    that shares its capacity: a command's time grows with how many run."""
    return lambda n: base * max(1.0, n / at)


class FakeTarget:
    """Commands run on virtual time; `latency(n)` is a command's time when it starts
    with n of the target's commands running (itself included)."""

    def __init__(self, admission: Admission, latency: Callable[[int], float]) -> None:
        self.admission = admission
        self.latency = latency
        self.now = 0.0
        self.running = 0
        self.peak = 0
        self.done: collections.Counter[str] = collections.Counter()
        self.waited: dict[str, float] = collections.defaultdict(float)
        self.limits: list[int] = []
        self._events: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()
        admission.clock = lambda: self.now

    async def command(self, run: str, process: str) -> None:
        asked = self.now
        async with self.admission.slot(process, run, TARGET):
            self.waited[run] += self.now - asked
            self.running += 1
            self.peak = max(self.peak, self.running)
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            heapq.heappush(
                self._events, (self.now + self.latency(self.running), next(self._seq), fut)
            )
            await fut
            self.running -= 1
        self.done[run] += 1

    def client(self, run: str, process: str) -> asyncio.Task[None]:
        async def loop() -> None:
            while True:
                await self.command(run, process)

        return asyncio.create_task(loop())

    async def until(self, completions: int) -> None:
        """Advance virtual time, one command's end at a time, until that many more
        commands ended."""
        goal = sum(self.done.values()) + completions
        while sum(self.done.values()) < goal:
            for _ in range(30):  # ends, hand-overs and new starts run
                await asyncio.sleep(0)
            self.limits.append(self.limit)
            assert self._events, "no command running: the lane stalled"
            self.now, _, fut = heapq.heappop(self._events)
            fut.set_result(None)

    @property
    def limit(self) -> int:
        """The learned limit (during a probe, the one it comes back to)."""
        est = self.admission.lanes[TARGET].estimate
        return est.limit if est.probing is None else est.probing

    def typical(self, last: int) -> float:
        """The median limit over the last steps: it moves as AIMD does, around a level."""
        return statistics.median(self.limits[-last:])


@pytest.fixture(autouse=True)
def no_graduation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Graduation runs on the loop's real clock; the simulation's commands are short
    in virtual time however long the test takes."""
    monkeypatch.setattr(concurrency, "GRADUATION_MIN", 1e9)


def stop(tasks: list[asyncio.Task[None]]) -> None:
    for t in tasks:
        t.cancel()


async def test_the_limit_shrinks_when_latency_rises_with_concurrency_and_grows_back() -> None:
    shape = {"at": 32}
    target = FakeTarget(Admission(limit=128), lambda n: knee(0.05, shape["at"])(n))
    tasks = [target.client("run", f"p{i}") for i in range(64)]
    try:
        await target.until(1500)
        roomy = target.typical(500)
        assert roomy >= 24, f"a target serving 32 at once was held to {roomy}"
        shape["at"] = 4  # the target got slow: its 5th command at once already queues
        await target.until(1500)
        tight = target.typical(500)
        assert FLOOR <= tight <= 10, f"a target serving 4 at once still got {tight}"
        target.peak = 0
        await target.until(500)
        assert target.peak <= 16  # what reached it, not only what the limit said
        shape["at"] = 32  # and quick again
        await target.until(3000)
        assert target.typical(500) >= 24, f"the limit did not grow back: {target.limits[-20:]}"
    finally:
        stop(tasks)


async def test_a_burst_reaches_a_new_target_a_few_at_a_time() -> None:
    """64 agents at once against a target nothing is known of: it gets START first
    (what MaxStartups lets direct clients send at once), not the burst of 64."""
    target = FakeTarget(Admission(limit=128), knee(0.05, 4))
    tasks = [target.client("run", f"p{i}") for i in range(64)]
    try:
        await target.until(1)
        assert target.peak == concurrency.START
        await target.until(2000)
        assert target.typical(1000) <= 10 and max(target.limits[-1000:]) <= 16
    finally:
        stop(tasks)


async def test_the_limit_never_passes_the_ceiling() -> None:
    target = FakeTarget(Admission(limit=10), knee(0.01, 1000))
    tasks = [target.client("run", f"p{i}") for i in range(40)]
    try:
        await target.until(2000)
        assert max(target.limits) <= 10 and target.peak <= 10
        assert target.limit == 10  # it did grow to the ceiling: the target had room
    finally:
        stop(tasks)


async def test_slots_go_to_runs_in_turn_not_to_the_run_with_most_processes() -> None:
    """Run A has 40 agents, run B 4; both always have commands waiting for a
    target that takes 4 at once: B gets about half the slots, not a tenth."""
    target = FakeTarget(Admission(limit=128), knee(0.05, 4))
    tasks = [target.client("A", f"a{i}") for i in range(40)]
    tasks += [target.client("B", f"b{i}") for i in range(4)]
    try:
        await target.until(3000)
        a, b = target.done["A"], target.done["B"]
        assert 0.7 < b / a < 1.4, f"run A {a} commands, run B {b}"
    finally:
        stop(tasks)


class Long:
    """`n` commands to TARGET that run until `end`, each started as its slot comes."""

    def __init__(self, a: Admission, n: int) -> None:
        self.held = asyncio.Event()
        self.started: list[int] = []

        async def long(i: int) -> None:
            async with a.slot(f"p{i}", "run", TARGET):
                self.started.append(i)
                await self.held.wait()

        self.tasks = [asyncio.create_task(long(i)) for i in range(n)]

    async def until(self, done: Callable[[], bool]) -> None:
        for _ in range(1000):  # a bounded wait on the event (graduations: loop time)
            if done():
                return
            await asyncio.sleep(0.01)

    async def end(self) -> None:
        self.held.set()
        await asyncio.gather(*self.tasks)


async def test_long_commands_leave_their_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    """Graduation: commands running past it no longer hold the lane (real loop time)."""
    monkeypatch.setattr(concurrency, "GRADUATION_MIN", 0.05)
    a = Admission(limit=128)
    lane, long = a.lane(TARGET), Long(a, 6)
    await long.until(lambda: len(long.started) == 6 and lane.slots.inflight == 0)
    assert lane.slots.inflight == 0, "the long commands kept their slots"
    assert len(long.started) == 6 and a.inflight == 6  # the ceiling still counts them all
    await long.end()
    assert a.inflight == 0 and lane.slots.inflight == 0


async def test_a_command_beside_long_ones_is_not_taken_for_the_target_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The baseline is what a command takes with at most FLOOR of the lane's commands at
    the target: graduated ones left their slots, not the target, and still count."""
    monkeypatch.setattr(concurrency, "GRADUATION_MIN", 0.05)
    a = Admission(limit=128)
    lane, long = a.lane(TARGET), Long(a, 4)
    await long.until(lambda: lane.graduated == 4)
    assert lane.graduated == 4 and lane.slots.inflight == 0
    async with a.slot("short", "run", TARGET):
        pass
    assert lane.estimate.quiet == (), "a command beside 4 running ones made the baseline"
    await long.end()  # (soon after graduating: slow starts, samples of their own)
    assert lane.graduated == 0 and a.inflight == 0
    before = len(lane.estimate.quiet)
    async with a.slot("short", "run", TARGET):
        pass
    assert len(lane.estimate.quiet) == before + 1  # alone now: it measures the baseline


async def test_a_graduated_command_that_ends_soon_after_was_slow_and_is_a_sample(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A command that graduates and then ends within SLOW_START graduations was slow to
    start (queued at the target), and its time is a sample; one that runs on is long by
    nature and gives none. Graduation runs on the loop; the time taken on `now`."""
    monkeypatch.setattr(concurrency, "GRADUATION_MIN", 0.05)
    now = [100.0]
    a = Admission(limit=128, clock=lambda: now[0])
    lane = a.lane(TARGET)

    async def one(graduations: float) -> None:
        took = graduations * lane.estimate.graduation
        release = asyncio.Event()

        async def command() -> None:
            async with a.slot("p", "run", TARGET):
                await release.wait()

        task = asyncio.create_task(command())
        for _ in range(1000):  # bounded wait on the event: the graduation (loop time)
            if lane.graduated:
                break
            await asyncio.sleep(0.01)
        assert lane.graduated == 1
        now[0] += took
        release.set()
        await task

    await one(2)  # ended 2 graduations in: slow, not long
    assert lane.estimate.window == (pytest.approx(2 * concurrency.GRADUATION_MIN),)
    await one(10)  # 10: long by nature
    assert len(lane.estimate.window) == 1 and lane.graduated == 0


async def test_a_fleet_of_long_commands_all_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """64 long commands at once: each graduation lets START more start, so the whole
    fleet runs within 64 / START graduations (8 s at a second each), not the wait."""
    monkeypatch.setattr(concurrency, "GRADUATION_MIN", 0.05)
    a = Admission(limit=128, wait=30)
    long = Long(a, 64)
    await long.until(lambda: len(long.started) == 64)
    assert len(long.started) == 64
    assert a.lanes[TARGET].slots.inflight <= concurrency.START
    await long.end()


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0.001, 30.0), st.integers(1, 200), st.booleans()), max_size=400),
    st.one_of(st.none(), st.integers(1, 200)),
)
def test_any_samples_keep_the_limit_within_its_bounds(
    samples: list[tuple[float, int, bool]], ceiling: int | None
) -> None:
    est = Estimate(limit=bounded(concurrency.START, ceiling))
    for seconds, n, waited in samples:
        if waited:
            est = held_back(est)
        est = observe(est, seconds, n, ceiling)
        assert est.limit >= 1 and (ceiling is None or est.limit <= ceiling)
        assert est.limit >= min(FLOOR, ceiling or FLOOR)
        assert len(est.window) < WINDOW and len(est.quiet) <= WINDOW


def test_a_window_far_above_the_baseline_halves_the_limit_at_most() -> None:
    est = Estimate(limit=40, baseline=0.1, quiet=(0.1,) * WINDOW)
    for _ in range(WINDOW):
        est = observe(est, 10.0, 40, None)
    assert est.limit == 20
    for _ in range(WINDOW):  # near the baseline, but nobody waited: it stays
        est = observe(est, 0.1, 20, None)
    assert est.limit == 20
    est = held_back(est)
    for _ in range(WINDOW):
        est = observe(est, 0.1, 20, None)
    assert est.limit == 24
