"""The operator socket, server side: the only door a person's decisions come through.

Its guard is `core/opguard.admit`: the peer must have the daemon's uid (or be
root), must not be inside a sandbox (another PID or user namespace than the
gateway's), and must not descend from any process the gateway knows as an
agent -- so an agent cannot approve itself even when it runs as the same user.
This module only observes the peer for it (`observe`: the kernel's uid, its
namespaces, the walk up the process tree). What each request does is `control.py`'s business.

Every line gets one JSON answer: a request too long, nested too deeply, not
JSON, naming no known op, or with arguments of the wrong type is answered
`{"ok": false, "error": ...}` and the connection is closed; no exception
leaves a client's handler. `ListenerHealth` counts what failed, for `bastion
status`, on this socket and on the agent socket alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from bastion.core import opguard
from bastion.gateway import descriptors
from bastion.identity import descends_from, peer_credentials
from bastion.identity.procs import in_other_namespaces
from bastion.ops.opsock import MAX_LINE, OperatorError, loads_line

log = logging.getLogger(__name__)

Handler = Callable[[dict[str, Any]], Awaitable[Any]]

# The argument the server itself adds to every request: who is asking (`opguard.Operator`,
# from SO_PEERCRED), so an answer is journaled with who gave it. A client's own value
# under this name is replaced, never believed.
OPERATOR_ARG = "operator"
Stream = Callable[[dict[str, Any]], AsyncIterator[dict[str, Any]]]

REQUEST_TIMEOUT = 60.0  # seconds a client may take to send its next request line
_ACCEPT_FAILED = "socket.accept() out of system resource"  # asyncio's report


class ListenerHealth:
    """What `bastion status` says about one listening socket.

    `serving`: the accept loop runs (a retry after a failed accept included);
    `connections`: open now; `accept_errors`/`connection_errors`: how many failed,
    `last_error`: the latest; `refusals`: connections answered with a refusal
    (a bad header, a peer that cannot be identified, a uid over its cap). Each
    kind (an errno, an exception class) is logged the first time only: a flood
    must not become a flood of log lines."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.serving = False
        self.connections = 0
        self.accept_errors = 0
        self.connection_errors = 0
        self.refusals = 0
        self.last_error: str | None = None
        self._logged: set[str] = set()

    def failed(self, where: str, exc: BaseException, *, trace: bool = False) -> None:
        """Count a failure: `where` is "accept" or "connection"; `trace` logs the
        traceback too (for what can only be a bug, never for a client's garbage)."""
        if where == "accept":
            self.accept_errors += 1
        else:
            self.connection_errors += 1
        kind = f"{where} {failure_kind(exc)}"
        self.last_error = f"{kind}: {exc}"[:300]
        if kind not in self._logged:
            self._logged.add(kind)
            log.log(
                logging.ERROR if trace else logging.WARNING,
                "%s socket: %s: %s (logged once; `bastion status` counts the rest)",
                self.name,
                kind,
                exc,
                exc_info=exc if trace else None,
            )

    def refused(self, exc: BaseException) -> None:
        """Count a connection refused with an answer (not a failure of the listener)."""
        self.refusals += 1
        kind = f"refused {failure_kind(exc)}"
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning("%s socket: %s: %s (logged once per kind)", self.name, kind, exc)
        else:
            log.debug("%s socket: %s: %s", self.name, kind, exc)

    def as_json(self) -> dict[str, Any]:
        return {
            "serving": self.serving,
            "connections": self.connections,
            "accept_errors": self.accept_errors,
            "connection_errors": self.connection_errors,
            "refusals": self.refusals,
            "last_error": self.last_error,
        }


def failure_kind(exc: BaseException) -> str:
    """EMFILE, ECONNRESET, ... for an OSError; the class name otherwise."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return errno.errorcode.get(exc.errno, f"errno {exc.errno}")
    return type(exc).__name__


def observe(sock: socket.socket, agent_processes: set[tuple[int, float]]) -> opguard.Caller:
    """What `opguard.admit` decides on: the peer's uid, whether it lives in other
    namespaces than the gateway (a sandbox), and whether it (or an ancestor) is one
    of `agent_processes`. Observed, not judged."""
    pid, uid, _ = peer_credentials(sock)
    sandboxed = pid <= 0 or in_other_namespaces(pid)
    return opguard.Caller(uid, sandboxed, descends_from(pid, agent_processes))


class OperatorServer:
    """The listening operator socket (asyncio's server) and its health."""

    def __init__(self, server: descriptors.UnixServer, health: ListenerHealth) -> None:
        self.server = server
        self._health = health
        self._loop = asyncio.get_running_loop()
        self._fd = server.sockets[0].fileno()
        self._previous = self._loop.get_exception_handler()
        self._loop.set_exception_handler(self._loop_error)

    def health(self) -> dict[str, Any]:
        self._health.serving = self.server.is_serving()
        return {**self._health.as_json(), "reserve": descriptors.reserve_status()}

    def close(self) -> None:
        self.server.close()
        self._health.serving = False
        self._loop.set_exception_handler(self._previous)

    def _loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """asyncio's server survives a failed accept (EMFILE, ...: it retries a
        second later) and reports it here; count it instead of logging a traceback."""
        sock = context.get("socket")
        exc = context.get("exception")
        if (
            context.get("message") == _ACCEPT_FAILED
            and sock is not None
            and sock.fileno() == self._fd
            and isinstance(exc, OSError)
        ):
            self._health.failed("accept", exc)
        elif self._previous is not None:
            self._previous(loop, context)
        else:
            loop.default_exception_handler(context)


async def serve(
    path: Path,
    handlers: dict[str, Handler],
    streams: dict[str, Stream],
    daemon_uid: int,
    agent_processes: Callable[[], set[tuple[int, float]]],
) -> OperatorServer:
    """Listen on `path` (mode 0600); answer requests with `handlers`, or
    follow a stream (one JSON event per line until the client leaves)."""
    health = ListenerHealth("operator")

    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        health.connections += 1
        try:
            await _converse(reader, writer, handlers, streams, daemon_uid, agent_processes)
        except ConnectionError:
            pass  # the client left: nobody to answer, nothing failed here
        except Exception as exc:  # answered, counted, never left to asyncio
            # An OSError (EMFILE while reading /proc, ...) is the system's; anything
            # else is a bug, and its traceback is what a developer needs.
            health.failed("connection", exc, trace=not isinstance(exc, OSError))
            with contextlib.suppress(Exception):
                await _reply(writer, _error(f"internal error ({failure_kind(exc)})"))
        finally:
            health.connections -= 1
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    old = os.umask(0o177)
    try:
        # Its own accept loop, with a reserve of descriptors (`descriptors.py`): an EMFILE
        # there is served, where asyncio's (libuv's) server would reset the connection.
        server = await descriptors.serve_unix(path, client, MAX_LINE, health)
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    health.serving = True
    return OperatorServer(server, health)


async def _converse(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    handlers: dict[str, Handler],
    streams: dict[str, Stream],
    daemon_uid: int,
    agent_processes: Callable[[], set[tuple[int, float]]],
) -> None:
    """Answer each line; a malformed one is answered once and ends the connection."""
    sock = writer.get_extra_info("socket")
    caller = observe(sock, agent_processes())
    refusal = opguard.admit(caller, daemon_uid)
    pid, uid, _ = peer_credentials(sock)
    operator = opguard.Operator(uid, pid)
    while True:
        try:
            line = await asyncio.wait_for(reader.readline(), REQUEST_TIMEOUT)
        except ValueError:  # asyncio's LimitOverrunError: no newline within MAX_LINE
            await _reply(writer, _error(f"request longer than {MAX_LINE} bytes"))
            return
        except TimeoutError:
            await _reply(writer, _error(f"no request line within {REQUEST_TIMEOUT:.0f}s"))
            return
        if not line:
            return
        if refusal is not None:
            await _reply(writer, _error(f"refused: {refusal}"))
            continue
        parsed = _parse(line, handlers, streams)
        if isinstance(parsed, str):
            await _reply(writer, _error(parsed))
            return
        op, request = parsed
        request[OPERATOR_ARG] = operator
        if op in streams:  # closed at once when the client leaves (its finally runs now)
            async with contextlib.aclosing(streams[op](request)) as events:  # type: ignore[type-var]
                async for event in events:
                    await _reply(writer, event)
            return
        await _reply(writer, await _answer(handlers[op], request))


def _parse(
    line: bytes, handlers: dict[str, Handler], streams: dict[str, Stream]
) -> tuple[str, dict[str, Any]] | str:
    """(op, arguments), or why the line is not a request."""
    try:
        request = loads_line(line)
    except ValueError as exc:
        return f"malformed operator request: {exc}"
    if not isinstance(request, dict):
        return "malformed operator request: not a JSON object"
    op = request.pop("op", None)
    if not isinstance(op, str):
        return 'malformed operator request: "op" must be a string'
    if op not in handlers and op not in streams:
        return f"unknown operator request {op[:50]!r}"
    return op, request


async def _answer(handler: Handler, request: dict[str, Any]) -> dict[str, Any]:
    try:
        return {"ok": True, "result": await handler(request)}
    except OperatorError as exc:
        return _error(str(exc))


def _error(message: str) -> dict[str, Any]:
    return {"ok": False, "error": message}


async def _reply(writer: asyncio.StreamWriter, doc: dict[str, Any]) -> None:
    writer.write(json.dumps(doc).encode() + b"\n")
    await writer.drain()
