"""The SSH server agents talk to: exec only, everything else refused.

Each connection on the agent socket starts with one header line from the
proxy naming the target; the daemon reads the peer's identity from the
kernel while the proxy still waits, answers OK, and only then speaks SSH on
the same socket. No SSH-level authentication is asked for: identity comes
from the socket peer, never from anything the client presents.

Refused at the protocol level: agent and X11 forwarding, TCP/unix forwarding
and tunnels (a forwarded connection with words naming bastion; a listener, -R, by
asyncssh's default, a global request failure, which carries no words). The `sftp`
subsystem is served, one request per file operation (`sftp.py`); shell and other
subsystem requests are answered with the agent-facing JSON error so that the agent
learns what to do instead; a terminal is the gate's to decide (`Request.terminal`).

One exec channel per connection: a second one is what an ssh ControlMaster
opens for another command, possibly from another process, and everything on
the connection runs as the process that connected. It is answered with the
agent-facing JSON error (`UNSUPPORTED_REQUEST`, naming ControlMaster) and runs
nothing -- except where the client that opened the connection is seen to be
the only one that can send through it (paramiko, fabric: `senders.own_connection`),
or on a registered run's connection while every process connected to the master
is one of the run's (`mux.py`); both are seen as the channel opens and again at
its request, and the gate decides.

No SSH-level authentication: whatever method a client tries first (`none`, any
public key, a password) succeeds, since the key or word identifies nothing.

This module only observes: which channel the client opened (`gate.Channel`)
and the ssh user it sent go into the `Request`, and the gate decides each of
those refusals in its contract order, after a locked vault (`core/gate.py`).

Every other request on the exec channel is answered without touching the
command's relay (`agent_channel.py`).

The listener stays up: a failed accept (EMFILE, ENFILE, ...) is retried after
a short pause, a failure inside one connection ends that connection only, and
every connection is accounted for (`connection_opened` and `connection_closed`
exactly once each). Each tenant (a registered run, or a uid outside every run:
`tenants.py`) holds at most `MAX_CONNECTIONS_PER_TENANT` connections, all of
them together `MAX_AGENT_CONNECTIONS` or what the descriptor limit leaves the agent
socket (`descriptors.budget`), counted from accept to close: before the header,
before the identity walk, whatever the connection turns out to be.
`health()` says how it is going, for `bastion status`.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import socket
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import asyncssh

from bastion.agent.wire import MAX_HEADER, PROTOCOL, refusal_line
from bastion.core.contract import Failure
from bastion.core.errors import BastionError
from bastion.core.events import Outcome, bound_action
from bastion.core.gate import ONE_COMMAND, Channel, Request, gateway_failed
from bastion.core.refusals import TURNED, Turned
from bastion.core.subject import Peer, SubjectKind
from bastion.core.waiting import WAIT_LINE_ENV
from bastion.gateway import descriptors
from bastion.gateway.admission import NoSlot
from bastion.gateway.agent_channel import AgentChannel, SubsystemProcess, forwarding_refused
from bastion.gateway.mux import MuxView
from bastion.gateway.opserver import ListenerHealth
from bastion.gateway.outbound import Streams
from bastion.gateway.service import AgentConn, Case, Opened, Service, new_request_id
from bastion.gateway.sftp import serve as serve_sftp
from bastion.gateway.tenants import Caps, Tenant, Tenants
from bastion.identity import IdentityError, peer_credentials, procs
from bastion.ops.opsock import loads_line

log = logging.getLogger(__name__)

HEADER_TIMEOUT = 5.0
OVER_CAP_WAIT = 1.0  # seconds to wait for the header of a connection refused by the cap
OVER_CAP_PATIENCE = 8  # refusals per tenant that wait for it at once; later ones do not
OVER_CAP_WAITING = 64  # ... and of every tenant together (each holds a descriptor)
MAX_CONVERSATION = 256
MAX_REQUEST_PACKET = 2 * 1024 * 1024 + 4096  # Linux caps all of argv at about 2 MiB
LOCAL_CIPHERS = ["aes128-gcm@openssh.com", "aes256-gcm@openssh.com"]
MAX_EXTRA_CHANNELS = 8  # answered per connection; beyond, a channel is refused at open
ACCEPT_RETRY = (0.05, 1.0)  # seconds: first and longest pause after a failed accept
# accept errors that concern one connection only: retried at once
_ONE_CONNECTION_LOST = {errno.ECONNABORTED, errno.EPROTO, errno.EINTR, errno.EAGAIN}

# Raised by a connection's own code for a client's input, or by the system; logged
# without a traceback. Anything else is a bug and is logged with one (once per kind).
_EXPECTED = (ValueError, TimeoutError, IdentityError, NoSlot, OSError, asyncssh.Error)

REGISTRATIONS = frozenset({"run", "front"})  # `bastion run`, `bastion mcp`
QUERIES = frozenset({"hosts", "request"})  # `bastion mcp`'s ssh_hosts and request_status


@dataclass(frozen=True)
class Doors:
    """What an agent connection may ask besides SSH (`agent_doors.py`), each given
    the connection's tenant and each refused with `IdentityError` or `ValueError`:
    who is connecting, a registration (`bastion run`, `bastion mcp`), and a query,
    answered with one JSON line."""

    identify: Callable[[socket.socket, Tenant], Awaitable[Peer]]
    register: Callable[[socket.socket, dict[str, Any], Tenant], Awaitable[str]]
    query: Callable[[socket.socket, dict[str, Any], Tenant], Awaitable[dict[str, Any]]]


async def _read_header(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> dict[str, Any]:
    """The proxy's one line: which target (or, from `bastion run`, a registration).
    Every value is a string, but a run's `"sandbox"`: null, or `{"given": [words]}`
    (what its sandbox was given beyond the defaults, for its cards), read here into
    None or a tuple of strings (absent: an older client's run, not sandboxed)."""
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
    try:
        fields = loads_line(data[len(PROTOCOL) :])
    except ValueError as exc:
        raise ValueError(f"malformed header: {exc}") from None
    if not isinstance(fields, dict):
        raise ValueError("malformed header")
    sandbox = _sandbox_given(fields.pop("sandbox", None)) if "register" in fields else None
    if not all(isinstance(v, str) for v in fields.values()):
        raise ValueError("malformed header")
    if "register" in fields:
        label = fields.get("label", "")
        if fields["register"] not in REGISTRATIONS or len(label) > 100 or not label.isprintable():
            raise ValueError("malformed registration")
        return {**fields, "sandbox": sandbox}
    if "query" in fields:
        if fields["query"] not in QUERIES or not all(len(v) <= 200 for v in fields.values()):
            raise ValueError("malformed query")
        return fields
    if not fields.get("host") or not fields.get("user"):
        raise ValueError("header lacks host or user")
    return {"host": fields["host"].lower(), "user": fields["user"]}


MAX_GIVEN = 32  # words a run's registration may say its sandbox was given


def _sandbox_given(value: object) -> tuple[str, ...] | None:
    """A registration's "sandbox" value: None, or what it was given, each word short
    and printable (a card shows them), or refuse."""
    if value is None:
        return None
    given = value.get("given") if isinstance(value, dict) and len(value) == 1 else None
    if (
        not isinstance(given, list)
        or len(given) > MAX_GIVEN
        or not all(isinstance(w, str) and len(w) <= 200 and w.isprintable() for w in given)
    ):
        raise ValueError("malformed registration: sandbox")
    return tuple(given)


class AgentListener:
    """Accepts agent connections and hands each to an SSH server.

    Who is connecting, registrations and queries are answered through `doors`
    before any SSH; every connection counts against its tenant's share (`caps`).
    """

    def __init__(
        self,
        service: Service,
        sock: socket.socket,
        host_key: asyncssh.SSHKey,
        doors: Doors,
        tenants: Tenants,
        caps: Caps | None = None,
    ) -> None:
        self.service = service
        self.sock = sock
        self.doors = doors
        self.tenants = tenants
        # All agents together hold what the descriptor limit leaves them (`descriptors`).
        self.caps = caps or Caps(ceiling=descriptors.budget().agent)
        self._refusing: Counter[Tenant] = Counter()  # over-cap connections being answered
        self._health = ListenerHealth("agent")
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
            # The local leg: AES-GCM is one AEAD call per packet (AES-NI), where
            # chacha20-poly1305 is several in asyncssh; the client's first choice wins,
            # so chacha is not offered. Every OpenSSH since 6.2 speaks these.
            encryption_algs=LOCAL_CIPHERS,
            compression_algs=["none"],
        )

    def health(self) -> dict[str, Any]:
        self._health.connections = len(self._tasks)
        return {
            **self._health.as_json(),
            "limit": self.caps.ceiling,
            "limit_per_tenant": self.caps.per_tenant,
            "runs": self.tenants.runs(),
        }

    async def serve(self) -> None:
        """Accept until cancelled. A failed accept (EMFILE: out of descriptors,
        ...) is counted and retried after a pause that doubles up to a second;
        nothing that happens in one connection reaches this loop."""
        loop = asyncio.get_running_loop()
        pause = 0.0
        self._health.serving = True
        try:
            while True:
                await descriptors.settled()  # the operator's request first
                try:
                    conn_sock, _ = await loop.sock_accept(self.sock)
                except Exception as exc:
                    if self.sock.fileno() < 0:
                        return  # closed by close()
                    self._health.failed("accept", exc, trace=not isinstance(exc, OSError))
                    if getattr(exc, "errno", None) not in _ONE_CONNECTION_LOST:
                        # A retry delay: descriptors free up as connections end.
                        pause = min(max(2 * pause, ACCEPT_RETRY[0]), ACCEPT_RETRY[1])
                        await asyncio.sleep(pause)
                    continue
                pause = 0.0
                task = asyncio.create_task(self._accept(conn_sock))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        finally:
            self._health.serving = False

    async def close(self) -> None:
        self.sock.close()
        for conn in list(self._conns):
            conn.close()
        for task in list(self._tasks):
            task.cancel()

    async def _accept(self, sock: socket.socket) -> None:
        """One connection, from accept to close. Whatever happens, it ends here:
        answered `ERR` before SSH, closed after, its descriptor released and, if it
        was opened to the service, closed to it."""
        held: Tenant | None = None
        try:
            pid, uid, _ = peer_credentials(sock)
            tenant = self.tenants.of_peer(pid, uid)
            refusal = self.caps.take(tenant)
            if refusal is not None:
                await self._over_cap(sock, tenant, TooManyConnections(refusal))
                return
            held = tenant
            await self._converse(sock, tenant)
        except Exception as exc:
            self._health.failed("connection", exc, trace=not isinstance(exc, _EXPECTED))
        finally:
            if held is not None:
                self.caps.give_back(held)
            sock.close()

    async def _over_cap(self, sock: socket.socket, tenant: Tenant, exc: Exception) -> None:
        """Take the header first (briefly): the proxy reads no answer once a send has
        failed, and a socket closed unread makes its send fail. Only a few at a time
        per tenant wait so: past those, a flood is answered at once."""
        self._refusing[tenant] += 1
        try:
            waiting = sum(self._refusing.values())
            if self._refusing[tenant] <= OVER_CAP_PATIENCE and waiting <= OVER_CAP_WAITING:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(
                        _read_header(asyncio.get_running_loop(), sock), OVER_CAP_WAIT
                    )
            await self._refuse(sock, exc)
        finally:
            self._refusing[tenant] -= 1
            if self._refusing[tenant] <= 0:
                del self._refusing[tenant]

    async def _converse(self, sock: socket.socket, tenant: Tenant) -> None:
        loop = asyncio.get_running_loop()
        try:
            header = await asyncio.wait_for(_read_header(loop, sock), HEADER_TIMEOUT)
            if "register" in header:
                reg_id = await self.doors.register(sock, header, tenant)
                await loop.sock_sendall(sock, f"OK {reg_id}\n".encode())
                return
            if "query" in header:
                answer = await self.doors.query(sock, header, tenant)
                line = json.dumps(answer, ensure_ascii=True, separators=(",", ":"))
                await loop.sock_sendall(sock, f"OK {line}\n".encode())
                return
            peer = await self.doors.identify(sock, tenant)
        except TimeoutError:
            await self._refuse(sock, TimeoutError(f"no header line within {HEADER_TIMEOUT:g}s"))
            return
        except (ValueError, IdentityError, NoSlot, OSError) as exc:
            await self._refuse(sock, exc)
            return
        conn = AgentConn(
            peer=peer,
            host=header["host"],
            user=header["user"],
            socket_inode=os.fstat(sock.fileno()).st_ino,
        )
        self.service.connection_opened(conn)
        closed = _once(lambda: self.service.connection_closed(conn))
        try:
            await loop.sock_sendall(sock, b"OK\n")
            # From here asyncssh speaks; a protocol error it raises (PacketDecodeError,
            # asyncssh.Error, ...) ends this connection in `_accept`.
            ssh_conn = await asyncssh.run_server(
                sock,
                options=self._options,
                server_factory=lambda: _AgentSSH(self.service, conn, closed),
            )
            self._conns.add(ssh_conn)
            try:
                await ssh_conn.wait_closed()
            finally:
                self._conns.discard(ssh_conn)
        finally:
            closed()

    async def _refuse(self, sock: socket.socket, exc: Exception) -> None:
        """The one-line answer to a connection refused before SSH started: what was
        observed (a full share, or anything else), with the code core gives it."""
        self._health.refused(exc)
        reason = " ".join(str(exc).split())[:500] or type(exc).__name__
        full = isinstance(exc, TooManyConnections | NoSlot)
        code = TURNED[Turned.FULL if full else Turned.REFUSED]
        with contextlib.suppress(OSError, TimeoutError):
            loop = asyncio.get_running_loop()
            line = refusal_line(code.value, reason)
            await asyncio.wait_for(loop.sock_sendall(sock, line), 5)


class TooManyConnections(BastionError):
    """A tenant holds its share of agent connections, or all agents hold the ceiling."""


def _once(action: Callable[[], None]) -> Callable[[], None]:
    """`action`, run by the first call only."""
    done = False

    def call() -> None:
        nonlocal done
        if not done:
            done = True
            action()

    return call


class _AgentSSH(asyncssh.SSHServer):
    def __init__(self, service: Service, conn: AgentConn, closed: Callable[[], None]) -> None:
        self.service = service
        self.conn = conn
        self.closed = closed  # closes `conn` to the service, once
        self.ssh_user = ""
        self.channels = 0
        self.refused_channels = 0  # later channels not known to come from the run
        self._ssh: asyncssh.SSHServerConnection | None = None

    def connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
        self._ssh = conn

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed()

    def begin_auth(self, username: str) -> bool:
        self.ssh_user = username
        return False  # identity comes from the socket peer

    def session_requested(self) -> Any:
        """The first exec channel runs a command; a later one (a ControlMaster's
        next command) is answered with `ONE_COMMAND` as the agent-facing JSON error
        (`UNSUPPORTED_REQUEST`, exit 77) and runs nothing -- unless the connection is a
        registered run's and the gate lets the run share it. Not a refused channel open:
        OpenSSH's mux client prints only "Session open refused by peer" (the reason
        goes to the master's stderr, /dev/null once it is in the background) and then
        quietly connects anew. Past a few answers the channel is refused anyway.

        Who is connected to a run's master is read here, before the open is confirmed,
        and again at the request: a mux client that asked and left before the master
        heard the confirmation gets no command sent (OpenSSH ends that session), and
        one still connected is seen."""
        assert self._ssh is not None
        self.channels += 1
        extra = self.channels > 1
        mux = self._mux_view(extra)
        own = self.service.edges.own_connection(self.conn.peer) if extra else None
        opened = Opened(mux, own)
        if extra and own is not True and (mux is None or mux.in_run is not True):
            self.refused_channels += 1
            if self.refused_channels > MAX_EXTRA_CHANNELS:
                raise asyncssh.ChannelOpenError(
                    asyncssh.OPEN_ADMINISTRATIVELY_PROHIBITED, ONE_COMMAND
                )
        # A large receive limit lets an oversized command arrive whole, so the
        # gate can refuse it with an agent-facing error, not a dropped connection.
        chan = self._ssh.create_server_channel(encoding=None, max_pktsize=MAX_REQUEST_PACKET)
        chan.__class__ = AgentChannel
        process = SubsystemProcess(lambda p: self._exec(p, extra, opened), None, 3, False)
        return chan, process

    def connection_requested(self, host: str, port: int, *_: object) -> Any:
        raise forwarding_refused(f"a connection to {host} port {port}")

    def unix_connection_requested(self, path: str) -> Any:
        raise forwarding_refused(f"a connection to the socket {path}")

    def tun_requested(self, unit: int | None) -> Any:
        raise forwarding_refused("a tunnel device")

    tap_requested = tun_requested

    def _mux_view(self, extra: bool) -> MuxView | None:
        """Who is connected to the master of a run's shared connection, now; None for a
        connection that is not a run's, or not shared."""
        peer = self.conn.peer
        if peer.subject.kind is not SubjectKind.RUN:
            return None
        if not extra and not self.service.edges.rides_a_master(peer):
            return None
        return self.service.edges.mux_clients(peer, self.conn.socket_inode)

    async def _exec(
        self,
        process: asyncssh.SSHServerProcess[bytes],
        extra: bool,
        opened: Opened,
    ) -> None:
        request_id = new_request_id()
        try:
            await self._serve(process, request_id, extra, opened)
        except Exception:
            log.exception("%s: internal error", request_id)
            _finish_failure(process, gateway_failed(request_id))

    async def _serve(
        self,
        process: asyncssh.SSHServerProcess[bytes],
        request_id: str,
        extra: bool,
        opened: Opened,
    ) -> None:
        conn = self.conn
        command: bytes | None = getattr(process.channel, "exact_command", None)
        if extra and command is not None:
            channel = Channel.SHARED  # a ControlMaster's next command
        elif command is None:
            channel = Channel.SUBSYSTEM if process.subsystem else Channel.SHELL
        else:
            channel = Channel.EXEC
        env = process.env
        conversation = env.get("BASTION_CONVERSATION")
        if conversation is not None:
            conversation = conversation[:MAX_CONVERSATION]
        if channel is Channel.SUBSYSTEM and process.subsystem == "sftp":
            # Every file operation is a request of its own (`gateway/sftp.py`).
            log.info("%s: sftp subsystem for %s@%s", request_id, conn.user, conn.host)
            outbound = self.service.outbound
            await serve_sftp(
                self.service,
                conn,
                process,
                conversation,
                self.ssh_user,
                outbound.open_sftp,
                opened if extra else None,
            )
            return
        subject = conn.peer.subject
        # An action key belongs to the subject that sent it: bound to it here, so
        # another process's acknowledgement or question names another action.
        action_key = env.get("BASTION_ACTION_KEY")
        action = bound_action(procs.owner(subject), action_key) if action_key else None
        req = Request(
            request_id,
            conn.host,
            conn.user,
            command or b"",
            subject.key,
            action,
            channel,
            self.ssh_user,
            terminal=getattr(process.channel, "terminal", None),
        )
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
        streams = Streams(process.stdin, process.stdout, process.stderr)
        if isinstance(process.channel, AgentChannel):  # a window-change, once it runs
            process.channel.resize = lambda size: self.service.resize(request_id, size)
        case = Case(
            conn,
            req,
            conversation,
            streams,
            opened,
            tell=process.stderr.write,
            wait_line=env.get(WAIT_LINE_ENV),
            ack_unknown=action is not None and env.get("BASTION_ACK_UNKNOWN") == "1",
        )
        result = await self.service.handle(case)
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
