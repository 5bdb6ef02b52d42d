"""The gateway survives a hostile loopback (issue 44): floods of idle connections to
the console and to the agent socket, idle connections, a console port taken or in
TIME-WAIT, and console requests from inside a `bastion run`. Real gateways, real
`bastion` CLI processes, real sockets; each test has its control.

Every flood comes from one helper process (`FLOOD`), loopback or the agent socket
only, bounded in count, against a gateway whose descriptor limit is lowered
(`start_daemon_limited`) so that the flood is past it: before the doors had caps
and the operator socket a reserve, the gateway ran out of descriptors, libuv
accepted and reset each operator connection, and `bastion lock` never reached it.
"""

from __future__ import annotations

import contextlib
import errno
import http.client
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bastion.core.defaults import CONSOLE_CONNECTIONS_PER_PEER, RESERVE_SLOTS
from bastion.devtools.sshd_fixture import SshdInfo
from tests.browser_helper import free_port
from tests.harness import (
    Bastion,
    cli_argv,
    make_bastion,
    open_fds,
    start_daemon_limited,
    wait_for,
    write_bastion_toml,
)

# One process: `count` connections at once (to a TCP port on 127.0.0.1, or a unix socket),
# then, for `seconds`, each one the gateway closes is opened again. It reports twice: once
# the first burst has been judged, and at the end.
FLOOD = r"""
import json, resource, select, socket, sys, time
kind, where, count, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (count + 200, hard))
attempts = ended = 0
def one():
    global attempts
    attempts += 1
    if kind == "tcp":
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", int(where)))
        return s
    s = socket.socket(socket.AF_UNIX)
    s.setblocking(False)
    try:
        s.connect(where)
    except (BlockingIOError, ConnectionRefusedError):  # the backlog is full
        s.close()
        return None
    return s
def sort(socks):
    # (still open, closed by the gateway): an event is the gateway's close or reset (it
    # sends nothing first on the console; an ERR line on the agent socket).
    global ended
    p = select.poll()
    for s in socks:
        p.register(s, select.POLLIN | select.POLLERR | select.POLLHUP)
    gone = {fd for fd, _ in p.poll(0)}
    keep = [s for s in socks if s.fileno() not in gone]
    for s in socks:
        if s.fileno() in gone:
            ended += 1
            s.close()
    return keep
socks = [s for s in (one() for _ in range(count)) if s is not None]
time.sleep(1.5)
socks = sort(socks)
print(json.dumps({"open": len(socks), "ended": ended, "attempts": attempts}), flush=True)
deadline = time.monotonic() + seconds
while time.monotonic() < deadline:
    socks = sort(socks)
    socks += [s for s in (one() for _ in range(min(200, count - len(socks)))) if s is not None]
    time.sleep(0.2)
print(json.dumps({"open": len(sort(socks)), "ended": ended, "attempts": attempts}), flush=True)
"""


@contextlib.contextmanager
def flood(kind: str, where: str, count: int, seconds: float) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", FLOOD, kind, where, str(count), str(seconds)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def report(proc: subprocess.Popen[str]) -> dict[str, int]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, "the flood ended without a report"
    got: dict[str, int] = json.loads(line)
    return got


def console_bastion(
    tmp_path: Path, sshd: SshdInfo, key: Path, nofile: int | None = None, extra: str = ""
) -> tuple[Bastion, int]:
    """A started, unlocked gateway with its console on a free port (and `extra` in
    [console]), its descriptor limit `nofile` if given."""
    b = make_bastion(tmp_path, sshd, key, start=False)
    port = free_port()
    write_bastion_toml(b, f"[console]\nenabled = true\nport = {port}\n{extra}")
    if nofile is None:
        b.start_daemon()
    else:
        start_daemon_limited(b, nofile)
    b.unlock()
    return b, port


def get(port: int, path: str = "/api/state", timeout: float = 10) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path, headers={"Host": f"localhost:{port}"})
        return conn.getresponse().status
    finally:
        conn.close()


def operator_answers(b: Bastion) -> None:
    """`bastion status` (human and --json) and `bastion lock` as the operator types them,
    each its own process: they answer, and the vault is locked."""
    human = b.cli("status", timeout=30)
    assert "vault:     unlocked" in human.stdout, human.stdout
    assert json.loads(b.cli("status", "--json", timeout=30).stdout)["locked"] is False
    b.cli("lock", timeout=30)
    assert b.op("status")["locked"] is True


# -- floods ------------------------------------------------------------------------------


def test_a_flood_of_idle_console_connections_leaves_lock_and_status_answered(
    tmp_path: Path, sshd: SshdInfo, client_key: tuple[Path, str]
) -> None:
    """2,000 idle connections from one process against a gateway limited to 400
    descriptors: the process holds its share (32) and no more, the rest are reset
    unread, the gateway's descriptors stay far below the limit, and `status` and
    `lock` answer while the flood goes on. (Before: the gateway took connections until
    it had no descriptor left, and `status` failed.)"""
    b, port = console_bastion(tmp_path, sshd, client_key[0], nofile=400)
    try:
        pid = b.gateway_pid
        baseline = open_fds(pid)
        with flood("tcp", str(port), 2000, 8.0) as proc:
            first = report(proc)
            console = b.op("status")["console"]
            during = open_fds(pid)
            operator_answers(b)
            last = report(proc)
        refused = b.op("status")["console"]["refused"]
        # The control: the flood was real, held what a peer may hold, and was reset past it
        # (the client's own count of resets; those the kernel still queues look open to it).
        assert console["served"] == CONSOLE_CONNECTIONS_PER_PEER, console
        # Past the peer's share, past the identifications waiting, past the console's
        # share of 400 descriptors (40): each kind resets, unread.
        assert refused["peer_full"] + refused["busy"] + refused["full"] > 2000, refused
        assert refused["inside_run"] == refused["sandboxed"] == 0, refused
        assert last["ended"] > 2000 and last["attempts"] > 4000, (first, last)
        held = (baseline, during)
        assert baseline + CONSOLE_CONNECTIONS_PER_PEER <= during < baseline + 100, held
        wait_for(lambda: b.op("status")["console"]["connections"] == 0)  # the flood's gone
        assert get(port) == 200  # the console itself answers once it is over
        log = b.log.read_text()
        assert "Traceback" not in log, log[-3000:]
        assert log.count("the limit per process") == 1, log[-3000:]  # once, not per connection
    finally:
        b.close()


def test_a_flood_of_idle_agent_connections_leaves_lock_and_status_answered(
    tmp_path: Path, sshd: SshdInfo, client_key: tuple[Path, str]
) -> None:
    """400 idle agent-socket connections from one process against a gateway limited to
    200 descriptors (below one tenant's 256): the agent socket holds its share of the
    limit and refuses past it, and `status` and `lock` answer meanwhile."""
    b = make_bastion(tmp_path, sshd, client_key[0], start=False)
    try:
        start_daemon_limited(b, 200)
        b.unlock()
        pid = b.gateway_pid
        with flood("unix", str(b.home.agent_socket), 400, 8.0) as proc:
            first = report(proc)
            agent = b.op("status")["listeners"]["agent"]
            during = open_fds(pid)
            operator_answers(b)
            last = report(proc)
        refusals = b.op("status")["listeners"]["agent"]["refusals"]
        limit = agent["limit"]
        assert limit < 200 - 64, agent  # the agent socket's share, well below the limit
        # The control: the flood held connections up to the agent socket's share, and was
        # refused past it (the per-tenant cap, 256, is not what stopped it).
        assert limit - 10 <= agent["connections"] <= limit + 8, agent
        assert refusals > 400 and last["ended"] > 400, (first, last, refusals)
        assert during < 200 - 16, during
        assert "its limit for all agents together" in b.log.read_text()
        assert "Traceback" not in b.log.read_text()
    finally:
        b.close()


def test_the_operator_socket_answers_when_the_gateway_is_out_of_descriptors(
    tmp_path: Path, sshd: SshdInfo, client_key: tuple[Path, str]
) -> None:
    """A limit so low (40) that the doors' shares do not fit: the agent socket's accept
    fails with EMFILE, and every `status` and the `lock` still answer, served on the
    operator socket's reserve (its count says so)."""
    b = make_bastion(tmp_path, sshd, client_key[0], start=False)
    try:
        start_daemon_limited(b, 40)
        b.unlock()
        with flood("unix", str(b.home.agent_socket), 150, 6.0) as proc:
            report(proc)
            for _ in range(5):
                b.cli("status", "--json", timeout=30)
            operator_answers(b)
            report(proc)
        listeners = b.op("status")["listeners"]
        assert listeners["agent"]["accept_errors"] > 0, listeners  # the control: EMFILE hit
        assert listeners["operator"]["reserve"]["lendings"] > 0, listeners["operator"]

        def whole() -> bool:  # once the flood's descriptors are gone, the reserve is full
            reserve = b.op("status")["listeners"]["operator"]["reserve"]
            return reserve["lent"] == 0 and reserve["slots"] == RESERVE_SLOTS

        wait_for(whole, timeout=30)
        assert "Traceback" not in b.log.read_text()
    finally:
        b.close()


# -- idle connections --------------------------------------------------------------------


def test_idle_console_connections_are_closed_after_idle_seconds(
    tmp_path: Path, sshd: SshdInfo, client_key: tuple[Path, str]
) -> None:
    """`idle_seconds = 2`: a connection that never sends, one that sent half a request,
    and one idle after its answer are all closed within a few seconds; the control, a
    connection that asks again every second, is still served after 6 s."""
    b, port = console_bastion(tmp_path, sshd, client_key[0], extra="idle_seconds = 2\n")
    try:
        silent = socket.create_connection(("127.0.0.1", port))
        half = socket.create_connection(("127.0.0.1", port))
        half.sendall(b"GET /api/state HTTP/1.1\r\nHost: localhost:%d\r\n" % port)
        after = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        after.request("GET", "/api/state", headers={"Host": f"localhost:{port}"})
        assert after.getresponse().read()
        busy = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        busy.connect()
        began = time.monotonic()
        wait_for(lambda: b.op("status")["console"]["served"] == 4, timeout=10)
        while time.monotonic() - began < 6:
            busy.request("GET", "/api/state", headers={"Host": f"localhost:{port}"})
            assert busy.getresponse().read()
            time.sleep(1)
        for sock in (silent, half, after.sock):
            assert sock is not None
            sock.settimeout(0.5)  # closed already, 4 s after the idle time: no wait
            with contextlib.suppress(ConnectionResetError):
                assert sock.recv(100) == b""  # closed by the gateway, nothing more said
        assert b.op("status")["console"]["served"] == 1
        busy.request("GET", "/api/state", headers={"Host": f"localhost:{port}"})
        assert busy.getresponse().status == 200  # the control: the same connection, served
        assert b.op("status")["console"]["idle_seconds"] == 2
        assert "Traceback" not in b.log.read_text()
    finally:
        b.close()


# -- the port ----------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["127.0.0.1", "::1"])
def test_a_taken_console_port_leaves_the_gateway_running_and_says_so(
    tmp_path: Path, sshd: SshdInfo, client_key: tuple[Path, str], family: str
) -> None:
    """Another process listens on the console's port (either loopback address): the
    gateway starts, serves the operator, and `status` (human, --json), `bastion console`
    and one line of the log say the console did not start and who has the port. The
    control: once the port is free, the console starts by itself and answers."""
    b = make_bastion(tmp_path, sshd, client_key[0], start=False)
    port = free_port()
    write_bastion_toml(b, f"[console]\nenabled = true\nport = {port}\n")
    taker = socket.socket(socket.AF_INET6 if ":" in family else socket.AF_INET)
    try:
        try:
            taker.bind((family, port))
        except OSError as exc:
            if exc.errno == errno.EADDRNOTAVAIL:
                pytest.skip("no IPv6 loopback here")
            raise
        taker.listen()
        b.start_daemon()
        b.unlock()
        shown = f"[{family}]:{port}" if ":" in family else f"{family}:{port}"
        said = f"{shown} is taken by another process (pid {os.getpid()}, "
        console = json.loads(b.cli("status", "--json").stdout)["console"]
        assert console["started"] is False and said in console["error"], console
        human = b.cli("status").stdout
        assert f"console:   not started: {said}" in human, human
        opened = b.cli("console", "--no-open", check=False)
        assert opened.returncode != 0 and "the console did not start" in opened.stderr
        time.sleep(6)  # a try more, with the same answer: still one line
        log = b.log.read_text()
        assert log.count("console: not started") == 1 and "Traceback" not in log, log
        operator_answers(b)  # the gateway itself is whole
        taker.close()
        wait_for(lambda: b.op("status")["console"]["started"], timeout=20)
        assert get(port) == 200
        assert b.cli("console", "--no-open").stdout.strip() == f"http://localhost:{port}/"
    finally:
        taker.close()
        b.close()


def ss_time_wait(port: int) -> int:
    shown = subprocess.run(
        ["ss", "-Htan", "state", "time-wait", f"( sport = :{port} )"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return len(shown.splitlines())


def time_wait_of_a_server(port: int) -> None:
    """Sockets in TIME-WAIT on 127.0.0.1:PORT as a server leaves them (it closed first,
    as a gateway stopping does), and nothing listening."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen()
        for _ in range(3):
            client = socket.create_connection(("127.0.0.1", port))
            served, _ = listener.accept()
            served.close()  # the server closes first: its end goes to TIME-WAIT
            client.recv(1)
            client.close()


def time_wait_without_reuse(port: int) -> None:
    """A socket in TIME-WAIT on 127.0.0.1:PORT made without SO_REUSEADDR: a client bound
    to the port that closed first (what another program, or an agent, can leave)."""
    with socket.socket() as elsewhere:
        elsewhere.bind(("127.0.0.1", 0))
        elsewhere.listen()
        client = socket.socket()
        client.bind(("127.0.0.1", port))
        client.connect(elsewhere.getsockname())
        served, _ = elsewhere.accept()
        client.close()  # it closes first: its end, on PORT, goes to TIME-WAIT
        served.close()


def test_time_wait_alone_does_not_keep_the_console_out(
    tmp_path: Path, sshd: SshdInfo, client_key: tuple[Path, str]
) -> None:
    """A server's TIME-WAIT sockets on the port: the console starts at once. One made
    without SO_REUSEADDR (which keeps any listener out until it expires, a minute): the
    gateway starts, `status` names the TIME-WAIT, and the console starts by itself once
    it is gone."""
    b = make_bastion(tmp_path, sshd, client_key[0], start=False)
    port, other = free_port(), free_port()
    try:
        time_wait_of_a_server(port)
        assert ss_time_wait(port) >= 1
        # The control: that TIME-WAIT is there, and keeps out a listener without reuse.
        with socket.socket() as plain, pytest.raises(OSError) as taken:
            plain.bind(("127.0.0.1", port))
        assert taken.value.errno == errno.EADDRINUSE
        write_bastion_toml(b, f"[console]\nenabled = true\nport = {port}\n")
        b.start_daemon()
        console = b.op("status")["console"]
        assert console["started"] is True, console
        assert get(port) == 200
        b.stop_daemon()

        time_wait_without_reuse(other)
        assert ss_time_wait(other) == 1
        write_bastion_toml(b, f"[console]\nenabled = true\nport = {other}\n")
        b.start_daemon()
        console = b.op("status")["console"]
        assert console["started"] is False and "TIME-WAIT" in console["error"], console
        wait_for(lambda: b.op("status")["console"]["started"], timeout=90)
        assert ss_time_wait(other) == 0 and get(other) == 200
        assert "Traceback" not in b.log.read_text()
    finally:
        b.close()


# -- peers inside a run ------------------------------------------------------------------

# One GET of the console's state, as a process speaks it; what came back, or how it ended.
ASK = r"""
import http.client, json, sys
port = int(sys.argv[1])
try:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    conn.request("GET", "/api/state", headers={"Host": f"localhost:{port}"})
    print(json.dumps({"status": conn.getresponse().status}))
except (OSError, http.client.HTTPException) as exc:
    print(json.dumps({"status": None, "error": f"{type(exc).__name__}: {exc}"}))
"""


def ask_console(b: Bastion, port: int, *run: str) -> dict[str, Any]:
    """ASK from inside `bastion run RUN... --` (outside every run if `run` is empty)."""
    argv = [sys.executable, "-I", "-c", ASK, str(port)]
    if run:
        argv = [*cli_argv(b.home.root, "run", *run, "--"), *argv]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    lines = done.stdout.strip().splitlines()
    assert lines, (done.returncode, done.stderr[-2000:])
    got: dict[str, Any] = json.loads(lines[-1])
    return got


def test_a_console_request_from_inside_a_run_is_refused_before_any_http(
    tmp_path: Path, sshd: SshdInfo, client_key: tuple[Path, str]
) -> None:
    """From inside `bastion run --no-sandbox` (the host's network, the operator's uid)
    and a sandboxed run sharing the host's network (`--share-net`), the connection is
    reset before any HTTP; a default run does not reach the host's loopback at all. The
    control: the same program outside every run is answered."""
    b, port = console_bastion(tmp_path, sshd, client_key[0])
    try:
        assert ask_console(b, port) == {"status": 200}  # the control
        inside = ask_console(b, port, "--no-sandbox", "--label", "loopback")
        assert inside["status"] is None and "Connection" in inside["error"], inside
        shared = ask_console(b, port, "--share-net", "--label", "shared")
        assert shared["status"] is None, shared
        default = ask_console(b, port, "--label", "default")
        assert default["status"] is None, default
        refused = b.op("status")["console"]["refused"]
        assert refused["inside_run"] >= 1 and refused["sandboxed"] >= 1, refused
        log = b.log.read_text()
        assert "inside a `bastion run` or an agent's process tree" in log, log[-3000:]
        assert "inside a sandboxed run" in log, log[-3000:]
        assert ask_console(b, port) == {"status": 200}  # and once more, after
    finally:
        b.close()
