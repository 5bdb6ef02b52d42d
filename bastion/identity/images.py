"""What a process runs: the sha256 of its executable, and which exec it is in.

exec() keeps a process's pid and start time, and an interpreter that execs
itself (`python3 a.py` into `python3 b.py`) keeps its executable too, so none of
them tells one program from the next. `Images` gives each exec a name of the
gateway's own (a random token) and keeps that name only while it can show that
no exec happened since (docs/architecture.md, "Who is asking"):

1. **A thread.** exec() ends every other thread of the process before the new
   program runs. A thread seen when the image was named, still alive under the
   same thread id with the same start time, proves that no exec happened: a new
   thread would need that id (pids wrapping round) within that clock tick.
   /proc/PID/task is readable for any process, so this holds for another user's
   process too (`bastion run --isolated` runs as root and keeps such a thread).
2. **Its memory.** Else /proc/PID/environ, held open since the image was named:
   the kernel ties that descriptor to the address space it was opened on, and
   its reads return nothing once no task uses it -- which exec() makes so. And
   the image's layout -- /proc/PID/auxv and the address fields of
   /proc/PID/stat, placed at random by every exec while ASLR is on -- must be
   the same. Each alone can be defeated: the old address space stays in use if
   a process shares it (a CLONE_VM child that never execs, or a read of it kept
   stalled on purpose), and a program may write its own layout fields (prctl
   PR_SET_MM_MAP, for checkpoint/restore, needs no privilege). Not seeing an
   exec here takes both at once: a program written against this check.
3. **Nothing.** Where neither can be read -- by a gateway that is not root,
   another user's single-threaded process or one that made itself not
   dumpable; an empty environment -- every sighting is a new image, so every
   request asks.

Both reads need ptrace-read access (same uid, or root); Yama's ptrace_scope
restricts attaching, not reading. Descriptors of images are closed when the
process is forgotten (`Resolver.forget`, `Resolver.prune`).
"""

from __future__ import annotations

import hashlib
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from bastion.core.subject import ExecWatch

# A file whose ctime is this close to the moment it was hashed is hashed again next
# time: timestamps tick coarsely (jiffies; 2 s on FAT), so a write in the same tick as
# the hash would leave the key unchanged ("racy git"). Far above any tick.
CTIME_MARGIN_NS = 2_000_000_000
_READ_TRIES = 3  # a file that changes under every read is not named at all
_CHUNK = 1 << 20
_MAX_CACHED = 4096
_MAX_WITNESSES = 8  # threads remembered per image; the oldest first (/proc lists by id)
_MAX_HELD = 4096  # address spaces held open at once; past it, new images rely on threads
# /proc/PID/stat fields (1-based, proc(5)) that exec() places: startcode, endcode,
# startstack, startdata, enddata, startbrk, arg_start, arg_end, env_start, env_end.
_LAYOUT_FIELDS = (26, 27, 28, 45, 46, 47, 48, 49, 50, 51)

FileKey = tuple[int, int, int, int, int]  # (dev, ino, size, mtime_ns, ctime_ns)


def stat_fields(data: bytes) -> list[bytes]:
    """/proc/PID/stat's fields from the state on (field 3 at index 0): the name,
    in parentheses, may hold spaces and parentheses of its own."""
    return data[data.rindex(b")") + 2 :].split()


def _stat(path: str) -> list[bytes] | None:
    try:
        with open(path, "rb") as f:
            return stat_fields(f.read())
    except (OSError, ValueError):
        return None


def start_ticks(path: str) -> int | None:
    """Field 22 of a stat file: when the task started, in clock ticks since boot."""
    fields = _stat(path)
    return int(fields[19]) if fields else None


def _file_key(st: os.stat_result) -> FileKey:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _sha256(fd: int) -> str:
    h, offset = hashlib.sha256(), 0
    while chunk := os.pread(fd, _CHUNK, offset):
        h.update(chunk)
        offset += len(chunk)
    return h.hexdigest()


@dataclass
class ExeHasher:
    """sha256 of the file a process executes, read through /proc/PID/exe: the
    inode the kernel runs, even renamed or deleted. Cached -- hashing a 5 MB
    interpreter on every request would dominate the hot path -- by (device,
    inode, size, mtime, ctime) of that very descriptor. A user can set a file's
    mtime back (utime) but not its ctime, which every write and every utime
    moves; an entry is made only when the file's ctime is older than the start
    of the hash by `CTIME_MARGIN_NS`, and the descriptor is fstat'ed before and
    after the read, so a write during the read is hashed again."""

    clock: Callable[[], int] = time.time_ns  # the wall clock file timestamps use
    _cache: dict[FileKey, str] = field(default_factory=dict)

    def digest(self, pid: int) -> str | None:
        try:
            fd = os.open(f"/proc/{pid}/exe", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None  # kernel thread, exited, or not ours to read
        try:
            return self.digest_fd(fd)
        except OSError:
            return None
        finally:
            os.close(fd)

    def digest_fd(self, fd: int) -> str | None:
        key = _file_key(os.fstat(fd))
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        for _ in range(_READ_TRIES):
            began = self.clock()
            value = _sha256(fd)
            after = _file_key(os.fstat(fd))
            if after == key:
                if key[4] < began - CTIME_MARGIN_NS:
                    if len(self._cache) >= _MAX_CACHED:
                        self._cache.clear()
                    self._cache[key] = value
                return value
            key = after  # written while read: again
        return None


def layout(pid: int) -> str | None:
    """sha256 of what exec() placed at random: the auxiliary vector and the
    address fields of /proc/PID/stat. None when not ours to read."""
    try:
        with open(f"/proc/{pid}/auxv", "rb") as f:
            auxv = f.read()
    except OSError:
        return None
    fields = _stat(f"/proc/{pid}/stat")
    if not auxv or fields is None or len(fields) < _LAYOUT_FIELDS[-1] - 2:
        return None
    addresses = b" ".join(fields[n - 3] for n in _LAYOUT_FIELDS)
    return hashlib.sha256(auxv + b"\0" + addresses).hexdigest()


def _in_use(fd: int) -> bool:
    """Does the address space this /proc/PID/environ descriptor was opened on still
    have a task? (Its reads return 0 bytes once it has none.)"""
    try:
        return len(os.pread(fd, 1, 0)) == 1
    except OSError:
        return False


def _task(pid: int, tid: int) -> str:
    """The stat file of thread `tid` *of process `pid`*: no other process's thread."""
    return f"/proc/{pid}/task/{tid}/stat"


def _witnesses(pid: int) -> tuple[tuple[int, int], ...]:
    """(thread id, start ticks) of the process's threads other than its first."""
    try:
        tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except (OSError, ValueError):
        return ()
    out: list[tuple[int, int]] = []
    for tid in tids:
        if tid == pid:
            continue
        ticks = start_ticks(_task(pid, tid))
        if ticks is not None:
            out.append((tid, ticks))
        if len(out) == _MAX_WITNESSES:
            break
    return tuple(out)


@dataclass(frozen=True)
class _Image:
    """One exec of one process, as first seen: what will show it is still the one."""

    name: str
    witnesses: tuple[tuple[int, int], ...]  # (tid, start ticks)
    layout: str | None
    memory: int | None  # a /proc/PID/environ descriptor on its address space


class Images:
    """The exec each known process is in; see the module's docstring. Called from
    the agent socket's worker threads and from the event loop, hence the lock."""

    def __init__(self) -> None:
        self._seen: dict[tuple[int, float], _Image] = {}
        self._held = 0
        self._lock = threading.Lock()

    def current(self, pid: int, start_time: float) -> tuple[str, ExecWatch]:
        """The name of the exec `pid` is in now, and how an exec of it is seen."""
        key = (pid, start_time)
        with self._lock:
            old = self._seen.get(key)
            if old is not None:
                watch = _still(pid, old)
                if watch is not None:
                    return old.name, watch
                self._drop(key)
            image, watch = self._name(pid)
            if watch is ExecWatch.NOTHING:
                self._close(image)
            else:
                self._seen[key] = image
            return image.name, watch

    def known(self) -> set[tuple[int, float]]:
        with self._lock:
            return set(self._seen)

    def forget(self, pid: int, start_time: float) -> None:
        with self._lock:
            self._drop((pid, start_time))

    def _name(self, pid: int) -> tuple[_Image, ExecWatch]:
        before = layout(pid)
        witnesses = _witnesses(pid)
        memory = None
        if before is not None and self._held < _MAX_HELD:
            try:
                memory = os.open(f"/proc/{pid}/environ", os.O_RDONLY | os.O_CLOEXEC)
                self._held += 1
            except OSError:
                memory = None
        if memory is not None and not _in_use(memory):  # an empty environment
            os.close(memory)
            self._held -= 1
            memory = None
        image = _Image(secrets.token_hex(8), witnesses, before, memory)
        if layout(pid) != before:  # it exec'd while we looked: name nothing
            return image, ExecWatch.NOTHING
        # An exec while we looked has ended every thread we saw (and changed the
        # layout, where it can be read).
        alive = tuple(w for w in witnesses if start_ticks(_task(pid, w[0])) == w[1])
        image = _Image(image.name, alive, before, memory)
        if alive:
            return image, ExecWatch.THREAD
        if memory is not None:
            return image, ExecWatch.MEMORY
        return image, ExecWatch.NOTHING

    def _drop(self, key: tuple[int, float]) -> None:
        image = self._seen.pop(key, None)
        if image is not None:
            self._close(image)

    def _close(self, image: _Image) -> None:
        if image.memory is not None:
            os.close(image.memory)
            self._held -= 1


def _still(pid: int, image: _Image) -> ExecWatch | None:
    """How `image` is shown to be what `pid` runs now; None if it is not."""
    for tid, ticks in image.witnesses:
        if start_ticks(_task(pid, tid)) == ticks:
            return ExecWatch.THREAD
    if image.memory is not None and _in_use(image.memory) and layout(pid) == image.layout:
        return ExecWatch.MEMORY
    return None
