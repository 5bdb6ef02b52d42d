"""A stateful property test of the gateway service: random interleavings of
everything that can happen to a gateway, with the invariants checked after
every step.

Steps: agents start, connect and send commands; operators approve, deny or
let cards time out; the vault locks (with or without ending commands in
flight) and unlocks; the gateway is killed and restarted; sessions are
revoked; processes exit or exec into another binary; the policy is edited or
broken; targets accept, refuse, finish or cut off commands; time passes.
Half the sequences run with a witness, which confirms (or cannot confirm) each
intent's head when a step says so.

Invariants:
  * nothing is sent without an unlocked vault, a live session grant of this
    lifetime and this vault epoch for the live process that asked, for the
    current policy entry -- and, for a per-command account, a command grant
    for exactly those bytes, spent at that moment and never before;
  * nothing asked while the vault was locked is ever sent;
  * a command grant is spent at most once;
  * with a witness, nothing is sent whose intent the witness did not confirm;
  * every request ends with exactly one terminal record (after the final
    restart, which closes what a killed lifetime left open), and every
    dispatched one with exactly one outcome -- or, with a witness that could not
    confirm its intent, a denial (nothing was sent);
  * no task dies of an unexpected exception.

The default tier runs a few hundred sequences; `BASTION_THOROUGH=1` runs
10,000 (`.ci/run` does, as a separate step).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
from typing import Any

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from bastion.core.events import TERMINAL, EventType, Outcome, Result, recover
from bastion.core.gate import Request
from bastion.core.policy import ApprovalMode, PolicyError, entry_digest, is_preapproved
from bastion.gateway.approvals import CardError
from bastion.gateway.service import AgentConn, Case, new_request_id
from tests.unit.fakes import (
    PASSPHRASE,
    Agent,
    Call,
    FakeGateway,
    FakeJournal,
    FakeOutbound,
    FakePolicy,
    FakeProcessTree,
    FakeVault,
    policy,
    settle,
)

THOROUGH = os.environ.get("BASTION_THOROUGH") == "1"
LOG = logging.getLogger("bastion")
POLICIES = [
    policy(),
    policy(port=2222),  # every entry of web1 changes
    policy(allow='"echo *", "uptime"'),  # only deploy's entry changes
    PolicyError("broken.toml: invalid TOML"),
]
COMMANDS = [b"echo hi", b"echo two", b"uptime", b"rm -rf /tmp/x"]
EXES = ["/usr/bin/agent", "/usr/bin/other"]
DISRUPTIONS = [
    "lock",
    "restart",
    "revoke",
    "disconnect",
    "process exits",
    "process execs",
    "policy edit",
    "time passes",
]
E = EventType
TERMINAL_TYPES = frozenset(k.value for k in TERMINAL)


class FakeWitness:
    """Holds each intent's confirmation until a step gives it (or says it cannot)."""

    def __init__(self) -> None:
        self.waiting: list[tuple[int, asyncio.Future[str | None]]] = []
        self.confirmed: set[int] = set()

    async def __call__(self, seq: int) -> str | None:
        fut: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self.waiting.append((seq, fut))
        return await fut

    def answer(self, i: int, ok: bool) -> None:
        self.waiting = [(seq, fut) for seq, fut in self.waiting if not fut.done()]
        if self.waiting:
            seq, fut = self.waiting.pop(i % len(self.waiting))
            if ok:
                self.confirmed.add(seq)
            fut.set_result(None if ok else "the audit witness did not confirm the intent")


class GatewayMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.now = 1000.0
        self.vault = FakeVault()
        self.policy = FakePolicy(POLICIES[0])
        self.journal = FakeJournal()
        self.tree = FakeProcessTree()
        self.agents: list[Agent] = []
        self.conns: list[tuple[FakeGateway, AgentConn]] = []
        self.tasks: list[asyncio.Task[Any]] = []
        self.asked_locked: set[str] = set()
        self.spent: set[str] = set()
        self.violations: list[str] = []
        self.ended: set[str] = set()
        self.checked = 0
        self.witness: FakeWitness | None = None
        self.log_level = LOG.level
        LOG.setLevel(logging.CRITICAL)  # restarts and broken policies are loud by design
        self.life = self.new_lifetime()

    # -- the world ---------------------------------------------------------------------------

    def clock(self) -> float:
        return self.now

    def new_lifetime(self) -> FakeGateway:
        outbound = FakeOutbound()
        life = FakeGateway(self.vault, self.policy, self.journal, self.tree, outbound, self.clock)
        outbound.on_send = lambda call: self.check_send(life, call)
        if self.witness is not None:
            self.witness = life.service.witnessed = FakeWitness()  # a new process's waits
        return life

    def settle(self) -> None:
        settle(self.loop)

    def run(self, coro: Any) -> Any:
        result = self.loop.run_until_complete(coro)
        self.settle()
        return result

    def violated(self, why: str) -> None:
        self.violations.append(why)

    def check_send(self, life: FakeGateway, call: Call) -> None:
        """The exec request is leaving: was it decided in this world?"""
        rid, conn = call.streams
        subject = conn.peer.subject
        if life is not self.life:
            self.violated(f"{rid}: sent by a killed lifetime")
        if self.vault.locked:
            self.violated(f"{rid}: sent while the vault is locked")
        if rid in self.asked_locked:
            self.violated(f"{rid}: asked while locked, sent later")
        if not self.tree.alive(subject.pid, subject.start_time):
            self.violated(f"{rid}: sent for a process that exited")
        if self.witness is not None:
            intents = [r.seq for r in self.journal.for_kind(E.DISPATCH_STARTED, rid)]
            if len(intents) != 1 or intents[0] not in self.witness.confirmed:
                self.violated(f"{rid}: sent before the witness confirmed its intent")
            event("sent after the witness confirmed its intent")
        current = self.policy.value
        if isinstance(current, PolicyError):
            return self.violated(f"{rid}: sent with no valid policy")
        host = current.host(conn.host)
        account = host.account(conn.user) if host else None
        if host is None or account is None:
            return self.violated(f"{rid}: sent outside the policy")
        grants = [
            g
            for g, s in life.book.sessions()
            if g.subject_key == subject.key and (g.host, g.user) == (host.alias, account.user)
        ]
        if not any(
            g.boot_id == life.boot_id
            and g.vault_epoch == self.vault.epoch
            and g.entry_digest == entry_digest(host, account)
            for g in grants
        ):
            self.violated(f"{rid}: sent without a live session grant for this world")
        command = call.command.decode()
        event(f"sent as {account.user}")
        if account.approval is ApprovalMode.PER_COMMAND and not is_preapproved(account, command):
            digest = hashlib.sha256(call.command).hexdigest()
            spent_now = [
                g
                for g in life.book._command_grants.values()
                if g.used and g.binding.what == digest and g.id not in self.spent
            ]
            if len(spent_now) != 1:
                self.violated(f"{rid}: sent without exactly one command grant spent for it")
            self.spent.update(g.id for g in spent_now)

    # -- agents ------------------------------------------------------------------------------

    @initialize(witnessed=st.booleans())
    def a_working_gateway(self, witnessed: bool) -> None:
        """Start where work happens: unlocked, two agents, each connected as both accounts
        (and, half the time, a witness that must confirm every intent)."""
        if witnessed:
            self.witness = self.life.service.witnessed = FakeWitness()
        self.run(self.life.authority.unlock(PASSPHRASE))
        for _ in range(2):
            agent = self.tree.spawn()
            self.agents.append(agent)
            for user in ("deploy", "ops"):
                self.conns.append((self.life, self.life.connect(agent, user=user)))

    @rule()
    def start_agent(self) -> None:
        if len(self.agents) < 4:
            self.agents.append(self.tree.spawn())

    def live_agents(self) -> list[Agent]:
        return [a for a in self.agents if self.tree.alive(a.pid, a.start_time)]

    @rule(i=st.integers(0, 7), user=st.sampled_from(["deploy", "ops"]))
    def connect(self, i: int, user: str) -> None:
        live = self.live_agents()
        if live and len(self.conns) < 8:
            agent = live[i % len(live)]
            self.conns.append((self.life, self.life.connect(agent, user=user)))

    @rule(
        i=st.integers(0, 7),
        command=st.sampled_from(COMMANDS),
        action=st.sampled_from([None, None, "act-1"]),
        ack=st.booleans(),
    )
    def send(self, i: int, command: bytes, action: str | None, ack: bool) -> None:
        conns = [c for life, c in self.conns if life is self.life]
        if not conns:
            return
        conn = conns[i % len(conns)]
        rid = new_request_id()
        if self.vault.locked:
            self.asked_locked.add(rid)
        req = Request(rid, conn.host, conn.user, command, conn.peer.subject.key, action)
        coro = self.life.service.handle(Case(conn, req, None, (rid, conn), ack_unknown=ack))
        self.tasks.append(self.loop.create_task(coro))
        self.settle()

    @rule(
        i=st.integers(0, 7),
        command=st.sampled_from(COMMANDS),
        stages=st.integers(1, 3),
    )
    def a_command_goes_through(self, i: int, command: bytes, stages: int) -> None:
        """The happy path as one step (so sequences reach sends often), stopping after
        the operator's answers (1), the target's answer (2) or the command's end (3)."""
        self.send(i, command, None, False)
        self.operator_approves_everything()
        if stages >= 2:
            self.every_target_answers()
        if stages >= 3:
            while self.witness is not None and any(not f.done() for _, f in self.witness.waiting):
                self.witness_answers(0, True)
            for call in self.life.outbound.running():
                call.finish(Result(Outcome.COMPLETED, exit_status=0))
            self.settle()

    def disconnect(self, i: int) -> None:
        conns = [c for life, c in self.conns if life is self.life]
        if conns:
            self.life.service.connection_closed(conns[i % len(conns)])
            self.settle()

    def process_exits(self, i: int) -> None:
        live = self.live_agents()
        if live:
            agent = live[i % len(live)]
            self.tree.alive_keys.discard((agent.pid, agent.start_time))
            subject = agent.subject()
            if subject.process_key in self.tree.watched:  # the pidfd fires
                self.life.authority.subject_exited(subject)
            self.settle()

    def process_execs(self, i: int, exe: str = EXES[1]) -> None:
        live = self.live_agents()
        if live:
            live[i % len(live)].exe = exe

    # -- the operator ------------------------------------------------------------------------

    @rule(i=st.integers(0, 7), approve=st.booleans())
    def answer(self, i: int, approve: bool) -> None:
        pending = self.life.book.pending()
        if pending:
            with contextlib.suppress(CardError):
                self.life.authority.answer(pending[i % len(pending)].id, approve)
            self.settle()

    @rule()
    def operator_approves_everything(self) -> None:
        for _ in range(3):  # a session card, then the command card it leads to
            for card in self.life.book.pending():
                with contextlib.suppress(CardError):
                    self.life.authority.answer(card.id, True)
            self.settle()

    @rule(i=st.integers(0, 7), watched=st.booleans())
    def card_times_out(self, i: int, watched: bool) -> None:
        armed = self.life.timers.armed()
        if armed:
            if watched:
                self.life.book.note_operator()
            armed[i % len(armed)].fire()
            self.settle()

    def lock(self, terminate: bool) -> None:
        self.run(self.life.authority.lock(terminate))

    @rule()
    def unlock(self) -> None:
        self.run(self.life.authority.unlock(PASSPHRASE))

    def revoke(self, i: int) -> None:
        live = self.life.book.sessions()
        if live:
            self.life.authority.revoke(live[i % len(live)][0].id)
            self.settle()

    def edit_policy(self, choice: int) -> None:
        self.policy.value = POLICIES[choice]

    def time_passes(self, seconds: float) -> None:
        self.now += seconds

    def restart(self) -> None:
        """kill -9 and start again: the new lifetime starts locked and closes
        what the old one left open."""
        self.life.kill()
        for task in self.tasks:
            task.cancel()
        self.settle()
        self.tasks = [t for t in self.tasks if not t.done()]
        self.vault.locked = True  # a new process holds no key
        self.life = self.new_lifetime()
        self.life.service.recover(recover(self.journal.records))
        event("restarted")

    # -- targets -----------------------------------------------------------------------------

    @rule(i=st.integers(0, 7), ok=st.booleans())
    def target_answers(self, i: int, ok: bool) -> None:
        waiting = self.life.outbound.waiting()
        if waiting:
            waiting[i % len(waiting)].connect(ok)
            self.settle()

    @rule(i=st.integers(0, 7), ok=st.booleans())
    def witness_answers(self, i: int, ok: bool) -> None:
        if self.witness is not None and self.witness.waiting:
            event(f"witness {'confirms' if ok else 'cannot confirm'} an intent")
            self.witness.answer(i, ok)
            self.settle()

    @rule()
    def every_target_answers(self) -> None:
        for call in self.life.outbound.waiting():
            call.connect()
        self.settle()

    @rule(
        i=st.integers(0, 7),
        outcome=st.sampled_from([Outcome.COMPLETED, Outcome.UNKNOWN, Outcome.SIGNALLED]),
    )
    def command_ends(self, i: int, outcome: Outcome) -> None:
        running = self.life.outbound.running()
        if running:
            result = {
                Outcome.COMPLETED: Result(Outcome.COMPLETED, exit_status=0),
                Outcome.UNKNOWN: Result(Outcome.UNKNOWN, cause="connection_lost"),
                Outcome.SIGNALLED: Result(Outcome.SIGNALLED, signal=("KILL", False, "", "")),
            }[outcome]
            running[i % len(running)].finish(result)
            self.settle()

    # -- what disturbs the work --------------------------------------------------------------
    # One rule for all of them, so that work (send, answer, connect, finish) is drawn
    # far more often than disruption and sequences get far enough to send things.

    @rule(kind=st.sampled_from(DISRUPTIONS), i=st.integers(0, 7), flag=st.booleans())
    def the_world_changes(self, kind: str, i: int, flag: bool) -> None:
        event(f"disruption: {kind}")
        if kind == "lock":
            self.lock(terminate=flag)
        elif kind == "restart":
            self.restart()
        elif kind == "revoke":
            self.revoke(i)
        elif kind == "disconnect":
            self.disconnect(i)
        elif kind == "process exits":
            self.process_exits(i)
        elif kind == "process execs":
            self.process_execs(i, EXES[flag])
        elif kind == "policy edit":
            self.edit_policy(i % len(POLICIES))
        elif kind == "time passes":
            self.time_passes(61.0 if flag else 1.0)

    # -- invariants --------------------------------------------------------------------------

    @invariant()
    def nothing_was_sent_that_was_not_decided(self) -> None:
        assert self.violations == []

    @invariant()
    def no_request_ends_twice(self) -> None:
        new = self.journal.records[self.checked :]
        self.checked = len(self.journal.records)
        for rec in new:
            if rec.type in TERMINAL_TYPES:
                rid = rec.meta["request_id"]
                assert rid not in self.ended, f"{rid} ended twice"
                self.ended.add(rid)

    @invariant()
    def no_task_died_of_a_bug(self) -> None:
        for task in self.tasks:
            if task.done() and not task.cancelled():
                assert task.exception() is None, repr(task.exception())

    def teardown(self) -> None:
        try:
            self.restart()  # close whatever is open, as the next start would
            for rec in self.journal.records:
                if rec.type in TERMINAL_TYPES:
                    event(f"{rec.type} {rec.meta.get('code') or rec.meta.get('cause') or ''}")
            received = {r.meta["request_id"] for r in self.journal.of(E.REQUEST_RECEIVED)}
            terminal = [
                r.meta["request_id"] for r in self.journal.records if r.type in TERMINAL_TYPES
            ]
            assert sorted(terminal) == sorted(received)
            dispatched = {r.meta["request_id"] for r in self.journal.of(E.DISPATCH_STARTED)}
            endings = [  # an outcome; with a witness, a denial (it could not confirm)
                r.meta["request_id"]
                for r in self.journal.records
                if r.meta.get("request_id") in dispatched
                and (
                    EventType(r.type).outcome is not None
                    or (self.witness is not None and r.type == E.DENIED.value)
                )
            ]
            assert sorted(endings) == sorted(dispatched)
        finally:
            for task in self.tasks:
                task.cancel()
            self.loop.run_until_complete(asyncio.sleep(0))
            self.loop.run_until_complete(self.loop.shutdown_default_executor())
            self.loop.close()
            LOG.setLevel(self.log_level)


GatewayMachine.TestCase.settings = settings(
    max_examples=10_000 if THOROUGH else 300,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=not THOROUGH,
)
test_gateway_service = GatewayMachine.TestCase
