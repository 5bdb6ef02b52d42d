"""How many commands one target serves well at once: learned, not configured.

Direct ssh staggers a fleet's commands by itself: each client pays its own
handshake before its command reaches the target. The gateway's pooled channels
do not, so 64 agents' commands would reach the target in one burst, and a target
that serialises somewhere (a lock in the user's rc files, a slow disk, one CPU)
turns that burst into a tail longer than direct ssh's. The right number of
commands at once differs per target and per hour, so the gateway learns it per
(host, account), as TCP's congestion control and Netflix's concurrency-limits
learn theirs: from how long commands take.

The signal is a command's time at the target (from its slot to its exit), and how
many of the target's commands were in flight as it started (graduated ones, below,
included: they left their slots, not the target). The `baseline` is
the median time of the latest commands that started with at most `FLOOR` in
flight -- what a command takes when the target is not busy with bastion's other
commands. Each window's median is compared with it:

- above `tolerance` times the baseline, the target is queueing work: the limit
  shrinks in proportion (at most by half a window), never below `FLOOR`;
- under `GROW_BELOW` times the baseline while the limit held commands back, the
  target has room: the limit grows (by its square root, so a quick target is
  found in a few windows), never above the `ceiling` (`[limits] inflight`);
- in between, or while the limit held nothing back, it stays.

A lane starts at `START` (about what sshd's `MaxStartups` lets direct clients
send into their handshakes at once) and measures its baseline with a first
window at `FLOOR`. A baseline goes stale (the target may have become faster or
slower for good): after `PROBE_EVERY` windows without a command at `FLOOR`,
one window runs at `FLOOR` to measure it again (as TCP BBR probes its round-trip time), then the
limit comes back.

Medians, not means: a few long commands among short ones do not move it. A
command still running after `graduation` (a few baselines) may be one that runs
long by nature: it leaves its slot (the ceiling still counts it), so long-running
commands never hold a target's short ones back (a fleet of them starts `START`
per graduation). One that then ends within `SLOW_START` graduations was slow to
start, not long, and its whole time is a sample: without it the windows held only
the commands quick enough not to graduate, and against a target whose commands
queued for seconds (on a lock in its rc files) the limit never saw the queue
while graduations let ever more commands in (`slow_start`). One that runs longer
gives no sample. Graduations do not grow the limit:
measured, against a target whose commands queued for seconds, they grew it past
what it served (38 at once where 6 did better) -- a slow start looks like a long
command.

Pure: the gateway (`gateway/admission.py`) measures and carries out.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace

START = 8  # commands at once to a target nothing is known of yet (sshd's MaxStartups is 10)
FLOOR = 2  # never fewer: one slow command must not serialise a target
TOLERANCE = 2.0  # window median over baseline that counts as the target queueing work
GROW_BELOW = 1.5  # window median over baseline under which a held-back limit grows
WINDOW = 8  # samples per decision
BACKOFF = 0.5  # the most a limit shrinks in one window (a factor)
PROBE_EVERY = 32  # windows a baseline lasts without a window mostly at FLOOR
PROBE_GIVES_UP = 8  # windows a probe waits for the target's commands to drain
GRADUATION_MIN = 1.0  # seconds: a command running longer leaves its slot ...
GRADUATION_BASELINES = 4.0  # ... or this many baselines, whichever is longer
SLOW_START = 4.0  # a graduated command ending within this many graduations was slow, not long


@dataclass(frozen=True)
class Estimate:
    """What is known of one target: its limit, baseline, and the window so far."""

    limit: int = START
    baseline: float | None = None  # seconds; None until a command ran at FLOOR
    window: tuple[float, ...] = ()
    window_quiet: int = 0  # of the window, commands that started at FLOOR
    quiet: tuple[float, ...] = ()  # the latest times of commands that started at FLOOR
    held_back: bool = False  # a command waited for this limit during the window
    stale: int = 0  # windows since one had commands at FLOOR
    probing: int | None = None  # the limit to come back to after a probe

    @property
    def graduation(self) -> float:
        """Seconds after which a running command leaves its slot (module docstring)."""
        if self.baseline is None:
            return GRADUATION_MIN
        return max(GRADUATION_MIN, GRADUATION_BASELINES * self.baseline)


def slow_start(seconds: float, graduation: float) -> bool:
    """A graduated command that ended after `seconds` was slow to start rather than
    long by nature: its time is a sample (module docstring)."""
    return seconds <= SLOW_START * graduation


def held_back(est: Estimate) -> Estimate:
    """A command had to wait for this target's limit."""
    return est if est.held_back else replace(est, held_back=True)


def observe(est: Estimate, seconds: float, started_with: int, ceiling: int | None) -> Estimate:
    """One command's time at the target, and how many were in flight as it started
    (itself included); at a full window, the limit is decided anew."""
    seconds = max(seconds, 1e-6)
    est = replace(est, window=(*est.window, seconds))
    if started_with <= FLOOR:
        quiet = (*est.quiet, seconds)[-WINDOW:]
        est = replace(
            est, quiet=quiet, baseline=statistics.median(quiet), window_quiet=est.window_quiet + 1
        )
    if len(est.window) < WINDOW:
        return est
    limit, probing = est.limit, est.probing
    measured = est.window_quiet >= WINDOW // 2
    stale = 0 if measured else est.stale + 1
    if probing is not None:
        if measured or stale > PROBE_GIVES_UP:  # measured again, or never quiet: give up
            limit, probing = probing, None
    elif est.baseline is None:  # nothing ran at FLOOR yet: measure it
        if bounded(limit, ceiling) > FLOOR:
            limit, probing, stale = FLOOR, bounded(limit, ceiling), 0
    else:
        ratio = statistics.median(est.window) / est.baseline
        if ratio > TOLERANCE:
            limit = math.floor(limit * max(BACKOFF, TOLERANCE / ratio))
        elif ratio < GROW_BELOW and est.held_back:
            limit += max(1, math.isqrt(limit))
        if stale >= PROBE_EVERY and bounded(limit, ceiling) > FLOOR:
            limit, probing, stale = FLOOR, bounded(limit, ceiling), 0
    return replace(
        est,
        limit=bounded(limit, ceiling),
        window=(),
        window_quiet=0,
        held_back=False,
        stale=stale,
        probing=probing,
    )


def bounded(limit: int, ceiling: int | None) -> int:
    """Within [FLOOR, ceiling]; the ceiling wins over the floor where it is lower."""
    limit = max(FLOOR, limit)
    return limit if ceiling is None else max(1, min(limit, ceiling))
