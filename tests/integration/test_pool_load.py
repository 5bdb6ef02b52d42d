"""The outbound pool against a real sshd whose MaxSessions is lower than the pool
assumes: many commands at once from one approved agent all run, spread over
several authenticated connections, and none is refused or lost."""

from __future__ import annotations

import collections
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from bastion.devtools.sshd_fixture import Sshd, SshdInfo, find_template, sshd_available
from tests.harness import Bastion, approved_agent, make_bastion, write_bastion_toml

MAX_SESSIONS = 3
AT_ONCE = 12


@pytest.fixture
def tight_sshd(tmp_path: Path, client_key: tuple[Path, str]) -> Iterator[Sshd]:
    reason = sshd_available()
    if reason:
        pytest.skip(reason)
    text = find_template().read_text()
    assert "MaxSessions 50" in text
    template = tmp_path / "sshd_config.template"
    template.write_text(text.replace("MaxSessions 50", f"MaxSessions {MAX_SESSIONS}"))
    with Sshd(tmp_path / "sshd", authorized_keys=[client_key[1]], template=template) as server:
        yield server


def test_commands_beyond_max_sessions_spread_over_connections(
    tmp_path: Path, tight_sshd: Sshd, client_key: tuple[Path, str]
) -> None:
    assert tight_sshd.info is not None
    b = make_bastion(tmp_path / "b", tight_sshd.info, client_key[0])
    try:
        agent = approved_agent(b)
        rids = [agent.start(f"sleep 1 && echo ran-{i}") for i in range(AT_ONCE)]
        results = [agent.wait(rid) for rid in rids]
        for i, r in enumerate(results):
            assert r.rc == 0 and r.stdout == f"ran-{i}\n".encode(), r.stderr
        held = b.op("status")["keys_held"]["connections"]
        assert held >= 2  # spread over several connections, each within MaxSessions
        rows = json.loads(b.cli("audit", "activity", "--json").stdout)
        assert sum(row["outcome"] == "completed" for row in rows) == AT_ONCE + 1
    finally:
        b.close()


def test_past_the_in_flight_limit_commands_run_or_are_told_busy_and_none_is_lost(
    tmp_path: Path, sshd: SshdInfo, client_key: tuple[Path, str]
) -> None:
    """[limits] inflight = 2: 16 slow commands at once; each runs or gets the retryable
    GATEWAY_BUSY, none hangs, and every request id has one outcome in the journal."""
    b = make_bastion(tmp_path, sshd, client_key[0], start=False)
    write_bastion_toml(b, "[limits]\ninflight = 2\nqueue_wait = 0.5\n")
    b.start_daemon()
    b.unlock()
    try:
        agent = approved_agent(b)
        rids = [agent.start(f"sleep 0.4 && echo ran-{i}") for i in range(16)]
        results = [agent.wait(rid, timeout=60) for rid in rids]
        ran = [r for r in results if r.rc == 0]
        busy = [r for r in results if r.rc != 0]
        assert ran and busy, [r.rc for r in results]
        for r in busy:
            assert r.rc == 69 and r.code == "GATEWAY_BUSY", r.stderr
            assert r.error is not None and r.error["retryable"] is True
        status = b.op("status")["load"]
        assert status["limit"] == 2 and status["busy_refused"] == len(busy)
        assert status["inflight"] == 0 and status["waiting"] == 0
        human = b.cli("status").stdout
        assert f"0 queued, {len(busy)} refused GATEWAY_BUSY since start" in human, human
        rows = json.loads(b.cli("audit", "activity", "--json").stdout)
        outcomes = collections.Counter((row["outcome"], row["code"]) for row in rows)
        assert outcomes[("completed", None)] == len(ran) + 1  # + the approving command
        assert outcomes[("denied", "GATEWAY_BUSY")] == len(busy)
        assert sum(outcomes.values()) == 17  # every request, one outcome each
        busy_id = busy[0].error["request_id"] if busy[0].error else ""
        assert json.loads(b.cli("request", busy_id, "--json").stdout)["state"] == "retry_safe"
    finally:
        b.close()


def test_the_local_leg_speaks_aes_gcm_without_compression(bastion: Bastion) -> None:
    """The agent's ssh and the gateway settle on AES-GCM (one AEAD call per packet in
    asyncssh, where chacha20-poly1305 takes several), never on compression."""
    agent = approved_agent(bastion)
    r = agent.run("echo hi", ssh_args=("-v",))
    assert r.rc == 0 and r.stdout == b"hi\n", r.stderr
    kex = [line for line in r.stderr.splitlines() if "kex: server->client cipher:" in line]
    assert kex and "cipher: aes128-gcm@openssh.com" in kex[0] and "compression: none" in kex[0]
