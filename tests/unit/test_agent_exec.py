"""The pure parts of `bastion mcp`'s runner (bastion/agent_exec.py): what is kept of
a stream, how bytes come back, what is refused before ssh starts, and which stderr
line is the gateway's."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bastion.agent_exec import AgentError, Command, Keeper, gateway_error, socket_of, ssh_argv


@given(st.lists(st.binary(max_size=300), max_size=20), st.integers(2, 64))
def test_keeper_keeps_the_start_and_the_end_and_counts_everything(
    chunks: list[bytes], limit: int
) -> None:
    k = Keeper(limit)
    for c in chunks:
        k.add(c)
    whole = b"".join(chunks)
    kept = k.kept()
    assert kept.total == len(whole)
    half = limit // 2
    if len(whole) <= 2 * half:
        assert not kept.truncated and kept.data == whole
    else:
        assert kept.truncated
        assert kept.head == whole[:half] and kept.tail == whole[-half:]
        assert f"[... {len(whole) - 2 * half} bytes not kept ...]".encode() in kept.data


def test_text_when_utf8_else_exact_base64() -> None:
    k = Keeper(100)
    k.add("café\n".encode())
    assert k.kept().as_json("stdout") == {
        "stdout": "café\n",
        "stdout_bytes": 6,
        "stdout_truncated": False,
    }
    k = Keeper(100)
    k.add(b"\xff\x00ok")
    doc = k.kept().as_json("stderr")
    assert doc["stderr"] is None and base64.b64decode(doc["stderr_base64"]) == b"\xff\x00ok"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("host", "-oProxyCommand=evil"),
        ("host", "web1 extra"),
        ("user", "-l"),
        ("user", "a@b"),
        ("action_key", "has space"),
        ("action_key", 'q"uote'),
        ("command", "  "),
        ("command", "a\0b"),
        ("timeout_s", 0),
        ("timeout_s", 86401),
    ],
)
def test_refused_before_ssh_starts(field: str, value: object) -> None:
    fields: dict[str, object] = {"host": "web1", "command": "true", field: value}
    with pytest.raises(AgentError):
        Command(**fields).checked()  # type: ignore[arg-type]


def test_argv_puts_the_command_last_and_env_in_one_setenv() -> None:
    cmd = Command("web1", "-rf x; id", user="deploy", ack_unknown=True)
    argv = ssh_argv(Path("/c"), cmd, "k1")
    assert argv == [
        "ssh", "-F", "/c", "-o", "SetEnv=BASTION_ACTION_KEY=k1 BASTION_ACK_UNKNOWN=1",
        "-l", "deploy", "web1", "-rf x; id",
    ]  # fmt: skip


def test_the_gateway_error_is_the_last_json_line_when_the_exit_says_so() -> None:
    line = json.dumps({"ok": False, "error": {"code": "VAULT_LOCKED", "request_id": "req_1"}})
    stderr = f"remote noise\n{line}\n".encode()
    assert gateway_error(stderr, 77) == {"code": "VAULT_LOCKED", "request_id": "req_1"}
    assert gateway_error(stderr, 1) is None  # a remote exit status: its stderr is its own
    assert gateway_error(b"ssh: connect failed\n", 255) is None
    proxy = json.dumps({"ok": False, "error": {"code": "INTERNAL"}})
    assert gateway_error(f"{proxy}\nkex_exchange_identification: closed\n".encode(), 255) == {
        "code": "INTERNAL"
    }


def test_the_socket_comes_from_the_configs_proxycommand(tmp_path: Path) -> None:
    config = tmp_path / "c"
    config.write_text(
        "Host *\n    ProxyCommand /usr/bin/python3 -I -S '/opt/b/proxy.py' --socket "
        "'/run/b/agent.sock' %h %p %r\n"
    )
    assert socket_of(config) == Path("/run/b/agent.sock")
    config.write_text("Host *\n    User x\n")
    assert socket_of(config) is None
