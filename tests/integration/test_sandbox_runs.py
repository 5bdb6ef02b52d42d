"""Runs side by side, and real agent programs inside one (issue 20, acceptance 3 -- the
process parts -- and 4).

Two default runs A and B: B cannot see A's processes, read or trace them, signal them, or
write A's /tmp or its --private-home HOME; each has a positive control (root outside both
runs can, through the same pids and /proc/PID/root). And what an agent really does works
inside a run: `git clone` over bastion's ssh config, a tool writing into the project, an
HTTP request to a loopback server outside, and `bastion mcp` started by an MCP client.
"""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.harness import (
    TRACE_PROBE,
    Bastion,
    cli_argv,
    inside,
    readable_address,
    run_agent,
    wait_for,
)

PY = sys.executable


def _only(argv: list[str]) -> int:
    found = [p.pid for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == argv]
    assert len(found) == 1, found
    return found[0]


def test_two_runs_cannot_see_trace_signal_or_write_each_other(
    bastion: Bastion, tmp_path: Path
) -> None:
    home = tmp_path / "user-home"
    home.mkdir()
    a = run_agent(bastion, "--label", "A", "--private-home", env={"HOME": str(home)})
    b = run_agent(bastion, "--label", "B", env={"HOME": str(home)})
    started = inside(
        a, "sh", "-c", "setsid -f sleep 3141.5 </dev/null >/dev/null 2>&1; echo a-secret > /tmp/a"
    )
    assert started.rc == 0, started.stderr
    wait_for(lambda: [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] ==
                      ["sleep", "3141.5"]], timeout=30)  # fmt: skip
    sleeper = _only(["sleep", "3141.5"])
    a_home = inside(a, "sh", "-c", 'printf %s "$HOME"').stdout.decode()
    assert a_home == str(home)

    doc = json.loads(
        inside(b, PY, "-c", TRACE_PROBE, str(sleeper), readable_address(sleeper), "/tmp/a").stdout
    )
    assert not [c for c in doc.pop("cmdlines") if "3141.5" in c], "B sees A's processes"
    assert doc["vm_readv"] < 0 and doc["ptrace"] < 0 and doc["kill0"] < 0, doc
    assert doc["root_tmp"] != "a-secret\n", doc
    # B writes "A's" /tmp and plants a usercustomize.py in A's HOME: it lands in B's own.
    plant = f"echo b-was-here > /tmp/a; echo 'import os' > {a_home}/usercustomize.py"
    assert inside(b, "sh", "-c", plant).rc == 0
    assert inside(a, "cat", "/tmp/a").stdout == b"a-secret\n"
    seen = inside(a, "ls", "-A", a_home).stdout.decode().split()
    assert "usercustomize.py" not in seen, seen
    # Positive control: from outside both runs (root), the same pid is read, traced and
    # signalled, and A's /tmp and HOME are reached through /proc/PID/root.
    doc = json.loads(
        subprocess.run(
            [PY, "-c", TRACE_PROBE, str(sleeper), readable_address(sleeper), "/tmp/a"],
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout
    )  # fmt: skip
    assert [c for c in doc.pop("cmdlines") if "3141.5" in c]
    assert doc == {
        "proc": True,
        "vm_readv": 64,
        "ptrace": 0,
        "kill0": 0,
        "root_tmp": "a-secret\n",
    }, doc
    Path(f"/proc/{sleeper}/root{a_home}/planted-from-outside").write_text("x")
    assert "planted-from-outside" in inside(a, "ls", "-A", a_home).stdout.decode()


# -- real agent programs -------------------------------------------------------------------


@pytest.fixture
def project(tmp_path: Path) -> Path:
    d = tmp_path / "project"
    d.mkdir()
    return d


def _bare_repo(tmp_path: Path) -> Path:
    """A bare git repository on the test sshd's account, with one commit."""
    work, bare = tmp_path / "repo-work", tmp_path / "repo.git"
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com"}  # fmt: skip
    for argv in (
        ["git", "init", "-q", "-b", "main", str(work)],
        ["git", "-C", str(work), "commit", "-q", "--allow-empty", "-m", "first"],
    ):
        subprocess.run(argv, check=True, timeout=60, env=env)
    (work / "README").write_text("cloned through bastion\n")
    subprocess.run(["git", "-C", str(work), "add", "README"], check=True, timeout=60, env=env)
    subprocess.run(["git", "-C", str(work), "commit", "-q", "-m", "readme"], check=True,
                   timeout=60, env=env)  # fmt: skip
    subprocess.run(["git", "clone", "-q", "--bare", str(work), str(bare)], check=True, timeout=60)
    return bare


def test_git_clone_over_bastions_ssh_config_inside_a_run(
    bastion: Bastion, tmp_path: Path, project: Path
) -> None:
    bare = _bare_repo(tmp_path)
    agent = run_agent(bastion, "--label", "git", cwd=project)
    rid = agent.start(
        [], argv=["git", "clone", "-q", f"web1:{bare}", "clone"],
        env={"GIT_SSH_COMMAND": f"ssh -F {bastion.config}"},
    )  # fmt: skip
    card = bastion.approve_next(timeout=30)
    assert card["subject"]["pid"] == agent.pid, card
    r = agent.wait(rid)
    assert r.rc == 0, r.stderr
    assert (project / "clone" / "README").read_text() == "cloned through bastion\n"


def test_a_python_tool_writes_into_the_project(bastion: Bastion, project: Path) -> None:
    agent = run_agent(bastion, "--label", "tool", cwd=project)
    tool = "import os; open('generated.txt', 'w').write(os.getcwd())"
    r = inside(agent, PY, "-c", tool)
    assert r.rc == 0, r.stderr
    assert (project / "generated.txt").read_text() == str(project)


class _Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"hello from outside the run\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def http_server() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hello)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_a_loopback_server_outside_is_reached_only_with_share_net(
    bastion: Bastion, http_server: int
) -> None:
    """A run's network is its own: the host's loopback (a dev server, the console) is
    not reached from a default run; `--share-net` gives the host's network back."""
    fetch = (
        "import sys, urllib.request\n"
        "print(urllib.request.urlopen(sys.argv[1], timeout=30).read().decode(), end='')"
    )
    url = f"http://127.0.0.1:{http_server}/"
    r = inside(run_agent(bastion, "--label", "http"), PY, "-c", fetch, url)
    assert r.rc != 0 and "Connection refused" in r.stderr, r.stderr
    r = inside(run_agent(bastion, "--label", "http", "--share-net"), PY, "-c", fetch, url)
    assert r.rc == 0, r.stderr
    assert r.stdout == b"hello from outside the run\n"


MCP_ONCE = """
import asyncio, json, os, sys
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
async def main():
    params = StdioServerParameters(command=sys.argv[1], args=sys.argv[2:], env=dict(os.environ))
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        r = await session.call_tool("ssh_exec", {"host": "web1", "command": "echo via-mcp"})
        print(json.dumps({"is_error": bool(r.is_error), "structured": r.structured_content}))
asyncio.run(main())
"""


def test_bastion_mcp_started_by_an_mcp_client_inside_a_run(bastion: Bastion) -> None:
    pytest.importorskip("mcp")
    agent = run_agent(bastion, "--label", "mcp")
    rid = agent.start([], argv=[PY, "-c", MCP_ONCE, *cli_argv(bastion.home.root, "mcp")])
    card = bastion.approve_next(timeout=30)
    assert card["subject"]["pid"] == agent.pid, card
    r = agent.wait(rid)
    assert r.rc == 0, r.stderr
    doc = json.loads(r.stdout.decode().strip().splitlines()[-1])
    assert doc["is_error"] is False, doc
    assert doc["structured"]["stdout"] == "via-mcp\n" and doc["structured"]["exit_status"] == 0
