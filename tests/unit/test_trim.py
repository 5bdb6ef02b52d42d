"""When the gateway hands memory back (`gateway/trim.py`), and the window that holds
(`gateway/window.py`): a relay's buffers stay within one window however fast the
sender and however slow the reader."""

from __future__ import annotations

import gc
import weakref
from typing import Any

from asyncssh.channel import SSHChannel

from bastion.gateway.trim import MiB, Schedule, Trimmer, settle
from bastion.gateway.window import deliver_held

# -- when to trim --------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def trimmer(schedule: Schedule) -> tuple[Trimmer, Clock, list[float]]:
    clock = Clock()
    done: list[float] = []
    return Trimmer(schedule, trim=lambda: done.append(clock.now), clock=clock), clock, done


def test_a_stream_is_trimmed_once_every_so_many_bytes() -> None:
    t, clock, done = trimmer(Schedule(every_bytes=16 * MiB))
    for _ in range(16 * 4 - 1):  # 63 MiB in 1 MiB reads
        t.relayed(MiB)
        clock.now += 0.01
    assert len(done) == 3  # at 16, 32 and 48 MiB; the last 15 wait
    t.relayed(MiB)
    assert len(done) == 4


def test_quiet_after_work_trims_once() -> None:
    t, clock, done = trimmer(Schedule(quiet=1.0, min_interval=5.0))
    t.tick()
    assert done == []  # no work since the start: nothing to give back
    t.ended()
    clock.now += 0.5
    t.tick()
    assert done == []  # not quiet yet
    clock.now += 0.6
    t.tick()
    assert len(done) == 1
    clock.now += 10
    t.tick()
    assert len(done) == 1  # nothing since: no second trim


def test_quiet_trims_are_spaced_but_a_streams_trims_do_not_delay_them() -> None:
    t, clock, done = trimmer(Schedule(every_bytes=16 * MiB, quiet=1.0, min_interval=5.0))
    t.ended()
    clock.now += 1
    t.tick()
    assert len(done) == 1
    t.ended()  # a lone command a moment later: not trimmed for until min_interval passed
    clock.now += 1
    t.tick()
    assert len(done) == 1
    clock.now += 4
    t.tick()
    assert len(done) == 2
    clock.now += 10
    t.relayed(16 * MiB)  # a stream's trim ...
    t.relayed(MiB)  # ... and what came after it still goes back once quiet
    assert len(done) == 3
    clock.now += 1
    t.tick()
    assert len(done) == 4


def test_without_malloc_trim_nothing_is_called() -> None:
    t = Trimmer(Schedule(every_bytes=1), trim=None)
    t._trim = None  # as where the C library has no malloc_trim
    t.relayed(10)
    assert t.trims == 0


def test_a_quiet_trim_collects_garbage_first_and_a_streams_does_not() -> None:
    clock, done = Clock(), []
    t = Trimmer(
        Schedule(every_bytes=16 * MiB, quiet=1.0, min_interval=5.0),
        trim=lambda: done.append("trim"),
        clock=clock,
        collect=lambda: done.append("collect"),
    )
    t.relayed(16 * MiB)
    assert done == ["trim"]  # in mid-stream: no walk over every object
    t.relayed(MiB)
    clock.now += 2
    t.tick()
    assert done == ["trim", "collect", "trim"]


def test_a_busy_gateway_collects_every_so_often_while_commands_end() -> None:
    clock, done = Clock(), []
    t = Trimmer(
        Schedule(quiet=1.0, min_interval=5.0, collect_every=5.0),
        trim=lambda: done.append("trim"),
        clock=clock,
        collect=lambda: done.append("collect"),
    )
    for _ in range(40):  # 20 s of commands ending every half second: never quiet
        t.ended()
        clock.now += 0.5
        t.tick()
    assert done == ["collect"] * 4  # every 5 s, no trim (the quiet one comes after)
    clock.now += 1.5
    t.tick()
    assert done[-2:] == ["collect", "trim"]
    clock.now += 20
    t.tick()
    assert done.count("collect") == 5  # nothing ended since: nothing to collect for


def test_the_collector_frees_what_a_finished_connection_left_in_cycles() -> None:
    """Why the quiet trim collects: objects in a cycle (as a closed connection and its
    channels, each pointing at the other) are not freed when the last outside
    reference goes, and stay until a full collection, however long that is."""

    class Conn:
        pass

    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()  # as between two of Python's own full collections
    try:
        conn, chan = Conn(), Conn()
        conn.chan, chan.conn = chan, conn  # type: ignore[attr-defined]
        gone = weakref.ref(conn)
        del conn, chan
        assert gone() is not None  # the cycle holds it
        clock = Clock()
        t = Trimmer(Schedule(quiet=1.0), trim=lambda: None, clock=clock)
        t.ended()
        clock.now += 2
        t.tick()
        assert gone() is None
    finally:
        if was_enabled:
            gc.enable()


def test_settle_freezes_what_lives_and_later_cycles_are_still_collected() -> None:
    """What start-up made is frozen out of every later collection (which then walks
    less); a cycle made after it is still freed, and start-up's own garbage was collected
    before the freeze, not kept for ever."""

    class Conn:
        pass

    def cycle() -> weakref.ref[Conn]:
        conn, chan = Conn(), Conn()
        conn.chan, chan.conn = chan, conn  # type: ignore[attr-defined]
        return weakref.ref(conn)

    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    start_garbage = cycle()
    lives = Conn()
    try:
        settle()
        assert start_garbage() is None  # collected, not frozen
        assert gc.get_freeze_count() > 0
        assert not any(o is lives for o in gc.get_objects())  # out of the collector's sight
        later = cycle()
        assert later() is not None
        gc.collect()
        assert later() is None
    finally:
        gc.unfreeze()
        if was_enabled:
            gc.enable()


# -- the window that holds -------------------------------------------------------------

WINDOW = 2 * MiB
PACKET = 32 * 1024


class _Log:
    def debug2(self, *args: object) -> None:
        pass


class _Session:
    """A stream above the channel: pauses it once `limit` bytes wait (asyncssh's
    limit is the window), resumes it when a read brings it below."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.waiting = 0
        self.chan: Any = None

    def data_received(self, data: bytes, datatype: object) -> None:
        self.waiting += len(data)
        if self.waiting >= self.limit and not self.chan._recv_paused:
            self.chan.pause_reading()

    def read(self, n: int) -> None:
        self.waiting -= min(n, self.waiting)
        if self.waiting < self.limit and self.chan._recv_paused:
            self.chan.resume_reading()


def _channel(cls: type) -> Any:
    chan = object.__new__(cls)
    chan.__dict__.update(
        _send_state="open",
        _recv_state="open",
        _recv_paused=False,
        _recv_buf=[],
        _recv_window=WINDOW,
        _init_recv_window=WINDOW,
        _encoding=None,
        _logger=_Log(),
        credited=0,
    )
    chan.send_packet = lambda _type, *args: setattr(
        chan, "credited", chan.credited + int.from_bytes(args[0], "big")
    )
    return chan


class _Plain(SSHChannel):  # type: ignore[type-arg]
    """asyncssh's own channel."""


class _Held(SSHChannel):  # type: ignore[type-arg]
    _deliver_data = deliver_held


def most_held(cls: type, total: int = 64 * MiB, read: int = 64 * 1024) -> int:
    """A sender that fills whatever window it is given, a reader that takes `read`
    bytes between the sender's turns: the most the channel and the stream above it
    held at once."""
    chan = _channel(cls)
    session = chan._session = _Session(WINDOW)
    session.chan = chan
    sent = most = 0
    peer_window = WINDOW
    while sent < total:
        peer_window += chan.credited
        chan.credited = 0
        while peer_window >= PACKET and sent < total:
            chan._accept_data(b"x" * PACKET)
            peer_window -= PACKET
            sent += PACKET
        held = sum(len(d) for d, _ in chan._recv_buf) + session.waiting
        most = max(most, held)
        session.read(read)
    return most


def test_the_window_holds_however_slow_the_reader() -> None:
    assert most_held(_Held) <= 2 * WINDOW  # the channel's window, and the stream's


def test_asyncssh_alone_lets_a_fast_sender_run_ahead() -> None:
    """The bug `window.py` works around (if asyncssh fixes it, this fails: drop the
    workaround)."""
    assert most_held(_Plain) > 8 * WINDOW
