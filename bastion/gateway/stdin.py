"""An agent's stdin, read whole before its command card, then fed to the target.

A command card approves exact bytes: the command, and -- when the gate asks one
(`core/gate.reads_stdin`) -- what the command reads on stdin, so a yes for
`ssh host sh` is a yes for one script, not for whatever is piped after it. Here
the gateway reads the agent's stdin up to its end (EOF), bounded in size
(`MAX_CARD_STDIN`) and in time, and says what it saw (`core/gate.Stdin`); the
gate and the card decide what that means. The target then gets exactly the
bytes read, and EOF (`Fed`): nothing the agent sends later reaches it.

Waiting for an end: `ssh -n`, `< /dev/null` and a pipe whose writer exits send
EOF at once. A script's `ssh host ls` often inherits a stdin its parent keeps
open and never writes to, and an ssh run from a terminal reads the terminal:
those send nothing and no EOF. After `STDIN_WAIT` seconds of silence with
nothing sent, the read ends `SILENT`: the card says the command gets no stdin,
and it gets none (EOF) -- what was approved is all the target gets. Silence
after some bytes (`UNFINISHED`), a read longer than `STDIN_DEADLINE`, or more
than the bound (`TOO_LARGE`) is never shown as if it were whole: the gate
refuses it. Nothing of the content is logged or journaled.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import asyncssh

from bastion.core.defaults import MAX_CARD_STDIN, STDIN_DEADLINE, STDIN_WAIT
from bastion.core.stdin import Stdin, StdinEnd

CHUNK = 64 * 1024
# What asyncssh raises from an agent's stdin for a signal, break or window-change
# request: never data, and never the end of it (the relay must go on to the EOF).
CHANNEL_REQUESTS = (asyncssh.SignalReceived, asyncssh.BreakReceived, asyncssh.TerminalSizeChanged)


class Fed:
    """A stdin reader that gives the bytes that were read and approved, then EOF:
    what the outbound relay reads in place of the agent's stream."""

    def __init__(self, data: bytes) -> None:
        self._data = memoryview(data)
        self._at = 0

    async def read(self, n: int = -1) -> bytes:
        size = len(self._data) - self._at if n < 0 else n
        piece = bytes(self._data[self._at : self._at + size])
        self._at += len(piece)
        return piece


@dataclass(frozen=True)
class Taken:
    """What was read of an agent's stdin, and the streams to relay with from now on:
    the agent's, with stdin replaced by the bytes read (`Fed`)."""

    stdin: Stdin
    streams: Any


async def read_whole(
    reader: Any,
    limit: int = MAX_CARD_STDIN,
    wait: float = STDIN_WAIT,
    deadline: float = STDIN_DEADLINE,
    clock: Callable[[], float] = time.monotonic,
) -> tuple[bytes, StdinEnd]:
    """Read `reader` to its EOF, at most `limit` bytes (one more says it is larger),
    giving up after `wait` seconds with nothing new or `deadline` seconds in all."""
    chunks: list[bytes] = []
    size = 0
    until = clock() + deadline
    while True:
        left = min(wait, until - clock())
        if left <= 0:
            return b"".join(chunks), StdinEnd.UNFINISHED if size else StdinEnd.SILENT
        try:
            data = await asyncio.wait_for(reader.read(min(CHUNK, limit + 1 - size)), left)
        except TimeoutError:  # silence, or the deadline: what came is not all of it
            return b"".join(chunks), StdinEnd.UNFINISHED if size else StdinEnd.SILENT
        except CHANNEL_REQUESTS:  # not data, never its end (agent_channel refuses them)
            continue
        except (OSError, asyncssh.Error):  # the agent's channel failed: never seen whole
            return b"".join(chunks), StdinEnd.UNFINISHED
        if not data:
            return b"".join(chunks), StdinEnd.CLOSED
        chunks.append(data)
        size += len(data)
        if size > limit:
            return b"".join(chunks), StdinEnd.TOO_LARGE


async def take(streams: Any) -> Taken:
    """Read the agent's stdin (`streams.stdin`, an `outbound.Streams`) whole, and the
    streams the target is relayed with: the bytes read, then EOF."""
    data, end = await read_whole(streams.stdin)
    return Taken(Stdin.of(data, end), replace(streams, stdin=Fed(data)))
