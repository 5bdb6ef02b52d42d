"""The `bastion` command: parse, call, print. Nothing is decided here.

Every read takes `--json`. Operator commands talk to the running gateway over
its operator socket; `init`, `key` and `audit` (when no gateway runs),
`hostkey`, `ssh-config` and `request` work on files directly. Heavy modules
(asyncssh, the gateway) are imported inside the commands that need them, so
that the commands an operator types often start fast.
"""

from __future__ import annotations

import base64
import importlib
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import click

from bastion.cli import completion as comp
from bastion.cli.common import (
    HOST_KEY_ALIAS,
    emit,
    fail,
    home_of,
    op,
    passphrase_option,
    read_passphrase,
    save_to_keyring,
    screen_width,
    width_option,
)
from bastion.core.display import escape_text
from bastion.data import EXAMPLE_POLICY
from bastion.home import default_home
from bastion.ops import opsock

# The commands that live in modules of their own, imported only when named: `bastion run`
# (started before every agent) pays for its own imports, not for `audit`'s or `isolate`'s.
ELSEWHERE = {
    "key": "bastion.cli.keys:key",
    "ca": "bastion.cli.ca:ca",
    "audit": "bastion.cli.audit:audit",
    "hostkey": "bastion.cli.agents:hostkey",
    "ssh-config": "bastion.cli.agents:ssh_config",
    "proxy": "bastion.cli.agents:proxy",
    "run": "bastion.cli.run:run",
    "check-command": "bastion.cli.check:check_command",
    "isolate": "bastion.cli.isolate:isolate",
    "daemon": "bastion.cli.daemon:daemon",
    "mcp": "bastion.cli.mcp:mcp",
    "doctor": "bastion.cli.doctor:doctor",
    "service": "bastion.cli.service:service",
    "completion": "bastion.cli.completion:completion",
    "operator": "bastion.cli.presence:operator",
    "console": "bastion.cli.presence:console",
}


class Commands(click.Group):
    """The `bastion` group: its own commands, and `ELSEWHERE`'s, each imported when
    asked for (click's documented way: `list_commands` and `get_command`)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *ELSEWHERE})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        where = ELSEWHERE.get(cmd_name)
        if where is None:
            return super().get_command(ctx, cmd_name)
        module, name = where.split(":")
        command: click.Command = getattr(importlib.import_module(module), name)
        return command


@click.group(cls=Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--home",
    type=click.Path(path_type=Path),
    default=None,
    help="Bastion home (default: $BASTION_HOME or $XDG_DATA_HOME/bastion).",
)
@click.version_option(package_name="bastion")
@click.pass_context
def main(ctx: click.Context, home: Path | None) -> None:
    """A local SSH bastion: agents run commands on real servers through the
    stock ssh client, and never hold a key."""
    ctx.obj = {"home": (home.expanduser().absolute() if home else default_home())}


# -- setup -------------------------------------------------------------------------------


@main.command()
@passphrase_option()
@click.option(
    "--keyring",
    "use_keyring",
    is_flag=True,
    help="Also store the passphrase in the OS keyring for `unlock --keyring`.",
)
@click.pass_context
def init(ctx: click.Context, passphrase_stdin: bool, use_keyring: bool) -> None:
    """Create the home: vault, the gateway's SSH host key, policy directory; say where the
    example policy (installed with bastion) is."""
    import asyncssh

    from bastion import journal
    from bastion.vault import Vault, VaultError

    home = home_of(ctx)
    if home.exists():
        fail(f"{home.root} is already initialised (vault at {home.vault}); nothing was changed")
    passphrase = read_passphrase(passphrase_stdin, False, home, confirm=True)
    if not passphrase:
        fail("an empty passphrase is not allowed; nothing was created")
    home.make_dirs()
    try:
        vault = Vault.create(home.vault, passphrase)
        vault.generate(journal.IDENTITY_LABEL)  # the journal identity: signs, reads the audit
        journal.create(home.journal, vault.private_key(journal.IDENTITY_LABEL).pyca_key)
        vault.lock()
    except VaultError as exc:
        fail(str(exc))
    key = asyncssh.generate_private_key("ssh-ed25519", comment="bastion-gateway")
    old = os.umask(0o177)
    try:
        key.write_private_key(str(home.host_key))
    finally:
        os.umask(old)
    public = key.export_public_key().decode().strip()
    home.known_hosts.write_text(f"{HOST_KEY_ALIAS} {public}\n")
    if use_keyring:
        save_to_keyring(home, passphrase)
    click.echo(
        f"Initialised {home.root}\n"
        f"  vault:     {home.vault} (locked)\n"
        f"  policies:  {home.policies}/ (empty: add *.toml files)\n"
        f"  example:   {EXAMPLE_POLICY} (the fields explained: copy it there, edit it)\n"
        "Next: `bastion key generate LABEL`, write a policy, `bastion daemon`, "
        "`bastion unlock`, `bastion ssh-config > agent_ssh_config`."
    )


@main.command()
@passphrase_option()
@click.option("--keyring", "use_keyring", is_flag=True, help="Read it from the OS keyring.")
@click.option("--store-keyring", is_flag=True, help="After unlocking, store it in the keyring.")
@click.pass_context
def unlock(
    ctx: click.Context, passphrase_stdin: bool, use_keyring: bool, store_keyring: bool
) -> None:
    """Unlock the vault in the running gateway (ends every session approval)."""
    home = home_of(ctx)
    passphrase = read_passphrase(passphrase_stdin, use_keyring, home)
    result = op(ctx, "unlock", timeout=60, passphrase=base64.b64encode(passphrase).decode())
    if store_keyring:
        save_to_keyring(home, passphrase)
    click.echo(f"unlocked (vault epoch {result['vault_epoch']})")


@main.command()
@click.option(
    "--terminate", is_flag=True, help="Also end every command in flight (each outcome is recorded)."
)
@click.pass_context
def lock(ctx: click.Context, terminate: bool) -> None:
    """Lock the vault: deny everything at once, end every approval, queue nothing."""
    result = op(ctx, "lock", timeout=60, terminate=terminate)
    ended = result.get("terminated") or []
    click.echo(
        f"locked (vault epoch {result['vault_epoch']})"
        + (f"; ended {len(ended)} command(s) in flight: {' '.join(ended)}" if ended else "")
    )


def load_lines(load: dict[str, Any] | None) -> list[str]:
    """Backpressure: in flight (the ceiling is [limits] inflight in bastion.toml), queued,
    refused busy; then each target's learned limit (core/concurrency.py)."""
    if not load:
        return ["load:      -"]
    lines = [
        f"load:      {load['inflight']} command(s) in flight (ceiling {load['limit']}), "
        f"{load['waiting']} queued, {load['busy_refused']} refused GATEWAY_BUSY since start"
    ]
    for t in load.get("targets") or []:
        base = t.get("baseline_ms")
        lines.append(
            f"  {t['target']}: limit {t['limit']} (learned), {t['inflight']} in flight, "
            f"{t['waiting']} queued"
            + (f", a command takes {base:.0f} ms at best" if base is not None else "")
        )
    return lines


def witness_lines(w: dict[str, Any] | None) -> list[str]:
    """How far behind the witness is, per target, and why (bastion.toml's [witness])."""
    if w is None:
        return ["witness:   none (no [witness] in bastion.toml)"]
    age = f", oldest {w['oldest_age']:.0f} s old" if w.get("oldest_age") is not None else ""
    state = "REFUSING NEW WORK" if w.get("refusing") else "FULL" if w.get("full") else "ok"
    lines = [
        f"witness:   {state}: {w['waiting']} entr{'y' if w['waiting'] == 1 else 'ies'} "
        f"waiting{age} (buffer_max {w['buffer_max']}, when_full {w['when_full']})"
    ]
    for name, t in sorted((w.get("targets") or {}).items()):
        trouble = f", FAILING: {t.get('last_error')}" if t.get("failing") else ""
        lines.append(
            f"  {name} {t['address']}: {t['waiting']} waiting, {t['delivered']} delivered{trouble}"
        )
    if w.get("spool_error"):
        lines.append(f"  spool: {w['spool_error']}")
    if n := w.get("unwitnessed_dispatches"):
        lines.append(
            f"  UNWITNESSED: {n} command(s) sent before a witness confirmed their intent "
            "(when_full = continue): this journal alone vouches for them"
        )
    return lines


def run_lines(runs: list[dict[str, Any]] | None) -> list[str]:
    """`status`'s live runs, each with what its sandbox was given (its claim)."""
    if not runs:
        return ["runs:      none"]
    out = [f"runs:      {len(runs)}"]
    for r in runs:
        given = r.get("given")
        what = "not sandboxed" if given is None else ", ".join(given) or "the defaults"
        out.append(f"  {r.get('label') or '(no label)'} (pid {r.get('pid')}): {what}")
    return out


@main.command()
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def status(ctx: click.Context, as_json: bool) -> None:
    """Gateway state: vault, policy, isolation and what it guarantees, the listeners."""
    from bastion.core.events import foreign_warning
    from bastion.sandbox.threat_model import threat_lines

    s = op(ctx, "status")

    def listener(h: dict[str, Any] | None) -> str:
        if not h:
            return "-"
        state = "serving" if h.get("serving") else "NOT SERVING"
        errors = h.get("accept_errors", 0) + h.get("connection_errors", 0)
        last = f", last: {h['last_error']}" if h.get("last_error") else ""
        return f"{state}, {h.get('connections', 0)} connection(s), {errors} error(s){last}"

    def console_line(c: dict[str, Any] | None) -> str:
        if not c:
            return "off"
        if not c.get("started"):
            retry = c.get("retry_seconds") or 5
            return f"not started: {c.get('error')} (trying again every {retry:g} s)"
        refused = {k: n for k, n in (c.get("refused") or {}).items() if n}
        said = ", ".join(f"{k.replace('_', ' ')} {n}" for k, n in refused.items())
        return (
            f"{c.get('url')} serving, {c.get('connections', 0)} connection(s), "
            f"{c.get('streams', 0)} stream(s), refused {sum(refused.values())}"
            + (f" ({said})" if said else "")
        )

    def human(s: dict[str, Any]) -> str:
        policy = "ok" if s["policy"]["ok"] else f"UNAVAILABLE: {s['policy']['error']}"
        listeners = s.get("listeners") or {}
        held = s.get("keys_held") or {}
        home = s.get("home") or {}
        lines = [
            *(f"home:      MOVED: {sentence}" for sentence in home.get("moved") or []),
            f"vault:     {'locked' if s['locked'] else 'unlocked'} (epoch {s['vault_epoch']}); "
            f"keys held in memory: {held.get('vault_keys', '?')}, "
            f"connections holding one: {held.get('connections', '?')}",
            f"policy:    {policy}",
            f"hosts:     {', '.join(s['policy']['hosts']) or '-'}",
            f"isolation: {s['isolation']}",
            *(
                f"  {'ok      ' if held_ else 'NOT HELD'}  {text}"
                for text, held_ in s.get("guarantees") or []
            ),
            f"agents:    {listener(listeners.get('agent'))}",
            f"operator:  {listener(listeners.get('operator'))}",
            f"console:   {console_line(s.get('console'))}",
            f"pending:   {s['pending']} card(s), sessions: {s['sessions']}",
            *run_lines(s.get("runs")),
            *load_lines(s.get("load")),
            f"boot:      {s['boot_id']}",
            *witness_lines(s.get("witness")),
            *(f"WARNING {foreign_warning(span)}" for span in s.get("foreign_records") or []),
            *threat_lines(s.get("threat_model") or {}),
        ]
        return "\n".join(escape_text(line) for line in lines)

    emit(s, as_json, human)


# -- the operator ---------------------------------------------------------------------------


@main.command()
@click.option("--json", "as_json", is_flag=True)
@click.option(
    "--wait",
    type=click.FloatRange(0, 600),
    default=0.0,
    help="Wait up to this many seconds for a card to arrive.",
)
@click.pass_context
def pending(ctx: click.Context, as_json: bool, wait: float) -> None:
    """Cards waiting for an operator's answer, each with when it expires."""
    from bastion.cli.cardview import UNWRAPPED, render_card
    from bastion.cli.rows import expiry

    cards = op(ctx, "pending", timeout=wait + 30, wait=wait)
    now = time.time()
    # A terminal gets lines that fit it; a pipe gets them whole, for grep.
    width = shutil.get_terminal_size().columns if sys.stdout.isatty() else UNWRAPPED
    emit(
        cards,
        as_json,
        lambda cs: (
            "\n\n".join(
                render_card(c, width=width)
                + f"\n  expires:  {expiry(c.get('expires_at'), now)}"
                + f"\n  decide:   bastion decide {c['id']} approve|deny"
                for c in cs
            )
            or "(no pending cards)"
        ),
    )


@main.command()
@click.option("--no-notify", is_flag=True, help="No desktop notification (notify-send).")
@click.option("--notify-command", is_flag=True, help="Show the command in notifications.")
@click.pass_context
def approve(ctx: click.Context, no_notify: bool, notify_command: bool) -> None:
    """Interactive approvals: each card as it arrives (bell, desktop notification).

    \b
    y then Enter   approve the card the question names
    n then Enter   deny it (Esc or any other key cancels a begun answer)
    g              widen a yes to a bounded grant (accounts with grants = true):
                   a digit per argv word to widen to *, Enter, a digit for the
                   bound (uses or minutes), Enter on the grant read back
    d              details (process chain, digests)
    a / s          the last requests / the live sessions, as the views show them
    L              lock the vault at once, no confirmation (l does nothing)
    q              quit

    Keys are case-sensitive. Input within 0.4 s of the card on screen changing (a new card,
    one withdrawn, a redraw on resize), several keys arriving in one read, and pasted text
    answer nothing, and the prompt says so. Between cards, a status line. Survives gateway
    restarts."""
    from bastion.cli.prompt import approve as run_prompt

    sys.exit(run_prompt(home_of(ctx).operator_socket, not no_notify, notify_command))


@main.command()
@click.argument("card_id", shell_complete=comp.complete_card)
@click.argument("answer", type=click.Choice(["approve", "deny"]))
@click.option(
    "--grant",
    "pattern",
    metavar="PATTERN",
    help="With approve, on a command card of an account with `grants = true`: also run "
    "later commands matching PATTERN without a card -- the card's own argv with chosen "
    "words replaced by * (one * is one word that does not begin with -, so an option is "
    "covered only as the card spells it; the program and the card's options stay "
    "literal), e.g. "
    "'systemctl restart *'. Needs --uses and/or --minutes (whichever ends first). Never "
    "covers shell source, stdin bytes or a terminal, nor anything the account's rules "
    "refuse; it ends with the session (lock, revoke, process change, restart, policy "
    "change).",
)
@click.option("--uses", type=click.IntRange(1, 100), help="Commands the grant covers (1-100).")
@click.option("--minutes", type=click.IntRange(1, 480), help="Minutes the grant lasts (1-480).")
@click.pass_context
def decide(
    ctx: click.Context,
    card_id: str,
    answer: str,
    pattern: str | None,
    uses: int | None,
    minutes: int | None,
) -> None:
    """Answer one card (and, with --grant, widen a yes to a bounded grant)."""
    if pattern is None and (uses is not None or minutes is not None):
        raise click.UsageError("--uses and --minutes bound a grant: give --grant PATTERN too")
    grant = None
    if pattern is not None:
        if answer != "approve":
            raise click.UsageError("--grant widens a yes: use it with approve")
        if uses is None and minutes is None:
            raise click.UsageError("a grant needs --uses and/or --minutes")
        grant = {"pattern": pattern, "uses": uses, "minutes": minutes}
    reply = op(ctx, "answer", card=card_id, approve=answer == "approve", grant=grant)
    click.echo(f"{card_id}: {'approved' if answer == 'approve' else 'denied'}")
    made = reply.get("grant") if isinstance(reply, dict) else None
    if made:
        bound = [f"{made['uses_left']} use(s)"] if made.get("uses_left") is not None else []
        if made.get("expires_at") is not None:
            until = time.strftime("%H:%M:%S", time.localtime(made["expires_at"]))
            bound.append(f"until {until}")
        click.echo(escape_text(f"grant {made['id']}: {made['pattern']} ({', '.join(bound)})"))


@main.command()
@click.option("--json", "as_json", is_flag=True)
@width_option()
@click.pass_context
def sessions(ctx: click.Context, as_json: bool, width: int | None) -> None:
    """Live session approvals: id, for whom (the run's label, or the process), user@host,
    when it started and who approved it. Ended ones: `bastion audit sessions`."""
    from bastion.cli.rows import session_rows

    found = op(ctx, "sessions")
    cut = screen_width(width)
    emit(found, as_json, lambda rs: "\n".join(session_rows(rs, cut)) or "(no live sessions)")


@main.command()
@click.argument("session_id", shell_complete=comp.complete_session)
@click.pass_context
def revoke(ctx: click.Context, session_id: str) -> None:
    """End one session approval now."""
    op(ctx, "revoke", session=session_id)
    click.echo(f"revoked {session_id}")


@main.command()
@click.argument("request_id", shell_complete=comp.complete_request_in_flight)
@click.pass_context
def kill(ctx: click.Context, request_id: str) -> None:
    """End a command in flight: signal it, then close its channel. Its outcome
    is recorded as the target reports it (or `unknown` if it does not)."""
    op(ctx, "kill", timeout=60, request=request_id)
    click.echo(f"{request_id}: ended; see `bastion request {request_id}`")


@main.command()
@click.argument("request_id", shell_complete=comp.complete_request)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def request(ctx: click.Context, request_id: str, as_json: bool) -> None:
    """What became of one request: completed, denied, retry_safe,
    status_unknown or in_flight (from the journal; no passphrase needed)."""
    from bastion import journal
    from bastion.core import events

    home = home_of(ctx)
    try:
        live = opsock.call(home.operator_socket, "status", timeout=5)["boot_id"]
    except opsock.OperatorError:
        live = None
    state = events.request_state(journal.records(home.journal), request_id, live)
    if state is None:
        fail(f"no request {request_id} in the journal at {home.journal}")
    emit(
        state,
        as_json,
        lambda s: (
            f"{s['request_id']}: {s['state']}"
            + (f" (exit {s['exit_status']})" if s.get("exit_status") is not None else "")
            + (f" ({s['code']})" if s.get("code") else "")
            + (f", certificate serial {s['certificate']['serial']}" if s.get("certificate") else "")
        ),
    )


@main.command()
@click.option("--keep", is_flag=True, help="Keep the throwaway directory for inspection.")
def demo(keep: bool) -> None:
    """Throwaway sshd + bastion + one agent command, end to end."""
    from bastion.devtools.demo import run_demo

    sys.exit(run_demo(keep=keep))


if __name__ == "__main__":
    main()
