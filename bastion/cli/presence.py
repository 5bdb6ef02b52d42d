"""`bastion operator` (the authenticators that sign presence cards) and `bastion console`.

Enrolling is three steps (`gateway/signers.py` says why): the passphrase here,
the authenticator in the console's page, then the code that page shows, typed
here. A registration nobody typed the code of is not kept.
"""

from __future__ import annotations

import base64
import contextlib
import getpass
import socket
import sys
import time
import webbrowser

import click

from bastion.cli.common import (
    emit,
    fail,
    home_of,
    op,
    passphrase_option,
    read_passphrase,
    read_secret_line,
    width_option,
)
from bastion.core.display import escape_text

KEYRING_HELP = "Read the passphrase from the OS keyring."
ENROL_WAIT = 300.0  # seconds the CLI waits for the page (the enrolment's own life)


def _open(url: str, no_open: bool) -> None:
    """Open the page in the operator's browser, unless asked not to or there is none."""
    if no_open:
        return
    with contextlib.suppress(webbrowser.Error):
        webbrowser.open(url)


@click.group()
def operator() -> None:
    """The authenticators (passkeys, security keys, a phone) that sign presence cards:
    an account with presence = "required" is approved only by their signatures, in
    the console (`bastion console`). Enrolling and removing need the vault passphrase."""


@operator.command()
@click.option(
    "--name",
    default=None,
    help="What cards it signs show (default: USER@HOST). 1-64 printable characters.",
)
@passphrase_option("Read the vault passphrase from stdin (and, with --code-stdin, the code).")
@click.option(
    "--keyring", "use_keyring", is_flag=True, help="Read the passphrase from the keyring."
)
@click.option("--no-open", is_flag=True, help="Print the page's URL; do not open a browser.")
@click.option(
    "--code-stdin", is_flag=True, help="Read the code the page shows from stdin's next line."
)
@click.pass_context
def enroll(
    ctx: click.Context,
    name: str | None,
    passphrase_stdin: bool,
    use_keyring: bool,
    no_open: bool,
    code_stdin: bool,
) -> None:
    """Enroll an authenticator: prove the passphrase, register it in the console's page,
    then type the code that page shows. The signer's public half is journaled."""
    home = home_of(ctx)
    name = name or f"{getpass.getuser()}@{socket.gethostname()}"
    passphrase = read_passphrase(passphrase_stdin, use_keyring, home)
    begun = op(
        ctx,
        "operator_enroll",
        timeout=60,
        passphrase=base64.b64encode(passphrase).decode(),
        signer_name=name,
    )
    url, token = begun["url"], begun["token"]
    click.echo(f"Open this page to register the authenticator {escape_text(name)!r}:\n  {url}")
    sys.stdout.flush()
    _open(url, no_open)
    deadline = time.monotonic() + ENROL_WAIT
    while not op(ctx, "operator_enroll_wait", timeout=60, token=token, wait=30)["registered"]:
        if time.monotonic() > deadline:
            fail("nothing registered in time; run `bastion operator enroll` again")
    if code_stdin:
        code = read_secret_line().decode(errors="replace").strip()
    else:
        code = click.prompt("The code the page shows").strip()
    cred = op(
        ctx,
        "operator_enroll_confirm",
        timeout=60,
        token=token,
        code=code,
        passphrase=base64.b64encode(passphrase).decode(),
    )
    click.echo(
        f"enrolled {escape_text(cred['name'])!r}: signer {cred['id'][:16]}..., "
        f"authenticator {cred['aaguid']}, attestation {cred['fmt']!r}"
    )


@operator.command("list")
@click.option("--json", "as_json", is_flag=True)
@width_option()
@click.pass_context
def list_(ctx: click.Context, as_json: bool, width: int | None) -> None:
    """The enrolled signers: name, id, authenticator model, when, sign counter."""
    rows = op(ctx, "operator_list", timeout=10)

    def text(rs: list[dict[str, object]]) -> str:
        lines = [
            f"{r['name']}  {str(r['id'])[:16]}...  {r['aaguid']}  "
            f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(float(r['enrolled_at'])))}"  # type: ignore[arg-type]
            f"  count {r['sign_count']}"
            for r in rs
        ]
        return "\n".join(lines) or "(no signer enrolled: `bastion operator enroll`)"

    emit(rows, as_json, text)


@operator.command()
@click.argument("signer")
@passphrase_option()
@click.option(
    "--keyring", "use_keyring", is_flag=True, help="Read the passphrase from the keyring."
)
@click.pass_context
def remove(ctx: click.Context, signer: str, passphrase_stdin: bool, use_keyring: bool) -> None:
    """Remove an enrolled signer (its name or id): it signs nothing from now on."""
    passphrase = read_passphrase(passphrase_stdin, use_keyring, home_of(ctx))
    gone = op(
        ctx,
        "operator_remove",
        timeout=60,
        passphrase=base64.b64encode(passphrase).decode(),
        signer=signer,
    )
    click.echo(f"removed {escape_text(gone['name'])!r} ({gone['removed'][:16]}...)")


@click.command()
@click.option("--no-open", is_flag=True, help="Print the URL; do not open a browser.")
@click.pass_context
def console(ctx: click.Context, no_open: bool) -> None:
    """Print the console's URL and open it: cards (and presence-signed approvals),
    sessions, activity, lock and revoke, in a browser on this machine."""
    got = op(ctx, "console", timeout=10)
    if not got["enabled"] and got.get("error"):
        fail(f"the console did not start: {got['error']}; the gateway tries again every 5 s")
    if not got["enabled"]:
        fail(
            "the console is off: add [console] with enabled = true to bastion.toml "
            "and restart the gateway"
        )
    click.echo(got["url"])
    _open(got["url"], no_open)
