"""The gateway's memory comes back after a large stream (issue 23).

A fast target streaming to a slower agent once made the gateway buffer most of the
stream (asyncssh re-opened the target's window for bytes it still held:
`gateway/window.py`), and what a burst freed stayed in glibc's heap
(`gateway/trim.py`). RSS is a fact of the process, not a timing: the bounds here
are generous (the fixes measured +8 MB peak for 200 MB; before them, +120 MB and
more, kept after the stream ended).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from tests.harness import Bastion, approved_agent, wait_for

MiB = 1024 * 1024
STREAM = 128 * MiB
UPLOAD = 32 * MiB


def _status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a process, in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def _random_file(path: Path, size: int) -> str:
    digest = hashlib.sha256()
    with path.open("wb") as f:
        for _ in range(size // MiB):
            block = os.urandom(MiB)
            digest.update(block)
            f.write(block)
    return digest.hexdigest()


def test_a_large_stream_leaves_the_gateway_where_it_started(
    bastion: Bastion, tmp_path: Path
) -> None:
    agent = approved_agent(bastion)
    blob = tmp_path / "blob"
    sha = _random_file(blob, STREAM)
    pid = bastion.gateway_pid
    before = _status(pid)["VmRSS"]
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM from now (the unlock's is 512 MiB)

    down = agent.run(f"cat {blob}")
    assert down.rc == 0, down.stderr
    assert (down.stdout_len, down.stdout_sha256) == (STREAM, sha)
    peak = _status(pid)["VmHWM"]

    # The other way too: the agent's stdin to the target, whole (the agent channel's
    # window holds the agent back when the target is slower).
    up_file = tmp_path / "up"
    up_sha = _random_file(up_file, UPLOAD)
    up = agent.run("sha256sum", stdin_path=up_file)
    assert up.rc == 0, up.stderr
    assert up.stdout.split()[0].decode() == up_sha

    # Peak: never the stream itself, only windows and the heap between trims.
    assert peak - before < 48 * MiB, (before, peak)
    # After: back near the start once the gateway is quiet (a trim, within seconds).
    wait_for(lambda: _status(pid)["VmRSS"] < before + 12 * MiB, timeout=30)
