"""The waiting line: its words (`core/waiting`), who may turn it off (the account's
`waiting_line`, the agent's `BASTION_WAIT_LINE`), and that the request path writes
one line per raised card and none for a request that needs no card."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from bastion.core.contract import Failure
from bastion.core.events import Outcome, Result
from bastion.core.gate import Channel, Request
from bastion.core.policy import PolicyError, build_policy, entry_digest
from bastion.core.waiting import wanted
from bastion.gateway.service import AgentConn, Case, new_request_id
from tests.unit.fakes import (
    PASSPHRASE,
    FakeGateway,
    FakeJournal,
    FakeOutbound,
    FakePolicy,
    FakeProcessTree,
    FakeVault,
    idle,
    policy_text,
)

# entry_digest of fakes.policy()'s two accounts on the base tree (fcef418), before the
# field existed: an account that does not set it keeps its digest (its approvals hold).
BASE_DIGESTS = [
    "0e6ddf0be82857d6a5d346fdfef5a638e2462df483bc25f28c2e1734b4cf1678",
    "aed3fd6102d63b56bc6fa825eee200c725a27c904cd9b2717ee1441e0de228cd",
]


def parsed(text: str) -> Any:
    return build_policy([("p.toml", "p.toml", text)])


def quiet_ops(value: str = "false") -> str:
    return policy_text().replace(
        'approval = "per-command"', f'approval = "per-command"\nwaiting_line = {value}'
    )


def digests(text: str) -> list[str]:
    host = parsed(text).hosts["web1"]
    return [entry_digest(host, a) for a in host.accounts]


def test_the_field_defaults_on_and_is_digested_only_when_off() -> None:
    assert digests(policy_text()) == BASE_DIGESTS
    assert digests(quiet_ops("true")) == BASE_DIGESTS
    quiet = digests(quiet_ops())
    assert quiet[0] == BASE_DIGESTS[0] and quiet[1] != BASE_DIGESTS[1]
    ops = parsed(quiet_ops()).hosts["web1"].accounts[1]
    assert ops.waiting_line is False


def test_the_field_is_a_boolean() -> None:
    with pytest.raises(PolicyError, match='field "waiting_line" must be true or false'):
        parsed(quiet_ops('"no"'))


@pytest.mark.parametrize(
    ("account", "agent", "shown"),
    [
        (True, None, True),
        (True, "1", True),
        (True, "", True),
        (True, "0", False),
        (True, " OFF ", False),
        (True, "no", False),
        (True, "false", False),
        (False, None, False),
        (False, "1", False),
    ],
)
def test_who_may_turn_it_off(account: bool, agent: str | None, shown: bool) -> None:
    assert wanted(account, agent) is shown


class Rig:
    def __init__(self, text: str | None = None) -> None:
        self.outbound = FakeOutbound(auto=True)
        self.tree = FakeProcessTree()
        self.life = FakeGateway(
            FakeVault(),
            FakePolicy(parsed(text or policy_text())),
            FakeJournal(),
            self.tree,
            self.outbound,
        )
        self.told: list[bytes] = []

    def send(
        self, conn: AgentConn, command: bytes = b"echo hi", wait_line: str | None = None
    ) -> asyncio.Task[Result | Failure]:
        req = Request(
            new_request_id(), conn.host, conn.user, command, conn.peer.subject.key, None,
            Channel.EXEC, None,
        )  # fmt: skip
        case = Case(conn, req, None, req.request_id, tell=self.told.append, wait_line=wait_line)
        coro = self.life.service.handle(case)
        return asyncio.ensure_future(coro)

    async def card(self) -> Any:
        await idle()
        pending = self.life.book.pending()
        assert pending, "no card was raised"
        return pending[-1]

    async def finish(self, task: asyncio.Task[Result | Failure]) -> None:
        await idle()
        for call in self.outbound.waiting():
            call.connect()
        await idle()
        for call in self.outbound.waiting():
            call.finish(Result(Outcome.COMPLETED, exit_status=0))
        result = await task
        assert isinstance(result, Result) and result.outcome is Outcome.COMPLETED, result


async def test_one_line_per_card_as_it_is_raised_and_none_without_a_card() -> None:
    rig = Rig()
    await rig.life.authority.unlock(PASSPHRASE)
    conn = rig.life.connect(rig.tree.spawn(), user="ops")  # per-command: two cards
    task = rig.send(conn)
    session = await rig.card()
    (line,) = rig.told  # written when the card was raised, before any answer
    assert session.id.encode() in line and b"session card for ops@web1" in line
    assert line.startswith(b"bastion: waiting for approval of card ") and line.endswith(b"\n")
    assert line.count(b"\n") == 1 and line.isascii() and b"`bastion approve`" in line
    rig.life.authority.answer(session.id, True)
    command = await rig.card()
    assert command.id != session.id and len(rig.told) == 2
    assert command.id.encode() in rig.told[1] and b"command card for ops@web1" in rig.told[1]
    rig.life.authority.answer(command.id, True)
    await rig.finish(task)
    assert len(rig.told) == 2
    preapproved = rig.send(conn, b"uptime")  # the session holds, no card: no line
    await rig.finish(preapproved)
    assert len(rig.told) == 2


@pytest.mark.parametrize("quiet", ["agent", "account"])
async def test_turned_off_no_line_is_written(quiet: str) -> None:
    rig = Rig(quiet_ops() if quiet == "account" else None)
    await rig.life.authority.unlock(PASSPHRASE)
    conn = rig.life.connect(rig.tree.spawn(), user="ops")
    task = rig.send(conn, wait_line="0" if quiet == "agent" else None)
    rig.life.authority.answer((await rig.card()).id, True)
    rig.life.authority.answer((await rig.card()).id, True)
    await rig.finish(task)
    assert rig.told == []


async def test_a_writer_that_fails_does_not_fail_the_request() -> None:
    rig = Rig()
    await rig.life.authority.unlock(PASSPHRASE)
    conn = rig.life.connect(rig.tree.spawn())

    def broken(line: bytes) -> None:
        raise BrokenPipeError("the agent's channel is closing")

    req = Request(
        new_request_id(), conn.host, conn.user, b"echo hi", conn.peer.subject.key, None,
        Channel.EXEC, None,
    )  # fmt: skip
    task = asyncio.ensure_future(
        rig.life.service.handle(Case(conn, req, None, req.request_id, tell=broken))
    )
    rig.life.authority.answer((await rig.card()).id, True)
    await rig.finish(task)
