"""`bastion check-command HOST USER 'COMMAND'`: what the policy says, before an agent asks.

Offline (no gateway, no passphrase): it reads the policy files and runs the
gate's own policy step (`core.gate.assess`) -- the same function the live
gateway calls -- and prints how the command reads (an argv, or shell source
with its constructs), which rule decided, and what the agent would meet:
a denial, a command card, or no command card (after the session card a new
process always gets). When only options kept an `allow` or `preapproved` rule
from matching (a glob or `...` never covers a word beginning with `-`), it
names each option and the rule word that would have matched it; and it warns
about the account's rules that spell an option known to run a program
(core/options.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from bastion.cli.common import home_of
from bastion.cli.completion import complete_account, complete_host


def verdict_of(policy_dir: Path, host: str, user: str, command: bytes) -> dict[str, Any]:
    """The policy's verdict as data (also what `--json` prints)."""
    from bastion.core.gate import assess, malformed, policy_unavailable, validate_command
    from bastion.core.options import warnings
    from bastion.core.policy import PolicyError
    from bastion.policy_files import load_policy_dir

    out: dict[str, Any] = {
        "host": host,
        "user": user,
        "command": command.decode("utf-8", "backslashreplace"),
        "argv": None,
        "shell_syntax": [],
        "rule": None,
        "preapproved": None,
        "verdict": "denied",
        "code": None,
        "reason": "",
        "unspelled_options": [],  # {field, rule, index, word, rule_word}
        "warnings": [],
    }
    problem = validate_command(command)
    if problem is not None:
        return {**out, "code": malformed(problem).code.value, "reason": problem}
    try:
        policy = load_policy_dir(policy_dir)
    except PolicyError as exc:
        return {**out, "code": policy_unavailable().code.value, "reason": str(exc)}
    judged = assess(policy, host, user, command)
    if judged.account is not None:
        account = judged.account
        out["warnings"] = [
            *warnings("allow", account.allow or ()),
            *warnings("preapproved", account.preapproved),
        ]
    if judged.check is not None:
        reading = judged.check.reading
        out["argv"] = list(reading.argv) if reading.argv is not None else None
        out["shell_syntax"] = [c.as_json() for c in reading.constructs]
        out["rule"] = judged.check.rule
        out["reason"] = judged.check.reason
        out["unspelled_options"] = [
            {"field": "allow", **u.as_json()} for u in judged.check.unspelled
        ]
    if judged.deny is not None:
        return {**out, "code": judged.deny.code.value, "reason": judged.deny.message}
    out["preapproved"] = judged.preapproved
    argv = judged.check.reading.argv if judged.check is not None else None
    if judged.command_card and argv is not None and judged.account is not None:
        out["unspelled_options"] = [  # why no preapproved rule spares the card
            {"field": "preapproved", **u.as_json()}
            for rule in judged.account.preapproved
            for u in rule.unspelled(argv)
        ]
    out["verdict"] = "command_card" if judged.command_card else "no_command_card"
    return out


def _human(v: dict[str, Any]) -> str:
    from bastion.core.display import escape_text

    if v["argv"] is not None:
        reads = "argv " + json.dumps(v["argv"])
    elif v["shell_syntax"]:
        reads = "shell source: " + ", ".join(
            f"{c['text']!r} at byte {c['offset']} ({c['what']})" for c in v["shell_syntax"]
        )
    else:
        reads = "-"
    if v["verdict"] == "denied":
        what = f"denied {v['code']}: {v['reason']}"
    elif v["verdict"] == "command_card":
        what = "a command card for this exact command (after the session card)"
    else:
        spared = f' (preapproved by "{v["preapproved"]}")' if v["preapproved"] else ""
        what = f"no command card{spared}: runs once the process is approved for the session"
    lines = [
        f"command:  {escape_text(v['command'])}",
        f"reads as: {escape_text(reads)}",
        f"rule:     {escape_text(v['rule'] or '-')}",
        f"verdict:  {escape_text(what)}",
    ]
    for u in v["unspelled_options"]:
        lines.append(
            f"option:   {escape_text(repr(u['word']))} (word {u['index'] + 1}) is an option: "
            f"{escape_text(repr(u['rule_word']))} in {u['field']} rule "
            f'"{escape_text(u["rule"])}" would match it otherwise; spell it in the rule, '
            "or use an option pattern such as -*"
        )
    lines += [f"warning:  {escape_text(w)}" for w in v["warnings"]]
    return "\n".join(lines)


@click.command("check-command")
@click.argument("host", shell_complete=complete_host)
@click.argument("user", shell_complete=complete_account)
@click.argument("command")
@click.option(
    "--policies",
    type=click.Path(path_type=Path),
    default=None,
    help="Policy directory (default: HOME/policies).",
)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def check_command(
    ctx: click.Context, host: str, user: str, command: str, policies: Path | None, as_json: bool
) -> None:
    """What the policy says of COMMAND as USER on HOST: how it reads (argv or shell
    source), which rule decides, and whether it is denied, needs a command card,
    or needs none. Offline; exit 0 unless the command would be denied."""
    directory = (policies or home_of(ctx).policies).absolute()
    verdict = verdict_of(directory, host.lower(), user, command.encode("utf-8", "surrogateescape"))
    click.echo(json.dumps(verdict, indent=2) if as_json else _human(verdict))
    sys.exit(1 if verdict["verdict"] == "denied" else 0)
