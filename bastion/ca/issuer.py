"""Who signs a certificate account's per-command certificates.

Two backends behind one small protocol: the vault's own CA (`bastion ca
init`), and a team's OpenBao / HashiCorp Vault SSH secrets engine
(`ca/openbao.py`). Either way the certificate says what `core/certs.py`
decided; a backend only chooses the serial and signs. A backend that cannot
sign raises a `Refusal` (`core/refusals.py` words it) -- and then nothing is
sent, because without a certificate there is no login.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Protocol

from bastion.ca import vault_ca
from bastion.ca.vault_ca import Issued
from bastion.core.certs import CertSpec
from bastion.core.refusals import Fact, refusal
from bastion.vault import Vault, VaultError, VaultLocked

SERIAL_BLOCK = 256  # serials reserved per vault write; a restart skips the unused rest


class Issuer(Protocol):
    name: str

    def problem(self) -> str | None:
        """Why no certificate can be signed at all (no CA), or None. Cheap: the gate
        asks it for every request to a certificate account."""
        ...

    async def issue(self, spec: CertSpec) -> Issued:
        """Sign `spec` for a fresh key; raises `Refusal`."""
        ...


class VaultCA:
    """The vault's newest user CA signs; serials come from the vault file in blocks."""

    name = "vault"

    def __init__(self, vault: Vault) -> None:
        self.vault = vault
        self._serials: list[int] = []
        self._lock = threading.Lock()
        self._seen: tuple[int, int, int] | None = None  # the vault file's (ino, mtime, size)
        self._label: str | None = None

    def _signing_label(self) -> str | None:
        """The signing CA's label, re-read only when the vault file changed."""
        try:
            st = os.stat(self.vault.path)
        except OSError:
            return None
        seen = (st.st_ino, st.st_mtime_ns, st.st_size)
        if seen != self._seen:
            try:
                self._label = vault_ca.signing_label(self.vault)
            except VaultError:
                self._label = None
            self._seen = seen
        return self._label

    def problem(self) -> str | None:
        if self._signing_label() is None:
            return (
                "the vault holds no user CA to sign its certificates: an operator must run "
                "`bastion ca init` and install `bastion ca public` on the target"
            )
        return None

    def _serial(self) -> int:
        with self._lock:
            if not self._serials:
                self._serials = list(reversed(self.vault.reserve_serials(SERIAL_BLOCK)))
            return self._serials.pop()

    def _sign(self, spec: CertSpec) -> Issued:
        label = self._signing_label()
        if label is None:
            raise refusal(Fact.NO_CA, problem=self.problem() or "no CA")
        try:
            return vault_ca.sign(self.vault.private_key(label), spec, self._serial())
        except VaultLocked as exc:
            raise refusal(Fact.CA_LOCKED) from exc
        except VaultError as exc:
            raise refusal(Fact.CA_FAILED, why=exc) from exc

    async def issue(self, spec: CertSpec) -> Issued:
        if self._serials:  # no file write this time: sign on the loop (~0.1 ms)
            return self._sign(spec)
        return await asyncio.to_thread(self._sign, spec)
