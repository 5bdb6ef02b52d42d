"""The gateway's TCP connections to targets acknowledge what they read at once.

OpenSSH's sshd turns Nagle's algorithm off (TCP_NODELAY) only when a session
starts (`do_exec`). Until then, each small packet it writes waits until the
client has acknowledged the one before, and Linux delays an acknowledgement up
to 40 ms when it has nothing of its own to send. After a login sshd writes
two packets of its own (a debug message and `hostkeys-00@openssh.com`), and the
answer to the first channel open then waited for the client's delayed ACK:
measured against the fixture sshd, the first command on a new connection took
47 ms and the second 3 ms; with every read acknowledged at once, 4 ms and 3 ms.
A certificate account logs in for every command, so it paid those 40 ms every
time (bench/README.md, issue 23); a pooled connection paid them once.

So every outbound connection sets TCP_QUICKACK after each read, which sends
the pending acknowledgement now (Linux resets the flag by itself, hence after
each read). What it costs: one setsockopt per read, and an ACK sent a little
earlier than Linux would have sent it.

`AckAtOnce` is handed to asyncssh as its `tunnel`: asyncssh calls a tunnel's
`create_connection(factory, host, port)` to make the transport, which lets
this module wrap the protocol before the event loop (uvloop, which reads a
protocol's `data_received` once) sees it.
`tests/integration/test_outbound_acks.py` holds asyncssh to that.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable
from typing import Any

QUICKACK = getattr(socket, "TCP_QUICKACK", None)  # Linux only; elsewhere nothing is done


def acking(protocol: asyncio.Protocol) -> asyncio.Protocol:
    """`protocol`, acknowledging each read at once: its `connection_made` learns the
    socket, its `data_received` sets TCP_QUICKACK before handing the data on."""
    made, received = protocol.connection_made, protocol.data_received  # type: ignore[attr-defined]
    sock: Any = None

    def connection_made(transport: asyncio.BaseTransport) -> None:
        nonlocal sock
        sock = transport.get_extra_info("socket")
        made(transport)

    def data_received(data: bytes, *args: Any) -> None:
        if sock is not None:
            # OSError: the connection is going; asyncssh hears of it from the transport
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, QUICKACK, 1)
        received(data, *args)

    protocol.connection_made = connection_made  # type: ignore[method-assign]
    protocol.data_received = data_received  # type: ignore[attr-defined]
    return protocol


class AckAtOnce:
    """asyncssh's `tunnel` for a plain TCP connection whose reads are acknowledged at
    once (module docstring). Where the platform has no TCP_QUICKACK, a plain one."""

    async def create_connection(
        self, factory: Callable[[], asyncio.Protocol], host: str, port: int
    ) -> tuple[asyncio.BaseTransport, asyncio.Protocol]:
        loop = asyncio.get_running_loop()
        make = factory if QUICKACK is None else (lambda: acking(factory()))
        return await loop.create_connection(make, host, port)

    def __repr__(self) -> str:
        return "TCP, ACKs at once"


ACK_AT_ONCE = AckAtOnce()
