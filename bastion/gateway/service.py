"""The request path: from an agent's exec request to one honest outcome.

Every request runs the same loop: take a snapshot of the world, ask the gate,
and if the gate wants a person, raise a card and wait -- then take a new
snapshot and ask again (`authorize`). Right before the exec request leaves,
the gate is asked once more (`final_check`, inside `intent`), because
connecting to the target is itself a wait; in the same breath, with no await,
a command grant is spent and the intent is made durable. The service decides
nothing itself: it observes (what the journal, the witness, the agent's ssh
client and the waiting cards say: `Arrival`, `Service.world`) and carries out
the gate's verdict. The operator's state changes (answer, revoke, lock,
unlock, a process exiting) live in `authority.py`, which ends the approvals
and cards here through the book.

One request travels as one frozen record, its `Case` (who asked, what, in which
conversation, what was seen as its channel opened and as it arrived, how to reach
the agent), as monitor.c's `authctxt` does; the outbound side gets one `Job`.
`Service` is built from its parts, so tests can hand it fakes: a vault, a policy
source, the approval book, an outbound dispatcher (`outbound.Dispatcher`), a
recorder, and the functions that touch the operating system, in one `Edges`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from bastion.core.cards import Card, Withdrawal, make_card
from bastion.core.contract import Failure, Refusal
from bastion.core.defaults import APPROVAL_TIMEOUT, MAX_ROUNDS
from bastion.core.events import (
    EventType,
    Outcome,
    Recovery,
    Result,
    recovered_meta,
)
from bastion.core.gate import (
    AskSession,
    CardEnding,
    CardKind,
    Channel,
    Dispatch,
    EndReason,
    Request,
    Session,
    World,
    after_wait,
    evaluate,
    exec_endings,
    final_check,
    intake,
    no_slot,
    reads_stdin,
    request_binding,
    rounds_exhausted,
    unanswered,
)
from bastion.core.grants import BoundedGrant, GrantEnd
from bastion.core.refusals import killed, not_started
from bastion.core.subject import Peer, Subject, SubjectKind
from bastion.core.waiting import waiting_line, wanted
from bastion.gateway.actions import ActionKeys
from bastion.gateway.admission import Admission, NoSlot
from bastion.gateway.approvals import ApprovalBook
from bastion.gateway.certify import NO_ISSUER, Certifier
from bastion.gateway.intent import Intent
from bastion.gateway.mux import MuxView
from bastion.gateway.outbound import Job
from bastion.gateway.recorder import PolicyWatch, Recorder
from bastion.gateway.stdin import Taken, take
from bastion.gateway.tenants import Tenant
from bastion.journal import JournalError

log = logging.getLogger(__name__)

KILL_GRACE = 2.0  # seconds a killed command has to report its end before it is abandoned


class VaultState(Protocol):
    @property
    def locked(self) -> bool: ...
    @property
    def epoch(self) -> int: ...
    def lock(self) -> int: ...
    def unlock(self, passphrase: bytes) -> int: ...
    def check_passphrase(self, passphrase: bytes) -> None: ...


class Outbound(Protocol):
    """What the request path needs of `outbound.Dispatcher`: `run` raises a `Refusal`
    for an ending before the exec request left (the intent's own passes through) and
    returns a `Result` once it was sent."""

    async def run(self, job: Job) -> Result: ...

    def retire_all(self) -> None: ...


# Carries out a decided request other than an exec (a file operation: `gateway/sftp.py`):
# given the gate's verdict and the intent, which it calls with no await before the
# operation leaves; raises a `Refusal` for an ending before that, returns the `Result`.
Perform = Callable[[Dispatch, Intent], Awaitable[Result]]


class Timer(Protocol):
    def cancel(self) -> None: ...


@dataclass(eq=False)
class AgentConn:
    """One agent ssh connection: who connected, what target it named."""

    peer: Peer
    host: str
    user: str
    cards: set[str] = field(default_factory=set)
    socket_inode: int = 0  # the gateway's end of it: what a ControlMaster is found by (`mux`)


@dataclass(eq=False)
class InFlight:
    """A command that was sent and has no outcome yet."""

    request_id: str
    process: Any = None  # the asyncssh client process, once the exec request left
    killed: bool = False
    abandon: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(frozen=True)
class Opened:
    """What was seen as the request's channel opened, before its request came: who was
    connected to a run's ControlMaster (`mux`), and, of a later channel on its
    connection, whether only the connection's own client can send through it (`own`:
    `senders.own_connection`). The gate decides on both, with the same seen again."""

    mux: MuxView | None = None
    own: bool | None = None


@dataclass(frozen=True)
class Arrival:
    """What was observed of a request once, as it arrived, and holds for its whole life:
    every snapshot of its world carries it (`Service.world`)."""

    not_journaled: str | None = None  # why its first record could not be written
    lost: int = 0  # the recorder's count of lost records once it was received
    shared_connection: bool = False  # its ssh client could carry other processes' commands
    witness_refusing: str | None = None  # why the witness took no new work as it arrived
    # Of a registered run's shared connection: whether every process connected to its
    # ControlMaster was of the run, at the channel's open and at its request (`mux`).
    mux: MuxView | None = None
    # Of a later channel: only the connection's own client can send through it, as seen
    # at the channel's open and at its request (`senders.own_connection`).
    own: bool | None = None


@dataclass(frozen=True)
class Case:
    """One request on its way through the gateway: who asked (the connection, whose
    peer is the subject), what, in which conversation, what was seen as its channel
    opened and as it arrived, and how the agent is reached (`streams`; `tell` writes
    to its stderr, `wait_line` is what it set in `BASTION_WAIT_LINE`). `perform`
    carries out a file operation instead of an exec (`gateway/sftp_broker.py`);
    `ack_unknown`: the agent inspected the target after an unknown outcome.

    Frozen: reading the subject again (`handle`) or the stdin before a command card
    (`authorize`) makes a new one, so each step sees the request it was decided for."""

    conn: AgentConn
    request: Request
    conversation: str | None = None
    streams: Any = None
    opened: Opened = Opened()
    arrival: Arrival | None = None  # set once, by `Service.arrive`
    tell: Callable[[bytes], None] | None = None
    wait_line: str | None = None
    perform: Perform | None = None
    ack_unknown: bool = False

    @property
    def subject(self) -> Subject:
        return self.conn.peer.subject


@dataclass(frozen=True)
class Decided:
    """The gate said dispatch; `command_key` is what its command grant is held under in
    the book (the command card's id, or the key of a bounded grant's use). The case
    is the one it was decided for: with the stdin read before a command card
    (`request.stdin`), its streams feed exactly those bytes."""

    dispatch: Dispatch
    command_key: str | None
    case: Case


def _nobody(_: object) -> None:
    return None


@dataclass(frozen=True)
class Edges:
    """What the request path reads of the operating system and the agent's ssh client,
    and the one thing it asks of them (`watch`): each a function, so tests hand fakes
    (the daemon's are `lifetime.Gateway`'s). Every default observes nothing."""

    alive: Callable[[int, float], bool]  # is (pid, start time) still that process
    watch: Callable[[Subject], None] = _nobody  # tell me when it exits (a pidfd)
    refresh: Callable[[Subject], Subject] = lambda s: s  # the subject, read again
    rides_a_master: Callable[[Peer], bool] = lambda p: False  # its ssh may be a ControlMaster
    # Who is connected to a run's ControlMaster (`mux.observe`), given the peer and the
    # inode of the gateway's end of the connection.
    mux_clients: Callable[[Peer, int], MuxView] = lambda p, i: unseen()
    own_connection: Callable[[Peer], bool | None] = lambda p: None  # `senders.own_connection`
    # Why no new work is taken (a full witness buffer, when_full = refuse), or None.
    refusing: Callable[[], str | None] = lambda: None
    # Reads an agent's stdin whole before a command card (`stdin.take`), given its streams.
    take_stdin: Callable[[Any], Awaitable[Taken]] = take
    clock: Callable[[], float] = time.time


def unseen() -> MuxView:
    """No observer of ControlMasters: nothing is known to be of the run."""
    return MuxView(None, "the gateway does not observe ControlMasters")


def both(first: MuxView | None, then: MuxView) -> MuxView:
    """Two sightings: the one that does not see the run alone decides (False, then None)."""
    if first is None:
        return then
    for view in (first, then):
        if view.in_run is False:
            return view
    for view in (first, then):
        if view.in_run is None:
            return view
    return then


def new_request_id() -> str:
    return "req_" + secrets.token_hex(8)


class Service:
    """The request path of one lifetime (module docstring). `witnessed`: a witness
    holds the intent's head before the exec (`Witness.intent`); `certifier` signs
    certificate accounts' logins (None: none can be); `on_sessions_changed` saves
    what the next lifetime's cards need (`lifetime.json`)."""

    def __init__(
        self,
        boot_id: str,
        vault: VaultState,
        policy: PolicyWatch,
        book: ApprovalBook,
        outbound: Outbound,
        recorder: Recorder,
        edges: Edges,
        *,
        admission: Admission | None = None,
        certifier: Certifier | None = None,
        witnessed: Callable[[int], Awaitable[str | None]] | None = None,
        schedule: Callable[[float, Callable[[], object]], Timer] | None = None,
        approval_timeout: float = APPROVAL_TIMEOUT,
        on_sessions_changed: Callable[[], None] = lambda: None,
    ) -> None:
        self.boot_id = boot_id
        self.vault = vault
        self.policy = policy
        self.book = book
        self.outbound = outbound
        self.recorder = recorder
        self.edges = edges
        self.admission = admission or Admission(limit=None)  # tests: no limit unless asked
        self.certifier = certifier
        self.witnessed = witnessed
        self.schedule = schedule
        self.approval_timeout = approval_timeout
        self.on_sessions_changed = on_sessions_changed
        self.actions = ActionKeys()
        # Bytes of per-command uploads each tenant holds for their file cards (`sftp`).
        self.held: Counter[Tenant] = Counter()
        # Each target account's turn for file operations, walk to answer (`Broker.turn`).
        self.file_turns: dict[tuple[str, int, str], asyncio.Lock] = {}
        self.connections: set[AgentConn] = set()
        self.inflight: dict[str, InFlight] = {}
        # request id -> why its card was withdrawn, from `authorize` to the `denied` record
        self.withdrawn: dict[str, Withdrawal] = {}
        book.on_card = self._card_event
        book.on_session = self._session_event
        book.on_grant = self._grant_event

    # -- a lifetime begins ---------------------------------------------------------------

    def recover(self, found: Recovery) -> None:
        """Close every request the last lifetime left open; inherit its blocked actions."""
        for rid in found.not_started:
            self.recorder.record(EventType.NOT_STARTED, recovered_meta(rid, Outcome.NOT_STARTED))
        for rid in found.unknown:
            self.recorder.record(EventType.UNKNOWN, recovered_meta(rid, Outcome.UNKNOWN))
            log.warning("%s: was in flight when the last gateway ended: outcome unknown", rid)
        self.actions.blocked.update(found.actions)

    # -- the world, as the gate sees it --------------------------------------------------

    def world(self, case: Case, command_key: str | None = None) -> World:
        """Everything the gate may look at, now: each value observed, none judged, and
        nothing changed -- reading the world journals nothing and ends nothing."""
        req, subject = case.request, case.subject
        seen = case.arrival or Arrival(lost=self.recorder.lost)
        session, ended = self.book.session_for(subject, req.host, req.user, case.conversation)
        tenant = Tenant.of_subject(subject)
        return World(
            locked=self.vault.locked,
            vault_epoch=self.vault.epoch,
            boot_id=self.boot_id,
            policy=self.policy.seen(),
            subject_alive=self.edges.alive(subject.pid, subject.start_time),
            session=session,
            ended=ended,
            command_grant=self.book.command_grant(command_key),
            now=self.edges.clock(),
            action_unknown=self.actions.blocking(req.action),
            certify_problem=self.certifier.problem() if self.certifier else NO_ISSUER,
            shared_connection=seen.shared_connection,
            subject_is_run=subject.kind is SubjectKind.RUN,
            mux_clients_in_run=seen.mux.in_run if seen.mux else None,
            mux_seen=seen.mux.seen if seen.mux else "",
            own_connection=seen.own,
            not_journaled=seen.not_journaled,
            records_lost=self.recorder.lost != seen.lost,
            witness_refusing=seen.witness_refusing,
            cards_waiting=sum(
                1 for c in self.book.pending() if Tenant.of_subject(c.subject) == tenant
            ),
            held_bytes=self.held[tenant],
            tenant=str(tenant),
            grants=self.book.grants_for(session.id) if session is not None else (),
            other_exec=self.book.other_exec(subject),
        )

    def look(self, case: Case, command_key: str | None = None) -> World:
        """The world, with what reading it must journal or end done around it, not in
        it: the policy read now (`PolicyWatch.current` journals a change before it
        decides anything), the bounded grants core says are spent (`BoundedGrant.end_reason`)
        ended; then, once it is read, what the gate says an exec ends (`exec_endings`:
        the grants of the subject's old exec), so the next look finds them ended."""
        self.policy.current()
        self.book.end_spent_grants()
        world = self.world(case, command_key)
        ending = exec_endings(world)
        if ending:
            self.book.end_for_exec(case.subject, ending)
        return world

    # -- one request ---------------------------------------------------------------------

    async def handle(self, case: Case) -> Result | Failure:
        """The whole life of one request; every ending is journaled.

        The subject is read again first: identified at connect, it may have exec'd
        into another program since, and that program is not what was approved."""
        conn = case.conn
        fresh = self.edges.refresh(conn.peer.subject)
        if fresh != conn.peer.subject:
            conn.peer = replace(conn.peer, subject=fresh)
            case = replace(case, request=replace(case.request, subject_key=fresh.key))
        case = replace(case, arrival=self.arrive(case))
        if case.ack_unknown and case.request.action is not None:
            self.acknowledge(case)
        decided = await self.authorize(case)
        if isinstance(decided, Failure):
            return self._denied(case, decided)
        case = decided.case
        try:
            async with self.admission.slot(
                case.subject.process_key,
                Tenant.of_subject(case.subject),
                decided.dispatch.account.label,
            ):
                return await self.dispatch(decided)
        except NoSlot as busy:
            now = self.look(case, decided.command_key)
            ended = after_wait(case.request, now, no_slot(str(busy)))
            return self._denied(case, ended.failure(case.request.request_id))
        finally:
            self.book.discard_command_grant(decided.command_key)

    def arrive(self, case: Case) -> Arrival:
        """Journal the request's first record and observe what holds for its life. A
        record that cannot be written is observed too: the gate refuses the request.
        Who rides a run's shared connection is read here and was read as the channel
        opened (`case.opened`): a process that sent its command and left in between is
        not seen here, and was there."""
        conn, req = case.conn, case.request
        not_journaled: str | None = None
        try:
            self.recorder.received(conn.peer, req, case.conversation)
        except (OSError, JournalError) as exc:  # nothing is taken that the journal cannot tell
            log.error("%s: could not journal the request: %s", req.request_id, exc)
            not_journaled = str(exc)
        shared = self.edges.rides_a_master(conn.peer)
        mux = None
        later = req.channel is Channel.SHARED or req.later
        if conn.peer.subject.kind is SubjectKind.RUN and (shared or later):
            mux = both(case.opened.mux, self.edges.mux_clients(conn.peer, conn.socket_inode))
            log.info("%s: shared connection of a run: %s", req.request_id, mux.seen)
        own = None
        if later:  # both sightings say so
            own = case.opened.own and self.edges.own_connection(conn.peer)
        return Arrival(
            not_journaled,
            self.recorder.lost,  # a record lost after this: not sent
            shared,
            self.edges.refusing(),
            mux,
            own,
        )

    def acknowledge(self, case: Case) -> None:
        """The agent inspected the target after an unknown outcome: its action is clear
        again -- unless the gateway does not take this request at all (`gate.intake`)."""
        req = case.request
        assert req.action is not None
        if intake(req, self.look(case)) is None and self.actions.acknowledge(req.action):
            self.recorder.record(
                EventType.ACTION_ACKNOWLEDGED, {"action": req.action, "request_id": req.request_id}
            )

    def _denied(self, case: Case, failure: Failure) -> Failure:
        why = self.withdrawn.pop(case.request.request_id, None)
        self.recorder.denied(case.subject, case.request, failure, why)
        return failure

    async def authorize(self, case: Case) -> Decided | Failure:
        """Ask the gate until it says dispatch or no: a card between two asks, the
        stdin read before a command card, one use of a bounded grant."""
        command_key: str | None = None
        reason: EndReason | None = None
        for _ in range(MAX_ROUNDS + 1):  # + the one round that reads stdin
            req = case.request
            world = self.look(case, command_key)
            verdict = evaluate(req, world)
            if isinstance(verdict, Dispatch) and verdict.bounded is not None:
                # A bounded grant covers it: take one use now, with no await since the
                # verdict, and ask again with the command grant that use is.
                command_key = self._use_grant(req, verdict, verdict.bounded)
                continue
            if isinstance(verdict, Dispatch):
                return Decided(verdict, command_key, case)
            if isinstance(verdict, Refusal):
                return verdict.failure(req.request_id, reason)
            if reads_stdin(req, verdict):  # a command card: its stdin first, then ask again
                taken = await self.edges.take_stdin(case.streams)
                case = replace(case, request=replace(req, stdin=taken.stdin), streams=taken.streams)
                self.recorder.stdin(case.request)
                continue
            if isinstance(verdict, AskSession):
                reason = verdict.reason
                if (stale := world.session) is not None:  # recorded but stale: end it, say why
                    self.book.end_sessions(
                        lambda g: g.id == stale.id, verdict.reason or EndReason.POLICY_CHANGED
                    )
            card = make_card(
                ("cc_" if not isinstance(verdict, AskSession) else "sc_") + secrets.token_hex(6),
                req,
                verdict,
                case.conn.peer,
                case.conversation,
                self.boot_id,
                world.vault_epoch,
                self.edges.clock(),
                self.approval_timeout,
            )
            told = case.tell if wanted(verdict.account.waiting_line, case.wait_line) else None
            answer, why = await self._ask(case.conn, card, told)
            if answer is not CardEnding.APPROVED:
                if why is not None:  # nobody said no: the `denied` record says why
                    self.withdrawn[req.request_id] = why
                target = f"{card.binding.user}@{card.host}"
                refused = unanswered(card.kind, answer, target, reason, self.approval_timeout)
                return refused.failure(req.request_id)
            if card.kind is CardKind.COMMAND:
                command_key = card.id
        return rounds_exhausted().failure(case.request.request_id)

    def _use_grant(self, req: Request, verdict: Dispatch, grant: BoundedGrant) -> str | None:
        """One use of a bounded grant for this request, journaled with its id: the key
        of the command grant it makes, or None (it ended: the next round asks a card)."""
        binding = request_binding(req, verdict.host, verdict.account)
        key = self.book.use_grant(grant.id, req.request_id, binding)
        if key is not None:
            self.recorder.grant_used(req.request_id, grant)
            # The grant's id only: its pattern is command text, which no log line carries.
            log.info("%s: covered by grant %s", req.request_id, grant.id)
        return key

    async def _ask(
        self, conn: AgentConn, card: Card, tell: Callable[[bytes], None] | None = None
    ) -> tuple[CardEnding, Withdrawal | None]:
        """Raise a card and wait for its answer, its withdrawal (and why), or the
        timeout; `tell` the agent so, at once, when it asked to be told. Cancelled
        while waiting, the channel or connection closed: the card is withdrawn so."""
        fut = self.book.open_card(card)
        conn.cards.add(card.id)
        self.edges.watch(card.subject)
        if tell is not None:
            _tell(tell, waiting_line(card), card.request_id)
        log.info(
            "%s: %s card %s raised for %s@%s (pid %d)%s",
            card.request_id,
            card.kind.value,
            card.id,
            card.binding.user,
            card.host,
            card.subject.pid,
            f", reason {card.reason.value}" if card.reason else "",
        )
        schedule = self.schedule or asyncio.get_running_loop().call_later
        timer = schedule(self.approval_timeout, lambda: self.book.expire(card.id))
        try:
            ending = await asyncio.shield(fut)
        finally:
            timer.cancel()
            conn.cards.discard(card.id)
            self.book.close_card(  # a no-op if it was answered or withdrawn already
                card.id, CardEnding.WITHDRAWN_GONE, Withdrawal.CONNECTION_CLOSED
            )
            why = self.book.withdrawal(card.id)
        return ending, why

    async def dispatch(self, decided: Decided) -> Result | Failure:
        """Send a decided command (or carry out a decided file operation: `perform`):
        re-ask the gate, spend the grant, journal the intent durably (and, with a
        witness, have it confirmed: `Intent.prepare`), exec, relay, and record the
        outcome as it is known. A refusal is journaled here: the intent's as `denied`,
        the outbound side's as `not_started`. (None is raised on: a frozen `Refusal`
        cannot pass through a context manager, which sets its `__traceback__`.)"""
        case, chosen = decided.case, decided.dispatch
        req = case.request
        flight = InFlight(req.request_id)

        def last_word() -> Refusal | None:
            return final_check(req, self.look(case, decided.command_key), chosen)

        intent = Intent(
            req.request_id,
            chosen.session.id,
            last_word,
            (self.book, decided.command_key),
            lambda: self.inflight.update({req.request_id: flight}),
            self.recorder,
            self.witnessed,
            grant_id=chosen.command_grant.grant_id if chosen.command_grant else None,
        )

        def started(process: Any) -> None:
            flight.process = process

        try:
            if case.perform is not None:
                result = await case.perform(chosen, intent)
            else:
                job = Job(
                    chosen.host,
                    chosen.account,
                    self.vault.epoch,
                    req.command,
                    case.streams,
                    intent,
                    started,
                    flight.abandon,
                    certify=self.certifier and self.certifier.login(req, chosen.account),
                    prepare=intent.prepare if self.witnessed is not None else None,
                    terminal=req.terminal,
                )
                result = await self.outbound.run(job)
        except Refusal as refused:
            if refused is intent.refusal:  # the gate, the journal or the witness said no
                return self._denied(case, refused.failure(req.request_id))
            # Ended before the exec request left (connect, credential, certificate).
            result = not_started(refused)
            self.recorder.outcome(req.request_id, result)
            if req.action is not None:
                self.actions.outcome(req.action, req.request_id, result.outcome)
            return refused.failure(req.request_id)
        finally:
            self.inflight.pop(req.request_id, None)
        if result.outcome is Outcome.UNKNOWN and flight.killed:
            result = killed(result)
        self.recorder.outcome(req.request_id, result)
        if req.action is not None:
            self.actions.outcome(req.action, req.request_id, result.outcome)
        return result

    def resize(self, request_id: str, size: tuple[int, int, int, int]) -> bool:
        """The agent's terminal changed size: so does the command's on the target, if it
        runs (with a terminal) now."""
        flight = self.inflight.get(request_id)
        if flight is None or flight.process is None:
            return False
        with contextlib.suppress(Exception):  # a channel already gone has no terminal
            flight.process.change_terminal_size(*size)
            return True
        return False

    async def kill(self, request_id: str, grace: float = KILL_GRACE) -> None:
        """Signal the remote command, then stop waiting for it if it does not end."""
        flight = self.inflight.get(request_id)
        if flight is None or flight.process is None:
            return
        flight.killed = True
        with contextlib.suppress(Exception):  # a channel already gone cannot be signalled
            flight.process.send_signal("TERM")
        try:
            await asyncio.wait_for(asyncio.shield(flight.process.wait_closed()), grace)
        except TimeoutError:
            flight.abandon.set()

    # -- connections and processes -------------------------------------------------------

    def connection_opened(self, conn: AgentConn) -> None:
        self.connections.add(conn)

    def connection_closed(self, conn: AgentConn) -> None:
        self.connections.discard(conn)
        for card_id in list(conn.cards):
            self.book.close_card(card_id, CardEnding.WITHDRAWN_GONE, Withdrawal.CONNECTION_CLOSED)

    # -- what the book reports -------------------------------------------------------------

    def _card_event(self, card: Card, answer: CardEnding | None, why: Withdrawal | None) -> None:
        if answer is None and self.recorder.watchers:
            self.book.note_operator()  # somebody is looking at it right now
        self.recorder.card(card, answer, why)

    def _session_event(self, session: Session, subject: Subject, reason: EndReason | None) -> None:
        self.on_sessions_changed()
        self.recorder.session(session, subject, reason)

    def _grant_event(self, grant: BoundedGrant, reason: EndReason | GrantEnd | None) -> None:
        self.recorder.grant(grant, reason)


def _tell(write: Callable[[bytes], None], line: bytes, request_id: str) -> None:
    """A sign of life never fails the request: the channel's writer buffers without
    waiting (no drain), and an agent that is gone has its card withdrawn anyway."""
    try:
        write(line)
    except Exception as exc:
        log.info("%s: could not show the waiting line: %s", request_id, exc)
