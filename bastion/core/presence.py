"""Presence: approvals signed by an enrolled authenticator, over the exact card.

An account with `presence = "required"` (`policy.Presence`) is approved only by
WebAuthn assertions: each one a signature, by a signer the operator enrolled
with the vault passphrase, over a challenge that commits to the card's digest
(`card_digest`: target, account, binding, argv, file, card id, gateway boot,
vault epoch) and a fresh nonce (`approval_challenge`). A process of the
operator's uid can ask, read and deny; it cannot sign, because the private key
is in the authenticator and the authenticator signs only with a person present.

`check` is the one check of an assertion, for the gateway (before it counts a
signature) and for `audit verify` (offline, from the journal's records) alike:
each flaw it can find is named (`Flaw`), so an operator reading `audit verify`
learns which of the signature, challenge, origin, rpId hash, presence flag,
verification flag or sign counter did not hold. The WebAuthn formats
(authenticator data, client data, COSE keys, attestation statements) are the
`webauthn` library's to read: no CBOR or COSE is parsed here by hand. The
library computes and does no I/O, so it belongs with the core's other pure
parts.
"""

from __future__ import annotations

import base64
import enum
import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from webauthn import verify_authentication_response, verify_registration_response
from webauthn.helpers import parse_authenticator_data, parse_client_data_json
from webauthn.helpers.exceptions import (
    InvalidAuthenticationResponse,
    InvalidRegistrationResponse,
)
from webauthn.helpers.structs import ClientDataType

from bastion.core.cards import Card
from bastion.core.errors import BastionError
from bastion.core.events import Entry, EventType, event_type
from bastion.core.policy import Presence

NONCE_BYTES = 32
MAX_NAME = 64


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def unb64url(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _sha256_json(doc: object) -> bytes:
    blob = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(blob.encode()).digest()


def card_digest(card: Card) -> str:
    """What a presence signature is over: every field of the card a yes is bound to.
    Hex sha256 of canonical JSON, kept in the journal beside the signature."""
    b = card.binding
    return _sha256_json(
        {
            "v": 1,
            "kind": "bastion.card",
            "id": card.id,
            "card_kind": card.kind.value,
            "request_id": card.request_id,
            "host": card.host,
            "binding": {
                "address": b.address,
                "port": b.port,
                "host_key_fingerprint": b.host_key_fingerprint,
                "user": b.user,
                "credential": b.credential,
                "what": b.what,
                "stdin": b.stdin,
                "terminal": b.terminal,
            },
            "argv": list(card.argv) if card.argv is not None else None,
            "file": card.file.as_json() if card.file is not None else None,
            "subject": [card.subject.pid, card.subject.start_time, card.subject.exe],
            "session_id": card.session_id,
            "entry_digest": card.entry_digest,
            "boot_id": card.boot_id,
            "vault_epoch": card.vault_epoch,
        }
    ).hex()


def grant_doc(pattern: str, uses: int | None, minutes: int | None) -> dict[str, object]:
    """A bounded grant asked with a yes, as the challenge commits to it: a grant is
    its own decision, so a signature for a plain yes makes none."""
    return {"pattern": pattern, "uses": uses, "minutes": minutes}


def approval_challenge(digest: str, nonce: bytes, grant: dict[str, object] | None) -> bytes:
    """The challenge an authenticator signs to approve one card: its digest, the grant
    asked with the yes (None: none), and a nonce the gateway made for this one ask."""
    return _sha256_json(
        {
            "v": 1,
            "kind": "bastion.presence-approval",
            "card": digest,
            "grant": grant,
            "nonce": b64url(nonce),
        }
    )


def login_challenge(nonce: bytes) -> bytes:
    """The challenge of a console login: never one an approval could be."""
    return _sha256_json({"v": 1, "kind": "bastion.console-login", "nonce": b64url(nonce)})


class PresenceError(BastionError, ValueError):
    """A browser's answer that is not the shape WebAuthn gives, or a name not allowed."""


@dataclass(frozen=True)
class Signer:
    """An enrolled WebAuthn credential -- a key pair in a passkey, a security key or a
    phone -- that signs presence cards: what the gateway checks signatures with, and
    what the journal records at enrolment (all public). Not the policy's `credential`,
    which names an SSH key in the vault."""

    id: str  # its WebAuthn credential id, base64url
    name: str  # the operator's name for it, shown on cards it signs
    public_key: str  # COSE_Key, base64url
    aaguid: str  # the authenticator model (zeros: not told)
    fmt: str  # the attestation statement format ("none", "packed", ...)
    rp_id: str
    origin: str  # the console origin it was enrolled at
    enrolled_at: float

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "public_key": self.public_key,
            "aaguid": self.aaguid,
            "fmt": self.fmt,
            "rp_id": self.rp_id,
            "origin": self.origin,
            "enrolled_at": self.enrolled_at,
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Signer:
        try:
            return cls(
                id=str(doc["id"]),
                name=str(doc["name"]),
                public_key=str(doc["public_key"]),
                aaguid=str(doc["aaguid"]),
                fmt=str(doc["fmt"]),
                rp_id=str(doc["rp_id"]),
                origin=str(doc["origin"]),
                enrolled_at=float(doc["enrolled_at"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise PresenceError(f"not an enrolled signer: {exc}") from None


def check_name(name: str) -> str:
    """A signer's name: shown on cards, so printable, short, one line."""
    if not name or len(name) > MAX_NAME or not name.isprintable() or name != name.strip():
        raise PresenceError(
            f"a signer's name is 1 to {MAX_NAME} printable characters, "
            "without leading or trailing spaces"
        )
    return name


def enrolled_from(
    registration: dict[str, Any],
    *,
    challenge: bytes,
    rp_id: str,
    origin: str,
    name: str,
    now: float,
) -> tuple[Signer, int]:
    """The credential a browser's `navigator.credentials.create()` answer registers (with
    presence required), and its sign counter at enrolment; PresenceError (the library's
    words) if it does not hold."""
    try:
        verified = verify_registration_response(
            credential=registration,
            expected_challenge=challenge,
            expected_rp_id=rp_id,
            expected_origin=origin,
            require_user_presence=True,
        )
    except (InvalidRegistrationResponse, ValueError, KeyError, TypeError) as exc:
        raise PresenceError(f"the authenticator's registration does not hold: {exc}") from None
    return Signer(
        id=b64url(verified.credential_id),
        name=check_name(name),
        public_key=b64url(verified.credential_public_key),
        aaguid=verified.aaguid or "00000000-0000-0000-0000-000000000000",
        fmt=str(getattr(verified.fmt, "value", verified.fmt)),
        rp_id=rp_id,
        origin=origin,
        enrolled_at=now,
    ), verified.sign_count


@dataclass(frozen=True)
class Proof:
    """One assertion as the browser gave it (`PublicKeyCredential.toJSON()`): what the
    journal keeps, so `audit verify` can check it again with no gateway."""

    signer_id: str  # base64url
    authenticator_data: str  # base64url
    client_data_json: str  # base64url
    signature: str  # base64url
    user_handle: str | None = None

    @classmethod
    def from_browser(cls, doc: object) -> Proof:
        """The assertion JSON a page posts; PresenceError if it is not that shape."""
        if not isinstance(doc, dict) or not isinstance(doc.get("response"), dict):
            raise PresenceError("an assertion is the JSON of a PublicKeyCredential")
        response = doc["response"]
        fields = [doc.get("id"), *(response.get(k) for k in _RESPONSE_KEYS)]
        if not all(isinstance(f, str) and f for f in fields):
            raise PresenceError(
                "an assertion needs id, authenticatorData, clientDataJSON and signature"
            )
        handle = response.get("userHandle")
        proof = cls(*fields, user_handle=handle if isinstance(handle, str) else None)  # type: ignore[arg-type]
        try:
            for text in fields:
                unb64url(text)  # type: ignore[arg-type]
        except ValueError:
            raise PresenceError("an assertion's fields are base64url") from None
        return proof

    def as_json(self) -> dict[str, Any]:
        return {
            "signer_id": self.signer_id,
            "authenticator_data": self.authenticator_data,
            "client_data_json": self.client_data_json,
            "signature": self.signature,
            "user_handle": self.user_handle,
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Proof:
        try:
            return cls(
                signer_id=str(doc["signer_id"]),
                authenticator_data=str(doc["authenticator_data"]),
                client_data_json=str(doc["client_data_json"]),
                signature=str(doc["signature"]),
                user_handle=doc.get("user_handle"),
            )
        except (KeyError, TypeError) as exc:
            raise PresenceError(f"not a presence proof: {exc}") from None

    def _library_json(self) -> dict[str, Any]:
        return {
            "id": self.signer_id,
            "rawId": self.signer_id,
            "type": "public-key",
            "response": {
                "authenticatorData": self.authenticator_data,
                "clientDataJSON": self.client_data_json,
                "signature": self.signature,
                "userHandle": self.user_handle,
            },
        }


_RESPONSE_KEYS = ("authenticatorData", "clientDataJSON", "signature")


class Flaw(enum.Enum):
    """Why an assertion does not hold, one name per check."""

    MALFORMED = "malformed"
    SIGNER = "signer"  # no enrolled signer has its id (never enrolled, or removed)
    CHALLENGE = "challenge"  # signed for another card, another ask, or another purpose
    ORIGIN = "origin"  # made on a page of another origin than the console's
    RP_ID = "rp_id"  # the authenticator data's rpId hash is not the console's
    PRESENCE = "presence"  # the user-presence flag is not set
    VERIFICATION = "verification"  # the account asks user verification; the flag is not set
    COUNTER = "counter"  # the sign counter did not rise: a cloned authenticator
    SIGNATURE = "signature"  # the signature does not verify with the enrolled key

    @property
    def words(self) -> str:
        return _FLAW_WORDS[self]


_FLAW_WORDS = {
    Flaw.MALFORMED: "the assertion is not well formed",
    Flaw.SIGNER: "its signer is not enrolled (never enrolled, or removed)",
    Flaw.CHALLENGE: "its challenge is not this card's (signed for another card or ask)",
    Flaw.ORIGIN: "it was made on a page of another origin than the console's",
    Flaw.RP_ID: "its rpId hash is not the console's",
    Flaw.PRESENCE: "the authenticator did not report the user present",
    Flaw.VERIFICATION: "the account asks user verification and the authenticator did not verify",
    Flaw.COUNTER: "its sign counter did not rise (a cloned authenticator?)",
    Flaw.SIGNATURE: "its signature does not verify with the enrolled public key",
}


@dataclass(frozen=True)
class Checked:
    """An assertion that holds: its signer, the counter it reported, and whether the
    authenticator verified its user."""

    signer_id: str
    sign_count: int
    user_verified: bool


def check(
    proof: Proof,
    signer: Signer | None,
    *,
    challenge: bytes,
    origin: str,
    rp_id: str,
    user_verification: bool,
    last_count: int,
) -> Checked | Flaw:
    """The one check of an assertion: each field is read with the library's parsers
    first, so the flaw is named; then the library's own verification runs whole (the
    signature among it), so nothing a reader skipped is skipped."""
    if signer is None or signer.id != proof.signer_id:
        return Flaw.SIGNER
    try:
        client = parse_client_data_json(unb64url(proof.client_data_json))
        auth = parse_authenticator_data(unb64url(proof.authenticator_data))
    except Exception:  # the library raises what its parsers meet: any is malformed
        return Flaw.MALFORMED
    if client.type != ClientDataType.WEBAUTHN_GET:
        return Flaw.MALFORMED
    if client.challenge != challenge:
        return Flaw.CHALLENGE
    if client.origin != origin:
        return Flaw.ORIGIN
    if auth.rp_id_hash != hashlib.sha256(rp_id.encode()).digest():
        return Flaw.RP_ID
    if not auth.flags.up:
        return Flaw.PRESENCE
    if user_verification and not auth.flags.uv:
        return Flaw.VERIFICATION
    if (auth.sign_count > 0 or last_count > 0) and auth.sign_count <= last_count:
        return Flaw.COUNTER
    try:
        verified = verify_authentication_response(
            credential=proof._library_json(),
            expected_challenge=challenge,
            expected_rp_id=rp_id,
            expected_origin=origin,
            credential_public_key=unb64url(signer.public_key),
            credential_current_sign_count=last_count,
            require_user_verification=user_verification,
        )
    except (InvalidAuthenticationResponse, ValueError, KeyError, TypeError):
        return Flaw.SIGNATURE
    return Checked(proof.signer_id, verified.new_sign_count, verified.user_verified)


@dataclass(frozen=True)
class Signature:
    """One counted presence signature on a card."""

    signer_id: str
    name: str
    at: float

    def as_json(self) -> dict[str, object]:
        return {"signer": self.signer_id, "name": self.name, "at": self.at}


def signed_enough(rule: Presence, signatures: tuple[Signature, ...]) -> bool:
    """N distinct signers have signed: the card is approved."""
    return len({s.signer_id for s in signatures}) >= rule.approvers


def second_signature(signatures: tuple[Signature, ...], signer_id: str) -> str | None:
    """Why this signer may not sign again (one signer is one approver)."""
    if any(s.signer_id == signer_id for s in signatures):
        return "this signer has already signed this card; another approver must sign"
    return None


def unsigned_answer(card: Card, approve: bool, where: str) -> str | None:
    """Why an answer that carries no signature cannot do what it asks (None: it can).
    A no needs none: anyone may stop a command. A yes to a presence card is told where
    to approve instead."""
    rule = card.presence
    if not approve or rule is None:
        return None
    who = (
        "an enrolled authenticator"
        if rule.approvers == 1
        else f"{rule.approvers} distinct enrolled authenticators"
    )
    return (
        f"card {card.id} needs a presence-signed approval by {who} (its account has "
        f'presence = "required"): approve it in the console ({where}); '
        "an answer here can only deny it"
    )


@dataclass(frozen=True)
class Finding:
    """One thing `audit verify` says of the presence records: a `problem` (an approval
    the journal claims that does not hold) or not (a signature the gateway refused)."""

    seq: int
    words: str
    problem: bool

    def as_json(self) -> dict[str, object]:
        return {"seq": self.seq, "words": self.words, "problem": self.problem}


@dataclass
class _Walk:
    signers: dict[str, Signer]
    counts: dict[str, int]
    consoles: dict[str, tuple[str, str]]  # boot -> (origin, rp_id)
    asked: dict[str, int]  # card id -> approvers, for the presence cards raised
    signed: dict[str, set[str]]  # card id -> signers whose signature held
    findings: list[Finding]


def audit(entries: Iterable[Entry]) -> list[Finding]:
    """Check every presence record of a journal again, offline, from its plaintext alone:
    each signature against the public key its enrolment recorded (signature, challenge,
    origin, rpId hash, presence and verification flags, the sign counter rising), and
    each approved presence card against the signatures it needed."""
    w = _Walk({}, {}, {}, {}, {}, [])
    for entry in entries:
        kind, meta = event_type(entry), entry.meta
        if kind is EventType.OPERATOR_ENROLLED:
            try:
                signer = Signer.from_json(meta)
            except PresenceError:
                w.findings.append(Finding(entry.seq, "an enrolment record is malformed", True))
                continue
            w.signers[signer.id], w.counts[signer.id] = signer, 0
        elif kind is EventType.OPERATOR_REMOVED:
            w.signers.pop(str(meta.get("id")), None)
        elif kind is EventType.CONSOLE_STARTED:
            w.consoles[entry.boot] = (str(meta.get("origin")), str(meta.get("rp_id")))
        elif kind is EventType.CARD_RAISED and meta.get("presence"):
            w.asked[str(meta.get("card"))] = int(meta["presence"])
        elif kind in (EventType.PRESENCE_SIGNED, EventType.CONSOLE_LOGIN):
            _signed(w, entry, kind)
        elif kind is EventType.PRESENCE_REFUSED:
            what = "a login" if meta.get("login") else f"a signature for card {meta.get('card')}"
            flaw = _flaw(meta.get("flaw"))
            w.findings.append(
                Finding(
                    entry.seq,
                    f"{what} by signer {str(meta.get('signer'))[:16]}... was refused "
                    f"by the gateway: {flaw.words if flaw else meta.get('flaw')}",
                    False,
                )
            )
        elif kind is EventType.CARD_CLOSED and str(meta.get("card")) in w.asked:
            card = str(meta.get("card"))
            need, got = w.asked.pop(card), w.signed.pop(card, set())
            if meta.get("answer") == "approved" and len(got) < need:
                w.findings.append(
                    Finding(
                        entry.seq,
                        f"card {card} is recorded approved with {len(got)} valid presence "
                        f"signature(s) of the {need} its account asks",
                        True,
                    )
                )
    return w.findings


def _flaw(value: object) -> Flaw | None:
    try:
        return Flaw(value)
    except ValueError:
        return None


def _signed(w: _Walk, entry: Entry, kind: EventType) -> None:
    meta = entry.meta
    login = kind is EventType.CONSOLE_LOGIN
    what = "the console login" if login else f"the signature on card {meta.get('card')}"
    try:
        proof = Proof.from_json(meta["proof"])
        nonce = unb64url(str(meta["nonce"]))
        if login:
            challenge = login_challenge(nonce)
        else:
            challenge = approval_challenge(str(meta["card_digest"]), nonce, meta.get("grant"))
    except (KeyError, TypeError, ValueError, PresenceError):
        w.findings.append(Finding(entry.seq, f"{what} is not a well-formed proof", True))
        return
    origin, rp_id = w.consoles.get(entry.boot, ("", ""))
    signer = w.signers.get(proof.signer_id)
    got = check(
        proof,
        signer,
        challenge=challenge,
        origin=origin,
        rp_id=rp_id,
        user_verification=bool(meta.get("user_verification")),
        last_count=w.counts.get(proof.signer_id, 0),
    )
    if isinstance(got, Flaw):
        name = f" by {signer.name!r}" if signer is not None else ""
        w.findings.append(Finding(entry.seq, f"{what}{name} does not hold: {got.words}", True))
        return
    w.counts[got.signer_id] = got.sign_count
    if not login:
        w.signed.setdefault(str(meta.get("card")), set()).add(got.signer_id)
