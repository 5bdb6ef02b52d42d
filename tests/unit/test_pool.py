"""The outbound pool: channels spread within MaxSessions, waits when full, opens
ahead of demand, learns a lower MaxSessions, closes idle extras, retires on a
vault change. Fake connections; the real path is in tests/integration/test_pool_load.py."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from bastion.gateway.pool import Pool, Slot

pytestmark = pytest.mark.unit


class FakeConn:
    def __init__(self, n: int) -> None:
        self.n = n
        self.closed = False
        self.lost = False

    def close(self) -> None:
        self.closed = True


class Target:
    """Counts connections; `gate` holds handshakes until the test lets them finish."""

    def __init__(self) -> None:
        self.conns: list[FakeConn] = []
        self.gate: asyncio.Event | None = None
        self.fail: Exception | None = None

    async def connect(self) -> tuple[Any, Any]:
        if self.gate is not None:
            await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        conn = FakeConn(len(self.conns))
        self.conns.append(conn)
        return conn, lambda: conn.lost


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_channels_spread_over_connections_within_max_sessions() -> None:
    pool, t = Pool(max_sessions=3, max_connections=4), Target()
    slots = [await pool.acquire("k", t.connect) for _ in range(9)]
    await settle()
    per_conn = {c.n: sum(s.conn is c for s in slots) for c in t.conns}
    assert all(n <= 3 for n in per_conn.values())
    assert sum(per_conn.values()) == 9 and len([n for n in per_conn.values() if n]) == 3
    assert len(t.conns) == 4  # the fourth was opened ahead, before anyone waited for it
    assert pool.held() == 4


async def test_a_full_pool_waits_in_order_and_never_exceeds_the_limits() -> None:
    pool, t = Pool(max_sessions=2, max_connections=2), Target()
    held = [await pool.acquire("k", t.connect) for _ in range(4)]
    order: list[int] = []

    async def wait(i: int) -> Slot:
        slot = await pool.acquire("k", t.connect)
        order.append(i)
        return slot

    waiters = [asyncio.create_task(wait(i)) for i in range(3)]
    await settle()
    assert order == [] and len(t.conns) == 2
    await pool.release(held[0])
    await settle()
    assert order == [0]
    for slot in held[1:]:
        await pool.release(slot)
    await settle()
    assert order == [0, 1, 2]
    got = [w.result() for w in waiters]
    assert all(s.active <= s.capacity == 2 for s in got)


async def test_a_lower_max_sessions_is_learned_from_a_refusal() -> None:
    pool, t = Pool(max_sessions=10, max_connections=3), Target()
    slots = [await pool.acquire("k", t.connect) for _ in range(3)]
    refused = await pool.acquire("k", t.connect)  # the target says no to the 4th
    pool.refused(refused)
    await pool.release(refused)
    assert refused.capacity == 3
    again = await pool.acquire("k", t.connect)
    assert again.conn is not refused.conn  # spread to another connection instead
    assert len(t.conns) >= 2 and not t.conns[0].closed
    for s in [*slots, again]:
        await pool.release(s)


async def test_a_connection_that_carries_nothing_is_dropped_when_refused() -> None:
    pool, t = Pool(max_sessions=10, max_connections=2), Target()
    slot = await pool.acquire("k", t.connect)
    pool.refused(slot)
    await pool.release(slot)
    assert t.conns[0].closed and pool.held() == 0 and pool.slots("k") == []


async def test_a_failed_connect_reaches_every_waiter_and_the_next_one_retries() -> None:
    pool, t = Pool(max_sessions=1, max_connections=1), Target()
    t.gate, t.fail = asyncio.Event(), OSError("refused")
    first = asyncio.create_task(pool.acquire("k", t.connect))
    second = asyncio.create_task(pool.acquire("k", t.connect))
    await settle()
    t.gate.set()
    with pytest.raises(OSError):
        await first
    with pytest.raises(OSError):
        await second  # it opened its own, and that failed too: no hang
    t.fail = None
    slot = await pool.acquire("k", t.connect)
    assert slot.conn is t.conns[0]


async def test_idle_extra_connections_close_but_the_first_stays() -> None:
    now = [0.0]
    pool, t = Pool(max_sessions=1, max_connections=3, idle_close=60, clock=lambda: now[0]), Target()
    slots = [await pool.acquire("k", t.connect) for _ in range(3)]
    for s in slots:
        await pool.release(s)
    assert not any(c.closed for c in t.conns)
    now[0] = 61.0
    last = await pool.acquire("k", t.connect)
    await pool.release(last)
    assert [c.closed for c in t.conns] == [False, True, True]
    assert pool.held() == 1


async def test_lost_connections_are_never_handed_out() -> None:
    pool, t = Pool(max_sessions=5, max_connections=2), Target()
    slot = await pool.acquire("k", t.connect)
    await pool.release(slot)
    t.conns[0].lost = True
    fresh = await pool.acquire("k", t.connect)
    assert fresh.conn is not t.conns[0]


async def test_retire_all_lets_busy_ones_finish_then_closes_them() -> None:
    pool, t = Pool(max_sessions=5, max_connections=2), Target()
    busy = await pool.acquire("k", t.connect)
    idle = await pool.acquire("k2", t.connect)
    await pool.release(idle)
    pool.retire_all()
    assert t.conns[1].closed and not t.conns[0].closed
    assert pool.held() == 1  # the busy one still holds the key
    fresh = await pool.acquire("k", t.connect)
    assert fresh.conn is not busy.conn  # nothing new rides a retired connection
    await pool.release(busy)
    assert t.conns[0].closed
    await pool.release(fresh)
    assert pool.held() == 1


async def test_a_connection_opened_ahead_while_the_vault_changes_is_closed() -> None:
    pool, t = Pool(max_sessions=1, max_connections=3), Target()
    busy = await pool.acquire("k", t.connect)  # full: the next one is opened ahead
    t.gate = asyncio.Event()
    await pool.release(busy)
    second = await pool.acquire("k", t.connect)  # takes the first again, opens ahead
    await settle()
    pool.retire_all()  # the vault locked while the extra connection was opening
    t.gate.set()
    await settle()
    assert len(t.conns) == 2 and t.conns[1].closed  # no one rides it; it holds no key
    await pool.release(second)
    assert pool.held() == 0
