"""The operator socket, server side: the only door a person's decisions come through.

Its guard is `admit`: the peer must have the daemon's uid (or be root), and
must not descend from any process the gateway knows as an agent -- so an
agent cannot approve itself even when it runs as the same user. What each
request does is `control.py`'s business.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from bastion.identity import descends_from, peer_credentials
from bastion.opsock import MAX_LINE, OperatorError

Handler = Callable[[dict[str, Any]], Awaitable[Any]]
Stream = Callable[[dict[str, Any]], AsyncIterator[dict[str, Any]]]


def admit(
    sock: socket.socket, daemon_uid: int, agent_processes: set[tuple[int, float]]
) -> str | None:
    """Why this peer may not speak for the operator, or None if it may."""
    pid, uid, _ = peer_credentials(sock)
    if uid not in (daemon_uid, 0):
        return f"uid {uid} is not the gateway's operator"
    if descends_from(pid, agent_processes):
        return (
            "this request comes from inside an agent's process tree; an agent cannot "
            "answer for the operator. Run it from the operator's own terminal."
        )
    return None


async def serve(
    path: Path,
    handlers: dict[str, Handler],
    streams: dict[str, Stream],
    daemon_uid: int,
    agent_processes: Callable[[], set[tuple[int, float]]],
) -> asyncio.AbstractServer:
    """Listen on `path` (mode 0600); answer requests with `handlers`, or
    follow a stream (one JSON event per line until the client leaves)."""

    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        try:
            refusal = admit(sock, daemon_uid, agent_processes())
            while line := await reader.readline():
                if refusal is not None:
                    reply: dict[str, Any] = {"ok": False, "error": f"refused: {refusal}"}
                elif (stream := _stream(line, streams)) is not None:
                    async for event in stream:
                        writer.write(json.dumps(event).encode() + b"\n")
                        await writer.drain()
                    return
                else:
                    reply = await _answer(line, handlers)
                writer.write(json.dumps(reply).encode() + b"\n")
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    old = os.umask(0o177)
    try:
        server = await asyncio.start_unix_server(client, path=str(path), limit=MAX_LINE)
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    return server


def _stream(line: bytes, streams: dict[str, Stream]) -> AsyncIterator[dict[str, Any]] | None:
    try:
        request = json.loads(line)
        return streams[request.pop("op")](request)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


async def _answer(line: bytes, handlers: dict[str, Handler]) -> dict[str, Any]:
    try:
        request = json.loads(line)
        op = request.pop("op")
        handler = handlers[op]
    except (ValueError, KeyError, TypeError, AttributeError):
        return {"ok": False, "error": "malformed operator request"}
    try:
        return {"ok": True, "result": await handler(request)}
    except OperatorError as exc:
        return {"ok": False, "error": str(exc)}
