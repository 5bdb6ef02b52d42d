"""The vault's user CA: its keys, their rotation, and the one signing routine.

The CA's private keys are vault records under reserved labels
(`bastion-ca-1`, `bastion-ca-2`, ...); the newest signs, every one still in
the vault is listed for the targets to trust, so a rotation is: `ca rotate`
(a new CA signs from now on), install the new public line on every target
next to the old one, `ca retire` the old one, remove it from the targets.
`sign` is the only place a certificate is made from a `CertSpec`, for the
vault CA and for a test CA alike; an OpenBao CA signs the same spec remotely.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import asyncssh

from bastion.core.certs import CA_LABEL_PREFIX, CertSpec
from bastion.vault import KeyInfo, Vault, VaultError

CA_TYPES = {"ed25519": "ssh-ed25519", "ecdsa": "ecdsa-sha2-nistp256", "rsa": "ssh-rsa"}
_CA_LABEL_RE = re.compile(re.escape(CA_LABEL_PREFIX) + r"([1-9][0-9]{0,8})")
CA_FILE = "/etc/ssh/bastion_user_ca.pub"
PRINCIPALS_DIR = "/etc/ssh/bastion_principals"
OPENBAO_SECRET = "bastion-openbao"  # the vault secret holding OpenBao's token or AppRole


@dataclass(frozen=True)
class Issued:
    """One signed certificate and the fresh key it certifies, held in memory only
    for the one connection it was made for."""

    key: asyncssh.SSHKey
    certificate: asyncssh.SSHCertificate
    serial: int
    key_id: str
    ca: str  # the signing CA's SHA256 fingerprint
    backend: str  # "vault" or "openbao"
    valid_before: int

    def journal_meta(self) -> dict[str, Any]:
        """What the journal keeps in plaintext: enough to match a target's auth log."""
        return {"serial": self.serial, "key_id": self.key_id, "ca": self.ca}


def fresh_key() -> asyncssh.SSHKey:
    """A new ed25519 key for one command: generated, certified, used once, dropped."""
    return asyncssh.generate_private_key("ssh-ed25519")


def sign(
    ca: asyncssh.SSHKey, spec: CertSpec, serial: int, user_key: asyncssh.SSHKey | None = None
) -> Issued:
    """Certify `user_key` (a fresh one if None) for exactly `spec`: its principal,
    key id, validity, force-command and source-address -- and no extension at all."""
    key = user_key or fresh_key()
    cert = ca.generate_user_certificate(
        key,
        spec.key_id,
        serial=serial,
        principals=[spec.principal],
        valid_after=spec.valid_after,
        valid_before=spec.valid_before,
        force_command=spec.force_command,
        source_address=list(spec.source_address),
        permit_x11_forwarding=False,
        permit_agent_forwarding=False,
        permit_port_forwarding=False,
        permit_pty=False,
        permit_user_rc=False,
        comment=f"bastion {spec.key_id}",
    )
    return Issued(
        key,
        cert,
        serial,
        spec.key_id,
        ca.get_fingerprint("sha256"),
        "vault",
        spec.valid_before,
    )


def _number(label: str) -> int | None:
    match = _CA_LABEL_RE.fullmatch(label)
    return int(match.group(1)) if match else None


def authorities(keys: list[KeyInfo]) -> list[KeyInfo]:
    """The CA records among a vault's keys, oldest first; the last one signs."""
    found = [(n, k) for k in keys if (n := _number(k.label)) is not None]
    return [k for _, k in sorted(found, key=lambda pair: pair[0])]


def signing_label(vault: Vault) -> str | None:
    cas = authorities(vault.list_keys())
    return cas[-1].label if cas else None


def init(vault: Vault, algorithm: str = "ssh-ed25519") -> KeyInfo:
    """The first user CA; a second one is `rotate`'s job, so a typo cannot add one."""
    if authorities(vault.list_keys()):
        raise VaultError("the vault already holds a user CA; `bastion ca rotate` adds another")
    return vault.generate(f"{CA_LABEL_PREFIX}1", algorithm)


def rotate(vault: Vault, algorithm: str = "ssh-ed25519") -> KeyInfo:
    """A new CA that signs from now on; the older ones stay trusted until retired."""
    cas = authorities(vault.list_keys())
    if not cas:
        raise VaultError("the vault holds no user CA yet; `bastion ca init` creates one")
    return vault.generate(f"{CA_LABEL_PREFIX}{_number(cas[-1].label) + 1}", algorithm)  # type: ignore[operator]


def retire(vault: Vault, which: str) -> KeyInfo:
    """Destroy an older CA (by label or fingerprint); the signing one cannot be retired."""
    cas = authorities(vault.list_keys())
    match = next((k for k in cas if which in (k.label, k.fingerprint)), None)
    if match is None:
        known = ", ".join(f"{k.label} ({k.fingerprint})" for k in cas) or "none"
        raise VaultError(f"no user CA {which!r} in the vault (CAs: {known})")
    if match is cas[-1]:
        raise VaultError(
            f"{match.label} is the CA that signs now; `bastion ca rotate` first, "
            "install the new CA on the targets, then retire this one"
        )
    vault.remove(match.label)
    return match


def public(keys: list[KeyInfo]) -> dict[str, Any]:
    """The lines a target trusts and the sshd_config that makes it enforce them."""
    cas = authorities(keys)
    if not cas:
        raise VaultError("the vault holds no user CA; `bastion ca init` creates one")
    lines = [" ".join([*k.public_key.split()[:2], k.label]) for k in cas]  # label as comment
    return {
        "authorities": [
            {"label": k.label, "fingerprint": k.fingerprint, "public_key": k.public_key}
            for k in cas
        ],
        "signing": cas[-1].label,
        "trusted_user_ca_keys": lines,
        "sshd_config": sshd_snippet(lines),
    }


def sshd_snippet(lines: list[str]) -> str:
    """Comments only around the key lines, so the whole text is a valid CA file."""
    overlap = (
        [
            "# Two or more CAs: a rotation is under way. Retire the old one in bastion",
            "# (`bastion ca retire LABEL`) once every target trusts the new one, then",
            "# remove its line here.",
        ]
        if len(lines) > 1
        else []
    )
    return "\n".join(
        [
            f"# bastion user CA: save this whole text as {CA_FILE} on each target.",
            *overlap,
            *lines,
            "#",
            "# Then in /etc/ssh/sshd_config (reload sshd once; it re-reads the CA file per login):",
            f"#   TrustedUserCAKeys {CA_FILE}",
            f"#   AuthorizedPrincipalsFile {PRINCIPALS_DIR}/%u",
            "# and for each account bastion logs in as with certificates, a file",
            f"# {PRINCIPALS_DIR}/USER holding the one line USER (the account name:",
            "# bastion certifies exactly that principal).",
            "# Do not set ForceCommand for these users in sshd_config: it would override",
            "# the certificate's force-command, and sshd would run it instead of the",
            "# approved command. sshd logs each login's key ID (the request id) and",
            "# serial: `bastion request ID` says what that request was.",
        ]
    )
