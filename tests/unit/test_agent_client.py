"""The pure parts of `bastion mcp`'s runner (bastion/client.py): what is kept of
a stream, how bytes come back, what is refused before ssh starts and why, how the
stock ssh parses the argv, and which stderr line is the gateway's."""

from __future__ import annotations

import base64
import json
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bastion.agent import client
from bastion.agent.client import (
    Busy,
    Command,
    Keeper,
    Unsupported,
    gateway_error,
    socket_of,
    ssh_argv,
)
from bastion.core.contract import Code


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
    ("field", "value", "says"),
    [
        ("host", "-oProxyCommand=evil", "read as an option"),
        ("host", "--", "read as an option"),
        ("host", "web1 extra", "is not a host alias"),
        ("host", "web1\n", "is not a host alias"),
        ("user", "-l", "read as an option"),
        ("user", "a@b", "is not an account"),
        ("action_key", "-F/tmp/evil", "is not an action key"),
        ("action_key", "has space", "is not an action key"),
        ("action_key", 'q"uote', "is not an action key"),
        ("command", "  ", "is empty"),
        ("command", "a\0b", "NUL"),
        ("timeout_s", 0, "more than 0"),
        ("timeout_s", 86401, "at most 86400"),
    ],
)
def test_refused_before_ssh_starts_saying_why(field: str, value: object, says: str) -> None:
    fields: dict[str, object] = {"host": "web1", "command": "true", field: value}
    with pytest.raises(Unsupported) as refused:
        Command(**fields).checked()  # type: ignore[arg-type]
    message = str(refused.value)
    assert f"`{field}`" in message and says in message, message
    assert message.endswith("Nothing was sent to the target."), message
    assert refused.value.code is Code.UNSUPPORTED_REQUEST


def test_a_refused_value_is_quoted_back_bounded() -> None:
    with pytest.raises(Unsupported) as refused:
        Command("-" + "x" * 10_000, "true").checked()
    assert len(str(refused.value)) < 400


def test_argv_ends_the_options_before_the_destination() -> None:
    cmd = Command("web1", "-rf x; id", user="deploy", ack_unknown=True)
    argv = ssh_argv(Path("/c"), cmd, "k1")
    assert argv == [
        "ssh", "-F", "/c", "-T", "-o",
        "SetEnv=BASTION_ACTION_KEY=k1 BASTION_ACK_UNKNOWN=1 BASTION_WAIT_LINE=0",
        "-l", "deploy", "--", "web1", "-rf x; id",
    ]  # fmt: skip


@pytest.mark.skipif(shutil.which("ssh") is None, reason="needs the OpenSSH client")
@pytest.mark.parametrize(
    "command", ["-oProxyCommand=touch /tmp/x", "-F/tmp/evil", "-l root", "-oUser=root"]
)
def test_the_stock_ssh_reads_an_option_shaped_command_as_the_command(
    tmp_path: Path, command: str
) -> None:
    """`ssh -G` prints the options ssh parsed, connecting nowhere. With the argv the
    MCP door builds, an option-shaped command changes none of them; with the old argv
    (no `--`), ssh took it as its own option."""
    config = tmp_path / "ssh_config"
    config.write_text("Host *\n    ProxyCommand /bin/true %h\n    User deploy\n")

    def parsed(argv: list[str]) -> str:
        r = subprocess.run(["ssh", "-G", *argv[1:]], capture_output=True, text=True, timeout=30)
        return r.stdout + r.stderr

    argv = ssh_argv(config, Command("web1", command), "k1")
    new = parsed(argv)
    assert "proxycommand /bin/true %h" in new and "\nuser deploy\n" in new, new
    old = parsed([a for a in argv if a != "--"])
    assert "proxycommand /bin/true %h" not in old or "\nuser deploy\n" not in old, old


def test_a_gateway_that_does_not_answer_is_busy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wedged gateway (it takes the connection, never answers; or its queue is
    full): GATEWAY_BUSY, nothing was sent, retry -- not an INTERNAL fault."""
    monkeypatch.setattr(client, "ASK_TIMEOUT", 0.3)
    path = tmp_path / "agent.sock"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(path))
        server.listen(0)
        for _ in range(2):  # silent, then a full queue (the first call's connection waits)
            with pytest.raises(Busy) as busy:
                client.ask(path, {"query": "hosts"})
            assert busy.value.code is Code.GATEWAY_BUSY and busy.value.code.retryable
            assert "did not answer within 0.3 s" in str(busy.value)
            assert "Nothing was sent" in str(busy.value) and "retry" in str(busy.value).lower()


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
