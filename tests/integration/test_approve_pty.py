"""`bastion approve` cannot be rushed (issue 22, acceptance 1): a real pty, its screen rendered
by pyte at 80x24, against a real gateway and sshd.

A single `y` answers nothing; `y` then Enter, after the guard time, approves. A key within the
guard of a card appearing answers nothing and the screen says so. `l` does not lock; `L` does.
"yes\\n" pasted (bracketed, and as one unbracketed write) answers nothing. Each has its
positive control: the same keys, one read each and after the guard, do what they say. And on
a resize (TIOCSWINSZ, then SIGWINCH) the card is drawn again at the new width.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import signal
import struct
import subprocess
import termios
import time
from collections.abc import Iterator

import pyte
import pytest

from bastion.cli.promptkeys import GUARD, PASTE_END, PASTE_START
from tests.harness import ANSI, Agent, Bastion, cli_argv, wait_for

PAST_GUARD = GUARD + 0.2  # a deliberate wait: the guard time is the thing under test
ASKED = "approve? [y/n"  # the question's start, on the screen of this tree and its base


class Screen:
    """`bastion approve` on the slave side of a pty; its output rendered by pyte."""

    def __init__(self, argv: list[str], columns: int = 80, rows: int = 24) -> None:
        self.master, slave = os.openpty()
        self._winsize(columns, rows, slave)
        self.proc = subprocess.Popen(
            argv, stdin=slave, stdout=slave, stderr=slave, start_new_session=True
        )
        os.close(slave)
        self.screen = pyte.Screen(columns, rows)
        self.stream = pyte.ByteStream(self.screen)
        self.raw = b""

    def _winsize(self, columns: int, rows: int, fd: int) -> None:
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))

    def text(self) -> str:
        return "\n".join(line.rstrip() for line in self.screen.display)

    def pump(self, timeout: float) -> None:
        ready, _, _ = select.select([self.master], [], [], timeout)
        if ready:
            with contextlib.suppress(OSError):  # the program exited, closing the pty
                chunk = os.read(self.master, 65536)
                self.raw += chunk
                self.stream.feed(chunk)

    def wait(self, *texts: str, after: int = 0, timeout: float = 30) -> str:
        """Until one of `texts` is in what the program wrote since byte `after` (escape
        sequences aside) and on the screen (however wrapped); returns the one seen."""
        deadline = time.monotonic() + timeout
        while True:
            written = ANSI.sub(b"", self.raw[after:]).decode("utf-8", "replace")
            on_screen = "".join(self.text().split())
            for text in texts:
                if text in written and "".join(text.split()) in on_screen:
                    return text
            left = deadline - time.monotonic()
            assert left > 0, f"none of {texts} shown; screen:\n{self.text()}"
            self.pump(min(left, 0.2))

    def type(self, keys: str) -> None:
        """One write: the program reads it as one chunk, as it would a paste."""
        os.write(self.master, keys.encode())

    def caught_up(self) -> None:
        """Until the program has read all that was typed: `a`, and what it answers (the
        activity, or the note that it came with other keys or too soon after a card). A
        quiet key cannot say when it was read, and on a loaded machine two writes a moment
        apart can arrive as one read: the tty may not yet have passed the first on when the
        second comes."""
        mark = len(self.raw)
        self.type("a")
        self.wait("last 5 requests", "several keys in one read", "of a new card", after=mark)

    def resize(self, columns: int, rows: int) -> None:
        self._winsize(columns, rows, self.master)
        self.screen.resize(rows, columns)
        os.kill(self.proc.pid, signal.SIGWINCH)  # not its controlling tty: say it ourselves

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(10)
        os.close(self.master)


@pytest.fixture
def screen(bastion: Bastion) -> Iterator[Screen]:
    term = Screen(cli_argv(bastion.home.root, "approve", "--no-notify"))
    term.wait("waiting for cards")
    yield term
    term.close()


def raise_card(bastion: Bastion, screen: Screen, command: str) -> tuple[Agent, str, str]:
    """An agent asks; its card is on the screen, the question under it."""
    mark = len(screen.raw)
    agent = bastion.agent()
    rid = agent.start(command)
    card = bastion.next_card()
    assert card["subject"]["pid"] == agent.pid
    screen.wait(ASKED, after=mark)
    return agent, rid, card["id"]


def pending(bastion: Bastion) -> list[str]:
    return [c["id"] for c in bastion.op("pending")]


def confirm(bastion: Bastion, screen: Screen, card_id: str) -> None:
    """The documented answer, key by key after the guard: `y`, then Enter."""
    time.sleep(PAST_GUARD)
    mark = len(screen.raw)
    screen.type("y")
    screen.wait("press Enter to confirm", after=mark)
    assert card_id in pending(bastion)
    screen.type("\r")
    screen.wait("approved", after=mark)


def test_a_single_y_does_not_approve_y_then_enter_does(bastion: Bastion, screen: Screen) -> None:
    agent, rid, card_id = raise_card(bastion, screen, "echo confirmed")
    time.sleep(PAST_GUARD)
    mark = len(screen.raw)
    screen.type("y")
    screen.wait("press Enter to confirm", "approved", after=mark)
    assert card_id in pending(bastion), "a single y approved"
    assert f"approve {card_id}? press Enter to confirm" in screen.text()
    # The question names the card a key answers.
    assert f"{card_id} (session on web1): approve? [y/n then Enter" in screen.text()

    screen.type("x")  # anything but Enter cancels
    screen.wait(f"cancelled: {card_id} not answered", after=mark)
    screen.type("\r")
    time.sleep(PAST_GUARD)  # an Enter with no answer begun does nothing
    assert card_id in pending(bastion)

    confirm(bastion, screen, card_id)  # positive control
    assert agent.wait(rid).stdout == b"confirmed\n"

    other, rid, card_id = raise_card(bastion, screen, "echo never")
    time.sleep(PAST_GUARD)
    mark = len(screen.raw)
    screen.type("n")
    screen.wait("press Enter to confirm", "denied", after=mark)
    assert card_id in pending(bastion), "a single n denied"
    screen.type("\r")
    screen.wait("denied", after=mark)
    assert other.wait(rid).code == "SESSION_DENIED"


def test_a_key_within_the_guard_of_a_new_card_answers_nothing(
    bastion: Bastion, screen: Screen
) -> None:
    mark = len(screen.raw)
    agent = bastion.agent()
    rid = agent.start("echo guarded")
    card_id = bastion.next_card()["id"]
    screen.wait(ASKED, after=mark)
    screen.type("y")  # at once: within the guard of the card appearing
    seen = screen.wait(f"within {GUARD} s of a new card ignored", "approved", after=mark)
    assert seen != "approved" and card_id in pending(bastion), "a rushed y approved"
    time.sleep(PAST_GUARD)
    screen.type("\r")  # the rushed y began nothing: this Enter answers nothing
    screen.type("Y")  # and capitals are no answer
    time.sleep(PAST_GUARD)
    assert card_id in pending(bastion)
    assert "press Enter to confirm" not in screen.text()

    confirm(bastion, screen, card_id)  # positive control: the same key after the guard
    assert agent.wait(rid).stdout == b"guarded\n"


def test_l_does_nothing_and_capital_l_locks(bastion: Bastion, screen: Screen) -> None:
    time.sleep(PAST_GUARD)
    mark = len(screen.raw)
    screen.type("l")
    screen.wait("L locks", "locked (vault epoch", after=mark)
    assert not bastion.op("status")["locked"], "l locked the vault"
    for key in "clear":  # typed into the wrong pane, a key a write (a read, mostly)
        screen.type(key)
        screen.pump(0.05)
    screen.caught_up()
    assert not bastion.op("status")["locked"]

    mark = len(screen.raw)
    screen.type("L")  # positive control: a read of its own, nothing typed before it unread
    screen.wait("locked (vault epoch", after=mark)
    assert bastion.op("status")["locked"]


@pytest.mark.parametrize(
    "paste", [PASTE_START + "yes\n" + PASTE_END, "yes\n"], ids=["bracketed", "unbracketed"]
)
def test_pasted_yes_does_not_approve(bastion: Bastion, screen: Screen, paste: str) -> None:
    agent, rid, card_id = raise_card(bastion, screen, "echo pasted")
    time.sleep(PAST_GUARD)
    mark = len(screen.raw)
    screen.type(paste)
    seen = screen.wait("ignored", "approved", after=mark)
    assert seen == "ignored" and card_id in pending(bastion), "a paste approved"
    time.sleep(PAST_GUARD)
    assert card_id in pending(bastion)

    confirm(bastion, screen, card_id)  # positive control: the keys typed one by one
    assert agent.wait(rid).stdout == b"pasted\n"


def test_a_resize_redraws_the_card_at_the_new_width(bastion: Bastion, screen: Screen) -> None:
    agent, rid, card_id = raise_card(bastion, screen, "echo resized")
    header = f"{card_id}: session approval"
    assert header in screen.text()
    mark = len(screen.raw)
    screen.resize(200, 50)
    screen.wait(header, after=mark)  # drawn again after the resize
    screen.wait(f"{card_id} (session on web1): approve? [y/n then Enter, d details, L lock]")
    shown = screen.text().splitlines()
    assert any(line.startswith(header) for line in shown), shown
    # At the new width: the target line holds the host key's fingerprint, which at 80
    # columns stood on a line of its own.
    fingerprint = next(c for c in bastion.op("pending") if c["id"] == card_id)[
        "host_key_fingerprint"
    ]
    assert any("target:" in line and fingerprint in line for line in shown), shown

    confirm(bastion, screen, card_id)  # the redraw was a change: the guard, then the answer
    assert agent.wait(rid).stdout == b"resized\n"
    wait_for(lambda: not pending(bastion))
