"""The SSH server agents talk to: exec only, everything else refused.

Each connection on the agent socket starts with one header line from the
proxy naming the target; the daemon reads the peer's identity from the
kernel while the proxy still waits, answers OK, and only then speaks SSH on
the same socket. No SSH-level authentication is asked for: identity comes
from the socket peer, never from anything the client presents.

Refused at the protocol level: PTYs, agent and X11 forwarding, TCP/unix
forwarding. Shell and subsystem requests are answered with the agent-facing
JSON error so that the agent learns what to do instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import socket
from collections.abc import Callable
from typing import Any

import asyncssh
from asyncssh.packet import SSHPacket

from bastion.core.contract import Code, Failure
from bastion.core.events import Outcome
from bastion.core.gate import Request
from bastion.core.subject import Peer
from bastion.gateway.outbound import Streams
from bastion.gateway.service import AgentConn, Service, new_request_id
from bastion.identity import IdentityError
from bastion.proxy import MAX_HEADER, PROTOCOL

log = logging.getLogger("bastion.agent")

HEADER_TIMEOUT = 5.0
MAX_CONVERSATION = 256
MAX_REQUEST_PACKET = 2 * 1024 * 1024 + 4096  # Linux caps all of argv at about 2 MiB


class _ExactCommandChannel(asyncssh.SSHServerChannel):  # type: ignore[type-arg]
    """Keeps the exec command's exact bytes.

    asyncssh refuses a non-UTF-8 exec request outright, which the agent sees
    only as "exec request failed". Keeping the bytes lets the gate refuse it
    with an agent-facing error instead, and lets the digest cover exactly what was sent.
    """

    exact_command: bytes | None = None

    def _process_exec_request(self, packet: SSHPacket) -> bool:
        command = packet.get_string()
        packet.check_end()
        self.exact_command = command
        return self._start_session(command=command.decode("utf-8", "surrogateescape"))


async def _read_header(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> dict[str, str]:
    """The proxy's one line: which target (or, from `bastion run`, a registration)."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = await loop.sock_recv(sock, MAX_HEADER)
        if not chunk:
            raise ValueError("connection closed before the header")
        data += chunk
        if len(data) > MAX_HEADER:
            raise ValueError("header too long")
    if not data.startswith(PROTOCOL) or data.count(b"\n") != 1:
        raise ValueError("not a bastion proxy header (use `bastion proxy` as the ProxyCommand)")
    fields = json.loads(data[len(PROTOCOL) :])
    if not isinstance(fields, dict) or not all(isinstance(v, str) for v in fields.values()):
        raise ValueError("malformed header")
    if "register" in fields:
        label = fields.get("label", "")
        if fields["register"] != "run" or len(label) > 100 or not label.isprintable():
            raise ValueError("malformed run registration")
        return fields
    if not fields.get("host") or not fields.get("user"):
        raise ValueError("header lacks host or user")
    return {"host": fields["host"].lower(), "user": fields["user"]}


class AgentListener:
    """Accepts agent connections and hands each to an SSH server.

    `identify` reads who is connecting (in a worker thread: /proc walks
    block); `register_run` makes the connecting process a registered run and
    returns its id. Both refuse with `IdentityError`.
    """

    def __init__(
        self,
        service: Service,
        sock: socket.socket,
        host_key: asyncssh.SSHKey,
        identify: Callable[[socket.socket], Peer],
        register_run: Callable[[socket.socket, str], str],
    ) -> None:
        self.service = service
        self.sock = sock
        self.identify = identify
        self.register_run = register_run
        self._tasks: set[asyncio.Task[None]] = set()
        self._conns: set[asyncssh.SSHServerConnection] = set()
        self._options = asyncssh.SSHServerConnectionOptions(
            server_host_keys=[host_key],
            server_version="bastion",
            agent_forwarding=False,
            x11_forwarding=False,
            allow_pty=False,
            allow_scp=False,
            line_editor=False,
            login_timeout=30,
            keepalive_interval=30,
            config=None,
        )

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn_sock, _ = await loop.sock_accept(self.sock)
            task = asyncio.create_task(self._accept(conn_sock))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        self.sock.close()
        for conn in list(self._conns):
            conn.close()
        for task in list(self._tasks):
            task.cancel()

    async def _accept(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            header = await asyncio.wait_for(_read_header(loop, sock), HEADER_TIMEOUT)
            if "register" in header:
                run_id = await asyncio.to_thread(self.register_run, sock, header.get("label", ""))
                await loop.sock_sendall(sock, f"OK {run_id}\n".encode())
                sock.close()
                return
            peer = await asyncio.to_thread(self.identify, sock)
        except (ValueError, TimeoutError, IdentityError, OSError) as exc:
            log.warning("agent connection refused: %s", exc)
            with contextlib.suppress(OSError):
                await loop.sock_sendall(sock, b"ERR " + str(exc).encode()[:500] + b"\n")
            sock.close()
            return
        conn = AgentConn(peer=peer, host=header["host"], user=header["user"])
        self.service.connection_opened(conn)
        try:
            await loop.sock_sendall(sock, b"OK\n")
            ssh_conn = await asyncssh.run_server(
                sock, options=self._options, server_factory=lambda: _AgentSSH(self.service, conn)
            )
        except (OSError, asyncssh.Error) as exc:
            log.warning("agent connection from pid %d failed before SSH: %s", peer.pid, exc)
            self.service.connection_closed(conn)
            sock.close()
            return
        self._conns.add(ssh_conn)
        await ssh_conn.wait_closed()
        self._conns.discard(ssh_conn)


class _AgentSSH(asyncssh.SSHServer):
    def __init__(self, service: Service, conn: AgentConn) -> None:
        self.service = service
        self.conn = conn
        self.ssh_user = ""
        self._ssh: asyncssh.SSHServerConnection | None = None

    def connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
        self._ssh = conn

    def connection_lost(self, exc: Exception | None) -> None:
        self.service.connection_closed(self.conn)

    def begin_auth(self, username: str) -> bool:
        self.ssh_user = username
        return False  # identity comes from the socket peer

    def session_requested(self) -> Any:
        assert self._ssh is not None
        # A large receive limit lets an oversized command arrive whole, so the
        # gate can refuse it with an agent-facing error, not a dropped connection.
        chan = self._ssh.create_server_channel(encoding=None, max_pktsize=MAX_REQUEST_PACKET)
        chan.__class__ = _ExactCommandChannel
        process = asyncssh.SSHServerProcess(self._exec, None, 3, False)
        return chan, process

    async def _exec(self, process: asyncssh.SSHServerProcess[bytes]) -> None:
        request_id = new_request_id()
        try:
            await self._serve(process, request_id)
        except Exception:
            log.exception("%s: internal error", request_id)
            _finish_failure(
                process,
                Failure(
                    Code.INTERNAL,
                    "The gateway failed while handling this request; an operator "
                    "can read the gateway's log. Inspect the target before retrying.",
                    request_id,
                ),
            )

    async def _serve(self, process: asyncssh.SSHServerProcess[bytes], request_id: str) -> None:
        conn = self.conn
        command: bytes | None = getattr(process.channel, "exact_command", None)
        env = process.env
        conversation = env.get("BASTION_CONVERSATION")
        if conversation is not None:
            conversation = conversation[:MAX_CONVERSATION]
        action_key = env.get("BASTION_ACTION_KEY")
        action = hashlib.sha256(action_key.encode()).hexdigest() if action_key else None
        req = Request(
            request_id, conn.host, conn.user, command or b"", conn.peer.subject.key, action
        )
        subject = conn.peer.subject
        log.info(
            "%s: exec request for %s@%s from pid %d (%s), %d bytes, sha256 %s",
            request_id,
            conn.user,
            conn.host,
            subject.pid,
            subject.exe,
            len(req.command),
            req.command_sha256[:16],
        )
        refusal = None
        if command is None:
            what = "a subsystem" if process.subsystem else "an interactive shell"
            refusal = (
                f"bastion does not open {what}; it runs one command per ssh call: "
                "ssh HOST 'COMMAND'. Nothing was sent."
            )
        elif self.ssh_user != conn.user:
            refusal = (
                f'The ssh user "{self.ssh_user}" does not match the user "{conn.user}" '
                "given to the proxy; use USER@HOST. Nothing was sent."
            )
        streams = Streams(process.stdin, process.stdout, process.stderr)
        result = await self.service.handle(
            conn,
            req,
            conversation,
            streams,
            ack_unknown=action is not None and env.get("BASTION_ACK_UNKNOWN") == "1",
            refusal=refusal,
        )
        if isinstance(result, Failure):
            _finish_failure(process, result)
        elif result.outcome is Outcome.COMPLETED:
            assert result.exit_status is not None
            process.exit(result.exit_status)
        elif result.outcome is Outcome.SIGNALLED:
            assert result.signal is not None
            name, core, message, lang = result.signal
            process.exit_with_signal(name, core, message, lang)
        else:
            assert result.code is not None
            _finish_failure(process, Failure(result.code, result.message, request_id))


def _finish_failure(process: asyncssh.SSHServerProcess[bytes], failure: Failure) -> None:
    with contextlib.suppress(OSError, asyncssh.Error):
        process.stderr.write(failure.json_line())
        process.exit(failure.code.exit_status)
