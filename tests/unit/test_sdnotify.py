"""The gateway's side of sd_notify(3): addresses, messages, the watchdog's pace, the beat.

The datagrams go to a real unix socket the test binds (abstract namespace,
as systemd's `@` form names it); the gateway itself is driven through
systemd's protocol in tests/integration/test_service_unit.py.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from bastion.gateway import sdnotify
from bastion.gateway.sdnotify import Notifier, Target


@pytest.mark.parametrize(
    ("value", "address"),
    [
        ("/run/systemd/notify", b"/run/systemd/notify"),
        ("/run/user/1000/systemd/notify", b"/run/user/1000/systemd/notify"),
        ("@/org/freedesktop/systemd1/notify/42", b"\0/org/freedesktop/systemd1/notify/42"),
        ("@x", b"\0x"),
        ("@", None),
        ("", None),
        ("run/relative", None),
        ("vsock:2:1234", None),
    ],
)
def test_the_socket_address_is_a_path_or_the_abstract_namespace(
    value: str, address: bytes | None
) -> None:
    assert sdnotify.socket_address(value) == address


def test_a_message_is_key_value_lines_and_a_value_cannot_start_a_new_one() -> None:
    assert sdnotify.message(("READY", "1"), ("STATUS", "locked")) == b"READY=1\nSTATUS=locked"
    assert sdnotify.message(("STATUS", "a\nREADY=1\r\nb")) == b"STATUS=a READY=1 b"


@pytest.mark.parametrize(
    ("env", "interval"),
    [
        ({"WATCHDOG_USEC": "30000000"}, 15.0),
        ({"WATCHDOG_USEC": "400000"}, 0.2),
        ({"WATCHDOG_USEC": "400000", "WATCHDOG_PID": "4242"}, 0.2),
        ({"WATCHDOG_USEC": "400000", "WATCHDOG_PID": "1"}, None),  # meant for another process
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({}, None),
    ],
)
def test_the_watchdog_is_pinged_at_half_its_interval_and_only_for_this_process(
    env: dict[str, str], interval: float | None
) -> None:
    assert sdnotify.watchdog_interval(env, 4242) == interval


def test_the_beat_keeps_the_watchdog_pace_and_looks_at_the_status_every_few_seconds() -> None:
    assert Target(b"/x", 0.2).period == 0.2
    assert Target(b"/x", 15.0).period == sdnotify.STATUS_EVERY
    assert Target(b"/x", None).period == sdnotify.STATUS_EVERY
    assert Target.from_env({"WATCHDOG_USEC": "400000"}, 1) is None  # no NOTIFY_SOCKET
    assert Target.from_env({"NOTIFY_SOCKET": "@n", "WATCHDOG_USEC": "400000"}, 1) == Target(
        b"\0n", 0.2
    )


def test_the_status_line() -> None:
    assert sdnotify.status_line(True, 3, 1) == "locked: run `bastion unlock`"
    assert sdnotify.status_line(False, 0, 0) == "unlocked, 0 sessions"
    assert sdnotify.status_line(False, 1, 0) == "unlocked, 1 session"
    assert sdnotify.status_line(False, 2, 1) == "unlocked, 2 sessions, 1 card waiting"
    assert sdnotify.status_line(False, 2, 3) == "unlocked, 2 sessions, 3 cards waiting"


@pytest.fixture
def listener() -> Iterator[tuple[socket.socket, str]]:
    """A datagram socket in the abstract namespace, named as $NOTIFY_SOCKET would name it."""
    name = f"bastion-test-notify-{secrets.token_hex(6)}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name.encode())
    sock.setblocking(False)
    try:
        yield sock, "@" + name
    finally:
        sock.close()


async def receive(sock: socket.socket, timeout: float = 5.0) -> dict[str, str]:
    data = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(sock, 4096), timeout)
    return dict(line.split("=", 1) for line in data.decode().split("\n"))


@dataclass
class FakeVault:
    locked: bool = True


@dataclass
class FakeBook:
    live: list[object] = field(default_factory=list)
    cards: list[object] = field(default_factory=list)

    def sessions(self) -> list[object]:
        return self.live

    def pending(self) -> list[object]:
        return self.cards


async def test_ready_then_pings_from_the_loop_then_status_changes_then_stopping(
    listener: tuple[socket.socket, str],
) -> None:
    sock, name = listener
    state = {"status": "locked"}
    notifier = Notifier(Target(sdnotify.socket_address(name) or b"", 0.05), lambda: state["status"])
    notifier.ready()
    assert await receive(sock) == {"READY": "1", "STATUS": "locked"}
    for _ in range(3):
        assert await receive(sock) == {"WATCHDOG": "1"}  # the status did not change: not resent
    state["status"] = "unlocked, 1 session"
    msg = await receive(sock)
    assert msg == {"WATCHDOG": "1", "STATUS": "unlocked, 1 session"}
    notifier.stopping()
    assert await receive(sock) == {"STOPPING": "1", "STATUS": "stopping"}
    with pytest.raises(TimeoutError):  # no ping after STOPPING: a slow stop is not a hang
        await receive(sock, timeout=0.3)


async def test_without_a_watchdog_only_status_changes_are_sent(
    listener: tuple[socket.socket, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sdnotify, "STATUS_EVERY", 0.05)
    sock, name = listener
    state = {"status": "locked"}
    notifier = Notifier(Target(sdnotify.socket_address(name) or b"", None), lambda: state["status"])
    notifier.ready()
    assert await receive(sock) == {"READY": "1", "STATUS": "locked"}
    with pytest.raises(TimeoutError):
        await receive(sock, timeout=0.3)
    state["status"] = "unlocked, 0 sessions"
    assert await receive(sock) == {"STATUS": "unlocked, 0 sessions"}
    notifier.stopping()


async def test_start_reads_and_removes_the_variables_and_reports_the_gateway(
    listener: tuple[socket.socket, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sock, name = listener
    monkeypatch.setenv("NOTIFY_SOCKET", name)
    monkeypatch.setenv("WATCHDOG_USEC", "100000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    vault, book = FakeVault(locked=False), FakeBook(live=[1, 2], cards=[3])
    notifier = sdnotify.start(vault, book)
    try:
        for key in sdnotify.ENV_KEYS:  # nothing the gateway starts later inherits them
            assert key not in os.environ
        assert await receive(sock) == {
            "READY": "1",
            "STATUS": "unlocked, 2 sessions, 1 card waiting",
        }
        assert await receive(sock) == {"WATCHDOG": "1"}
        vault.locked = True
        assert (await receive(sock))["STATUS"] == "locked: run `bastion unlock`"
    finally:
        notifier.stopping()


async def test_without_notify_socket_nothing_is_sent_or_opened(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key in sdnotify.ENV_KEYS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WATCHDOG_USEC", "100000")  # a watchdog alone is not a manager to talk to
    notifier = sdnotify.start(FakeVault(), FakeBook())
    assert notifier.target is None
    notifier.beat()
    notifier.stopping()
    assert notifier._sock is None and notifier._task is None


async def test_a_missing_socket_is_reported_once_and_never_raises(
    caplog: pytest.LogCaptureFixture, tmp_path: os.PathLike[str]
) -> None:
    missing = os.path.join(tmp_path, "gone.sock")
    notifier = Notifier(Target(os.fsencode(missing), 0.05), lambda: "locked")
    notifier.ready()
    for _ in range(3):
        notifier.beat()
    notifier.stopping()
    warnings = [r for r in caplog.records if "could not notify systemd" in r.getMessage()]
    assert len(warnings) == 1


async def test_a_failing_status_line_never_stops_the_pings(
    listener: tuple[socket.socket, str],
) -> None:
    """The watchdog watches the loop; a bug in the status line must not get a healthy
    gateway restarted."""
    sock, name = listener
    calls = {"n": 0}

    def status() -> str:
        calls["n"] += 1
        if calls["n"] > 1:
            raise RuntimeError("broken")
        return "locked"

    notifier = Notifier(Target(sdnotify.socket_address(name) or b"", 0.05), status)
    notifier.ready()
    try:
        assert await receive(sock) == {"READY": "1", "STATUS": "locked"}
        for _ in range(3):
            assert await receive(sock) == {"WATCHDOG": "1"}
    finally:
        notifier.stopping()


def test_the_first_process_hands_the_main_pid_to_the_gateways_child(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`bastion daemon` runs the gateway in a child (`bastion.memory`): the process
    systemd started says MAINPID= first, and the child takes over its watchdog."""
    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as manager:
        manager.bind(str(path))
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        sdnotify.hand_over(4242)
        assert manager.recv(4096) == b"MAINPID=4242"
    monkeypatch.setenv("WATCHDOG_PID", "17")
    sdnotify.taken_over(17)
    assert os.environ["WATCHDOG_PID"] == str(os.getpid())
    monkeypatch.setenv("WATCHDOG_PID", "18")  # meant for another process: left alone
    sdnotify.taken_over(17)
    assert os.environ["WATCHDOG_PID"] == "18"
    monkeypatch.delenv("NOTIFY_SOCKET")
    sdnotify.hand_over(4242)  # not run by systemd: nothing is sent, nothing fails
