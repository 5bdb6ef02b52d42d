"""`bastion demo` end to end, and CLI commands that work without a gateway
(issue 2, acceptance 7)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bastion.devtools.sshd_fixture import SshdInfo, sshd_available
from tests.harness import Bastion


def test_demo_exits_zero() -> None:
    if sshd_available():
        pytest.skip(sshd_available() or "")
    r = subprocess.run(
        [sys.executable, "-m", "bastion.cli", "demo"],
        capture_output=True,
        text=True,
        timeout=180,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "VAULT_LOCKED" in r.stdout and "POLICY_DENIED" in r.stdout and "== Done" in r.stdout


def test_hostkey_prints_a_pin_that_matches_the_server(sshd: SshdInfo) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "bastion.cli", "hostkey", sshd.address, "--port", str(sshd.port)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert "trust on first use" in r.stdout
    assert f'host_key = "{sshd.host_key}"' in r.stdout


def test_status_without_a_gateway_says_how_to_start_it(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "bastion.cli", "--home", str(tmp_path), "status"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1 and "bastion daemon" in r.stderr


def test_status_json_has_the_contract_keys(bastion: Bastion) -> None:
    status = json.loads(bastion.cli("status", "--json").stdout)
    assert {"locked", "vault_epoch", "boot_id", "policy", "isolation"} <= set(status)
    assert status["isolation"] == "advisory"  # the agents here run as the gateway's own user
    assert set(status["policy"]) >= {"ok", "error"}


def test_ssh_config_is_accepted_by_openssh(bastion: Bastion) -> None:
    r = subprocess.run(
        ["ssh", "-G", "-F", str(bastion.config), "web1"], capture_output=True, text=True, timeout=30
    )
    assert r.returncode == 0, r.stderr
    settings = dict(line.split(" ", 1) for line in r.stdout.splitlines() if " " in line)
    assert settings["proxyusefdpass"] == "yes" and settings["forwardagent"] == "no"
    assert settings["hostkeyalias"] == "bastion-gateway" and settings["batchmode"] == "yes"
    assert settings["user"] == bastion.sshd.user and settings["requesttty"] == "false"
