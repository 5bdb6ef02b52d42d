"""The witness: the journal's head, and one summary per request, sent off the box.

A process of the gateway's uid can rewrite every file in the home -- truncate
the journal, roll it back, rebuild it, rewrite `head.json` -- but not what has
already left the machine. So the gateway tells a witness the head (`seq`,
`hash`, `boot`, time, the boot key's signature) at every certification and
every N records (by default after each record that ends a request), and
`bastion audit verify --witness FILE` (`check`) fails when the journal lacks a
witnessed head or has another hash at its seq. Each line carries JSON after a
fixed marker, so any file a collector writes can be read back, rsyslog's
default template included (`parse_line`):

    bastion-witness {"boot","hash","journal","seq","sig","t","type"}
    bastion-audit {the request's `bastion audit activity --json` row}

`journal` names the journal identity (`journal_id`): one collector may serve many
homes, and heads of other journals are ignored. The `file` witness gets the
heads; `syslog` gets the heads and the summaries, whose command text is None
unless bastion.toml's [export] `with_commands` is true. Delivery (the spool, the
transports, retries) is `courier.py`'s; see docs/architecture.md, The witness.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization

from bastion import journal
from bastion.config import WitnessConfig
from bastion.core.events import TERMINAL, EventType, activity, event_type, without_commands
from bastion.courier import AUDIT, HEAD, Courier, FileWitness, Spool, SyslogWitness, dumps

log = logging.getLogger("bastion")

OPEN_MAX = 10_000  # open requests remembered for their summaries (the oldest is dropped)
OPEN_COMPACT = 1_000  # requests closed before open.jsonl is rewritten
CLOSE_TIMEOUT = 5.0  # seconds a stopping gateway waits for the witnesses to catch up
_JSON = json.JSONDecoder()


def journal_id(identity: journal.Identity) -> str:
    """Which journal a head belongs to: its identity's public signing key, hashed."""
    raw = identity.signing.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:32]


@dataclass(frozen=True)
class _Entry:
    """What `events.activity` reads of a record, kept for a request still open."""

    seq: int
    boot: str
    type: str
    meta: dict[str, Any]


class Witness:
    """The recorder's sink (`sink`): what to witness, queued to the spool; and the
    witnesses' health (`health`) and the refusal `when_full = "refuse"` asks for."""

    def __init__(
        self, config: WitnessConfig, spool: Path, journal: str, with_commands: bool = False
    ) -> None:
        self.config = config
        self.journal = journal
        self.with_commands = with_commands
        targets: list[FileWitness | SyslogWitness] = []
        if config.file is not None:
            targets.append(FileWitness(config.file))
        if config.syslog is not None:
            targets.append(SyslogWitness(config.syslog))
        self.spool = Spool(spool, [t.name for t in targets])
        self.couriers = [Courier(t, self.spool, self._check_full) for t in targets]
        self.summaries = config.syslog is not None
        self.last_head: dict[str, Any] | None = None
        self._open: dict[str, list[tuple[_Entry, dict[str, Any]]]] = {}
        self._open_path = spool / "open.jsonl"
        self._open_fd: int | None = None
        self._closed_since_compact = 0
        self._since_head = 0
        self._full = False
        self._lock = threading.Lock()
        self._spool_error: str | None = None

    # -- the lifetime --------------------------------------------------------------------

    def start(self) -> None:
        """Open the spool (what an earlier lifetime left is sent first) and start sending."""
        self.spool.open()
        self._load_open()
        self._check_full()
        for courier in self.couriers:
            courier.start()

    def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Let the witnesses catch up for up to `timeout`; what is left stays spooled."""
        for courier in self.couriers:
            courier.closing.set()
        with self.spool.cond:
            self.spool.cond.notify_all()
        deadline = time.monotonic() + timeout
        for courier in self.couriers:
            if courier.is_alive():
                courier.join(max(0.0, deadline - time.monotonic()))
            left = self.spool.waiting(courier.target.name)
            if left:
                log.warning(
                    "witness %s: %d entr%s not delivered, kept in %s for the next start",
                    courier.target.address,
                    left,
                    "y" if left == 1 else "ies",
                    self.spool.directory,
                )
        self.spool.close()
        if self._open_fd is not None:
            os.close(self._open_fd)
            self._open_fd = None

    # -- the sink ------------------------------------------------------------------------

    def sink(self, record: Any, event: dict[str, Any]) -> None:
        """A record is on disk: queue its head if one is due, and its request's summary
        once the request has ended. Never blocks on a witness."""
        kind = event_type(record)
        self._since_head += 1
        every = self.config.every
        due = kind in TERMINAL if every is None else self._since_head >= every
        if kind is EventType.CERTIFY or due:
            self._since_head = 0
            head = {
                "journal": self.journal,
                "seq": record.seq,
                "hash": record.hash,
                "boot": record.boot,
                "type": record.type,
                "t": event.get("t", time.time()),
                "sig": record.sig,
            }
            self.last_head = {"seq": record.seq, "hash": record.hash}
            self._add(HEAD, head)
        if self.summaries:
            self._summarize(record, kind, event)

    def _add(self, kind: str, doc: dict[str, Any]) -> None:
        try:
            self.spool.append(kind, doc, float(doc.get("t") or time.time()))
            self._spool_error = None
        except OSError as exc:
            if self._spool_error is None:
                log.error("WITNESS: cannot write the spool %s: %s", self.spool.directory, exc)
            self._spool_error = str(exc)
        self._check_full()

    def _summarize(self, record: Any, kind: EventType | None, event: dict[str, Any]) -> None:
        rid = record.meta.get("request_id")
        if not isinstance(rid, str) or kind is None:
            return
        entry = _Entry(record.seq, record.boot, record.type, dict(record.meta))
        pair = (entry, event if self.with_commands else without_commands(event))
        if kind is EventType.REQUEST_RECEIVED:
            self._open.pop(rid, None)
            self._open[rid] = []
            while len(self._open) > OPEN_MAX:
                dropped = next(iter(self._open))
                log.warning(
                    "witness: too many open requests; %s's summary will be partial", dropped
                )
                del self._open[dropped]
        pairs = self._open.get(rid)
        if kind not in TERMINAL:
            if pairs is not None:
                pairs.append(pair)
                self._persist({"rid": rid, **asdict(entry), "event": pair[1]})
            return
        if pairs is None:  # received before this witness knew of it: what the record says
            pairs = [
                (_Entry(0, record.boot, EventType.REQUEST_RECEIVED.value, {"request_id": rid}), {})
            ]
        else:
            del self._open[rid]
            self._persist({"rid": rid, "done": True})
        row = activity([*pairs, pair])[0]
        self._add(AUDIT, row if self.with_commands else without_commands(row))

    # -- requests still open, across a restart (their summary comes from the next lifetime)

    def _load_open(self) -> None:
        """Requests an earlier lifetime left open: recovery will close them, and their
        summaries need what their first records said (`open.jsonl`, rewritten here)."""
        with contextlib.suppress(FileNotFoundError), open(self._open_path, "rb") as f:
            for raw in f:
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    d = json.loads(raw)
                    if d.get("done"):
                        self._open.pop(d["rid"], None)
                        continue
                    entry = _Entry(int(d["seq"]), str(d["boot"]), str(d["type"]), dict(d["meta"]))
                    if entry.type == EventType.REQUEST_RECEIVED.value:
                        self._open[d["rid"]] = []
                    self._open.get(d["rid"], []).append((entry, dict(d["event"])))
        for rid in list(self._open)[: max(0, len(self._open) - OPEN_MAX)]:
            del self._open[rid]
        self._rewrite_open()

    def _rewrite_open(self) -> None:
        lines = [
            dumps({"rid": rid, **asdict(e), "event": ev}) + "\n"
            for rid, pairs in self._open.items()
            for e, ev in pairs
        ]
        tmp = self._open_path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("".join(lines))
        os.replace(tmp, self._open_path)
        if self._open_fd is not None:
            os.close(self._open_fd)
        self._open_fd = os.open(self._open_path, os.O_WRONLY | os.O_APPEND, 0o600)
        self._closed_since_compact = 0

    def _persist(self, doc: dict[str, Any]) -> None:
        if self._open_fd is None:
            return
        try:
            if doc.get("done"):
                self._closed_since_compact += 1
                if self._closed_since_compact >= OPEN_COMPACT:
                    self._rewrite_open()
                    return
            os.write(self._open_fd, (dumps(doc) + "\n").encode())
        except OSError as exc:
            log.error("witness: cannot record an open request in %s: %s", self._open_path, exc)

    # -- how far behind ------------------------------------------------------------------

    def _check_full(self) -> None:
        """Log once each time the backlog crosses `buffer_max`, either way."""
        waiting, limit = self.spool.waiting(), self.config.buffer_max
        with self._lock:
            full = waiting > limit
            if full == self._full:
                return
            self._full = full
        if full:
            log.warning(
                "WITNESS BEHIND: %d entries wait in %s (buffer_max %d): %s",
                waiting,
                self.spool.directory,
                limit,
                "new requests are refused (when_full = refuse)"
                if self.config.when_full == "refuse"
                else "requests continue and the spool grows (when_full = continue)",
            )
        else:
            log.warning("witness: back under buffer_max (%d entries wait)", waiting)

    def refusing(self) -> str | None:
        """Why new requests must be refused now (`when_full = "refuse"` and the
        backlog past `buffer_max`), or None."""
        if self.config.when_full != "refuse" or not self._full:
            return None
        # The agent reads this: no collector address or error text (the operator's
        # infrastructure), which `bastion status` shows the operator instead.
        return (
            f"the audit witness is {self.spool.waiting()} entries behind (buffer_max "
            f"{self.config.buffer_max}, when_full = refuse): new requests are refused "
            "until it catches up; retry later -- the operator sees why in `bastion status`"
        )

    def health(self) -> dict[str, Any]:
        """For `bastion status`: how far behind each witness is, and why."""
        targets = {c.target.name: c.health() for c in self.couriers}
        ages = [t["oldest_age"] for t in targets.values() if t["oldest_age"] is not None]
        return {
            "waiting": self.spool.waiting(),
            "oldest_age": max(ages, default=None),
            "buffer_max": self.config.buffer_max,
            "when_full": self.config.when_full,
            "full": self._full,
            "refusing": self.refusing(),
            "spool": str(self.spool.directory),
            "spool_error": self._spool_error,
            "journal": self.journal,
            "last_head": self.last_head,
            "open_requests": len(self._open),
            "targets": targets,
        }


# -- reading a witness back, and checking a journal against it --------------------------------


def parse_line(text: str) -> tuple[str, dict[str, Any]] | None:
    """The entry in one line of any file a witness or a collector wrote: the JSON
    object after the line's first marker. A marker quoted inside JSON is never
    first (its own entry's marker comes before it) and never parses."""
    found = [(i, m) for m in (HEAD, AUDIT) if (i := text.find(m + " {")) >= 0]
    if not found:
        return None
    at, marker = min(found)
    try:
        doc, _ = _JSON.raw_decode(text, at + len(marker) + 1)
    except ValueError:
        return None
    return (marker, doc) if isinstance(doc, dict) else None


def read_entries(paths: Iterable[Path], kind: str = HEAD) -> list[dict[str, Any]]:
    """Every entry of one kind in these files, in file order (a directory: every
    file in it, by name -- a witness directory, or a collector's rotated logs)."""
    out = []
    files = (
        f
        for p in paths
        for f in (sorted(x for x in p.iterdir() if x.is_file()) if p.is_dir() else [p])
    )
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                parsed = parse_line(line)
                if parsed is not None and parsed[0] == kind:
                    out.append(parsed[1])
    return out


@dataclass
class WitnessCheck:
    ok: bool
    problem: str | None = None  # the first witnessed head the journal does not hold, and why
    heads: int = 0  # distinct witnessed heads of this journal
    last: int | None = None  # the highest witnessed seq
    other_journals: int = 0  # heads of other journals, ignored
    notes: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def check(directory: Path, identity: journal.Identity, heads: list[dict[str, Any]]) -> WitnessCheck:
    """Does the journal hold every head the witness saw, with the same hash? A
    journal that ends before one was truncated; another hash at its seq was
    rolled back or rebuilt. Nothing witnessed proves nothing, and fails too."""
    jid = journal_id(identity)
    seen: dict[int, str] = {}
    c = WitnessCheck(ok=False)
    for h in heads:
        seq, digest = h.get("seq"), h.get("hash")
        if h.get("journal") != jid or type(seq) is not int or not isinstance(digest, str):
            c.other_journals += h.get("journal") != jid
            continue
        if seen.setdefault(seq, digest) != digest:
            c.problem = (
                f"seq {seq}: the witness saw two hashes ({seen[seq][:16]}... and "
                f"{digest[:16]}...): the journal was rolled back or rebuilt while a gateway ran"
            )
            return c
    c.heads, c.last = len(seen), max(seen, default=None)
    if not seen:
        c.problem = (
            f"no witnessed head of this journal (journal {jid}); "
            f"{c.other_journals} head(s) of other journals. Nothing witnessed is not proof"
        )
        return c
    local = {r.seq: r.hash for r in journal.records(directory)}
    end = max(local, default=0)
    for seq in sorted(seen):
        witnessed = seen[seq][:16]
        if seq > end:
            c.problem = (
                f"truncated: the witness saw seq {seq} (hash {witnessed}...), "
                f"the journal ends at seq {end}"
            )
        elif seq not in local:
            c.problem = f"deleted: the witness saw seq {seq} (hash {witnessed}...), it is missing"
        elif local[seq] != seen[seq]:
            c.problem = (
                f"forked: seq {seq} has hash {local[seq][:16]}... here, the witness saw "
                f"{witnessed}... (rolled back, rebuilt or laundered)"
            )
        if c.problem:
            return c
    c.ok = True
    if end > c.last:
        c.notes.append(f"{end - c.last} record(s) after seq {c.last} are not witnessed yet")
    return c
