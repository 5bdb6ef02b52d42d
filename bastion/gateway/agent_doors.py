"""The agent socket's doors besides SSH: who is connecting, registrations
(`bastion run`, `bastion mcp`), and the two questions `bastion mcp` asks.

None of them decides anything: a registration only says how the identity walk
reads a process that registered *itself*, and the answers carry nothing an
agent could not learn by trying -- the hosts the policy names with their rules
(never an address, a port, a host key or a credential), the state of a
request whose unguessable id it holds, and the latest request of an action
key it sent itself (action keys are bound to their subject).

What each costs is bounded. Identity walks read /proc (about a millisecond),
so they run in worker threads of their own -- never the default pool the
journal's fsync and `status` use -- behind fair slots per tenant
(`tenants.py`): a flood from one run waits behind its own walks. A `run`
registration costs one journal record and one pidfd watch, once per process
(registering again is the run it is), at most `MAX_RUNS_PER_UID` live per uid,
none inside a run. A `request` answer is a lookup in `requests.RequestIndex`,
never a journal read.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from bastion.core.events import EventType, bound_action
from bastion.core.policy import Policy, PolicyError
from bastion.core.refusals import Fact, answer
from bastion.core.subject import Peer, ProcessInfo, Run, Subject, SubjectKind
from bastion.gateway.admission import Admission, NoSlot
from bastion.gateway.agent_ssh import Doors
from bastion.gateway.recorder import Recorder
from bastion.gateway.requests import RequestIndex
from bastion.gateway.tenants import Tenant, Tenants
from bastion.identity import IdentityError, Resolver, peer_credentials, procs

log = logging.getLogger(__name__)

WALKERS = 2  # worker threads for identity walks: /proc reads, mostly under the GIL
WALK_WAIT = 20.0  # seconds a walk may wait for its turn (the proxy waits 30 s for OK)

T = TypeVar("T")


class GatewayView(Protocol):
    """The part of the one `lifetime.Gateway` the doors read: the Gateway that
    owns them, seen through what they use of it (control has its own view)."""

    boot_id: str
    resolver: Resolver
    recorder: Recorder
    same_uid_agent_seen: bool

    def watch(self, subject: Subject) -> None: ...

    def save_runs(self) -> None: ...


class AgentDoors:
    def __init__(
        self,
        gw: GatewayView,
        policy: Callable[[], Policy | PolicyError],
        requests: RequestIndex,
        tenants: Tenants,
    ) -> None:
        self.gw = gw
        self._policy = policy
        self.requests = requests
        self.tenants = tenants
        self._pool = concurrent.futures.ThreadPoolExecutor(WALKERS, "bastion-walk")
        self._turns = Admission(WALKERS, WALK_WAIT, what="identity walks")

    def doors(self) -> Doors:
        return Doors(self.identify, self.register, self.query)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _walk(self, tenant: Tenant, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in a walker thread once `tenant`'s turn comes. A connection
        that goes meanwhile keeps its slot until the thread is done with it, so no
        more than WALKERS walks ever run or wait in the pool itself."""
        loop = asyncio.get_running_loop()
        try:
            async with self._turns.slot(tenant):
                done = loop.run_in_executor(self._pool, fn, *args)
                try:
                    return await asyncio.shield(done)
                except asyncio.CancelledError:
                    await asyncio.wait({done})
                    raise
        except NoSlot as busy:
            raise NoSlot(
                f"the gateway is busy identifying connections ({busy}); retry in a few seconds"
            ) from None

    async def identify(self, sock: socket.socket, tenant: Tenant) -> Peer:
        peer = await self._walk(tenant, self.gw.resolver.identify, sock)
        if peer.uid == os.getuid():
            self.gw.same_uid_agent_seen = True
        return peer

    async def register(self, sock: socket.socket, header: dict[str, Any], tenant: Tenant) -> str:
        """`bastion run`: the connecting process becomes one subject for its whole
        tree, for as long as it lives (and past a gateway restart: `runs.json`);
        registering again is the run it already is (the same id, its first label,
        nothing written). `bastion mcp`: the connecting process acts for its
        parent, as a shell would."""
        resolver = self.gw.resolver
        if header["register"] == "front":
            info = await self._walk(tenant, resolver.register_front, sock)
            log.info("front registered: pid %d (%s)", info.pid, info.exe)
            return f"front_{resolver.nonce_for(info.pid, info.start_time)}"
        pid, uid, _ = peer_credentials(sock)
        run = self.tenants.run_of(pid)
        if run is not None:  # the run it already is: no new record, no new watch
            return f"run_{resolver.nonce_for(run.pid, run.start_time)}"
        key = self.tenants.reserve(pid, uid)

        def record(info: ProcessInfo) -> Run:
            lasting = procs.Lasting(procs.kernel_boot(), info.pid, key[1])
            label, given = header.get("label", ""), header.get("sandbox")
            return Run(label, given, lasting.text(), time.time(), info.uid)

        try:
            info = await self._walk(tenant, resolver.register_run, sock, record)
            now = procs.stat(pid)
            if info.pid != pid or now is None or now.start_ticks != key[1]:
                resolver.forget(info.pid, info.start_time)
                raise IdentityError("the registering process changed while being identified")
        except BaseException:
            self.tenants.cancel(key)
            raise
        subject = run_subject(info, resolver.runs[(info.pid, info.start_time)], resolver)
        self.tenants.add(key, subject)
        self.gw.watch(subject)  # its exit gives the share back (`Gateway._subject_exited`)
        self.gw.save_runs()
        self.gw.recorder.record(EventType.RUN_REGISTERED, {}, {"subject": subject.as_json()})
        log.info("run registered: pid %d %r (%s)", info.pid, header.get("label", ""), info.exe)
        return f"run_{subject.nonce}"

    async def query(
        self, sock: socket.socket, header: dict[str, Any], tenant: Tenant
    ) -> dict[str, Any]:
        """`hosts`, or `request` by id (the id is the capability: no walk) or by
        action key (only the subject that sent the key can name it: one walk)."""
        if header["query"] == "hosts":
            return hosts_view(self._policy())
        request_id = header.get("request_id")
        if not request_id:
            action_key = header.get("action_key")
            if not action_key:
                raise ValueError("a request query names a request_id or an action_key")
            peer = await self.identify(sock, tenant)
            request_id = self.requests.latest(bound_action(procs.owner(peer.subject), action_key))
            if request_id is None:
                raise ValueError("no request with that action key from this process")
        if header.get("only") == "id":
            return {"request_id": request_id}
        state = self.requests.state(request_id, self.gw.boot_id)
        if state is None:
            raise ValueError(
                f"no request {request_id} among the last {self.requests.remembered} this "
                f"gateway remembers; an operator can read older ones with `bastion request "
                f"{request_id}`"
            )
        return state


def run_subject(info: ProcessInfo, run: Run, resolver: Resolver) -> Subject:
    """The subject a run process is, as registered (by this lifetime or an earlier one)."""
    return Subject(
        info.pid,
        info.start_time,
        info.exe,
        info.exe_sha256,
        info.uid,
        resolver.nonce_for(info.pid, info.start_time),
        run,
        SubjectKind.RUN,
    )


def hosts_view(policy: Policy | PolicyError) -> dict[str, Any]:
    """What an agent may use: each host alias, its accounts, how each is approved
    and what its rules allow. No address, port, host key or credential: the agent
    names hosts, bastion alone knows where they are and how to get in."""
    if isinstance(policy, PolicyError):
        return answer(Fact.POLICY_UNREADABLE)
    return {
        "hosts": [
            {
                "host": alias,
                "accounts": [
                    {
                        "user": a.user,
                        "approval": a.approval.value,
                        "allow": None if a.allow is None else [r.text for r in a.allow],
                        "preapproved": [r.text for r in a.preapproved],
                        "shell": a.shell.value,
                        # The paths sftp may read and write (None: no file access).
                        "files": None if a.file_rules is None else a.file_rules.doc(),
                    }
                    for a in host.accounts
                ],
            }
            for alias, host in sorted(policy.hosts.items())
        ]
    }
