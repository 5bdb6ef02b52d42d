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
import base64
import contextlib
import json
import logging
import os
import secrets
import signal
import socket
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncssh

from bastion import operator
from bastion.approvals import Answer, ApprovalBook, Card, CardError, CardKind, escape_command
from bastion.errors import Code, Failure
from bastion.gate import (
    AskCommand,
    AskSession,
    CommandGrant,
    Deny,
    Dispatch,
    EndReason,
    Request,
    World,
    decide,
)
from bastion.home import Home
from bastion.identity import Peer, Resolver, Subject, alive
from bastion.policy import Policy, PolicyError, PolicyStore, host_key_fingerprint
from bastion.vault import Vault, VaultError, load_private_key_file

log = logging.getLogger("bastion")

MAX_ROUNDS = 4  # gate → card → gate ... a request never loops for ever
WATCH_PING = 10.0  # seconds between keep-alive events to watching operators


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
    closed: bool = False


def new_request_id() -> str:
    return "req_" + secrets.token_hex(8)


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
        self.book.on_change = self._save_lifetime
        self.book.on_card = self._card_event
        self._watchers: set[asyncio.Queue[dict[str, Any]]] = set()
        self.dispatcher = Dispatcher(
            self.vault.private_key, settings.keepalive_interval, settings.keepalive_count_max
        )
        self.host_key = asyncssh.read_private_key(str(self.home.host_key))
        self.same_uid_agent_seen = False
        self.connections: set[AgentConn] = set()
        self._watches: dict[tuple[int, float, str], int] = {}
        self._last_policy: str | None = None
        self._stop = asyncio.Event()

    # -- state read by the gate ------------------------------------------------------

    def policy(self) -> Policy | PolicyError:
        current = self.policies.current()
        seen = str(current) if isinstance(current, PolicyError) else current.digest
        if seen != self._last_policy:
            self._last_policy = seen
            if isinstance(current, PolicyError):
                log.error("policy unavailable: %s", current)
            else:
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
        for q in self._watchers:
            q.put_nowait(event)

    def _card_event(self, card: Card, answer: Answer | None) -> None:
        if answer is None:
            if self._watchers:
                self.book.note_operator()  # somebody is looking at it right now
            self.publish({"event": "card", "card": card.as_json()})
        else:
            self.publish({"event": "closed", "card": card.id, "answer": answer.value})

    def denied(self, conn: AgentConn, req: Request, failure: Failure) -> None:
        subject = conn.peer.subject
        log.info("%s: denied %s", req.request_id, failure.code.value)
        self.notice(
            f"denied {failure.code.value}: pid {subject.pid} "
            f"({os.path.basename(subject.exe)}) asked for {req.user}@{req.host}; "
            "nothing was sent",
            req.request_id,
        )

    def notice(self, text: str, request_id: str | None = None) -> None:
        """A fact for the operator; nothing to decide, nothing it could run."""
        self.publish({"event": "notice", "text": text, "request_id": request_id})

    async def op_watch(self, _: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        q: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._watchers.add(q)
        self.book.note_operator()
        try:
            yield {
                "event": "hello",
                "boot_id": self.boot_id,
                "locked": self.vault.locked,
                "vault_epoch": self.vault.epoch,
            }
            for card in self.book.pending():
                yield {"event": "card", "card": card.as_json()}
            while True:
                try:
                    yield await asyncio.wait_for(q.get(), WATCH_PING)
                except TimeoutError:
                    yield {"event": "ping"}
        finally:
            self._watchers.discard(q)

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
        log.info("run registered: pid %d %r (%s)", info.pid, label, info.exe)
        return f"run_{subject.nonce}"

    def connection_opened(self, conn: AgentConn) -> None:
        self.connections.add(conn)

    def connection_closed(self, conn: AgentConn) -> None:
        self.connections.discard(conn)
        conn.closed = True
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
        log.info(
            "vault %s (epoch %d): %d session(s) ended, %d card(s) withdrawn",
            "locked" if locked else "unlocked",
            self.vault.epoch,
            len(ended),
            len(withdrawn),
        )

    # -- operator handlers ---------------------------------------------------------------

    def handlers(self) -> dict[str, operator.Handler]:
        return {
            "status": self.op_status,
            "unlock": self.op_unlock,
            "lock": self.op_lock,
            "pending": self.op_pending,
            "decide": self.op_decide,
            "sessions": self.op_sessions,
            "revoke": self.op_revoke,
            "key_list": self.op_key_list,
            "key_generate": self.op_key_generate,
            "key_import": self.op_key_import,
            "key_public": self.op_key_public,
            "key_remove": self.op_key_remove,
        }

    async def op_status(self, _: dict[str, Any]) -> dict[str, Any]:
        policy = self.policy()
        return {
            "locked": self.vault.locked,
            "vault_epoch": self.vault.epoch,
            "boot_id": self.boot_id,
            "policy": {
                "ok": not isinstance(policy, PolicyError),
                "error": str(policy) if isinstance(policy, PolicyError) else None,
                "hosts": [] if isinstance(policy, PolicyError) else sorted(policy.hosts),
                "directory": str(self.policies.directory),
            },
            "isolation": self.isolation(),
            "pending": len(self.book.pending()),
            "sessions": len(self.book.sessions()),
            "pid": os.getpid(),
            "agent_socket": str(self.settings.agent_socket),
        }

    async def op_unlock(self, args: dict[str, Any]) -> dict[str, Any]:
        try:
            passphrase = base64.b64decode(str(args.get("passphrase", "")), validate=True)
        except ValueError:
            raise operator.OperatorError("malformed passphrase field") from None
        try:
            await asyncio.to_thread(self.vault.unlock, passphrase)
        except VaultError as exc:
            raise operator.OperatorError(str(exc)) from None
        self._vault_changed(locked=False)
        return {"locked": False, "vault_epoch": self.vault.epoch}

    async def op_lock(self, _: dict[str, Any]) -> dict[str, Any]:
        self.vault.lock()
        self._vault_changed(locked=True)
        return {"locked": True, "vault_epoch": self.vault.epoch}

    async def op_pending(self, args: dict[str, Any]) -> list[dict[str, Any]]:
        self.book.note_operator()
        wait = min(float(args.get("wait") or 0), 600.0)
        deadline = time.monotonic() + wait
        while not self.book.pending() and (left := deadline - time.monotonic()) > 0:
            await self.book.wait_changed(left)
        self.book.note_operator()
        return [c.as_json() for c in self.book.pending()]

    async def op_decide(self, args: dict[str, Any]) -> dict[str, Any]:
        self.book.note_operator()
        card_id = str(args.get("card", ""))
        approve = bool(args.get("approve"))
        try:
            card = self.book.decide(card_id, approve, self.vault.epoch, self.vault.locked)
        except CardError as exc:
            raise operator.OperatorError(str(exc)) from None
        if not alive(card.subject.pid, card.subject.start_time):
            self._subject_exited(card.subject)
        log.info(
            "%s: card %s %s by operator",
            card.request_id,
            card.id,
            "approved" if approve else "declined",
        )
        return {"card": card.id, "approved": approve}

    async def op_sessions(self, _: dict[str, Any]) -> list[dict[str, Any]]:
        return [
            {
                "id": g.id,
                "host": g.host,
                "user": g.user,
                "subject": s.as_json(),
                "approved_at": g.approved_at,
                "vault_epoch": g.vault_epoch,
            }
            for g, s in self.book.sessions()
        ]

    async def op_revoke(self, args: dict[str, Any]) -> dict[str, Any]:
        session = str(args.get("session", ""))
        ended = self.book.end_sessions(lambda g: g.id == session, EndReason.REVOKED)
        if not ended:
            raise operator.OperatorError(f"no live session {session}")
        log.info("session %s revoked by operator", session)
        return {"revoked": session}

    def _vault_call(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except VaultError as exc:
            raise operator.OperatorError(str(exc)) from None

    async def op_key_list(self, _: dict[str, Any]) -> list[dict[str, Any]]:
        return [k.__dict__ for k in self._vault_call(self.vault.keys)]

    async def op_key_generate(self, args: dict[str, Any]) -> dict[str, Any]:
        label, alg = str(args.get("label", "")), str(args.get("algorithm") or "ssh-ed25519")
        return self._vault_call(lambda: self.vault.generate(label, alg)).__dict__

    async def op_key_import(self, args: dict[str, Any]) -> dict[str, Any]:
        label, data = str(args.get("label", "")), str(args.get("private_key", "")).encode()
        key = self._vault_call(lambda: load_private_key_file(data, None))
        return self._vault_call(lambda: self.vault.add(label, key)).__dict__

    async def op_key_public(self, args: dict[str, Any]) -> dict[str, Any]:
        return self._vault_call(lambda: self.vault.key_info(str(args.get("label", "")))).__dict__

    async def op_key_remove(self, args: dict[str, Any]) -> dict[str, Any]:
        label = str(args.get("label", ""))
        self._vault_call(lambda: self.vault.remove(label))
        return {"removed": label}

    # -- lifetime -------------------------------------------------------------------------

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        from bastion.agent_server import AgentListener

        home = self.home
        home.make_dirs()
        self._loop = asyncio.get_running_loop()
        self._load_previous_lifetime()
        with contextlib.suppress(operator.OperatorError):
            operator.call(home.operator_socket, "status", timeout=2)
            raise SystemExit(f"bastion: a gateway is already running for {home.root}")
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop)
        op_server = await operator.serve(
            home.operator_socket,
            self.handlers(),
            {"watch": self.op_watch},
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
            self.vault.lock()
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
