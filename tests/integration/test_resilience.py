"""A gateway that stays up: malformed input on either socket, a per-uid
connection cap, and a storm of connections past the descriptor limit.

Every input to the fuzz gets an answer (`ERR ...` on the agent socket before
SSH starts, one JSON line on the operator socket) or, once SSH has started, a
close -- within a bound (socket timeouts). Afterwards the gateway answers
`status`, runs a normal command through the real ssh client, has logged no
traceback, and holds no more descriptors than before.
"""

from __future__ import annotations

import contextlib
import json
import random
import socket
import struct
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bastion.core.defaults import MAX_CONNECTIONS_PER_TENANT
from bastion.devtools.sshd_fixture import SshdInfo
from bastion.ops import opsock
from tests.harness import (
    Bastion,
    approved_agent,
    make_bastion,
    open_fds,
    start_daemon_limited,
    wait_for,
)

SEED = 20240611
TIMEOUT = 15.0  # per input: above the header timeout (5 s), below anything that hangs
HEADER = b'BASTION/1 {"host": "web1", "port": "22", "user": "%s"}\n'
BANNER = b"SSH-2.0-OpenSSH_9.2p1 fuzz\r\n"
# Descriptors the gateway may hold after the fuzz beyond its baseline: the pooled
# outbound connection to the target can be replaced by the final command (the old
# one closes when its keepalive notices), and one operator `status` connection may
# still be closing when /proc is read.
FD_SLACK = 2


# -- one exchange ----------------------------------------------------------------------


def exchange(path: Path, data: bytes, then: bytes | None = None) -> tuple[bytes, str]:
    """Send `data` (and, after the gateway's first line, `then`), close our side,
    read until the gateway closes. Returns (everything read, how it ended):
    "eof", "reset" (closed with our bytes unread), or "timeout"."""
    got = b""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(TIMEOUT)
        s.connect(str(path))
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(data)
            if then is not None:
                while not got.endswith(b"\n") and (chunk := s.recv(1)):
                    got += chunk
                s.sendall(then)
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_WR)
        try:
            while chunk := s.recv(65536):
                got += chunk
        except ConnectionResetError:
            return got, "reset"
        except TimeoutError:
            return got, "timeout"
    return got, "eof"


# -- what the agent socket is sent -------------------------------------------------------


def agent_inputs(
    rng: random.Random, user: bytes, count: int
) -> Iterator[tuple[bytes, bytes | None]]:
    """(data, then) pairs: `then` is sent after the gateway's OK, when SSH speaks."""
    header = HEADER % user

    def nested(n: int) -> bytes:
        opener = rng.choice([b"[", b'{"a":', b"[{"])
        return b"BASTION/1 " + opener * n + b"\n"

    def packet(length: int, body: bytes) -> bytes:
        return struct.pack(">I", length) + body

    pre_ssh: list[Callable[[], bytes]] = [
        lambda: rng.randbytes(rng.randrange(0, 300)),
        lambda: rng.randbytes(rng.randrange(0, 300)) + b"\n",
        lambda: b"BASTION/1 " + rng.randbytes(rng.randrange(0, 200)) + b"\n",
        lambda: nested(rng.randrange(33, 1500)),
        lambda: b"BASTION/1 " + b"[" * 1500 + b"\n",
        lambda: b"BASTION/1 " + b"x" * rng.randrange(4090, 9000) + rng.choice([b"", b"\n"]),
        lambda: b"BASTION/1 " + json.dumps(rng.choice(HEADER_VALUES)).encode() + b"\n",
        lambda: header[: rng.randrange(0, len(header))],
        lambda: header + rng.randbytes(rng.randrange(1, 50)),  # more than one line
        lambda: b"",
    ]
    after_ok: list[Callable[[], bytes]] = [
        lambda: b"",
        lambda: rng.randbytes(rng.randrange(1, 400)),
        lambda: BANNER,
        lambda: BANNER + packet(rng.randrange(0, 6), rng.randbytes(rng.randrange(0, 20))),
        lambda: BANNER + packet(rng.randrange(0, 1 << 32), rng.randbytes(rng.randrange(0, 64))),
        lambda: BANNER + packet(rng.randrange(6, 300), rng.randbytes(rng.randrange(0, 300))),
        lambda: BANNER + rng.randbytes(rng.randrange(1, 600)),
        lambda: b"SSH-1.5-old\r\n" + rng.randbytes(10),
        lambda: b"SSH-2.0-" + b"v" * rng.randrange(200, 2000) + b"\r\n",
    ]
    for i in range(count):
        if i % 3 == 2:
            yield header, rng.choice(after_ok)()
        else:
            yield rng.choice(pre_ssh)(), None


HEADER_VALUES: list[Any] = [
    {"host": 1, "user": "u"},
    {"host": "web1"},
    {"user": "root"},
    {"host": "", "user": ""},
    {"host": ["web1"], "user": "root"},
    {"host": {"a": "b"}, "user": "root"},
    {"register": "run", "label": "x" * 101},
    {"register": "run", "label": "\x1b[31m"},
    {"register": "other"},
    {"register": None},
    [],
    "BASTION",
    None,
    3.5,
]


def check_agent_answer(data: bytes, then: bytes | None, got: bytes, ended: str) -> None:
    what = f"{data[:60]!r}... then {then[:40] if then else None!r}: got {got[:120]!r} ({ended})"
    assert ended in ("eof", "reset"), what
    if then is None and not got.startswith(b"OK"):  # refused before SSH: one ERR line
        assert got.startswith(b"ERR ") and got.endswith(b"\n") and got.count(b"\n") == 1, what
    elif then is not None:
        assert got.startswith(b"OK\n"), what


# -- what the operator socket is sent -----------------------------------------------------

# op -> {argument: type}. Every op is sent wrong types only, which must be refused
# before anything happens (the vault stays unlocked, no key is added or removed).
SCHEMA: dict[str, dict[str, str]] = {
    "status": {},
    "sessions": {},
    "key_list": {},
    "pending": {"wait": "number"},
    "answer": {"card": "str", "approve": "bool"},
    "revoke": {"session": "str"},
    "kill": {"request": "str"},
    "audit": {"view": "str", "last": "number"},
    "key_public": {"label": "str"},
    "lock": {"terminate": "bool"},
    "unlock": {"passphrase": "str"},
    "key_generate": {"label": "str", "algorithm": "str"},
    "key_import": {"label": "str", "private_key": "str"},
    "key_remove": {"label": "str"},
    # ca_init and ca_rotate are left out: with a None algorithm they rightly succeed.
    "ca_public": {},
    "ca_retire": {"which": "str"},
    "ca_openbao_login": {"token": "str"},
}


def wrong_value(rng: random.Random, kind: str) -> Any:
    pool: list[Any] = [
        [],
        {},
        [1, "a"],
        {"x": [1]},
        "abc",
        "",
        "1",
        "true",
        0,
        1,
        -5,
        1e308,
        True,
        False,
        None,
        float("nan"),
    ]
    while True:
        value = rng.choice(pool)
        if kind == "str" and not isinstance(value, str):
            return value
        if kind == "bool" and not isinstance(value, bool):
            return value
        if kind == "number" and (
            isinstance(value, bool | str | list | dict)
            or (isinstance(value, int | float) and not 0 <= value <= 600)
        ):
            return value


def operator_inputs(rng: random.Random, count: int) -> Iterator[tuple[bytes, bool]]:
    """(line, must_fail) pairs; must_fail: the answer must be ok false."""

    def typed() -> tuple[bytes, bool]:
        op = rng.choice(list(SCHEMA))
        args = SCHEMA[op]
        if not args:
            return json.dumps({"op": op, "junk": rng.randrange(9)}).encode() + b"\n", False
        doc: dict[str, Any] = {"op": op}
        for name, kind in args.items():
            doc[name] = wrong_value(rng, kind)
        return json.dumps(doc).encode() + b"\n", True

    makers: list[Callable[[], tuple[bytes, bool]]] = [
        typed,
        typed,
        typed,
        lambda: (rng.randbytes(rng.randrange(0, 300)) + b"\n", True),
        lambda: (rng.choice([b"[", b'{"op":', b'{"a":[']) * rng.randrange(33, 3000) + b"\n", True),
        lambda: (b'{"op":"watch","x":' + b"[" * 1500 + b"\n", True),
        lambda: (json.dumps(rng.choice([[], "status", 1, None, {"op": 5}])).encode() + b"\n", True),
        lambda: (json.dumps({"op": "no_such_op_" + str(rng.randrange(99))}).encode() + b"\n", True),
        lambda: (b'{"op": "status"' + b" " * rng.randrange(0, 50), True),  # cut short
    ]
    for _ in range(count):
        yield rng.choice(makers)()
    for _ in range(3):  # over the line limit, with and without a newline at the end
        yield (
            b'{"op":"status","x":"' + b"y" * ((1 << 20) + 10) + b'"}' + rng.choice([b"", b"\n"]),
            True,
        )


def check_operator_answer(line: bytes, must_fail: bool, got: bytes, ended: str) -> None:
    what = f"{line[:80]!r}: got {got[:200]!r} ({ended})"
    assert ended in ("eof", "reset"), what
    assert got.endswith(b"\n") and got.count(b"\n") == 1, what
    reply = json.loads(got)
    assert isinstance(reply, dict) and "ok" in reply, what
    if must_fail:
        assert reply["ok"] is False and isinstance(reply["error"], str) and reply["error"], what


# -- the tests ---------------------------------------------------------------------------


def test_fuzzing_both_sockets_leaves_the_gateway_serving(bastion: Bastion) -> None:
    assert bastion.daemon is not None
    pid = bastion.gateway_pid
    agent = approved_agent(bastion)
    assert agent.run("echo warm").rc == 0
    baseline = open_fds(pid)
    rng = random.Random(SEED)
    user = bastion.sshd.user.encode()
    started = time.monotonic()

    agent_cases = list(agent_inputs(rng, user, 2400))
    op_cases = list(operator_inputs(rng, 2400))
    with ThreadPoolExecutor(8) as pool:
        agent_results = pool.map(lambda c: exchange(bastion.home.agent_socket, *c), agent_cases)
        for (data, then), (got, ended) in zip(agent_cases, agent_results, strict=True):
            check_agent_answer(data, then, got, ended)
        op_results = pool.map(lambda c: exchange(bastion.home.operator_socket, c[0]), op_cases)
        for (line, must_fail), (got, ended) in zip(op_cases, op_results, strict=True):
            check_operator_answer(line, must_fail, got, ended)
    fuzz_seconds = time.monotonic() - started

    status = bastion.op("status")
    assert status["locked"] is False and status["pid"] == pid
    listeners = status["listeners"]
    assert listeners["agent"]["serving"] and listeners["operator"]["serving"]
    assert listeners["agent"]["accept_errors"] == 0
    assert listeners["agent"]["connection_errors"] > 0  # the SSH-level garbage was seen
    # Every connection opened to the service was closed to it, once.
    wait_for(lambda: bastion.op("status")["agent_connections"] == 0)
    assert bastion.op("status")["listeners"]["agent"]["connections"] == 0
    result = agent.run("echo still-serving")
    assert (result.rc, result.stdout) == (0, b"still-serving\n"), result.stderr
    log = bastion.log.read_text()
    assert "Traceback" not in log, log[-3000:]
    assert "Task exception was never retrieved" not in log
    wait_for(lambda: open_fds(pid) <= baseline + FD_SLACK, timeout=20)
    assert fuzz_seconds < 60, f"the fuzz took {fuzz_seconds:.0f}s"


def test_a_uid_over_its_connection_cap_is_told_why(bastion: Bastion) -> None:
    agent = approved_agent(bastion)
    path = str(bastion.home.agent_socket)
    idle: list[socket.socket] = []
    try:
        for _ in range(MAX_CONNECTIONS_PER_TENANT):  # the default cap; closed after 5 s
            s = socket.socket(socket.AF_UNIX)
            s.connect(path)
            idle.append(s)
        wait_for(
            lambda: (
                bastion.op("status")["listeners"]["agent"]["connections"]
                >= MAX_CONNECTIONS_PER_TENANT
            )
        )
        got, ended = exchange(bastion.home.agent_socket, HEADER % bastion.sshd.user.encode())
        assert ended in ("eof", "reset")  # reset: closed with our header unread
        # Full, not broken: the code core gives a full share says retry, as the words do.
        assert got.startswith(b"ERR [GATEWAY_BUSY] too many connections from uid ")
        limit = f"(limit {MAX_CONNECTIONS_PER_TENANT}); close idle ssh connections and retry"
        assert limit.encode() in got
        refused = agent.run("echo over-the-cap")
        assert refused.rc == 255
        assert refused.code == "GATEWAY_BUSY" and refused.error["retryable"] is True
        assert "too many connections" in refused.error["message"], refused.error
    finally:
        for s in idle:
            s.close()
    wait_for(lambda: bastion.op("status")["listeners"]["agent"]["connections"] == 0)
    result = agent.run("echo under-the-cap")
    assert (result.rc, result.stdout) == (0, b"under-the-cap\n"), result.stderr


def test_an_emfile_storm_on_the_agent_socket_is_survived(
    tmp_path: Path, sshd: SshdInfo, client_key: tuple[Path, str]
) -> None:
    """Healthy throughout means: every `status` that answers -- during the storm
    and after it -- says the agent listener is serving, and at least one answers
    while the storm holds the gateway's descriptors and already counts failed
    accepts. A `status` that cannot get through (the operator socket needs a
    descriptor too) is no answer, not an unhealthy one."""
    b = make_bastion(tmp_path, sshd, client_key[0], start=False)
    try:
        start_daemon_limited(b, 40)  # soft and hard: below the per-uid cap
        b.unlock()
        assert b.daemon is not None
        pid = b.gateway_pid
        agent = approved_agent(b)
        baseline = open_fds(pid)
        flood: list[socket.socket] = []
        answers: list[dict[str, Any]] = []
        unanswered = 0
        try:
            for _ in range(150):  # idle: no header, so each holds a descriptor for 5 s
                s = socket.socket(socket.AF_UNIX)
                s.setblocking(False)
                try:
                    s.connect(str(b.home.agent_socket))
                except BlockingIOError:  # the backlog is full: as much as the kernel queues
                    s.close()
                    break
                flood.append(s)
            deadline = time.monotonic() + 8
            while time.monotonic() < deadline:
                try:
                    answers.append(_status(b, 1.0))
                except (OSError, opsock.OperatorError):  # no descriptor to answer with
                    unanswered += 1
                time.sleep(0.3)
        finally:
            for s in flood:
                s.close()
        assert len(flood) > 40, "the storm did not exceed the descriptor limit"
        during = [a["listeners"]["agent"] for a in answers]
        assert all(a["serving"] for a in during), during
        assert any(a["accept_errors"] > 0 for a in during), (during, unanswered)
        wait_for(lambda: _answers(b), timeout=20)
        after = b.op("status")["listeners"]["agent"]
        assert after["serving"] and after["accept_errors"] > 0, after
        result = agent.run("echo after-the-storm")
        assert (result.rc, result.stdout) == (0, b"after-the-storm\n"), result.stderr
        assert b.op("status")["listeners"]["agent"]["serving"]
        wait_for(lambda: open_fds(pid) <= baseline + FD_SLACK, timeout=20)
        log = b.log.read_text()
        assert "Traceback" not in log, log[-3000:]
        assert log.count("accept EMFILE") <= 2  # once per socket, not once per failure
    finally:
        b.close()


def _status(b: Bastion, timeout: float) -> dict[str, Any]:
    result: dict[str, Any] = opsock.call(b.home.operator_socket, "status", timeout=timeout)
    return result


def _answers(b: Bastion) -> bool:
    try:
        _status(b, 2.0)
    except (OSError, opsock.OperatorError):
        return False
    return True
