"""`bastion mcp`'s file tools in process (bastion/agent/sftp_wire.py): every hostile
argument is refused before any process starts, naming the argument; ssh's argv never
holds a path; and the SFTP v3 client moves exact bytes (against OpenSSH's own
sftp-server, spoken to directly: no gateway here)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import shutil
import stat
from pathlib import Path
from typing import Any

import pytest

from bastion.agent import client, mcp_front, sftp_wire
from bastion.agent.sftp_wire import Get, Put
from bastion.core import defaults, files

SFTP_SERVER = next(
    (p for p in ("/usr/lib/openssh/sftp-server", "/usr/lib/sftp-server") if os.path.exists(p)),
    None,
)

HOSTILE_PATHS = [
    "!touch /tmp/M",
    "!",
    "-oProxyCommand=touch /tmp/M",
    "-F/tmp/evil",
    "--",
    "/srv/x\n!touch /tmp/M",
    "/srv/x\r\n!touch /tmp/M",
    "/srv/x\0!touch /tmp/M",
    "/srv/\x1b[2Jx",
    "/srv/x\x7f",
    "/srv/x\x85",  # C1 NEL: a newline to some readers
    "relative/path",
    "~/file",
    "./file",
    " /srv/leading-space",
    "",
    "/\ud800",  # a lone surrogate: no UTF-8 for it
    "/" + "a" * 4096,
]


@pytest.fixture
def front(tmp_path: Path) -> mcp_front.Front:
    """A front whose gateway is not running: nothing here may need one."""
    return mcp_front.Front(tmp_path / "ssh_config", tmp_path / "no-gateway.sock")


@pytest.fixture
def no_process(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """Every process a call starts, recorded and never run."""
    started: list[tuple[Any, ...]] = []

    async def record(*argv: Any, **_: Any) -> Any:
        started.append(argv)
        raise AssertionError(f"a process was started: {argv}")

    monkeypatch.setattr(asyncio, "create_subprocess_exec", record)
    return started


def call(front: mcp_front.Front, tool: str, **arguments: Any) -> Any:
    return asyncio.run(mcp_front.build(front).call_tool(tool, arguments))


def refusal(front: mcp_front.Front, tool: str, **arguments: Any) -> dict[str, Any]:
    result = call(front, tool, **arguments)
    assert result.is_error, result
    error: dict[str, Any] = result.structured_content["error"]
    assert error["code"] == "UNSUPPORTED_REQUEST" and error["retryable"] is False, error
    assert error["message"].endswith("Nothing was sent to the target."), error
    return error


@pytest.mark.parametrize("path", HOSTILE_PATHS)
@pytest.mark.parametrize("tool", ["sftp_put", "sftp_get"])
def test_every_hostile_path_is_refused_before_anything_starts(
    front: mcp_front.Front, no_process: list[Any], tool: str, path: str
) -> None:
    extra = {"content": "x"} if tool == "sftp_put" else {}
    error = refusal(front, tool, host="web1", user="deploy", path=path, **extra)
    assert "`path`" in error["message"], error
    assert no_process == []


@pytest.mark.parametrize(
    ("arguments", "field"),
    [
        ({"host": "-oProxyCommand=touch M"}, "host"),
        ({"host": "web1 -V"}, "host"),
        ({"user": "-lroot"}, "user"),
        ({"content": None}, "content"),
        ({"content_base64": "aGk="}, "content"),  # both at once
        ({"content": None, "content_base64": "not base64!"}, "content_base64"),
        ({"mode": "rwxr-xr-x"}, "mode"),
        ({"mode": "-o"}, "mode"),
        ({"mode": "77777"}, "mode"),
        ({"mode": "8"}, "mode"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"timeout_s": "-oProxyCommand=x"}, "timeout_s"),
    ],
)
def test_other_bad_put_arguments_name_themselves(
    front: mcp_front.Front, no_process: list[Any], arguments: dict[str, Any], field: str
) -> None:
    args = {"host": "web1", "user": "deploy", "path": "/srv/f", "content": "x", **arguments}
    args = {k: v for k, v in args.items() if v is not None}
    error = refusal(front, "sftp_put", **args)
    assert f"`{field}`" in error["message"], error
    assert no_process == []


@pytest.mark.parametrize(
    ("arguments", "field"),
    [
        ({"max_bytes": 0}, "max_bytes"),
        ({"max_bytes": sftp_wire.MAX_FILE_BYTES + 1}, "max_bytes"),
        ({"max_bytes": "-1"}, "max_bytes"),
        ({"user": "-oUser=root"}, "user"),
    ],
)
def test_bad_get_arguments_name_themselves(
    front: mcp_front.Front, no_process: list[Any], arguments: dict[str, Any], field: str
) -> None:
    args = {"host": "web1", "user": "deploy", "path": "/srv/f", **arguments}
    error = refusal(front, "sftp_get", **args)
    assert f"`{field}`" in error["message"], error
    assert no_process == []


def test_content_past_the_file_card_bound_is_refused(no_process: list[Any]) -> None:
    assert sftp_wire.MAX_FILE_BYTES == defaults.MAX_FILE_CARD_BYTES
    assert sftp_wire.MAX_PATH_BYTES == files.MAX_PATH
    big = base64.b64encode(bytes(sftp_wire.MAX_FILE_BYTES + 1)).decode()
    with pytest.raises(client.Unsupported, match="file card"):
        Put.of("web1", "/srv/f", None, big)
    exact = Put("web1", "/srv/f", bytes(sftp_wire.MAX_FILE_BYTES)).checked()
    assert len(exact.data) == sftp_wire.MAX_FILE_BYTES


def test_ssh_argv_is_fixed_and_holds_no_path(tmp_path: Path) -> None:
    """The host alias and account are checked names; the subsystem name is literal;
    `--` ends ssh's options before the destination."""
    argv = client.sftp_argv(tmp_path / "cfg", "web1", "deploy")
    assert argv == [
        "ssh",
        "-F",
        str(tmp_path / "cfg"),
        "-T",
        "-o",
        "SetEnv=BASTION_WAIT_LINE=0",
        "-l",
        "deploy",
        "-s",
        "--",
        "web1",
        "sftp",
    ]


def test_absolute_paths_with_shell_and_batch_syntax_stay_out_of_the_argv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A valid absolute path, however shaped, is only the SFTP packet's string."""
    started: list[tuple[Any, ...]] = []

    async def record(*argv: Any, **_: Any) -> Any:
        started.append(argv)
        raise OSError("not started")

    monkeypatch.setattr(asyncio, "create_subprocess_exec", record)
    for path in ("/srv/!touch M", "/srv/-oProxyCommand=x", "/srv/a; b", "/srv/*", "/srv/'\""):
        with pytest.raises(OSError):
            asyncio.run(sftp_wire.transfer(tmp_path / "cfg", Get("web1", path, "deploy")))
    assert started and all(
        a == tuple(client.sftp_argv(tmp_path / "cfg", "web1", "deploy")) for a in started
    )


# -- the wire, against OpenSSH's sftp-server -------------------------------------------------


needs_server = pytest.mark.skipif(SFTP_SERVER is None, reason="no OpenSSH sftp-server")


def run(req: Put | Get) -> sftp_wire.Moved:
    assert SFTP_SERVER is not None
    return asyncio.run(sftp_wire.transfer(Path("/nonexistent"), req, argv=[SFTP_SERVER]))


@needs_server
@pytest.mark.parametrize("size", [0, 1, sftp_wire.CHUNK, sftp_wire.CHUNK * 40 + 7])
def test_the_wire_moves_exact_bytes(tmp_path: Path, size: int) -> None:
    data = os.urandom(size)
    target = tmp_path / "f.bin"
    moved = run(Put("web1", str(target), data, mode=0o600))
    assert moved.error is moved.status is moved.broken is None, moved
    assert target.read_bytes() == data and stat.S_IMODE(target.stat().st_mode) == 0o600
    moved = run(Get("web1", str(target), max_bytes=max(size, 1)))
    assert moved.data == data and moved.size == size and not moved.truncated, moved
    if size > 10:
        moved = run(Get("web1", str(target), max_bytes=size - 3))
        assert moved.data == data[: size - 3] and moved.truncated and moved.size == size


@needs_server
def test_the_targets_failure_is_a_status(tmp_path: Path) -> None:
    moved = run(Get("web1", str(tmp_path / "absent")))
    assert moved.status is not None and moved.status.code == 2, moved  # no such file
    assert moved.error is None and moved.opened
    moved = run(Put("web1", str(tmp_path / "no-dir" / "f"), b"x"))
    assert moved.status is not None and moved.status.code == 2, moved
    assert not (tmp_path / "no-dir").exists()


@needs_server
def test_a_put_of_shell_shaped_names_writes_those_names(tmp_path: Path) -> None:
    for name in ("!touch M", "-rf", "$(touch M)", "*", "a\\b", "q'\"", "x y"):
        moved = run(Put("web1", str(tmp_path / name), name.encode()))
        assert moved.status is None and moved.broken is None, (name, moved)
        assert (tmp_path / name).read_bytes() == name.encode()
    assert not (Path.cwd() / "M").exists() and not (tmp_path / "M").exists()


def test_a_channel_that_ends_early_is_broken_not_a_result(tmp_path: Path) -> None:
    true = shutil.which("true")
    assert true is not None
    moved = asyncio.run(sftp_wire.transfer(tmp_path, Get("web1", "/x"), argv=[true]))
    assert moved.broken and not moved.opened and moved.error is None, moved


def test_the_gateways_error_line_wins(tmp_path: Path) -> None:
    line = '{"ok": false, "error": {"code": "POLICY_DENIED", "message": "no", "retryable": false}}'
    script = tmp_path / "gw.sh"
    script.write_text(f"#!/bin/sh\necho '{line}' >&2\nexit 77\n")
    script.chmod(0o755)
    moved = asyncio.run(sftp_wire.transfer(tmp_path, Get("web1", "/x"), argv=[str(script)]))
    assert moved.error == {"code": "POLICY_DENIED", "message": "no", "retryable": False}, moved
    sha = hashlib.sha256(b"").hexdigest()
    assert sftp_wire.sha256(b"") == sha
