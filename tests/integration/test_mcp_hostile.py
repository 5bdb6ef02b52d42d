"""Issue 18, the MCP door: nothing a model sends to a `bastion mcp` tool becomes an
ssh option or a local command.

OpenSSH's ssh reads options again after the destination unless `--` ended them
(ssh.c, `opt_terminated`), so `ssh -F CFG web1 -oProxyCommand=CMD` runs CMD on this
machine, as the MCP server's user, before any gateway, card or journal sees it. A
real MCP client (the official SDK) drives the real server against a real gateway and
sshd; every option-shaped value is one that would make a local marker appear.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bastion.agent import client as agent_client
from bastion.devtools.sshd_fixture import SshdInfo
from tests.harness import Bastion, policy_toml
from tests.mcp_client_helper import McpClient, error_of

# {marker}: a file only a local command would create; {evil}: an ssh_config whose
# ProxyCommand creates it.
OPTION_SHAPED = (
    "-oProxyCommand=touch {marker}",
    "-oProxyCommand=touch {marker} and more words",
    "-oProxyCommand=touch {marker}\n-V",
    "-oSetEnv=X=-oProxyCommand=touch {marker}",
    "-F{evil}",
    "-F {evil}",
    "--",
    "-l",
    "-V",
)


@dataclass(frozen=True)
class Traps:
    marker: Path
    evil: Path

    def values(self) -> list[str]:
        return [v.format(marker=self.marker, evil=self.evil) for v in OPTION_SHAPED]

    def sprung(self) -> bool:
        return self.marker.exists()


@pytest.fixture
def traps(tmp_path: Path) -> Traps:
    marker = tmp_path / "local-command-ran"
    evil = tmp_path / "evil_ssh_config"
    evil.write_text(f"Host *\n    ProxyCommand touch {marker}\n")
    return Traps(marker, evil)


def stock_ssh(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ssh", *argv],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SHELL": "/bin/sh"},
    )


def approving(b: Bastion, client: McpClient, rid: int, timeout: float = 60) -> list[dict[str, Any]]:
    """Approve every card until the call `rid` is answered; the cards, in order."""
    cards: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    while not client.finished(rid):
        assert time.monotonic() < deadline, "the call was not answered in time"
        for card in b.op("pending", wait=0.5):
            cards.append(card)
            b.answer(card, True)
    return cards


def test_the_old_argv_ran_option_shaped_commands_locally(bastion: Bastion, traps: Traps) -> None:
    """The positive control: the argv `bastion mcp` built before issue 18 (options,
    destination, command, no `--`) makes the stock ssh read the command as options."""
    setenv = "SetEnv=BASTION_ACTION_KEY=control"
    for value in (f"-oProxyCommand=touch {traps.marker}", f"-F{traps.evil}"):
        traps.marker.unlink(missing_ok=True)
        stock_ssh("-F", str(bastion.config), "-o", setenv, "web1", value)
        assert traps.sprung(), f"{value!r} ran no local command with the old argv"
    r = stock_ssh("-F", str(bastion.config), "-o", setenv, "web1", "-V")
    assert r.returncode == 0 and r.stderr.startswith("OpenSSH"), r  # ssh's own version
    assert bastion.op("pending") == []  # the gateway never heard of any of it


def test_option_shaped_host_or_user_is_refused_and_says_why(bastion: Bastion, traps: Traps) -> None:
    client = McpClient(bastion)
    for field in ("host", "user"):
        for value in traps.values():
            r = client.call("ssh_exec", **{"host": "web1", "command": "true", field: value})
            err = error_of(r)
            assert err["code"] == "UNSUPPORTED_REQUEST" and err["retryable"] is False, err
            assert err["request_id"] is None, err
            # Why, and what to send instead.
            assert f"`{field}`" in err["message"] and "option" in err["message"], err
            assert "ssh_hosts" in err["message"] and "option" in r["text"], err
        for value in ("web1 -oProxyCommand=x", "web1\n-V", "me@web1", ""):
            err = error_of(
                client.call("ssh_exec", **{"host": "web1", "command": "true", field: value})
            )
            assert err["code"] == "UNSUPPORTED_REQUEST" and "ssh_hosts" in err["message"], err
    assert not traps.sprung()
    assert bastion.op("pending") == []  # refused before ssh started: no card


def test_option_shaped_commands_reach_the_target_as_the_command(
    bastion: Bastion, sshd: SshdInfo, traps: Traps
) -> None:
    """Each value is the command the operator approves, the journal records and the
    target's shell runs (which reads most of them as its own bad options)."""
    bastion.write_policy(policy_toml(sshd, approval="per-command"))
    client = McpClient(bastion)
    for value in traps.values():
        rid = client.start("call", name="ssh_exec", arguments={"host": "web1", "command": value})
        cards = approving(bastion, client, rid)
        r = client.wait(rid)
        assert not r["is_error"], (value, r)
        s = r["structured"]
        shown = [c["command"] for c in cards if c["kind"] == "command"]
        assert len(shown) == 1 and shown[0].startswith(value.split("\n")[0]), (value, shown)
        request = bastion.cli("request", s["request_id"], "--json").stdout
        assert '"state": "completed"' in request, request
        output = (s["stdout"] or "") + (s["stderr"] or "")
        assert "OpenSSH" not in output, (value, output)  # not the local ssh's -V
        if value == "-V":
            assert "-V" in s["stderr"] and s["exit_status"] != 0, s  # the target's shell's
    assert not traps.sprung()


def test_no_other_argument_becomes_an_option(bastion: Bastion, traps: Traps) -> None:
    client = McpClient(bastion)
    option = f"-oProxyCommand=touch {traps.marker}"
    # stdin is the remote command's stdin, byte for byte.
    text = f"{option}\n~C\n~.\n-F{traps.evil}\n"
    rid = client.start(
        "call", name="ssh_exec", arguments={"host": "web1", "command": "cat", "stdin": text}
    )
    bastion.approve_next()
    assert client.wait(rid)["structured"]["stdout"] == text
    # A "-" inside the SetEnv value stays inside it: the key is the gateway's action key.
    key = f"k-oProxyCommand=touch{traps.marker}"
    r = client.call("ssh_exec", host="web1", command="echo ran", action_key=key)
    assert r["structured"]["stdout"] == "ran\n", r
    assert r["structured"]["request_id"]  # the front found its request by that very key
    # ... which belongs to the process that sent it: another one learns nothing by it.
    with pytest.raises(agent_client.Declined, match="no request with that action key"):
        agent_client.ask(bastion.home.agent_socket, {"query": "request", "action_key": key})
    # Refused before ssh starts, saying which argument: option-shaped action keys and
    # values of the wrong type.
    wrong: list[dict[str, Any]] = [{"action_key": v} for v in traps.values()]
    wrong += [{"timeout_s": option}, {"timeout_s": "-1"}, {"ack_unknown": option}]
    for args in wrong:
        err = error_of(client.call("ssh_exec", host="web1", command="true", **args))
        assert err["code"] == "UNSUPPORTED_REQUEST" and err["retryable"] is False, (args, err)
        assert next(iter(args)) in err["message"], (args, err)
    for value in traps.values():
        err = error_of(client.call("request_status", request_id=value))
        assert err["code"] == "UNSUPPORTED_REQUEST" and "request_id" in err["message"], err
    # ssh_hosts takes no arguments: ones sent anyway change nothing.
    r = client.call("ssh_hosts", host=option, user=option)
    assert not r["is_error"] and r["structured"]["hosts"][0]["host"] == "web1", r
    assert not traps.sprung()
