"""`bastion daemon`: run the gateway in the foreground (bastion/gateway/lifetime.py).

Before the gateway starts, the home is read for what the gateway reads first, so
that a damaged home stops it with one sentence naming the file, not a traceback.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import click

from bastion.cli.common import fail, home_of
from bastion.core import defaults
from bastion.home import Home

if TYPE_CHECKING:
    from bastion.sandbox.isolation import Isolation


@click.command()
@click.option(
    "--policies",
    type=click.Path(path_type=Path),
    default=None,
    help="Policy directory (default: HOME/policies).",
)
@click.option(
    "--agent-socket",
    type=click.Path(path_type=Path),
    default=None,
    help="Agent socket path (default: HOME/run/agent.sock).",
)
@click.option(
    "--agent-group",
    default=None,
    help="Group allowed to connect to the agent socket (agents as another user).",
)
@click.option(
    "--approval-timeout",
    type=click.FloatRange(min=0.1),
    default=defaults.APPROVAL_TIMEOUT,
    show_default=True,
    help="Seconds a card waits for an answer.",
)
@click.option(
    "--command-ttl",
    type=click.FloatRange(min=0.1),
    default=defaults.COMMAND_TTL,
    show_default=True,
    help="Seconds an approved command may wait to be sent.",
)
@click.option(
    "--keepalive",
    type=click.FloatRange(min=0.1),
    default=defaults.KEEPALIVE_INTERVAL,
    show_default=True,
    help=f"Seconds between keepalives to targets ({defaults.KEEPALIVE_COUNT_MAX} missed = "
    "connection lost).",
)
@click.option(
    "--wrapper",
    "wrappers",
    multiple=True,
    metavar="NAME",
    help="Another executable the subject walk passes over like a shell (repeatable).",
)
@click.option(
    "--terminal-host",
    "--session-host",  # its name before issue 19
    "terminal_hosts",
    multiple=True,
    metavar="NAME",
    help="Another executable the subject walk never climbs into, like tmux: a name or a "
    "glob over the executable's name, e.g. 'emacs-*' (repeatable).",
)
@click.pass_context
def daemon(
    ctx: click.Context,
    policies: Path | None,
    agent_socket: Path | None,
    agent_group: str | None,
    approval_timeout: float,
    command_ttl: float,
    keepalive: float,
    wrappers: tuple[str, ...],
    terminal_hosts: tuple[str, ...],
) -> None:
    """Run the gateway in the foreground. It starts locked.

    Without --agent-group and --agent-socket it uses HOME/isolation.json when
    `bastion isolate setup` wrote one (strong isolation), else it runs in
    advisory mode."""
    from bastion.gateway.lifetime import Settings, run_daemon

    home = home_of(ctx)
    if not home.exists():
        fail(f"{home.root} is not initialised; run `bastion init` first")
    _startable(home)
    gid = None
    if agent_group is not None:
        import grp

        try:
            gid = grp.getgrnam(agent_group).gr_gid
        except KeyError:
            fail(f"no group named {agent_group!r}")
    elif agent_socket is None and (iso := _isolation_of(home)) is not None:
        gid, agent_socket = iso.gid, iso.agent_socket
        click.echo(
            f"bastion: strong isolation ({home.isolation}): agents run as {iso.user} "
            f"(uid {iso.uid}); group {iso.group} may reach {iso.agent_socket}",
            err=True,
        )
    sock = (agent_socket or home.agent_socket).absolute()
    if agent_group is not None:
        click.echo(f"bastion: strong isolation: group {agent_group} may reach {sock}", err=True)
    elif gid is None:
        click.echo(
            f"bastion: advisory isolation: agents run as this user (uid {os.getuid()}); for "
            f"strong isolation: sudo bastion --home {home.root} isolate setup",
            err=True,
        )
    run_daemon(
        Settings(
            home=home,
            policies=(policies or home.policies).absolute(),
            agent_socket=sock,
            agent_group=gid,
            approval_timeout=approval_timeout,
            command_approval_ttl=command_ttl,
            keepalive_interval=keepalive,
            wrappers=frozenset(wrappers),
            terminal_hosts=frozenset(terminal_hosts),
        )
    )


def _startable(home: Home) -> None:
    """Read what the gateway reads first -- the vault, the journal identity it pins,
    the SSH host key -- so that a damaged home stops the daemon with one sentence
    naming the file, not a traceback. The gateway reads them again for itself."""
    import asyncssh

    from bastion.journal import JournalError, read_identity
    from bastion.ops import identity_pin
    from bastion.vault import Vault, VaultError

    restore = f"restore it from a backup of {home.root}, or move that home aside and run "
    stop = "`bastion init` for a new one; the gateway does not start"
    identity = home.journal / "identity.json"
    if not identity.is_file():
        fail(f"no journal identity at {identity}: {restore}{stop}")
    try:
        read_identity(home.journal, identity_pin(Vault.open(home.vault)))
    except VaultError as exc:
        fail(f"{exc}; the gateway does not start")
    except JournalError as exc:
        fail(f"{exc}: {restore}{stop}")
    try:
        asyncssh.read_private_key(str(home.host_key))
    except (OSError, asyncssh.KeyImportError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else str(exc)
        fail(f"cannot read the gateway's SSH host key {home.host_key} ({why}): {restore}{stop}")


def _isolation_of(home: Home) -> Isolation | None:
    """What `isolate setup` recorded, if it did, with its socket directory checked."""
    import stat

    from bastion.sandbox import isolation

    try:
        iso = isolation.load(home)
    except isolation.IsolationError as exc:
        fail(str(exc))
    if iso is None:
        return None
    again = f"run `sudo bastion --home {home.root} isolate setup` again"
    try:
        st = os.lstat(iso.socket_dir)
    except OSError:
        fail(f"{iso.socket_dir} is gone (/run is emptied at boot): {again}")
    if (
        not stat.S_ISDIR(st.st_mode)
        or st.st_gid != iso.gid
        or not os.access(iso.socket_dir, os.W_OK)
    ):
        fail(
            f"{iso.socket_dir} is not the agents' directory (group {iso.group}, writable): {again}"
        )
    return iso
