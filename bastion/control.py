"""What each operator request does: parse it, call the gateway, shape the answer.

The operator socket (`operator.py`) decides *who* may ask; this module maps
each request to the gateway (`daemon.py`), which owns every state change.
Negative controls -- status, lock, revoke, kill, pending -- never depend on
the policy or on the vault being unlocked.
"""

from __future__ import annotations

import asyncio
import base64
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from bastion import journal
from bastion.approvals import CardError
from bastion.operator import Handler, OperatorError
from bastion.policy import PolicyError
from bastion.vault import RESERVED_PREFIX, VaultError, load_private_key_file

if TYPE_CHECKING:
    from bastion.daemon import Gateway

WATCH_PING = 10.0  # seconds between keep-alive events to a watching prompt


def _vault_call(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except VaultError as exc:
        raise OperatorError(str(exc)) from None


def _user_label(args: dict[str, Any]) -> str:
    """A key label an operator may manage: bastion's own are not theirs."""
    label = str(args.get("label", ""))
    if label.startswith(RESERVED_PREFIX):
        raise OperatorError(
            f"labels starting with {RESERVED_PREFIX!r} are bastion's own; choose another"
        )
    return label


class Control:
    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway

    def handlers(self) -> dict[str, Handler]:
        return {
            "status": self.status,
            "unlock": self.unlock,
            "lock": self.lock,
            "pending": self.pending,
            "decide": self.decide,
            "sessions": self.sessions,
            "revoke": self.revoke,
            "kill": self.kill,
            "audit": self.audit,
            "key_list": self.key_list,
            "key_generate": self.key_generate,
            "key_import": self.key_import,
            "key_public": self.key_public,
            "key_remove": self.key_remove,
        }

    # -- state -------------------------------------------------------------------------

    async def status(self, _: dict[str, Any]) -> dict[str, Any]:
        gw = self.gw
        policy = gw.policy()
        broken = isinstance(policy, PolicyError)
        return {
            "locked": gw.vault.locked,
            "vault_epoch": gw.vault.epoch,
            "boot_id": gw.boot_id,
            "policy": {
                "ok": not broken,
                "error": str(policy) if broken else None,
                "hosts": [] if broken else sorted(policy.hosts),  # type: ignore[union-attr]
                "directory": str(gw.policies.directory),
            },
            "isolation": gw.isolation(),
            "journal": {
                "seq": gw.journal.seq,
                "appends": gw.journal.appends,
                "fsyncs": gw.journal.fsyncs,
                "append_seconds": gw.journal.append_seconds,
            },
            "pending": len(gw.book.pending()),
            "sessions": len(gw.book.sessions()),
            "pid": os.getpid(),
            "agent_socket": str(gw.settings.agent_socket),
        }

    async def unlock(self, args: dict[str, Any]) -> dict[str, Any]:
        try:
            passphrase = base64.b64decode(str(args.get("passphrase", "")), validate=True)
        except ValueError:
            raise OperatorError("malformed passphrase field") from None
        try:
            await self.gw.unlock(passphrase)
        except VaultError as exc:
            raise OperatorError(str(exc)) from None
        return {"locked": False, "vault_epoch": self.gw.vault.epoch}

    async def lock(self, args: dict[str, Any]) -> dict[str, Any]:
        ended = await self.gw.lock(bool(args.get("terminate")))
        return {"locked": True, "vault_epoch": self.gw.vault.epoch, "terminated": ended}

    # -- approvals ---------------------------------------------------------------------

    async def pending(self, args: dict[str, Any]) -> list[dict[str, Any]]:
        book = self.gw.book
        book.note_operator()
        wait = min(float(args.get("wait") or 0), 600.0)
        deadline = time.monotonic() + wait
        while not book.pending() and (left := deadline - time.monotonic()) > 0:
            await book.wait_changed(left)
        book.note_operator()
        return [c.as_json() for c in book.pending()]

    async def decide(self, args: dict[str, Any]) -> dict[str, Any]:
        self.gw.book.note_operator()
        approve = bool(args.get("approve"))
        try:
            card = self.gw.decide(str(args.get("card", "")), approve)
        except CardError as exc:
            raise OperatorError(str(exc)) from None
        return {"card": card.id, "approved": approve}

    async def sessions(self, _: dict[str, Any]) -> list[dict[str, Any]]:
        return [
            {
                "id": g.id,
                "host": g.host,
                "user": g.user,
                "subject": s.as_json(),
                "approved_at": g.approved_at,
                "vault_epoch": g.vault_epoch,
            }
            for g, s in self.gw.book.sessions()
        ]

    async def revoke(self, args: dict[str, Any]) -> dict[str, Any]:
        session = str(args.get("session", ""))
        if not self.gw.revoke(session):
            raise OperatorError(f"no live session {session}")
        return {"revoked": session}

    async def watch(self, _: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """The `bastion approve` stream: a hello, the open cards, then events."""
        gw = self.gw
        q: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        gw.watchers.add(q)
        gw.book.note_operator()
        try:
            yield {
                "event": "hello",
                "boot_id": gw.boot_id,
                "locked": gw.vault.locked,
                "vault_epoch": gw.vault.epoch,
            }
            for card in gw.book.pending():
                yield {"event": "card", "card": card.as_json()}
            while True:
                try:
                    yield await asyncio.wait_for(q.get(), WATCH_PING)
                except TimeoutError:
                    yield {"event": "ping"}
        finally:
            gw.watchers.discard(q)

    # -- requests and the journal --------------------------------------------------------

    async def kill(self, args: dict[str, Any]) -> dict[str, Any]:
        rid = str(args.get("request", ""))
        if rid not in self.gw.inflight:
            raise OperatorError(f"{rid} is not in flight (see `bastion request {rid}`)")
        self.gw.record("operator_kill", {"request_id": rid})
        await self.gw.kill(rid)
        return {"killed": rid}

    async def audit(self, args: dict[str, Any]) -> list[dict[str, Any]]:
        view = {"activity": journal.activity, "sessions": journal.sessions}.get(args.get("view"))
        if view is None:
            raise OperatorError("unknown audit view")
        key = _vault_call(lambda: self.gw.vault.private_key(journal.IDENTITY_LABEL)).pyca_key
        return view(journal.decrypt(journal.records(self.gw.home.journal), key))

    # -- keys --------------------------------------------------------------------------

    async def key_list(self, _: dict[str, Any]) -> list[dict[str, Any]]:
        return [k.__dict__ for k in _vault_call(self.gw.vault.keys)]

    async def key_generate(self, args: dict[str, Any]) -> dict[str, Any]:
        label, alg = _user_label(args), str(args.get("algorithm") or "ssh-ed25519")
        return _vault_call(lambda: self.gw.vault.generate(label, alg)).__dict__

    async def key_import(self, args: dict[str, Any]) -> dict[str, Any]:
        label, data = _user_label(args), str(args.get("private_key", "")).encode()
        key = _vault_call(lambda: load_private_key_file(data, None))
        return _vault_call(lambda: self.gw.vault.add(label, key)).__dict__

    async def key_public(self, args: dict[str, Any]) -> dict[str, Any]:
        return _vault_call(lambda: self.gw.vault.key_info(str(args.get("label", "")))).__dict__

    async def key_remove(self, args: dict[str, Any]) -> dict[str, Any]:
        label = _user_label(args)
        _vault_call(lambda: self.gw.vault.remove(label))
        return {"removed": label}
