"""`bastion key`: the vault's keys, through the running gateway or, with none, on the file.

Either way the work is done by `ops.key_op`, so the two paths behave alike.
`ops` and the vault (asyncssh) are imported when a command runs, not when
the CLI starts.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from bastion.cli.common import (
    LineStdin,
    ask_secret,
    emit,
    fail,
    home_of,
    passphrase_option,
    read_passphrase,
    read_secret_line,
)
from bastion.cli.completion import complete_key_label, complete_own_key_label
from bastion.ops import opsock


@click.group()
def key() -> None:
    """Manage the keys in the vault (they never leave it)."""


def vault_call(ctx: click.Context, name: str, passphrase_stdin: bool, **args: Any) -> Any:
    """Through the running gateway if there is one, else on the vault file."""
    from bastion import ops
    from bastion.vault import Vault, VaultError

    home = home_of(ctx)
    try:
        ops.check_key_args(name, args)
        try:
            return opsock.call(home.operator_socket, name, **args)
        except opsock.GatewayNotRunning:
            pass
        vault = Vault.open(home.vault)
        if not ops.needs_unlock(name):
            return ops.key_op(vault, name, args)
        with ops.unlocked(vault, read_passphrase(passphrase_stdin, False, home)):
            return ops.key_op(vault, name, args)
    except (opsock.OperatorError, ops.OpsError, VaultError) as exc:
        fail(str(exc))


def _key_line(k: dict[str, Any]) -> str:
    return f"{k['label']}\t{k['algorithm']}\t{k['fingerprint']}"


@key.command("generate")
@click.argument("label")
@click.option(
    "--type",
    "algorithm",
    default="ssh-ed25519",
    show_default=True,
    type=click.Choice(["ssh-ed25519", "ecdsa-sha2-nistp256", "ssh-rsa"]),
)
@passphrase_option("Vault passphrase (no gateway running).")
@click.pass_context
def key_generate(ctx: click.Context, label: str, algorithm: str, passphrase_stdin: bool) -> None:
    """Create a key in the vault and print its public half."""
    k = vault_call(ctx, "key_generate", passphrase_stdin, label=label, algorithm=algorithm)
    click.echo(k["public_key"])


@key.command("import")
@click.argument("label")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@passphrase_option("Vault passphrase on stdin's first line (no gateway running).")
@click.option(
    "--key-passphrase-stdin",
    is_flag=True,
    help="The key file's passphrase on stdin (after the vault passphrase, if both).",
)
@click.pass_context
def key_import(
    ctx: click.Context, label: str, file: Path, passphrase_stdin: bool, key_passphrase_stdin: bool
) -> None:
    """Import an OpenSSH or PEM private key (ed25519, ecdsa, rsa)."""
    from bastion.vault import KeyFilePassphraseNeeded, VaultError, load_private_key_file

    data = file.read_bytes()
    vault_pass = read_secret_line() if passphrase_stdin and key_passphrase_stdin else None
    try:
        try:
            private = load_private_key_file(data, None)
        except KeyFilePassphraseNeeded:
            if key_passphrase_stdin:
                secret = read_secret_line()
            elif sys.stdin.isatty():
                secret = ask_secret(f"Passphrase for {file}: ")
            else:
                fail(f"{file} is encrypted; give its passphrase with --key-passphrase-stdin")
            private = load_private_key_file(data, secret)
    except VaultError as exc:
        fail(f"{file}: {exc}; nothing was imported")
    text = private.export_private_key("openssh").decode()
    if vault_pass is not None:  # put the vault passphrase back for vault_call to read
        sys.stdin = LineStdin(vault_pass)  # type: ignore[assignment]
    k = vault_call(ctx, "key_import", passphrase_stdin, label=label, private_key=text)
    click.echo(f"imported {_key_line(k)}")


@key.command("list")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def key_list(ctx: click.Context, as_json: bool) -> None:
    """Labels, algorithms and fingerprints (never key material)."""
    keys = vault_call(ctx, "key_list", False)
    emit(keys, as_json, lambda ks: "\n".join(_key_line(k) for k in ks) or "(no keys)")


@key.command("public")
@click.argument("label", shell_complete=complete_key_label)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def key_public(ctx: click.Context, label: str, as_json: bool) -> None:
    """Print a key's public half, to install in a target's authorized_keys."""
    k = vault_call(ctx, "key_public", False, label=label)
    emit(k, as_json, lambda k: k["public_key"])


@key.command("remove")
@click.argument("label", shell_complete=complete_own_key_label)
@passphrase_option("Vault passphrase (no gateway running).")
@click.pass_context
def key_remove(ctx: click.Context, label: str, passphrase_stdin: bool) -> None:
    """Delete a key from the vault."""
    vault_call(ctx, "key_remove", passphrase_stdin, label=label)
    click.echo(f"removed {label}")
