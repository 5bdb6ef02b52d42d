"""Policy as the running gateway applies it (issue 2, acceptance 5)."""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

from bastion.devtools.sshd_fixture import SshdInfo
from tests.harness import Bastion, policy_toml


def test_deny_and_allow_rules(bastion: Bastion, sshd: SshdInfo) -> None:
    bastion.write_policy(policy_toml(sshd, allow=["echo *", "uname*"], deny=["*secret*"]))
    agent = bastion.agent()
    rid = agent.start("echo allowed")
    bastion.approve_next()
    assert agent.wait(rid).stdout == b"allowed\n"
    r = agent.run("echo secret")
    assert r.rc == 77 and r.code == "POLICY_DENIED" and "deny rule" in r.error["message"]
    r = agent.run("id")
    assert r.rc == 77 and r.code == "POLICY_DENIED" and "allow rule" in r.error["message"]


def test_unknown_host_and_account(bastion: Bastion) -> None:
    agent = bastion.agent()
    r = agent.run("true", host="db9")
    assert r.rc == 77 and r.code == "UNKNOWN_HOST" and "web1" in r.error["message"]
    r = agent.run("true", host="nobody@web1")
    assert r.rc == 77 and r.code == "POLICY_DENIED" and "nobody" in r.error["message"]
    assert bastion.op("pending") == []


def test_wrong_pinned_host_key_runs_nothing(
    bastion: Bastion, sshd: SshdInfo, tmp_path: Path
) -> None:
    other = tmp_path / "other"
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True, timeout=30
    )
    wrong = " ".join(other.with_suffix(".pub").read_text().split()[:2])
    bastion.write_policy(policy_toml(sshd, host_key=wrong))
    marker = tmp_path / "marker-wrong-key"
    agent = bastion.agent()
    rid = agent.start(f"touch {marker}")
    bastion.approve_next()
    r = agent.wait(rid)
    assert r.rc == 69 and r.code == "HOST_KEY_MISMATCH" and r.error["retryable"] is False
    assert not marker.exists()


def test_closed_port_is_unreachable_and_retryable(bastion: Bastion, sshd: SshdInfo) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    bastion.write_policy(policy_toml(sshd, port=closed))
    agent = bastion.agent()
    rid = agent.start("true")
    bastion.approve_next()
    r = agent.wait(rid)
    assert r.rc == 69 and r.code == "UNREACHABLE" and r.error["retryable"] is True


def test_broken_policy_fails_closed_while_negative_controls_work(
    bastion: Bastion, sshd: SshdInfo
) -> None:
    broken = policy_toml(sshd).replace('credential = "deploy-key"\n', "")
    bastion.write_policy(broken)
    agent = bastion.agent()
    r = agent.run("true")
    assert r.rc == 77 and r.code == "POLICY_UNAVAILABLE"
    status = json.loads(bastion.cli("status", "--json").stdout)
    assert status["policy"]["ok"] is False
    assert "test.toml" in status["policy"]["error"] and "credential" in status["policy"]["error"]
    bastion.cli("lock")
    assert json.loads(bastion.cli("status", "--json").stdout)["locked"] is True
    r = agent.run("true")
    assert r.code == "VAULT_LOCKED"  # the lock is checked first, policy or not


def test_policy_edits_apply_without_restart(bastion: Bastion, sshd: SshdInfo) -> None:
    agent = bastion.agent()
    rid = agent.start("echo before")
    bastion.approve_next()
    assert agent.wait(rid).stdout == b"before\n"
    bastion.write_policy(policy_toml(sshd, deny=["echo denied*"]))
    r = agent.run("echo denied now")
    assert r.code == "POLICY_DENIED"
    # The entry changed, so the earlier approval no longer covers it.
    rid = agent.start("echo after")
    card = bastion.next_card()
    assert card["reason"] == "policy_changed"
    bastion.answer(card, True)
    assert agent.wait(rid).stdout == b"after\n"


def test_policy_file_writable_by_others_is_refused(bastion: Bastion, sshd: SshdInfo) -> None:
    path = bastion.write_policy(policy_toml(sshd))
    path.chmod(0o666)
    r = bastion.agent().run("true")
    assert r.code == "POLICY_UNAVAILABLE"
    status = json.loads(bastion.cli("status", "--json").stdout)
    assert "writable" in status["policy"]["error"]


def test_credential_missing_from_the_vault_is_a_clear_gateway_fault(
    bastion: Bastion, sshd: SshdInfo
) -> None:
    bastion.write_policy(policy_toml(sshd, credential="not-in-vault"))
    agent = bastion.agent()
    rid = agent.start("true")
    bastion.approve_next()
    r = agent.wait(rid)
    assert r.rc == 70 and r.code == "INTERNAL"
    assert "not-in-vault" in r.error["message"] and "bastion key import" in r.error["message"]
