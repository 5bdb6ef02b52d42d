"""Who a cap counts (issue 18): a registered run's whole tree is one tenant, a
process outside every run counts as its uid; runs do not nest; a uid's live
runs are bounded; connections are capped per tenant and in all.

Real processes (a shell and its sleeping child), since a tenant is read from
/proc; nothing here needs a gateway.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import pytest

from bastion.core.subject import Subject, SubjectKind
from bastion.gateway.tenants import Caps, RunRefused, Tenant, TenantKind, Tenants
from bastion.identity import procs
from tests.harness import wait_for

UID = os.getuid()


def run_subject(pid: int) -> Subject:
    return Subject(
        pid, 1000.0 + pid, "/usr/bin/bastion", "ab" * 32, UID, "n1", "agents", SubjectKind.RUN
    )


@pytest.fixture
def tree() -> Iterator[tuple[int, int]]:
    """(a shell, the sleep it started): the shell will be the run."""
    shell = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!; wait"], stdout=subprocess.PIPE)
    assert shell.stdout is not None
    child = int(shell.stdout.readline())
    wait_for(lambda: (st := procs.stat(child)) is not None and st.ppid == shell.pid)
    try:
        yield shell.pid, child
    finally:
        shell.kill()
        shell.wait(30)
        subprocess.run(["kill", str(child)], check=False)


def register(tenants: Tenants, pid: int) -> Tenant:
    return tenants.add(tenants.reserve(pid, UID), run_subject(pid))


def test_a_run_is_the_tenant_of_its_whole_tree(tree: tuple[int, int]) -> None:
    shell, child = tree
    tenants = Tenants()
    assert tenants.of_peer(child, UID) == Tenant(TenantKind.UID, UID)  # seen, and kept
    run = register(tenants, shell)
    assert (
        run == Tenant.of_subject(run_subject(shell)) and str(run) == f"registered run pid {shell}"
    )
    assert tenants.of_peer(child, UID) == run  # what was kept of it is forgotten
    assert tenants.of_peer(shell, UID) == run and tenants.run_of(shell) == run
    assert tenants.run_of(child) is None
    assert tenants.of_peer(os.getpid(), UID) == Tenant(TenantKind.UID, UID)
    tenants.forget(shell, run.start_time)
    assert tenants.of_peer(child, UID) == Tenant(TenantKind.UID, UID) and tenants.runs() == 0


def test_runs_do_not_nest(tree: tuple[int, int]) -> None:
    shell, child = tree
    tenants = Tenants()
    register(tenants, shell)
    with pytest.raises(RunRefused, match="runs do not nest"):
        tenants.reserve(child, UID)


def test_a_uid_has_a_bounded_number_of_live_runs(tree: tuple[int, int]) -> None:
    shell, _ = tree
    other = subprocess.Popen(["sleep", "60"])
    try:
        tenants = Tenants(max_runs_per_uid=1)
        key = tenants.reserve(other.pid, UID)  # a registration under way holds its place
        with pytest.raises(RunRefused, match=f"uid {UID} has 1 live registered runs"):
            tenants.reserve(shell, UID)
        tenants.cancel(key)
        run = register(tenants, shell)
        with pytest.raises(RunRefused, match="the limit is 1"):
            tenants.reserve(other.pid, UID)
        tenants.forget(shell, run.start_time)  # its exit gives the place back
        register(tenants, other.pid)
    finally:
        other.kill()
        other.wait(30)


def test_a_subject_outside_every_run_counts_as_its_uid() -> None:
    agent = Subject(7, 7.0, "/usr/bin/node", "cd" * 32, 1001, "n7")
    assert Tenant.of_subject(agent) == Tenant(TenantKind.UID, 1001)
    assert str(Tenant.of_subject(agent)) == "uid 1001"


def test_connections_are_capped_per_tenant_and_in_all() -> None:
    caps = Caps(per_tenant=2, ceiling=3)
    a, b = Tenant(TenantKind.RUN, 0, 10, 1.0), Tenant(TenantKind.RUN, 0, 11, 2.0)
    assert caps.take(a) is None and caps.take(a) is None
    assert caps.take(a) == (
        "too many connections from registered run pid 10 (limit 2); "
        "close idle ssh connections and retry"
    )
    assert caps.take(b) is None  # another run's share is its own
    assert "its limit for all agents together" in (caps.take(b) or "")
    caps.give_back(a)
    assert caps.take(b) is None and caps.held(b) == 2 and caps.total == 3
