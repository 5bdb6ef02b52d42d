"""Memory that comes back: the gateway hands the allocator's free pages back to the system.

Measured (bench/load.py --stream-mb, issue 23): most of what a 200 MB stream left
behind was a window that did not hold (`window.py`: 113 MB buffered at once). With
that fixed, what is left is glibc's: a burst's freed memory stays in the heap (each
256 kB read is sliced packet by packet, each packet decrypted into a fresh 32 kB
object, and the holes are not all reused), so RSS after a stream or a burst of 64
agents stays above where it started while what Python holds is back. `malloc_trim(0)`
gives those pages back (a fragmented 200 MB heap: 21 ms, 199 -> 11 MB).

So the gateway trims: while bytes flow, once every `every_bytes` relayed, which bounds
the heap a long stream grows; and once it is quiet after work (a burst of commands, a
stream that ended), which brings RSS back to its start. A quiet trim first runs the
cyclic garbage collector: a finished SSH connection or channel (asyncssh's, asyncio's)
is a web of reference cycles that only a full collection frees, and Python runs one
only when its oldest generation has grown by a quarter -- after a burst of 64 agents
that left their connections' memory held for minutes, and with it the arenas and heap
pages around them. For the same reason a busy gateway collects every
`collect_every` seconds while commands end: garbage left in place while new
connections are made pushes their objects into new arenas, which the long-lived
objects made beside them (a request's story, say) then keep from ever being freed
(measured after 64 agents against the rc-reading target: 21 arenas of 1 MiB before,
25 after, 4 MB of them free blocks). `Schedule` decides when;
`Trimmer` counts and carries it out; `settle` keeps what lives as long as the gateway
out of those collections. Where the C library has no `malloc_trim` (not
glibc), nothing is done.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

MiB = 1024 * 1024


@dataclass(frozen=True)
class Schedule:
    """When to trim. While bytes flow, after every `every_bytes` relayed: a trim walks
    the heap, which that many bytes grew by at most about as much, so its cost is
    bounded per byte (and small beside the bytes' encryption). Once `quiet` seconds
    pass with nothing relayed after any work at all, and never more often than every
    `min_interval` seconds that way: a lone command now and then is not trimmed for."""

    every_bytes: int = 16 * MiB
    min_interval: float = 5.0
    quiet: float = 1.0
    collect_every: float = 5.0

    def while_flowing(self, relayed: int) -> bool:
        """A trim in the middle of a stream: enough bytes since the last one."""
        return relayed >= self.every_bytes

    def when_quiet(self, worked: bool, now: float, last_work: float, last_quiet: float) -> bool:
        """A trim once the gateway is quiet after work (bytes relayed or commands ended
        since the last trim), at most every `min_interval` seconds (`last_quiet`: the
        last such trim; one in a stream does not count: what followed it is left)."""
        return worked and now - last_work >= self.quiet and now - last_quiet >= self.min_interval

    def while_busy(self, ended: int, now: float, last_collect: float) -> bool:
        """A garbage collection (no trim) while commands keep ending: one ended since the
        last collection, which was `collect_every` seconds ago or more."""
        return ended > 0 and now - last_collect >= self.collect_every


def _libc_trim() -> Callable[[], object] | None:
    """glibc's malloc_trim(0), or None where the C library has none."""
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return lambda: fn(0)


class Trimmer:
    """Counts what the relays carried and trims when `Schedule` says so."""

    def __init__(
        self,
        schedule: Schedule = Schedule(),
        trim: Callable[[], object] | None = None,
        clock: Callable[[], float] = time.monotonic,
        collect: Callable[[], object] = gc.collect,
    ) -> None:
        self.schedule = schedule
        self._trim = trim if trim is not None else _libc_trim()
        self._collect = collect
        self._clock = clock
        self._relayed = 0  # bytes since the last trim
        self._worked = False  # anything since the last trim
        self._last_work = clock()
        self._last_quiet = float("-inf")
        self._ended = 0  # commands ended since the last collection
        self._last_collect = clock()
        self.trims = 0
        self.collections = 0

    def relayed(self, n: int) -> None:
        """`n` bytes went through a relay (either way)."""
        self._relayed += n
        self._worked = True
        self._last_work = self._clock()
        if self.schedule.while_flowing(self._relayed):
            self.trim()

    def ended(self) -> None:
        """A command's relay ended: work that may have left pages behind."""
        self._worked = True
        self._last_work = self._clock()
        self._ended += 1

    def tick(self) -> None:
        """Called now and then (`idle`): trims once quiet after work, collects while busy."""
        now = self._clock()
        if self.schedule.when_quiet(self._worked, now, self._last_work, self._last_quiet):
            self._last_quiet = now
            self.trim(collect=True)
        elif self.schedule.while_busy(self._ended, now, self._last_collect):
            t0 = time.perf_counter()
            self._collected(now)
            log.debug("collected while busy in %.1f ms", (time.perf_counter() - t0) * 1e3)

    def _collected(self, now: float) -> None:
        self._collect()
        self.collections += 1
        self._ended = 0
        self._last_collect = now

    def trim(self, collect: bool = False) -> None:
        """Hand free pages back; `collect`: after a full garbage collection (quiet only:
        it walks every object, which a trim in mid-stream has no reason to pay for)."""
        self._relayed = 0
        self._worked = False
        t0 = time.perf_counter()
        if collect:
            self._collected(self._clock())
        if self._trim is not None:
            self._trim()
            self.trims += 1
        log.debug("trim took %.1f ms (collect: %s)", (time.perf_counter() - t0) * 1e3, collect)

    async def idle(self, every: float = 0.5) -> None:
        """Tick forever (the gateway's lifetime)."""
        while True:
            await asyncio.sleep(every)
            self.tick()


def settle() -> None:
    """Once the gateway has started: collect start-up's garbage, then put every object
    alive now (the modules, the policy, the requests loaded from the journal) out of the
    collector's sight. They live as long as the gateway, yet a full collection walked
    them all, every `collect_every` seconds while busy: ~50,000 objects, 32 ms of CPU
    (median) on the event loop with 64 agents at work, more with a longer journal.
    Frozen, they cost it nothing: the same run's collections walked 1,600-6,400 objects
    in 4 ms (bench/README.md). Reference counting still frees a frozen object nobody
    holds; only a cycle among them would stay, hence the collection first. The vault is
    locked at start-up, so no key is among them."""
    gc.collect()
    gc.freeze()


# The gateway's one trimmer: the relays (outbound, sftp) tell it what they carried,
# and `lifetime` runs its `idle` loop.
TRIMMER = Trimmer()
