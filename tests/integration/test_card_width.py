"""`bastion approve` at the terminal's width (issue 22, acceptance 2): in a real pty of
80x24 and of 200x50, no line the prompt writes is wider than the terminal, and the host
key's fingerprint and the sha256s under `d` stand whole on one line of the screen, as a
terminal emulator (pyte) draws it."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import select
import struct
import subprocess
import termios
import time
from collections.abc import Iterator

import pyte
import pytest
from rich.cells import cell_len

from bastion.cli.promptkeys import GUARD
from tests.harness import Bastion, cli_argv

# The prompt's own control sequences: its colours, the bell, the status line's redraw.
CONTROL = re.compile(rb"\x1b\[[0-9;]*m|\r\x1b\[K|\x07")


class Sized:
    """`bastion approve` on a pty of a given size; what it wrote, raw and as drawn."""

    def __init__(self, argv: list[str], columns: int, rows: int) -> None:
        self.columns, self.rows = columns, rows
        self.master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
        self.proc = subprocess.Popen(
            argv, stdin=slave, stdout=slave, stderr=slave, start_new_session=True
        )
        os.close(slave)
        self.raw = b""

    def wait_for(self, text: str, after: int = 0, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while text.encode() not in CONTROL.sub(b"", self.raw[after:]):
            left = deadline - time.monotonic()
            assert left > 0, f"{text!r} not shown; screen:\n" + "\n".join(self.screen())
            ready, _, _ = select.select([self.master], [], [], left)
            if ready:
                with contextlib.suppress(OSError):
                    self.raw += os.read(self.master, 65536)

    def written_lines(self, after: int) -> list[str]:
        """Each line as the prompt wrote it (a pty turns "\\n" into "\\r\\n")."""
        plain = CONTROL.sub(b"", self.raw[after:]).decode("utf-8", "replace")
        return [piece for line in plain.split("\n") for piece in line.split("\r")]

    def screen(self) -> list[str]:
        screen = pyte.Screen(self.columns, self.rows)
        pyte.ByteStream(screen).feed(self.raw)
        return [line.rstrip() for line in screen.display]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        os.close(self.master)


@pytest.fixture(params=[(80, 24), (200, 50)], ids=["80x24", "200x50"])
def sized(request: pytest.FixtureRequest, bastion: Bastion) -> Iterator[Sized]:
    columns, rows = request.param
    term = Sized(cli_argv(bastion.home.root, "approve", "--no-notify"), columns, rows)
    try:
        term.wait_for("waiting for cards")
        yield term
    finally:
        term.close()


def test_the_card_fits_the_terminal_and_its_digests_stand_whole(
    bastion: Bastion, sized: Sized
) -> None:
    start = 0  # everything the prompt wrote: the greeting, the cards, their questions
    agent = bastion.agent()
    rid = agent.start("echo fits")
    card = bastion.next_card()
    sized.wait_for("approve? [y/n then Enter")
    fingerprint = card["host_key_fingerprint"]
    assert any(fingerprint in line for line in sized.screen()), "\n".join(sized.screen())

    time.sleep(GUARD + 0.2)  # a key sooner than this after the card answers nothing
    mark = len(sized.raw)
    os.write(sized.master, b"d")
    sized.wait_for("approve? [y/n then Enter", after=mark)
    screen = sized.screen()
    for digest in (card["subject"]["exe_sha256"], card["chain"][0]["exe_sha256"]):
        assert any(digest in line for line in screen), (digest, "\n".join(screen))
    details = CONTROL.sub(b"", sized.raw[mark:]).decode()
    assert "approval --" not in details  # `d` adds the details; the header is not drawn again

    wide = [line for line in sized.written_lines(start) if cell_len(line) > sized.columns]
    assert not wide, f"wider than {sized.columns}: {wide}"
    time.sleep(GUARD + 0.2)  # d redrew below the card: past the guard again
    os.write(sized.master, b"y")
    sized.wait_for("press Enter to confirm", after=mark)
    os.write(sized.master, b"\r")
    assert agent.wait(rid).stdout == b"fits\n"
