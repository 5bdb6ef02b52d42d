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

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from bastion.core.defaults import APPROVAL_TIMEOUT
from bastion.core.subject import Peer, Subject
from bastion.gateway.admission import Admission
from bastion.gateway.approvals import ApprovalBook
from bastion.gateway.authority import Authority
from bastion.gateway.certify import Certifier
from bastion.gateway.recorder import PolicyWatch, Recorder
from bastion.gateway.service import Outbound, Service, Timer, VaultState


@dataclass(frozen=True)
class Assembly:
    """One lifetime's request path and the operator's authority over it."""

    service: Service
    authority: Authority


def build_service(
    *,
    boot_id: str,
    vault: VaultState,
    policy: PolicyWatch,
    book: ApprovalBook,
    outbound: Outbound,
    recorder: Recorder,
    alive: Callable[[int, float], bool],
    watch: Callable[[Subject], None] = lambda s: None,
    refresh: Callable[[Subject], Subject] = lambda s: s,
    rides_a_master: Callable[[Peer], bool] = lambda p: False,
    refusing: Callable[[], str | None] = lambda: None,
    admission: Admission | None = None,
    schedule: Callable[[float, Callable[[], object]], Timer] | None = None,
    clock: Callable[[], float] = time.time,
    approval_timeout: float = APPROVAL_TIMEOUT,
    on_sessions_changed: Callable[[], None] = lambda: None,
    certifier: Certifier | None = None,
    witnessed: Callable[[int], Awaitable[str | None]] | None = None,
    vouch: Callable[[], None] = lambda: None,
    unlocked: Callable[[], None] = lambda: None,
) -> Assembly:
    """The service over these parts, and the authority over the same book.

    The service's parts are `Service`'s own (its docstring says what each is);
    `vouch` and `unlocked` are the authority's: have the journal vouch for what
    was written (at unlock and before a lock), and what the lifetime does once
    the vault is unlocked."""
    service = Service(
        boot_id,
        vault,
        policy,
        book,
        outbound,
        recorder,
        alive,
        watch=watch,
        refresh=refresh,
        rides_a_master=rides_a_master,
        refusing=refusing,
        admission=admission,
        schedule=schedule,
        clock=clock,
        approval_timeout=approval_timeout,
        on_sessions_changed=on_sessions_changed,
        certifier=certifier,
        witnessed=witnessed,
    )
    authority = Authority(
        vault=vault,
        book=book,
        recorder=recorder,
        retire_connections=outbound.retire_all,
        alive=alive,
        in_flight=lambda: list(service.inflight),
        kill=service.kill,
        vouch=vouch,
        unlocked=unlocked,
    )
    return Assembly(service, authority)
