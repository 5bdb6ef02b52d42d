"""`bastion ca`: the user CA whose certificates make a target enforce each approval.

An account with `auth = "certificate"` logs in with a fresh key and a
certificate made for one approved command; the target's stock sshd trusts the
CA (`TrustedUserCAKeys`) and runs nothing but that command. These commands
create, show, rotate and retire that CA, and seal the login of a team's
OpenBao when it signs instead. Like `bastion key`, each goes through the
running gateway if there is one, else works on the vault file (with the
passphrase), through the same `ops` functions either way. The CA logic is
`bastion.ca`'s; this module parses, calls and prints.

Secrets typed here (the vault passphrase, an OpenBao token or AppRole secret
id) are read from stdin or a terminal prompt -- never from argv, where any
process could read them -- and are never printed.
"""

from __future__ import annotations

import sys
from typing import Any

import click

from bastion.cli.common import (
    LineStdin,
    ask_secret,
    emit,
    fail,
    passphrase_option,
    read_secret_line,
)
from bastion.cli.completion import complete_retirable_ca
from bastion.cli.keys import vault_call

CA_CHOICES = ("ed25519", "ecdsa", "rsa")
PASSPHRASE_HELP = "Vault passphrase on stdin's first line (no gateway running)."


@click.group()
def ca() -> None:
    """The user CA that certifies each approved command, so the target enforces it.

    For accounts with auth = "certificate": `ca init` once, then install the
    output of `ca public` on each target. To change the CA: `ca rotate`,
    install `ca public` again, then `ca retire` the old one."""


def _type_option(command: Any) -> Any:
    return click.option(
        "--type",
        "algorithm",
        default="ed25519",
        show_default=True,
        type=click.Choice(CA_CHOICES),
        help="The CA key's type (ed25519 unless a target's sshd is too old for it).",
    )(command)


def _passphrase_option(command: Any) -> Any:
    return passphrase_option(PASSPHRASE_HELP)(command)


@ca.command("init")
@_type_option
@_passphrase_option
@click.pass_context
def ca_init(ctx: click.Context, algorithm: str, passphrase_stdin: bool) -> None:
    """Create the vault's user CA.

    Once: `ca rotate` adds the next one. Its private key stays in the vault like any
    other; its label (bastion-ca-1) is bastion's own, so `key remove` cannot destroy
    it by mistake. Prints the public line, itself a valid TrustedUserCAKeys file."""
    k = vault_call(ctx, "ca_init", passphrase_stdin, algorithm=algorithm)
    click.echo(k["public_key"])
    click.echo(
        f"# created {k['label']} ({k['fingerprint']}); `bastion ca public` prints the file "
        "and the sshd_config lines each target needs"
    )


@ca.command("public")
@click.option("--json", "as_json", is_flag=True, help="Every CA, the signing one, the snippet.")
@click.pass_context
def ca_public(ctx: click.Context, as_json: bool) -> None:
    """Print what each target must trust.

    Every CA in the vault, the newest (the one that signs) last. The whole output is
    a valid TrustedUserCAKeys file -- the key lines, and as comments the sshd_config
    lines that make sshd enforce the certificates. Save it on each target; after a
    rotation it lists the old CA and the new one, so targets keep working while they
    are updated. Needs no passphrase."""
    emit(vault_call(ctx, "ca_public", False), as_json, lambda doc: doc["sshd_config"])


@ca.command("rotate")
@_type_option
@_passphrase_option
@click.pass_context
def ca_rotate(ctx: click.Context, algorithm: str, passphrase_stdin: bool) -> None:
    """Add a new CA that signs from now on.

    The older CAs stay in the vault and in `ca public` until retired: install
    the new output of `ca public` on every target first, then `ca retire` the
    old CA, so no target ever refuses a certificate during the change."""
    k = vault_call(ctx, "ca_rotate", passphrase_stdin, algorithm=algorithm)
    click.echo(k["public_key"])
    click.echo(
        f"# {k['label']} ({k['fingerprint']}) signs from now on. `bastion ca public` lists "
        "it and the older CA until that is retired: install it on every target, then "
        f"`bastion ca retire {k['older'][-1]}`"
    )


@ca.command("retire")
@click.argument("which", metavar="LABEL|FINGERPRINT", shell_complete=complete_retirable_ca)
@_passphrase_option
@click.pass_context
def ca_retire(ctx: click.Context, which: str, passphrase_stdin: bool) -> None:
    """Destroy an older CA no target needs any more.

    Named by its label or SHA256 fingerprint (`ca public --json`). The CA that signs
    now cannot be retired: that would leave nothing to sign with (`ca rotate`
    first). Certificates it made stay valid on targets that still trust it: remove
    its line from each target's file too."""
    k = vault_call(ctx, "ca_retire", passphrase_stdin, which=which)
    click.echo(
        f"retired {k['label']} ({k['fingerprint']}); remove its line from each target's "
        "CA file (`bastion ca public` prints the file as it is now)"
    )


def _read_secret(prompt: str, what: str) -> str:
    """One secret line: from a terminal without echo, else stdin's next line."""
    try:
        secret = (ask_secret(prompt) if sys.stdin.isatty() else read_secret_line()).decode()
    except (EOFError, UnicodeDecodeError):
        secret = ""
    if not secret:
        fail(f"no {what} given (stdin was empty); nothing was stored")
    return secret


@ca.command("openbao-login")
@click.option(
    "--approle",
    "role_id",
    metavar="ROLE_ID",
    default=None,
    help="Log in with this AppRole; its secret id is read from stdin (or prompted for).",
)
@passphrase_option("Vault passphrase on stdin's first line, before the token (no gateway running).")
@click.pass_context
def ca_openbao_login(ctx: click.Context, role_id: str | None, passphrase_stdin: bool) -> None:
    """Seal the OpenBao login in the vault.

    For bastion.toml's `[ca] backend = "openbao"`: the gateway asks OpenBao to
    sign with this login, a token or, with --approle, an AppRole. The secret is read
    from stdin (or a prompt that does not echo), never from the command line or a
    plain file, and is kept only in the vault, encrypted like the keys. Running it
    again replaces the login."""
    vault_pass = read_secret_line() if passphrase_stdin else None
    args: dict[str, Any]
    if role_id is None:
        args = {"token": _read_secret("OpenBao token: ", "OpenBao token")}
    else:
        secret_id = _read_secret(f"Secret id of AppRole {role_id}: ", "AppRole secret id")
        args = {"role_id": role_id, "secret_id": secret_id}
    if vault_pass is not None:  # put the vault passphrase back for vault_call to read
        sys.stdin = LineStdin(vault_pass)  # type: ignore[assignment]
    done = vault_call(ctx, "ca_openbao_login", passphrase_stdin, **args)
    what = "token" if done["login"] == "token" else f"AppRole {role_id} and its secret id"
    click.echo(f"sealed the OpenBao {what} in the vault (secret {done['sealed']})")
