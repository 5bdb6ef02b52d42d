"""`bastion mcp`'s own errors, in process (bastion/mcp_front.py): whatever the SDK or
this server refuses or trips on reaches the model in the gateway's error shape, with
a code from the contract and the `retryable` that code has."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import pytest

from bastion import mcp_front
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
    assert "request_status, ssh_exec, ssh_hosts" in error["message"], error


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
