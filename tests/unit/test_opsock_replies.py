"""The operator wire's client (opsock.call) reads answers of any honest size: a
64 x 50 bench run made `audit activity --json` about 4 MB, past the 1 MiB a request
may be, and the old reader cut it there and called it "not JSON"."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

import pytest

from bastion.ops.opsock import OperatorError, call


def serve_once(path: Path, reply: bytes) -> threading.Thread:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)

    def answer() -> None:
        conn, _ = server.accept()
        with conn, conn.makefile("rb") as f:
            f.readline()
            conn.sendall(reply)
        server.close()

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    return t


def test_a_large_answer_arrives_whole(tmp_path: Path) -> None:
    rows = [{"request_id": f"req_{i:08x}", "command": "x" * 200} for i in range(20_000)]
    reply = json.dumps({"ok": True, "result": rows}).encode() + b"\n"
    assert len(reply) > 4 << 20
    path = tmp_path / "op.sock"
    t = serve_once(path, reply)
    assert call(path, "audit", verify=False, view="activity") == rows
    t.join(5)


def test_an_answer_cut_off_is_said_to_be_cut_off(tmp_path: Path) -> None:
    path = tmp_path / "op.sock"
    t = serve_once(path, b'{"ok": true, "result": [1, 2')
    with pytest.raises(OperatorError, match="cut off"):
        call(path, "status", verify=False)
    t.join(5)
