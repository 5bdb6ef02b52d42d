"""The agent's side of the trust boundary: code that runs as the agent.

Everything here runs in the agent's own process tree, with the agent's uid and
whatever the agent can read: `proxy` (the ProxyCommand helper, standard library
only, started by path), `wire` (what the proxy and the gateway say before SSH,
both sides' one copy), `client` (one command through the stock ssh client, for
programs that are not a shell), `mcp_front` (`bastion mcp`) and `sftp_wire` (the
sftp client the MCP door's file tools speak). None of it
holds a key, reads the vault or the journal, or decides anything: it asks the
gateway over the agent socket and carries the answer back, and the codes it
may say come from `core/` (`tests/unit/test_architecture.py` holds it to that).
"""
