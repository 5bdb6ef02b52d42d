"""asyncssh makes the gateway's target connections through `AckAtOnce` (gateway/acks.py).

A canary: `acks.py` hands asyncssh an object as its `tunnel`, which asyncssh asks to
`create_connection`. If a later asyncssh stops doing that, reads would go
unacknowledged for 40 ms again and only the bench would notice; this fails first.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import asyncssh

from bastion.devtools.sshd_fixture import SshdInfo
from bastion.gateway import acks


class _Counted(acks.AckAtOnce):
    def __init__(self) -> None:
        self.made = 0
        self.acked = 0

    async def create_connection(self, factory, host, port):  # type: ignore[no-untyped-def]
        def counted() -> asyncio.Protocol:
            proto = factory()
            received = proto.data_received

            def data_received(data: bytes, *args: object) -> None:
                self.acked += 1
                received(data, *args)

            proto.data_received = data_received
            return proto

        self.made += 1
        return await super().create_connection(counted, host, port)


def test_asyncssh_connects_through_the_acking_tunnel(
    sshd: SshdInfo, client_key: tuple[Path, str]
) -> None:
    tunnel = _Counted()

    async def two_commands() -> list[int | None]:
        async with asyncssh.connect(
            sshd.address,
            sshd.port,
            username=sshd.user,
            client_keys=[str(client_key[0])],
            known_hosts=None,
            config=None,
            tunnel=tunnel,
        ) as conn:
            return [(await conn.run("true")).exit_status for _ in range(2)]

    assert asyncio.run(asyncio.wait_for(two_commands(), 60)) == [0, 0]
    assert tunnel.made == 1
    assert tunnel.acked > 0  # each read went through acks.acking's wrapper, then this one
