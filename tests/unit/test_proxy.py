"""The proxy's handshake with the daemon, without ssh (pure socket tests), and every
way it can end before SSH starts, held to the agent-facing contract."""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bastion.agent import proxy, wire
from bastion.agent.proxy import read_reply
from bastion.core.contract import CONTRACT, Code
from bastion.ops.opsock import loads_line

ARGS = ["web1", "22", "deploy"]


def test_read_reply_leaves_the_ssh_banner_on_the_socket() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"OK\nSSH-2.0-bastion\r\n")
        assert read_reply(b) == b"OK\n"
        assert b.recv(100) == b"SSH-2.0-bastion\r\n"


def test_read_reply_stops_at_close() -> None:
    a, b = socket.socketpair()
    with b:
        t = threading.Thread(target=lambda: (a.sendall(b"ERR no"), a.close()))
        t.start()
        assert read_reply(b) == b"ERR no"
        t.join(5)


# -- each way the proxy ends before SSH, run in this process against fake gateways --------


@contextlib.contextmanager
def listening(path: Path, backlog: int = 8) -> Iterator[socket.socket]:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with server:
        server.bind(str(path))
        server.listen(backlog)
        yield server


def no_socket(path: Path) -> contextlib.AbstractContextManager[object]:
    return contextlib.nullcontext()


@contextlib.contextmanager
def stale_socket(path: Path) -> Iterator[None]:
    """A socket file nobody listens on: a gateway that died."""
    with listening(path):
        pass
    yield


@contextlib.contextmanager
def silent(path: Path) -> Iterator[None]:
    """Takes the connection (the kernel's queue) and never answers: a wedged gateway."""
    with listening(path):
        yield


@contextlib.contextmanager
def queue_full(path: Path) -> Iterator[None]:
    """A wedged gateway whose listen queue is full: a blocking connect would wait for ever."""
    with listening(path, backlog=0), socket.socket(socket.AF_UNIX) as first:
        first.connect(str(path))
        yield


@contextlib.contextmanager
def answering(path: Path, reply: bytes | None) -> Iterator[None]:
    """Reads the header and answers `reply` (None: closes with the header unread,
    which resets the connection)."""
    with listening(path) as server:

        def serve() -> None:
            conn, _ = server.accept()
            with conn:
                select.select([conn], [], [], 10)  # the header has arrived
                if reply is not None:
                    conn.recv(4096)
                    conn.sendall(reply)

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        yield
        t.join(10)


CASES: dict[str, tuple[Callable[[Path], contextlib.AbstractContextManager[object]], str, str]] = {
    "not running": (no_socket, "INTERNAL", "is not running"),
    "stale socket": (stale_socket, "INTERNAL", "not accepting connections"),
    "refused": (lambda p: answering(p, b"ERR too many\n"), "INTERNAL", "refused the connection"),
    "refused, coded": (
        lambda p: answering(p, b"ERR [INTERNAL] not a header\n"),
        "INTERNAL",
        "refused the connection: not a header.",
    ),
    "full": (
        lambda p: answering(p, b"ERR [GATEWAY_BUSY] too many connections; retry\n"),
        "GATEWAY_BUSY",
        "refused the connection: too many connections; retry.",
    ),
    "unknown code": (
        lambda p: answering(p, b"ERR [MADE_UP] no\n"),
        "INTERNAL",
        "refused the connection: no.",
    ),
    "closed": (lambda p: answering(p, b""), "INTERNAL", "no reply"),
    "reset": (lambda p: answering(p, None), "INTERNAL", "Could not talk"),
    "silent": (silent, "GATEWAY_BUSY", "did not answer within 0.5 s"),
    "queue full": (queue_full, "GATEWAY_BUSY", "did not answer within 0.5 s"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_ending_before_ssh_is_a_contract_line_with_a_sentence(
    case: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    gateway, code, says = CASES[case]
    monkeypatch.setattr(wire, "REPLY_TIMEOUT", 0.5)
    path = tmp_path / "agent.sock"
    ended: list[int] = []
    with gateway(path):
        t = threading.Thread(
            target=lambda: ended.append(proxy.main(["--socket", str(path), *ARGS]))
        )
        t.daemon = True
        t.start()
        t.join(10)
    assert ended, "the proxy was still waiting after 10 s"
    error = json.loads(capsys.readouterr().err.strip().splitlines()[-1])["error"]
    assert error["code"] == code, error
    assert (ended[0], error["retryable"]) == CONTRACT[Code(code)], error
    assert says in error["message"] and "None" not in error["message"], error
    assert error["message"].endswith("Nothing was sent to the target."), error


def test_a_name_too_long_for_the_header_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert proxy.main(["--socket", "/nonexistent", "h" * 5000, "22", "u"]) == 70
    error = json.loads(capsys.readouterr().err)["error"]
    assert error["code"] == "INTERNAL" and "too long" in error["message"]


def test_a_refusal_line_reads_back_as_written() -> None:
    """The gateway writes `refusal_line`, the proxy and the agent client `read_refusal`:
    one format, with lines of older gateways (no code) still read."""
    line = wire.refusal_line("GATEWAY_BUSY", "too many connections [x] ] y")
    assert line == b"ERR [GATEWAY_BUSY] too many connections [x] ] y\n"
    assert wire.read_refusal(line) == ("GATEWAY_BUSY", "too many connections [x] ] y")
    assert wire.read_refusal(b"ERR too many\n") == (None, "too many")
    assert wire.read_refusal(b"ERR [not a code] x\n") == (None, "[not a code] x")
    assert wire.read_refusal(b"") == (None, "")


# -- what the ssh that started the proxy asked for ------------------------------------------


@pytest.mark.parametrize(
    "argv,asked",
    [
        (["ssh", "-N", "web1"], "-N"),
        (["ssh", "-f", "web1", "true"], "-f"),
        (["ssh", "-fN", "web1"], "-f"),  # grouped flags
        (["ssh", "-L", "8080:localhost:80", "web1", "true"], "-L"),
        (["ssh", "-L8080:localhost:80", "web1"], "-L"),  # the argument attached
        (["ssh", "-R", "9000:localhost:22", "web1", "true"], "-R"),
        (["ssh", "-D", "1080", "web1"], "-D"),
        (["ssh", "-W", "localhost:22", "web1"], "-W"),
        (["ssh", "-w", "any", "web1"], "-w"),
        (["ssh", "web1", "-N"], "-N"),  # options may follow the destination
        (["ssh", "-F", "cfg", "web1", "-tt", "-L", "1:h:2", "ls"], "-L"),
        (["ssh", "-o", "SessionType=none", "web1"], "-o SessionType"),
        (["ssh", "-oSessionType none", "web1"], "-o SessionType"),
        (["ssh", "-o", "forkafterauthentication=yes", "web1", "true"], "-f"),
        (["ssh", "-o", "LocalForward=8080 localhost:80", "web1", "true"], "-o LocalForward"),
        (["ssh", "-o", "DynamicForward 1080", "web1", "true"], "-D"),
        (["ssh", "-o", "ControlMaster=no", "-N", "web1"], "-N"),
        (["ssh", "-M", "-N", "-L", "1:h:2", "web1"], "-L"),  # a master forwards nothing either
    ],
)
def test_the_proxy_refuses_what_bastion_does_not_serve(argv: list[str], asked: str) -> None:
    problem = proxy.ssh_problem(argv)
    assert problem is not None and asked in problem, (argv, problem)
    assert "one command per ssh call" in problem


@pytest.mark.parametrize(
    "argv",
    [
        ["ssh", "-F", "cfg", "web1", "uptime"],
        ["ssh", "web1", "ls", "-N", "-L", "x"],  # the command's words, not ssh's options
        ["ssh", "web1", "--", "-N"],
        ["ssh", "--", "web1", "-N"],
        ["ssh", "-l", "-N", "web1", "true"],  # -N as -l's argument (a login name)
        ["ssh", "-o", "SessionType=default", "web1", "true"],
        ["ssh", "-o", "ForkAfterAuthentication=no", "-o", "Tunnel=no", "web1", "true"],
        # a ControlMaster in the background, for later commands (the gateway judges those)
        ["ssh", "-M", "-S", "/x/cp", "-o", "ControlPersist=60", "-N", "-f", "web1"],
        ["ssh", "-o", "ControlMaster=yes", "-o", "ControlPath=/x", "-N", "-f", "web1"],
        # ansible's own: ControlMaster/ControlPersist and -tt are the gateway's to judge
        [
            "ssh",
            "-C",
            "-o",
            "ControlMaster=auto",
            "-o",
            "ControlPersist=60s",
            "-o",
            "ControlPath=/x/%C",
            "-tt",
            "web1",
            "/bin/sh -c 'echo ~ && sleep 0'",
        ],
    ],
)
def test_the_proxy_lets_a_command_through(argv: list[str]) -> None:
    assert proxy.ssh_problem(argv) is None, argv


def test_the_proxy_checks_only_an_openssh_parent() -> None:
    """Run by pytest (python), the proxy checks nothing: paramiko's ProxyCommand and
    other parents are the gateway's to answer."""
    assert proxy.parent_ssh_argv() is None


# -- the header, written without json, and what the helper imports --------------------------


@given(st.text(), st.text(), st.text())
def test_the_header_reads_back_as_the_names_given(host: str, port: str, user: str) -> None:
    line = wire.header(host, port, user)
    assert line.startswith(wire.PROTOCOL) and line.endswith(b"\n") and line.count(b"\n") == 1
    assert line.isascii()
    fields = loads_line(line[len(wire.PROTOCOL) :])
    assert (
        fields
        == json.loads(line[len(wire.PROTOCOL) :])
        == {"host": host, "port": port, "user": user}
    )


# What made the helper's start twice as long as the interpreter's (module comment in proxy.py).
HEAVY = {"json", "socket", "contextlib", "selectors", "enum", "re", "select", "collections"}


def test_the_way_to_ssh_imports_nothing_heavy(tmp_path: Path) -> None:
    """The whole path an agent's ssh call takes -- header, OK, the socket passed to ssh
    (ProxyUseFdpass) -- run as ssh runs it (-I -S), with Python listing its imports."""
    path = tmp_path / "agent.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)
    got: list[bytes] = []

    def gateway() -> None:
        conn, _ = listener.accept()
        with conn:
            got.append(conn.recv(4096))
            conn.sendall(b"OK\n")
            conn.recv(1)  # until the proxy is gone

    ssh_end, proxy_end = socket.socketpair()
    t = threading.Thread(target=gateway, daemon=True)
    t.start()
    with listener, ssh_end, proxy_end:
        done = subprocess.run(
            [sys.executable, "-I", "-S", "-X", "importtime", proxy.__file__,
             "--socket", str(path), *ARGS],
            stdout=proxy_end, stderr=subprocess.PIPE, timeout=60,
        )  # fmt: skip
        _, fds, _, _ = socket.recv_fds(ssh_end, 1, 1)
        for fd in fds:
            os.close(fd)
    t.join(10)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert fds, "the proxy passed ssh no socket"
    assert got and got[0] == wire.header(*ARGS)
    imported = {
        line.rsplit("|", 1)[-1].strip()
        for line in done.stderr.decode().splitlines()
        if line.startswith("import time:") and "|" in line
    }
    assert "_socket" in imported  # the listing is what it claims to be
    assert not imported & HEAVY, sorted(imported & HEAVY)
    assert "wire" in imported  # the wire beside it, by path


def test_a_copy_of_the_proxy_alone_says_what_it_needs(tmp_path: Path) -> None:
    """Isolation installs the proxy with its wire beside it; a proxy copied alone ends in
    the agent-facing shape with the fix (the same copy with its wire is the control)."""
    lonely, paired = tmp_path / "lonely", tmp_path / "paired"
    for folder in (lonely, paired):
        folder.mkdir()
        (folder / "proxy.py").write_bytes(Path(proxy.__file__).read_bytes())
    (paired / "wire.py").write_bytes(Path(wire.__file__).read_bytes())
    missing = str(tmp_path / "no.sock")
    runs = {}
    for folder in (lonely, paired):
        argv = [sys.executable, "-I", "-S", str(folder / "proxy.py"), "--socket", missing, *ARGS]
        runs[folder] = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    alone = runs[lonely]
    assert alone.returncode == CONTRACT[Code.INTERNAL][0], alone.stderr
    error = json.loads(alone.stderr)["error"]
    assert error["code"] == "INTERNAL" and error["retryable"] is False
    assert "wire.py beside it" in error["message"] and str(lonely) in error["message"]
    assert "Nothing was sent" in error["message"]
    # With its wire, the copy gets as far as the socket (which is not there).
    assert "wire.py" not in runs[paired].stderr
    assert json.loads(runs[paired].stderr)["error"]["code"] == "INTERNAL"
    assert str(missing) in runs[paired].stderr or "gateway" in runs[paired].stderr
