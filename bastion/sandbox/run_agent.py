"""The throwaway ssh agent `bastion run` offers its sandbox: `SSH_AUTH_SOCK` for clients
that will not connect without a key.

paramiko's `SSHClient.connect` (and fabric, over it) gives up before it contacts the
server when it has no key, no agent and no password -- and inside a sandboxed run the
user's keys and agent are hidden. The gateway asks for no authentication (identity comes
from the socket peer), so any key will do: this agent holds one Ed25519 key made in
memory for this run, which identifies nothing and opens nothing but the gateway.

It is ours, not OpenSSH's `ssh-agent`, for the smaller surface: a thread of the run's
supervisor (outside the sandbox) that answers two requests, list the identities and
sign with that key, and fails every other one (add, remove, lock, extensions: nothing
can be put into it or taken out of it); no process to start, watch or kill, no key on
disk, and it lives exactly as long as the supervisor serves it (`close`). Only the
supervisor's uid, root and the run's agent user (`--isolated`) may talk to it.

Its socket needs a name on the host's disk for the whole run: the sandbox connects to
it by path (an abstract socket made outside is refused by the run's Landlock scope),
through a bind of its directory, and unlinking the name would take it from the run too.
A name on disk outlives a `bastion run` that dies without its `close` (SIGKILL, a
crash), so the directory has a janitor (`_janitor`): a process of its own, forked
before the run starts and outside its tree (its own session, not below the run's
subreaper, deaf to the signals that end a run), that waits on a pipe whose only write
end `bastion run` holds. The kernel closes that end when `bastion run` dies, however it
dies, and the janitor then removes the directory: nothing of a run is left in the
host's temporary directory for longer than that takes (milliseconds). A sweep of stale
directories at the next run's start would leave them until then, and not at all on a
machine where no run follows.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import struct
import tempfile
import threading
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

# The agent protocol (draft-miller-ssh-agent): the two requests served, their answers.
REQUEST_IDENTITIES, IDENTITIES_ANSWER = 11, 12
SIGN_REQUEST, SIGN_RESPONSE = 13, 14
FAILURE = 5
MAX_MESSAGE = 256 * 1024  # a sign request carries a session id and a little more
MAX_CLIENTS = 32  # connections served at once; beyond, one is closed at accept
IO_TIMEOUT = 30.0  # seconds a client may take to send a message it started
INSIDE = Path("/tmp/.bastion-ssh-agent")  # where the sandbox sees the socket's directory
COMMENT = b"bastion run: throwaway key (identifies nothing)"


def _string(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def _read_string(buf: bytes, at: int) -> tuple[bytes, int]:
    if at + 4 > len(buf):
        raise ValueError("truncated")
    (n,) = struct.unpack_from(">I", buf, at)
    if at + 4 + n > len(buf):
        raise ValueError("truncated")
    return buf[at + 4 : at + 4 + n], at + 4 + n


class ThrowawayAgent:
    """One run's agent: a key made now, a socket in a directory of its own."""

    def __init__(self, allowed_uid: int | None = None) -> None:
        """`allowed_uid`: the run's agent user, who owns the directory and may connect."""
        self._key = Ed25519PrivateKey.generate()
        raw = self._key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self.blob = _string(b"ssh-ed25519") + _string(raw)
        self._uids = {0, os.getuid()} | ({allowed_uid} if allowed_uid is not None else set())
        self.directory = Path(tempfile.mkdtemp(prefix="bastion-run-agent-"))
        self._janitor = _janitor(self.directory)
        self.socket_path = self.directory / "agent.sock"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            self._sock.bind(str(self.socket_path))
        finally:
            os.umask(old)
        if allowed_uid is not None:
            os.chown(self.directory, allowed_uid, -1)
            os.chown(self.socket_path, allowed_uid, -1)
        self._sock.listen(16)
        self._slots = threading.BoundedSemaphore(MAX_CLIENTS)
        self._closed = threading.Event()
        threading.Thread(target=self._serve, name="run-agent", daemon=True).start()

    @property
    def inside(self) -> Path:
        """The socket's path inside the sandbox (`sandbox.plan`'s `agent_auth`)."""
        return INSIDE / self.socket_path.name

    def close(self) -> None:
        """The end of the run: no more answers, the socket and its directory gone."""
        self._closed.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        shutil.rmtree(self.directory, ignore_errors=True)
        with contextlib.suppress(OSError):  # the janitor finds nothing left, and ends
            os.close(self._janitor)

    def _serve(self) -> None:
        # No signal for this thread (nor for the client threads it starts): the run's
        # supervisor waits for them itself (`run._supervise`, sigtimedwait).
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            _, uid, _ = struct.unpack(
                "3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
            )
            if uid not in self._uids or not self._slots.acquire(blocking=False):
                conn.close()
                continue
            threading.Thread(target=self._client, args=(conn,), daemon=True).start()

    def _client(self, conn: socket.socket) -> None:
        try:
            with conn:
                while not self._closed.is_set():
                    message = _receive(conn)
                    if message is None:
                        return
                    conn.sendall(_string(self.answer(message)))
        except (OSError, ValueError):
            pass
        finally:
            self._slots.release()

    def answer(self, message: bytes) -> bytes:
        """The reply to one request: the identity, a signature by this key, or failure."""
        kind, body = message[0], message[1:]
        if kind == REQUEST_IDENTITIES and not body:
            return (
                bytes([IDENTITIES_ANSWER])
                + struct.pack(">I", 1)
                + _string(self.blob)
                + _string(COMMENT)
            )
        if kind == SIGN_REQUEST:
            try:
                blob, at = _read_string(body, 0)
                data, at = _read_string(body, at)
            except ValueError:
                return bytes([FAILURE])
            if blob == self.blob and at + 4 == len(body):
                signature = _string(b"ssh-ed25519") + _string(self._key.sign(data))
                return bytes([SIGN_RESPONSE]) + _string(signature)
        return bytes([FAILURE])


# The janitor's program: deaf to the signals that end a run, it reads its stdin (the
# pipe) until the end of file that the death of `bastion run` makes, then removes $1.
JANITOR = 'trap "" HUP INT QUIT TERM TSTP; while read -r _; do :; done; exec rm -rf -- "$1"'


def _janitor(directory: Path) -> int:
    """Start the process that removes `directory` once this process is gone (see the
    module's docstring) and return the pipe's write end, to close at `close` (or never:
    the kernel closes it). Forked twice, so that it is nobody's child here: the run's
    supervisor ends every process below it, and the janitor must outlive it."""
    r, w = os.pipe()  # both ends close on exec: no program this process starts holds w
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child, then the janitor
        try:
            os.setsid()  # no terminal's signals, no process group of the run's
            if os.fork() == 0:
                os.chdir("/")
                os.dup2(r, 0)
                null = os.open(os.devnull, os.O_RDWR)
                os.dup2(null, 1)
                os.dup2(null, 2)
                env = {"PATH": "/usr/bin:/bin", "LC_ALL": "C"}
                os.execve("/bin/sh", ["sh", "-c", JANITOR, "sh", str(directory)], env)
        finally:
            os._exit(0)
    os.close(r)
    os.waitpid(pid, 0)
    return w


def _receive(conn: socket.socket) -> bytes | None:
    """One framed message (None at a clean end), bounded in size and in time."""
    head = _exactly(conn, 4, first=True)
    if head is None:
        return None
    (n,) = struct.unpack(">I", head)
    if not 1 <= n <= MAX_MESSAGE:
        raise ValueError("bad message length")
    conn.settimeout(IO_TIMEOUT)
    try:
        body = _exactly(conn, n)
    finally:
        conn.settimeout(None)
    if body is None:
        raise ValueError("truncated message")
    return body


def _exactly(conn: socket.socket, n: int, first: bool = False) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            if first and not data:
                return None
            raise ValueError("truncated message")
        data += chunk
    return data
