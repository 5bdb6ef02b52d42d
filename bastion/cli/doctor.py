"""`bastion doctor`: one line per check, ✓ / ✗ / ! / -, and the fix for what is wrong.

The checks and their verdicts are `bastion.doctor`'s; this module only gathers
the one input that belongs to the CLI (the ssh config `bastion ssh-config`
would print, so the installed ssh client is asked about exactly that) and prints.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import click

from bastion.cli.common import HOST_KEY_ALIAS, home_of
from bastion.home import Home

if TYPE_CHECKING:
    from bastion.ops.doctor import Check

MARKS = {"ok": "✓", "fail": "✗", "warn": "!", "skip": "-"}


def line(check: Check) -> str:
    """One check, one line; the fix only where something is wrong. Escaped: details
    carry text from outside (error messages, host names, paths)."""
    from bastion.core.display import escape_text

    text = f"{MARKS[check.status.value]} {check.name:<14} {check.detail}"
    if check.fix and check.status.value in ("fail", "warn"):
        text += f" -- fix: {check.fix}"
    return escape_text(text)


def render(checks: Iterable[Check]) -> str:
    return "\n".join(line(c) for c in checks)


def agent_ssh_config(home: Home) -> str:
    """What `bastion ssh-config` prints for this home (without the per-host entries,
    which only add a `User`): the options the agents' ssh client must accept."""
    from bastion.agent import proxy as proxy_mod
    from bastion.cli.agents import pinned_host_key, ssh_config_text

    try:
        pinned = pinned_host_key(home)
    except OSError:  # `ssh -G` never runs KnownHostsCommand; the mode check names the file
        pinned = [HOST_KEY_ALIAS, "ssh-ed25519", "AAAA"]
    argv = (sys.executable, "-I", "-S", proxy_mod.__file__, "--socket", str(home.agent_socket))
    return ssh_config_text({}, pinned, argv, "bastion doctor")


@click.command()
@click.option("--json", "as_json", is_flag=True)
@click.option(
    "--policies",
    type=click.Path(path_type=Path),
    default=None,
    help="Policy directory (default: the running gateway's, else HOME/policies).",
)
@click.option(
    "--timeout",
    type=click.FloatRange(0.5, 60),
    default=5.0,
    show_default=True,
    help="Seconds each policy host's sshd has to show its host key.",
)
@click.pass_context
def doctor(ctx: click.Context, as_json: bool, policies: Path | None, timeout: float) -> None:
    """Check the setup: the ssh client, the gateway and the vault, isolation, file
    modes, bastion.toml, the policy and the host key each host presents, the
    witness and the keyring. One line per check with the fix; exit 1 if any failed.
    Nothing is authenticated or sent to a host: doctor only reads its host key."""
    from bastion.ops.doctor import gather, run_checks, summary

    home = home_of(ctx)
    directory = policies.absolute() if policies else None
    checks = run_checks(gather(home, agent_ssh_config(home), timeout, directory))
    status = summary(checks)
    if as_json:
        doc = {"ok": status == 0, "checks": [c.as_json() for c in checks]}
        click.echo(json.dumps(doc, indent=2))
    else:
        click.echo(render(checks))
    if status:
        failed = ", ".join(c.name for c in checks if c.status.value == "fail")
        click.echo(f"bastion: doctor: failed: {failed}; each check names its fix", err=True)
    sys.exit(status)
