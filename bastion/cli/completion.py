"""`bastion completion SHELL`, and what a TAB offers after `decide`, `revoke`, `key public`...

Completion is click's own (`click.shell_completion`), not hand-written
scripts: the script `completion SHELL` prints calls `bastion` back with
`_BASTION_COMPLETE=<shell>_complete`, and click asks the `shell_complete=`
callback of the argument being typed. The callbacks here ask the running
gateway over the operator socket, with a short timeout, for what is live now:
card ids, session ids, requests in flight. What needs no gateway and no
passphrase (key and CA labels on the vault file, host aliases in the policy files,
recent request ids at the end of the journal) is read from the files when no
gateway runs.

A completer runs inside the operator's shell at every TAB, so it never
raises, prints or prompts: whatever goes wrong, it offers nothing.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
from click.shell_completion import CompletionItem, get_completion_class

from bastion.core.display import escape_text
from bastion.home import Home, default_home
from bastion.ops import opsock

PROG = "bastion"
COMPLETE_VAR = "_BASTION_COMPLETE"  # what click derives from PROG; fixed so `python -m` agrees
SHELLS = ("bash", "zsh", "fish")
ASK_TIMEOUT = 1.0  # seconds a TAB may wait for the gateway
JOURNAL_TAIL = 256 * 1024  # bytes of the newest journal segment read for request ids
MAX_REQUESTS = 50  # request ids offered, newest first


@dataclass(frozen=True)
class Choice:
    """One value a TAB may insert, and what zsh and fish show beside it."""

    value: str
    help: str | None = None


Completer = Callable[[click.Context, click.Parameter, str], list[CompletionItem]]


def script(cli: click.Command, shell: str) -> str:
    """The completion script for `shell`, for the command as the operator types it."""
    cls = get_completion_class(shell)
    if cls is None:
        raise click.BadParameter(f"no completion for {shell!r}; choose one of {', '.join(SHELLS)}")
    return cls(cli, {}, PROG, COMPLETE_VAR).source()


@click.command()
@click.argument("shell", type=click.Choice(SHELLS))
@click.pass_context
def completion(ctx: click.Context, shell: str) -> None:
    """Print the completion script for SHELL (bash, zsh or fish).

    \b
    bash: bastion completion bash > ~/.local/share/bash-completion/completions/bastion
    zsh:  bastion completion zsh > ~/.zfunc/_bastion  (with ~/.zfunc in fpath, before compinit)
    fish: bastion completion fish > ~/.config/fish/completions/bastion.fish

    It completes card ids, session ids, requests, host aliases and key labels
    from the running gateway (or, with none, from the files that need no
    passphrase)."""
    click.echo(script(ctx.find_root().command, shell), nl=False)


# -- where the answers come from ---------------------------------------------------------


def home_at(ctx: click.Context) -> Home:
    """The home the command line names. While completing, click parses without
    running `main`, so `ctx.obj` is unset: read `--home` from the parsed options."""
    root = ctx.find_root()
    if isinstance(root.obj, dict) and root.obj.get("home"):
        return Home(Path(root.obj["home"]))
    given = root.params.get("home")
    return Home(Path(given).expanduser().absolute() if given else default_home())


def ask(home: Home, name: str, **args: Any) -> Any:
    """One operator request with the completion's short timeout (raises
    GatewayNotRunning when none runs, OperatorError or OSError otherwise)."""
    return opsock.call(home.operator_socket, name, timeout=ASK_TIMEOUT, **args)


def quietly(fetch: Callable[[click.Context], Iterable[Choice]]) -> Completer:
    """A click `shell_complete` callback from `fetch`: its choices that start with
    what was typed, or none at all if anything fails. Output is swallowed too (a
    library's warning on stderr would land in the middle of the operator's line)."""

    def complete(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[Any]:
        sink = io.StringIO()
        try:
            with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
                choices = list(fetch(ctx))
        except Exception:  # a TAB must never show a traceback
            return []
        return [
            CompletionItem(c.value, help=c.help) for c in choices if c.value.startswith(incomplete)
        ]

    return complete


def _subject_help(row: dict[str, Any]) -> str:
    s = row.get("subject") or {}
    exe = os.path.basename(str(s.get("exe", "")))
    return escape_text(f"{row.get('user')}@{row.get('host')} pid {s.get('pid')} {exe}")


def cards(home: Home) -> Iterator[Choice]:
    """Cards waiting for an answer (`decide CARD_ID`)."""
    for card in ask(home, "pending", wait=0):
        yield Choice(str(card["id"]), f"{card.get('kind')}: {_subject_help(card)}")


def sessions(home: Home) -> Iterator[Choice]:
    """Live session approvals (`revoke SESSION_ID`)."""
    for row in ask(home, "sessions"):
        yield Choice(str(row["id"]), _subject_help(row))


def key_rows(home: Home) -> list[dict[str, Any]]:
    """The vault's keys: from the gateway, or from the vault file (listing
    needs no passphrase: `key list` works on a locked vault)."""
    try:
        return list(ask(home, "key_list"))
    except opsock.GatewayNotRunning:
        from bastion import ops
        from bastion.vault import Vault

        return list(ops.key_op(Vault.open(home.vault), "key_list", {}))


def key_labels(home: Home) -> Iterator[Choice]:
    """Every key's label (`key public LABEL`)."""
    for k in key_rows(home):
        yield Choice(str(k["label"]), f"{k.get('algorithm')} {k.get('fingerprint')}")


def own_key_labels(home: Home) -> Iterator[Choice]:
    """The labels an operator may manage (`key remove LABEL`): not bastion's own."""
    from bastion.vault import RESERVED_PREFIX

    return (c for c in key_labels(home) if not c.value.startswith(RESERVED_PREFIX))


def retirable_cas(home: Home) -> Iterator[Choice]:
    """The user CAs `ca retire` accepts: every one but the newest, which signs."""
    from bastion.ca import vault_ca
    from bastion.vault import KeyInfo

    cas = vault_ca.authorities([KeyInfo(**k) for k in key_rows(home)])
    return (Choice(k.label, k.fingerprint) for k in cas[:-1])


def _policy_dir(ctx: click.Context) -> tuple[Path, list[str] | None]:
    """The policy directory: the command's own `--policies` if typed, else the
    one the running gateway reads (with the hosts it sees), else HOME/policies."""
    if ctx.params.get("policies"):
        return Path(ctx.params["policies"]).expanduser(), None
    home = home_at(ctx)
    try:
        policy = ask(home, "status")["policy"]
    except opsock.GatewayNotRunning:
        return home.policies, None
    return Path(policy["directory"]), list(policy["hosts"])


def host_aliases(ctx: click.Context) -> Iterator[Choice]:
    """Policy host aliases (`check-command HOST`): what the running gateway
    sees, or what the policy files say when none runs."""
    from bastion.policy_files import load_policy_dir

    directory, hosts = _policy_dir(ctx)
    if hosts is None:
        hosts = sorted(load_policy_dir(directory).hosts)
    return (Choice(h) for h in hosts)


def host_accounts(ctx: click.Context) -> Iterator[Choice]:
    """The accounts of the host typed before (`check-command HOST USER`)."""
    from bastion.policy_files import load_policy_dir

    directory, _ = _policy_dir(ctx)
    host = load_policy_dir(directory).hosts.get(str(ctx.params.get("host")).lower())
    return (Choice(a.user, f"key {a.credential}") for a in (host.accounts if host else ()))


def _journal_tail(home: Home) -> list[Any]:
    """The records at the end of the newest journal segment: recent requests
    cheaply, whatever the journal's size. The first line read may be cut in two;
    `parse_record` refuses it."""
    from bastion import journal

    segs = journal.segments(home.journal)
    if not segs:
        return []
    with open(segs[-1], "rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(0, size - JOURNAL_TAIL))
        data = f.read(JOURNAL_TAIL)
    found = (journal.parse_record(raw) for raw in data.split(b"\n"))
    return [r for r in found if r is not None]


def request_states(home: Home) -> list[tuple[dict[str, Any], bool]]:
    """Recent requests, newest first: each as `bastion request` reads it, and
    whether it was dispatched (only a dispatched request can be killed)."""
    from bastion.core import events

    try:
        live = ask(home, "status")["boot_id"]
    except opsock.GatewayNotRunning:
        live = None
    by_request: dict[str, list[Any]] = {}
    for record in _journal_tail(home):
        rid = record.meta.get("request_id")
        if isinstance(rid, str):
            by_request.setdefault(rid, []).append(record)
    out = []
    for rid in list(reversed(by_request))[:MAX_REQUESTS]:
        state = events.request_state(by_request[rid], rid, live)
        if state is not None:
            sent = any(
                events.event_type(r) is events.EventType.DISPATCH_STARTED for r in by_request[rid]
            )
            out.append((state, sent))
    return out


def requests(home: Home) -> Iterator[Choice]:
    """Recent request ids (`request REQUEST_ID`), with what became of each."""
    for state, _ in request_states(home):
        yield Choice(state["request_id"], state["state"])


def requests_in_flight(home: Home) -> Iterator[Choice]:
    """Commands of the live gateway running now (`kill REQUEST_ID`)."""
    from bastion.core import events

    for state, sent in request_states(home):
        if sent and state["state"] == events.RequestState.IN_FLIGHT.value:
            yield Choice(state["request_id"], "in flight")


def at_home(
    fetch: Callable[[Home], Iterable[Choice]],
) -> Callable[[click.Context], Iterable[Choice]]:
    """A fetcher that needs only the home the command line names."""
    return lambda ctx: fetch(home_at(ctx))


complete_card = quietly(at_home(cards))
complete_session = quietly(at_home(sessions))
complete_key_label = quietly(at_home(key_labels))
complete_own_key_label = quietly(at_home(own_key_labels))
complete_retirable_ca = quietly(at_home(retirable_cas))
complete_request = quietly(at_home(requests))
complete_request_in_flight = quietly(at_home(requests_in_flight))
complete_host = quietly(host_aliases)
complete_account = quietly(host_accounts)
