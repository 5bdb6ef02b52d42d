"""`bastion mcp`'s own errors, in process (bastion/agent/mcp_front.py): whatever the SDK or
this server refuses or trips on reaches the model in the gateway's error shape, with
a code from the contract and the `retryable` that code has."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import pytest

from bastion.agent import mcp_front
from bastion.core.contract import Code


def call(front: mcp_front.Front, tool: str, **arguments: Any) -> dict[str, Any]:
    result = asyncio.run(mcp_front.build(front).call_tool(tool, arguments))
    assert result.is_error, result
    error = result.structured_content["error"]
    code = Code(error["code"])
    assert error["retryable"] is code.retryable and error["request_id"] is None, error
    return error


@pytest.fixture
def front(tmp_path: Path) -> mcp_front.Front:
    """A front whose gateway is not running: nothing here may need one."""
    return mcp_front.Front(tmp_path / "ssh_config", tmp_path / "no-gateway.sock")


@pytest.mark.parametrize(
    ("arguments", "field"),
    [
        ({"host": "web1"}, "command"),
        ({"host": "web1", "command": "true", "timeout_s": "-oProxyCommand=x"}, "timeout_s"),
        ({"host": "web1", "command": "true", "timeout_s": 0}, "timeout_s"),
        ({"host": "web1", "command": "true", "ack_unknown": "-o"}, "ack_unknown"),
        ({"host": ["web1"], "command": "true"}, "host"),
        ({"host": "-V", "command": "true"}, "host"),
        ({"host": "web1", "user": "-oUser=root", "command": "true"}, "user"),
    ],
)
def test_bad_arguments_are_unsupported_and_name_the_argument(
    front: mcp_front.Front, arguments: dict[str, Any], field: str
) -> None:
    error = call(front, "ssh_exec", **arguments)
    assert error["code"] == "UNSUPPORTED_REQUEST" and f"`{field}`" in error["message"], error
    assert error["message"].endswith("Nothing was sent to the target."), error


def test_an_unknown_tool_is_unsupported_and_names_the_tools(front: mcp_front.Front) -> None:
    error = call(front, "ssh_exec_locally", command="id")
    assert error["code"] == "UNSUPPORTED_REQUEST", error
    assert "request_status, sftp_get, sftp_put, ssh_exec, ssh_hosts" in error["message"], error


def test_a_crash_is_internal_and_says_what_to_do(
    front: mcp_front.Front, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_: object, **__: object) -> dict[str, Any]:
        raise RuntimeError("a bug")

    monkeypatch.setattr(mcp_front.Front, "ask", broken)
    error = call(front, "ssh_hosts")
    assert error["code"] == "INTERNAL" and "a bug" not in error["message"], error
    assert "failed on this ssh_hosts call" in error["message"], error


def test_a_gateway_that_is_not_running_or_talks_nonsense_is_internal(
    front: mcp_front.Front, tmp_path: Path
) -> None:
    error = call(front, "ssh_hosts")
    assert error["code"] == "INTERNAL" and "not running" in error["message"], error
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(front.agent_socket))
        server.listen(1)

        async def nonsense() -> None:
            loop = asyncio.get_running_loop()
            conn, _ = await loop.sock_accept(server)
            with conn:
                await loop.sock_recv(conn, 4096)
                await loop.sock_sendall(conn, b"OK not json\n")

        async def both() -> Any:
            server.setblocking(False)
            served = asyncio.create_task(nonsense())
            result = await mcp_front.build(front).call_tool("ssh_hosts", {})
            await served
            return result

        result = asyncio.run(both())
    error = result.structured_content["error"]
    assert error["code"] == "INTERNAL" and "not a JSON object" in error["message"], error


class Answers:
    """A front whose gateway answers every `request` question with `state`."""

    def __init__(self, state: dict[str, Any] | None) -> None:
        self.state = state

    def ask(self, query: str, **fields: str) -> dict[str, Any]:
        if self.state is None:
            raise mcp_front.AgentError("no gateway")
        return self.state


def timed_out(state: dict[str, Any] | None) -> dict[str, Any]:
    from bastion.agent.client import Command, Kept, Ran

    empty = Kept(b"", b"", 0)
    ran = Ran(empty, empty, None, None, True, "k1")
    cmd = Command("web1", "sleep 9", timeout_s=2)
    result = asyncio.run(mcp_front.timed_out(Answers(state), cmd, ran))  # type: ignore[arg-type]
    assert result.is_error, result
    return result.structured_content["error"]


WHERE = "`timeout_s` (2 s) ran out and bastion's MCP server ended the ssh call."


def test_a_call_that_timed_out_waiting_keeps_the_journals_code_or_is_approval_timeout() -> None:
    busy = timed_out({"state": "retry_safe", "code": "GATEWAY_BUSY", "request_id": "req_1"})
    assert busy == {
        "code": "GATEWAY_BUSY",
        "message": f"{WHERE} The command was not sent (it was still waiting for an approval or "
        "a free slot); the same call may be repeated, with a longer timeout_s if needed.",
        "request_id": "req_1",
        "retryable": True,
    }
    waiting = timed_out({"state": "denied", "request_id": "req_2"})
    assert (waiting["code"], waiting["retryable"]) == ("APPROVAL_TIMEOUT", False)


def test_a_call_that_timed_out_while_the_gateway_holds_it_is_status_unknown() -> None:
    """Said the same since issue 12; its code now chosen in core/refusals.py."""
    held = timed_out(None)
    assert held == {
        "code": "STATUS_UNKNOWN",
        "message": f"{WHERE} bastion still holds the command (running on the target, or "
        "waiting for an approval) and records how it ends: call request_status with this "
        "request_id for its outcome, and do not repeat it before then. bastion did not name "
        "the request in time.",
        "request_id": None,
        "retryable": False,
    }
