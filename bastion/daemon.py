"""The gateway lifetime: boot id, sockets, state, wiring, shutdown.

One `Gateway` is one lifetime. Its `boot_id` lives in memory only, so a
restarted gateway cannot honour anything the previous one granted. The
vault starts locked. Every request runs the same loop: take a snapshot of
the world, ask the gate, and if the gate wants a person, wait -- then take a
new snapshot and ask again (`authorize`). Right before the exec request
leaves, the gate is asked once more (`recheck`), because connecting to the
target is itself a wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import asyncssh
from cryptography.hazmat.primitives import serialization

from bastion import operator
from bastion.approvals import Answer, ApprovalBook, Card, CardKind, escape_command
from bastion.errors import Code, Failure
from bastion.gate import (
    AskCommand,
    AskSession,
    CommandGrant,
    Deny,
    Dispatch,
    EndReason,
    Request,
    SessionGrant,
    World,
    decide,
)
from bastion.home import Home
from bastion.identity import Peer, Resolver, Subject, alive
from bastion.journal import IDENTITY_LABEL, OUTCOMES, Journal, JournalError, read_identity
from bastion.policy import Policy, PolicyError, PolicyStore, host_key_fingerprint
from bastion.vault import RESERVED_PREFIX, Vault, VaultError

if TYPE_CHECKING:
    from bastion.dispatch import Result

log = logging.getLogger("bastion")

MAX_ROUNDS = 4  # gate → card → gate ... a request never loops for ever


@dataclass(frozen=True)
class Settings:
    home: Home
    policies: Path
    agent_socket: Path
    agent_group: int | None = None  # gid allowed to reach the agent socket (strong mode)
    approval_timeout: float = 120.0
    command_approval_ttl: float = 60.0
    keepalive_interval: float = 15.0
    keepalive_count_max: int = 3


@dataclass(eq=False)
class AgentConn:
    """One agent ssh connection: who connected, what target it named."""

    peer: Peer
    host: str
    user: str
    cards: set[str] = field(default_factory=set)


@dataclass(eq=False)
class InFlight:
    """A command that was sent and has no outcome yet."""

    request_id: str
    process: Any = None  # the asyncssh client process, once the exec request left
    killed: bool = False
    abandon: asyncio.Event = field(default_factory=asyncio.Event)


def new_request_id() -> str:
    return "req_" + secrets.token_hex(8)


class NotDispatched(Exception):
    """The world changed (or the intent could not be journaled) before the
    exec request left: nothing was sent."""

    def __init__(self, failure: Failure) -> None:
        self.failure = failure


class Gateway:
    def __init__(self, settings: Settings) -> None:
        from bastion.dispatch import Dispatcher  # asyncssh-heavy; keep CLI start light

        self.settings = settings
        self.home = settings.home
        self.boot_id = "boot_" + secrets.token_hex(12)
        self.vault = Vault.open(self.home.vault)  # opened locked: a new lifetime starts locked
        self.policies = PolicyStore(settings.policies)
        self.resolver = Resolver()
        self.book = ApprovalBook(self.boot_id, command_ttl=settings.command_approval_ttl)
        self.book.on_session = self._session_event
        self.book.on_card = self._card_event
        self.watchers: set[asyncio.Queue[dict[str, Any]]] = set()
        self.dispatcher = Dispatcher(
            self._credential, settings.keepalive_interval, settings.keepalive_count_max
        )
        self.host_key = asyncssh.read_private_key(str(self.home.host_key))
        self.same_uid_agent_seen = False
        self.connections: set[AgentConn] = set()
        self._watches: dict[tuple[int, float, str], int] = {}
        self._last_policy: str | None = None
        self._stop = asyncio.Event()
        self.journal = Journal(
            self.home.journal,
            read_identity(self.home.journal, self._pinned_identity()),
            self.boot_id,
        )
        self.inflight: dict[str, InFlight] = {}
        self.unknown_actions: dict[str, str] = {}  # sha256(action key) -> request id

    def _pinned_identity(self) -> bytes | None:
        """The journal identity's public key as the vault records it, so a
        swapped identity.json cannot redirect the journal's encryption."""
        try:
            line = self.vault.key_info(IDENTITY_LABEL).public_key
        except VaultError:
            return None
        pyca = asyncssh.import_public_key(line).pyca_key
        return pyca.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    # -- the journal -----------------------------------------------------------------------

    def record(self, type_: str, meta: dict[str, Any], event: dict[str, Any] | None = None) -> None:
        """Journal an event, on disk when this returns. A failure is logged
        loudly; only the intent before a dispatch (see `intent`) is fatal."""
        try:
            self.journal.append(type_, meta, event or {})
        except (OSError, JournalError) as exc:
            log.error("could not journal %s: %s", type_, exc)

    def _recover(self, found: list[Any]) -> None:
        """Close every intent the last lifetime left open; remember unknown actions."""
        outcome_of: dict[str, str] = {}
        action_of: dict[str, str] = {}
        for r in found:
            rid = r.meta.get("request_id")
            if r.type == "request_received" and r.meta.get("action"):
                action_of[rid] = r.meta["action"]
            elif r.type == "action_acknowledged":
                self.unknown_actions.pop(r.meta.get("action"), None)
            elif rid and r.type in ("dispatch_started", *OUTCOMES):
                outcome_of[rid] = r.type
            if r.type in OUTCOMES and rid in action_of:
                self._track_action(action_of[rid], rid, r.type == "unknown")
        for rid, last in outcome_of.items():
            if last == "dispatch_started":
                self.record(
                    "unknown",
                    {
                        "request_id": rid,
                        "code": Code.STATUS_UNKNOWN.value,
                        "cause": "gateway_restarted",
                    },
                )
                if rid in action_of:
                    self._track_action(action_of[rid], rid, unknown=True)
                log.warning("%s: was in flight when the last gateway ended: outcome unknown", rid)

    # -- state read by the gate ------------------------------------------------------

    def policy(self) -> Policy | PolicyError:
        current = self.policies.current()
        seen = str(current) if isinstance(current, PolicyError) else current.digest
        if seen != self._last_policy:
            self._last_policy = seen
            if isinstance(current, PolicyError):
                log.error("policy unavailable: %s", current)
                self.record("policy_failed", {}, {"error": str(current)})
            else:
                self.record("policy_loaded", {"digest": current.digest})
                log.info(
                    "policy loaded: %d host(s), digest %s", len(current.hosts), current.digest[:16]
                )
        return current

    def world(
        self,
        req: Request,
        subject: Subject,
        conversation: str | None,
        command_grant: CommandGrant | None,
    ) -> World:
        policy = self.policy()
        host = req.host
        if not isinstance(policy, PolicyError) and (h := policy.host(req.host)) is not None:
            host = h.alias
        grant, ended = self.book.session_for(subject, host, req.user, conversation)
        return World(
            locked=self.vault.locked,
            vault_epoch=self.vault.epoch,
            boot_id=self.boot_id,
            policy=policy,
            subject_alive=alive(subject.pid, subject.start_time),
            session=grant,
            ended=ended,
            command_grant=command_grant,
            now=time.time(),
            action_unknown=self.unknown_actions.get(req.action) if req.action else None,
        )

    def isolation(self) -> str:
        strong = self.settings.agent_group is not None and not self.same_uid_agent_seen
        return "strong" if strong else "advisory"

    # -- the authorisation loop --------------------------------------------------------

    async def authorize(
        self, conn: AgentConn, req: Request, conversation: str | None
    ) -> Dispatch | Failure:
        subject = conn.peer.subject
        command_card: str | None = None
        reason: EndReason | None = None
        for _ in range(MAX_ROUNDS):
            world = self.world(req, subject, conversation, self.book.command_grant(command_card))
            verdict = decide(req, world)
            if isinstance(verdict, Dispatch):
                return verdict
            if isinstance(verdict, Deny):
                why = verdict.reauth_reason or reason
                return Failure(
                    verdict.code, verdict.message, req.request_id, why.value if why else None
                )
            if isinstance(verdict, AskSession):
                reason = verdict.reason
                if world.session is not None:  # recorded but stale: end it, say why
                    stale = world.session.id
                    self.book.end_sessions(
                        lambda g, s=stale: g.id == s, verdict.reason or EndReason.POLICY_CHANGED
                    )
                card = self._card(CardKind.SESSION, conn, req, verdict, world, conversation)
            else:
                card = self._card(CardKind.COMMAND, conn, req, verdict, world, conversation)
            answer = await self._ask(conn, card)
            if answer is not Answer.APPROVED:
                return self._unanswered(card, answer, req.request_id, reason)
            if card.kind is CardKind.COMMAND:
                command_card = card.id
        return Failure(
            Code.APPROVAL_TIMEOUT,
            "The approval no longer matched the request after "
            "several rounds; nothing was sent. Send the request again.",
            req.request_id,
        )

    def _card(
        self,
        kind: CardKind,
        conn: AgentConn,
        req: Request,
        verdict: AskSession | AskCommand,
        world: World,
        conversation: str | None,
    ) -> Card:
        now = time.time()
        host, account = verdict.host, verdict.account
        is_command = kind is CardKind.COMMAND
        return Card(
            id=("cc_" if is_command else "sc_") + secrets.token_hex(6),
            kind=kind,
            request_id=req.request_id,
            reason=verdict.reason if isinstance(verdict, AskSession) else None,
            host=host.alias,
            address=host.address,
            port=host.port,
            user=account.user,
            credential=account.credential,
            host_key_fingerprint=host_key_fingerprint(host.host_key),
            command=escape_command(req.command) if is_command else None,
            command_sha256=req.command_sha256 if is_command else None,
            subject=conn.peer.subject,
            chain=conn.peer.chain,
            conversation=conversation,
            boot_id=self.boot_id,
            vault_epoch=world.vault_epoch,
            entry_digest=(
                verdict.entry_digest
                if isinstance(verdict, AskSession)
                else verdict.session.entry_digest
            ),
            created_at=now,
            expires_at=now + self.settings.approval_timeout,
            session_id=verdict.session.id if isinstance(verdict, AskCommand) else None,
        )

    async def _ask(self, conn: AgentConn, card: Card) -> Answer:
        """Raise a card and wait for its answer, its withdrawal, or the timeout."""
        fut = self.book.open_card(card)
        conn.cards.add(card.id)
        self.watch(card.subject)
        log.info(
            "%s: %s card %s raised for %s@%s (pid %d)%s",
            card.request_id,
            card.kind.value,
            card.id,
            card.user,
            card.host,
            card.subject.pid,
            f", reason {card.reason.value}" if card.reason else "",
        )
        try:
            return await asyncio.wait_for(asyncio.shield(fut), self.settings.approval_timeout)
        except TimeoutError:
            seen = self.book.approver_seen(card.id)
            self.book.close_card(card.id, Answer.TIMEOUT if seen else Answer.UNSEEN)
            return fut.result()
        finally:
            conn.cards.discard(card.id)
            self.book.close_card(card.id, Answer.WITHDRAWN_GONE)  # no-op if answered

    def _unanswered(
        self, card: Card, answer: Answer, request_id: str, reason: EndReason | None
    ) -> Failure:
        why = reason.value if reason else None
        what = "this command" if card.kind is CardKind.COMMAND else "this process"
        if answer is Answer.DECLINED:
            code = Code.CALL_DENIED if card.kind is CardKind.COMMAND else Code.SESSION_DENIED
            return Failure(
                code,
                f"The operator declined {what} on {card.user}@{card.host}. "
                "Nothing was sent; do not retry without asking the person.",
                request_id,
                why,
            )
        if answer is Answer.WITHDRAWN_LOCKED:
            return Failure(
                Code.VAULT_LOCKED,
                "The credential vault was locked while this request "
                "waited for approval. It was not queued or sent.",
                request_id,
                why,
            )
        if answer is Answer.UNSEEN:
            return Failure(
                Code.NO_APPROVER,
                f"No operator was watching for approvals within "
                f"{self.settings.approval_timeout:g}s. Nothing was sent; ask the person "
                "to run `bastion approve` (or `bastion pending`), then retry.",
                request_id,
                why,
            )
        if answer is Answer.TIMEOUT:
            return Failure(
                Code.APPROVAL_TIMEOUT,
                f"Nobody answered the approval card within "
                f"{self.settings.approval_timeout:g}s. Nothing was sent.",
                request_id,
                why,
            )
        return Failure(
            Code.SESSION_DENIED,
            "The request ended before it was approved (its "
            "process exited or its connection closed). Nothing was sent.",
            request_id,
            why,
        )

    # -- dispatch ------------------------------------------------------------------------

    async def dispatch(
        self,
        conn: AgentConn,
        req: Request,
        conversation: str | None,
        decided: Dispatch,
        streams: Any,
    ) -> Result:
        """Send a decided command: re-ask the gate, journal the intent durably,
        exec, relay, and record the outcome as it is known."""
        from bastion.dispatch import Outcome, Result

        if decided.command_grant is not None:
            self.book.use_command_grant(decided.command_grant.id)  # before anything is sent
        flight = InFlight(req.request_id)

        def intent() -> None:  # runs with no await before the exec request leaves
            failure = self.recheck(conn, req, conversation, decided)
            if failure is not None:
                raise NotDispatched(failure)
            try:  # the intent is on disk before the exec request leaves, or nothing leaves
                self.journal.append(
                    "dispatch_started",
                    {"request_id": req.request_id, "session_id": decided.session.id},
                    {},
                )
            except (OSError, JournalError) as exc:
                log.error("%s: could not journal the intent: %s", req.request_id, exc)
                raise NotDispatched(
                    Failure(
                        Code.INTERNAL,
                        "The gateway could not record its intent durably, so it did "
                        "not send the command. Nothing was sent.",
                        req.request_id,
                    )
                ) from None
            self.inflight[req.request_id] = flight

        def started(process: Any) -> None:
            flight.process = process

        try:
            result = await self.dispatcher.run(
                decided.host,
                decided.account,
                self.vault.epoch,
                req.command,
                streams,
                intent,
                started,
                flight.abandon,
            )
        finally:
            self.inflight.pop(req.request_id, None)
        if result.outcome is Outcome.UNKNOWN and flight.killed:
            result = Result(
                Outcome.UNKNOWN,
                code=result.code,
                message="The operator ended this "
                "command before it reported an exit status; it may or may not have "
                "finished. Inspect the target before retrying.",
                cause="killed",
            )
        self._record_outcome(req, result)
        return result

    def _record_outcome(self, req: Request, result: Any) -> None:
        from bastion.dispatch import Outcome

        meta: dict[str, Any] = {"request_id": req.request_id}
        if result.outcome is Outcome.COMPLETED:
            meta["exit_status"] = result.exit_status
        elif result.outcome is Outcome.SIGNALLED:
            meta["signal"] = result.signal[0] if result.signal else None
        else:
            meta["code"] = result.code.value if result.code else None
            meta["cause"] = result.cause
        self.record(result.outcome.value, meta, {"message": result.message})
        log.info(
            "%s: %s%s",
            req.request_id,
            result.outcome.value,
            f" (exit {result.exit_status})" if result.exit_status is not None else "",
        )
        if req.action is not None:
            self._track_action(req.action, req.request_id, result.outcome is Outcome.UNKNOWN)

    async def kill(self, request_id: str, grace: float = 2.0) -> None:
        """Signal the remote command, then close its channel if it does not end."""
        flight = self.inflight.get(request_id)
        if flight is None or flight.process is None:
            return
        flight.killed = True
        with contextlib.suppress(OSError, asyncssh.Error):
            flight.process.send_signal("TERM")
        try:
            await asyncio.wait_for(asyncio.shield(flight.process.wait_closed()), grace)
        except TimeoutError:
            flight.abandon.set()

    def _track_action(self, action: str, request_id: str, unknown: bool) -> None:
        """An action's last attempt decides: unknown blocks it, anything else clears it."""
        if unknown:
            self.unknown_actions[action] = request_id
        else:
            self.unknown_actions.pop(action, None)

    def acknowledge(self, action: str, request_id: str) -> None:
        """The agent says it inspected the target after an unknown outcome."""
        if self.unknown_actions.pop(action, None) is not None:
            self.record("action_acknowledged", {"action": action, "request_id": request_id})

    def recheck(
        self, conn: AgentConn, req: Request, conversation: str | None, decided: Dispatch
    ) -> Failure | None:
        """Ask the gate again right before the exec leaves: connecting was a wait."""
        world = self.world(req, conn.peer.subject, conversation, decided.command_grant)
        verdict = decide(req, world)
        if isinstance(verdict, Dispatch) and verdict.session.id == decided.session.id:
            return None
        if isinstance(verdict, Deny):
            return Failure(verdict.code, verdict.message, req.request_id)
        why = verdict.reason if isinstance(verdict, AskSession) else None
        return Failure(
            Code.SESSION_DENIED,
            "The approval ended while the gateway was connecting "
            "to the target; nothing was sent. Send the request again to be re-decided.",
            req.request_id,
            why.value if why else None,
        )

    # -- what operators watching see ---------------------------------------------------

    def publish(self, event: dict[str, Any]) -> None:
        for q in self.watchers:
            q.put_nowait(event)

    def _card_event(self, card: Card, answer: Answer | None) -> None:
        meta = {"request_id": card.request_id, "card": card.id, "kind": card.kind.value}
        if answer is None:
            if self.watchers:
                self.book.note_operator()  # somebody is looking at it right now
            self.record("card_raised", meta, {"card": card.as_json()})
            self.publish({"event": "card", "card": card.as_json()})
        else:
            self.record("card_closed", {**meta, "answer": answer.value})
            self.publish({"event": "closed", "card": card.id, "answer": answer.value})

    def _session_event(
        self, grant: SessionGrant, subject: Subject, reason: EndReason | None
    ) -> None:
        self._save_lifetime()
        if reason is None:
            self.record(
                "session_approved",
                {"session_id": grant.id},
                {
                    "host": grant.host,
                    "user": grant.user,
                    "subject": subject.as_json(),
                    "vault_epoch": grant.vault_epoch,
                    "entry_digest": grant.entry_digest,
                },
            )
        else:
            self.record("session_ended", {"session_id": grant.id, "reason": reason.value})

    def received(self, conn: AgentConn, req: Request, conversation: str | None) -> None:
        self.record(
            "request_received",
            {
                "request_id": req.request_id,
                "action": req.action,
            },
            {
                "host": req.host,
                "user": req.user,
                "command": req.command.decode("utf-8", "backslashreplace"),
                "command_sha256": req.command_sha256,
                "subject": conn.peer.subject.as_json(),
                "conversation": conversation,
                "chain": [p.pid for p in conn.peer.chain],
            },
        )

    def denied(self, conn: AgentConn, req: Request, failure: Failure) -> None:
        subject = conn.peer.subject
        log.info("%s: denied %s", req.request_id, failure.code.value)
        self.record(
            "denied",
            {"request_id": req.request_id, "code": failure.code.value},
            {"message": failure.message},
        )
        self.notice(
            f"denied {failure.code.value}: pid {subject.pid} "
            f"({os.path.basename(subject.exe)}) asked for {req.user}@{req.host}; "
            "nothing was sent",
            req.request_id,
        )

    def notice(self, text: str, request_id: str | None = None) -> None:
        """A fact for the operator; nothing to decide, nothing it could run."""
        self.publish({"event": "notice", "text": text, "request_id": request_id})

    # -- what the next lifetime may know ---------------------------------------------

    def _load_previous_lifetime(self) -> None:
        try:
            doc = json.loads(self.home.lifetime.read_text())
            keys = [k for k in doc["live_match_keys"] if isinstance(k, str)]
        except (OSError, ValueError, KeyError, TypeError):
            return
        if doc.get("boot_id") != self.boot_id:
            self.book.previous_lifetime(keys)

    def _save_lifetime(self) -> None:
        doc = {"boot_id": self.boot_id, "live_match_keys": self.book.live_match_keys()}
        tmp = self.home.lifetime.with_suffix(".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(doc, f)
            os.replace(tmp, self.home.lifetime)
        except OSError as exc:
            log.warning("could not record live approvals for the next lifetime: %s", exc)

    # -- process lifetimes -----------------------------------------------------------

    def watch(self, subject: Subject) -> None:
        """End grants and withdraw cards the moment a subject exits (not only
        when it next asks): a pidfd becomes readable at exit."""
        if subject.process_key in self._watches:
            return
        try:
            fd = os.pidfd_open(subject.pid)
        except OSError:
            self._subject_exited(subject)
            return
        if not alive(subject.pid, subject.start_time):  # pid reused before we pinned it
            os.close(fd)
            self._subject_exited(subject)
            return
        self._watches[subject.process_key] = fd
        asyncio.get_running_loop().add_reader(fd, self._subject_exited, subject)

    def _subject_exited(self, subject: Subject) -> None:
        fd = self._watches.pop(subject.process_key, None)
        if fd is not None:
            asyncio.get_running_loop().remove_reader(fd)
            os.close(fd)
        ended = self.book.end_sessions(
            lambda g: g.subject_key[:3] == subject.process_key, EndReason.PROCESS_CHANGED
        )
        gone = self.book.withdraw(
            lambda c: c.subject.process_key == subject.process_key, Answer.WITHDRAWN_GONE
        )
        self.resolver.forget(subject.pid, subject.start_time)
        if ended or gone:
            log.info(
                "process %d exited: %d session(s) ended, %d card(s) withdrawn",
                subject.pid,
                len(ended),
                len(gone),
            )

    def register_run(self, sock: socket.socket, label: str) -> str:
        """`bastion run`: the connecting process becomes one subject for its
        whole tree, for as long as it lives (runs in a worker thread)."""
        info = self.resolver.register_run(sock, label)
        subject = Subject(
            info.pid,
            info.start_time,
            info.exe,
            info.exe_sha256,
            info.uid,
            self.resolver.nonce_for(info.pid, info.start_time),
            label,
        )
        self._loop.call_soon_threadsafe(self.watch, subject)
        self._loop.call_soon_threadsafe(
            lambda: self.record("run_registered", {}, {"subject": subject.as_json()})
        )
        log.info("run registered: pid %d %r (%s)", info.pid, label, info.exe)
        return f"run_{subject.nonce}"

    def connection_opened(self, conn: AgentConn) -> None:
        self.connections.add(conn)

    def connection_closed(self, conn: AgentConn) -> None:
        self.connections.discard(conn)
        for card_id in list(conn.cards):
            self.book.close_card(card_id, Answer.WITHDRAWN_GONE)

    def agent_processes(self) -> set[tuple[int, float]]:
        """Every process the gateway knows as an agent -- approved, asking,
        connected or registered as a run: operator requests from below any of
        them are refused."""
        subjects = [
            *self.book.subjects(),
            *(c.subject for c in self.book.pending()),
            *(c.peer.subject for c in self.connections),
        ]
        return {(s.pid, s.start_time) for s in subjects} | set(self.resolver.runs)

    # -- vault -------------------------------------------------------------------------

    def _vault_changed(self, locked: bool) -> None:
        ended = self.book.end_sessions(lambda g: True, EndReason.VAULT_STATE_CHANGED)
        answer = Answer.WITHDRAWN_LOCKED
        withdrawn = self.book.withdraw(lambda c: True, answer)
        self.dispatcher.retire_all()
        self.record("vault_locked" if locked else "vault_unlocked", {"epoch": self.vault.epoch})
        log.info(
            "vault %s (epoch %d): %d session(s) ended, %d card(s) withdrawn",
            "locked" if locked else "unlocked",
            self.vault.epoch,
            len(ended),
            len(withdrawn),
        )

    # -- operator actions (parsed and answered in control.py) --------------------------

    async def unlock(self, passphrase: bytes) -> None:
        await asyncio.to_thread(self.vault.unlock, passphrase)
        self._vault_changed(locked=False)
        self.certify()

    async def lock(self, terminate: bool) -> list[str]:
        """Lock at once: every approval ends, every card is withdrawn, nothing is
        kept to run later. With `terminate`, also end every command in flight."""
        self.certify()
        self.vault.lock()
        self._vault_changed(locked=True)
        ended: list[str] = []
        if terminate:
            ended = list(self.inflight)
            self.record("operator_terminate", {"requests": ended})
            await asyncio.gather(*(self.kill(rid) for rid in ended))
        return ended

    def certify(self) -> None:
        """Have the journal identity vouch for everything written so far. Only
        possible while unlocked: at unlock, before a lock, before stopping."""
        if self.vault.locked:
            return
        try:
            self.journal.certify(self.vault.private_key(IDENTITY_LABEL).pyca_key)
        except (VaultError, OSError, JournalError) as exc:
            log.error("could not certify this lifetime's journal: %s", exc)

    def decide(self, card_id: str, approve: bool) -> Card:
        card = self.book.decide(card_id, approve, self.vault.epoch, self.vault.locked)
        if not alive(card.subject.pid, card.subject.start_time):
            self._subject_exited(card.subject)
        log.info(
            "%s: card %s %s by operator",
            card.request_id,
            card.id,
            "approved" if approve else "declined",
        )
        return card

    def revoke(self, session: str) -> bool:
        ended = self.book.end_sessions(lambda g: g.id == session, EndReason.REVOKED)
        if ended:
            log.info("session %s revoked by operator", session)
        return bool(ended)

    def _credential(self, label: str) -> asyncssh.SSHKey:
        """A key for an outbound connection -- never one of bastion's own."""
        if label.startswith(RESERVED_PREFIX):
            raise VaultError(f"{label!r} is reserved for bastion and cannot be a credential")
        return self.vault.private_key(label)

    # -- lifetime -------------------------------------------------------------------------

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        from bastion.agent_server import AgentListener
        from bastion.control import Control

        home = self.home
        home.make_dirs()
        self._loop = asyncio.get_running_loop()
        self._load_previous_lifetime()
        with contextlib.suppress(operator.OperatorError):
            operator.call(home.operator_socket, "status", timeout=2)
            raise SystemExit(f"bastion: a gateway is already running for {home.root}")
        self._recover(self.journal.open())
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop)
        control = Control(self)
        op_server = await operator.serve(
            home.operator_socket,
            control.handlers(),
            {"watch": control.watch},
            os.getuid(),
            self.agent_processes,
        )
        listener = AgentListener(self, self._agent_listen_socket())
        accept_task = asyncio.create_task(listener.serve())
        policy = self.policy()
        log.info(
            "gateway started: boot %s, vault locked (epoch %d), policy %s, isolation %s",
            self.boot_id,
            self.vault.epoch,
            "ok" if not isinstance(policy, PolicyError) else "UNAVAILABLE",
            self.isolation(),
        )
        if self.isolation() == "advisory":
            log.warning(
                "isolation is advisory: agents that run as this user (uid %d) could read "
                "this home; run agents as another user for strong isolation",
                os.getuid(),
            )
        try:
            await self._stop.wait()
        finally:
            log.info("gateway stopping")
            accept_task.cancel()
            await listener.close()
            op_server.close()
            self.dispatcher.close_all()
            self.record("gateway_stopped", {})
            self.certify()
            self.vault.lock()
            self.journal.close()
            for path in (home.operator_socket, self.settings.agent_socket):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            log.info("gateway stopped")

    def _agent_listen_socket(self) -> socket.socket:
        path = self.settings.agent_socket
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            sock.bind(str(path))
        finally:
            os.umask(old)
        if self.settings.agent_group is not None:
            os.chown(path, -1, self.settings.agent_group)
            os.chmod(path, 0o660)
        else:
            os.chmod(path, 0o600)
        sock.listen(128)
        sock.setblocking(False)
        return sock


def run_daemon(settings: Settings) -> None:
    logging.basicConfig(level=logging.INFO, format="bastion[%(process)d]: %(message)s")
    # asyncssh logs every exec'd command at INFO; commands may carry secrets.
    logging.getLogger("asyncssh").setLevel(logging.WARNING)
    asyncio.run(Gateway(settings).run())
