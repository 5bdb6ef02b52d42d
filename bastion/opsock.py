"""The operator socket's wire, client side: one JSON request per line, one JSON answer.

Every CLI command that talks to the gateway goes through `call`. The server
side, with its guard on who may speak for the operator, is
`gateway/opserver.py`. Standard library only, so the CLI starts fast.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

MAX_LINE = 1 << 20


class OperatorError(Exception):
    """An operator request failed; the message is for a person to read."""


class GatewayNotRunning(OperatorError):
    pass


def call(path: Path, op: str, timeout: float = 30.0, **args: Any) -> Any:
    """Send one request to a running gateway and return its result."""
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
