"""An agent's stdin on a command card: what was read of it, and when it cannot be shown.

A command card approves exact bytes, and a command reads its stdin: `printf 'rm -rf
/' | ssh host sh` is approved as "sh" unless the card shows the script too. So before
a command card the gateway reads the agent's stdin whole (`gateway/stdin.py`, when
`gate.reads_stdin` says so), bounded by `MAX_CARD_STDIN`; the card shows its size,
sha256 and first bytes, a yes is bound to its digest (`Binding.stdin`), and the
target gets exactly those bytes, then EOF. What could not be read whole is refused
(`stdin_problem`): never shown as if it were all.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass

from bastion.core.defaults import MAX_CARD_STDIN, STDIN_DEADLINE, STDIN_PREVIEW, STDIN_WAIT


class StdinEnd(enum.Enum):
    """How reading an agent's stdin whole, before its command card, ended."""

    CLOSED = "closed"  # the agent sent EOF: these bytes are all of it
    SILENT = "silent"  # still open, and nothing came within STDIN_WAIT: the command gets none
    TOO_LARGE = "too_large"  # more than MAX_CARD_STDIN bytes: that is file transfer's job
    UNFINISHED = "unfinished"  # bytes came, then no EOF within the wait: never seen whole


@dataclass(frozen=True)
class Stdin:
    """An agent's stdin as a command card shows it and a yes is bound to it: read whole
    before the card (`gateway/stdin.py`), so the target gets exactly these bytes and
    then EOF. Never its content in the journal: size and digest only."""

    end: StdinEnd
    size: int  # bytes read: all of them, unless TOO_LARGE (then one past the bound)
    sha256: str  # of the bytes read
    preview: bytes  # their first STDIN_PREVIEW bytes, for the card (escaped there)

    @classmethod
    def of(cls, data: bytes, end: StdinEnd) -> Stdin:
        """The record of `data`, read until `end`."""
        return cls(end, len(data), hashlib.sha256(data).hexdigest(), data[:STDIN_PREVIEW])


def digest_of(stdin: Stdin | None) -> str | None:
    """What a grant binds of a request's stdin: the digest of the bytes read, or None
    when it was not read (it streams to the target as it comes)."""
    return stdin.sha256 if stdin is not None else None


def stdin_problem(stdin: Stdin | None) -> str | None:
    """Why this stdin cannot be shown on a card and sent exactly as approved, or None."""
    if stdin is None:
        return None
    if stdin.end is StdinEnd.TOO_LARGE:
        return (
            f"this command's stdin is larger than {MAX_CARD_STDIN} bytes "
            f"({MAX_CARD_STDIN // 1024} KiB), the most an approval card shows and binds. "
            "Copy files with file transfer through bastion (scp or sftp: `scp FILE "
            "HOST:PATH`, `sftp HOST`), then run the command on the copy"
        )
    if stdin.end is StdinEnd.UNFINISHED:
        return (
            f"this command's stdin sent {stdin.size} bytes and then no end (EOF) within "
            f"{STDIN_WAIT:g}s of silence or {STDIN_DEADLINE:g}s in all: a card shows stdin "
            "whole, so it must end before the card is raised. Give it an end (`< FILE`, a "
            "pipe whose writer exits), or none (`ssh -n`)"
        )
    return None
