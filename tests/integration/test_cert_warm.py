"""Certificate accounts on warm connections, seen from the target's own sshd log.

After a certificate account's command logs in, the gateway opens the next connection to
that target and stops it at the auth step (`gateway/warm.py`): key exchange and the pin
are done before the next command is asked. sshd logs each connection's port when it
arrives ("Connection from ... port P"), each login with the certificate's key id (the
request id) and the same port, and each command it starts on it; so the log says which
connection a command rode, whether it was there before the command, and that no
connection carried two.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncssh
import psutil
import pytest

from bastion.devtools.sshd_fixture import Sshd, sshd_available
from tests.harness import (
    CERT,
    Agent,
    Bastion,
    ca_bastion,
    policy_toml,
    wait_for,
)

_ARRIVED = re.compile(r"Connection from \S+ port (\d+) on ")
_LOGIN = re.compile(r"Accepted publickey for \S+ from \S+ port (\d+) ssh2: \S+-CERT \S+ ID (\S+) ")
_STARTED = re.compile(r"Starting session: .* for \S+ from \S+ port (\d+) id ")


def _arrived(log: str) -> list[int]:
    return [int(p) for p in _ARRIVED.findall(log)]


def _logins(log: str) -> list[tuple[int, str]]:
    """(port, certificate key id) of each certificate login, oldest first."""
    return [(int(p), key_id) for p, key_id in _LOGIN.findall(log)]


def _parked(log: str) -> list[int]:
    """Ports that arrived and neither logged in nor ended (as far as the log says)."""
    logged = {p for p, _ in _logins(log)}
    return [p for p in _arrived(log) if p not in logged and f"port {p} [preauth]" not in log]


def _links(b: Bastion, server: Sshd) -> list[int]:
    """The gateway's TCP connections to the target now, by local port."""
    port = server.info.port
    return [
        c.laddr.port
        for c in psutil.Process(b.gateway_pid).net_connections(kind="tcp")
        if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
    ]


def _rows(b: Bastion) -> list[dict[str, Any]]:
    return list(b.op("audit", view="activity"))


@pytest.fixture
def cert_bastion(tmp_path: Path, ca_sshd: Sshd, client_key: tuple[Path, str]) -> Iterator[Bastion]:
    b = ca_bastion(tmp_path, ca_sshd, client_key[0], **CERT)
    try:
        yield b
    finally:
        b.close()


def _first(b: Bastion) -> Agent:
    """An agent whose session is approved, after its first command (on a connection of
    its own: nothing was parked before it)."""
    agent = b.agent()
    rid = agent.start("true")
    b.approve_next()
    assert agent.wait(rid).rc == 0
    return agent


def _one_parked(server: Sshd, since: int) -> int:
    """Wait until the log shows one connection parked (arrived after `since`, no login)."""
    parked: list[int] = []

    def seen() -> bool:
        parked[:] = _parked(server.log_text()[since:])
        return len(parked) == 1

    wait_for(seen, timeout=20)
    return parked[0]


def test_the_next_command_logs_in_on_the_connection_opened_before_it(
    cert_bastion: Bastion, ca_sshd: Sshd
) -> None:
    b, since = cert_bastion, len(ca_sshd.log_text())
    agent = _first(b)
    first_port, _ = _logins(ca_sshd.log_text()[since:])[0]
    warm = _one_parked(ca_sshd, since)  # opened after the first login, before any command
    assert warm != first_port

    second = agent.run("echo second")
    assert (second.rc, second.stdout) == (0, b"second\n"), second.stderr
    rows = _rows(b)
    assert [r["outcome"] for r in rows] == ["completed", "completed"]
    logins = _logins(ca_sshd.log_text()[since:])
    # The second request's certificate logged in on the warm connection: one login there.
    assert (warm, rows[1]["request_id"]) in logins
    assert [p for p, _ in logins].count(warm) == 1


def test_no_connection_carries_two_logins_or_two_commands(
    cert_bastion: Bastion, ca_sshd: Sshd
) -> None:
    b, since = cert_bastion, len(ca_sshd.log_text())
    agent = _first(b)
    for i in range(4):
        _one_parked(ca_sshd, since)  # each command finds a warm one (not timing: a wait)
        r = agent.run(f"echo {i}")
        assert (r.rc, r.stdout) == (0, f"{i}\n".encode()), r.stderr
    log = ca_sshd.log_text()[since:]
    logins = _logins(log)
    ids = [r["request_id"] for r in _rows(b)]
    assert sorted(key_id for _, key_id in logins) == sorted(ids)  # one login per request
    assert len({p for p, _ in logins}) == len(logins) == 5  # each on a connection of its own
    started = Counter(int(p) for p in _STARTED.findall(log))
    assert started == Counter(p for p, _ in logins)  # and one command on each
    assert len(set(_arrived(log))) == len(_arrived(log))


def test_a_lock_closes_the_warm_connection_and_none_opens_until_a_command(
    cert_bastion: Bastion, ca_sshd: Sshd
) -> None:
    b, since = cert_bastion, len(ca_sshd.log_text())
    agent = _first(b)
    warm = _one_parked(ca_sshd, since)
    wait_for(lambda: _links(b, ca_sshd) == [warm], timeout=20)  # the control: it is held

    b.cli("lock")
    wait_for(lambda: _links(b, ca_sshd) == [], timeout=20)
    wait_for(lambda: _parked(ca_sshd.log_text()[since:]) == [], timeout=20)  # sshd saw it end
    b.unlock()
    assert _links(b, ca_sshd) == []  # unlocking opens none: nobody asked since

    rid = agent.start("echo after")
    b.approve_next()  # the lock ended the session
    after = agent.wait(rid)
    assert (after.rc, after.stdout) == (0, b"after\n"), after.stderr
    port, key_id = _logins(ca_sshd.log_text()[since:])[-1]
    assert port != warm and key_id == _rows(b)[-1]["request_id"]


@pytest.fixture
def impatient_sshd(tmp_path: Path) -> Iterator[Sshd]:
    """A target that drops a connection not logged in within 2 seconds."""
    reason = sshd_available()
    if reason:
        pytest.skip(reason)
    with Sshd(tmp_path / "impatient", login_grace_time=2) as server:
        yield server


def test_a_warm_connection_the_target_dropped_is_replaced_and_the_command_runs(
    tmp_path: Path, impatient_sshd: Sshd, client_key: tuple[Path, str]
) -> None:
    server = impatient_sshd
    b = ca_bastion(tmp_path, server, client_key[0], **CERT)
    try:
        since = len(server.log_text())
        agent = _first(b)
        warm = _one_parked(server, since)
        assert warm in _links(b, server)  # the control: parked, and held
        # sshd ends it at LoginGraceTime (its SIGALRM handler logs nothing, since the
        # regreSSHion fix): the gateway's end of it is gone long before its own 30 s.
        wait_for(lambda: warm not in _links(b, server), timeout=20)

        r = agent.run("echo still-runs")
        assert (r.rc, r.stdout) == (0, b"still-runs\n"), r.stderr
        port, key_id = _logins(server.log_text()[since:])[-1]
        assert port != warm and key_id == _rows(b)[-1]["request_id"]
        assert [row["outcome"] for row in _rows(b)] == ["completed", "completed"]
    finally:
        b.close()


def test_a_parked_connection_is_not_used_once_the_pin_changes(
    cert_bastion: Bastion, ca_sshd: Sshd
) -> None:
    """The parked connection checked the old pin; a command under a new pin (the policy
    changed) does not ride it, and its own connection fails the pin, as without one."""
    b, since = cert_bastion, len(ca_sshd.log_text())
    agent = _first(b)
    warm = _one_parked(ca_sshd, since)
    other = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode()
    b.write_policy(policy_toml(ca_sshd.info, host_key=" ".join(other.split()[:2]), **CERT))

    rid = agent.start("echo never")
    b.approve_next()  # the entry changed: a new session
    r = agent.wait(rid)
    assert r.code == "HOST_KEY_MISMATCH", r.stderr
    assert [p for p, _ in _logins(ca_sshd.log_text()[since:])] == [
        _logins(ca_sshd.log_text()[since:])[0][0]
    ]  # the first command's login only: none on the parked connection
    assert warm in _parked(ca_sshd.log_text()[since:]) or warm not in _links(b, ca_sshd)
    assert [row["outcome"] for row in _rows(b)] == ["completed", "not_started"]
