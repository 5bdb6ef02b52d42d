"""Honest outcomes: cut-offs are `unknown`, never success or failure (issue 4,
acceptance 1-4, 8, 9), with the real ssh client and a real sshd."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

from bastion import journal
from bastion.devtools.sshd_fixture import Sshd, SshdInfo
from tests.harness import Agent, Bastion, journal_frozen, make_bastion, policy_toml, wait_for


class Relay:
    """A loopback TCP relay in front of the target, which a test can sever."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.socks: list[socket.socket] = []
        self.severed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target, timeout=10)
            upstream.settimeout(None)
            self.socks += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass

    def sever(self) -> None:
        """Drop every connection at once, as a dead network would."""
        self.severed = True
        self.listener.close()
        for s in self.socks:
            try:
                s.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
                )
                s.close()
            except OSError:
                pass


def started(agent: Agent, marker: Path, command: str, **kw: object) -> int:
    """Start `command` and wait until it is running on the target."""
    rid = agent.start(f"touch {marker}; {command}", **kw)  # type: ignore[arg-type]
    return rid


def approve_and_wait_running(bastion: Bastion, marker: Path) -> None:
    bastion.approve_next()
    wait_for(marker.exists, timeout=20)


def state(bastion: Bastion, request_id: str) -> dict:
    return json.loads(bastion.cli("request", request_id, "--json").stdout)


def activity(bastion: Bastion) -> dict[str, dict]:
    rows = json.loads(bastion.cli("audit", "activity", "--json").stdout)
    return {r["request_id"]: r for r in rows}


def test_cut_network_is_status_unknown(bastion: Bastion, sshd: SshdInfo, tmp_path: Path) -> None:
    relay = Relay((sshd.address, sshd.port))
    bastion.write_policy(policy_toml(sshd, port=relay.port))
    agent = bastion.agent()
    marker = tmp_path / "running-cut"
    rid = started(agent, marker, "sleep 30")
    approve_and_wait_running(bastion, marker)
    relay.sever()
    r = agent.wait(rid, timeout=30)
    assert r.rc == 76 and r.code == "STATUS_UNKNOWN" and r.error["retryable"] is False
    request_id = r.error["request_id"]
    assert state(bastion, request_id)["state"] == "status_unknown"
    row = activity(bastion)[request_id]
    assert row["outcome"] == "unknown" and row["cause"] == "connection_lost"


def test_killed_target_session_is_status_unknown(
    bastion: Bastion, target: Sshd, tmp_path: Path
) -> None:
    assert target.info is not None
    bastion.write_policy(policy_toml(target.info))
    agent = bastion.agent()
    marker = tmp_path / "running-kill"
    rid = started(agent, marker, "sleep 30")
    approve_and_wait_running(bastion, marker)
    for pid in target.session_pids():
        os.kill(pid, signal.SIGKILL)
    r = agent.wait(rid, timeout=30)
    assert r.rc == 76 and r.code == "STATUS_UNKNOWN"
    assert state(bastion, r.error["request_id"])["state"] == "status_unknown"


def test_frozen_target_is_unknown_within_the_keepalive_window(
    tmp_path: Path, target: Sshd, client_key: tuple[Path, str]
) -> None:
    assert target.info is not None
    b = make_bastion(tmp_path, target.info, client_key[0], start=False)
    b.daemon_args = ("--approval-timeout", "20", "--keepalive", "1")
    b.start_daemon()
    b.unlock()
    try:
        agent = b.agent()
        marker = tmp_path / "running-freeze"
        rid = started(agent, marker, "sleep 60")
        approve_and_wait_running(b, marker)
        frozen = target.session_pids()
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        try:
            began = time.monotonic()
            r = agent.wait(rid, timeout=30)
            assert r.rc == 76 and r.code == "STATUS_UNKNOWN"
            assert time.monotonic() - began < 20  # 3 missed keepalives of 1 s, not the 60 s
        finally:
            for pid in frozen:
                with __import__("contextlib").suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
    finally:
        b.close()


def _open_request(bastion: Bastion) -> str:
    """The request id of the last request the journal shows as received."""
    rids = [
        r.meta["request_id"]
        for r in journal.records(bastion.home.journal)
        if r.type == "request_received"
    ]
    return rids[-1]


def test_gateway_killed_mid_command_is_unknown_after_restart(
    bastion: Bastion, tmp_path: Path
) -> None:
    agent = bastion.agent()
    marker = tmp_path / "running-sigkill"
    rid = started(agent, marker, "sleep 30")
    approve_and_wait_running(bastion, marker)
    assert bastion.daemon is not None
    bastion.kill_daemon()
    request_id = _open_request(bastion)
    assert state(bastion, request_id)["state"] == "status_unknown"  # its gateway is gone
    r = agent.wait(rid, timeout=30)
    assert r.rc == 255  # ssh lost its gateway; the outcome lives in the journal
    bastion.daemon = None
    bastion.start_daemon()
    s = state(bastion, request_id)
    assert s["state"] == "status_unknown" and s["cause"] == "gateway_restarted"
    bastion.unlock()
    assert activity(bastion)[request_id]["outcome"] == "unknown"


def test_request_answers_every_state(bastion: Bastion, sshd: SshdInfo) -> None:
    agent = bastion.agent()
    rid = agent.start("exit 3")
    bastion.approve_next()
    r = agent.wait(rid)
    assert r.rc == 3
    completed = _open_request(bastion)
    assert state(bastion, completed) == {
        "request_id": completed,
        "state": "completed",
        "exit_status": 3,
        "code": None,
    }
    denied = agent.run("true", host="nowhere")
    assert state(bastion, denied.error["request_id"])["state"] == "denied"
    assert state(bastion, denied.error["request_id"])["code"] == "UNKNOWN_HOST"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    bastion.write_policy(policy_toml(sshd, port=closed))
    rid = agent.start("true")
    bastion.approve_next()
    unreachable = agent.wait(rid)
    s = state(bastion, unreachable.error["request_id"])
    assert s["state"] == "retry_safe" and s["code"] == "UNREACHABLE"
    r = bastion.cli("request", "req_doesnotexist", check=False)
    assert r.returncode == 1 and "no request" in r.stderr


def test_kill_ends_a_command_and_records_it(bastion: Bastion, tmp_path: Path) -> None:
    agent = bastion.agent()
    marker = tmp_path / "running-killcmd"
    rid = started(agent, marker, "sleep 60")
    approve_and_wait_running(bastion, marker)
    request_id = _open_request(bastion)
    assert state(bastion, request_id)["state"] == "in_flight"
    bastion.cli("kill", request_id)
    r = agent.wait(rid, timeout=15)
    assert r.rc != 0
    row = activity(bastion)[request_id]
    assert row["outcome"] in ("signalled", "unknown"), row
    assert state(bastion, request_id)["state"] in ("completed", "status_unknown")


def test_lock_terminate_ends_every_command_in_flight(bastion: Bastion, tmp_path: Path) -> None:
    agent = bastion.agent()
    marks = [tmp_path / f"running-term-{i}" for i in range(2)]
    rids = [started(agent, marks[0], "sleep 60")]
    approve_and_wait_running(bastion, marks[0])
    rids.append(started(agent, marks[1], "sleep 60"))
    wait_for(marks[1].exists, timeout=20)
    out = bastion.cli("lock", "--terminate").stdout
    assert "ended 2 command(s)" in out
    for rid in rids:
        assert agent.wait(rid, timeout=15).rc != 0
    bastion.unlock()
    rows = activity(bastion)
    ended = [r for r in rows.values() if r["command"] and "sleep 60" in r["command"]]
    assert len(ended) == 2 and all(r["outcome"] in ("signalled", "unknown") for r in ended)


def test_an_action_with_an_unknown_outcome_waits_for_acknowledgement(
    bastion: Bastion, sshd: SshdInfo, tmp_path: Path
) -> None:
    relay = Relay((sshd.address, sshd.port))
    bastion.write_policy(policy_toml(sshd, port=relay.port))
    agent = bastion.agent()
    key = ("-o", "SetEnv=BASTION_ACTION_KEY=deploy-42")
    marker = tmp_path / "running-action"
    rid = started(agent, marker, "sleep 30", ssh_args=key)
    approve_and_wait_running(bastion, marker)
    relay.sever()
    assert agent.wait(rid, timeout=30).code == "STATUS_UNKNOWN"

    bastion.write_policy(policy_toml(sshd))  # the network is back
    r = agent.run("true", ssh_args=key)  # refused before any card is raised
    assert r.rc == 77 and r.code == "ACTION_OUTCOME_UNKNOWN"
    assert r.error["message"].count("req_") == 1
    rid = agent.start("true", ssh_args=("-o", "SetEnv=BASTION_ACTION_KEY=other"))
    bastion.approve_next()  # the policy entry changed: a new session card
    assert agent.wait(rid).rc == 0
    acked = ("-o", "SetEnv=BASTION_ACTION_KEY=deploy-42 BASTION_ACK_UNKNOWN=1")
    assert agent.run("echo again", ssh_args=acked).stdout == b"again\n"
    assert agent.run("true", ssh_args=key).rc == 0  # the last attempt completed


def test_an_agent_that_leaves_mid_command_still_gets_an_honest_record(
    bastion: Bastion, tmp_path: Path
) -> None:
    import psutil

    agent = bastion.agent()
    marker, done = tmp_path / "running-leave", tmp_path / "finished-after-leave"
    rid = started(agent, marker, f"sleep 2; echo finished > {done}; exit 5")
    approve_and_wait_running(bastion, marker)
    request_id = _open_request(bastion)
    ssh = [p for p in psutil.Process(agent.pid).children() if p.name() == "ssh"]
    assert len(ssh) == 1
    ssh[0].kill()  # the agent side goes away mid-command
    assert agent.wait(rid).rc == -9
    wait_for(lambda: state(bastion, request_id)["state"] == "completed", timeout=20)
    assert state(bastion, request_id)["exit_status"] == 5 and done.exists()


def test_no_intent_on_disk_means_nothing_is_sent(bastion: Bastion, tmp_path: Path) -> None:
    """With the journal unwritable nothing is sent: since issue 18 the request is
    refused at its first record (`request_received`), before the gate; the intent's own
    failure is `tests/unit/test_service.py::test_no_durable_intent_means_nothing_is_sent`."""
    agent = bastion.agent()
    rid = agent.start("true")
    bastion.approve_next()
    assert agent.wait(rid).rc == 0
    marker = tmp_path / "sent-without-intent"
    with journal_frozen(bastion.home):
        r = agent.run(f"touch {marker}")
    assert r.rc == 70 and r.code == "INTERNAL", r.stderr
    assert "could not write this request to its journal" in r.error["message"]
    assert not marker.exists()
    assert "could not journal the request" in bastion.log.read_text()
