"""One command per agent connection: an ssh ControlMaster carries no second one.

Everything on an agent connection runs as the process that opened it, so a
command sent through an ssh ControlMaster -- by the agent that started it or by
an unrelated process using its control socket -- must not run. Command-line
options override the generated config (`ControlMaster no`, `ControlPath
none`), so these tests pass them with `-o`, `-S` and `-M` as an agent could.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import asyncssh
import pytest

from bastion.agent import proxy
from bastion.gateway.agent_ssh import MAX_EXTRA_CHANNELS
from tests.harness import (
    HELPER,
    Agent,
    Bastion,
    Result,
    approved_agent,
    master_pid,
    python_copy,
    wait_for,
)

pytestmark = pytest.mark.skipif(not Path("/usr/bin/ssh").exists(), reason="no /usr/bin/ssh")


@contextlib.contextmanager
def control_path() -> Iterator[Path]:
    """A short ControlPath (a unix socket path has at most 107 bytes, and ssh adds a
    suffix while it binds); any master left on it is stopped afterwards."""
    with tempfile.TemporaryDirectory(prefix="cm", dir="/tmp") as d:
        path = Path(d) / "m"
        try:
            yield path
        finally:
            pid = master_pid(path)
            subprocess.run(
                ["ssh", "-F", "/dev/null", "-o", f"ControlPath={path}", "-O", "exit", "web1"],
                capture_output=True,
                timeout=30,
            )
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)


def assert_refused(result: Result, second_session: bool = False) -> None:
    """The agent-facing refusal: exit 77, UNSUPPORTED_REQUEST, naming ControlMaster.
    `second_session`: refused by the one-session rule itself (its own text)."""
    assert result.rc == 77, result.stderr
    assert result.code == "UNSUPPORTED_REQUEST", result.stderr
    assert result.error is not None
    message = result.error["message"]
    assert "one command per ssh connection" in message and "ControlMaster" in message
    assert "Nothing was sent" in message
    if second_session:
        assert "this connection already carried one" in message
        assert "-o ControlPath=none" in message
        # What the agent sees is the JSON line and nothing else: no ssh chatter.
        assert result.stderr.strip().splitlines() == [result.stderr.strip()]


def test_a_persistent_master_carries_no_second_command(bastion: Bastion, tmp_path: Path) -> None:
    a = approved_agent(bastion)
    b = bastion.agent()
    marker_a, marker_b, marker_exec = (tmp_path / n for n in ("by-a", "by-b", "after-exec"))
    with control_path() as sock:
        # Agent A starts a master with its first command. That command is its own
        # (it may run, or be refused as coming from a master); the master stays.
        persist = ("-o", "ControlMaster=auto", "-o", f"ControlPath={sock}")
        first = a.run("echo first", ssh_args=(*persist, "-o", "ControlPersist=60"))
        assert first.rc in (0, 77), first.stderr
        if first.rc == 77:
            assert_refused(first)
        master = master_pid(sock)
        assert master is not None, "no master to ride"

        # A's second command through its own master: refused, nothing runs.
        second = a.run(f"touch {marker_a}", ssh_args=("-o", f"ControlPath={sock}"))
        assert_refused(second)
        assert master_pid(sock) == master  # it went through the master, not a new connection

        # B, an unrelated process, through A's control socket: refused, no card, nothing runs.
        third = b.run(f"touch {marker_b}", ssh_args=("-S", str(sock)))
        assert_refused(third)
        assert bastion.op("pending") == []

        # A becomes another program; the master it left behind still carries nothing.
        a.exec([str(python_copy(tmp_path, "other-agent")), str(HELPER)])
        fourth = b.run(f"touch {marker_exec}", ssh_args=("-o", f"ControlPath={sock}"))
        assert_refused(fourth)
    assert not marker_a.exists() and not marker_b.exists() and not marker_exec.exists()


def test_no_one_rides_a_master_while_its_first_command_runs(
    bastion: Bastion, tmp_path: Path
) -> None:
    """While A's first command runs through a ControlPersist master, the ssh that
    connected is alive and listens on nothing (the master went to the background):
    only the one-session rule stands between B and A's approval."""
    a = approved_agent(bastion)
    b = bastion.agent()
    running, marker_b = tmp_path / "running", tmp_path / "by-b"
    with control_path() as sock:
        persist = ("-o", "ControlMaster=auto", "-o", f"ControlPath={sock}")
        first = a.start(
            f"touch {running}; sleep 3; echo first", ssh_args=(*persist, "-o", "ControlPersist=60")
        )
        wait_for(running.exists, timeout=30)
        ride = b.run(f"touch {marker_b}", ssh_args=("-S", str(sock)))
        assert_refused(ride, second_session=True)
        done = a.wait(first)
        assert (done.rc, done.stdout) == (0, b"first\n"), done.stderr
        assert bastion.op("pending") == []
    assert not marker_b.exists()


def test_a_background_master_with_no_command_carries_none(bastion: Bastion, tmp_path: Path) -> None:
    a = approved_agent(bastion)
    b = bastion.agent()
    marker_a, marker_b = tmp_path / "by-a", tmp_path / "by-b"
    with control_path() as sock:
        master = ("-o", "ControlMaster=yes", "-o", f"ControlPath={sock}", "-o", "ControlPersist=60")
        started = a.run([], argv=["ssh", "-F", str(bastion.config), *master, "-N", "-f", "web1"])
        assert started.rc == 0, started.stderr
        assert master_pid(sock) is not None
        # The first session on this connection comes through the master: refused
        # by the gateway's ControlMaster check; any later one by the one-session rule.
        assert_refused(a.run(f"touch {marker_a}", ssh_args=("-o", f"ControlPath={sock}")))
        assert_refused(b.run(f"touch {marker_b}", ssh_args=("-S", str(sock))))
        assert_refused(b.run(f"touch {marker_b}", ssh_args=("-o", f"ControlPath={sock}")))
        assert bastion.op("pending") == []
    assert not marker_a.exists() and not marker_b.exists()


def test_one_command_per_connection_still_works(bastion: Bastion) -> None:
    a = approved_agent(bastion)
    for n in range(3):
        result = a.run(f"echo plain-{n}")
        assert (result.rc, result.stdout) == (0, f"plain-{n}\n".encode()), result.stderr
    # A second agent, sharing nothing with the first, gets its own card as ever.
    other = Agent(bastion.config, python=sys.executable)
    bastion.agents.append(other)
    rid = other.start("echo other")
    bastion.approve_next()
    assert other.wait(rid).stdout == b"other\n"


async def _sessions_on_one_connection(bastion: Bastion, count: int) -> list[object]:
    """Open `count` sessions on one raw SSH connection (no OpenSSH, no mux), run
    `true` in each but the first; the exit status of each, or the open error. This
    process listens on a unix socket meanwhile, as a client that relays for others
    would: a connection only its own client sends through carries later channels
    (issue 21; tests/clients/test_libraries.py), this one must not."""
    relay = socket.socket(socket.AF_UNIX)
    relay.bind(str(bastion.root / "relay.sock"))
    relay.listen()
    try:
        return await _sessions(bastion, count)
    finally:
        relay.close()


async def _sessions(bastion: Bastion, count: int) -> list[object]:
    known = bastion.home.known_hosts.read_text().split(None, 1)[1]
    user = bastion.sshd.user
    command = [sys.executable, "-I", "-S", proxy.__file__, "--socket"]
    async with asyncssh.connect(
        "web1",
        username=user,
        known_hosts=([asyncssh.import_public_key(known)], [], []),
        proxy_command=[*command, str(bastion.home.agent_socket), "web1", "22", user],
        config=None,
        client_keys=None,
        agent_path=None,
    ) as conn:
        outcomes: list[object] = []
        first, _ = await conn.create_session(asyncssh.SSHClientSession)  # opened, never used
        for _ in range(count - 1):
            try:
                result = await conn.run("true")
                outcomes.append((result.exit_status, result.stderr))
            except asyncssh.ChannelOpenError as exc:
                outcomes.append(exc)
        first.close()
        return outcomes


def test_later_sessions_are_answered_then_refused_at_open(bastion: Bastion) -> None:
    outcomes = asyncio.run(
        asyncio.wait_for(_sessions_on_one_connection(bastion, MAX_EXTRA_CHANNELS + 3), 60)
    )
    answered, refused = outcomes[:MAX_EXTRA_CHANNELS], outcomes[MAX_EXTRA_CHANNELS:]
    for status, stderr in answered:  # type: ignore[misc]
        assert status == 77
        error = json.loads(stderr.strip())["error"]
        assert error["code"] == "UNSUPPORTED_REQUEST" and "ControlMaster" in error["message"]
    for exc in refused:
        assert isinstance(exc, asyncssh.ChannelOpenError)
        assert exc.code == asyncssh.OPEN_ADMINISTRATIVELY_PROHIBITED
        assert "one command per ssh connection" in exc.reason
    assert bastion.op("pending") == []
