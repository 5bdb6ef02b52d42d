"""`bastion audit`: verify the journal offline, or read its views.

Verification needs neither the passphrase nor the gateway. The views need
the journal identity: from the unlocked gateway, or offline with the
passphrase -- both through `ops.audit_view` (imported when a command runs:
the CLI starts without cryptography or asyncssh).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from bastion import opsock
from bastion.cli.common import emit, fail, home_of, passphrase_option, read_passphrase
from bastion.cli.export import export
from bastion.core.display import escape_text


@click.group()
def audit() -> None:
    """The journal: verify it offline, or read its views."""


audit.add_command(export)


@audit.command("verify")
@click.option(
    "--journal",
    "path",
    type=click.Path(path_type=Path),
    default=None,
    help="A journal directory (default: HOME/journal).",
)
@click.option(
    "--expect-head", default=None, help="A head hash recorded earlier (catches truncation)."
)
@click.option(
    "--witness",
    "witness_files",
    multiple=True,
    type=click.Path(path_type=Path, exists=True),
    help="A file a witness wrote: bastion.toml's witness file (or directory), or the file "
    "a syslog collector writes. Fails unless the journal holds every head it saw, with the same "
    "hash (catches truncation, rollback and rebuilt chains, head.json or not). Repeatable.",
)
@click.option(
    "--strict",
    is_flag=True,
    help="Fail on records not yet vouched for, and on records signed by a boot key the "
    "journal identity never vouched for.",
)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def audit_verify(
    ctx: click.Context,
    path: Path | None,
    expect_head: str | None,
    witness_files: tuple[Path, ...],
    strict: bool,
    as_json: bool,
) -> None:
    """Check order, chain, signatures and vouches, and with --witness the
    heads a witness saw. Needs neither the passphrase nor the gateway. Exit 0
    intact, 1 with the first bad record or the first witnessed head missing."""
    from bastion import journal, journal_verify, ops
    from bastion.vault import Vault, VaultError

    home = home_of(ctx)
    directory = path or home.journal
    try:
        pin = None if path else ops.identity_pin(Vault.open(home.vault))
        identity = journal.read_identity(directory, pin)
    except (journal.JournalError, VaultError) as exc:
        fail(str(exc))
    report = journal_verify.verify(directory, identity, expect_head, strict)
    doc = report.as_json()
    ok = report.ok
    if witness_files:
        from bastion import witness_check

        try:
            heads = witness_check.read_entries(witness_files)
        except OSError as exc:
            fail(f"cannot read the witness: {exc}")
        check = witness_check.check(directory, identity, heads)
        doc["witness"] = {"files": [str(f) for f in witness_files], **check.as_json()}
        ok = ok and check.ok

    def human(v: dict[str, Any]) -> str:
        head = "intact" if v["ok"] else f"BROKEN at {v['problem']}"
        lines = [
            f"journal {directory}: {head} ({v['records']} record(s) checked)",
            *(f"  note: {n}" for n in v["notes"]),
        ]
        w = v.get("witness")
        if w is not None:
            files = ", ".join(w["files"])
            if w["ok"]:
                lines.append(
                    f"witness {files}: {w['heads']} witnessed head(s) held, "
                    f"the last at seq {w['last']}"
                )
            else:
                lines.append(f"witness {files}: BROKEN: {w['problem']}")
            lines += [f"  note: {n}" for n in w["notes"]]
        return "\n".join(lines)

    emit(doc, as_json, human)
    sys.exit(0 if ok else 1)


@audit.command("head")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def audit_head(ctx: click.Context, as_json: bool) -> None:
    """The journal's last (seq, hash): record it elsewhere, verify against it later."""
    from bastion import journal

    home = home_of(ctx)
    if not home.journal.is_dir():
        fail(f"no journal at {home.journal}; is {home.root} a bastion home (`bastion init`)?")
    seq, digest = journal.head(home.journal)
    emit({"seq": seq, "hash": digest}, as_json, lambda h: f"{h['seq']} {h['hash']}")


def _audit_view(ctx: click.Context, view: str, passphrase_stdin: bool, use_keyring: bool) -> Any:
    """Through an unlocked gateway, or offline with the passphrase."""
    from bastion import journal, ops
    from bastion.vault import Vault, VaultError

    home = home_of(ctx)
    if not (passphrase_stdin or use_keyring):
        try:
            return opsock.call(home.operator_socket, "audit", timeout=120, view=view)
        except opsock.OperatorError as exc:
            if not isinstance(exc, opsock.GatewayNotRunning) and "locked" not in str(exc):
                fail(str(exc))
    passphrase = read_passphrase(passphrase_stdin, use_keyring, home)
    try:
        identity = Vault.open(home.vault).read_private_key(passphrase, journal.IDENTITY_LABEL)
        return ops.audit_view(view, home.journal, identity.pyca_key)
    except (VaultError, ops.OpsError) as exc:
        fail(str(exc))


def _activity_line(a: dict[str, Any]) -> str:
    end = a["outcome"] + (f" {a['code']}" if a.get("code") else "")
    if a.get("exit_status") is not None:
        end += f" exit {a['exit_status']}"
    cert = a.get("certificate")
    if cert:  # what the target's sshd logged for this login: ID <request id> (serial N)
        end += f" cert serial {cert['serial']}"
    line = f"{a['request_id']}  {a['user']}@{a['host']}  {end:<28} {a['command']!r}"
    return escape_text(line)  # user, host and command came from an agent


def _view_command(name: str, row: Callable[[dict[str, Any]], str], empty: str, doc: str) -> None:
    """`audit activity` and `audit sessions`: one view each, the same options."""

    @audit.command(name, help=doc)
    @click.option("--json", "as_json", is_flag=True)
    @passphrase_option("Read the journal without a gateway.")
    @click.option(
        "--keyring",
        "use_keyring",
        is_flag=True,
        help="Read the vault passphrase from the OS keyring.",
    )
    @click.pass_context
    def command(
        ctx: click.Context, as_json: bool, passphrase_stdin: bool, use_keyring: bool
    ) -> None:
        rows = _audit_view(ctx, name, passphrase_stdin, use_keyring)
        emit(rows, as_json, lambda rs: "\n".join(map(row, rs)) or empty)


def _session_row(r: dict[str, Any]) -> str:
    pid = (r["subject"] or {}).get("pid")
    return escape_text(
        f"{r['session_id']}  {r['user']}@{r['host']}  pid {pid}  ended: {r['end_reason'] or 'live'}"
    )


_view_command(
    "activity",
    _activity_line,
    "(no requests)",
    "One row per request: what was asked, by whom, and how it ended.",
)
_view_command(
    "sessions",
    _session_row,
    "(no sessions)",
    "One row per session approval: who, what, when, and why it ended.",
)
