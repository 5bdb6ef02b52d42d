"""The journal's vocabulary, and every fold that reads it back.

Each journal record has a plaintext `type` and `meta` (request ids, codes,
exit statuses -- never a secret) and an encrypted event. The types exist
once, here, as `EventType`; writers pass members, readers parse with
`event_type`, and the four readings of a journal -- crash recovery, one
request's state, the activity view, the sessions view -- are the folds below.
Renaming an event is a change to one line of this file.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

from bastion.core.contract import Code
from bastion.core.gate import EndReason


class Outcome(enum.Enum):
    """How a dispatched request ended, as far as anyone can know.

    Before the exec request leaves, a failure means nothing ran (`not_started`);
    after it, only an exit status or an exit signal is an answer -- any other
    ending is `unknown`.
    """

    COMPLETED = "completed"
    SIGNALLED = "signalled"
    REMOTE_REJECTED = "remote_rejected"
    UNKNOWN = "unknown"
    NOT_STARTED = "not_started"


@dataclass(frozen=True)
class Result:
    """What became of one dispatched request, as it is known."""

    outcome: Outcome
    exit_status: int | None = None
    signal: tuple[str, bool, str, str] | None = None  # (name, core dumped, message, lang)
    code: Code | None = None  # the agent-facing code when the gateway must explain the ending
    message: str = ""
    cause: str | None = None  # for not_started / unknown: what is known of why
    # a file operation's: (size, sha256) of the bytes that went through, journaled in
    # the record's encrypted body (never the bytes)
    transferred: tuple[int, str] | None = None

    def meta(self, request_id: str) -> dict[str, Any]:
        """The plaintext of the record that ends the request's story."""
        meta: dict[str, Any] = {"request_id": request_id}
        if self.outcome is Outcome.COMPLETED:
            meta["exit_status"] = self.exit_status
        elif self.outcome is Outcome.SIGNALLED:
            meta["signal"] = self.signal[0] if self.signal else None
        else:
            meta["code"] = self.code.value if self.code else None
            meta["cause"] = self.cause
        return meta


class EventType(enum.Enum):
    # the journal itself
    BOOT = "boot"  # a gateway lifetime begins; meta: its boot key
    TORN_TAIL = "torn_tail"  # a crash cut the last line short; it was set aside
    # the journal identity vouches for a boot key and a head (`certify` before: see _missing_)
    VOUCH = "vouch"
    GATEWAY_STOPPED = "gateway_stopped"
    FOREIGN_RECORDS = "foreign_records"  # boots whose key was never certified: reported once
    # the gateway's state
    POLICY_LOADED = "policy_loaded"
    POLICY_FAILED = "policy_failed"
    VAULT_LOCKED = "vault_locked"
    VAULT_UNLOCKED = "vault_unlocked"
    RUN_REGISTERED = "run_registered"
    # the home's path no longer leads to the directory the gateway holds open (home.Held):
    # once per lifetime and directory; meta: which and its path; the gateway reads on there
    HOME_MOVED = "home_moved"
    # approvals
    CARD_RAISED = "card_raised"
    CARD_CLOSED = "card_closed"
    SESSION_APPROVED = "session_approved"
    SESSION_ENDED = "session_ended"
    # a bounded grant (`core/grants`): made on a yes, each use (request id), its end
    GRANT_MADE = "grant_made"
    GRANT_USED = "grant_used"
    GRANT_ENDED = "grant_ended"
    # presence (`core/presence`): a credential enrolled or removed (meta: its public half);
    # the console's origin in this lifetime; a signature counted on a card (meta: the
    # proof, for `audit verify`), or refused (meta: which check failed); a console login
    OPERATOR_ENROLLED = "operator_enrolled"
    OPERATOR_REMOVED = "operator_removed"
    CONSOLE_STARTED = "console_started"
    PRESENCE_SIGNED = "presence_signed"
    PRESENCE_REFUSED = "presence_refused"
    CONSOLE_LOGIN = "console_login"
    # one request's life: received, then denied, or dispatched and one outcome
    REQUEST_RECEIVED = "request_received"
    # the stdin read whole before a command card: its end, size and sha256 (no content)
    STDIN_READ = "stdin_read"
    DENIED = "denied"
    DISPATCH_STARTED = "dispatch_started"
    # a certificate account's login for this one request was signed (serial, key id, CA)
    CERTIFICATE_ISSUED = "certificate_issued"
    COMPLETED = Outcome.COMPLETED.value
    SIGNALLED = Outcome.SIGNALLED.value
    REMOTE_REJECTED = Outcome.REMOTE_REJECTED.value
    UNKNOWN = Outcome.UNKNOWN.value
    NOT_STARTED = Outcome.NOT_STARTED.value
    ACTION_ACKNOWLEDGED = "action_acknowledged"
    # operator actions on requests
    OPERATOR_KILL = "operator_kill"
    OPERATOR_TERMINATE = "operator_terminate"

    @classmethod
    def _missing_(cls, value: object) -> EventType | None:
        """Older gateways wrote VOUCH as `certify` (before the word went to SSH certificates
        only): their journals read the same."""
        return cls.VOUCH if value == "certify" else None

    @classmethod
    def of(cls, outcome: Outcome) -> EventType:
        return cls(outcome.value)

    @property
    def outcome(self) -> Outcome | None:
        """The outcome this event records, if it is one."""
        return _OUTCOME_OF.get(self)


_OUTCOME_OF = {EventType.of(o): o for o in Outcome}
# Why an outcome is what it is, when the gateway itself ended the request's story.
CAUSE_RESTARTED = "gateway_restarted"  # closed by the next lifetime's recovery
CAUSE_STOPPED = "gateway_stopped"  # its gateway is gone and no lifetime has closed it yet
CAUSE_KILLED = "killed"  # the operator ended it (kill, lock --terminate)
CAUSE_LOST = "connection_lost"  # the connection to the target ended first

# Every way a request's journal story can end: one of these, exactly once.
TERMINAL = frozenset({EventType.DENIED, *_OUTCOME_OF})


class Entry(Protocol):
    """What the folds read of a journal record (journal.Record is one)."""

    @property
    def seq(self) -> int: ...
    @property
    def boot(self) -> str: ...
    @property
    def type(self) -> str: ...
    @property
    def meta(self) -> dict[str, Any]: ...


def event_type(entry: Entry) -> EventType | None:
    """The record's type, or None for one this version does not know."""
    try:
        return EventType(entry.type)
    except ValueError:
        return None


class RequestState(enum.Enum):
    """What `bastion request` answers."""

    COMPLETED = "completed"
    DENIED = "denied"
    RETRY_SAFE = "retry_safe"
    STATUS_UNKNOWN = "status_unknown"
    IN_FLIGHT = "in_flight"


# -- action keys ---------------------------------------------------------------------------


def bound_action(owner: str, key: str) -> str:
    """The name an action key is journaled and tracked under: bound to the process
    that sent it (`owner`, a name that outlives a gateway lifetime: the kernel's
    boot id, the pid and the start in clock ticks), so an action key belongs to the
    subject that created it -- another process's acknowledgement or question names
    another action -- and the same process finds its own after a restart."""
    return hashlib.sha256(b"bastion-action\0" + owner.encode() + b"\0" + key.encode()).hexdigest()


# -- crash recovery ------------------------------------------------------------------------


@dataclass(frozen=True)
class Recovery:
    """What a new lifetime must close, and the action keys it inherits."""

    unknown: tuple[str, ...]  # dispatched, no outcome: closed as `unknown`
    not_started: tuple[str, ...]  # received, never dispatched: nothing was sent
    actions: Mapping[str, str]  # blocked action -> request id, after closing `unknown`


def recover(entries: Iterable[Entry]) -> Recovery:
    """Read a journal left by earlier lifetimes: every request that has no
    terminal event yet gets one now. The intent (`dispatch_started`) is on disk
    before the exec request leaves, so its absence proves nothing was sent."""
    stage: dict[str, EventType] = {}  # request id -> its last life event
    action_of: dict[str, str] = {}
    # blocked action -> request id, by the rule `gateway.actions.ActionKeys` keeps live:
    # an action's last attempt decides, and the agent's acknowledgement clears it.
    blocked: dict[str, str] = {}

    def attempt(action: str, rid: str, outcome: Outcome) -> None:
        if outcome is Outcome.UNKNOWN:
            blocked[action] = rid
        else:
            blocked.pop(action, None)

    for entry in entries:
        kind = event_type(entry)
        rid = entry.meta.get("request_id")
        if kind is EventType.ACTION_ACKNOWLEDGED:
            blocked.pop(entry.meta.get("action", ""), None)
        if not isinstance(rid, str) or kind is None:
            continue
        if kind is EventType.REQUEST_RECEIVED:
            stage[rid] = kind
            if entry.meta.get("action"):
                action_of[rid] = entry.meta["action"]
        elif kind is EventType.DISPATCH_STARTED or kind in TERMINAL:
            stage[rid] = kind
        if kind.outcome is not None and rid in action_of:
            attempt(action_of[rid], rid, kind.outcome)
    unknown = tuple(r for r, k in stage.items() if k is EventType.DISPATCH_STARTED)
    for rid in unknown:
        if rid in action_of:
            attempt(action_of[rid], rid, Outcome.UNKNOWN)
    not_started = tuple(r for r, k in stage.items() if k is EventType.REQUEST_RECEIVED)
    return Recovery(unknown, not_started, dict(blocked))


def recovered_meta(request_id: str, outcome: Outcome) -> dict[str, Any]:
    """The plaintext of the record that closes a request its lifetime left open."""
    code = Code.STATUS_UNKNOWN.value if outcome is Outcome.UNKNOWN else None
    return {"request_id": request_id, "code": code, "cause": CAUSE_RESTARTED}


# -- one request ---------------------------------------------------------------------------


_RETRYABLE = frozenset(c.value for c in Code if c.retryable)


@dataclass(frozen=True, slots=True)
class RequestStory:
    """One request's story so far, from plaintext metadata alone: what `bastion
    request` says of it. `step` reads the request's next record; the same fold
    answers the CLI (over the whole journal) and the gateway's index (record by
    record, as each is written)."""

    boot: str  # the lifetime that received it
    state: RequestState = RequestState.IN_FLIGHT
    dispatched: bool = False
    exit_status: int | None = None
    code: str | None = None
    more: tuple[tuple[str, Any], ...] = ()  # signal, cause, certificate: the last of each wins

    def step(self, entry: Entry) -> RequestStory:
        """The story once `entry` (a later record of this request) is read."""
        kind = event_type(entry)
        meta = entry.meta
        if kind is EventType.DISPATCH_STARTED:
            return replace(self, dispatched=True)
        if kind is EventType.CERTIFICATE_ISSUED:
            return self._with(("certificate", certificate_of(entry)))
        if kind is EventType.STDIN_READ:
            read = {k: meta.get(k) for k in ("end", "size", "sha256")}
            return self._with(("stdin", read))
        if kind is EventType.DENIED:
            code = meta.get("code")
            # A denial that only says "not now" (GATEWAY_BUSY): nothing was sent.
            state = RequestState.RETRY_SAFE if code in _RETRYABLE else RequestState.DENIED
            denied = replace(self, state=state, code=code)
            # Its card was withdrawn (agent exited, connection closed, vault locked): why.
            withdrawn = meta.get("withdrawn")
            return denied._with(("withdrawn", withdrawn)) if withdrawn else denied
        if kind is EventType.COMPLETED:
            return replace(self, state=RequestState.COMPLETED, exit_status=meta.get("exit_status"))
        if kind is EventType.SIGNALLED:
            done = replace(self, state=RequestState.COMPLETED, code=None)
            return done._with(("signal", meta.get("signal")))
        if kind in (EventType.NOT_STARTED, EventType.REMOTE_REJECTED):
            retry_safe = replace(self, state=RequestState.RETRY_SAFE, code=meta.get("code"))
            return retry_safe._with(("cause", meta.get("cause")))
        if kind is EventType.UNKNOWN:
            unknown = replace(
                self, state=RequestState.STATUS_UNKNOWN, code=Code.STATUS_UNKNOWN.value
            )
            return unknown._with(("cause", meta.get("cause")))
        return self

    def _with(self, *more: tuple[str, Any]) -> RequestStory:
        return replace(self, more=(*self.more, *more))

    def answer(self, request_id: str, live_boot: str | None) -> dict[str, Any]:
        """`bastion request --json`'s object. A request with no outcome whose gateway
        is gone reads as the next start will close it."""
        story = self
        if story.state is RequestState.IN_FLIGHT and story.boot != live_boot:
            if story.dispatched:
                story = replace(
                    story, state=RequestState.STATUS_UNKNOWN, code=Code.STATUS_UNKNOWN.value
                )
            else:
                story = replace(story, state=RequestState.RETRY_SAFE)
            story = story._with(("cause", CAUSE_STOPPED))
        return {
            "request_id": request_id,
            "state": story.state.value,
            "exit_status": story.exit_status,
            "code": story.code,
            **dict(story.more),
        }


def request_state(
    entries: Iterable[Entry], request_id: str, live_boot: str | None
) -> dict[str, Any] | None:
    """What became of one request, from plaintext metadata alone."""
    story: RequestStory | None = None
    for entry in entries:
        if entry.meta.get("request_id") != request_id:
            continue
        if event_type(entry) is EventType.REQUEST_RECEIVED:
            story = RequestStory(entry.boot)
        elif story is not None:
            story = story.step(entry)
    return None if story is None else story.answer(request_id, live_boot)


# -- views (they need the decrypted events) --------------------------------------------------


# Fields that carry command text (an agent's command can hold secrets): collectors get
# them only when asked (`audit export --with-commands`); digests always go.
_COMMAND_FIELDS = ("command", "argv", "cmdline", "pattern", "pattern_words")  # a grant's too


def without_commands(row: dict[str, Any]) -> dict[str, Any]:
    """A row or event as collectors get it by default: command text replaced by None."""
    out = {k: (None if k in _COMMAND_FIELDS else v) for k, v in row.items()}
    card = out.get("card")
    if isinstance(card, dict):
        out["card"] = without_commands(card)
    chain = out.get("chain")  # a card's process chain: the ssh process's cmdline holds the command
    if isinstance(chain, list):
        out["chain"] = [without_commands(p) if isinstance(p, dict) else p for p in chain]
    return out


def export_event(
    entry: Entry, event: dict[str, Any], with_commands: bool = False
) -> dict[str, Any]:
    """One journal record as a log collector reads it: its place in the journal,
    its type, its plaintext metadata and its decrypted fields -- never a key, a
    passphrase or command output (none is ever journaled), and command text only
    when asked."""
    fields = {k: v for k, v in event.items() if k != "t"}
    out = {
        "seq": entry.seq,
        "boot": entry.boot,
        "type": entry.type,
        "time": event.get("t"),
        **entry.meta,
        **fields,
    }
    return out if with_commands else without_commands(out)


def run_label(subject: object) -> str | None:
    """The label of the registered run a subject (`Subject.as_json`) is, if it is one:
    what the run's start said (a claim, shown as one)."""
    if not isinstance(subject, Mapping):
        return None
    info = subject.get("run_info")
    label = info.get("label") if isinstance(info, Mapping) else subject.get("run")
    return label if isinstance(label, str) else None


def activity(events: Iterable[tuple[Entry, dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per request: what was asked, when, by whom (the run's label, or the
    process), and how and when it ended; a use of a bounded grant names the grant, its
    pattern and the uses it left."""
    rows: dict[str, dict[str, Any]] = {}
    patterns: dict[str, Any] = {}  # grant id -> its pattern, from its grant_made
    for entry, e in events:
        rid = entry.meta.get("request_id")
        kind = event_type(entry)
        if kind is EventType.GRANT_MADE:
            patterns[str(entry.meta.get("grant"))] = e.get("pattern")
        if not rid or kind is None:
            continue
        if kind is EventType.REQUEST_RECEIVED:
            rows[rid] = {
                "request_id": rid,
                "session_id": None,
                "host": e.get("host"),
                "user": e.get("user"),
                "command": e.get("command"),
                "command_sha256": e.get("command_sha256"),
                "outcome": RequestState.IN_FLIGHT.value,
                "code": None,
                "exit_status": None,
                "cause": None,
                "subject": e.get("subject"),
                "received_at": e.get("t"),
                "certificate": None,
                "run": run_label(e.get("subject")),
                "ended_at": None,
                "grant": None,
            } | ({"file": e["file"]} if e.get("file") else {})  # an sftp operation's
            continue
        row = rows.get(rid)
        if row is None:
            continue
        if kind is EventType.DENIED:
            row.update(
                outcome=RequestState.DENIED.value, code=entry.meta.get("code"), ended_at=e.get("t")
            )
        elif kind is EventType.DISPATCH_STARTED:
            row.update(
                session_id=entry.meta.get("session_id"), outcome=RequestState.IN_FLIGHT.value
            )
            if e.get("acts_on") and isinstance(row.get("file"), dict):
                # where a symlink on the way took the operation (`sftp`, the walk)
                row["file"] = {**row["file"], "acts_on": e["acts_on"]}
        elif kind is EventType.CERTIFICATE_ISSUED:
            row["certificate"] = certificate_of(entry)
        elif kind is EventType.GRANT_USED:
            grant = entry.meta.get("grant")
            row.update(
                grant=grant,
                grant_pattern=patterns.get(str(grant)),
                grant_uses_left=entry.meta.get("uses_left"),
            )
        elif kind.outcome is not None:
            row.update(
                outcome=kind.outcome.value,
                code=entry.meta.get("code"),
                exit_status=entry.meta.get("exit_status"),
                cause=entry.meta.get("cause"),
                ended_at=e.get("t"),
            )
    return list(rows.values())


def certificate_of(entry: Entry) -> dict[str, Any]:
    """The certificate a request logged in with, as the target's sshd logs it: key id
    (the request id), serial, and the signing CA's fingerprint."""
    meta = entry.meta
    return {"serial": meta.get("serial"), "key_id": meta.get("key_id"), "ca": meta.get("ca")}


def sessions(events: Iterable[tuple[Entry, dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per session approval: for whom (the run's label, or the process), when
    it began and who approved it (`approved_by`: the operator socket's peer, in
    journals written since it was recorded; None before), when and why it ended."""
    rows: dict[str, dict[str, Any]] = {}
    for entry, e in events:
        sid = entry.meta.get("session_id")
        kind = event_type(entry)
        if kind is EventType.SESSION_APPROVED and sid:
            rows[sid] = {
                "session_id": sid,
                "host": e.get("host"),
                "user": e.get("user"),
                "subject": e.get("subject"),
                "approved_at": e.get("t"),
                "ended_at": None,
                "end_reason": None,
                "run": run_label(e.get("subject")),
                "approved_by": e.get("approved_by"),
                "signed_by": e.get("signed_by") or [],  # presence: the signers of its card
            }
        elif kind is EventType.SESSION_ENDED and sid in rows:
            rows[sid].update(ended_at=e.get("t"), end_reason=entry.meta.get("reason"))
        elif kind is EventType.BOOT:  # a new lifetime ends every approval of the last one
            for row in rows.values():
                if row["end_reason"] is None:
                    row.update(ended_at=e.get("t"), end_reason=EndReason.GATEWAY_RESTARTED.value)
    return list(rows.values())


def foreign_warning(span: dict[str, Any]) -> str:
    """What the operator must know of records no certification of theirs covers."""
    return (
        f"journal: {span.get('records')} record(s), seq {span.get('first')}..{span.get('last')}, "
        f"are signed by boot key {span.get('boot')}, which this journal's identity never "
        "certified: a gateway that was never unlocked wrote them, or someone else did. "
        "Check with `bastion audit verify --witness`."
    )


@dataclass(frozen=True)
class ActivityFilter:
    """`audit activity`'s filters; an empty one keeps every row. Hosts compare without
    case (policy aliases do); the run label and `grep` (a plain substring of the
    command as the agent sent it, or of a file operation's path) compare exactly.
    `until` compares the received time in whole seconds, as the rows show it: a row shown
    at 21:52:05 is kept by `--until 21:52:05`, though it came at 21:52:05.4."""

    hosts: frozenset[str] = frozenset()
    run: str | None = None
    since: float | None = None
    until: float | None = None
    outcomes: frozenset[str] = frozenset()
    grep: str | None = None

    def keeps(self, row: Mapping[str, Any]) -> bool:
        if self.hosts and str(row.get("host") or "").lower() not in self.hosts:
            return False
        if self.run is not None and row.get("run") != self.run:
            return False
        at = row.get("received_at")
        if self.since is not None and not (isinstance(at, int | float) and at >= self.since):
            return False
        if self.until is not None and not (isinstance(at, int | float) and int(at) <= self.until):
            return False
        if self.outcomes and not self.outcomes & outcome_words(row):
            return False
        return self.grep is None or self.grep in searched_text(row)

    def select(self, rows: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        return [r for r in rows if self.keeps(r)]


def outcome_words(row: Mapping[str, Any]) -> frozenset[str]:
    """The `--outcome` words a row answers to: its outcome, and `failed` when it ran
    and did not succeed."""
    outcome = str(row.get("outcome"))
    failed = outcome == "signalled" or (
        outcome == "completed" and row.get("exit_status") not in (0, None)
    )
    return frozenset({outcome, "failed"} if failed else {outcome})


def searched_text(row: Mapping[str, Any]) -> str:
    f = row.get("file")
    if isinstance(f, Mapping):
        return f"{f.get('path')}\n{f.get('to') or ''}"
    command = row.get("command")
    return command if isinstance(command, str) else ""
