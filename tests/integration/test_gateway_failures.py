"""Issue 18: a gateway that cannot answer, as the agent meets it (the real ssh client
and the ProxyCommand `bastion ssh-config` writes, against a real gateway frozen with
SIGSTOP), and a gateway that cannot start, as the operator meets it (the real CLI on
a damaged home)."""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from bastion.agent.wire import REPLY_TIMEOUT
from bastion.home import Home
from tests.harness import PASSPHRASE, Bastion, bastion_cli


def test_a_wedged_gateway_is_gateway_busy_after_the_reply_timeout(
    bastion: Bastion, tmp_path: Path
) -> None:
    agent = bastion.agent()
    marker = tmp_path / "ran"
    gateway = bastion.gateway_pid
    os.kill(gateway, signal.SIGSTOP)  # takes connections (the kernel), answers none
    try:
        started = time.monotonic()
        result = agent.run(f"touch {marker}")
        took = time.monotonic() - started
    finally:
        os.kill(gateway, signal.SIGCONT)
    assert result.rc == 255, result  # ssh's own status when its ProxyCommand fails
    error = result.error
    assert error is not None, result.stderr
    assert error["code"] == "GATEWAY_BUSY" and error["retryable"] is True, error
    message = error["message"]
    assert f"did not answer within {REPLY_TIMEOUT:g} s" in message, message
    assert "Nothing was sent to the target" in message and "retry" in message, message
    assert "None" not in message, message
    assert REPLY_TIMEOUT - 1 < took < REPLY_TIMEOUT + 30, took
    # The gateway carries on; the connection its proxy gave up on ran nothing.
    rid = agent.start("echo again")
    bastion.approve_next()
    assert agent.wait(rid).stdout == b"again\n"
    assert not marker.exists()


def damage(home: Home, what: str, other: Path) -> str:
    """Break one file the gateway reads at its start; the file the sentence must name."""
    identity = home.journal / "identity.json"
    if what == "identity missing":
        identity.unlink()
        return str(identity)
    if what == "identity of another home":
        shutil.copy(other / "journal" / "identity.json", identity)
        return str(identity)
    if what == "identity corrupt":
        identity.write_text("{}\n")
        return str(identity)
    if what == "host key missing":
        home.host_key.unlink()
        return str(home.host_key)
    if what == "host key corrupt":
        home.host_key.write_text("not a key\n")
        return str(home.host_key)
    if what == "vault corrupt":
        home.vault.write_text("garbage\n")
        return str(home.vault)
    assert what == "vault unreadable"
    home.vault.unlink()
    home.vault.mkdir()
    return str(home.vault)


DAMAGES = [
    "identity missing",
    "identity of another home",
    "identity corrupt",
    "host key missing",
    "host key corrupt",
    "vault corrupt",
    "vault unreadable",
]


@pytest.fixture(scope="module")
def other_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("other") / "home"
    bastion_cli(root, "init", "--passphrase-stdin", stdin=PASSPHRASE + "\n")
    return root


@pytest.mark.parametrize("what", DAMAGES)
def test_a_daemon_that_cannot_start_says_why_in_one_sentence(
    tmp_path: Path, other_home: Path, what: str
) -> None:
    root = tmp_path / "home"
    assert bastion_cli(root, "init", "--passphrase-stdin", stdin=PASSPHRASE + "\n").returncode == 0
    named = damage(Home(root), what, other_home)
    r = bastion_cli(root, "daemon")
    assert r.returncode != 0, r
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bastion: "), r.stderr
    assert named in lines[0] and "the gateway does not start" in lines[0], lines[0]
    if what.startswith(("identity", "host key")):
        assert "`bastion init`" in lines[0], lines[0]
    assert not Home(root).agent_socket.exists()
