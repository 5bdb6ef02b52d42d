"""`bastion mcp`: serve the MCP tools on stdio (bastion/agent/mcp_front.py)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import click

from bastion.cli.agents import home_ssh_config
from bastion.cli.common import fail, home_of


@click.command("mcp")
@click.option(
    "--ssh-config",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="The agents' ssh_config (`bastion ssh-config`); default: made from the home.",
)
@click.option(
    "--agent-socket",
    type=click.Path(path_type=Path),
    default=None,
    help="The gateway's agent socket; default: the one --ssh-config names, else the home's.",
)
@click.option(
    "--max-output",
    type=click.IntRange(1024, 64 << 20),
    default=256 * 1024,
    show_default=True,
    help="Bytes of stdout and of stderr kept per command (half from the start, half from "
    "the end); the result says the true size and whether bytes were cut.",
)
@click.pass_context
def mcp(
    ctx: click.Context, ssh_config: Path | None, agent_socket: Path | None, max_output: int
) -> None:
    """An MCP server on stdio for agents that speak MCP: tools ssh_exec, ssh_hosts
    and request_status, through the same gate, cards and journal as ssh.

    An MCP client starts it as {"command": "bastion", "args": ["mcp"]}; the
    client process is the subject the operator approves in `bastion approve`.

    Nothing a tool call sends becomes an ssh option or a local command: host
    and user must be names as ssh_hosts lists them, and the command goes after
    `--` and the destination. A call it refuses is UNSUPPORTED_REQUEST."""
    try:
        from bastion.agent import client, mcp_front
    except ImportError as exc:
        fail(f"`bastion mcp` needs the MCP SDK ({exc.name}): pip install 'bastion[mcp]'")
    home = home_of(ctx)
    with tempfile.TemporaryDirectory(prefix="bastion-mcp-") as tmp:
        if ssh_config is None:
            ssh_config = Path(tmp) / "ssh_config"
            # No per-host User lines: each call asks the gateway for the host's account,
            # so a policy that is broken when the client starts the server stops nothing.
            text = home_ssh_config(home, None, agent_socket, origin="bastion mcp", with_users=False)
            ssh_config.write_text(text)
        elif not ssh_config.is_file():
            fail(f"no ssh_config at {ssh_config} (make one with `bastion ssh-config`)")
        sock = agent_socket or client.socket_of(ssh_config) or home.agent_socket
        server = mcp_front.build(mcp_front.Front(ssh_config, sock.absolute(), max_output))
        print(f"bastion mcp: serving on stdio; agent socket {sock}", file=sys.stderr)
        server.run("stdio")
