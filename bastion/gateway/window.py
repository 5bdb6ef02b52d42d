"""SSH flow control that holds: a channel's window opens only for bytes passed on.

A relay reads one leg as fast as it can write the other. When the reader falls
behind, asyncssh pauses the channel and keeps what still arrives (up to the window)
in the channel's buffer -- but the first packet it delivers on resuming sends a
window adjust for everything received, the bytes still buffered included. A fast
sender then fills the window again on top of them, at every resume: measured
(issue 23), a 200 MB `cat` from a quick target to a slower agent held 113 MB in the
target channel's buffer at once, and the gateway's RSS went from 45 MB to 200 MB.
(The same mistake, and its fix, in Apache MINA sshd: apache/mina-sshd#292.)

`deliver_held` fixes the credit: when a packet is delivered, the bytes still buffered
count as not yet given back, so the peer may have at most one window in flight and
in the buffer together. The bound per channel is then the window (2 MiB) plus what
the stream above holds (asyncssh's limit: one window).
"""

from __future__ import annotations

from typing import Any

import asyncssh
from asyncssh.channel import SSHChannel


def deliver_held(self: Any, data: Any, datatype: Any) -> None:
    """A channel class's `_deliver_data` (asyncssh's own, but for the window adjust):
    the adjust sent as a packet is delivered leaves out what is still buffered behind
    it. A function, not a mixin: asyncssh's channels are re-classed to a subclass,
    which must add nothing to their layout."""
    # asyncssh pops a buffered packet before delivering it: what is left is held.
    held = sum(len(d) for d, _ in self._recv_buf)
    self._recv_window += held
    try:
        SSHChannel._deliver_data(self, data, datatype)
    finally:
        self._recv_window -= held


class HeldClientChannel(asyncssh.SSHClientChannel):  # type: ignore[type-arg]
    """The outbound exec channel, with the window that holds."""

    _deliver_data = deliver_held


def hold(channel: asyncssh.SSHClientChannel[Any]) -> None:
    """Give an outbound channel asyncssh made the window that holds (its class only
    adds that: the agent channel is re-classed the same way, agent_ssh.py)."""
    if type(channel) is asyncssh.SSHClientChannel:
        channel.__class__ = HeldClientChannel
