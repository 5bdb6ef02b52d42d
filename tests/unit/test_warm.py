"""The warm set's rules (`gateway/warm.py`), with connections that are futures and a clock
and timers the test moves by hand: one parked per key, handed out once, never one that is
gone, recycled and replaced only while used, all closed by `retire_all`; and the
dispatcher's login on a warm connection that turns out gone (`gateway/outbound.py`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import asyncssh
import pytest

from bastion.core.contract import Code, Refusal
from bastion.core.policy import parse_policy_text
from bastion.gateway.outbound import Dispatcher
from bastion.gateway.warm import Opening, Parked, Warm

KEY = ("127.0.0.1", 22, "deploy", "ssh-ed25519 AAAA")


class Timers:
    """`loop.call_later`'s shape, run by hand."""

    def __init__(self) -> None:
        self.due: list[tuple[float, Callable[[], None]]] = []

    def __call__(self, delay: float, callback: Callable[[], None]) -> None:
        self.due.append((delay, callback))

    def fire(self) -> None:
        due, self.due = self.due, []
        for _, callback in due:
            callback()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _opening() -> Opening:
    loop = asyncio.get_running_loop()
    return Opening(Parked(), loop.create_future())


def _warm(clock: Clock, timers: Timers) -> tuple[Warm, list[Opening], Callable[[], Opening]]:
    opened: list[Opening] = []

    def opener() -> Opening:
        opened.append(_opening())
        return opened[-1]

    return Warm(recycle=30, keep_warm=120, clock=clock, schedule=timers), opened, opener


def _run(test: Callable[[], Any]) -> None:
    asyncio.run(test())


def test_a_parked_connection_is_handed_out_once_and_one_is_parked_per_key() -> None:
    async def test() -> None:
        warm, opened, opener = _warm(Clock(), Timers())
        assert warm.take(KEY, 1, opener) is None  # nothing parked before the first command
        warm.fill(KEY, 1)
        warm.fill(KEY, 1)
        assert len(opened) == 1 and warm.parked() == 1  # one per key, however often asked
        assert warm.take(KEY, 1, opener) is opened[0]
        assert warm.take(KEY, 1, opener) is None  # taken is gone from the set: never twice
        assert warm.stats() == {"parked": 0, "opened": 1, "rode": 1, "missed": 2}
        warm.fill(("10.0.0.2", *KEY[1:]), 1)  # a key that took nothing opens nothing
        assert len(opened) == 1

    _run(test)


@pytest.mark.parametrize("how", ["failed", "lost"])
def test_a_connection_that_is_gone_is_never_handed_out(how: str) -> None:
    async def test() -> None:
        warm, opened, opener = _warm(Clock(), Timers())
        warm.take(KEY, 1, opener)
        warm.fill(KEY, 1)
        if how == "failed":
            opened[0].task.set_exception(ConnectionResetError("dropped"))
        else:
            opened[0].client.connection_lost(None)
        assert warm.parked() == 0
        assert warm.take(KEY, 1, opener) is None
        warm.fill(KEY, 1)
        assert len(opened) == 2 and warm.take(KEY, 1, opener) is opened[1]  # the control

    _run(test)


def test_a_parked_connection_is_recycled_and_replaced_only_while_its_key_is_used() -> None:
    async def test() -> None:
        clock, timers = Clock(), Timers()
        warm, opened, opener = _warm(clock, timers)
        warm.take(KEY, 1, opener)
        warm.fill(KEY, 1)
        clock.now += 30
        timers.fire()  # used 30 s ago: recycled, and replaced
        assert opened[0].task.cancelled() and len(opened) == 2 and warm.parked() == 1
        clock.now += 100
        timers.fire()  # used 130 s ago: closed, and none opened
        assert opened[1].task.cancelled() and len(opened) == 2 and warm.parked() == 0
        warm.fill(KEY, 1)  # the key was forgotten: only a command's take brings it back
        assert len(opened) == 2

    _run(test)


def test_retire_all_closes_every_parked_connection_and_ends_its_timers() -> None:
    async def test() -> None:
        timers = Timers()
        warm, opened, opener = _warm(Clock(), timers)
        other = ("10.0.0.2", *KEY[1:])
        for key in (KEY, other):
            warm.take(key, 1, opener)
            warm.fill(key, 1)
        assert warm.parked() == 2  # the control
        warm.retire_all()  # a lock: the vault is in epoch 2 now
        assert warm.parked() == 0 and all(o.task.cancelled() for o in opened)
        timers.fire()
        # A command decided in epoch 1 and still on its way parks nothing, even if it
        # takes (a CA that is not the vault's can still sign for it).
        assert warm.take(KEY, 1, opener) is None
        warm.fill(KEY, 1)
        assert len(opened) == 2 and warm.parked() == 0
        warm.take(KEY, 3, opener)  # unlocked again: a command in the new epoch
        warm.fill(KEY, 3)
        assert len(opened) == 3 and warm.parked() == 1

    _run(test)


def test_a_parked_client_answers_the_auth_step_once() -> None:
    async def test() -> None:
        client = Parked()
        asked = asyncio.ensure_future(client.public_key_auth_requested())
        await client.parked.wait()
        assert not asked.done() and not client.sent  # it waits for the certificate
        client.give("the login")
        assert await asked == ["the login"] and client.sent
        assert await client.public_key_auth_requested() is None  # no second key, ever

        closed = Parked()
        waiting = asyncio.ensure_future(closed.public_key_auth_requested())
        await closed.parked.wait()
        closed.close()  # a lock: the auth step ends, no login is sent
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert not closed.sent

    _run(test)


# -- the dispatcher's login on a warm connection ------------------------------------------


def _target() -> Any:
    host_key = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode().strip()
    text = f"""
[hosts.web1]
address = "127.0.0.1"
port = 22
host_key = "{host_key}"
connect_timeout = 5

[[hosts.web1.accounts]]
user = "deploy"
credential = "k1"
auth = "certificate"
source_address = ["127.0.0.1"]
"""
    host = parse_policy_text(text, "p.toml")["web1"]
    return host, host.accounts[0]


class _Issued:
    key, certificate, key_id, serial = "key", "cert", "req_1", 1


def _login(sent_before_drop: bool) -> tuple[list[Opening], object]:
    """Log in on a warm connection that drops once given its login (after sending it, or
    before); any fresh one succeeds. Which connections were opened, and the ending."""

    async def test() -> tuple[list[Opening], object]:
        host, account = _target()
        dispatcher = Dispatcher(lambda _: None)  # type: ignore[arg-type,return-value]
        opened: list[Opening] = []

        def open_parked(_h: Any = None, _a: Any = None) -> Opening:
            opened.append(_opening())
            if len(opened) > 1:
                opened[-1].task.set_result("the fresh connection")  # type: ignore[arg-type]
            return opened[-1]

        dispatcher._open_parked = open_parked  # type: ignore[method-assign]
        key = ("127.0.0.1", 22, "deploy", host.host_key)
        dispatcher.warm.take(key, 1, open_parked)
        dispatcher.warm.fill(key, 1)
        (parked,) = opened

        def drop(_: Any) -> None:
            parked.client.sent = sent_before_drop
            parked.task.set_exception(asyncssh.ConnectionLost("dropped"))

        parked.client.give = drop  # type: ignore[method-assign]
        try:
            return opened, await dispatcher._login(host, account, 1, _Issued())  # type: ignore[arg-type]
        except Refusal as refused:
            return opened, refused

    return asyncio.run(test())


def test_a_warm_connection_gone_before_the_certificate_left_is_replaced() -> None:
    opened, ended = _login(sent_before_drop=False)
    assert len(opened) == 2 and ended == "the fresh connection"


def test_a_warm_connection_gone_after_the_certificate_left_fails_as_a_fresh_one_would() -> None:
    opened, ended = _login(sent_before_drop=True)
    assert len(opened) == 1  # the certificate is never offered on a second connection
    assert isinstance(ended, Refusal) and ended.code is Code.UNREACHABLE
