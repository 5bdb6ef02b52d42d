"""How many commands one target serves well at once: learned, not configured.

Direct ssh staggers a fleet's commands by itself: each client pays its own
handshake before its command reaches the target. The gateway's pooled channels
do not, so 64 agents' commands would reach the target in one burst, and a target
that serialises somewhere (a lock in the user's rc files, a slow disk, one CPU)
turns that burst into a tail longer than direct ssh's. The right number of
commands at once differs per target and per hour, so the gateway learns it per
(host, account), as TCP's congestion control and Netflix's concurrency-limits
learn theirs: from how long commands take.

The signal is a command's time at the target (from its slot to its exit). The
controller keeps a `baseline` (the lowest window median seen, aging slowly
upward so a target that became slower for good is learned again) and compares
each window's median with it:

- above `tolerance` times the baseline, the target is queueing work: the limit
  shrinks in proportion (at most by half a window), never below `floor`;
- near the baseline while the limit held commands back, the target has room:
  the limit grows (by its square root, so a quick target is found in a few
  windows), never above the `ceiling` (`[limits] inflight`);
- in between, or while the limit held nothing back, it stays.

Medians, not means: a few long commands among short ones do not move it. A
command still running after `graduation` (a few baselines) has shown it is not
waiting at the start: it leaves its slot (the ceiling still counts it) and gives
no sample, so long-running commands never hold a target's short ones back.

Pure: the gateway (`gateway/admission.py`) measures and carries out.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace

START = 8  # commands at once to a target nothing is known of yet
FLOOR = 2  # never fewer: one slow command must not serialise a target
TOLERANCE = 2.0  # window median over baseline that counts as the target queueing work
GROW_BELOW = 1.5  # window median over baseline under which a held-back limit grows
WINDOW = 8  # samples per decision
BACKOFF = 0.5  # the most a limit shrinks in one window (a factor)
DRIFT = 1.02  # the baseline ages upward by this factor per window
GRADUATION_MIN = 1.0  # seconds: a command running longer leaves its slot ...
GRADUATION_BASELINES = 4.0  # ... or this many baselines, whichever is longer


@dataclass(frozen=True)
class Estimate:
    """What is known of one target: its limit, baseline, and the window so far."""

    limit: int = START
    baseline: float | None = None  # seconds; None until a first window
    window: tuple[float, ...] = ()
    held_back: bool = False  # a command waited for this limit during the window
    windows: int = 0  # decisions made, since start

    @property
    def graduation(self) -> float:
        """Seconds after which a running command leaves its slot (module docstring)."""
        if self.baseline is None:
            return GRADUATION_MIN
        return max(GRADUATION_MIN, GRADUATION_BASELINES * self.baseline)


def held_back(est: Estimate) -> Estimate:
    """A command had to wait for this target's limit."""
    return est if est.held_back else replace(est, held_back=True)


def observe(est: Estimate, seconds: float, ceiling: int | None) -> Estimate:
    """One command's time at the target; at a full window, the limit is decided anew."""
    window = (*est.window, max(seconds, 1e-6))
    if len(window) < WINDOW:
        return replace(est, window=window)
    short = statistics.median(window)
    baseline = short if est.baseline is None else min(short, est.baseline * DRIFT)
    ratio = short / baseline
    limit = est.limit
    if ratio > TOLERANCE:
        limit = math.floor(limit * max(BACKOFF, TOLERANCE / ratio))
    elif ratio < GROW_BELOW and est.held_back:
        limit += max(1, math.isqrt(limit))
    return Estimate(bounded(limit, ceiling), baseline, (), False, est.windows + 1)


def bounded(limit: int, ceiling: int | None) -> int:
    """Within [FLOOR, ceiling]; the ceiling wins over the floor where it is lower."""
    limit = max(FLOOR, limit)
    return limit if ceiling is None else max(1, min(limit, ceiling))
