"""`bastion isolate setup` and `bastion isolate check`: strong isolation in one command.

Setup (root) creates the agent user and the socket directory, writes the
proxy and the agents' ssh config there, then tries, as the agent user, to
read everything it must not and to reach everything it must; only when every
check passes does it record `isolation.json`, which `bastion daemon` and
`bastion run --isolated` read. Check says, in sentences, which guarantees
hold in the current mode (`bastion.isolation.guarantees`).
"""

from __future__ import annotations

import grp
import os
import re
import shlex
from pathlib import Path
from typing import Any

import click

from bastion import sandbox
from bastion.cli.agents import refresh_agent_files
from bastion.cli.common import emit, fail, home_of
from bastion.home import Home
from bastion.ops import opsock
from bastion.sandbox import isolation
from bastion.sandbox.isolation import Isolation, IsolationError
from bastion.sandbox.threat_model import LIMIT

USER_NAME = re.compile(r"[a-z_][a-z0-9_-]{0,30}")

# What each check says when it holds, and how to make it hold.
LABELS = {
    "home": ("cannot list the home", "chmod 700 {home}"),
    "vault": ("cannot read the vault", "chmod 600 {vault}; chmod 700 {home}"),
    "policies": ("cannot read or change the policies", "chmod -R go-rwx {policies}"),
    "journal": ("cannot read or change the journal", "chmod -R go-rwx {journal}"),
    "host_key": ("cannot read the gateway's host key", "chmod 600 {host_key}"),
    "operator_socket": ("cannot connect to the operator socket", "chmod 700 {run}"),
    "gateway_memory": (
        "cannot read the gateway's memory",
        "run `bastion daemon` as the operator (uid {operator}), not as {user}",
    ),
    "socket_dir": (
        "can reach the socket directory, the proxy, the ssh config and {python}",
        "every directory above {dir} must be searchable by {user} (chmod o+x DIR) "
        "and {python} executable by it",
    ),
    "agent_socket": (
        "can connect to the agent socket",
        "restart `bastion daemon`: it reads isolation.json and opens the socket to {group}",
    ),
    "sealed": (
        "cannot change the socket directory, the proxy or the ssh config",
        "take away what lets {user} write there (an ACL: setfacl -b PATH), then run this again",
    ),
}


def _sudo(home: Home, rest: str) -> str:
    return f"sudo bastion --home {shlex.quote(str(home.root))} {rest}"


def _gateway(home: Home) -> dict[str, Any] | None:
    try:
        status: dict[str, Any] = opsock.call(home.operator_socket, "status", timeout=5)
        return status
    except opsock.OperatorError:
        return None


def _fill(text: str, home: Home, iso: Isolation) -> str:
    return text.format(
        home=home.root,
        vault=home.vault,
        policies=home.policies,
        journal=home.journal,
        host_key=home.host_key,
        run=home.run,
        operator=iso.operator_uid,
        user=iso.user,
        group=iso.group,
        dir=iso.socket_dir,
        python=iso.python,
    )


@click.group()
def isolate() -> None:
    """Strong isolation: agents as their own user, who can reach the agent
    socket and nothing else of bastion."""


@isolate.command()
@click.option(
    "--user",
    "user",
    default=isolation.DEFAULT_USER,
    show_default=True,
    help="The agents' system user (created with a group of its own if missing).",
)
@click.option(
    "--socket-dir",
    type=click.Path(path_type=Path),
    default=None,
    help="The agents' door: agent socket, proxy, ssh config "
    "(default: /run/bastion-<operator uid>). Every directory above it must be searchable.",
)
@click.option(
    "--python",
    default=isolation.SYSTEM_PYTHON,
    show_default=True,
    help="The interpreter agents run the proxy with.",
)
@click.pass_context
def setup(ctx: click.Context, user: str, socket_dir: Path | None, python: str) -> None:
    """Create the agent user and its socket directory, check what that user
    can reach, and record it for `bastion daemon` and `bastion run --isolated`.
    Needs root. Safe to run again: after a reboot (/run is emptied) or a change
    of the policy's hosts (`run --isolated` also refreshes the ssh config)."""
    home = home_of(ctx)
    if os.geteuid() != 0:
        fail(
            "`isolate setup` creates a system user and the agents' socket directory, so it "
            f"needs root. Run it with sudo, naming your home: {_sudo(home, 'isolate setup')}"
        )
    if not home.exists():
        fail(
            f"{home.root} is not initialised (no vault there). Under sudo, name your home: "
            "sudo bastion --home ~/.local/share/bastion isolate setup"
        )
    if not USER_NAME.fullmatch(user):
        fail(f"{user!r} is not a user name useradd accepts ([a-z_][a-z0-9_-]*, 32 at most)")
    operator = os.stat(home.root).st_uid
    try:
        pw, created = isolation.ensure_user(user)
    except IsolationError as exc:
        fail(str(exc))
    if pw.pw_uid in (0, operator) or pw.pw_gid == 0:
        fail(f"{user} is uid {pw.pw_uid} gid {pw.pw_gid}: agents need a uid and group of their own")
    group = grp.getgrgid(pw.pw_gid).gr_name
    directory = (socket_dir or isolation.default_socket_dir(operator)).absolute()
    iso = Isolation(user, pw.pw_uid, group, pw.pw_gid, operator, directory, python)
    made = " (created now)" if created else ""
    click.echo(f"agent user:  {user} (uid {iso.uid}), group {group} (gid {iso.gid}){made}")
    try:
        isolation.prepare_socket_dir(directory, operator, iso.gid)
        warning = refresh_agent_files(home, iso)
    except (OSError, IsolationError) as exc:
        fail(f"cannot prepare {directory}: {exc}")
    click.echo(f"socket dir:  {directory} (owner uid {operator}, group {group}, mode 2750)")
    click.echo(f"ssh config:  {iso.ssh_config} (agents: ssh -F {iso.ssh_config} HOST 'COMMAND')")
    if warning:
        click.echo(f"warning:     {warning}")
    gateway = _gateway(home)
    try:
        checks = isolation.probe(home, iso, gateway["pid"] if gateway else None)
    except IsolationError as exc:
        fail(str(exc))
    click.echo(f"checks, tried as {user}:")
    for c in checks:
        label, fix = LABELS[c.key]
        click.echo(f"  {'ok  ' if c.ok else 'FAIL'}  {_fill(label, home, iso)}")
        if not c.ok:
            click.echo(f"        {c.detail}\n        fix: {_fill(fix, home, iso)}")
    if any(not c.ok for c in checks):
        kept = ""
        if home.isolation.exists():
            home.isolation.unlink()
            kept = f"; {home.isolation} removed, so `bastion daemon` starts in advisory mode"
        fail(f"isolation is not set up: fix what failed and run this again{kept}")
    isolation.save(home, iso)
    click.echo(f"recorded:    {home.isolation}")
    if gateway is not None and gateway.get("agent_socket") != str(iso.agent_socket):
        click.echo(
            f"the running gateway listens at {gateway.get('agent_socket')} "
            f"({gateway.get('isolation')}): restart `bastion daemon` to use {iso.agent_socket}"
        )
    click.echo(
        "next:        `bastion daemon` (as yourself) listens there; start agents with "
        f"{_sudo(home, 'run --isolated -- CMD...')}; see them with `bastion isolate check`"
    )


@isolate.command()
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def check(ctx: click.Context, as_json: bool) -> None:
    """Which guarantees hold in the current mode, each ok or NOT HELD (exit 1
    unless all hold). As root the checks are tried as the agent user; otherwise
    they are judged from file modes."""
    home = home_of(ctx)
    if not home.exists():
        fail(f"{home.root} is not initialised; run `bastion init` (or name your home: --home)")
    try:
        iso = isolation.load(home)
    except IsolationError as exc:
        fail(str(exc))
    gateway = _gateway(home)
    notes: list[str] = []
    if gateway is not None:
        mode = str(gateway["isolation"])
        if iso is not None and gateway.get("agent_socket") != str(iso.agent_socket):
            notes.append(
                "the running gateway was started without isolation.json: restart `bastion daemon`"
            )
        elif iso is not None and mode == "advisory":
            notes.append("a process of the gateway's own uid has used the agent socket")
    else:
        mode = "strong" if iso is not None else "advisory"
        notes.append("the gateway is not running: this is the mode it starts in")
    if iso is None:
        notes.append(f"no isolation.json: for strong isolation, {_sudo(home, 'isolate setup')}")
    checks: dict[str, bool] = {}
    how = None
    pid = gateway["pid"] if gateway else None
    if mode != "strong":
        checks = {"gateway_memory": isolation.memory_sealed(pid)} if pid else {}
    elif iso is not None:
        if os.geteuid() == 0:
            try:
                checks = {c.key: c.ok for c in isolation.probe(home, iso, pid)}
            except IsolationError as exc:
                fail(str(exc))
            how = f"tried as {iso.user}"
        else:
            checks = isolation.permission_checks(home, iso, pid)
            how = f"judged from file modes (as root they are tried as {iso.user})"
    rows = isolation.guarantees(mode, iso.uid if iso else None, checks, sandbox.machine())
    notes.append(f"limit: {LIMIT}")
    doc = {
        "mode": mode,
        "gateway_running": gateway is not None,
        "isolation": iso.as_json() if iso else None,
        "checks": checks,
        "checked": how,
        "notes": notes,
        "guarantees": [{"guarantee": text, "held": held} for text, held in rows],
    }

    def human(d: dict[str, Any]) -> str:
        lines = [f"mode:      {d['mode']}"]
        if iso is not None:
            lines.append(f"agents:    {iso.user} (uid {iso.uid}), socket {iso.agent_socket}")
        if how:
            lines.append(f"checks:    {how}")
        lines += [f"note:      {n}" for n in notes]
        lines += [f"{'ok' if held else 'NOT HELD':<9} {text}" for text, held in rows]
        return "\n".join(lines)

    emit(doc, as_json, human)
    if not all(held for _, held in rows):
        raise SystemExit(1)
