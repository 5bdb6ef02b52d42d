"""The console refuses a process inside a `bastion run`, even one holding the logged-in
browser's cookie and CSRF token (issue 44); the browser itself, outside every run, is
served, its event stream included, with idle connections closed after two seconds.

The attacker is what the issue names: a process inside a run that took the console's
cookie from the browser's profile and the CSRF token from `/api/state`, and asks the
console's API to answer its own card. The control is the same program, with the same
cookie and token, run outside every run: its answer is taken.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bastion.devtools.sshd_fixture import SshdInfo
from tests.browser_helper import (
    Browser,
    Stolen,
    enroll,
    free_port,
    log_in,
    next_card,
)
from tests.harness import Bastion, cli_argv, make_bastion, policy_toml, write_bastion_toml

# One state-changing request to the console, with everything the page would send.
ASK = r"""
import http.client, json, sys
origin, cookie, csrf, path = sys.argv[1:5]
host, port = origin.removeprefix("http://").split(":")
headers = {
    "Host": f"{host}:{port}", "Origin": origin, "Cookie": f"bastion_console={cookie}",
    "X-CSRF-Token": csrf, "Content-Type": "application/json",
}
try:
    conn = http.client.HTTPConnection("127.0.0.1", int(port), timeout=20)
    conn.request("POST", path, body=b"{}", headers=headers)
    response = conn.getresponse()
    print(json.dumps({"status": response.status, "body": json.loads(response.read())}))
except (OSError, http.client.HTTPException) as exc:
    print(json.dumps({"status": None, "error": f"{type(exc).__name__}: {exc}"}))
"""


@pytest.fixture
def idle_console(
    tmp_path: Path, sshd: SshdInfo, client_key: tuple[Path, str], web: Browser
) -> Iterator[tuple[Bastion, str, Browser]]:
    """A session-approval gateway whose console closes idle connections after 2 s, one
    signer enrolled and logged in."""
    b = make_bastion(tmp_path, sshd, client_key[0], policy=policy_toml(sshd), start=False)
    port = free_port()
    write_bastion_toml(b, f"[console]\nenabled = true\nport = {port}\nidle_seconds = 2\n")
    origin = f"http://localhost:{port}"
    b.daemon_args = ("--approval-timeout", "60")
    try:
        b.start_daemon()
        b.unlock()
        web.authenticator()
        assert "enrolled 'alice'" in enroll(b, web, "alice", origin)["out"]
        log_in(web, origin)
        yield b, origin, web
    finally:
        b.close()


def ask(b: Bastion, thief: Stolen, path: str, *run: str) -> dict[str, Any]:
    """ASK with the stolen cookie and token, from inside `bastion run RUN... --` (or
    outside every run when `run` is empty)."""
    argv = [sys.executable, "-I", "-c", ASK, thief.origin, thief.cookie, thief.csrf, path]
    if run:
        argv = [*cli_argv(b.home.root, "run", *run, "--"), *argv]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    lines = done.stdout.strip().splitlines()
    assert lines, (done.returncode, done.stderr[-2000:])
    got: dict[str, Any] = json.loads(lines[-1])
    return got


def test_a_run_with_the_cookie_and_token_cannot_answer_its_card(
    idle_console: tuple[Bastion, str, Browser],
) -> None:
    b, origin, web = idle_console
    agent = b.agent()
    rid = agent.start("echo never")
    card = next_card(b, "session")
    thief = Stolen.from_browser(web, origin)  # the cookie and token work: /api/state
    deny = f"/api/cards/{card['id']}/deny"
    # The run's own host network (--no-sandbox): reset before any HTTP is read.
    inside = ask(b, thief, deny, "--no-sandbox", "--label", "thief")
    assert inside["status"] is None and "Connection" in inside["error"], inside
    # A sandboxed run that shares the host's network: another PID and user namespace.
    shared = ask(b, thief, deny, "--share-net", "--label", "shared-thief")
    assert shared["status"] is None, shared
    # A default run has a loopback of its own: the console is not even there.
    default = ask(b, thief, deny, "--label", "default-thief")
    assert default["status"] is None, default
    assert card["id"] in {c["id"] for c in b.op("pending")}  # nothing was answered
    refused = b.op("status")["console"]["refused"]
    assert refused["inside_run"] >= 1 and refused["sandboxed"] >= 1, refused
    log = b.log.read_text()
    assert "console: refused a connection from pid" in log
    assert "inside a `bastion run` or an agent's process tree" in log
    # The control: the same program, cookie and token, outside every run, is answered.
    outside = ask(b, thief, deny)
    assert outside["status"] == 200 and outside["body"]["approved"] is False, outside
    assert agent.wait(rid).code == "SESSION_DENIED"


def test_the_browser_is_served_and_its_event_stream_is_not_idle(
    idle_console: tuple[Bastion, str, Browser],
) -> None:
    """The logged-in page holds its event stream past the idle time (a stream is not
    idle); its card arrives through it; nothing of the browser's is refused."""
    b, _, web = idle_console
    time.sleep(5)  # past idle_seconds (2): idle connections closed, the stream not
    console = b.op("status")["console"]
    assert console["streams"] == 1, console
    agent = b.agent()
    rid = agent.start("echo served")
    card = next_card(b, "session")
    web.find(f'[data-card="{card["id"]}"] .approve').click()
    result = agent.wait(rid)
    assert (result.rc, result.stdout) == (0, b"served\n"), result.stderr
    console = b.op("status")["console"]
    refused = console["refused"]
    assert refused["inside_run"] == refused["sandboxed"] == refused["unidentified"] == 0
    assert refused["peer_full"] == refused["full"] == 0, refused
    print(f"\nthe browser's connections, each peer found: {console['identify']}")
