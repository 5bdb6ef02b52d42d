"""Who a cap counts: the tenant of a connection, a card, a registration.

A **tenant** is the registered run a process is in (`bastion run`, isolated or
not: its whole tree), or, for a process outside every run, its uid. Every
share the agent socket hands out is counted per tenant -- connections open
(`Caps`), cards waiting (`Service`), identity walks queued (`agent_doors`),
live runs -- so one run cannot take another's, although every isolated run's
agent has the agent user's uid and every isolated run itself is root's.
Outside a run nothing ties a process's children together (each forked child is
a subject of its own), so the uid is the only bound there is: processes of
one uid outside runs share one share, as they share everything else
(advisory isolation).

Runs do not nest: a process inside a run that registers another is refused,
so a run cannot mint tenants (or subjects) of its own. A process that
registers again is the run it already is (no new record, no new watch). One
uid has at most `MAX_RUNS_PER_UID` live runs.

A connection's tenant is needed before its identity walk is queued (that
queue is fair per tenant), so it is read cheaply: each ancestor's parent and
start from one /proc line (`procs.stat`) up to the nearest registered run,
with the answer for processes already seen kept. Nothing here grants
anything: a wrong tenant (a pid reused within the read) costs a share, never
an approval.
"""

from __future__ import annotations

import collections
import enum
from dataclasses import dataclass

from bastion.core.defaults import (
    MAX_AGENT_CONNECTIONS,
    MAX_CONNECTIONS_PER_TENANT,
    MAX_RUNS_PER_UID,
)
from bastion.core.errors import BastionError
from bastion.core.subject import Subject, SubjectKind
from bastion.identity import procs

MAX_DEPTH = 64  # ancestors read at most (identity/resolver.py's walk stops there too)
SEEN = 4096  # processes whose tenant is kept between connections

ProcKey = tuple[int, int]  # (pid, start in clock ticks): one process in one boot


class TenantKind(enum.Enum):
    RUN = "run"
    UID = "uid"


@dataclass(frozen=True)
class Tenant:
    """A registered run (its pid and start time, as its subject has them), or a uid."""

    kind: TenantKind
    uid: int
    pid: int = 0
    start_time: float = 0.0

    @classmethod
    def of_subject(cls, subject: Subject) -> Tenant:
        """A subject's tenant: itself if it is a run (runs do not nest), else its uid."""
        if subject.kind is SubjectKind.RUN:
            return cls(TenantKind.RUN, subject.uid, subject.pid, subject.start_time)
        return cls(TenantKind.UID, subject.uid)

    def __str__(self) -> str:
        if self.kind is TenantKind.RUN:
            return f"registered run pid {self.pid}"
        return f"uid {self.uid}"


class RunRefused(BastionError, ValueError):
    """A registration that would nest a run, or pass the uid's live runs."""


class Tenants:
    """The live registered runs, and the tenant any process counts against."""

    def __init__(self, max_runs_per_uid: int = MAX_RUNS_PER_UID) -> None:
        self.max_runs_per_uid = max_runs_per_uid
        self._runs: dict[ProcKey, Tenant] = {}
        self._keys: dict[tuple[int, float], ProcKey] = {}  # a run's (pid, start time) -> key
        self._reserved: dict[ProcKey, int] = {}  # registrations under way -> uid
        self._per_uid: collections.Counter[int] = collections.Counter()  # live + reserved
        self._seen: collections.OrderedDict[ProcKey, Tenant | None] = collections.OrderedDict()

    def runs(self) -> int:
        return len(self._runs)

    def of_peer(self, pid: int, uid: int) -> Tenant:
        """The tenant of the process `pid` (a connection's peer): the nearest run at or
        above it, else its uid. O(depth) one-line reads, fewer for a process seen."""
        found: Tenant | None = None
        walked: list[ProcKey] = []
        while pid > 1 and len(walked) < MAX_DEPTH:
            st = procs.stat(pid)
            if st is None:
                break
            key = (pid, st.start_ticks)
            if key in self._runs:
                found = self._runs[key]
                break
            if key in self._seen:
                found = self._seen[key]
                self._seen.move_to_end(key)
                break
            walked.append(key)
            pid = st.ppid
        for key in walked:
            self._seen[key] = found
        while len(self._seen) > SEEN:
            self._seen.popitem(last=False)
        return found if found is not None else Tenant(TenantKind.UID, uid)

    def run_of(self, pid: int) -> Tenant | None:
        """The run this very process is, if it registered as one."""
        st = procs.stat(pid)
        return None if st is None else self._runs.get((pid, st.start_ticks))

    def reserve(self, pid: int, uid: int) -> ProcKey:
        """Make room for the process `pid` to become a run, or refuse: it is inside a
        run already, or its uid has all the live runs it may. `add` or `cancel` next."""
        st = procs.stat(pid)
        if st is None:
            raise RunRefused("the registering process exited")
        above = self.of_peer(st.ppid, uid)
        if above.kind is TenantKind.RUN:
            raise RunRefused(
                f"this process is inside {above}, whose whole process tree is one subject "
                "already; runs do not nest"
            )
        if self._per_uid[uid] >= self.max_runs_per_uid:
            raise RunRefused(
                f"uid {uid} has {self._per_uid[uid]} live registered runs (the limit is "
                f"{self.max_runs_per_uid}); end one before starting another"
            )
        key = (pid, st.start_ticks)
        self._reserved[key] = uid
        self._per_uid[uid] += 1
        return key

    def cancel(self, key: ProcKey) -> None:
        uid = self._reserved.pop(key, None)
        if uid is not None:
            self._release(uid)

    def add(self, key: ProcKey, subject: Subject) -> Tenant:
        """The reserved process is now the run `subject`."""
        if self._reserved.pop(key, None) is None:
            self._per_uid[subject.uid] += 1
        tenant = Tenant.of_subject(subject)
        self._runs[key] = tenant
        self._keys[(subject.pid, subject.start_time)] = key
        self._seen.clear()  # its descendants already seen now count against it
        return tenant

    def forget(self, pid: int, start_time: float) -> None:
        """A process exited: if it was a run, its share goes back."""
        key = self._keys.pop((pid, start_time), None)
        tenant = self._runs.pop(key, None) if key is not None else None
        if tenant is not None:
            self._release(tenant.uid)
            self._seen.clear()

    def _release(self, uid: int) -> None:
        self._per_uid[uid] -= 1
        if self._per_uid[uid] <= 0:
            del self._per_uid[uid]


class Caps:
    """Agent connections open, per tenant and in all: each holds a descriptor from its
    accept to its close, whatever it turns out to be (SSH, a registration, a query)."""

    def __init__(
        self, per_tenant: int = MAX_CONNECTIONS_PER_TENANT, ceiling: int = MAX_AGENT_CONNECTIONS
    ) -> None:
        self.per_tenant = per_tenant
        self.ceiling = ceiling
        self.total = 0
        self._held: collections.Counter[Tenant] = collections.Counter()

    def take(self, tenant: Tenant) -> str | None:
        """Count one more connection of `tenant`, or say why not (nothing is counted)."""
        if self._held[tenant] >= self.per_tenant:
            return (
                f"too many connections from {tenant} (limit {self.per_tenant}); "
                "close idle ssh connections and retry"
            )
        if self.total >= self.ceiling:
            return (
                f"the gateway holds {self.total} agent connections, its limit for all agents "
                "together; retry in a few seconds"
            )
        self._held[tenant] += 1
        self.total += 1
        return None

    def give_back(self, tenant: Tenant) -> None:
        self._held[tenant] -= 1
        self.total -= 1
        if self._held[tenant] <= 0:
            del self._held[tenant]

    def held(self, tenant: Tenant) -> int:
        return self._held[tenant]
