"""The operator socket's wire, client side: one JSON request per line, one JSON answer.

Every CLI command that talks to the gateway goes through `call`. The server
side, with its guard on who may speak for the operator, is
`gateway/opserver.py`. Standard library only (and the import-free root exception,
`core/errors`), so the CLI starts fast.
"""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path
from typing import Any

from bastion.core.errors import BastionError

MAX_LINE = 1 << 20  # a request; the gateway refuses a longer one
# An answer: the gateway is the operator's own process, and its audit views grow with
# the journal (4,000 requests make `audit activity` about 4 MB).
MAX_REPLY = 1 << 30
MAX_DEPTH = 32  # arrays and objects inside each other, on either socket

_TOKEN = re.compile(rb'[][{}"]')
_REST_OF_STRING = re.compile(rb'(?:[^"\\]++|\\.)*+"', re.DOTALL)


class OperatorError(BastionError):
    """An operator request failed; the message is for a person to read."""


class GatewayNotRunning(OperatorError):
    pass


def too_deep(data: bytes, limit: int = MAX_DEPTH) -> bool:
    """Does this JSON text nest more than `limit` arrays and objects? A cheap scan
    before parsing: `json.loads` recurses once per level, and a line of `[`s would
    exhaust the interpreter's stack. Brackets inside strings do not count."""
    if data.count(b"[") + data.count(b"{") <= limit:
        return False
    depth, pos = 0, 0
    while (token := _TOKEN.search(data, pos)) is not None:
        pos = token.end()
        if token.group() == b'"':  # skip the string; an unterminated one ends the text
            rest = _REST_OF_STRING.match(data, pos)
            if rest is None:
                return False
            pos = rest.end()
            continue
        depth += 1 if token.group() in b"[{" else -1
        if depth > limit:
            return True
    return False


def loads_line(data: bytes, limit: int = MAX_DEPTH) -> Any:
    """One JSON line of bounded depth (the caller bounds its length); `ValueError`
    for anything else, with a reason a person can read."""
    if too_deep(data, limit):
        raise ValueError(f"JSON nested more than {limit} levels deep")
    try:
        return json.loads(data)
    except RecursionError:  # the scan above makes this unreachable; kept as a backstop
        raise ValueError("JSON nested too deeply") from None


def connect(path: Path, timeout: float) -> socket.socket:
    """A connection to the running gateway's operator socket, or GatewayNotRunning
    saying which of the two usual reasons it is and what to do."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(path))
    except (FileNotFoundError, ConnectionRefusedError) as exc:
        sock.close()
        why = (
            f"no operator socket at {path}"
            if isinstance(exc, FileNotFoundError)
            else f"nothing answers at {path}, left by a gateway that did not stop cleanly"
        )
        raise GatewayNotRunning(
            f"the gateway is not running ({why}); start it with `bastion daemon`"
        ) from exc
    except OSError:
        sock.close()
        raise
    return sock


def call(path: Path, op: str, timeout: float = 30.0, **args: Any) -> Any:
    """Send one request to a running gateway and return its result."""
    sock = connect(path, timeout)
    with sock, sock.makefile("rwb") as f:
        f.write(json.dumps({"op": op, **args}).encode() + b"\n")
        f.flush()
        line = f.readline(MAX_REPLY)
    if not line:
        raise OperatorError("the gateway closed the connection without answering")
    if not line.endswith(b"\n"):
        raise OperatorError("the gateway's answer was cut off before its end")
    try:
        reply = loads_line(line)
    except ValueError as exc:
        raise OperatorError(f"the gateway answered something that is not JSON: {exc}") from None
    if not isinstance(reply, dict):
        raise OperatorError("the gateway answered something that is not a JSON object")
    if not reply.get("ok"):
        raise OperatorError(reply.get("error") or "the gateway refused the request")
    return reply.get("result")
