"""Fakes for the gateway service: every part it is built from, in memory.

`FakeGateway` below builds a `Service` and an `Authority` with the function the
gateway uses (`gateway/assembly.build_service`), but over a vault, a policy, a
journal, an outbound dispatcher, a clock and timers that the test controls.
Nothing here sleeps or touches the network: a test moves time and answers
connections itself, and `settle` runs the event loop until every task waits
again.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bastion.core.contract import Code, Refusal
from bastion.core.events import EventType, Outcome, Result
from bastion.core.policy import Account, Host, Policy, PolicyError, build_policy
from bastion.core.stdin import Stdin, StdinEnd
from bastion.core.subject import Peer, ProcessInfo, Subject
from bastion.gateway.approvals import ApprovalBook
from bastion.gateway.assembly import build_service
from bastion.gateway.outbound import Job
from bastion.gateway.recorder import Recorder
from bastion.gateway.service import AgentConn, Edges, PolicyWatch
from bastion.gateway.stdin import Taken
from bastion.journal import JournalError
from bastion.vault import VaultLocked, WrongPassphrase

KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKwqVd3vMikqXGyJKL6mRiDHH8Ym3yLu2zkTPeUe2xx0"
PASSPHRASE = b"pw"


def policy_text(port: int = 22, allow: str = '"echo *", "uptime", "rm *"') -> str:
    return f"""
[hosts.web1]
address = "10.0.0.5"
port = {port}
host_key = "{KEY}"

[[hosts.web1.accounts]]
user = "deploy"
credential = "deploy-key"
approval = "session"
deny = ["rm -rf*"]
allow = [{allow}]

[[hosts.web1.accounts]]
user = "ops"
credential = "ops-key"
approval = "per-command"
preapproved = ["uptime"]
"""


def policy(**kw: Any) -> Policy:
    return build_policy([("p.toml", "p.toml", policy_text(**kw))])


# -- the parts -------------------------------------------------------------------------------


@dataclass
class FakeVault:
    """The vault's state as the gateway sees it; `epoch` persists across lifetimes."""

    epoch: int = 1
    locked: bool = True

    def unlock(self, passphrase: bytes) -> int:
        if passphrase != PASSPHRASE:
            raise WrongPassphrase("wrong passphrase")
        self.epoch += 1
        self.locked = False
        return self.epoch

    def lock(self) -> int:
        if not self.locked:
            self.locked = True
            self.epoch += 1
        return self.epoch

    def private_key(self, label: str) -> Any:
        if self.locked:
            raise VaultLocked("locked")
        return label


@dataclass
class FakePolicy:
    value: Policy | PolicyError

    def current(self) -> Policy | PolicyError:
        return self.value


@dataclass(frozen=True)
class Rec:
    """One journal record, as the folds read it."""

    seq: int
    boot: str
    type: str
    meta: dict[str, Any]
    event: dict[str, Any]


@dataclass
class FakeJournal:
    """The journal's records, shared by every lifetime; a dead lifetime writes nothing."""

    records: list[Rec] = field(default_factory=list)
    fail_intents: bool = False
    fail: set[EventType] = field(default_factory=set)  # kinds the disk refuses (disk full)

    def writer(self, boot: str) -> JournalHandle:
        return JournalHandle(self, boot)

    def of(self, kind: EventType) -> list[Rec]:
        return [r for r in self.records if r.type == kind.value]

    def for_kind(self, kind: EventType, rid: str) -> list[Rec]:
        return [r for r in self.of(kind) if r.meta.get("request_id") == rid]

    def for_request(self, rid: str) -> list[str]:
        return [r.type for r in self.records if r.meta.get("request_id") == rid]


@dataclass
class JournalHandle:
    journal: FakeJournal
    boot: str
    alive: bool = True

    def sync(self) -> int:
        return len(self.journal.records)

    def append(
        self, kind: EventType, meta: dict[str, Any], event: dict[str, Any], sync: bool = True
    ) -> Rec | None:
        if not self.alive:  # this lifetime was killed: nothing it does reaches the disk
            return None
        if kind is EventType.DISPATCH_STARTED and self.journal.fail_intents:
            raise JournalError("disk full")
        if kind in self.journal.fail:
            raise JournalError("could not write to the journal: No space left on device")
        rec = Rec(len(self.journal.records) + 1, self.boot, kind.value, dict(meta), dict(event))
        self.journal.records.append(rec)
        return rec


@dataclass
class FakeProcess:
    """The remote command, once the exec request has left."""

    call: Call

    def send_signal(self, name: str) -> None:
        self.call.finish(Result(Outcome.SIGNALLED, signal=(name, False, "", "")))

    async def wait_closed(self) -> None:
        await asyncio.shield(self.call.done)


@dataclass(eq=False)
class Call:
    """One `Outbound.run`: connecting, then (if the intent allows) running."""

    host: Host
    account: Account
    command: bytes
    streams: Any
    intent: Callable[[], None]
    connected: asyncio.Future[None]
    done: asyncio.Future[Result]
    sent: bool = False

    def connect(self, ok: bool = True) -> None:
        if not self.connected.done():
            if ok:
                self.connected.set_result(None)
            else:
                self.connected.set_exception(ConnectionRefusedError("refused"))

    def finish(self, result: Result) -> None:
        if not self.done.done():
            self.done.set_result(result)


class FakeOutbound:
    """Records every exec that leaves; the test decides when connections
    open and how commands end. `auto` runs every call to completion at once."""

    def __init__(self, auto: bool = False) -> None:
        self.auto = auto
        self.calls: list[Call] = []
        self.sent: list[Call] = []
        self.on_send: Callable[[Call], None] = lambda call: None
        self.retired = 0

    async def run(self, job: Job) -> Result:
        loop = asyncio.get_running_loop()
        call = Call(
            job.host,
            job.account,
            job.command,
            job.streams,
            job.intent,
            loop.create_future(),
            loop.create_future(),
        )
        self.calls.append(call)
        if self.auto:
            call.connect()
        try:
            await call.connected
        except OSError:  # as `outbound.Dispatcher`: nothing left, so a Refusal
            raise Refusal(Code.UNREACHABLE, "unreachable", cause=Code.UNREACHABLE.value) from None
        if job.prepare is not None:
            await job.prepare()  # a witness holds the intent, or it raises a Refusal
        job.intent()  # raises the intent's Refusal: nothing leaves
        call.sent = True
        self.sent.append(call)
        self.on_send(call)
        job.on_exec(FakeProcess(call))  # type: ignore[arg-type]
        if self.auto:
            call.finish(Result(Outcome.COMPLETED, exit_status=0))
        return await asyncio.shield(call.done)

    def retire_all(self) -> None:
        self.retired += 1

    def waiting(self) -> list[Call]:
        return [c for c in self.calls if not c.connected.done()]

    def running(self) -> list[Call]:
        return [c for c in self.sent if not c.done.done()]


@dataclass
class FakeTimer:
    delay: float
    callback: Callable[[], object]
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True

    def fire(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            self.callback()


class FakeTimers:
    def __init__(self) -> None:
        self.timers: list[FakeTimer] = []

    def __call__(self, delay: float, callback: Callable[[], object]) -> FakeTimer:
        timer = FakeTimer(delay, callback)
        self.timers.append(timer)
        return timer

    def armed(self) -> list[FakeTimer]:
        return [t for t in self.timers if not t.cancelled]


# -- processes ---------------------------------------------------------------------------------


_pids = itertools.count(1000)


@dataclass
class FakeProcessTree:
    """Agent processes: alive or not, running one executable or another."""

    alive_keys: set[tuple[int, float]] = field(default_factory=set)
    watched: set[tuple[int, float, str]] = field(default_factory=set)

    def spawn(self, exe: str = "/usr/bin/agent") -> Agent:
        pid = next(_pids)
        agent = Agent(pid, float(pid), exe, "n" + str(pid))
        self.alive_keys.add((pid, agent.start_time))
        return agent

    def alive(self, pid: int, start_time: float) -> bool:
        return (pid, start_time) in self.alive_keys

    def watch(self, subject: Subject) -> None:
        self.watched.add(subject.process_key)


@dataclass
class Agent:
    pid: int
    start_time: float
    exe: str
    nonce: str

    def subject(self) -> Subject:
        digest = hashlib.sha256(self.exe.encode()).hexdigest()
        return Subject(self.pid, self.start_time, self.exe, digest, 1000, self.nonce)

    def peer(self) -> Peer:
        subject = self.subject()
        info = ProcessInfo(
            self.pid, 1, self.start_time, 1000, self.exe, subject.exe_sha256, "agent", ()
        )
        return Peer(self.pid + 1, 1000, 1000, (info,), subject)


# -- one gateway lifetime over the fakes ---------------------------------------------------------

_boots = itertools.count(1)


async def no_stdin(streams: Any) -> Taken:
    """A fake agent sends no stdin before its command card (EOF at once)."""
    return Taken(Stdin.of(b"", StdinEnd.CLOSED), streams)


class FakeGateway:
    """What `gateway/lifetime.py` wires, with fakes for what touches the system."""

    def __init__(
        self,
        vault: FakeVault,
        policy_source: FakePolicy,
        journal: FakeJournal,
        tree: FakeProcessTree,
        outbound: FakeOutbound | None = None,
        clock: Callable[[], float] = lambda: 1000.0,
        command_ttl: float = 60.0,
        take_stdin: Callable[[Any], Any] | None = None,
    ) -> None:
        self.boot_id = f"boot_{next(_boots)}"
        self.journal = journal.writer(self.boot_id)
        self.recorder = Recorder(self.journal)
        self.book = ApprovalBook(self.boot_id, command_ttl=command_ttl, clock=clock)
        self.outbound = outbound or FakeOutbound()
        self.timers = FakeTimers()
        assembly = build_service(
            boot_id=self.boot_id,
            vault=vault,
            policy=PolicyWatch(policy_source, self.recorder),
            book=self.book,
            outbound=self.outbound,
            recorder=self.recorder,
            edges=Edges(
                alive=tree.alive, watch=tree.watch, take_stdin=take_stdin or no_stdin, clock=clock
            ),
            schedule=self.timers,
            approval_timeout=120.0,
        )
        self.service = assembly.service
        self.authority = assembly.authority

    def connect(self, agent: Agent, host: str = "web1", user: str = "deploy") -> AgentConn:
        conn = AgentConn(agent.peer(), host, user)
        self.service.connection_opened(conn)
        return conn

    def kill(self) -> None:
        """kill -9: this lifetime writes nothing more."""
        self.journal.alive = False


def settle(loop: asyncio.AbstractEventLoop, rounds: int = 200) -> None:
    """Run the loop until every task waits on something only the test can give."""
    for _ in range(rounds):
        loop.run_until_complete(asyncio.sleep(0))
        if not loop._ready:  # type: ignore[attr-defined]
            return
    raise AssertionError("the event loop did not settle")


async def idle() -> None:
    """From inside a test coroutine: let every other task run until it waits."""
    loop = asyncio.get_running_loop()
    for _ in range(200):
        await asyncio.sleep(0)
        if not loop._ready:  # type: ignore[attr-defined]
            return
