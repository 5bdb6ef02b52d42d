"""What every `bastion` subcommand shares: errors, output, the home, the gateway, secrets.

Output: every line a command prints for a person (`emit`'s text, `fail`'s
message) passes through `core.display.escape_text`, whatever it holds.

Secrets: a process that reads the vault passphrase, a key or a token first
closes its memory to the other processes of its uid (`close_memory`), as the
gateway does at start. Every way in goes through here: the `--passphrase-stdin`
option (`passphrase_option`) closes it while the command line is parsed, and
the readers (`read_passphrase`, `read_secret_line`, `ask_secret`) close it
before they read, for a command that reads a secret without that option.
"""

from __future__ import annotations

import getpass
import io
import json
import shutil
import sys
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import click

from bastion.core.display import escape_text
from bastion.home import Home
from bastion.ops import opsock
from bastion.sandbox import memory

KEYRING_SERVICE = "bastion"
HOST_KEY_ALIAS = "bastion-gateway"
F = TypeVar("F", bound=Callable[..., Any])


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


# -- a process that holds a secret --------------------------------------------------------


def close_memory() -> None:
    """Close this process's memory to every other process of its uid that lacks
    CAP_SYS_PTRACE, before a secret enters it (`bastion.memory`: the command goes on
    in a child forked after the prctl; a tracer refuses it)."""
    try:
        memory.close()
    except memory.NotClosed as exc:
        fail(f"{exc}; no secret was read")


def _close_on_parse(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    if not ctx.resilient_parsing:  # not for shell completion, which reads nothing secret
        close_memory()
    return value


def passphrase_option(help: str = "Read the vault passphrase from stdin.") -> Callable[[F], F]:
    """`--passphrase-stdin`, which every command that may read the vault passphrase
    takes. Taking it closes the process's memory (`close_memory`) while the command
    line is parsed, before the command reads anything, given or not."""
    return click.option("--passphrase-stdin", is_flag=True, help=help, callback=_close_on_parse)


def read_secret_line() -> bytes:
    """A secret on stdin's next line, without its line end."""
    close_memory()
    return sys.stdin.buffer.readline().rstrip(b"\r\n")


def ask_secret(prompt: str) -> bytes:
    """A secret typed at the terminal, not echoed."""
    close_memory()
    return getpass.getpass(prompt).encode()


def read_passphrase(
    from_stdin: bool, use_keyring: bool, home: Home, confirm: bool = False
) -> bytes:
    close_memory()
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
        return read_secret_line()
    if not sys.stdin.isatty():
        fail("no terminal to ask for the passphrase; use --passphrase-stdin or --keyring")
    first = ask_secret("Vault passphrase: ")
    if confirm and ask_secret("Again: ") != first:
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
        self.buffer = io.BytesIO(line + b"\n")

    def isatty(self) -> bool:
        return False


def width_option() -> Callable[[F], F]:
    """`--width`, which the one-row-per-item views take (`audit activity`, `sessions`, ...)."""
    return click.option(
        "--width",
        type=click.IntRange(0, 10_000),
        default=None,
        help="Cut each row to this many columns (0: never cut). "
        "Default: the terminal's width, or no cut when the output is not a terminal.",
    )


def screen_width(width: int | None) -> int | None:
    """The width rows are cut to: the one asked for, else the terminal's; None: no cut."""
    if width is not None:
        return width or None
    if not sys.stdout.isatty():
        return None
    return shutil.get_terminal_size().columns
