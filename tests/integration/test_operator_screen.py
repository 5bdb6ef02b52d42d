"""What the operator's terminal shows cannot be repainted by an agent (issue 18).

`bastion daemon &` and `bastion approve` share one terminal, as the README's
first real setup has them: a real pty, its screen rendered by a terminal emulator
(pyte). An agent that raised a command card then makes the gateway log strings
it chose -- its executable's path, the proxy header's user and host -- full of
cursor movements that would redraw the card's command as `uptime`. The
operator approves what the screen shows; a marker file on the target proves
what ran. And the characters an allowlist must catch (fillers, the blank
braille pattern, combining marks) reach neither `pending` nor `approve` raw.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import select
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pyte
import pytest

from bastion.agent import proxy as proxy_mod
from bastion.cli.promptkeys import GUARD
from bastion.devtools.sshd_fixture import SshdInfo
from bastion.ops import opsock
from tests.harness import (
    PASSPHRASE,
    Agent,
    Bastion,
    cli_argv,
    make_bastion,
    policy_toml,
    python_copy,
    wait_for,
)

COLUMNS, ROWS = 200, 80
# The prompt's own control: its colours, the bell, the status line's redraw, bracketed paste.
OUR_STYLES = re.compile(rb"\x1b\[(?:0|1|2|31|32|33)m|\r\x1b\[K|\x07|\x1b\[\?2004[hl]")
# Written where the log line starts, just after the question (17 columns: "approve? [y/n/d] ",
# the question before issue 22): wipe the log text, go up to the command, draw another, come back.
REPAINT = (
    "\r\x1b[17C\x1b[K"  # keep the question, erase what follows it on its line
    "\x1b[3A\r\x1b[2K  command:  1 word(s), run as this argv (no shell syntax):"
    "\x1b[1B\r\x1b[2K              0  uptime"
    "\x1b[1B\r\x1b[2K"
)
PARK = "\x1b[70;1f"  # the rest of the log line goes far below (lowercase: the host is folded)
INVISIBLE = "\u3164\u2800\u034f\u0338"  # a filler, blank braille, a joiner, an overlay


class SharedTerminal:
    """One pty that several programs write to, as a person's terminal is."""

    def __init__(self) -> None:
        self.master, self.slave = os.openpty()
        fcntl.ioctl(self.slave, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLUMNS, 0, 0))
        self.raw = b""
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, argv: list[str], keyboard: bool = False) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            argv,
            stdin=self.slave if keyboard else subprocess.DEVNULL,
            stdout=self.slave,
            stderr=self.slave,
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def pump(self, until: Callable[[bytes], bool], timeout: float = 30) -> None:
        """Read what the programs wrote until `until(raw)` holds."""
        deadline = time.monotonic() + timeout
        while not until(self.raw):
            left = deadline - time.monotonic()
            assert left > 0, "not shown in time; screen:\n" + "\n".join(self.lines())
            ready, _, _ = select.select([self.master], [], [], left)
            if ready:
                with contextlib.suppress(OSError):
                    self.raw += os.read(self.master, 65536)

    def shows(self, text: str, after: int = 0) -> Callable[[bytes], bool]:
        return lambda raw: text.encode() in OUR_STYLES.sub(b"", raw[after:])

    def type(self, keys: str) -> None:
        os.write(self.master, keys.encode())

    def answer(self, key: str) -> None:
        """As a person answers in `bastion approve`: past the guard, the key, then Enter."""
        time.sleep(GUARD + 0.2)
        mark = len(self.raw)
        self.type(key)
        self.pump(self.shows("press Enter to confirm", after=mark))
        self.type("\r")

    def lines(self) -> list[str]:
        screen = pyte.Screen(COLUMNS, ROWS)
        pyte.ByteStream(screen).feed(self.raw)
        return [line.rstrip() for line in screen.display]

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(20)
        os.close(self.master)
        os.close(self.slave)


@pytest.fixture
def desk(
    tmp_path: Path, sshd: SshdInfo, client_key: tuple[Path, str]
) -> Iterator[tuple[Bastion, SharedTerminal]]:
    """`bastion daemon &` then `bastion approve` on one terminal, the vault unlocked."""
    b = make_bastion(
        tmp_path, sshd, client_key[0], policy_toml(sshd, approval="per-command"), start=False
    )
    term = SharedTerminal()
    try:
        b.daemon = term.start(cli_argv(b.home.root, "daemon", *b.daemon_args))

        def answering() -> bool:
            assert b.daemon is not None and b.daemon.poll() is None, "the gateway exited"
            with contextlib.suppress(opsock.OperatorError):
                return bool(b.op("status"))
            return False

        wait_for(answering, timeout=30)
        b.cli("unlock", "--passphrase-stdin", stdin=PASSPHRASE + "\n")
        term.start(cli_argv(b.home.root, "approve", "--no-notify"), keyboard=True)
        term.pump(term.shows("waiting for cards"))
        yield b, term
    finally:
        term.close()
        b.close()


def command_card(b: Bastion, term: SharedTerminal, agent: Agent, command: str) -> int:
    """The agent asks to run `command`; the operator approves its session card and
    is shown its command card. Returns the agent's call."""
    rid = agent.start(command)
    term.pump(term.shows("approve? [y/n then Enter"))
    term.answer("y")  # the session card
    mark = len(term.raw)
    term.pump(term.shows("approve? [y/n then Enter", after=mark))  # the command card
    return rid


def logged(term: SharedTerminal, b: Bastion, request_id: str) -> None:
    """Wait until the gateway's log of a request's end has reached the terminal."""
    term.pump(term.shows(f"{request_id}: denied"))


def card_words(lines: list[str]) -> list[tuple[str, str]]:
    """The argv words of the last command card on the screen, as shown."""
    heading = re.compile(r"  command:  \d+ word\(s\), run as this argv \(no shell syntax\):")
    start = max(i for i, line in enumerate(lines) if heading.fullmatch(line))
    words = []
    for line in lines[start + 1 :]:
        m = re.fullmatch(r"\s+(\d+)  (\S.*)", line)
        if not m:
            break
        words.append((m.group(1), m.group(2)))
    return words


def the_card_shows(term: SharedTerminal, marker: Path) -> None:
    """What the operator reads on the card is the command that waits: touch MARKER."""
    lines = term.lines()
    assert card_words(lines) == [("0", "touch"), ("1", str(marker))], "\n".join(lines)
    assert not any(re.fullmatch(r"\s+0  uptime", line) for line in lines)


def approve_what_is_shown(agent: Agent, term: SharedTerminal, rid: int, marker: Path) -> None:
    """The operator approves what the screen shows; the marker proves it is what ran."""
    term.answer("y")
    result = agent.wait(rid)
    assert result.rc == 0, result.stderr
    assert marker.exists()


def no_escape_but_ours(raw: bytes) -> None:
    rest = OUR_STYLES.sub(b"", raw).replace(b"\r\n", b"\n")
    assert b"\x1b" not in rest, rest[rest.index(b"\x1b") - 200 :][:400]


def test_an_executable_path_in_the_log_cannot_repaint_the_card(
    desk: tuple[Bastion, SharedTerminal], tmp_path: Path
) -> None:
    b, term = desk
    hostile = tmp_path / f"bin{REPAINT}{PARK}"
    hostile.mkdir()
    agent = Agent(b.config, python=str(python_copy(hostile, "python")))
    b.agents.append(agent)
    marker = tmp_path / "MARKER"
    rid = command_card(b, term, agent, f"touch {marker}")

    # While the card waits, one more request: refused, but logged with the exe path.
    other = agent.run("true", host="nohost")
    assert other.code == "UNKNOWN_HOST"
    logged(term, b, other.error["request_id"])  # type: ignore[index]

    the_card_shows(term, marker)
    no_escape_but_ours(term.raw)
    screen = "".join(line.ljust(COLUMNS) for line in term.lines())
    assert "bin\\x0d\\x1b[17C\\x1b[K\\x1b[3A" in screen  # shown as text, not obeyed
    approve_what_is_shown(agent, term, rid, marker)


def test_a_proxy_header_user_and_host_in_the_log_cannot_repaint_the_card(
    desk: tuple[Bastion, SharedTerminal], tmp_path: Path
) -> None:
    b, term = desk
    agent = Agent(b.config)
    b.agents.append(agent)
    marker = tmp_path / "MARKER"
    rid = command_card(b, term, agent, f"touch {marker}")

    # The same agent names its target itself: a proxy of its own choosing, whose
    # header says user REPAINT at host PARK. Refused, but logged as it came.
    proxy = f"{sys.executable} {Path(proxy_mod.__file__)}"
    forged = f'ProxyCommand={proxy} --socket {b.home.agent_socket} "$EVIL_HOST" %p "$EVIL_USER"'
    other = agent.run(
        "true",
        host="nohost",
        ssh_args=("-o", forged),
        env={"EVIL_USER": REPAINT, "EVIL_HOST": f"nohost{PARK}"},
    )
    assert other.code == "UNSUPPORTED_REQUEST", other.stderr  # the ssh user is not its
    logged(term, b, other.error["request_id"])  # type: ignore[index]

    the_card_shows(term, marker)
    no_escape_but_ours(term.raw)
    screen = "".join(line.ljust(COLUMNS) for line in term.lines())
    assert "exec request for \\x0d\\x1b[17C\\x1b[K\\x1b[3A" in screen
    assert "@nohost\\x1b[70;1f" in screen
    approve_what_is_shown(agent, term, rid, marker)


def test_invisible_characters_reach_neither_pending_nor_approve_raw(
    desk: tuple[Bastion, SharedTerminal], tmp_path: Path
) -> None:
    """A filler, blank braille, a grapheme joiner and a combining overlay in the
    executable's path and in the conversation ref: shown as escapes everywhere."""
    b, term = desk
    hostile = tmp_path / f"bin{INVISIBLE}"
    hostile.mkdir()
    agent = Agent(b.config, python=str(python_copy(hostile, "python")))
    b.agents.append(agent)
    rid = agent.start("true", ssh_args=("-o", f"SetEnv=BASTION_CONVERSATION=ref{INVISIBLE}end"))
    term.pump(term.shows("approve? [y/n then Enter"))
    escaped = "\\u3164\\u2800\\u034f\\u0338"

    pending = b.cli("pending").stdout
    assert not any(ch in pending for ch in INVISIBLE), ascii(pending)
    assert f"bin{escaped}/python" in pending and f"ref{escaped}end" in pending

    text = term.raw.decode("utf-8", "replace")
    assert not any(ch in text for ch in INVISIBLE), ascii(text[-3000:])
    lines = term.lines()
    assert any(f"bin{escaped}/python" in line for line in lines)  # the card's exe
    assert any("the agent's claim" in line and f"ref{escaped}end" in line for line in lines)
    term.answer("n")
    assert agent.wait(rid).code == "SESSION_DENIED"
