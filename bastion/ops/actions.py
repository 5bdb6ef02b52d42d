"""Operator actions that work with or without a running gateway: one implementation each.

Key operations, the journal identity pin and the audit views are the same
whether the gateway answers them over the operator socket (`gateway/control.py`,
on its own open vault) or the CLI runs them on the files because no gateway
is running (`cli/keys.py`, `cli/ca.py`, `cli/audit.py`). Both call `key_op` and
`audit_view` here, so the two paths cannot drift apart.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import load_ssh_public_key

from bastion import journal
from bastion.ca import vault_ca
from bastion.core import events
from bastion.core.errors import BastionError
from bastion.vault import RESERVED_PREFIX, Vault, VaultError, load_private_key_file


class OpsError(BastionError):
    """An operator action that cannot be done as asked; the message says why."""


def user_label(label: object) -> str:
    """A key label an operator may manage: bastion's own are not theirs."""
    text = str(label or "")
    if text.startswith(RESERVED_PREFIX):
        raise OpsError(
            f"labels starting with {RESERVED_PREFIX!r} are bastion's own; choose another"
        )
    return text


def _list(vault: Vault, args: dict[str, Any]) -> Any:
    return [asdict(k) for k in vault.list_keys()]


def _public(vault: Vault, args: dict[str, Any]) -> Any:
    return asdict(vault.key_info(str(args.get("label", ""))))


def _generate(vault: Vault, args: dict[str, Any]) -> Any:
    label = user_label(args.get("label"))
    return asdict(vault.generate(label, str(args.get("algorithm") or "ssh-ed25519")))


def _import(vault: Vault, args: dict[str, Any]) -> Any:
    label = user_label(args.get("label"))
    key = load_private_key_file(str(args.get("private_key", "")).encode(), None)
    return asdict(vault.add(label, key))


def _remove(vault: Vault, args: dict[str, Any]) -> Any:
    label = user_label(args.get("label"))
    vault.remove(label)
    return {"removed": label}


def _text(args: dict[str, Any], name: str) -> str:
    """An argument that must be a string, if present ("" when absent); the gateway
    checks only the key operations' arguments before calling here."""
    value = args.get(name)
    if value is not None and not isinstance(value, str):
        raise OpsError(f'"{name}" must be a string')
    return value or ""


def _ca_algorithm(args: dict[str, Any]) -> str:
    """`ed25519`, `ecdsa`, `rsa` (what `ca init --type` offers) or the SSH name."""
    name = _text(args, "algorithm") or "ssh-ed25519"
    return vault_ca.CA_TYPES.get(name, name)


def _ca_init(vault: Vault, args: dict[str, Any]) -> Any:
    return asdict(vault_ca.init(vault, _ca_algorithm(args)))


def _ca_public(vault: Vault, args: dict[str, Any]) -> Any:
    return vault_ca.public(vault.list_keys())


def _ca_rotate(vault: Vault, args: dict[str, Any]) -> Any:
    new = vault_ca.rotate(vault, _ca_algorithm(args))
    older = [k.label for k in vault_ca.authorities(vault.list_keys()) if k.label != new.label]
    return {**asdict(new), "older": older}


def _ca_retire(vault: Vault, args: dict[str, Any]) -> Any:
    which = _text(args, "which")
    if not which:
        raise OpsError("name the CA to retire by its label or fingerprint (`bastion ca public`)")
    return asdict(vault_ca.retire(vault, which))


def openbao_login(args: dict[str, Any]) -> dict[str, str]:
    """The OpenBao login to seal: a token, or an AppRole's role id and secret id.
    Refusals never quote a value: the secret must not reach a message or a log."""
    token, role, secret = (_text(args, k) for k in ("token", "role_id", "secret_id"))
    for name, value in (("token", token), ("role_id", role), ("secret_id", secret)):
        if value and (len(value) > 4096 or not value.isprintable() or " " in value):
            raise OpsError(
                f"the {name} must be one word of printable characters (at most 4096); "
                "nothing was stored"
            )
    if token and not (role or secret):
        return {"token": token}
    if role and secret and not token:
        return {"role_id": role, "secret_id": secret}
    raise OpsError(
        "give either an OpenBao token, or an AppRole role id (--approle) and its secret id; "
        "nothing was stored"
    )


def _ca_openbao_login(vault: Vault, args: dict[str, Any]) -> Any:
    login = openbao_login(args)
    vault.put_secret(vault_ca.OPENBAO_SECRET, json.dumps(login).encode())
    return {"sealed": vault_ca.OPENBAO_SECRET, "login": "token" if "token" in login else "approle"}


# name -> (implementation, needs the vault unlocked)
KEY_OPS: dict[str, tuple[Callable[[Vault, dict[str, Any]], Any], bool]] = {
    "key_list": (_list, False),
    "key_public": (_public, False),
    "key_generate": (_generate, True),
    "key_import": (_import, True),
    "key_remove": (_remove, True),
    "ca_init": (_ca_init, True),
    "ca_public": (_ca_public, False),
    "ca_rotate": (_ca_rotate, True),
    "ca_retire": (_ca_retire, True),
    "ca_openbao_login": (_ca_openbao_login, True),
}


def needs_unlock(name: str) -> bool:
    return KEY_OPS[name][1]


def check_key_args(name: str, args: dict[str, Any]) -> None:
    """Refuse what would be refused anyway, before anyone types a passphrase."""
    if name not in KEY_OPS:
        raise OpsError(f"unknown key operation {name!r}")
    if name.startswith("key_") and needs_unlock(name):
        user_label(args.get("label"))
    if name == "ca_openbao_login":
        openbao_login(args)


def key_op(vault: Vault, name: str, args: dict[str, Any]) -> Any:
    """Run one key operation on `vault` (unlocked already, where it must be)."""
    check_key_args(name, args)
    return KEY_OPS[name][0](vault, args)


@contextlib.contextmanager
def unlocked(vault: Vault, passphrase: bytes) -> Iterator[Vault]:
    """The offline path: unlock for one operation, lock again whatever happens."""
    vault.unlock(passphrase)
    try:
        yield vault
    finally:
        vault.lock()


def identity_pin(vault: Vault) -> bytes | None:
    """The journal identity's public key as the vault records it (readable
    without the passphrase), so a swapped identity.json is caught."""
    try:
        line = vault.key_info(journal.IDENTITY_LABEL).public_key
    except VaultError:
        return None
    return load_ssh_public_key(line.encode()).public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    )


VIEWS = {"activity": events.activity, "sessions": events.sessions}


def audit_view(name: str, directory: Path, identity: Ed25519PrivateKey) -> list[dict[str, Any]]:
    """One of the journal's views, read with the journal identity's private key."""
    view = VIEWS.get(name)
    if view is None:
        raise OpsError(f"unknown audit view {name!r} (known: {', '.join(VIEWS)})")
    return view(journal.decrypt(journal.records(directory), identity))
