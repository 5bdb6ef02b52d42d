"""What a per-command SSH certificate says, decided from the request alone.

A certificate account's approval is enforced twice: by the gate, and by the
target's stock sshd, which runs only the certificate's `force-command`, only
for a client connecting from one of its `source-address` networks, only
inside its validity window, and grants nothing its extensions do not name --
and this certificate names none (no PTY, no forwarding, no agent, no X11, no
user rc). Everything that goes into one is fixed here, purely, so the vault's
CA and an OpenBao CA sign the same thing and a test can read it field by field.
"""

from __future__ import annotations

import enum
import ipaddress
import math
from dataclasses import dataclass

from bastion.core.errors import BastionError

DEFAULT_TTL = 60  # seconds a certificate is valid after it is signed
MIN_TTL, MAX_TTL = 5, 3600
# Valid from a little before now: a target whose clock runs behind the gateway's
# would otherwise refuse a certificate that is "not yet valid".
BACKDATE = 30
CA_LABEL_PREFIX = "bastion-ca-"  # vault labels of the user CAs: bastion-ca-1, bastion-ca-2, ...


class Auth(enum.Enum):
    """How an account logs in to its target."""

    KEY = "key"  # the vault key named by `credential`, pooled connections
    CERTIFICATE = "certificate"  # a fresh key and a certificate per command, no pooling


class CertError(BastionError, ValueError):
    """A certificate cannot say exactly what was approved; the message says why."""


@dataclass(frozen=True)
class CertSpec:
    """The certificate for one request, before any key or CA is involved."""

    principal: str  # the account's user: sshd matches it against AuthorizedPrincipalsFile
    key_id: str  # the request id: sshd logs it at login, `bastion request` reads it
    force_command: str  # the exact approved command; sshd runs this whatever is asked
    source_address: tuple[str, ...]  # CIDR networks the target must see the gateway come from
    valid_after: int  # unix seconds
    valid_before: int  # unix seconds

    @property
    def critical_options(self) -> dict[str, str]:
        """The two critical options, in OpenSSH's spelling (what OpenBao's API takes)."""
        return {
            "force-command": self.force_command,
            "source-address": ",".join(self.source_address),
        }


def source_networks(value: object) -> tuple[str, ...]:
    """A `source_address` list as sshd reads it: each entry an address or CIDR network,
    normalised (`10.0.0.7` -> `10.0.0.7/32`). Raises CertError naming the bad entry."""
    if not isinstance(value, list) or not value:
        raise CertError("must be a non-empty list of addresses or CIDR networks")
    nets = []
    for item in value:
        if not isinstance(item, str):
            raise CertError(f"{item!r} is not a string")
        try:
            nets.append(str(ipaddress.ip_network(item, strict=True)))
        except (TypeError, ValueError) as exc:
            raise CertError(f"{item!r} is not an address or CIDR network ({exc})") from None
    return tuple(dict.fromkeys(nets))


def account_auth(raw: dict[str, object]) -> tuple[Auth, tuple[str, ...], int]:
    """A policy account's `auth`, `source_address` and `cert_ttl`. A certificate account
    must say where the gateway connects from, because sshd enforces it."""
    value = raw.get("auth", Auth.KEY.value)
    if value not in {m.value for m in Auth}:
        raise CertError(f'field "auth" must be "key" or "certificate", got {value!r}')
    auth = Auth(value)
    if auth is Auth.KEY:
        for key in ("source_address", "cert_ttl"):
            if key in raw:
                raise CertError(f'field "{key}" is only for accounts with auth = "certificate"')
        return auth, (), DEFAULT_TTL
    if "source_address" not in raw:
        raise CertError(
            'auth = "certificate" needs field "source_address": the addresses the target '
            'sees the gateway connect from, e.g. source_address = ["10.0.0.5"]'
        )
    try:
        nets = source_networks(raw["source_address"])
    except CertError as exc:
        raise CertError(f'field "source_address" {exc}') from None
    try:
        ttl = check_ttl(raw.get("cert_ttl", DEFAULT_TTL))
    except CertError as exc:
        raise CertError(f'field "cert_ttl" {exc}') from None
    return auth, nets, ttl


def check_ttl(value: object) -> int:
    if type(value) is not int or not MIN_TTL <= value <= MAX_TTL:
        raise CertError(f"must be a whole number of seconds {MIN_TTL}..{MAX_TTL}")
    return value


def cert_spec(
    request_id: str,
    principal: str,
    command: bytes,
    source_address: tuple[str, ...],
    ttl: int,
    now: float,
) -> CertSpec:
    """The certificate that lets exactly `command` run once the target checks it.

    The gate has already refused commands that are not UTF-8 or hold a NUL;
    this refuses them again, because a certificate string that differs from
    the approved bytes would make sshd run something nobody approved."""
    try:
        text = command.decode("utf-8")
    except UnicodeDecodeError:
        raise CertError("the command is not valid UTF-8") from None
    if not text.strip() or "\0" in text:
        raise CertError("the command is empty or holds a NUL byte")
    if not source_address:
        raise CertError("the account has no source_address")
    start = math.floor(now)
    return CertSpec(
        principal=principal,
        key_id=request_id,
        force_command=text,
        source_address=source_address,
        valid_after=start - BACKDATE,
        valid_before=start + check_ttl(ttl),
    )
