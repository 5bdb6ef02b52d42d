"""Operator actions that work with or without a running gateway: one implementation each.

Key operations, the journal identity pin and the audit views are the same
whether the gateway answers them over the operator socket (`gateway/control.py`,
on its own open vault) or the CLI runs them on the files because no gateway
is running (`cli/keys.py`, `cli/audit.py`). Both call `key_op` and
`audit_view` here, so the two paths cannot drift apart.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import load_ssh_public_key

from bastion import journal
from bastion.core import events
from bastion.vault import RESERVED_PREFIX, Vault, VaultError, load_private_key_file


class OpsError(Exception):
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


# name -> (implementation, needs the vault unlocked)
KEY_OPS: dict[str, tuple[Callable[[Vault, dict[str, Any]], Any], bool]] = {
    "key_list": (_list, False),
    "key_public": (_public, False),
    "key_generate": (_generate, True),
    "key_import": (_import, True),
    "key_remove": (_remove, True),
}


def needs_unlock(name: str) -> bool:
    return KEY_OPS[name][1]


def check_key_args(name: str, args: dict[str, Any]) -> None:
    """Refuse what would be refused anyway, before anyone types a passphrase."""
    if name not in KEY_OPS:
        raise OpsError(f"unknown key operation {name!r}")
    if needs_unlock(name):
        user_label(args.get("label"))


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
