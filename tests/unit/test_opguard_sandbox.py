"""The operator socket refuses a process inside a sandbox (`core/opguard.admit`'s
second rule) by what the kernel says of its namespaces, never by what the gateway
remembers: checked after the uid, before the process tree. And the edge's reader
(`procs.in_other_namespaces`) against real namespaces: this process, a child in
new user and PID namespaces (`unshare`), and one whose namespaces cannot be read."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess

import pytest

from bastion.core.opguard import INSIDE_A_SANDBOX, INSIDE_AN_AGENT, ROOT_UID, Caller, admit
from bastion.identity import procs

DAEMON = 1000
OTHER = 1001


@pytest.mark.parametrize(
    ("uid", "sandboxed", "below_agent"),
    list(itertools.product((DAEMON, ROOT_UID, OTHER), (False, True), (False, True))),
)
def test_the_rules_in_order_uid_then_sandbox_then_tree(
    uid: int, sandboxed: bool, below_agent: bool
) -> None:
    if uid == OTHER:
        want: str | None = f"uid {OTHER} is not the gateway's operator"
    elif sandboxed:
        want = INSIDE_A_SANDBOX
    elif below_agent:
        want = INSIDE_AN_AGENT
    else:
        want = None
    assert admit(Caller(uid, sandboxed, below_agent), DAEMON) == want


def test_a_sandboxed_caller_is_refused_with_words_of_its_own() -> None:
    """Even when the gateway knows of no agent above it (a run it never registered)."""
    assert admit(Caller(DAEMON, True, False), DAEMON) == INSIDE_A_SANDBOX
    assert admit(Caller(ROOT_UID, True, False), DAEMON) == INSIDE_A_SANDBOX
    assert "sandboxed run" in INSIDE_A_SANDBOX and INSIDE_A_SANDBOX != INSIDE_AN_AGENT


def test_this_process_and_its_parent_share_the_gateways_namespaces() -> None:
    assert procs.in_other_namespaces(os.getpid()) is False
    assert procs.in_other_namespaces(os.getppid()) is False


def test_a_process_gone_counts_as_sandboxed() -> None:
    """Closed: namespaces that cannot be read are not the gateway's."""
    child = subprocess.Popen(["true"])
    child.wait()
    assert procs.in_other_namespaces(child.pid) is True


@pytest.mark.skipif(shutil.which("unshare") is None, reason="util-linux unshare missing")
def test_a_process_in_new_user_and_pid_namespaces_is_sandboxed() -> None:
    """The positive control is the same `sleep` outside `unshare`: not sandboxed."""
    outside = subprocess.Popen(["sleep", "30"])
    inside = subprocess.Popen(["unshare", "--user", "--pid", "--fork", "sleep", "30"])
    try:
        assert procs.in_other_namespaces(outside.pid) is False
        # The sleep is unshare's child, the one in the new namespaces.
        procs_inside = _child_of(inside.pid)
        assert procs.in_other_namespaces(procs_inside) is True
    finally:
        for p in (outside, inside):
            p.kill()
            p.wait()


@pytest.mark.skipif(shutil.which("unshare") is None, reason="util-linux unshare missing")
def test_unreadable_links_fall_back_to_what_anyone_may_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A gateway that is not root cannot read another uid's (root's) /proc/PID/ns
    links: then NSpid and uid_map, which anyone may read, still tell a process in
    the gateway's namespaces from one in new ones."""
    here = subprocess.Popen(["sleep", "30"])
    away = [
        subprocess.Popen(["unshare", "--pid", "--fork", "sleep", "30"]),
        subprocess.Popen(["unshare", "--user", "--fork", "sleep", "30"]),
    ]
    try:
        inside = [_child_of(p.pid) for p in away]

        def denied(path: str) -> str:
            raise PermissionError(13, "Permission denied", path)

        monkeypatch.setattr(procs.os, "readlink", denied)
        assert procs.in_other_namespaces(here.pid) is False
        assert [procs.in_other_namespaces(pid) for pid in inside] == [True, True]
    finally:
        for p in (here, *away):
            p.kill()
            p.wait()


def _child_of(pid: int) -> int:
    from bastion.identity import children
    from tests.harness import wait_for

    wait_for(lambda: children(pid), 10)
    return children(pid)[0]
