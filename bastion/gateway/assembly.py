"""How the request path and the operator's authority are put together, once.

The daemon (`lifetime.Gateway`) and the unit tests (`tests/unit/fakes.py`) both
build the pair here, from real parts or fakes, so the tests run the wiring the
daemon runs. `Service` (the request path) and `Authority` (what the operator
decides) are two clients of the same approval book, recorder and vault: this
is the one place that hands both the same objects, and the only place that
knows both -- `Authority` sees of the requests in flight only their ids and
the way to end one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bastion.gateway.approvals import ApprovalBook
from bastion.gateway.authority import Authority
from bastion.gateway.recorder import PolicyWatch, Recorder
from bastion.gateway.service import Edges, Outbound, Service, VaultState
from bastion.gateway.signers import Signers


@dataclass(frozen=True)
class Assembly:
    """One lifetime's request path and the operator's authority over it."""

    service: Service
    authority: Authority


def build_service(
    boot_id: str,
    vault: VaultState,
    policy: PolicyWatch,
    book: ApprovalBook,
    outbound: Outbound,
    recorder: Recorder,
    edges: Edges,
    *,
    vouch: Callable[[], None] = lambda: None,
    unlocked: Callable[[], None] = lambda: None,
    signers: Signers | None = None,
    **options: Any,
) -> Assembly:
    """The service over these parts, and the authority over the same book.

    `options` are `Service`'s own keyword parts (its signature says what each is:
    admission, certifier, witnessed, schedule, approval_timeout,
    on_sessions_changed); `vouch`, `unlocked` and `signers` are the authority's:
    have the journal vouch for what was written (at unlock and before a lock), what
    the lifetime does once the vault is unlocked, and who can sign presence cards.
    Both read liveness from `edges`."""
    service = Service(boot_id, vault, policy, book, outbound, recorder, edges, **options)
    authority = Authority(
        vault=vault,
        book=book,
        recorder=recorder,
        retire_connections=outbound.retire_all,
        alive=edges.alive,
        in_flight=lambda: list(service.inflight),
        kill=service.kill,
        vouch=vouch,
        unlocked=unlocked,
        signers=signers,
    )
    return Assembly(service, authority)
