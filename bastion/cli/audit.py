"""`bastion audit`: verify the journal offline, or read its views.

Verification needs neither the passphrase nor the gateway. The views need
the journal identity: from the unlocked gateway, or offline with the
passphrase -- both through `ops.audit_view` (imported when a command runs:
the CLI starts without cryptography or asyncssh).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from bastion.cli import rows
from bastion.cli.common import (
    emit,
    fail,
    home_of,
    passphrase_option,
    read_passphrase,
    screen_width,
    width_option,
)
from bastion.cli.export import export
from bastion.core.events import ActivityFilter
from bastion.ops import opsock


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
    """Check order, chain, signatures and vouches, every presence-signed approval
    against the keys its enrolment recorded, and with --witness the heads a witness
    saw. Needs neither the passphrase nor the gateway. Exit 0 intact, 1 with the
    first bad record, a presence approval that does not hold, or the first
    witnessed head missing."""
    from bastion import journal, ops
    from bastion.journal import verify as journal_verify
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
        from bastion.journal import witness_reading as witness_check

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
            *(f"  presence: seq {p['seq']}: {p['words']}" for p in v["presence"] if p["problem"]),
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


class When(click.ParamType):
    """`--since`/`--until`: a duration ago or a local time (`rows.parse_when`); anything
    else is a usage error, never a traceback."""

    name = "when"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, float):
            return value
        try:
            return rows.parse_when(str(value), time.time())
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


def _journal_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """What every view takes: --json, --width, and the offline passphrase."""
    for option in reversed(
        (
            click.option("--json", "as_json", is_flag=True, help="Every field of every row."),
            width_option(),
            passphrase_option("Read the journal without a gateway."),
            click.option(
                "--keyring",
                "use_keyring",
                is_flag=True,
                help="Read the vault passphrase from the OS keyring.",
            ),
        )
    ):
        command = option(command)
    return command


@audit.command("activity")
@click.option(
    "--host",
    "hosts",
    multiple=True,
    help="Only requests for this host (repeatable, or comma-separated; any case).",
)
@click.option("--run", "run_label", default=None, help="Only requests of the run with this label.")
@click.option(
    "--since", type=When(), default=None, help=f"Only requests received since: {rows.WHEN_HELP}."
)
@click.option(
    "--until",
    type=When(),
    default=None,
    help="Only requests received until then (as --since); a row shown at that very second is kept.",
)
@click.option(
    "--outcome",
    "outcomes",
    multiple=True,
    type=click.Choice(rows.OUTCOMES),
    help="Only requests that ended so (repeatable): completed, failed (completed with a "
    "non-zero exit status, or signalled), signalled, denied, remote_rejected, not_started "
    "(nothing was sent), unknown (sent, no answer known), in_flight.",
)
@click.option(
    "--grep",
    default=None,
    help="Only requests whose command (as the agent sent it) or file path contains this "
    "text: a plain, case-sensitive substring, not a pattern.",
)
@_journal_options
@click.pass_context
def audit_activity(
    ctx: click.Context,
    hosts: tuple[str, ...],
    run_label: str | None,
    since: float | None,
    until: float | None,
    outcomes: tuple[str, ...],
    grep: str | None,
    as_json: bool,
    width: int | None,
    passphrase_stdin: bool,
    use_keyring: bool,
) -> None:
    """One row per request: when it was received, who asked (the run's label, or the
    process), user@host, how it ended (outcome, code, exit status) and the command,
    escaped and cut to the width. --json keeps every field of each row it shows."""
    keep = ActivityFilter(
        hosts=frozenset(h.strip().lower() for hs in hosts for h in hs.split(",") if h.strip()),
        run=run_label,
        since=since,
        until=until,
        outcomes=frozenset(outcomes),
        grep=grep,
    )
    kept = keep.select(_audit_view(ctx, "activity", passphrase_stdin, use_keyring))
    cut = screen_width(width)
    emit(kept, as_json, lambda rs: "\n".join(rows.activity_rows(rs, cut)) or "(no requests)")


@audit.command("sessions")
@_journal_options
@click.pass_context
def audit_sessions(
    ctx: click.Context, as_json: bool, width: int | None, passphrase_stdin: bool, use_keyring: bool
) -> None:
    """One row per session approval: its id, for whom (the run's label, or the process),
    user@host, when it started, who approved it, and when and why it ended (or live)."""
    found = _audit_view(ctx, "sessions", passphrase_stdin, use_keyring)
    cut = screen_width(width)
    emit(found, as_json, lambda rs: "\n".join(rows.session_rows(rs, cut)) or "(no sessions)")
