"""The ProxyCommand helper: `bastion proxy HOST PORT USER`.

Runs once per agent ssh call, so it imports only the standard library and
exits as soon as it can. It connects to the daemon's agent socket, names the
target, and waits for the daemon to say it has read who is connecting -- the
daemon identifies this very process through SO_PEERCRED, so it must still be
alive while /proc is read. Then it hands the connected socket to ssh
(ProxyUseFdpass) and exits; ssh speaks SSH to the daemon directly, with no
byte relayed through Python. Without fd passing it relays stdin/stdout.

The target given here is only a name: address and port come from the
policy, never from the client.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import stat
import struct
import sys

PROTOCOL = b"BASTION/1 "
MAX_HEADER = 4096
REPLY_TIMEOUT = 30.0
# The agent-facing codes this helper ends with: (code, exit status, retryable), as
# bastion.core.contract's table has them (tests/unit/test_contract.py holds them to it).
INTERNAL = ("INTERNAL", 70, False)
GATEWAY_BUSY = ("GATEWAY_BUSY", 69, True)
# What a gateway's `ERR [CODE] reason` line may carry; any other is read as INTERNAL.
ENDINGS = {ending[0]: ending for ending in (INTERNAL, GATEWAY_BUSY)}


def refusal_line(code: str, reason: str) -> bytes:
    """The gateway's one-line refusal before SSH: the code core chose, then why."""
    return f"ERR [{code}] {reason}\n".encode()


def read_refusal(reply: bytes) -> tuple[str | None, str]:
    """(code, reason) from an `ERR` line; the code is None where the line has none."""
    text = reply.decode("utf-8", "replace").strip().removeprefix("ERR").strip()
    code, sep, rest = text.partition("] ")
    if text.startswith("[") and sep and code[1:].isupper():
        return code[1:], rest
    return None, text


def fail(message: str, ending: tuple[str, int, bool] = INTERNAL) -> int:
    """Tell the agent, in the agent-facing error shape, why no SSH session could even start."""
    code, status, retryable = ending
    error = {
        "code": code,
        "message": message + " Nothing was sent to the target.",
        "request_id": None,
        "retryable": retryable,
    }
    sys.stderr.write(json.dumps({"ok": False, "error": error}) + "\n")
    return status


def reason(exc: OSError) -> str:
    """What went wrong, in words (a timeout's strerror is None)."""
    return exc.strerror or str(exc) or type(exc).__name__


def connect(sock: socket.socket, path: str, timeout: float) -> None:
    """Connect within `timeout` seconds and bound each later send and receive the same.
    A blocking connect waits for ever while the listener's queue is full, as a wedged
    gateway's stays: SO_SNDTIMEO bounds that wait (it then fails EAGAIN)."""
    limit = struct.pack("@ll", int(timeout), int(timeout % 1 * 1_000_000))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)
    sock.connect(path)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, bytes(len(limit)))
    sock.settimeout(timeout)


def read_reply(sock: socket.socket) -> bytes:
    """Read the daemon's one-line answer and not one byte more: the SSH
    banner follows at once on the same socket, and it belongs to ssh."""
    sock.settimeout(REPLY_TIMEOUT)
    data = bytearray()
    while len(data) < MAX_HEADER:
        byte = sock.recv(1)
        if not byte:
            break
        data += byte
        if byte == b"\n":
            break
    return bytes(data)


def relay(sock: socket.socket) -> int:
    """Copy bytes both ways until the daemon closes (no ProxyUseFdpass)."""
    sock.setblocking(True)
    sock.settimeout(None)
    stdin_open = True
    while True:
        watch = [sock, 0] if stdin_open else [sock]
        readable, _, _ = select.select(watch, [], [])
        if 0 in readable:
            data = os.read(0, 65536)
            if data:
                sock.sendall(data)
            else:
                stdin_open = False
                sock.shutdown(socket.SHUT_WR)
        if sock in readable:
            data = sock.recv(65536)
            if not data:
                return 0
            view = memoryview(data)
            while view:
                view = view[os.write(1, view) :]


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    sock_path = os.environ.get("BASTION_AGENT_SOCKET", "")
    if len(args) >= 2 and args[0] == "--socket":
        sock_path = args[1]
        args = args[2:]
    if len(args) != 3 or not sock_path:
        sys.stderr.write("usage: bastion proxy [--socket PATH] HOST PORT USER\n")
        return 2
    host, port, user = args
    header = PROTOCOL + json.dumps({"host": host, "port": port, "user": user}).encode() + b"\n"
    if len(header) > MAX_HEADER:
        return fail("The host or user name is too long.")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connect(sock, sock_path, REPLY_TIMEOUT)
        # The gateway may refuse before reading (a per-uid cap): its ERR line still waits.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(header)
        reply = read_reply(sock)
    except FileNotFoundError:
        return fail(
            f"The bastion gateway is not running (no socket at {sock_path}); "
            "ask the operator to start `bastion daemon`."
        )
    except ConnectionRefusedError:
        return fail(
            f"The bastion gateway is not accepting connections at {sock_path}; "
            "ask the operator to start `bastion daemon`."
        )
    except (TimeoutError, BlockingIOError):  # no answer, or a queue full as long (EAGAIN)
        return fail(
            f"The bastion gateway at {sock_path} did not answer within {REPLY_TIMEOUT:g} s "
            "(it is overloaded or stuck); retry in a moment, and if it persists ask the "
            "operator to check `bastion status`.",
            GATEWAY_BUSY,
        )
    except OSError as exc:
        return fail(
            f"Could not talk to the bastion gateway at {sock_path}: {reason(exc)}; "
            "ask the operator to check `bastion status`."
        )
    if not reply.startswith(b"OK"):
        code, text = read_refusal(reply)
        ending = ENDINGS.get(code or "", INTERNAL)
        return fail(f"The bastion gateway refused the connection: {text or 'no reply'}.", ending)
    if stat.S_ISSOCK(os.fstat(1).st_mode):
        # ProxyUseFdpass (ssh gives us a socketpair, not pipes): hand ssh the
        # connected socket itself and get out of the way.
        out = socket.socket(fileno=1)
        try:
            socket.send_fds(out, [b"\0"], [sock.fileno()])
        except OSError as exc:
            return fail(f"Could not pass the connection to ssh: {reason(exc)}.")
        finally:
            out.detach()
        return 0
    try:
        return relay(sock)
    except OSError as exc:  # SSH had started: what became of the command is the gateway's to say
        sys.stderr.write(f"bastion proxy: the connection to the gateway broke: {reason(exc)}.\n")
        return 1


if __name__ == "__main__":
    sys.exit(main())
