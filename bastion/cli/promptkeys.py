"""What a read of the operator's keyboard means to `bastion approve`: pure, so every rule is
tested without a terminal.

An answer is two deliberate keys: `y` (or `n`), then Enter, given to the card still shown.
Input that cannot be a person's intent for the card on screen answers nothing: a read that
brings more than one key at once (typed ahead, or pasted by a terminal that does not mark
pastes), a bracketed paste, and anything that arrives within GUARD seconds of the card on
screen changing (it was meant for what was there before). Each is discarded whole, with a
note. Keys are case-sensitive: `L` locks, `l` (as in "clear" typed into the wrong pane) does
nothing. `L` alone is exempt from the guard: locking only takes authority away, and a stream
of cards must not be able to keep the operator from it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

GUARD = 0.4  # seconds after the card on screen changed in which input answers nothing
PASTE_ON = "\033[?2004h"  # ask the terminal to mark pastes (bracketed paste)...
PASTE_OFF = "\033[?2004l"  # ...and to stop, at exit
PASTE_START = "\033[200~"
PASTE_END = "\033[201~"
HELP = "y or n then Enter answers (Esc cancels), d details, L lock the vault, q quit"
ENTER = frozenset({"\r", "\n"})  # cbreak keeps ICRNL: Enter reads as "\n"; "\r" without it
# One key that is several bytes: Esc alone, Alt+key, a CSI or SS3 sequence (arrows, F-keys).
_ONE_SEQUENCE = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|O.|.)?", re.DOTALL)


class Mode(Enum):
    """What the prompt waits for: the state a read is decided in."""

    IDLE = "idle"  # no answer begun
    CONFIRM_APPROVE = "confirm_approve"  # `y` given to the card shown: Enter approves it
    CONFIRM_DENY = "confirm_deny"  # `n` given: Enter denies it
    PASTE = "paste"  # inside a bracketed paste: everything is discarded until its end


CONFIRMING = frozenset({Mode.CONFIRM_APPROVE, Mode.CONFIRM_DENY})


class Act(Enum):
    """What the prompt does about a read, in order."""

    CANCEL = "cancel"  # the begun answer is dropped (any key but Enter, or a discarded read)
    ASK_APPROVE = "ask_approve"  # `y`: echo the pending approval, wait for Enter
    ASK_DENY = "ask_deny"  # `n`: echo the pending denial, wait for Enter
    APPROVE = "approve"  # Enter after `y`: send the answer
    DENY = "deny"  # Enter after `n`: send the answer
    DETAILS = "details"
    LOCK = "lock"
    QUIT = "quit"
    IGNORED_GUARD = "ignored_guard"  # notes: what was discarded, and why
    IGNORED_PASTE = "ignored_paste"
    IGNORED_BURST = "ignored_burst"  # several keys in one read
    HINT_LOCK = "hint_lock"  # `l`: nothing; the prompt says once that `L` locks


# What the prompt says about a read it discarded, or about a key that does nothing.
NOTES: dict[Act, str] = {
    Act.IGNORED_GUARD: f"input within {GUARD} s of a new card ignored",
    Act.IGNORED_PASTE: "pasted text ignored: a paste never answers a card",
    Act.IGNORED_BURST: "several keys in one read (typed ahead or pasted) ignored: "
    "one key, then Enter",
    Act.HINT_LOCK: "l: nothing; L locks",
}


@dataclass(frozen=True)
class Decision:
    mode: Mode
    acts: tuple[Act, ...] = ()
    carry: str = ""  # inside a paste: the read's tail, put before the next read (a split end)


def one_key(chunk: str) -> str | None:
    """The key a read holds, if it holds exactly one; None for none or several."""
    if len(chunk) == 1:
        return chunk
    if chunk.startswith("\x1b") and _ONE_SEQUENCE.fullmatch(chunk):
        return chunk
    return None


def _paste(mode: Mode, chunk: str) -> Decision | None:
    """A read inside or touching a bracketed paste: discarded, and where the paste stands."""
    start, end = chunk.rfind(PASTE_START), chunk.rfind(PASTE_END)
    if mode is not Mode.PASTE and start < 0 and end < 0:
        return None
    if start > end:
        after = Mode.PASTE  # a paste began and has not ended in this read
    elif end >= 0:
        after = Mode.IDLE
    else:
        after = mode  # still inside the paste
    cancel = (Act.CANCEL,) if mode in CONFIRMING else ()
    noted = () if mode is Mode.PASTE else (Act.IGNORED_PASTE,)
    carry = chunk[-(len(PASTE_END) - 1) :] if after is Mode.PASTE else ""
    return Decision(after, cancel + noted, carry)


def decide(mode: Mode, chunk: str, since_change: float, card_shown: bool) -> Decision:
    """What a read means, given what the prompt waits for and the seconds since the card
    on screen last changed (shown, withdrawn, replaced or redrawn)."""
    pasted = _paste(mode, chunk)
    if pasted is not None:
        return pasted
    cancel = (Act.CANCEL,) if mode in CONFIRMING else ()
    key = one_key(chunk)
    if key == "L":
        return Decision(Mode.IDLE, (*cancel, Act.LOCK))
    if since_change < GUARD:
        return Decision(Mode.IDLE, (*cancel, Act.IGNORED_GUARD))
    if key is None:
        return Decision(Mode.IDLE, (*cancel, Act.IGNORED_BURST))
    if mode is Mode.CONFIRM_APPROVE and key in ENTER:
        return Decision(Mode.IDLE, (Act.APPROVE,))
    if mode is Mode.CONFIRM_DENY and key in ENTER:
        return Decision(Mode.IDLE, (Act.DENY,))
    if cancel:
        return Decision(Mode.IDLE, cancel)  # anything but Enter cancels, and only cancels
    if key == "q":
        return Decision(Mode.IDLE, (Act.QUIT,))
    if key == "l":
        return Decision(Mode.IDLE, (Act.HINT_LOCK,))
    if card_shown and key == "y":
        return Decision(Mode.CONFIRM_APPROVE, (Act.ASK_APPROVE,))
    if card_shown and key == "n":
        return Decision(Mode.CONFIRM_DENY, (Act.ASK_DENY,))
    if card_shown and key == "d":
        return Decision(Mode.IDLE, (Act.DETAILS,))
    return Decision(Mode.IDLE)  # any other key, `Y` and `N` among them: nothing
