"""Every read on a connection to a target is acknowledged at once (gateway/acks.py)."""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace
from typing import Any

import asyncssh
import pytest

from bastion.gateway import acks
from bastion.gateway.outbound import Dispatcher


class _Sock:
    def __init__(self, log: list[Any]) -> None:
        self.log = log

    def setsockopt(self, level: int, option: int, value: int) -> None:
        self.log.append(("ack", level, option, value))


class _Transport(asyncio.BaseTransport):
    def __init__(self, log: list[Any]) -> None:
        super().__init__()
        self.sock = _Sock(log)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.sock if name == "socket" else default


class _Protocol(asyncio.Protocol):
    def __init__(self, log: list[Any]) -> None:
        self.log = log

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.log.append("made")

    def data_received(self, data: bytes) -> None:
        self.log.append(("data", data))


@pytest.mark.skipif(acks.QUICKACK is None, reason="TCP_QUICKACK is Linux's")
def test_each_read_is_acknowledged_before_it_is_handed_on() -> None:
    log: list[Any] = []
    proto = acks.acking(_Protocol(log))
    proto.data_received(b"early")  # before the transport: nothing to set, data still passes
    proto.connection_made(_Transport(log))
    proto.data_received(b"one")
    proto.data_received(b"two")
    ack = ("ack", socket.IPPROTO_TCP, acks.QUICKACK, 1)
    assert log == [("data", b"early"), "made", ack, ("data", b"one"), ack, ("data", b"two")]


def test_a_socket_already_gone_does_not_lose_the_data() -> None:
    log: list[Any] = []

    class Gone(_Sock):
        def setsockopt(self, *args: int) -> None:
            raise OSError(9, "Bad file descriptor")

    transport = _Transport(log)
    transport.sock = Gone(log)
    proto = acks.acking(_Protocol(log))
    proto.connection_made(transport)
    proto.data_received(b"last")
    assert log == ["made", ("data", b"last")]


def test_every_outbound_connection_goes_through_it() -> None:
    """The pooled logins and the certificate ones (warm or not) take `_options`."""
    key = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode()
    dispatcher = SimpleNamespace(keepalive_interval=15, keepalive_count_max=3)
    host, account = SimpleNamespace(host_key=key), SimpleNamespace(user="deploy")
    options = Dispatcher._options(dispatcher, host, account)  # type: ignore[arg-type]
    assert options["tunnel"] is acks.ACK_AT_ONCE
