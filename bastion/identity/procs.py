"""What the gateway reads of a process besides the identity walk: one line of
/proc/PID/stat, the kernel's boot id, and the namespaces a process lives in.

`resolver.py` walks a peer's whole chain with psutil (about 0.15 ms a process)
to decide who is asking. Two things need less, and need it where that walk is
too dear or has not happened yet: the tenant a connection counts against
(`tenants.py`, asked for every connection before its walk is queued) needs
each ancestor's parent and start; an action key's owner (`agent_ssh.py` for a
request, `agent_doors.py` for a question) needs a name for the subject that a
gateway restart does not change. Both read one file per process here.

A `Lasting` name is (kernel boot id, pid, start in clock ticks since boot): it
names one process for the whole life of one kernel boot, whatever the wall
clock does (the start time `resolver.py` reports is built on /proc/stat's
btime, which moves when the clock is stepped) and whichever gateway lifetime
reads it.

**Sandboxed** means: in another PID or user namespace than the gateway's own
(`in_other_namespaces`). That is what `bastion run` makes (bubblewrap), and a
fact the kernel keeps, so it holds whether or not this gateway lifetime saw the
run register. The links under /proc/PID/ns need ptrace-read access (a gateway
that is not root cannot read another uid's, root's among them); then the
world-readable `NSpid` line of /proc/PID/status (one pid per PID namespace
level) and /proc/PID/uid_map (shown relative to the reader's user namespace)
decide. Where none of it can be read, the answer is "sandboxed": closed.
"""

from __future__ import annotations

import functools
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from bastion.core.subject import Subject
from bastion.identity import alive
from bastion.identity.images import stat_fields

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
NAMESPACES = ("pid", "user")  # a run's sandbox has its own of both


@dataclass(frozen=True)
class Stat:
    """One process as /proc/PID/stat says at one moment."""

    pid: int
    ppid: int
    start_ticks: int  # field 22: clock ticks after boot; fixed for the process's life


def stat(pid: int) -> Stat | None:
    """The process's parent and start, or None when it is gone (or unreadable)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = stat_fields(f.read())
        return Stat(pid, int(fields[1]), int(fields[19]))
    except (OSError, IndexError, ValueError):
        return None


@functools.cache
def kernel_boot() -> str:
    """This kernel boot's id: a pid and a start tick name one process within it only."""
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return "unknown-boot"


@dataclass(frozen=True)
class Lasting:
    """A process's name that outlives a gateway lifetime (not a reboot)."""

    boot: str
    pid: int
    start_ticks: int

    def text(self) -> str:
        return f"{self.boot}:{self.pid}:{self.start_ticks}"


def lasting(pid: int) -> Lasting | None:
    st = stat(pid)
    return None if st is None else Lasting(kernel_boot(), pid, st.start_ticks)


def owner(subject: Subject) -> str:
    """The subject's lasting name as an action key's owner (`events.bound_action`),
    read now. A subject that is gone -- or whose pid now names another process --
    gets a name nobody else has: its request is refused anyway, and must not touch
    any action."""
    name = lasting(subject.pid)
    if name is None or not alive(subject.pid, subject.start_time):
        return "gone:" + secrets.token_hex(8)
    return name.text()


def in_other_namespaces(pid: int) -> bool:
    """Is `pid` in another PID or user namespace than this process (or can that not
    be read)? Closed: a process whose namespaces cannot be read counts as in another."""
    try:
        return any(
            os.readlink(f"/proc/{pid}/ns/{ns}") != os.readlink(f"/proc/self/ns/{ns}")
            for ns in NAMESPACES
        )
    except OSError:
        pass  # not ours to ptrace-read (another uid, root): what anyone may read decides
    try:
        return _pid_depth(pid) != _pid_depth("self") or _uid_map(pid) != _uid_map("self")
    except (OSError, ValueError):
        return True


def _pid_depth(pid: int | str) -> int:
    """How many PID namespaces `pid` is nested in, as /proc/PID/status's NSpid says."""
    with open(f"/proc/{pid}/status", "rb") as f:
        for line in f:
            if line.startswith(b"NSpid:"):
                return len(line.split()) - 1
    raise ValueError("no NSpid line")


def _uid_map(pid: int | str) -> list[list[bytes]]:
    with open(f"/proc/{pid}/uid_map", "rb") as f:
        return [line.split() for line in f]
