"""Delivering witness entries: the spool on disk, the witnesses, one courier each.

`witness.py` decides what is witnessed; this module gets it there without ever
blocking the request path. `Spool.append` is a write to the local disk and
returns; one `Courier` thread per witness sends entries in order from its cursor
and moves the cursor only past what is confirmed: fsynced to the witness file;
acknowledged by the collector's TCP stack (SIOCOUTQ reaches 0), or read by it
off a unix stream socket, or queued on its datagram socket. What is not
confirmed is sent again, after a pause that doubles up to `BACKOFF[1]`.

So an entry is lost only once the collector holds it (its own queues, or a
crash before it read its socket) or when the spool's disk loses unsynced writes
(a power cut); it is sent twice only when the gateway dies between a
confirmation and the cursor's update, or the connection breaks with an
acknowledgement in flight. A collector that must not lose entries uses a
disk-assisted queue; a reader that must not see duplicates keys entries by
(`journal`, `seq`) for heads and by `request_id` for summaries.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import logging
import os
import select
import socket
import termios
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bastion.config import SyslogTarget
from bastion.core.errors import BastionError

log = logging.getLogger(__name__)

HEAD, AUDIT = "bastion-witness", "bastion-audit"  # the markers, and the entry kinds
SEGMENT_ENTRIES = 4096  # entries per spool segment
BATCH = 256  # entries per delivery
BACKOFF = (0.25, 10.0)  # the first and the longest pause after a failed delivery, seconds
TIMEOUT = 10.0  # connecting, sending, and waiting for the collector's acknowledgement
PRI = {HEAD: 10 * 8 + 5, AUDIT: 10 * 8 + 6}  # authpriv.notice, authpriv.info


def dumps(doc: Any) -> str:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


# -- the spool ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    n: int  # its place in the spool, across lifetimes
    kind: str  # HEAD or AUDIT
    t: float
    doc: dict[str, Any]
    where: tuple[int, int] = (0, 0)  # (segment, offset just after its line)

    def line(self) -> str:
        return f"{self.kind} {dumps(self.doc)}"


def _entry(raw: bytes, seg: int, end: int) -> Entry | None:
    try:
        d = json.loads(raw)
        return Entry(int(d["n"]), str(d["kind"]), float(d["t"]), dict(d["doc"]), (seg, end))
    except (ValueError, KeyError, TypeError):
        return None


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


class Spool:
    """Entries not yet delivered, in order, in append-only segments
    (`NNNNNNNNNNNN.jsonl`, named by their first entry), with one cursor per
    witness (`cursor-NAME`: the last entry it confirmed). A segment every cursor
    has passed is deleted. A torn last line (a crash mid-write) is cut at open."""

    def __init__(self, directory: Path, names: Iterable[str]) -> None:
        self.directory = directory
        self.cursors = dict.fromkeys(names, 0)
        self.last = 0
        self.cond = threading.Condition()
        self._pos: dict[str, tuple[int, int]] = {}  # where the entry after the cursor is
        self._segs: list[int] = []
        self._fd: int | None = None
        self._count = 0  # entries in the newest segment

    def _path(self, seg: int) -> Path:
        return self.directory / f"{seg:012d}.jsonl"

    def _lines(self, seg: int, offset: int = 0) -> Iterator[Entry]:
        with contextlib.suppress(FileNotFoundError), open(self._path(seg), "rb") as f:
            f.seek(offset)
            for raw in iter(f.readline, b""):
                if not raw.endswith(b"\n"):
                    return  # still being written
                offset += len(raw)
                e = _entry(raw, seg, offset)
                if e is not None:
                    yield e

    def open(self) -> None:
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._segs = sorted(int(p.stem) for p in self.directory.glob("*.jsonl") if p.stem.isdigit())
        saved = {name: self._read_cursor(name) for name in self.cursors}
        self.last = max(saved.values(), default=0)
        if self._segs:
            newest = self._path(self._segs[-1])
            data = newest.read_bytes()
            if not data.endswith(b"\n") and data:
                log.warning("witness spool: a torn entry at the end of %s was cut", newest)
                os.truncate(newest, data.rfind(b"\n") + 1)
            entries = list(self._lines(self._segs[-1]))
            self._count = len(entries)
            self.last = max(self.last, entries[-1].n if entries else self._segs[-1] - 1)
        for name, n in saved.items():
            self.cursors[name] = min(n, self.last)
            self._pos[name] = self._locate(self.cursors[name])
        seg = self._segs[-1] if self._segs else self.last + 1
        self._segs = self._segs or [seg]
        self._fd = os.open(self._path(seg), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._compact()

    def _read_cursor(self, name: str) -> int:
        try:
            return int(json.loads((self.directory / f"cursor-{name}").read_text())["n"])
        except (OSError, ValueError, KeyError, TypeError):
            return 0

    def _locate(self, n: int) -> tuple[int, int]:
        """Where the entry after `n` starts (or will)."""
        seg = max((s for s in self._segs if s <= n + 1), default=self._segs[0] if self._segs else 1)
        offset = 0
        for e in self._lines(seg):
            if e.n > n:
                break
            offset = e.where[1]
        return seg, offset

    def append(self, kind: str, doc: dict[str, Any], t: float) -> int:
        """Add one entry (a write to the local disk, no fsync); wakes the couriers."""
        with self.cond:
            if self._fd is None:
                raise OSError(errno.EBADF, "the witness spool is not open")
            if self._count >= SEGMENT_ENTRIES:
                os.close(self._fd)
                self._segs.append(self.last + 1)
                self._fd = os.open(
                    self._path(self._segs[-1]), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600
                )
                self._count = 0
            n = self.last + 1
            data = (dumps({"doc": doc, "kind": kind, "n": n, "t": t}) + "\n").encode()
            if os.write(self._fd, data) != len(data):
                raise OSError(errno.EIO, "short write to the witness spool")
            self.last, self._count = n, self._count + 1
            self.cond.notify_all()
        return n

    def read(self, name: str, limit: int = BATCH) -> list[Entry]:
        """The next entries after `name`'s cursor (not moved until `commit`)."""
        with self.cond:
            last, (seg, offset) = self.last, self._pos[name]
            later = [s for s in self._segs if s > seg]
        out: list[Entry] = []
        for e in self._lines(seg, offset):
            if e.n > last or len(out) >= limit:
                break
            out.append(e)
        if not out and later:
            with self.cond:
                self._pos[name] = (later[0], 0)
            return self.read(name, limit)
        return out

    def commit(self, name: str, entry: Entry) -> None:
        """`name` has confirmed everything up to `entry` (one courier per name)."""
        _write_atomic(self.directory / f"cursor-{name}", json.dumps({"n": entry.n}))
        with self.cond:
            self.cursors[name], self._pos[name] = entry.n, entry.where
            self._compact()

    def _compact(self) -> None:
        low = min(self.cursors.values(), default=self.last)
        while len(self._segs) > 1 and self._segs[1] - 1 <= low:
            with contextlib.suppress(FileNotFoundError):
                self._path(self._segs.pop(0)).unlink()

    def waiting(self, name: str | None = None) -> int:
        """Entries after `name`'s cursor (after the slowest one's, without a name)."""
        cursor = self.cursors[name] if name else min(self.cursors.values(), default=self.last)
        return self.last - cursor

    def close(self) -> None:
        with self.cond:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


# -- the witnesses ----------------------------------------------------------------------------


class Undelivered(BastionError):
    """A delivery failed after its first `delivered` entries were confirmed."""

    def __init__(self, delivered: int, why: str) -> None:
        super().__init__(why)
        self.delivered = delivered


WITNESS_FILE = "bastion-witness.jsonl"  # the file a witness directory gets


class FileWitness:
    """One line per head, appended and fsynced: point it at another mount or machine.
    A directory gets `WITNESS_FILE` inside it (one directory may serve many homes:
    every head names its journal)."""

    name = "file"

    def __init__(self, path: Path) -> None:
        self.path = path
        self.address = str(path)

    def wants(self, kind: str) -> bool:
        return kind == HEAD

    def deliver(self, entries: list[Entry]) -> None:
        data = "".join(e.line() + "\n" for e in entries).encode()
        try:
            path = self.path / WITNESS_FILE if self.path.is_dir() else self.path
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            raise Undelivered(0, f"{self.path}: {exc.strerror or exc}") from None

    def close(self) -> None:
        pass


def _unacked(sock: socket.socket) -> int:
    """Bytes sent and not yet acknowledged by the peer (TCP) or read by it (unix stream)."""
    buf = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    return int.from_bytes(buf, "little", signed=True)


def _closed_by_peer(sock: socket.socket) -> bool:
    """Has the collector gone (FIN or RST)? Anything it sent is read and ignored."""
    poller = select.poll()  # not select(): the gateway's descriptors run past 1023
    poller.register(sock, select.POLLIN)
    try:
        while poller.poll(0):
            if not sock.recv(4096, socket.MSG_DONTWAIT):
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True
    return False


class SyslogWitness:
    """RFC 5424 messages: over TCP or a unix stream socket with RFC 6587 octet
    counting, or one datagram each on a unix datagram socket (/dev/log style)."""

    name = "syslog"

    def __init__(self, target: SyslogTarget) -> None:
        self.target = target
        self.address = (
            f"{target.transport}:{'//' if target.transport == 'tcp' else ''}{target.address}"
        )
        host = "".join(c for c in socket.gethostname() if 33 <= ord(c) < 127)[:255]
        self.host = host or "-"
        self.sock: socket.socket | None = None
        self.stream = True

    def wants(self, kind: str) -> bool:
        return True

    def message(self, e: Entry) -> bytes:
        stamp = datetime.datetime.fromtimestamp(e.t, datetime.UTC).isoformat(
            timespec="microseconds"
        )
        msgid = "witness" if e.kind == HEAD else "audit"
        head = f"<{PRI[e.kind]}>1 {stamp} {self.host} bastion {os.getpid()} {msgid} -"
        return f"{head} {e.line()}".encode()

    def _connect(self) -> socket.socket:
        if self.sock is not None and self.stream and _closed_by_peer(self.sock):
            self.close()
        if self.sock is not None:
            return self.sock
        if self.target.transport == "tcp":
            sock, self.stream = socket.create_connection(self.target.host_port, TIMEOUT), True
        else:
            sock, self.stream = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM), False
            try:
                sock.connect(self.target.address)
            except OSError as exc:
                sock.close()
                if exc.errno != errno.EPROTOTYPE:
                    raise
                sock, self.stream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM), True
                sock.settimeout(TIMEOUT)
                sock.connect(self.target.address)
        sock.settimeout(TIMEOUT)
        self.sock = sock
        return sock

    def deliver(self, entries: list[Entry]) -> None:
        try:
            sock = self._connect()
        except OSError as exc:
            self.close()
            raise Undelivered(0, f"cannot reach {self.address}: {exc}") from None
        messages = [self.message(e) for e in entries]
        if not self.stream:
            for i, m in enumerate(messages):
                try:
                    sock.send(m)
                except OSError as exc:
                    self.close()
                    raise Undelivered(i, f"{self.address}: {exc}") from None
            return
        frames = [b"%d %s" % (len(m), m) for m in messages]
        data, sent = memoryview(b"".join(frames)), 0
        try:
            while sent < len(data):
                sent += sock.send(data[sent:])
            deadline = time.monotonic() + TIMEOUT
            while _unacked(sock) > 0:
                if _closed_by_peer(sock):
                    raise OSError(errno.ECONNRESET, "the collector closed the connection")
                if time.monotonic() > deadline:
                    raise OSError(errno.ETIMEDOUT, "the collector did not acknowledge")
                time.sleep(0.002)
        except OSError as exc:
            acked, done, total = sent, 0, 0
            with contextlib.suppress(OSError):
                acked = sent - _unacked(sock)
            for frame in frames:
                total += len(frame)
                done += total <= acked
            self.close()
            raise Undelivered(done, f"{self.address}: {exc.strerror or exc}") from None

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


Target = FileWitness | SyslogWitness


class Courier(threading.Thread):
    """Sends one witness its entries, in order, from its cursor; retries with backoff."""

    def __init__(self, target: Target, spool: Spool, after: Callable[[], None]) -> None:
        super().__init__(name=f"witness-{target.name}", daemon=True)
        self.target, self.spool, self.after = target, spool, after
        self.closing = threading.Event()
        self.delivered = 0
        self.oldest: float | None = None  # the time of the oldest entry not yet confirmed
        self.last_delivery: float | None = None
        self.last_error: str | None = None
        self.last_error_at: float | None = None
        self.failing = False
        self.witnessed = 0  # the highest journal seq of a head this witness confirmed

    def run(self) -> None:
        pause, name = 0.0, self.target.name
        try:
            while True:
                seen = self.spool.last
                entries = self.spool.read(name)
                if not entries:
                    self.oldest = None
                    if self.closing.is_set():
                        return
                    with self.spool.cond:
                        self.spool.cond.wait_for(
                            lambda s=seen: self.closing.is_set() or self.spool.last != s, 1.0
                        )
                    continue
                self.oldest = entries[0].t
                if self._deliver(entries):
                    pause = 0.0
                    continue
                if self.closing.is_set():
                    return
                pause = min(BACKOFF[1], pause * 2 or BACKOFF[0])
                self.closing.wait(pause)
        finally:
            self.target.close()

    def _deliver(self, entries: list[Entry]) -> bool:
        wanted = [e for e in entries if self.target.wants(e.kind)]
        try:
            if wanted:  # else only entries for other witnesses: just move past them
                self.target.deliver(wanted)
            done, error = len(wanted), None
        except Undelivered as exc:
            done, error = exc.delivered, str(exc)
        upto = entries[-1] if error is None else None
        if error is not None and done:
            upto = entries[entries.index(wanted[done]) - 1]
        if upto is not None:
            self.spool.commit(self.target.name, upto)
            self.delivered += done
            self.last_delivery = time.time()
            heads = [e.doc.get("seq") for e in entries[: entries.index(upto) + 1] if e.kind == HEAD]
            self.witnessed = max([self.witnessed, *(s for s in heads if type(s) is int)])
        self.after()
        if error is None:
            if self.failing:
                log.warning("witness %s: delivering again", self.target.address)
            self.failing = False
            return True
        if not self.failing:
            log.warning(
                "witness %s: %s; entries wait in the spool and are retried",
                self.target.address,
                error,
            )
        self.failing, self.last_error, self.last_error_at = True, error, time.time()
        return False

    def health(self) -> dict[str, Any]:
        now = time.time()
        return {
            "address": self.target.address,
            "waiting": self.spool.waiting(self.target.name),
            "oldest_age": None if self.oldest is None else round(now - self.oldest, 3),
            "delivered": self.delivered,
            "last_delivery_at": self.last_delivery,
            "failing": self.failing,
            "last_error": self.last_error,
            "last_error_at": self.last_error_at,
        }
