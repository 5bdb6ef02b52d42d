"""What each operator request does: parse it, call the gateway, shape the answer.

The operator socket (`opserver.py`) decides *who* may ask; this module maps
each request to one call: the operator's state changes go to `Authority`,
requests in flight to `Service`, key operations and audit views to `ops`
(the same functions the offline CLI runs). Negative controls -- status,
lock, revoke, kill, pending -- never depend on the policy or on the vault
being unlocked.

Arguments come from a socket: each is checked for its type (and range) before
use, and a wrong one is answered with an `OperatorError` that names it.
"""

from __future__ import annotations

import asyncio
import base64
import math
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Protocol

from bastion import ops
from bastion.core.events import EventType
from bastion.core.grants import GrantError
from bastion.core.opguard import Operator
from bastion.core.policy import PolicyError
from bastion.gateway.approvals import ApprovalBook, CardError, GrantAsk
from bastion.gateway.authority import Authority
from bastion.gateway.opserver import OPERATOR_ARG, Handler
from bastion.gateway.recorder import ForeignRecords, Recorder
from bastion.gateway.service import Service
from bastion.gateway.signers import Signers, SignersError
from bastion.home import Home
from bastion.journal import IDENTITY_LABEL, Journal
from bastion.journal.witness import Witness
from bastion.ops.opsock import OperatorError
from bastion.sandbox.isolation import status_guarantees
from bastion.sandbox.threat_model import threat_model
from bastion.vault import Vault, VaultError

WATCH_PING = 10.0  # seconds between keep-alive events to a watching prompt
MAX_WAIT = 600.0  # the longest `pending` wait, in seconds
MAX_ARG = 1 << 20  # the longest string argument (the operator line's own limit)

_MISSING = object()


def text_arg(args: dict[str, Any], name: str) -> str:
    """A required string argument."""
    value = args.get(name)
    if not isinstance(value, str) or len(value) > MAX_ARG:
        raise OperatorError(f'"{name}" must be a string')
    return value


def flag_arg(args: dict[str, Any], name: str, default: bool | None = None) -> bool:
    """A boolean argument (true/false, not 0/1 or "yes"); required unless defaulted."""
    value = args.get(name, _MISSING)
    if value is _MISSING and default is not None:
        return default
    if not isinstance(value, bool):
        raise OperatorError(f'"{name}" must be true or false')
    return value


MAX_AUDIT_LAST = 10_000  # rows an `audit` request may ask for by `last` (0: all of them)


def number_arg(args: dict[str, Any], name: str, low: float, high: float) -> float:
    """A number argument within [low, high]; absent (or null) means `low`."""
    value = args.get(name)
    if value is None:
        return low
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not low <= value <= high
    ):
        raise OperatorError(f'"{name}" must be a number from {low:g} to {high:g}')
    return float(value)


def grant_arg(args: dict[str, Any]) -> GrantAsk | None:
    """The optional `grant` of an answer: {"pattern": str, "uses": int|null, "minutes":
    int|null}; its ranges are `core/grants`' to check."""
    value = args.get("grant")
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) - {"pattern", "uses", "minutes"}:
        raise OperatorError('"grant" must be an object with "pattern", "uses", "minutes"')
    for name in ("uses", "minutes"):
        n = value.get(name)
        if n is not None and (isinstance(n, bool) or not isinstance(n, int)):
            raise OperatorError(f'"grant.{name}" must be a whole number or null')
    return GrantAsk(text_arg(value, "pattern"), value.get("uses"), value.get("minutes"))


class Settings(Protocol):
    @property
    def policies(self) -> Path: ...
    @property
    def agent_socket(self) -> Path: ...


class GatewayView(Protocol):
    """The part of the one `lifetime.Gateway` control reads: the Gateway that
    built it, seen through what it uses of it (the agent doors have their own view)."""

    boot_id: str
    home: Home
    vault: Vault
    journal: Journal
    book: ApprovalBook
    service: Service
    authority: Authority
    witness: Witness | None
    foreign: ForeignRecords
    signers: Signers
    recorder: Recorder  # the console adds a sink to it

    @property
    def console_url(self) -> str | None: ...

    def console_status(self) -> dict[str, Any] | None: ...

    @property
    def settings(self) -> Settings: ...

    def isolation(self) -> str: ...

    def listeners_health(self) -> dict[str, Any]: ...

    def keys_held(self) -> dict[str, int]: ...

    def live_runs(self) -> list[dict[str, Any]]: ...

    def agent_processes(self) -> set[tuple[int, float]]: ...

    def home_status(self) -> dict[str, Any]: ...

    def shown(self, text: str) -> str: ...


class Control:
    def __init__(self, gateway: GatewayView) -> None:
        self.gw = gateway
        self.service = gateway.service
        self.authority = gateway.authority
        self.book = gateway.book

    def handlers(self) -> dict[str, Handler]:
        handlers: dict[str, Handler] = {
            "status": self.status,
            "unlock": self.unlock,
            "lock": self.lock,
            "pending": self.pending,
            "answer": self.answer,
            "sessions": self.sessions,
            "revoke": self.revoke,
            "kill": self.kill,
            "audit": self.audit,
            "console": self.console,
            "operator_list": self.operator_list,
            "operator_enroll": self.operator_enroll,
            "operator_enroll_wait": self.operator_enroll_wait,
            "operator_enroll_confirm": self.operator_enroll_confirm,
            "operator_remove": self.operator_remove,
        }
        for name in ops.KEY_OPS:
            handlers[name] = self._key_handler(name)
        return {name: self._shown(h) for name, h in handlers.items()}

    def _shown(self, handler: Handler) -> Handler:
        """`handler`, its refusal worded with the home's path, not the /proc/self/fd name
        the gateway acts through (home.Held)."""

        async def answer(args: dict[str, Any]) -> Any:
            try:
                return await handler(args)
            except OperatorError as exc:
                raise OperatorError(self.gw.shown(str(exc))) from None

        return answer

    # -- state -------------------------------------------------------------------------

    async def status(self, _: dict[str, Any]) -> dict[str, Any]:
        gw = self.gw
        policy = self.service.policy.current()
        broken = isinstance(policy, PolicyError)
        return {
            "locked": gw.vault.locked,
            "vault_epoch": gw.vault.epoch,
            "boot_id": gw.boot_id,
            # The home's path, and whether it still leads to the directory held open.
            "home": gw.home_status(),
            "policy": {
                "ok": not broken,
                "error": gw.shown(str(policy)) if broken else None,
                "hosts": [] if broken else sorted(policy.hosts),  # type: ignore[union-attr]
                "directory": gw.shown(str(gw.settings.policies)),
            },
            "isolation": gw.isolation(),
            "journal": {
                "seq": gw.journal.seq,
                "synced_seq": gw.journal.synced_seq,  # durable (group commit) up to here
                "appends": gw.journal.appends,
                "fsyncs": gw.journal.fsyncs,
                "append_seconds": gw.journal.append_seconds,
            },
            "pending": len(self.book.pending()),
            "agent_connections": len(self.service.connections),
            "sessions": len(self.book.sessions()),
            # Each live run and what its sandbox was given (the project, --rw, ...).
            "runs": gw.live_runs(),
            "pid": os.getpid(),
            "agent_socket": gw.shown(str(gw.settings.agent_socket)),
            "listeners": gw.listeners_health(),
            "keys_held": gw.keys_held(),
            # Backpressure: commands in flight, queued for a slot, refused GATEWAY_BUSY.
            "load": {
                "inflight": gw.service.admission.inflight,
                "limit": gw.service.admission.limit,
                "waiting": gw.service.admission.waiting(),
                "busy_refused": gw.service.admission.refused,
                # Each target's learned limit (core/concurrency.py), in flight and queued.
                "targets": gw.service.admission.targets(),
            },
            # Certificate accounts' connections parked before auth (gateway/warm.py).
            "warm": gw.dispatcher.warm.stats(),
            # How far behind the witness is (None: bastion.toml asks for none).
            "witness": gw.witness.health() if gw.witness is not None else None,
            # Records no vouch of this identity covers, found at the last unlock.
            "foreign_records": gw.foreign.reported,
            "guarantees": await asyncio.to_thread(
                status_guarantees, gw.home.here(), gw.isolation(), os.getpid()
            ),
            # The browser console (None: off) and its open event streams (tabs).
            "console": gw.console_status(),
            # What an agent can do in each mode (docs/sandbox.md, "The sandbox"): the same table.
            "threat_model": threat_model(),
        }

    async def unlock(self, args: dict[str, Any]) -> dict[str, Any]:
        passphrase = self._passphrase(args)
        try:
            await self.authority.unlock(passphrase)
        except VaultError as exc:
            raise OperatorError(str(exc)) from None
        return {"locked": False, "vault_epoch": self.gw.vault.epoch}

    async def lock(self, args: dict[str, Any]) -> dict[str, Any]:
        ended = await self.authority.lock(flag_arg(args, "terminate", False))
        return {"locked": True, "vault_epoch": self.gw.vault.epoch, "terminated": ended}

    # -- approvals ---------------------------------------------------------------------

    async def pending(self, args: dict[str, Any]) -> list[dict[str, Any]]:
        wait = number_arg(args, "wait", 0.0, MAX_WAIT)
        book = self.book
        book.note_operator()
        deadline = time.monotonic() + wait
        while not book.pending() and (left := deadline - time.monotonic()) > 0:
            await book.wait_changed(left)
        book.note_operator()
        return [c.as_json() for c in book.pending()]

    async def answer(self, args: dict[str, Any]) -> dict[str, Any]:
        """A card's answer; `grant` ({"pattern", "uses", "minutes"}) widens a yes to a
        command card into a bounded grant, or the whole answer is refused."""
        card_id, approve = text_arg(args, "card"), flag_arg(args, "approve")
        by = args.get(OPERATOR_ARG)
        ask = grant_arg(args)
        self.book.note_operator()
        try:
            card = self.authority.answer(
                card_id, approve, ask, by if isinstance(by, Operator) else None
            )
        except (CardError, GrantError) as exc:
            raise OperatorError(str(exc)) from None
        made = self.book.grant_of_card(card.id) if ask is not None else None
        return {"card": card.id, "approved": approve} | (
            {"grant": made.as_json()} if made is not None else {}
        )

    async def sessions(self, _: dict[str, Any]) -> list[dict[str, Any]]:
        self.book.end_spent_grants()  # a spent grant is listed ended, not live
        return [
            {
                "id": g.id,
                "host": g.host,
                "user": g.user,
                "subject": s.as_json(),
                "approved_at": g.approved_at,
                "vault_epoch": g.vault_epoch,
                "approved_by": g.approved_by.as_json() if g.approved_by else None,
                "signed_by": list(g.signed_by),
                "grants": [b.as_json() for b in self.book.grants_for(g.id)],
            }
            for g, s in self.book.sessions()
        ]

    async def revoke(self, args: dict[str, Any]) -> dict[str, Any]:
        session = text_arg(args, "session")
        if not self.authority.revoke(session):
            raise OperatorError(f"no live session {session}")
        return {"revoked": session}

    async def watch(self, _: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """The `bastion approve` stream: a hello, the open cards, then events."""
        gw = self.gw
        q: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        watchers = self.service.recorder.watchers
        watchers.add(q)
        self.book.note_operator()
        try:
            yield {
                "event": "hello",
                "boot_id": gw.boot_id,
                "locked": gw.vault.locked,
                "vault_epoch": gw.vault.epoch,
                "foreign_records": gw.foreign.reported,
            }
            for card in self.book.pending():
                yield {"event": "card", "card": card.as_json()}
            while True:
                try:
                    yield await asyncio.wait_for(q.get(), WATCH_PING)
                except TimeoutError:
                    yield {"event": "ping"}
        finally:
            watchers.discard(q)

    # -- requests and the journal --------------------------------------------------------

    async def kill(self, args: dict[str, Any]) -> dict[str, Any]:
        rid = text_arg(args, "request")
        if rid not in self.service.inflight:
            raise OperatorError(f"{rid} is not in flight (see `bastion request {rid}`)")
        self.service.recorder.record(EventType.OPERATOR_KILL, {"request_id": rid})
        await self.service.kill(rid)
        return {"killed": rid}

    async def audit(self, args: dict[str, Any]) -> list[dict[str, Any]]:
        """A journal view (`last`: only its last N rows, as `bastion approve`'s `a` asks).
        The journal is read and decrypted whole in a worker thread: on the event loop it
        would hold up every agent's request for as long as the journal is long."""
        view = text_arg(args, "view")
        last = int(number_arg(args, "last", 0, MAX_AUDIT_LAST))
        try:
            key = self.gw.vault.private_key(IDENTITY_LABEL).pyca_key
            rows = await asyncio.to_thread(ops.audit_view, view, self.gw.home.journal, key)
        except (VaultError, ops.OpsError) as exc:
            raise OperatorError(str(exc)) from None
        return rows[-last:] if last else rows

    # -- presence: the console and the enrolled signers --------------------------------

    async def console(self, _: dict[str, Any]) -> dict[str, Any]:
        """Its URL; or, when bastion.toml asks for it but it did not start, why."""
        url, status = self.gw.console_url, self.gw.console_status()
        return {"enabled": url is not None, "url": url, "error": (status or {}).get("error")}

    async def operator_list(self, _: dict[str, Any]) -> list[dict[str, Any]]:
        if self.gw.vault.locked:
            raise OperatorError("the vault is locked; run `bastion unlock` first")
        return self.gw.signers.listed()

    def _passphrase(self, args: dict[str, Any]) -> bytes:
        try:
            return base64.b64decode(text_arg(args, "passphrase"), validate=True)
        except ValueError:
            raise OperatorError("malformed passphrase field") from None

    async def operator_enroll(self, args: dict[str, Any]) -> dict[str, Any]:
        """Begin an enrolment: the passphrase, then a one-time URL for the browser."""
        url = self.gw.console_url
        failure = (self.gw.console_status() or {}).get("error")
        if url is None and failure:
            raise OperatorError(f"the console did not start: {failure}; enroll once it has")
        if url is None:
            raise OperatorError(
                "the console is off: set [console] enabled = true in bastion.toml and "
                "restart the gateway; enrolling is done in its page"
            )
        passphrase, name = self._passphrase(args), text_arg(args, "signer_name")
        try:
            await self.authority.prove_passphrase(passphrase)
            token = self.gw.signers.begin(name)
        except (SignersError, VaultError) as exc:
            raise OperatorError(str(exc)) from None
        return {"token": token, "url": f"{url}enroll#{token}"}

    async def operator_enroll_wait(self, args: dict[str, Any]) -> dict[str, Any]:
        """Wait (up to `wait` seconds) for the page to register an authenticator."""
        token = text_arg(args, "token")
        deadline = time.monotonic() + number_arg(args, "wait", 0.0, MAX_WAIT)
        ops_ = self.gw.signers
        try:
            while not ops_.waiting(token) and (left := deadline - time.monotonic()) > 0:
                await ops_.wait_registered(left)
            return {"registered": ops_.waiting(token)}
        except SignersError as exc:
            raise OperatorError(str(exc)) from None

    async def operator_enroll_confirm(self, args: dict[str, Any]) -> dict[str, Any]:
        """Keep what the page registered: the passphrase again (the token alone is no
        authority: a browser's argv shows it to the uid), and the code the page showed
        (so a registration raced in from another page is not the one kept)."""
        passphrase = self._passphrase(args)
        try:
            await self.authority.prove_passphrase(passphrase)
            cred = self.gw.signers.confirm(text_arg(args, "token"), text_arg(args, "code"))
        except (SignersError, VaultError) as exc:
            raise OperatorError(str(exc)) from None
        return cred.as_json()

    async def operator_remove(self, args: dict[str, Any]) -> dict[str, Any]:
        passphrase, ident = self._passphrase(args), text_arg(args, "signer")
        try:
            await self.authority.prove_passphrase(passphrase)
            cred = self.gw.signers.remove(ident)
        except (SignersError, VaultError) as exc:
            raise OperatorError(str(exc)) from None
        return {"removed": cred.id, "name": cred.name}

    # -- keys --------------------------------------------------------------------------

    def _key_handler(self, name: str) -> Handler:
        async def handler(args: dict[str, Any]) -> Any:
            if name.startswith("key_") and name != "key_list":  # ca_* check their own
                text_arg(args, "label")
            for optional in ("algorithm", "private_key"):
                if args.get(optional) is not None:
                    text_arg(args, optional)
            try:
                return ops.key_op(self.gw.vault, name, args)
            except (VaultError, ops.OpsError) as exc:
                raise OperatorError(str(exc)) from None

        return handler
