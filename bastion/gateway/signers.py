"""The signers: the enrolled WebAuthn credentials that can sign a presence card.

The set is sealed in the vault (secret `bastion-signers`): a process of the
operator's uid can read the vault file but cannot add a signer to it without
the passphrase, and every change is journaled with the signer's public half
(`operator_enrolled`, `operator_removed`), which is what `audit verify` checks
signatures against, offline. The gateway holds the set in
memory while the vault is unlocked (cards exist only then) and forgets it at
lock.

Enrolling takes three steps, so that a process that sees the enrolment URL (a
browser's argv is readable by the same uid) cannot slip its own authenticator
in: the CLI proves the passphrase and gets a one-time token (`begin`); the
page registers an authenticator with it and is shown a code (`register`); the
operator types that code at the CLI, which proves the passphrase again and
keeps the signer (`confirm`). The token is no authority by itself: keeping a
registration takes the passphrase, and the code ties it to the operator's own
page, so one raced in from another page is not the one kept.

The sign counter each signer last reported is sealed beside it, so a
cloned authenticator (its counter behind) is refused across restarts too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from webauthn import generate_registration_options, options_to_json
from webauthn.helpers.structs import (
    AuthenticatorSelectionCriteria,
    PublicKeyCredentialDescriptor,
    ResidentKeyRequirement,
    UserVerificationRequirement,
)

from bastion.core.errors import BastionError
from bastion.core.events import EventType
from bastion.core.presence import (
    Checked,
    Flaw,
    PresenceError,
    Proof,
    Signer,
    check,
    check_name,
    enrolled_from,
    unb64url,
)
from bastion.gateway.recorder import Recorder
from bastion.vault import Vault, VaultError

log = logging.getLogger(__name__)

SECRET = "bastion-signers"
ENROL_TTL = 300.0  # seconds an enrolment token lives
MAX_PENDING = 8  # enrolments begun and not confirmed (oldest dropped)
MAX_SIGNERS = 64


class SignersError(BastionError):
    """An enrolment or removal that cannot be done; the message says why."""


@dataclass
class _Enrolment:
    name: str
    challenge: bytes
    user_id: bytes
    expires_at: float
    registered: tuple[Signer, int] | None = None
    code: str | None = None


class Signers:
    """The enrolled signers and their counters, for one console origin."""

    def __init__(
        self,
        vault: Vault,
        recorder: Recorder,
        rp_id: str,
        origin: str,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.vault = vault
        self.recorder = recorder
        self.rp_id = rp_id
        self.origin = origin
        self.clock = clock
        self._signers: dict[str, Signer] = {}
        self._counts: dict[str, int] = {}
        self._pending: dict[str, _Enrolment] = {}
        self._registered = asyncio.Event()  # set (and replaced) when a page registers

    # -- the sealed set ------------------------------------------------------------

    def load(self) -> None:
        """Read the sealed set (at unlock); an absent one is an empty set."""
        self._signers, self._counts = {}, {}
        if SECRET not in self.vault.secret_labels():
            return
        doc = json.loads(self.vault.secret(SECRET))
        for entry in doc.get("signers", []):
            cred = Signer.from_json(entry["signer"])
            self._signers[cred.id] = cred
            self._counts[cred.id] = int(entry.get("sign_count", 0))

    def forget(self) -> None:
        """At lock: nothing signs while locked (no card is open)."""
        self._signers, self._counts = {}, {}
        self._pending.clear()

    def _save(self) -> None:
        doc = {
            "v": 1,
            "signers": [
                {"signer": c.as_json(), "sign_count": self._counts.get(c.id, 0)}
                for c in self._signers.values()
            ],
        }
        self.vault.put_secret(SECRET, json.dumps(doc, sort_keys=True).encode())

    def listed(self) -> list[dict[str, Any]]:
        return [
            {
                "id": c.id,
                "name": c.name,
                "aaguid": c.aaguid,
                "fmt": c.fmt,
                "enrolled_at": c.enrolled_at,
                "sign_count": self._counts.get(c.id, 0),
            }
            for c in self._signers.values()
        ]

    def get(self, signer_id: str) -> Signer | None:
        return self._signers.get(signer_id)

    def descriptors(self) -> list[PublicKeyCredentialDescriptor]:
        return [PublicKeyCredentialDescriptor(id=unb64url(c)) for c in self._signers]

    # -- enrolling -------------------------------------------------------------------

    def begin(self, name: str) -> str:
        """A one-time enrolment token. The caller has proven the vault passphrase
        (`Authority.prove_passphrase`, with unlock's backoff) just before."""
        try:
            check_name(name)
        except PresenceError as exc:
            raise SignersError(str(exc)) from None
        if self.vault.locked:
            raise SignersError("the vault is locked; run `bastion unlock` first")
        if any(c.name == name for c in self._signers.values()):
            raise SignersError(f"a signer named {name!r} is enrolled; choose another name")
        if len(self._signers) >= MAX_SIGNERS:
            raise SignersError(f"{MAX_SIGNERS} signers are enrolled; remove one first")
        now = self.clock()
        self._pending = {t: e for t, e in self._pending.items() if e.expires_at > now}
        while len(self._pending) >= MAX_PENDING:
            del self._pending[next(iter(self._pending))]
        token = secrets.token_urlsafe(24)
        self._pending[token] = _Enrolment(
            name, secrets.token_bytes(32), secrets.token_bytes(16), now + ENROL_TTL
        )
        return token

    def _enrolment(self, token: str) -> _Enrolment:
        e = self._pending.get(token)
        if e is None or e.expires_at <= self.clock():
            self._pending.pop(token, None)
            raise SignersError(
                "this enrolment is unknown, used or expired: run `bastion operator enroll` again"
            )
        return e

    def options(self, token: str) -> dict[str, Any]:
        """The page's `navigator.credentials.create()` options, as JSON."""
        e = self._enrolment(token)
        if e.registered is not None:
            raise SignersError("this enrolment already registered an authenticator")
        options = generate_registration_options(
            rp_id=self.rp_id,
            rp_name="bastion",
            user_id=e.user_id,
            user_name=e.name,
            user_display_name=e.name,
            challenge=e.challenge,
            exclude_credentials=self.descriptors(),
            authenticator_selection=AuthenticatorSelectionCriteria(
                resident_key=ResidentKeyRequirement.DISCOURAGED,
                user_verification=UserVerificationRequirement.PREFERRED,
            ),
            timeout=int(ENROL_TTL * 1000),
        )
        return json.loads(options_to_json(options))

    def register(self, token: str, registration: dict[str, Any]) -> str:
        """Check the page's registration; keep it pending and return the code the page
        shows, which the operator types at the CLI (`confirm`)."""
        e = self._enrolment(token)
        if e.registered is not None:
            raise SignersError("this enrolment already registered an authenticator")
        try:
            made = enrolled_from(
                registration,
                challenge=e.challenge,
                rp_id=self.rp_id,
                origin=self.origin,
                name=e.name,
                now=self.clock(),
            )
        except PresenceError as exc:
            self._pending.pop(token, None)
            raise SignersError(str(exc)) from None
        if made[0].id in self._signers:
            self._pending.pop(token, None)
            raise SignersError("this authenticator is already enrolled")
        e.registered = made
        e.code = f"{secrets.randbelow(10**6):06d}"
        self._registered.set()
        self._registered = asyncio.Event()
        return e.code

    def confirm(self, token: str, code: str) -> Signer:
        """Keep the registered signer if `code` is the one its page showed; one try."""
        e = self._enrolment(token)
        if e.registered is None or e.code is None:
            raise SignersError("no authenticator has registered with this enrolment yet")
        del self._pending[token]
        if not secrets.compare_digest(code.replace("-", "").strip(), e.code):
            raise SignersError(
                "that is not the code the enrolment page showed; nothing was enrolled "
                "(run `bastion operator enroll` again)"
            )
        cred, count = e.registered
        self._signers[cred.id] = cred
        self._counts[cred.id] = count
        self._save()
        self.recorder.record(EventType.OPERATOR_ENROLLED, cred.as_json())
        log.info("signer %r enrolled (%s)", cred.name, cred.aaguid)
        return cred

    def waiting(self, token: str) -> bool:
        """True once the page has registered an authenticator for `token`."""
        return self._enrolment(token).registered is not None

    async def wait_registered(self, timeout: float) -> None:
        """Wake when any page registers (or after `timeout`)."""
        event = self._registered
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout)

    def remove(self, ident: str) -> Signer:
        """Remove one signer (by id or name); the caller has proven the passphrase,
        as for `begin`."""
        if self.vault.locked:
            raise SignersError("the vault is locked; run `bastion unlock` first")
        cred = self._signers.get(ident) or next(
            (c for c in self._signers.values() if c.name == ident), None
        )
        if cred is None:
            raise SignersError(f"no enrolled signer {ident!r} (see `bastion operator list`)")
        del self._signers[cred.id]
        self._counts.pop(cred.id, None)
        self._save()
        self.recorder.record(EventType.OPERATOR_REMOVED, {"id": cred.id, "name": cred.name})
        log.info("signer %r removed", cred.name)
        return cred

    # -- signing ---------------------------------------------------------------------

    def verify(self, proof: Proof, challenge: bytes, user_verification: bool) -> Checked | Flaw:
        """`presence.check` against the enrolled key; a signature that holds moves the
        signer's counter (sealed at once, so a restart does not forget it)."""
        cred = self._signers.get(proof.signer_id)
        got = check(
            proof,
            cred,
            challenge=challenge,
            origin=self.origin,
            rp_id=self.rp_id,
            user_verification=user_verification,
            last_count=self._counts.get(proof.signer_id, 0),
        )
        if isinstance(got, Checked):
            self._counts[got.signer_id] = got.sign_count
            try:
                self._save()
            except VaultError as exc:  # the signature holds; the counter is kept in memory
                log.error("could not seal the sign counter of %s: %s", got.signer_id, exc)
        return got
