"""What the gateway writes down and who hears of it: the journal and the watchers.

Every event goes through `record`, named by an `EventType`; the wording of
each event's plaintext metadata and encrypted body is here, once. Only the
intent before a dispatch (`intent`) may fail loudly: if it is not on disk,
nothing is sent. Operators watching `bastion approve` get the same facts as a
stream (`publish`), never anything they could run.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from typing import Any, Protocol

from bastion.core.cards import Card, Withdrawal
from bastion.core.contract import Failure
from bastion.core.events import EventType, Result, foreign_warning
from bastion.core.gate import CardEnding, EndReason, Request, Session
from bastion.core.grants import BoundedGrant, GrantEnd
from bastion.core.policy import Policy, PolicyError
from bastion.core.subject import Peer, Subject
from bastion.journal import Identity, JournalError, Record
from bastion.journal.verify import unvouched_boots

log = logging.getLogger(__name__)


class JournalWriter(Protocol):
    """The part of `journal.Journal` the gateway writes through."""

    def append(
        self, kind: EventType, meta: dict[str, Any], event: dict[str, Any], sync: bool = True
    ) -> Any: ...

    def sync(self) -> int: ...


# Told of every record once it is on disk, with its plaintext event: the witness and
# the collectors' stream. A sink must not block (it queues and returns).
Sink = Callable[[Any, dict[str, Any]], None]

# Group commit: records other than the intent are made durable together, at most this
# many seconds after they were written, by one fdatasync in a worker thread; the loop
# never waits for the disk except for the intent before a dispatch.
FLUSH_DELAY = 0.02


class Recorder:
    def __init__(self, journal: JournalWriter) -> None:
        self.journal = journal
        self.watchers: set[asyncio.Queue[dict[str, Any]]] = set()
        self.sinks: list[Sink] = []
        # Told of each request as it is received: (hashed action key or None, request id).
        self.on_received: list[Callable[[str | None, str], None]] = []
        self._unsynced: list[tuple[Any, dict[str, Any]]] = []  # written, sinks not yet told
        self._flush_at: asyncio.TimerHandle | None = None
        self._flushing = False
        # Records that could not be written (disk full, ...): a request whose story lost
        # one since it was received is not dispatched (`Service.dispatch`).
        self.lost = 0

    def record(
        self, kind: EventType, meta: dict[str, Any], event: dict[str, Any] | None = None
    ) -> None:
        """Journal an event: written when this returns (a killed gateway loses
        nothing), durable within FLUSH_DELAY (a power cut may lose the last few, so
        a finished request may then read `unknown`, never a false outcome). A
        failure is logged loudly; only the intent before a dispatch is fatal."""
        try:
            self._append(kind, meta, event or {})
        except (OSError, JournalError) as exc:
            self.lost += 1
            log.error("could not journal %s: %s", kind.value, exc)

    def intent(
        self,
        request_id: str,
        session_id: str,
        grant: str | None = None,
        acts_on: tuple[str, ...] = (),
    ) -> Any:
        """The durable intent, on disk with everything before it when this returns
        (the record, whose head the witness must confirm): raises if not written.
        `grant`: the bounded grant whose use sends it, instead of a card. `acts_on`: a
        file operation's paths as the walk found them, where a symlink on the way made
        them other than those asked (in the encrypted body, as paths are)."""
        meta = {"request_id": request_id, "session_id": session_id}
        if grant is not None:
            meta["grant"] = grant
        event = {"acts_on": list(acts_on)} if acts_on else {}
        return self._append(EventType.DISPATCH_STARTED, meta, event, sync=True)

    def certificate(self, request_id: str, meta: dict[str, Any], event: dict[str, Any]) -> None:
        """A signed certificate, on disk before it is presented to the target: every
        login capability the gateway minted is on record. Raises if not written."""
        meta = {"request_id": request_id, **meta}
        self._append(EventType.CERTIFICATE_ISSUED, meta, event, sync=True)

    def _append(
        self, kind: EventType, meta: dict[str, Any], event: dict[str, Any], sync: bool = False
    ) -> Any:
        stamped = {"t": time.time(), **event}
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            sync = True  # no loop to flush later: durable now
        record = self.journal.append(kind, meta, stamped, sync=sync)
        self._unsynced.append((record, stamped))
        if sync:
            self._durable(None)
        else:
            self._schedule()
        return record

    def _schedule(self) -> None:
        if self._flush_at is None and not self._flushing:
            self._flush_at = asyncio.get_running_loop().call_later(FLUSH_DELAY, self._flush_soon)

    def _flush_soon(self) -> None:
        self._flush_at = None
        if not self._unsynced:
            return
        try:  # a future, not a coroutine: a loop closing first leaves nothing unawaited
            pending = asyncio.get_running_loop().run_in_executor(None, self.journal.sync)
        except RuntimeError:  # the loop is closing: no worker threads any more
            self.flush()
            return
        self._flushing = True
        pending.add_done_callback(self._flushed)

    def _flushed(self, done: asyncio.Future[int]) -> None:
        self._flushing = False
        if done.cancelled():
            return
        try:
            self._durable(done.result())
        except OSError as exc:  # the records stay written; the next round tries again
            log.error("could not make the journal durable: %s", exc)
        if self._unsynced:
            self._schedule()

    def flush(self) -> None:
        """Everything written so far durable now, and told to the sinks (before a
        vouch, at a stop)."""
        self.journal.sync()
        self._durable(None)

    def _durable(self, upto: int | None) -> None:
        """Tell the sinks of the records now on disk (all, or up to seq `upto`)."""
        ready = [p for p in self._unsynced if upto is None or getattr(p[0], "seq", 0) <= upto]
        self._unsynced = self._unsynced[len(ready) :]
        for record, event in ready:
            self.note(record, event)

    def note(self, record: Any, event: dict[str, Any]) -> None:
        """A record is on disk (written here, or by the journal itself: boot,
        vouch): tell every sink. A sink's failure never costs the journal or
        the dispatch that asked for the record."""
        for sink in self.sinks:
            try:
                sink(record, event)
            except Exception:
                log.exception("an audit sink failed on seq %s", getattr(record, "seq", "?"))

    # -- what operators watching see -------------------------------------------------

    def publish(self, event: dict[str, Any]) -> None:
        for q in self.watchers:
            q.put_nowait(event)

    def notice(self, text: str, request_id: str | None = None) -> None:
        """A fact for the operator; nothing to decide, nothing it could run."""
        self.publish({"event": "notice", "text": text, "request_id": request_id})

    # -- one request ---------------------------------------------------------------------

    def received(self, peer: Peer, req: Request, conversation: str | None) -> None:
        """The request's first record, the only one with its command and subject:
        raises if it could not be written, and the request is refused."""
        self._append(
            EventType.REQUEST_RECEIVED,
            {"request_id": req.request_id, "action": req.action},
            {
                "host": req.host,
                "user": req.user,
                "command": req.command.decode("utf-8", "backslashreplace"),
                "command_sha256": req.command_sha256,
                "subject": peer.subject.as_json(),
                "conversation": conversation,
                "chain": [p.pid for p in peer.chain],
            }
            | ({"file": req.file.as_json()} if req.file is not None else {})
            | ({"terminal": True} if req.terminal is not None else {}),
        )
        for listener in self.on_received:
            listener(req.action, req.request_id)

    def stdin(self, req: Request) -> None:
        """The stdin read before the request's command card: how the read ended, its
        size and digest -- never its content (the card shows a preview; the journal
        does not keep it)."""
        assert req.stdin is not None
        s = req.stdin
        meta = {"request_id": req.request_id, "end": s.end.value, "size": s.size}
        self.record(EventType.STDIN_READ, {**meta, "sha256": s.sha256})
        log.info(
            "%s: stdin %s, %d bytes, sha256 %s", req.request_id, s.end.value, s.size, s.sha256[:16]
        )

    def denied(
        self, subject: Subject, req: Request, failure: Failure, withdrawn: Withdrawal | None = None
    ) -> None:
        """The request's end before anything was sent. Its card withdrawn (`withdrawn`):
        nobody said no, and the record and the operator's notice say why instead."""
        code = failure.code.value
        why = f"withdrawn ({withdrawn.words})" if withdrawn is not None else f"denied {code}"
        log.info("%s: %s%s", req.request_id, why, f" ({code})" if withdrawn is not None else "")
        self.record(
            EventType.DENIED,
            {"request_id": req.request_id, "code": code}
            | ({"withdrawn": withdrawn.value} if withdrawn is not None else {}),
            {"message": failure.message},
        )
        self.notice(
            f"{why}: pid {subject.pid} "
            f"({os.path.basename(subject.exe)}) asked for {req.user}@{req.host}; "
            "nothing was sent",
            req.request_id,
        )

    def outcome(self, request_id: str, result: Result) -> None:
        moved = result.transferred
        self.record(
            EventType.of(result.outcome),
            result.meta(request_id),
            {"message": result.message}
            | ({"size": moved[0], "sha256": moved[1]} if moved is not None else {}),
        )
        log.info(
            "%s: %s%s",
            request_id,
            result.outcome.value,
            f" (exit {result.exit_status})" if result.exit_status is not None else "",
        )

    # -- approvals -----------------------------------------------------------------------

    def card(self, card: Card, answer: CardEnding | None, why: Withdrawal | None = None) -> None:
        """A card raised (`answer` None) or closed: its ending, and why when it was
        withdrawn (`why`: the agent exited, its connection closed, the vault locked)."""
        meta = {"request_id": card.request_id, "card": card.id, "kind": card.kind.value}
        if card.presence is not None:  # `audit verify` counts the signatures it needs
            meta["presence"] = card.presence.approvers
        if answer is None:
            self.record(EventType.CARD_RAISED, meta, {"card": card.as_json(preview=False)})
            self.publish({"event": "card", "card": card.as_json()})
        else:
            withdrawn = {"why": why.value} if why is not None else {}
            self.record(EventType.CARD_CLOSED, {**meta, "answer": answer.value, **withdrawn})
            self.publish({"event": "closed", "card": card.id, "answer": answer.value, **withdrawn})

    def session(self, session: Session, subject: Subject, reason: EndReason | None) -> None:
        if reason is None:
            self.record(
                EventType.SESSION_APPROVED,
                {"session_id": session.id},
                {
                    "host": session.host,
                    "user": session.user,
                    "subject": subject.as_json(),
                    "vault_epoch": session.vault_epoch,
                    "entry_digest": session.entry_digest,
                }
                | ({"approved_by": session.approved_by.as_json()} if session.approved_by else {})
                | ({"signed_by": list(session.signed_by)} if session.signed_by else {}),
            )
        else:
            self.record(EventType.SESSION_ENDED, {"session_id": session.id, "reason": reason.value})

    def grant(self, grant: BoundedGrant, reason: EndReason | GrantEnd | None) -> None:
        """A bounded grant made (its pattern and bound, and what it is bound to) or
        ended (why)."""
        if reason is None:
            self.record(
                EventType.GRANT_MADE,
                {"grant": grant.id, "session_id": grant.session_id, "card": grant.card_id},
                {
                    "pattern": grant.pattern.text,
                    "pattern_words": list(grant.pattern.words),
                    "uses": grant.uses_left,
                    "expires_at": grant.expires_at,
                    "host": grant.host,
                    "user": grant.user,
                    "vault_epoch": grant.vault_epoch,
                    "entry_digest": grant.entry_digest,
                },
            )
            self.publish({"event": "grant", "grant": grant.as_json()})
        else:
            self.record(EventType.GRANT_ENDED, {"grant": grant.id, "reason": reason.value})
            self.publish({"event": "grant_ended", "grant": grant.id, "reason": reason.value})

    def grant_used(self, request_id: str, grant: BoundedGrant) -> None:
        """One use of a bounded grant taken for this request, in place of its card."""
        left = None if grant.uses_left is None else grant.uses_left - 1
        self.record(
            EventType.GRANT_USED,
            {"request_id": request_id, "grant": grant.id, "uses_left": left},
        )


class PolicySource(Protocol):
    def current(self) -> Policy | PolicyError: ...


class PolicyWatch:
    """The policy source, journaling each change of what it says (a new
    digest, or a new reason it is unavailable) once."""

    def __init__(self, source: PolicySource, recorder: Recorder) -> None:
        self.source = source
        self.recorder = recorder
        self._last: str | None = None
        self._read: Policy | PolicyError | None = None

    def seen(self) -> Policy | PolicyError:
        """What `current` last read, reading nothing and journaling nothing: the policy
        in the gate's world (`Service.look` reads it with `current` first)."""
        return self._read if self._read is not None else self.source.current()

    def current(self) -> Policy | PolicyError:
        """The policy now, its change journaled before it is used."""
        current = self._read = self.source.current()
        seen = str(current) if isinstance(current, PolicyError) else current.digest
        if seen != self._last:
            self._last = seen
            if isinstance(current, PolicyError):
                log.error("policy unavailable: %s", current)
                self.recorder.record(EventType.POLICY_FAILED, {}, {"error": str(current)})
            else:
                self.recorder.record(EventType.POLICY_LOADED, {"digest": current.digest})
                log.info(
                    "policy loaded: %d host(s), digest %s", len(current.hosts), current.digest[:16]
                )
        return current


class ForeignRecords:
    """Records under boot keys the journal identity never vouched for: a gateway that
    was never unlocked wrote them, or someone else did (a forged tail after a crash).
    Found when the journal opens, journaled once as `foreign_records` at the next
    unlock, told to watching operators, and kept for `status` for this lifetime."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self._pending: dict[str, list[int]] = {}  # boot -> [first seq, last seq, records]
        self.reported: list[dict[str, Any]] = []  # what this lifetime reported

    def found(self, records: list[Record], identity: Identity) -> None:
        spans = unvouched_boots(records, identity)
        # Boots an earlier notice already named -- counted only from notices under a
        # vouched-for boot, or a forger could silence the report with a notice of its own.
        told = {
            boot
            for r in records
            if r.type == EventType.FOREIGN_RECORDS.value and r.boot not in spans
            for boot in r.meta.get("boots", [])
        }
        self._pending = {b: span for b, span in spans.items() if b not in told}

    def report(self) -> None:
        """At unlock, once the identity can vouch for the notice itself."""
        if not self._pending:
            return
        spans = [
            {"boot": boot, "first": a, "last": z, "records": n}
            for boot, (a, z, n) in sorted(self._pending.items(), key=lambda i: i[1][0])
        ]
        self._pending = {}
        self.reported = spans
        meta = {"boots": [s["boot"] for s in spans], "records": sum(s["records"] for s in spans)}
        self.recorder.record(EventType.FOREIGN_RECORDS, meta, {"spans": spans})
        for span in spans:
            log.warning("%s", foreign_warning(span))
            self.recorder.notice(foreign_warning(span))
