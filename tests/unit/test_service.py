"""The request path against fakes: the authorize loop, cards that get no yes,
the final check, single-use command grants, the intent, action keys, recovery.

Each test builds one gateway lifetime over in-memory parts (`fakes.py`), so
what the integration tier shows end to end is shown here in milliseconds,
including the orderings that are hard to hit with real processes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import replace
from typing import Any

import pytest

from bastion.core.contract import Code, Failure
from bastion.core.defaults import MAX_PENDING_CARDS_PER_TENANT
from bastion.core.events import EventType, Outcome, Result, recover
from bastion.core.gate import Channel, Request
from bastion.core.policy import PolicyError
from bastion.core.subject import Run, SubjectKind
from bastion.gateway import authority as authority_mod
from bastion.gateway.admission import Admission
from bastion.gateway.approvals import CardError
from bastion.gateway.service import AgentConn, Case, new_request_id
from bastion.vault import WrongPassphrase
from tests.unit.fakes import (
    PASSPHRASE,
    FakeGateway,
    FakeJournal,
    FakeOutbound,
    FakePolicy,
    FakeProcessTree,
    FakeVault,
    idle,
    policy,
)

E = EventType


class Rig:
    """One unlocked lifetime and a helper to send requests through it."""

    def __init__(self, auto: bool = True) -> None:
        self.vault = FakeVault()
        self.policy = FakePolicy(policy())
        self.journal = FakeJournal()
        self.tree = FakeProcessTree()
        self.outbound = FakeOutbound(auto=auto)
        self.life = self.new_lifetime()

    def new_lifetime(self) -> FakeGateway:
        return FakeGateway(self.vault, self.policy, self.journal, self.tree, self.outbound)

    async def unlock(self) -> None:
        await self.life.authority.unlock(PASSPHRASE)

    def send(
        self, conn: AgentConn, command: bytes = b"echo hi", action: str | None = None, **kw: Any
    ) -> asyncio.Task[Result | Failure]:
        req = Request(
            new_request_id(),
            conn.host,
            conn.user,
            command,
            conn.peer.subject.key,
            action,
            kw.pop("channel", Channel.EXEC),
            kw.pop("ssh_user", None),
        )
        case = Case(conn, req, kw.pop("conversation", None), req.request_id, **kw)
        coro: Awaitable[Result | Failure] = self.life.service.handle(case)
        return asyncio.ensure_future(coro)

    async def card(self) -> Any:
        await idle()
        pending = self.life.book.pending()
        assert pending, "no card was raised"
        return pending[-1]

    async def connected(self) -> Any:
        """The target accepts the one connection the gateway is opening; the exec leaves."""
        await idle()
        (call,) = self.outbound.waiting()
        call.connect()
        await idle()
        return call

    async def finished(self, result: Result | None = None) -> None:
        (await self.connected()).finish(result or Result(Outcome.COMPLETED, exit_status=0))

    async def approve(self) -> Any:
        card = await self.card()
        self.life.authority.answer(card.id, True)
        return card


@pytest.fixture
async def rig() -> Rig:
    r = Rig()
    await r.unlock()
    return r


def code(result: Result | Failure) -> Code | None:
    return result.code


async def test_locked_vault_denies_at_once_and_sends_nothing() -> None:
    r = Rig()  # a lifetime starts locked
    conn = r.life.connect(r.tree.spawn())
    result = await r.send(conn)
    assert isinstance(result, Failure) and result.code is Code.VAULT_LOCKED
    assert r.life.book.pending() == [] and r.outbound.calls == []
    assert r.journal.for_request(result.request_id) == ["request_received", "denied"]


async def test_approved_session_runs_and_is_reused_by_the_same_process(rig: Rig) -> None:
    conn = rig.life.connect(rig.tree.spawn())
    task = rig.send(conn)
    card = await rig.approve()
    result = await task
    assert isinstance(result, Result) and result.outcome is Outcome.COMPLETED
    assert rig.journal.for_request(card.request_id) == [
        "request_received",
        "card_raised",
        "card_closed",
        "dispatch_started",
        "completed",
    ]
    again = await rig.send(conn)  # no card this time
    assert isinstance(again, Result) and len(rig.outbound.sent) == 2
    other = rig.life.connect(rig.tree.spawn())
    waiting = rig.send(other)
    assert (await rig.card()).subject.pid != card.subject.pid
    waiting.cancel()


@pytest.mark.parametrize(
    "user,command,expected",
    [("deploy", b"echo hi", Code.SESSION_DENIED), ("ops", b"echo hi", Code.CALL_DENIED)],
)
async def test_a_declined_card_is_a_denial_of_its_kind(
    rig: Rig, user: str, command: bytes, expected: Code
) -> None:
    conn = rig.life.connect(rig.tree.spawn(), user=user)
    task = rig.send(conn, command)
    if user == "ops":
        await rig.approve()  # the session card; the command card follows
    card = await rig.card()
    rig.life.authority.answer(card.id, False)
    result = await task
    assert isinstance(result, Failure) and result.code is expected
    assert rig.outbound.calls == []


@pytest.mark.parametrize(
    "watched,expected", [(False, Code.NO_APPROVER), (True, Code.APPROVAL_TIMEOUT)]
)
async def test_an_unanswered_card_times_out(rig: Rig, watched: bool, expected: Code) -> None:
    conn = rig.life.connect(rig.tree.spawn())
    task = rig.send(conn)
    await rig.card()
    if watched:
        rig.life.book.note_operator()
    (timer,) = rig.life.timers.armed()
    assert timer.delay == 120.0
    timer.fire()
    result = await task
    assert isinstance(result, Failure) and result.code is expected


async def test_lock_withdraws_waiting_cards_and_nothing_is_kept(rig: Rig) -> None:
    conn = rig.life.connect(rig.tree.spawn())
    task = rig.send(conn)
    card = await rig.card()
    await rig.life.authority.lock(terminate=False)
    result = await task
    assert isinstance(result, Failure) and result.code is Code.VAULT_LOCKED
    await rig.unlock()
    with pytest.raises(CardError):
        rig.life.authority.answer(card.id, True)
    assert rig.outbound.calls == []


async def test_a_card_dies_with_its_connection_or_its_process(rig: Rig) -> None:
    agent = rig.tree.spawn()
    conn = rig.life.connect(agent)
    task = rig.send(conn)
    await rig.card()
    rig.life.service.connection_closed(conn)
    result = await task
    assert isinstance(result, Failure) and result.code is Code.SESSION_DENIED
    assert "ended before it was approved" in result.message

    conn = rig.life.connect(agent)
    task = rig.send(conn)
    card = await rig.card()
    rig.tree.alive_keys.discard((agent.pid, agent.start_time))
    rig.life.authority.subject_exited(card.subject)
    result = await task
    assert isinstance(result, Failure) and result.code is Code.SESSION_DENIED


async def test_the_final_check_stops_a_send_when_the_vault_locks_during_connect() -> None:
    r = Rig(auto=False)
    await r.unlock()
    conn = r.life.connect(r.tree.spawn())
    task = r.send(conn)
    await r.approve()
    await idle()
    (call,) = r.outbound.waiting()
    await r.life.authority.lock(terminate=False)
    await r.unlock()  # a new epoch: the old decision is void even when unlocked again
    call.connect()
    result = await task
    assert isinstance(result, Failure) and result.code is Code.SESSION_DENIED
    assert result.reauth_reason == "vault_state_changed"
    assert r.outbound.sent == [] and r.journal.of(E.DISPATCH_STARTED) == []


async def test_a_command_grant_is_spent_before_the_send_and_never_reused() -> None:
    r = Rig(auto=False)
    await r.unlock()
    conn = r.life.connect(r.tree.spawn(), user="ops")
    task = r.send(conn, b"echo once")
    await r.approve()  # session
    command_card = await r.approve()
    await idle()
    (call,) = r.outbound.waiting()
    grant = r.life.book.command_grant(command_card.id)
    assert grant is not None and not grant.used
    call.connect()
    await idle()
    spent = r.life.book.command_grant(command_card.id)
    assert spent is not None and spent.used  # the gate itself now refuses it
    call.finish(Result(Outcome.COMPLETED, exit_status=0))
    assert isinstance(await task, Result)
    assert r.life.book.command_grant(command_card.id) is None  # gone with its request
    again = r.send(conn, b"echo once")
    assert (await r.card()).kind.value == "command"  # the same bytes need a new card
    again.cancel()


async def test_preapproved_commands_skip_only_the_command_card(rig: Rig) -> None:
    conn = rig.life.connect(rig.tree.spawn(), user="ops")
    task = rig.send(conn, b"uptime")
    assert (await rig.approve()).kind.value == "session"
    assert isinstance(await task, Result)


async def test_no_durable_intent_means_nothing_is_sent(rig: Rig) -> None:
    rig.journal.fail_intents = True
    conn = rig.life.connect(rig.tree.spawn())
    task = rig.send(conn)
    await rig.approve()
    result = await task
    assert isinstance(result, Failure) and result.code is Code.INTERNAL
    assert rig.outbound.sent == []


async def test_a_request_whose_first_record_cannot_be_written_is_refused_at_once(
    rig: Rig,
) -> None:
    """`request_received` is the only record with the command and the subject: a
    request the journal cannot hold is not taken (no card, no dispatch)."""
    rig.journal.fail = {E.REQUEST_RECEIVED}
    result = await rig.send(rig.life.connect(rig.tree.spawn()))
    assert isinstance(result, Failure) and result.code is Code.INTERNAL
    assert "could not write this request to its journal" in result.message
    assert rig.life.book.pending() == [] and rig.outbound.calls == []


async def test_a_record_lost_after_receipt_keeps_the_command_from_being_sent(rig: Rig) -> None:
    """A full disk costs the card's record; the disk has room again by the time the
    card is approved; the command is still not sent: its story has a hole."""
    rig.journal.fail = {E.CARD_RAISED}
    task = rig.send(rig.life.connect(rig.tree.spawn()))
    card = await rig.card()
    rig.journal.fail = set()
    rig.life.authority.answer(card.id, True)
    result = await task
    assert isinstance(result, Failure) and result.code is Code.INTERNAL
    assert "could not journal every record of this request" in result.message
    assert rig.outbound.sent == []
    assert "dispatch_started" not in rig.journal.for_request(card.request_id)


class Confirm:
    """A witness that confirms the intent's head when the test says so."""

    def __init__(self) -> None:
        self.asked: list[int] = []
        self.answer: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()

    async def __call__(self, seq: int) -> str | None:
        self.asked.append(seq)
        return await self.answer


async def test_with_a_witness_the_intent_is_confirmed_before_the_exec_leaves(rig: Rig) -> None:
    witness = rig.life.service.witnessed = Confirm()
    task = rig.send(rig.life.connect(rig.tree.spawn()))
    card = await rig.approve()
    await idle()
    intent = [
        r for r in rig.journal.of(E.DISPATCH_STARTED) if r.meta["request_id"] == card.request_id
    ]
    assert [r.seq for r in intent] == witness.asked  # its head is what the witness must hold
    assert rig.outbound.sent == []  # not before the witness confirmed it
    witness.answer.set_result(None)
    assert isinstance(await task, Result) and len(rig.outbound.sent) == 1
    assert rig.journal.for_request(card.request_id).count("dispatch_started") == 1


async def test_a_lock_while_the_witness_confirms_sends_nothing(rig: Rig) -> None:
    witness = rig.life.service.witnessed = Confirm()
    task = rig.send(rig.life.connect(rig.tree.spawn()))
    card = await rig.approve()
    await idle()
    assert witness.asked
    await rig.life.authority.lock(terminate=False)
    witness.answer.set_result(None)
    result = await task
    assert isinstance(result, Failure) and result.code is Code.VAULT_LOCKED
    assert rig.outbound.sent == []
    story = rig.journal.for_request(card.request_id)
    assert story[-2:] == ["dispatch_started", "denied"]  # on record, and said not sent


async def test_a_witness_that_cannot_confirm_refuses_before_the_exec(rig: Rig) -> None:
    witness = rig.life.service.witnessed = Confirm()
    witness.answer.set_result("the audit witness did not confirm ...; send it again later")
    task = rig.send(rig.life.connect(rig.tree.spawn()))
    await rig.approve()
    result = await task
    assert isinstance(result, Failure) and result.code is Code.GATEWAY_BUSY
    assert result.code.retryable and rig.outbound.sent == []


async def test_an_unknown_outcome_blocks_its_action_until_acknowledged() -> None:
    r = Rig(auto=False)
    await r.unlock()
    conn = r.life.connect(r.tree.spawn())
    task = r.send(conn, action="deploy-42")
    await r.approve()
    await r.finished(Result(Outcome.UNKNOWN, code=Code.STATUS_UNKNOWN, cause="connection_lost"))
    first = await task
    assert isinstance(first, Result) and first.outcome is Outcome.UNKNOWN
    blocked = await r.send(conn, action="deploy-42")
    assert isinstance(blocked, Failure) and blocked.code is Code.ACTION_OUTCOME_UNKNOWN
    assert len(r.outbound.calls) == 1
    other = r.send(conn, action="other")
    await r.finished()
    assert isinstance(await other, Result)
    acked = r.send(conn, action="deploy-42", ack_unknown=True)
    await r.finished()
    assert isinstance(await acked, Result)
    assert r.journal.of(E.ACTION_ACKNOWLEDGED)


async def test_a_restart_closes_what_the_last_lifetime_left_open() -> None:
    r = Rig(auto=False)
    await r.unlock()
    conn = r.life.connect(r.tree.spawn())
    sent = r.send(conn, action="deploy-1")
    await r.approve()
    await r.connected()
    asking = r.send(r.life.connect(r.tree.spawn()))
    await r.card()
    r.life.kill()  # kill -9 while one command runs and one request waits for a card
    sent.cancel()
    asking.cancel()
    await idle()
    life = r.new_lifetime()
    life.service.recover(recover(r.journal.records))
    closed = {x.meta["request_id"]: x.type for x in r.journal.records if x.boot == life.boot_id}
    first, second = (rec.meta["request_id"] for rec in r.journal.of(E.REQUEST_RECEIVED))
    assert closed == {first: "unknown", second: "not_started"}
    assert life.service.actions.blocking("deploy-1") == first  # unknown: look before retrying


async def test_an_exec_into_another_binary_ends_the_approval(rig: Rig) -> None:
    agent = rig.tree.spawn()
    conn = rig.life.connect(agent)
    task = rig.send(conn)
    await rig.approve()
    await task
    agent.exe = "/usr/bin/other"  # same pid and start time, another executable
    conn = rig.life.connect(agent)
    waiting = rig.send(conn)
    card = await rig.card()
    assert card.reason is not None and card.reason.value == "process_changed"
    waiting.cancel()


async def test_a_policy_edit_ends_approvals_of_that_entry(rig: Rig) -> None:
    conn = rig.life.connect(rig.tree.spawn())
    task = rig.send(conn)
    await rig.approve()
    await task
    rig.policy.value = policy(port=2222)
    waiting = rig.send(conn)
    card = await rig.card()
    assert card.reason is not None and card.reason.value == "policy_changed"
    assert rig.life.book.sessions() == []
    rig.policy.value = PolicyError("broken")
    rig.life.authority.answer(card.id, True)
    result = await waiting
    assert isinstance(result, Failure) and result.code is Code.POLICY_UNAVAILABLE
    assert [r.type for r in rig.journal.records if r.type.startswith("policy")] == [
        "policy_loaded",
        "policy_loaded",
        "policy_failed",
    ]


async def test_kill_signals_the_command_and_records_its_end(rig: Rig) -> None:
    r = Rig(auto=False)
    await r.unlock()
    conn = r.life.connect(r.tree.spawn())
    task = r.send(conn)
    await r.approve()
    await r.connected()
    (rid,) = r.life.service.inflight
    ended = await r.life.authority.lock(terminate=True)
    assert ended == [rid]
    result = await task
    assert isinstance(result, Result) and result.outcome is Outcome.SIGNALLED
    assert r.journal.for_request(rid)[-1] == "signalled"


async def test_a_refused_request_is_journaled_and_never_asks(rig: Rig) -> None:
    conn = rig.life.connect(rig.tree.spawn())
    result = await rig.send(conn, b"", channel=Channel.SHELL)
    assert isinstance(result, Failure) and result.code is Code.UNSUPPORTED_REQUEST
    assert "an interactive shell" in result.message
    assert rig.journal.for_request(result.request_id) == ["request_received", "denied"]
    assert rig.life.book.pending() == [] and rig.outbound.calls == []


async def test_a_uid_cannot_bury_the_operator_in_cards(rig: Rig) -> None:
    """Processes outside every run count against their uid: each forked child is a
    subject of its own, so the uid is their only common bound."""
    waiting = [
        rig.send(rig.life.connect(rig.tree.spawn())) for _ in range(MAX_PENDING_CARDS_PER_TENANT)
    ]
    await idle()
    assert len(rig.life.book.pending()) == MAX_PENDING_CARDS_PER_TENANT
    result = await rig.send(rig.life.connect(rig.tree.spawn()))
    # Nothing was sent and the same request may run later: busy, retryable, and said so.
    assert isinstance(result, Failure) and result.code is Code.GATEWAY_BUSY
    assert result.code.retryable and result.code.exit_status == 69
    assert f"the limit is {MAX_PENDING_CARDS_PER_TENANT}" in result.message
    assert "from uid 1000" in result.message and "send this request again" in result.message
    assert "Nothing was sent" in result.message
    for task in waiting:
        task.cancel()


def run_conn(rig: Rig, uid: int = 0) -> AgentConn:
    """A connection whose subject is a registered run (an isolated one is root's)."""
    agent = rig.tree.spawn("/usr/bin/python3")
    subject = replace(
        agent.subject(),
        uid=uid,
        run=Run("agents", None, f"b:{uid}:1", 0.0, uid),
        kind=SubjectKind.RUN,
    )
    peer = replace(agent.peer(), subject=subject)
    conn = AgentConn(peer, "web1", "deploy")
    rig.life.service.connection_opened(conn)
    return conn


async def test_one_run_cannot_take_another_runs_cards(rig: Rig) -> None:
    """Every isolated run is root's and its agent has the agent user's uid: the card
    cap counts the run, so a run at its cap leaves another run's share untouched."""
    greedy = run_conn(rig)
    waiting = [rig.send(greedy) for _ in range(MAX_PENDING_CARDS_PER_TENANT)]
    await idle()
    refused = await rig.send(greedy)
    assert isinstance(refused, Failure) and refused.code is Code.GATEWAY_BUSY
    assert f"registered run pid {greedy.peer.subject.pid}" in refused.message
    other = rig.send(run_conn(rig))
    card = await rig.card()
    assert card.subject.pid != greedy.peer.subject.pid  # the other run was asked about
    rig.life.authority.answer(card.id, True)
    assert isinstance(await other, Result)
    for task in waiting:
        task.cancel()


async def test_the_subject_is_read_again_at_each_request(rig: Rig) -> None:
    agent = rig.tree.spawn()
    conn = rig.life.connect(agent)
    first = rig.send(conn)
    await rig.approve()
    assert isinstance(await first, Result)
    agent.exe = "/usr/bin/other"  # exec'd after its connection was identified
    rig.life.service.edges = replace(rig.life.service.edges, refresh=lambda s: agent.subject())
    waiting = rig.send(conn)  # the same, old connection
    card = await rig.card()
    assert card.reason is not None and card.reason.value == "process_changed"
    assert card.subject.exe == "/usr/bin/other"
    waiting.cancel()


async def test_a_shared_ssh_connection_is_refused_before_any_card(rig: Rig) -> None:
    rig.life.service.edges = replace(rig.life.service.edges, rides_a_master=lambda p: True)
    result = await rig.send(rig.life.connect(rig.tree.spawn()))
    assert isinstance(result, Failure) and result.code is Code.UNSUPPORTED_REQUEST
    assert "ControlMaster" in result.message and rig.life.book.pending() == []


async def test_a_full_witness_buffer_set_to_refuse_stops_new_work_before_any_card(rig: Rig) -> None:
    """`when_full = "refuse"`: nothing is dispatched the collector could not hear of,
    and the agent is told why and that a retry later may work."""
    full = "the audit witness is 9 entries behind; retry later"
    rig.life.service.edges = replace(rig.life.service.edges, refusing=lambda: full)
    result = await rig.send(rig.life.connect(rig.tree.spawn()))
    # Not now, and nothing was sent: the same request later may run (retryable).
    assert isinstance(result, Failure) and result.code is Code.GATEWAY_BUSY
    assert result.code.retryable and result.message == full and rig.life.book.pending() == []
    assert rig.outbound.calls == [] and rig.outbound.sent == []
    rig.life.service.edges = replace(rig.life.service.edges, refusing=lambda: None)  # caught up
    waiting = rig.send(rig.life.connect(rig.tree.spawn()))
    await rig.card()
    waiting.cancel()


async def approved_in_flight(r: Rig) -> tuple[AgentConn, asyncio.Task[Result | Failure]]:
    """An agent whose approved command holds its in-flight slot (the target is slow)."""
    conn = r.life.connect(r.tree.spawn())
    task = r.send(conn)
    await r.approve()
    await idle()
    return conn, task


async def test_past_the_in_flight_limit_a_command_waits_then_is_told_busy() -> None:
    r = Rig(auto=False)
    await r.unlock()
    r.life.service.admission = Admission(limit=1, wait=0.05)
    _, first = await approved_in_flight(r)
    conn = r.life.connect(r.tree.spawn())
    second = r.send(conn)
    await r.approve()
    result = await asyncio.wait_for(second, 5)
    assert isinstance(result, Failure) and result.code is Code.GATEWAY_BUSY
    assert result.code.retryable and len(r.outbound.calls) == 1  # only the first left
    assert r.journal.for_request(result.request_id)[-1] == "denied"
    assert "dispatch_started" not in r.journal.for_request(result.request_id)
    await r.finished()
    assert isinstance(await first, Result)
    again = r.send(conn)  # a slot is free again
    await r.finished()
    assert isinstance(await again, Result)


async def one_queued(r: Rig, wait: float) -> tuple[Any, Any]:
    """One command in flight under a limit of one, a second approved and waiting its turn."""
    await r.unlock()
    r.life.service.admission = Admission(limit=1, wait=wait)
    _, first = await approved_in_flight(r)
    second = r.send(r.life.connect(r.tree.spawn()))
    await r.approve()
    await idle()
    assert r.life.service.admission.waiting() == 1
    return first, second


async def test_a_lock_while_queued_stops_the_command_when_its_turn_comes() -> None:
    r = Rig(auto=False)
    first, second = await one_queued(r, wait=30)
    await r.life.authority.lock(terminate=False)
    await r.finished()
    await first
    await r.connected()  # its turn: the final check runs as the channel opens
    result = await asyncio.wait_for(second, 5)
    assert isinstance(result, Failure) and result.code is Code.VAULT_LOCKED
    assert r.outbound.sent == []  # neither left: the lock came before either channel opened
    assert r.life.service.admission.inflight == 0


async def test_wrong_passphrases_in_a_row_cost_ever_longer(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    waits: list[float] = []

    async def record(seconds: float) -> None:
        waits.append(seconds)

    monkeypatch.setattr(authority_mod.asyncio, "sleep", record)
    await rig.life.authority.lock(terminate=False)
    for _ in range(3):
        with pytest.raises(WrongPassphrase):
            await rig.life.authority.unlock(b"wrong")
    await rig.unlock()
    with pytest.raises(WrongPassphrase):
        await rig.life.authority.unlock(b"wrong")  # a success started the count again
    assert waits == [0.5, 1.0, 2.0, 0.5]


async def test_an_unreachable_target_is_journaled_not_started_and_the_agent_told_so() -> None:
    """The outbound side raises a `Refusal` for an ending before the exec left: the
    journal's `not_started` (with its cause) and the agent's answer are as before."""
    r = Rig(auto=False)
    await r.unlock()
    conn = r.life.connect(r.tree.spawn())
    task = r.send(conn, action="deploy-1")
    await r.approve()
    await idle()
    (call,) = r.outbound.waiting()
    call.connect(ok=False)
    result = await task
    assert isinstance(result, Failure) and result.code is Code.UNREACHABLE
    assert result.message == "unreachable"
    assert r.journal.for_request(result.request_id)[-1] == "not_started"
    (record,) = r.journal.of(E.NOT_STARTED)
    assert record.meta["code"] == "UNREACHABLE" and record.meta["cause"] == "UNREACHABLE"
    assert r.life.service.actions.blocking("deploy-1") is None


async def test_a_locked_vault_answers_before_every_refusal_an_edge_observes() -> None:
    """The refusals once decided before the gate (a shell, another ssh user, a shared
    connection, a journal that cannot record, a witness refusing) come after the lock."""
    r = Rig()  # a lifetime starts locked
    for kw in ({"channel": Channel.SHELL}, {"channel": Channel.SHARED}, {"ssh_user": "root"}):
        result = await r.send(r.life.connect(r.tree.spawn()), **kw)
        assert isinstance(result, Failure) and result.code is Code.VAULT_LOCKED, kw
    behind = "the audit witness is 9 entries behind"
    r.life.service.edges = replace(
        r.life.service.edges, rides_a_master=lambda p: True, refusing=lambda: behind
    )
    result = await r.send(r.life.connect(r.tree.spawn()))
    assert isinstance(result, Failure) and result.code is Code.VAULT_LOCKED
    assert r.journal.for_request(result.request_id) == ["request_received", "denied"]
    r.journal.fail = {E.REQUEST_RECEIVED}
    result = await r.send(r.life.connect(r.tree.spawn()))
    assert isinstance(result, Failure) and result.code is Code.VAULT_LOCKED
    assert r.outbound.calls == [] and r.life.book.pending() == []
    await r.unlock()  # unlocked, each is refused in the contract's order
    result = await r.send(r.life.connect(r.tree.spawn()))
    assert isinstance(result, Failure) and result.code is Code.UNSUPPORTED_REQUEST
    assert "ControlMaster" in result.message
    r.life.service.edges = replace(r.life.service.edges, rides_a_master=lambda p: False)
    result = await r.send(r.life.connect(r.tree.spawn()))
    assert isinstance(result, Failure) and result.code is Code.INTERNAL
    r.journal.fail = set()
    result = await r.send(r.life.connect(r.tree.spawn()))
    assert isinstance(result, Failure) and result.code is Code.GATEWAY_BUSY


async def test_an_ssh_user_other_than_the_proxys_is_refused_before_any_card(rig: Rig) -> None:
    conn = rig.life.connect(rig.tree.spawn())
    result = await rig.send(conn, ssh_user="root")
    assert isinstance(result, Failure) and result.code is Code.UNSUPPORTED_REQUEST
    assert result.message == (
        'The ssh user "root" does not match the user "deploy" given to the proxy; '
        "use USER@HOST. Nothing was sent."
    )
    assert rig.life.book.pending() == []


async def test_a_wait_for_a_slot_that_ran_out_while_the_vault_locked_says_vault_locked() -> None:
    r = Rig(auto=False)
    first, second = await one_queued(r, wait=0.05)
    await r.life.authority.lock(terminate=False)
    result = await asyncio.wait_for(second, 5)  # the wait runs out: the lock comes first
    assert isinstance(result, Failure) and result.code is Code.VAULT_LOCKED
    assert r.journal.for_request(result.request_id)[-1] == "denied"
    first.cancel()


async def test_an_acknowledgement_on_a_request_the_gateway_does_not_take_is_not_made() -> None:
    r = Rig(auto=False)
    await r.unlock()
    conn = r.life.connect(r.tree.spawn())
    task = r.send(conn, action="deploy-42")
    await r.approve()
    await r.finished(Result(Outcome.UNKNOWN, code=Code.STATUS_UNKNOWN, cause="connection_lost"))
    await task
    refused = await r.send(conn, b"", action="deploy-42", ack_unknown=True, channel=Channel.SHELL)
    assert isinstance(refused, Failure) and refused.code is Code.UNSUPPORTED_REQUEST
    assert not r.journal.of(E.ACTION_ACKNOWLEDGED)
    blocked = await r.send(conn, action="deploy-42")
    assert isinstance(blocked, Failure) and blocked.code is Code.ACTION_OUTCOME_UNKNOWN
