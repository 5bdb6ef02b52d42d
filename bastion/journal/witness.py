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
transports, retries) is `courier.py`'s; see docs/architecture.md, "The witness".
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization

from bastion import journal
from bastion.config import WitnessConfig
from bastion.core.events import TERMINAL, EventType, activity, event_type, without_commands
from bastion.journal.courier import AUDIT, HEAD, Courier, FileWitness, Spool, SyslogWitness, dumps

log = logging.getLogger(__name__)

INTENT_WAIT = 5.0  # seconds a dispatch waits for every witness to confirm its intent
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


class OpenRequests:
    """Requests still open, with what their records said so far: their summary is sent
    when they end, perhaps by the next lifetime (recovery closes them), so they are kept
    in `open.jsonl` too -- appended to, and rewritten every OPEN_COMPACT endings."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._pairs: dict[str, list[tuple[_Entry, dict[str, Any]]]] = {}
        self._fd: int | None = None
        self._ended_since_compact = 0

    def __len__(self) -> int:
        return len(self._pairs)

    def load(self) -> None:
        """What an earlier lifetime left open; the file is rewritten without the rest."""
        with contextlib.suppress(FileNotFoundError), open(self.path, "rb") as f:
            for raw in f:
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    d = json.loads(raw)
                    if d.get("done"):
                        self._pairs.pop(d["rid"], None)
                        continue
                    entry = _Entry(int(d["seq"]), str(d["boot"]), str(d["type"]), dict(d["meta"]))
                    if entry.type == EventType.REQUEST_RECEIVED.value:
                        self._pairs[d["rid"]] = []
                    self._pairs.get(d["rid"], []).append((entry, dict(d["event"])))
        for rid in list(self._pairs)[: max(0, len(self._pairs) - OPEN_MAX)]:
            del self._pairs[rid]
        self._rewrite()

    def received(self, rid: str) -> None:
        self._pairs.pop(rid, None)
        self._pairs[rid] = []
        while len(self._pairs) > OPEN_MAX:
            dropped = next(iter(self._pairs))
            log.warning("witness: too many open requests; %s's summary will be partial", dropped)
            del self._pairs[dropped]

    def add(self, rid: str, pair: tuple[_Entry, dict[str, Any]]) -> None:
        pairs = self._pairs.get(rid)
        if pairs is not None:
            pairs.append(pair)
            self._persist({"rid": rid, **asdict(pair[0]), "event": pair[1]})

    def ended(self, rid: str) -> list[tuple[_Entry, dict[str, Any]]] | None:
        """What the request's records said, now that it has ended (None: not known)."""
        pairs = self._pairs.pop(rid, None)
        if pairs is not None:
            self._persist({"rid": rid, "done": True})
        return pairs

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _rewrite(self) -> None:
        lines = [
            dumps({"rid": rid, **asdict(e), "event": ev}) + "\n"
            for rid, pairs in self._pairs.items()
            for e, ev in pairs
        ]
        tmp = self.path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("".join(lines))
        os.replace(tmp, self.path)
        self.close()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND, 0o600)
        self._ended_since_compact = 0

    def _persist(self, doc: dict[str, Any]) -> None:
        if self._fd is None:
            return
        try:
            if doc.get("done"):
                self._ended_since_compact += 1
                if self._ended_since_compact >= OPEN_COMPACT:
                    self._rewrite()
                    return
            os.write(self._fd, (dumps(doc) + "\n").encode())
        except OSError as exc:
            log.error("witness: cannot record an open request in %s: %s", self.path, exc)


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
        self.couriers = [Courier(t, self.spool, self._delivered) for t in targets]
        self.summaries = config.syslog is not None
        self.last_head: dict[str, Any] | None = None
        self._open = OpenRequests(spool / "open.jsonl")
        self._since_head = 0
        self._full = False
        self._lock = threading.Lock()
        self._spool_error: str | None = None
        # Dispatches waiting for their intent's head to be confirmed: (journal seq, future).
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self.unwitnessed = 0  # commands sent while no witness confirmed their intent
        self._unwitnessed_logged = False

    # -- the lifetime --------------------------------------------------------------------

    def start(self) -> None:
        """Open the spool (what an earlier lifetime left is sent first) and start sending."""
        with contextlib.suppress(RuntimeError):  # no loop: a test of the spool alone
            self._loop = asyncio.get_running_loop()
        self.spool.open()
        self._open.load()
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
        self._open.close()

    # -- the sink ------------------------------------------------------------------------

    def sink(self, record: Any, event: dict[str, Any]) -> None:
        """A record is on disk: queue its head if one is due, and its request's summary
        once the request has ended. Never blocks on a witness."""
        kind = event_type(record)
        self._since_head += 1
        every = self.config.every
        due = kind in TERMINAL if every is None else self._since_head >= every
        # The intent's head always goes, and the exec waits for it (`intent`): once a
        # command may have reached its target, no one here can make it unsaid.
        if kind in (EventType.VOUCH, EventType.DISPATCH_STARTED) or due:
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
            self._open.received(rid)
        if kind not in TERMINAL:
            self._open.add(rid, pair)
            return
        pairs = self._open.ended(rid)
        if pairs is None:  # received before this witness knew of it: what the record says
            pairs = [
                (_Entry(0, record.boot, EventType.REQUEST_RECEIVED.value, {"request_id": rid}), {})
            ]
        row = activity([*pairs, pair])[0]
        self._add(AUDIT, row if self.with_commands else without_commands(row))

    # -- the intent, witnessed before the exec leaves --------------------------------------

    def witnessed(self) -> int:
        """The highest journal seq every witness has confirmed a head for."""
        return min((c.witnessed for c in self.couriers), default=0)

    async def intent(self, seq: int) -> str | None:
        """Called once the intent (`dispatch_started`, journal seq `seq`) is on disk and
        before the exec request leaves: wait, up to INTENT_WAIT, until every witness has
        confirmed its head, so truncating the journal back past a command that may have
        run fails `audit verify --witness`. None: go on. A witness that cannot confirm
        (failing, or too slow) gets `when_full`'s answer: "refuse" returns why the
        request must not be sent; "continue" sends it unwitnessed, counted in `status`."""
        if self.witnessed() >= seq:
            return None
        if not any(c.failing for c in self.couriers):
            loop = self._loop = asyncio.get_running_loop()
            item = (seq, loop.create_future())
            self._waiters.append(item)
            try:
                self._wake()  # confirmed between the check above and the registration
                await asyncio.wait_for(asyncio.shield(item[1]), INTENT_WAIT)
                return None
            except TimeoutError:
                pass
            finally:
                self._waiters.remove(item)
        if self.config.when_full == "refuse":
            return (
                "the audit witness did not confirm that it holds this command's intent "
                f"(within {INTENT_WAIT:g} s; when_full = refuse), so the gateway did not send "
                "it. Nothing was sent. An operator must get the witness delivering again "
                "(`bastion status` shows why); then send the command again"
            )
        self.unwitnessed += 1
        if not self._unwitnessed_logged:
            self._unwitnessed_logged = True
            log.warning(
                "WITNESS: a command was sent before any witness confirmed its intent (seq %d; "
                "when_full = continue): until the witness delivers again, commands sent can "
                "be erased from this journal unnoticed",
                seq,
            )
        return None

    def _delivered(self) -> None:
        """A courier's thread, after each delivery attempt: the backlog, and the
        dispatches waiting for what it confirmed."""
        self._check_full()
        if not any(c.failing for c in self.couriers):
            self._unwitnessed_logged = False
        loop = self._loop
        if loop is not None and self._waiters:
            with contextlib.suppress(RuntimeError):  # the loop has closed
                loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        done = self.witnessed()
        for seq, fut in self._waiters:
            if seq <= done and not fut.done():
                fut.set_result(None)

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
            "witnessed_seq": self.witnessed(),
            "unwitnessed_dispatches": self.unwitnessed,
            "targets": targets,
        }
