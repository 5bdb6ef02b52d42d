"""What every `bastion` subcommand shares: errors, output, the home, the gateway, passphrases.

Output: every line a command prints for a person (`emit`'s text, `fail`'s
message) passes through `core.display.escape_text`, whatever it holds.
"""

from __future__ import annotations

import getpass
import io
import json
import sys
from collections.abc import Callable
from typing import Any, NoReturn

import click

from bastion import opsock
from bastion.core.display import escape_text
from bastion.home import Home

KEYRING_SERVICE = "bastion"
HOST_KEY_ALIAS = "bastion-gateway"


def shown(text: str) -> str:
    """Text for a person, line by line: each line escaped, tabs kept between fields."""
    return "\n".join(
        "\t".join(escape_text(field) for field in line.split("\t")) for line in text.split("\n")
    )


def fail(message: str, status: int = 1) -> NoReturn:
    click.echo(f"bastion: {shown(message)}", err=True)
    sys.exit(status)


def emit(data: Any, as_json: bool, human: Callable[[Any], str]) -> None:
    click.echo(json.dumps(data, indent=2) if as_json else shown(human(data)))


def home_of(ctx: click.Context) -> Home:
    return Home(ctx.obj["home"])


def op(ctx: click.Context, name: str, timeout: float = 30.0, **args: Any) -> Any:
    """One request to the running gateway; its refusal is this command's failure."""
    try:
        return opsock.call(home_of(ctx).operator_socket, name, timeout=timeout, **args)
    except opsock.OperatorError as exc:
        fail(str(exc))


def read_passphrase(
    from_stdin: bool, use_keyring: bool, home: Home, confirm: bool = False
) -> bytes:
    if use_keyring:
        import keyring

        try:
            secret = keyring.get_password(KEYRING_SERVICE, str(home.root))
        except keyring.errors.KeyringError as exc:
            fail(f"the OS keyring is not usable here: {exc}")
        if secret is None:
            fail(
                f"no passphrase for {home.root} in the OS keyring (service '{KEYRING_SERVICE}'); "
                "store one with `bastion init --keyring` or `bastion unlock --store-keyring`"
            )
        return secret.encode()
    if from_stdin:
        line = sys.stdin.buffer.readline()
        return line.rstrip(b"\r\n")
    if not sys.stdin.isatty():
        fail("no terminal to ask for the passphrase; use --passphrase-stdin or --keyring")
    first = getpass.getpass("Vault passphrase: ").encode()
    if confirm and getpass.getpass("Again: ").encode() != first:
        fail("the passphrases do not match; nothing was changed")
    return first


def save_to_keyring(home: Home, passphrase: bytes) -> None:
    import keyring
    import keyring.errors

    try:
        keyring.set_password(KEYRING_SERVICE, str(home.root), passphrase.decode())
    except keyring.errors.KeyringError as exc:
        fail(f"could not store the passphrase in the OS keyring: {exc}")


class LineStdin:
    """Stands in for stdin once a line of it has been read on another's behalf."""

    def __init__(self, line: bytes) -> None:
        self.buffer = io.BytesIO(line)

    def isatty(self) -> bool:
        return False
