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

A yes may be widened to a bounded grant (`core/grants`) with the same deliberateness: `g`,
then a digit per argv word to widen to `*`, Enter, a digit for the bound (`GRANT_BOUNDS`),
and Enter once more on the whole grant read back -- one key a read, under the same guard.
A `*` never matches an option (a word beginning with `-`), so a digit on one of the card's
options widens nothing, and the prompt says why (`GrantDraft.why_not`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from enum import Enum

from bastion.core.grants import Pattern, why_literal

GUARD = 0.4  # seconds after the card on screen changed in which input answers nothing
PASTE_ON = "\033[?2004h"  # ask the terminal to mark pastes (bracketed paste)...
PASTE_OFF = "\033[?2004l"  # ...and to stop, at exit
PASTE_START = "\033[200~"
PASTE_END = "\033[201~"
HELP = (
    "y or n then Enter answers (Esc cancels), g widens a yes to a grant, d details, "
    "a activity, s sessions, L lock the vault, q quit"
)
# What a grant's bound may be, one key each: (uses, minutes).
GRANT_BOUNDS: dict[str, tuple[int | None, int | None]] = {
    "1": (1, None),
    "2": (2, None),
    "3": (5, None),
    "4": (10, None),
    "5": (None, 10),
    "6": (None, 60),
}
ENTER = frozenset({"\r", "\n"})  # cbreak keeps ICRNL: Enter reads as "\n"; "\r" without it
# One key that is several bytes: Esc alone, Alt+key, a CSI or SS3 sequence (arrows, F-keys).
_ONE_SEQUENCE = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|O.|.)?", re.DOTALL)


class Mode(Enum):
    """What the prompt waits for: the state a read is decided in."""

    IDLE = "idle"  # no answer begun
    CONFIRM_APPROVE = "confirm_approve"  # `y` given to the card shown: Enter approves it
    CONFIRM_DENY = "confirm_deny"  # `n` given: Enter denies it
    PASTE = "paste"  # inside a bracketed paste: everything is discarded until its end
    GRANT_WORDS = "grant_words"  # `g`: digits choose the argv words a grant widens, Enter
    GRANT_BOUND = "grant_bound"  # then a digit chooses its bound (`GRANT_BOUNDS`)
    CONFIRM_GRANT = "confirm_grant"  # the grant read back: Enter approves with it


# An answer begun: a card change, a discarded read or a key out of place drops it.
CONFIRMING = frozenset(
    {
        Mode.CONFIRM_APPROVE,
        Mode.CONFIRM_DENY,
        Mode.GRANT_WORDS,
        Mode.GRANT_BOUND,
        Mode.CONFIRM_GRANT,
    }
)


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
    ASK_GRANT = "ask_grant"  # `g`: show the argv words, numbered, to choose from
    GRANT_WORD = "grant_word"  # a digit: that word is widened to * (or back); `Decision.key`
    ASK_BOUND = "ask_bound"  # Enter after the words: show the bounds to choose from
    GRANT_BOUND = "grant_bound"  # a digit: that bound; read the grant back (`Decision.key`)
    APPROVE_GRANT = "approve_grant"  # Enter on the grant read back: send yes with it
    SHOW_ACTIVITY = "show_activity"  # `a`: the last requests, as `bastion audit activity`
    SHOW_SESSIONS = "show_sessions"  # `s`: the live sessions, as `bastion sessions`


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
    key: str = ""  # GRANT_WORD, GRANT_BOUND: the digit pressed


@dataclass(frozen=True)
class GrantDraft:
    """The grant being chosen for the card shown: which of its argv words become `*` (the
    program, word 0, never does, nor does an option, which a `*` never matches; a digit
    reaches words 1 to 9) and its bound."""

    argv: tuple[str, ...]
    wild: frozenset[int] = frozenset()
    bound: tuple[int | None, int | None] | None = None  # (uses, minutes)

    def why_not(self, key: str) -> str | None:
        """Why that digit widens nothing, or None when it does: there is no such word, or
        the word must stay literal (`core/grants.why_literal`: an option)."""
        at = int(key)
        if not 1 <= at < len(self.argv):
            return f"no word {key} to widen"
        why = why_literal(self.argv, at)
        return None if why is None else f"word {key} cannot be *: {why}"

    def toggled(self, key: str) -> GrantDraft | None:
        """The draft with that word widened (or back); None where `why_not` says why not."""
        if self.why_not(key) is not None:
            return None
        return replace(self, wild=self.wild ^ {int(key)})

    def bounded(self, key: str) -> GrantDraft:
        return replace(self, bound=GRANT_BOUNDS[key])

    def pattern(self) -> str:
        """As `core/grants.parse_grant` reads it: the card's words, quoted, `*` bare."""
        words = tuple(None if i in self.wild else w for i, w in enumerate(self.argv))
        return Pattern(words).text

    def request(self) -> dict[str, object]:
        """The `grant` argument of the operator socket's `answer`."""
        uses, minutes = self.bound or (None, None)
        return {"pattern": self.pattern(), "uses": uses, "minutes": minutes}


def bound_text(bound: tuple[int | None, int | None]) -> str:
    uses, minutes = bound
    if uses is not None:
        return f"{uses} use{'s' if uses != 1 else ''}"
    return f"{minutes} minutes"


BOUND_CHOICES = "  ".join(f"{k}) {bound_text(b)}" for k, b in GRANT_BOUNDS.items())


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
    if mode is Mode.GRANT_WORDS and key.isdigit() and key != "0":
        return Decision(Mode.GRANT_WORDS, (Act.GRANT_WORD,), key=key)
    if mode is Mode.GRANT_WORDS and key in ENTER:
        return Decision(Mode.GRANT_BOUND, (Act.ASK_BOUND,))
    if mode is Mode.GRANT_BOUND and key in GRANT_BOUNDS:
        return Decision(Mode.CONFIRM_GRANT, (Act.GRANT_BOUND,), key=key)
    if mode is Mode.CONFIRM_GRANT and key in ENTER:
        return Decision(Mode.IDLE, (Act.APPROVE_GRANT,))
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
    if card_shown and key == "g":
        return Decision(Mode.GRANT_WORDS, (Act.ASK_GRANT,))
    if key == "a":
        return Decision(Mode.IDLE, (Act.SHOW_ACTIVITY,))
    if key == "s":
        return Decision(Mode.IDLE, (Act.SHOW_SESSIONS,))
    return Decision(Mode.IDLE)  # any other key, `Y` and `N` among them: nothing
