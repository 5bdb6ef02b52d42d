"""Cards cannot lie (issue 8, acceptance 4): `bastion approve` in a real pty,
its screen rendered by a terminal emulator (pyte), for an agent whose
executable path, conversation ref and command are full of ESC sequences,
carriage returns, bidi overrides and zero-width characters."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pyte

from tests.harness import Agent, Bastion, Terminal, make_bastion, policy_toml, python_copy

HOSTILE = "\r\x1b[2K  command:  uptime\x1b[8m\u202e\u200b"
# The prompt's own control: its colours, the bell for a new card, and the status
# line's "back to the start, erase the line" (cli/prompt.py CLEAR_LINE, notify.BELL), and
# bracketed paste on and off (cli/promptkeys.py PASTE_ON, PASTE_OFF).
OUR_STYLES = re.compile(rb"\x1b\[(?:0|1|2|31|32|33)m|\r\x1b\[K|\x07|\x1b\[\?2004[hl]")


def test_every_string_on_a_card_is_escaped_and_the_screen_shows_the_real_command(
    tmp_path: Path, sshd: object, client_key: tuple[Path, str]
) -> None:
    b: Bastion = make_bastion(
        tmp_path,
        sshd,
        client_key[0],
        policy=policy_toml(sshd, approval="per-command"),  # type: ignore[arg-type]
    )
    term = None
    try:
        weird = tmp_path / f"bin{HOSTILE}"
        weird.mkdir()
        python = python_copy(weird, "python")
        agent = Agent(b.config, python=str(python))
        b.agents.append(agent)
        term = Terminal(
            [sys.executable, "-m", "bastion.cli", "--home", str(b.home.root), "approve"]
        )
        term.expect("waiting for cards")
        command = f"touch {tmp_path}/ran{HOSTILE}"
        conversation = ("-o", f'SetEnv=BASTION_CONVERSATION="{HOSTILE}"')
        rid = agent.start(command, ssh_args=conversation)
        term.expect("approve? [y/n then Enter")
        term.answer("y")  # the session card
        term.expect("approved")
        shown = term.expect("approve? [y/n then Enter")  # the command card
        raw = term.raw
        term.answer("n")
        term.expect("denied")
        assert agent.wait(rid).code == "CALL_DENIED"
        assert not list(tmp_path.glob("ran*"))

        # Nothing the agent wrote reached the terminal as control: the only escape
        # sequences on the wire are the prompt's own colours.
        rest = OUR_STYLES.sub(b"", raw).replace(b"\r\n", b"\n")
        assert b"\x1b" not in rest and b"\r" not in rest
        text = rest.decode()
        for hidden in ("\u202e", "\u200b"):
            assert hidden not in text

        # What a person sees, rendered as a terminal would.
        screen = pyte.Screen(200, 80)
        stream = pyte.ByteStream(screen)
        stream.feed(raw)
        lines = [line.rstrip() for line in screen.display]
        assert not any(line.lstrip().startswith("command:  uptime") for line in lines)
        escaped = "\\x0d\\x1b[2K  command:  uptime\\x1b[8m\\u202e\\u200b"
        command_line = next(line for line in lines if "touch" in line and "ran" in line)
        assert f"touch {tmp_path}/ran{escaped}" in command_line
        assert any(f"bin{escaped}/python" in line for line in lines)  # the exe path
        claim = next(line for line in lines if "the agent's claim" in line)
        assert escaped in claim
        assert "USES SHELL SYNTAX" in shown
    finally:
        if term is not None:
            term.close()
        b.close()
