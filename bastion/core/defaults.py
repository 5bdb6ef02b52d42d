"""Every tunable default, defined once.

The CLI shows these as its option defaults, the gateway's `Settings` and the
outbound dispatcher start from them, and docs/*.md quote them.
"""

from __future__ import annotations

APPROVAL_TIMEOUT = 120.0  # seconds a card waits for an operator's answer
COMMAND_TTL = 60.0  # seconds an approved command may wait to be sent
KEEPALIVE_INTERVAL = 15.0  # seconds between keepalives to a target
KEEPALIVE_COUNT_MAX = 3  # missed keepalives before the connection counts as lost
MAX_COMMAND_BYTES = 64 * 1024  # the longest command a card can show a person
MAX_ROUNDS = 4  # gate -> card -> gate ...: a request never loops for ever
# The shares one tenant -- a registered run, or a uid outside every run
# (gateway/tenants.py) -- may hold at once, and the ceilings over all of them.
MAX_PENDING_CARDS_PER_TENANT = 32  # cards waiting for an operator
MAX_CONNECTIONS_PER_TENANT = 256  # agent connections open (a descriptor each)
MAX_AGENT_CONNECTIONS = 4096  # agent connections open, every tenant together
MAX_RUNS_PER_UID = 256  # live registered runs (a pidfd watch each); runs do not nest
# The browser console's TCP door (gateway/console_door.py). A peer is the process that
# holds the other end of a connection (a browser's network process holds all of its
# connections; Chromium opens at most 6 per host).
CONSOLE_CONNECTIONS_PER_PEER = 32  # console connections one peer process holds open
CONSOLE_CONNECTIONS = 256  # console connections open, every peer together (at most)
CONSOLE_IDENTIFYING = 16  # connections waiting for their peer to be found; past it, closed
CONSOLE_IDLE = 60  # seconds a console connection may sit idle (bastion.toml [console])
# Descriptors (gateway/descriptors.py): the operator socket's reserve, and what the
# gateway keeps for its own files, watches and outbound connections; the agent socket
# and the console share what is left of RLIMIT_NOFILE, so they stop well before it.
RESERVE_SLOTS = 4  # operator connections that can be served with no descriptor left
RESERVE_PER_SLOT = 4  # descriptors each: the connection's own, and what its request opens
KEPT_DESCRIPTORS = 64  # for the gateway's own use, beyond the doors and the reserve
REQUESTS_REMEMBERED = 65536  # requests whose state the agent socket's `request` answers
MAX_INFLIGHT = 128  # commands dispatched at once; past it they queue (bastion.toml [limits])
QUEUE_WAIT = 30.0  # seconds a command may queue for a slot before GATEWAY_BUSY
# stdin on a command card (core/gate.Stdin): read whole before the card, so a yes is
# bound to the exact bytes the target gets. More is file transfer (scp/sftp).
MAX_CARD_STDIN = 1024 * 1024  # bytes of stdin a command card may carry
STDIN_WAIT = 3.0  # seconds of silence before an open stdin counts as sending nothing more
STDIN_DEADLINE = 30.0  # seconds the whole read may take: a trickle is not waited for
STDIN_PREVIEW = 512  # bytes of stdin a card shows, escaped like a command
# The largest write a per-command account's file card can hold: the gateway buffers it
# whole (in memory) so the operator approves its exact sha256; larger is refused.
MAX_FILE_CARD_BYTES = 64 * 1024 * 1024
# Bytes of such writes one tenant may hold in the gateway at once, over all its files and
# connections: past it a write is refused (GATEWAY_BUSY), so no agent can fill the
# gateway's memory with uploads it never closes.
MAX_HELD_BYTES_PER_TENANT = 256 * 1024 * 1024
