"""What the gateway refuses: a locked vault, shells, PTYs, forwarding (issue 2, acceptance 3-4)."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from pathlib import Path

from tests.harness import Bastion, unchecked_proxy


def test_locked_vault_denies_at_once_and_nothing_runs_after_unlock(
    bastion: Bastion, tmp_path: Path
) -> None:
    marker = tmp_path / "marker-locked"
    agent = bastion.agent()
    rid = agent.start("true")
    bastion.approve_next()
    assert agent.wait(rid).rc == 0

    bastion.cli("lock")
    started = time.monotonic()
    r = agent.run(f"touch {marker}")
    elapsed = time.monotonic() - started
    assert r.rc == 77 and r.code == "VAULT_LOCKED" and r.error["retryable"] is False
    assert r.error["request_id"].startswith("req_")
    assert json.loads(r.stderr.strip().splitlines()[-1])["ok"] is False  # the very last line
    # Answered at once, not after waiting for anyone (the approval timeout is 20 s).
    assert elapsed < 10, elapsed
    assert bastion.op("pending") == []

    bastion.unlock()
    # A fresh approval and a later command act as a barrier: anything queued
    # before it would have run by the time it completes.
    rid = agent.start("echo after")
    card = bastion.next_card()
    assert card["reason"] == "vault_state_changed"
    bastion.answer(card, True)
    assert agent.wait(rid).stdout == b"after\n"
    assert not marker.exists()


def test_a_card_waiting_when_the_vault_locks_is_withdrawn(bastion: Bastion, tmp_path: Path) -> None:
    marker = tmp_path / "marker-waiting"
    agent = bastion.agent()
    rid = agent.start(f"touch {marker}")
    card = bastion.next_card()
    bastion.cli("lock")
    r = agent.wait(rid)
    assert r.rc == 77 and r.code == "VAULT_LOCKED"
    bastion.unlock()
    late = bastion.cli("decide", card["id"], "approve", check=False)
    assert late.returncode != 0 and "no pending card" in late.stderr
    assert not marker.exists()


def test_no_shell_and_no_pty(bastion: Bastion, tmp_path: Path) -> None:
    agent = bastion.agent()
    r = agent.run([], ssh_args=("-o", "RequestTTY=no"))
    assert r.rc == 77 and r.code == "UNSUPPORTED_REQUEST" and "one command" in r.error["message"]
    # A forced PTY (-tt) on an account without `pty` is refused by the gate with
    # bastion's error (tests/integration/test_terminal_requests.py): nothing runs.
    marker = tmp_path / "marker-tty"
    r = agent.run(f"touch {marker}", ssh_args=("-tt",))
    assert r.rc == 77 and r.code == "UNSUPPORTED_REQUEST" and "`pty = true`" in r.stderr
    assert bastion.op("pending") == [] and not marker.exists()
    # Without -tt, the command runs with no terminal on the target.
    rid = agent.start("tty; echo rc=$?", ssh_args=("-t",))
    bastion.approve_next()
    r = agent.wait(rid)
    assert r.rc == 0 and r.stdout == b"not a tty\nrc=1\n"


def test_no_agent_forwarding(bastion: Bastion, tmp_path: Path) -> None:
    sock = tmp_path / "agent.sock"
    ssh_agent = subprocess.Popen(
        ["ssh-agent", "-D", "-a", str(sock)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 10
        while not sock.exists():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        agent = bastion.agent(SSH_AUTH_SOCK=str(sock))
        rid = agent.start(
            "echo sock=${SSH_AUTH_SOCK:-none}", ssh_args=("-A", "-o", "ForwardAgent=yes")
        )
        bastion.approve_next()
        r = agent.wait(rid)
        assert r.rc == 0 and r.stdout == b"sock=none\n"
    finally:
        ssh_agent.kill()
        ssh_agent.wait(10)


# Undo the config's ClearAllForwardings, and run the proxy where it does not read the
# ssh's argv (which refuses -N, -L and -R at once), so the request reaches the gateway.
FORWARD = ("-N", "-o", "ClearAllForwardings=no", "-o", "ExitOnForwardFailure=yes")


def test_no_port_forwarding(bastion: Bastion) -> None:
    agent = bastion.agent()
    proxied = (*FORWARD, *unchecked_proxy(bastion))
    refused = agent.run([], ssh_args=(*FORWARD, "-R", "0:127.0.0.1:22"))
    assert refused.rc == 255 and refused.code == "UNSUPPORTED_REQUEST", refused.stderr
    remote = agent.run([], ssh_args=(*proxied, "-R", "0:127.0.0.1:22"))
    assert remote.rc == 255 and "forwarding failed" in remote.stderr

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    target = f"{port}:{bastion.sshd.address}:{bastion.sshd.port}"
    agent.start([], ssh_args=(*proxied, "-L", target))
    deadline = time.monotonic() + 10
    while True:
        try:
            conn = socket.create_connection(("127.0.0.1", port), timeout=5)
            break
        except OSError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    with conn:
        conn.settimeout(5)
        # The channel open is refused: the target's SSH banner never arrives.
        assert conn.recv(100) == b""
    agent.proc.kill()  # ends the -N ssh with it
