"""The operator socket: one JSON request per line, one JSON answer per line.

This is the only door through which a person's decisions reach the
gateway. Its guard is in `admit`: the peer must have the daemon's uid (or be
root), and must not descend from any process the gateway knows as an agent
-- so an agent cannot approve itself even when it runs as the same user.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from bastion.identity import descends_from, peer_credentials

MAX_LINE = 1 << 20

Handler = Callable[[dict[str, Any]], Awaitable[Any]]


class OperatorError(Exception):
    """An operator request failed; the message is for a person to read."""


class GatewayNotRunning(OperatorError):
    pass


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
    daemon_uid: int,
    agent_processes: Callable[[], set[tuple[int, float]]],
) -> asyncio.AbstractServer:
    """Listen on `path` (mode 0600) and answer requests with `handlers`."""

    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        try:
            refusal = admit(sock, daemon_uid, agent_processes())
            while line := await reader.readline():
                if refusal is not None:
                    reply: dict[str, Any] = {"ok": False, "error": f"refused: {refusal}"}
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


def call(path: Path, op: str, timeout: float = 30.0, **args: Any) -> Any:
    """Send one request to a running gateway and return its result."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(path))
    except (FileNotFoundError, ConnectionRefusedError) as exc:
        sock.close()
        raise GatewayNotRunning(
            f"the gateway is not running (no operator socket at {path}); start it with "
            "`bastion daemon`"
        ) from exc
    with sock, sock.makefile("rwb") as f:
        f.write(json.dumps({"op": op, **args}).encode() + b"\n")
        f.flush()
        line = f.readline(MAX_LINE)
    if not line:
        raise OperatorError("the gateway closed the connection without answering")
    reply = json.loads(line)
    if not reply.get("ok"):
        raise OperatorError(reply.get("error") or "the gateway refused the request")
    return reply.get("result")
