"""Who may speak for the operator (`core/opguard.admit`), over every combination
of what the operator socket observes: the peer's uid (the daemon's, root's, or
another), whether it is inside an agent's process tree, and whether the
gateway itself runs as root; and what the socket observes for it."""

from __future__ import annotations

import itertools
import os
import socket

import pytest

from bastion.core.opguard import INSIDE_AN_AGENT, ROOT_UID, Caller, admit
from bastion.gateway.opserver import observe
from bastion.identity import resolver as identity

DAEMON = 1000
OTHER = 1001


def expected(uid: int, below_agent: bool, daemon_uid: int) -> str | None:
    """The rule stated once more, plainly: uid first, then the process tree."""
    if uid != daemon_uid and uid != ROOT_UID:
        return f"uid {uid} is not the gateway's operator"
    return INSIDE_AN_AGENT if below_agent else None


@pytest.mark.parametrize(
    ("daemon_uid", "uid", "below_agent"),
    list(itertools.product((DAEMON, ROOT_UID), (DAEMON, ROOT_UID, OTHER), (False, True))),
)
def test_admit_over_every_combination(daemon_uid: int, uid: int, below_agent: bool) -> None:
    assert admit(Caller(uid, False, below_agent), daemon_uid) == expected(
        uid, below_agent, daemon_uid
    )


def test_only_the_daemons_uid_or_root_outside_every_agent_is_admitted() -> None:
    admitted = [
        (daemon_uid, uid)
        for daemon_uid, uid, below in itertools.product(
            (DAEMON, ROOT_UID), (DAEMON, ROOT_UID, OTHER), (False, True)
        )
        if admit(Caller(uid, False, below), daemon_uid) is None
    ]
    assert admitted == [(DAEMON, DAEMON), (DAEMON, ROOT_UID), (ROOT_UID, ROOT_UID)]


def test_a_foreign_uid_is_refused_for_its_uid_even_inside_an_agent() -> None:
    """The uid is checked first: its refusal names the uid, whatever the tree says."""
    assert admit(Caller(OTHER, True, True), DAEMON) == f"uid {OTHER} is not the gateway's operator"


def test_root_inside_an_agent_is_refused() -> None:
    """Root may speak for the operator, but not from below an agent (a sudo in its tree)."""
    assert admit(Caller(ROOT_UID, False, True), DAEMON) == INSIDE_AN_AGENT
    assert "agent's process tree" in INSIDE_AN_AGENT  # what the CLI prints after "refused: "


def test_the_operator_socket_observes_the_uid_and_the_process_tree() -> None:
    """The edge's half (`opserver.observe`): the kernel's uid for the peer, and
    whether it or an ancestor is a known agent process -- here, this test itself."""
    me = (os.getpid(), identity._start_time(os.getpid()))
    parent = (os.getppid(), identity._start_time(os.getppid()))
    a, b = socket.socketpair(socket.AF_UNIX)
    with a, b:
        assert observe(a, set()) == Caller(os.getuid(), False, False)
        assert observe(a, {me}) == Caller(os.getuid(), False, True)
        assert observe(a, {parent}) == Caller(os.getuid(), False, True)  # an ancestor counts
        assert observe(a, {(os.getpid(), 1.0)}) == Caller(os.getuid(), False, False)  # pid reused
