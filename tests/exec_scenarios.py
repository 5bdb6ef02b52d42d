"""Brokered exec passthrough, as scenarios any sshd target can be put through.

The integration tier runs them against a loopback sshd (`integration/test_exec.py`),
the container tier against the image `fixtures/sshd/Dockerfile` builds
(`container/test_container_exec.py`): one body each, two targets.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

from tests.harness import Bastion, after_waiting

Scenario = Callable[[Bastion, Path], None]


def output_stderr_binary_stdin_and_exit_status_pass_through(
    bastion: Bastion, tmp_path: Path
) -> None:
    agent = bastion.agent()
    rid = agent.start("printf 'out\\n'; printf 'err\\n' >&2; exit 7")
    card = bastion.approve_next()
    assert card["kind"] == "session" and card["subject"]["pid"] == agent.pid
    r = agent.wait(rid)
    assert (r.rc, r.stdout, after_waiting(r.stderr, card)) == (7, b"out\n", "err\n")

    blob = tmp_path / "blob"
    blob.write_bytes(os.urandom(3 * 1024 * 1024 + 17))
    digest = hashlib.sha256(blob.read_bytes()).hexdigest()
    r = agent.run("sha256sum | cut -d' ' -f1", stdin_path=blob)
    assert r.rc == 0 and r.stdout.decode().strip() == digest
    r = agent.run("cat", stdin_path=blob)  # and back again, byte for byte
    assert r.rc == 0 and r.stdout_sha256 == digest and r.stdout_len == blob.stat().st_size


def exit_signal_passes_through(bastion: Bastion, tmp_path: Path) -> None:
    agent = bastion.agent()
    rid = agent.start("kill -TERM $$")
    bastion.approve_next()
    r = agent.wait(rid)
    # OpenSSH's client exits 255 when the remote command died of a signal.
    assert r.rc == 255 and r.code is None


def same_process_reuses_its_approval_another_process_does_not(
    bastion: Bastion, tmp_path: Path
) -> None:
    first = bastion.agent()
    rid = first.start("echo one")
    bastion.approve_next()
    assert first.wait(rid).stdout == b"one\n"
    assert first.run("echo two").stdout == b"two\n"  # no card: approve_next not called
    assert bastion.op("pending") == []
    sessions = bastion.op("sessions")
    assert [s["subject"]["pid"] for s in sessions] == [first.pid]

    second = bastion.agent()
    rid = second.start("echo three")
    card = bastion.next_card()
    assert card["subject"]["pid"] == second.pid and card["reason"] is None
    bastion.answer(card, False)
    r = second.wait(rid)
    assert r.rc == 77 and r.code == "SESSION_DENIED" and r.stdout == b""


ALL: list[Scenario] = [
    output_stderr_binary_stdin_and_exit_status_pass_through,
    exit_signal_passes_through,
    same_process_reuses_its_approval_another_process_does_not,
]
