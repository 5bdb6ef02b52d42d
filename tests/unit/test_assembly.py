"""One assembly (`gateway/assembly.build_service`) for the daemon and the tests.

The unit tests run the service and the authority that `fakes.FakeGateway` builds;
they show what the daemon does only if the daemon builds them the same way.
These tests hold that: only the assembly constructs either, and what it hands
the authority is the service's own book, recorder, vault, connections and
requests in flight.
"""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import pytest

from bastion.core.events import Outcome, Result
from bastion.core.gate import Request
from bastion.gateway.service import Case, new_request_id
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

ROOT = Path(__file__).resolve().parents[2]
ASSEMBLY = "bastion/gateway/assembly.py"


def constructed(path: Path) -> set[str]:
    """The names of the classes `path` calls by name (`Service(...)`, `x.Authority(...)`)."""
    calls = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            fn = node.func
            name = fn.id if isinstance(fn, ast.Name) else getattr(fn, "attr", None)
            if name is not None:
                calls.add(name)
    return calls


def test_only_the_assembly_constructs_the_service_and_the_authority() -> None:
    """The daemon (`lifetime.py`) and the fakes both call `build_service`."""
    sources = [*sorted((ROOT / "bastion").rglob("*.py")), ROOT / "tests/unit/fakes.py"]
    builders = {
        str(p.relative_to(ROOT)) for p in sources if constructed(p) & {"Service", "Authority"}
    }
    assert builders == {ASSEMBLY}
    for caller in ("bastion/gateway/lifetime.py", "tests/unit/fakes.py"):
        assert "build_service" in constructed(ROOT / caller), caller


def test_the_authority_does_not_reach_into_the_service() -> None:
    """Two clients of one book: authority.py names no `Service` and no `service.` part."""
    tree = ast.parse((ROOT / "bastion/gateway/authority.py").read_text())
    imported = {
        alias.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for alias in n.names
    }
    assert "Service" not in imported
    reads = {
        n.value.id
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
    }
    assert "service" not in reads


TREE = FakeProcessTree()


@pytest.fixture
def life() -> FakeGateway:
    return FakeGateway(FakeVault(), FakePolicy(policy()), FakeJournal(), TREE, FakeOutbound())


def test_the_service_and_the_authority_share_their_parts(life: FakeGateway) -> None:
    service, authority = life.service, life.authority
    assert authority.book is service.book is life.book
    assert authority.recorder is service.recorder is life.recorder
    assert authority.vault is service.vault
    assert authority.alive is service.edges.alive


async def test_a_vault_change_retires_the_services_connections(life: FakeGateway) -> None:
    """Unlock and lock each retire the outbound connections the service dispatches on."""
    outbound = life.outbound
    assert life.service.outbound is outbound and outbound.retired == 0
    await life.authority.unlock(PASSPHRASE)
    assert outbound.retired == 1
    await life.authority.lock(terminate=False)
    assert outbound.retired == 2


async def test_lock_with_terminate_ends_what_the_service_has_in_flight(life: FakeGateway) -> None:
    """The authority's view of the requests in flight is the service's own."""
    await life.authority.unlock(PASSPHRASE)
    conn = life.connect(TREE.spawn(), user="ops")
    req = Request(new_request_id(), "web1", "ops", b"uptime", conn.peer.subject.key)  # preapproved
    task = asyncio.ensure_future(life.service.handle(Case(conn, req, None, req.request_id)))
    await idle()
    (card,) = life.book.pending()  # the session card: only the command card is skipped
    life.authority.answer(card.id, True)
    await idle()
    life.outbound.calls[0].connect()
    await idle()
    assert life.authority.in_flight() == list(life.service.inflight) == [req.request_id]
    assert await life.authority.lock(terminate=True) == [req.request_id]
    result = await task
    assert isinstance(result, Result) and result.outcome is Outcome.SIGNALLED
