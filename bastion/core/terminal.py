"""The terminal an agent's ssh client asked for, as one record.

`ssh -t`/`-tt` (and ansible, without pipelining) send a `pty-req` before their
exec: a terminal type, a size, and the terminal's modes. The gateway answers it
yes and only notes it (`gateway/agent_channel.py`): a refusal there would leave
OpenSSH's client reporting failure while its exec, already sent, ran. The gate
then decides -- the account's `pty` says whether such a request runs at all --
and, where it runs, the target makes exactly the terminal the client asked for.

What is checked here is that it can be made exactly: a short printable type, a
sane size, modes as RFC 4254 section 8 encodes them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from bastion.core.contract import NOT_SENT

MAX_TERM_TYPE = 64  # bytes; terminfo names are short
MAX_CELLS = 10_000  # columns or rows
MAX_PIXELS = 100_000  # width or height in pixels
MAX_MODES = 1024  # bytes of the encoded modes
_TERM_TYPE = re.compile(rb"[A-Za-z0-9._+-]*")
_MODES_END = 0  # TTY_OP_END
_FIRST_UNDEFINED = 160  # opcodes 160..255 are undefined: parsing stops there
# The gate's words for a terminal on an account without `pty` (UNSUPPORTED_REQUEST).
NO_TERMINAL = (
    "This ssh client asked for a terminal (-t, -tt or RequestTTY), and {account} runs "
    "commands without one: the command was not run, so nothing of it happened on the "
    "target. Run ssh without -t/-tt (or with -o RequestTTY=no); for ansible, turn "
    "pipelining on (pipelining = True under [ssh_connection] in ansible.cfg, or "
    "ANSIBLE_PIPELINING=1); or ask the operator to set `pty = true` on this account in "
    "the policy. Nothing was sent."
)


@dataclass(frozen=True)
class Terminal:
    """A `pty-req` as the client sent it: what the target's terminal is made of."""

    term_type: bytes
    columns: int
    rows: int
    width: int  # pixels
    height: int  # pixels
    modes: bytes  # encoded: (opcode byte, uint32 value)*, then TTY_OP_END

    @property
    def size(self) -> tuple[int, int, int, int]:
        return (self.columns, self.rows, self.width, self.height)


def modes_of(encoded: bytes) -> dict[int, int] | None:
    """The modes, opcode to value, or None where the encoding is broken."""
    modes: dict[int, int] = {}
    at = 0
    while at < len(encoded):
        opcode = encoded[at]
        if opcode == _MODES_END or opcode >= _FIRST_UNDEFINED:
            return modes
        if at + 5 > len(encoded):
            return None
        modes[opcode] = int.from_bytes(encoded[at + 1 : at + 5], "big")
        at += 5
    return modes


def terminal_problem(t: Terminal) -> str | None:
    """What the agent is told when this terminal cannot be made on the target as
    asked (the gate's intake, UNSUPPORTED_REQUEST), or None."""
    if len(t.term_type) > MAX_TERM_TYPE or not _TERM_TYPE.fullmatch(t.term_type):
        why = (
            "its terminal type is not a short name of letters, digits and ._+- "
            f"(at most {MAX_TERM_TYPE} bytes)"
        )
    elif max(t.columns, t.rows) > MAX_CELLS or max(t.width, t.height) > MAX_PIXELS:
        why = (
            f"its terminal size {t.columns}x{t.rows} ({t.width}x{t.height} pixels) is "
            f"beyond {MAX_CELLS} cells or {MAX_PIXELS} pixels"
        )
    elif len(t.modes) > MAX_MODES or modes_of(t.modes) is None:
        why = "its terminal modes are not encoded as RFC 4254 says"
    else:
        return None
    return f"This ssh client asked for a terminal that cannot be made as asked: {why}. {NOT_SENT}"
