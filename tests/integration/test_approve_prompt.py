"""`bastion approve` driven through a real pseudo-terminal (issue 3, acceptance 10)."""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tests.harness import Bastion

ANSI = re.compile(rb"\x1b\[[0-9;]*m")


class Terminal:
    """A program on the slave side of a pty; we read its screen and type keys."""

    def __init__(self, argv: list[str]) -> None:
        self.master, slave = os.openpty()
        self.proc = subprocess.Popen(
            argv, stdin=slave, stdout=slave, stderr=slave, start_new_session=True
        )
        os.close(slave)
        self.seen = b""

    def expect(self, text: str, timeout: float = 20) -> str:
        """Wait until `text` appears on the screen after what was already matched."""
        deadline = time.monotonic() + timeout
        while True:
            plain = ANSI.sub(b"", self.seen)
            idx = plain.find(text.encode())
            if idx >= 0:
                self.seen = plain[idx + len(text) :]
                return plain[: idx + len(text)].decode("utf-8", "replace")
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{text!r} not shown; screen: {plain.decode()[-2000:]}")
            ready, _, _ = select.select([self.master], [], [], left)
            if ready:
                with contextlib.suppress(OSError):  # the program exited, closing the pty
                    self.seen += os.read(self.master, 65536)

    def type(self, keys: str) -> None:
        os.write(self.master, keys.encode())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(10)
        os.close(self.master)


@pytest.fixture
def prompt(bastion: Bastion) -> Iterator[Terminal]:
    term = Terminal(
        [sys.executable, "-m", "bastion.cli", "--home", str(bastion.home.root), "approve"]
    )
    term.expect("waiting for cards")
    yield term
    term.close()


def test_approve_and_decline_by_keystroke_with_details(bastion: Bastion, prompt: Terminal) -> None:
    agent = bastion.agent()
    rid = agent.start("echo approved-by-key")
    prompt.expect("session approval")
    prompt.expect(f"pid {agent.pid}")
    prompt.expect("approve? [y/n/d]")
    prompt.type("d")
    details = prompt.expect("approve? [y/n/d]")
    assert "process chain" in details and "exe sha256" in details and str(agent.pid) in details
    prompt.type("y")
    prompt.expect("approved")
    assert agent.wait(rid).stdout == b"approved-by-key\n"

    other = bastion.agent()
    rid = other.start("echo never")
    prompt.expect(f"pid {other.pid}")
    prompt.type("n")
    prompt.expect("denied")
    r = other.wait(rid)
    assert r.code == "SESSION_DENIED" and r.stdout == b""


def test_notices_have_no_button_and_restarts_are_survived(
    bastion: Bastion, prompt: Terminal
) -> None:
    bastion.cli("lock")
    r = bastion.agent().run("echo locked")
    assert r.code == "VAULT_LOCKED"
    screen = prompt.expect("notice: denied VAULT_LOCKED")
    assert "approve?" not in screen

    bastion.stop_daemon()
    prompt.expect("lost the gateway")
    bastion.start_daemon()
    prompt.expect("reconnected to a restarted gateway")
    bastion.unlock()
    agent = bastion.agent()
    rid = agent.start("echo after-restart")
    prompt.expect("approve? [y/n/d]")
    prompt.type("y")
    assert agent.wait(rid).stdout == b"after-restart\n"


def test_a_withdrawn_card_is_announced(bastion: Bastion, prompt: Terminal) -> None:
    agent = bastion.agent()
    agent.start("echo gone")
    prompt.expect("approve? [y/n/d]")
    agent.close()
    prompt.expect("withdrawn: its process exited")
    prompt.type("q")
    assert prompt.proc.wait(10) == 0
