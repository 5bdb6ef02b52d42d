"""A software WebAuthn authenticator, for the unit tests only: it makes registrations
and assertions as a browser hands them over (`PublicKeyCredential.toJSON()`), with
every field a test may want wrong made wrong on request. The browser tests use
Chromium's own virtual authenticator instead (tests/browser/).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass, field
from typing import Any

import cbor2
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

from bastion.core.presence import b64url

UP, UV, AT = 0x01, 0x04, 0x40


@dataclass
class SoftAuthenticator:
    rp_id: str = "localhost"
    key: ec.EllipticCurvePrivateKey = field(
        default_factory=lambda: ec.generate_private_key(ec.SECP256R1())
    )
    signer_id: bytes = field(default_factory=lambda: os.urandom(16))
    count: int = 0
    aaguid: bytes = bytes(16)

    @property
    def id(self) -> str:
        return b64url(self.signer_id)

    def cose(self) -> bytes:
        n = self.key.public_key().public_numbers()
        return cbor2.dumps(
            {1: 2, 3: -7, -1: 1, -2: n.x.to_bytes(32, "big"), -3: n.y.to_bytes(32, "big")}
        )

    def _auth_data(self, rp_id: str, flags: int, count: int, attested: bool) -> bytes:
        data = hashlib.sha256(rp_id.encode()).digest() + bytes([flags]) + struct.pack(">I", count)
        if attested:
            cid = self.signer_id
            data += self.aaguid + struct.pack(">H", len(cid)) + cid + self.cose()
        return data

    def register(self, options: dict[str, Any], origin: str) -> dict[str, Any]:
        client = json.dumps(
            {"type": "webauthn.create", "challenge": options["challenge"], "origin": origin}
        ).encode()
        auth = self._auth_data(self.rp_id, UP | AT, self.count, attested=True)
        attestation = cbor2.dumps({"fmt": "none", "attStmt": {}, "authData": auth})
        return {
            "id": self.id,
            "rawId": self.id,
            "type": "public-key",
            "response": {
                "clientDataJSON": b64url(client),
                "attestationObject": b64url(attestation),
                "transports": ["internal"],
            },
            "clientExtensionResults": {},
        }

    def sign(
        self,
        challenge: bytes,
        origin: str,
        *,
        rp_id: str | None = None,
        up: bool = True,
        uv: bool = False,
        count: int | None = None,
        kind: str = "webauthn.get",
    ) -> dict[str, Any]:
        """An assertion; each keyword makes one field what a test needs (a cloned key's
        counter, another origin's page, no presence...)."""
        if count is None:
            self.count += 1
            count = self.count
        client = json.dumps(
            {"type": kind, "challenge": b64url(challenge), "origin": origin, "crossOrigin": False}
        ).encode()
        flags = (UP if up else 0) | (UV if uv else 0)
        auth = self._auth_data(rp_id or self.rp_id, flags, count, attested=False)
        signature = self.key.sign(auth + hashlib.sha256(client).digest(), ec.ECDSA(hashes.SHA256()))
        return {
            "id": self.id,
            "rawId": self.id,
            "type": "public-key",
            "response": {
                "authenticatorData": b64url(auth),
                "clientDataJSON": b64url(client),
                "signature": b64url(signature),
                "userHandle": None,
            },
            "clientExtensionResults": {},
        }
