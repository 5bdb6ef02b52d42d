"""`bastion mcp` (issue 12, acceptance 1-3): a real MCP client process from the
official SDK starts `bastion mcp` as its child; commands go through the stock
ssh client, the real gateway and a real sshd; the test is the operator.
"""

from __future__ import annotations

import base64
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from bastion.devtools.sshd_fixture import Sshd, SshdInfo
from tests.harness import USER, Bastion, make_bastion, policy_toml, wait_for
from tests.mcp_client_helper import McpClient, error_of

TOOLS = {"ssh_exec", "ssh_hosts", "request_status", "sftp_get", "sftp_put"}


def state(b: Bastion, request_id: str) -> dict[str, Any]:
    return json.loads(b.cli("request", request_id, "--json").stdout)


def test_tools_run_exactly_and_the_client_is_the_subject(bastion: Bastion) -> None:
    client = McpClient(bastion)
    assert set(client.wait(client.start("list_tools"))["tools"]) == TOOLS
    rid = client.start(
        "call",
        name="ssh_exec",
        arguments={"host": "web1", "command": "printf 'caf\\303\\251\\n'; echo oops >&2; exit 3"},
    )
    card = bastion.next_card()
    # The agent program is the subject, not the MCP server between it and ssh.
    assert card["subject"]["pid"] == client.pid != client.server_pid
    bastion.answer(card, True)
    r = client.wait(rid)
    assert not r["is_error"], r
    s = r["structured"]
    assert (s["stdout"], s["stderr"], s["exit_status"]) == ("café\n", "oops\n", 3)
    assert s["stdout_truncated"] is False and s["stdout_bytes"] == len("café\n".encode())
    assert state(bastion, s["request_id"]) == {
        "request_id": s["request_id"],
        "state": "completed",
        "exit_status": 3,
        "code": None,
    }
    # Bytes that are not UTF-8 come back exact, in base64; stdin goes in.
    r = client.call("ssh_exec", host="web1", command="cat; printf '\\377\\000\\001'", stdin="in\n")
    s = r["structured"]
    assert s["stdout"] is None and base64.b64decode(s["stdout_base64"]) == b"in\n\xff\x00\x01"
    # A remote command's own exit 255 is its result, not "ssh failed, nothing sent".
    r = client.call("ssh_exec", host="web1", command="exit 255")
    assert not r["is_error"] and r["structured"]["exit_status"] == 255, r
    assert r["structured"]["request_id"].startswith("req_")
    # request_status answers what `bastion request` answers.
    r = client.call("request_status", request_id=s["request_id"])
    assert r["structured"] == state(bastion, s["request_id"])


def test_locked_vault_is_the_error_object_at_once(bastion: Bastion) -> None:
    client = McpClient(bastion)
    bastion.cli("lock")
    err = error_of(client.call("ssh_exec", host="web1", command="true"))
    assert err["code"] == "VAULT_LOCKED" and err["retryable"] is False
    assert err["request_id"].startswith("req_")
    assert bastion.op("pending") == []  # nothing was queued for the operator


def test_per_command_cards(bastion: Bastion, sshd: SshdInfo) -> None:
    bastion.write_policy(policy_toml(sshd, approval="per-command"))
    client = McpClient(bastion)
    rid = client.start("call", name="ssh_exec", arguments={"host": "web1", "command": "echo one"})
    kinds = []
    for _ in range(2):  # the session card, then this command's card
        card = bastion.next_card()
        kinds.append(card["kind"])
        bastion.answer(card, True)
    assert client.wait(rid)["structured"]["stdout"] == "one\n"
    rid = client.start("call", name="ssh_exec", arguments={"host": "web1", "command": "echo two"})
    card = bastion.next_card()
    assert "echo two" in json.dumps(card)
    bastion.answer(card, False)
    err = error_of(client.wait(rid))
    assert err["code"] == "CALL_DENIED", err
    assert kinds[0] != kinds[1]


def test_cut_off_is_status_unknown_and_request_status_resolves_it(
    tmp_path: Path, target: Sshd, client_key: tuple[Path, str]
) -> None:
    assert target.info is not None
    b = make_bastion(tmp_path / "b", target.info, client_key[0])
    try:
        client = McpClient(b)
        marker = tmp_path / "running"
        rid = client.start(
            "call",
            name="ssh_exec",
            arguments={"host": "web1", "command": f"touch {marker}; sleep 60"},
        )
        b.approve_next()
        wait_for(marker.exists, timeout=20)
        for pid in target.session_pids():
            os.kill(pid, signal.SIGKILL)
        err = error_of(client.wait(rid))
        assert err["code"] == "STATUS_UNKNOWN" and err["retryable"] is False
        r = client.call("request_status", request_id=err["request_id"])
        assert r["structured"]["state"] == "status_unknown"
        # The MCP call's own timeout: the call stops waiting, the gateway keeps the command
        # running to its end, and request_status tells how it ended.
        marker2 = tmp_path / "running2"
        command = f"touch {marker2}; sleep 8; exit 5"
        rid = client.start(
            "call", name="ssh_exec", arguments={"host": "web1", "command": command, "timeout_s": 2}
        )
        err = error_of(client.wait(rid))
        assert marker2.exists()
        assert err["code"] == "STATUS_UNKNOWN" and err["request_id"].startswith("req_"), err

        def ended() -> dict[str, Any]:
            return client.call("request_status", request_id=err["request_id"])["structured"]

        assert ended()["state"] == "in_flight"
        wait_for(lambda: ended()["state"] != "in_flight", timeout=30)
        assert ended() | {"request_id": None} == {
            "request_id": None,
            "state": "completed",
            "exit_status": 5,
            "code": None,
        }
    finally:
        b.close()


def test_two_clients_are_two_subjects_and_a_killed_client_ends_its_approval(
    bastion: Bastion,
) -> None:
    first, second = McpClient(bastion), McpClient(bastion)
    for client in (first, second):
        rid = client.start("call", name="ssh_exec", arguments={"host": "web1", "command": "true"})
        card = bastion.next_card()
        assert card["subject"]["pid"] == client.pid
        bastion.answer(card, True)
        assert client.wait(rid)["structured"]["exit_status"] == 0
    assert len(bastion.op("sessions")) == 2
    first.proc.kill()
    first.proc.wait(10)
    wait_for(lambda: len(bastion.op("sessions")) == 1, timeout=20)
    third = McpClient(bastion)
    rid = third.start("call", name="ssh_exec", arguments={"host": "web1", "command": "true"})
    card = bastion.next_card()
    # Another process of the same program: not told that the killed one's approval ended.
    assert card["subject"]["pid"] == third.pid and card["reason"] is None, card
    bastion.answer(card, True)
    assert third.wait(rid)["structured"]["exit_status"] == 0


def test_ssh_hosts_shows_only_what_the_policy_lets_it_reach(
    bastion: Bastion, sshd: SshdInfo
) -> None:
    policy = policy_toml(sshd, approval="per-command", allow=["uptime", "df -h"])
    policy += policy_toml(sshd, alias="db1").replace(f'user = "{USER}"', 'user = "ro"')
    bastion.write_policy(policy)
    r = McpClient(bastion).call("ssh_hosts")
    assert not r["is_error"], r
    hosts = r["structured"]["hosts"]
    assert [h["host"] for h in hosts] == ["db1", "web1"]
    web1 = hosts[1]["accounts"][0]
    assert web1["approval"] == "per-command" and web1["allow"] == ["uptime", "df -h"]
    assert hosts[0]["accounts"][0]["user"] == "ro" and hosts[0]["accounts"][0]["allow"] is None
    shown = json.dumps(r)
    for secret in (sshd.address, str(sshd.port), sshd.host_key.split()[1], "deploy-key"):
        assert secret not in shown


def test_output_is_bounded_and_progress_is_reported(bastion: Bastion) -> None:
    client = McpClient(bastion, "--max-output", "1024")
    command = "head -c 10000 /dev/zero | tr '\\0' x; for i in 1 2 3; do sleep 1; echo >&2 $i; done"
    rid = client.start("call", name="ssh_exec", arguments={"host": "web1", "command": command})
    bastion.approve_next()
    r = client.wait(rid)
    s = r["structured"]
    assert s["stdout_bytes"] == 10000 and s["stdout_truncated"] is True
    assert s["stdout"].startswith("x" * 512) and s["stdout"].endswith("x" * 512)
    assert "bytes not kept" in s["stdout"] and s["stderr"] == "1\n2\n3\n"
    assert r["progress"], "a 3-second command reported no progress"


def test_the_agent_socket_answers_only_the_questions_it_knows(bastion: Bastion) -> None:
    """The doors `bastion mcp` uses are the agent socket's: a malformed or unknown
    question is refused with one line, and a front can register only itself."""
    from bastion.agent import client

    sock = bastion.home.agent_socket
    with pytest.raises(client.Declined, match="malformed query"):
        client.ask(sock, {"query": "keys"})
    with pytest.raises(client.Declined, match="no request req_nope"):
        client.ask(sock, {"query": "request", "request_id": "req_nope"})
    with pytest.raises(client.Declined, match="malformed registration"):
        client._converse(sock, {"register": "subject"}, 4096)
    assert client.ask(sock, {"query": "hosts"})["hosts"][0]["host"] == "web1"


def test_a_policy_broken_when_the_client_starts_stops_nothing_for_long(
    bastion: Bastion, sshd: SshdInfo
) -> None:
    """The server starts whatever the policy's state (it asks the gateway for each
    host's account per call, not once), says POLICY_UNAVAILABLE while the policy is
    broken, and runs commands once it is fixed -- no restart of the MCP client."""
    good = policy_toml(sshd)
    bastion.write_policy("[hosts.web1]\naddres = 'typo'\n")
    client = McpClient(bastion)
    err = error_of(client.call("ssh_hosts"))
    assert err["code"] == "POLICY_UNAVAILABLE", err
    err = error_of(client.call("ssh_exec", host="web1", command="true"))
    assert err["code"] == "POLICY_UNAVAILABLE", err
    bastion.write_policy(good)
    rid = client.start("call", name="ssh_exec", arguments={"host": "web1", "command": "id -un"})
    bastion.approve_next()
    assert client.wait(rid)["structured"]["stdout"] == f"{USER}\n"
    # A host with two accounts: the call must name one.
    second = '\n[[hosts.web1.accounts]]\nuser = "other"\ncredential = "deploy-key"\n'
    bastion.write_policy(good + second)
    r = client.call("ssh_exec", host="web1", command="true")
    assert "several accounts" in error_of(r)["message"] and "other" in error_of(r)["message"]
