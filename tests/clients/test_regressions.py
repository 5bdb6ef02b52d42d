"""rsync and git through bastion: they worked before issue 21, and keep working.

Each runs as an agent runs it -- the stock tool over `ssh -F` the config `bastion
ssh-config` prints, inside one approved `bastion run` (rsync and git are the processes
above ssh: outside a run each call would be a process of its own, with its own card) --
byte-exact both ways, with a journal row per ssh call it made.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.harness import Agent, Bastion, run_agent

pytestmark = pytest.mark.skipif(
    not (shutil.which("rsync") and shutil.which("git")), reason="needs rsync and git"
)
GIT_ENV = {
    "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
    "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com",
}  # fmt: skip


def given(b: Bastion) -> Path:
    """The directory a run is given (`--rw`): a run writes only where it was given."""
    d = b.root / "given"
    d.mkdir(exist_ok=True)
    return d


def approved(b: Bastion) -> Agent:
    """A sandboxed run whose session card was approved, given `given(b)`."""
    agent = run_agent(b, "--label", "tools", "--rw", str(given(b)))
    rid = agent.start("true")
    b.approve_next()
    assert agent.wait(rid).rc == 0
    return agent


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def completed(rows: list[dict[str, Any]], word: str) -> list[dict[str, Any]]:
    return [r for r in rows if word in (r["command"] or "") and r["outcome"] == "completed"]


def test_rsync_up_and_down_byte_exact(bastion: Bastion, tmp_path: Path, journal_rows: Any) -> None:
    agent = approved(bastion)
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "bin").write_bytes(os.urandom(300_000))
    (src / "sub" / "text").write_text("through bastion\n")
    (src / "sub" / "empty").write_bytes(b"")
    up, down = tmp_path / "up", given(bastion) / "down"
    ssh = f"ssh -F {bastion.config}"
    r = agent.run([], argv=["rsync", "-a", "-e", ssh, f"{src}/", f"web1:{up}/"])
    assert r.rc == 0, r.stderr
    assert tree(up) == tree(src)
    r = agent.run([], argv=["rsync", "-a", "-e", ssh, f"web1:{up}/", f"{down}/"])
    assert r.rc == 0, r.stderr
    assert tree(down) == tree(src)
    assert len(completed(journal_rows(), "rsync --server")) == 2


def _repo(tmp_path: Path) -> tuple[Path, Path]:
    """A work tree with two commits, and a bare clone of it (on the test sshd's account:
    the same machine)."""
    work, bare = tmp_path / "work", tmp_path / "repo.git"
    env = {**os.environ, **GIT_ENV}
    subprocess.run(["git", "init", "-q", "-b", "main", str(work)], check=True, env=env)
    (work / "README").write_bytes(b"first\n\x00binary\xff\n")
    subprocess.run(["git", "-C", str(work), "add", "README"], check=True, env=env)
    subprocess.run(["git", "-C", str(work), "commit", "-q", "-m", "one"], check=True, env=env)
    subprocess.run(["git", "clone", "-q", "--bare", str(work), str(bare)], check=True, env=env)
    return work, bare


def test_git_clone_and_push_with_protocol_v2(
    bastion: Bastion, tmp_path: Path, journal_rows: Any
) -> None:
    """Asked for protocol v2, clone and push work. (The wire protocol is v0: git sends
    GIT_PROTOCOL as an environment variable, which bastion does not pass to the target,
    so upload-pack answers v0 -- git's own fallback.)"""
    agent = approved(bastion)
    _, bare = _repo(tmp_path)
    clone = given(bastion) / "clone"
    env = {
        **GIT_ENV,
        "GIT_SSH_COMMAND": f"ssh -F {bastion.config}",
        "GIT_TRACE_PACKET": str(given(bastion) / "trace"),
    }
    r = agent.run([], argv=[
        "git", "-c", "protocol.version=2", "clone", "-q", f"web1:{bare}", str(clone),
    ], env=env)  # fmt: skip
    assert r.rc == 0, r.stderr
    assert (clone / "README").read_bytes() == b"first\n\x00binary\xff\n"
    (clone / "NEW").write_bytes(b"pushed through bastion\n")
    for argv in (["add", "NEW"], ["commit", "-q", "-m", "two"]):
        subprocess.run(["git", "-C", str(clone), *argv], check=True, env={**os.environ, **GIT_ENV})
    r = agent.run([], argv=[
        "git", "-C", str(clone), "-c", "protocol.version=2", "push", "-q", "origin", "main",
    ], env=env)  # fmt: skip
    assert r.rc == 0, r.stderr
    shown = subprocess.run(
        ["git", "-C", str(bare), "show", "main:NEW"], capture_output=True, check=True
    )
    assert shown.stdout == b"pushed through bastion\n"
    rows = journal_rows()
    assert len(completed(rows, "git-upload-pack")) == 1
    assert len(completed(rows, "git-receive-pack")) == 1
