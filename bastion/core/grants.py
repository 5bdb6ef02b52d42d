"""Bounded grants: an operator's yes to a command card, widened to a pattern, briefly.

A per-command account asks a card for every command; a session account covers
everything. A grant is the middle, and only ever explicit: answering a command
card yes, the operator may add "and commands matching PATTERN, for K uses or N
minutes (whichever ends first)". PATTERN is the card's own argv with chosen
words replaced by `*`; a `*` stands for exactly one argv word that is not an
option (`command.is_option`: it begins with `-`) -- never a glob inside a word,
never any number of words. That is what a `*` matches in every admitting rule
(`allow`, `preapproved`): a word beginning with `-` can change what a program does
(`make --eval=...`, `tar --to-command=...`), so an option is covered only where the
pattern spells it, as the card's own word. The first word (the program) and the
card's options stay literal (`why_literal`). Shell source has no argv and is
never granted.

A grant is bound like the session it extends (`Session`): the subject key
(the run, or the one process in one exec), host, account, gateway lifetime,
vault epoch and policy entry digest, and it ends with that session. It only
replaces the card: a command it covers still passes every earlier step of the
gate (the account's allow and deny rules above all), has no stdin bytes (its
stdin read and empty) and no terminal, and each use is taken before the
command leaves. Records here are pure; the book (`gateway/approvals.py`)
keeps the live ones.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from bastion.core.command import is_option
from bastion.core.errors import BastionError
from bastion.core.subject import SubjectKey

WILD = "*"  # a pattern word that matches any one argv word that is not an option
# Why a card's option stays as spelled: parse_grant's refusal and the prompt's note say it.
OPTION_KEPT = (
    "a * never matches a word that begins with -, so this pattern could not match even "
    "the card's own command; keep the option as spelled"
)
MAX_USES = 100
MAX_MINUTES = 480
_PLAIN = re.compile(r"[A-Za-z0-9@%+=:,./_-]+")
_BLANKS = " \t"


class GrantError(BastionError):
    """An operator's grant that cannot be made as asked: the message says why."""


class GrantEnd(enum.Enum):
    """Why a grant ended on its own; one that ends with its session keeps that
    session's reason (`EndReason`)."""

    USED_UP = "used_up"
    EXPIRED = "expired"


@dataclass(frozen=True)
class Pattern:
    """The argv words a grant covers: a literal word, or None where the card's word
    was replaced by `*`. The first word and every option are literal (`parse_grant`)."""

    words: tuple[str | None, ...]

    def matches(self, argv: tuple[str, ...] | None) -> bool:
        """Exactly as many words, each literal one equal, each `*` one word that is not
        an option (as in every admitting rule: an option is covered only where spelled);
        shell source (None) never. Checked here, not only at `parse_grant`: a pattern is
        a record anyone may build."""
        if argv is None or len(argv) != len(self.words):
            return False
        return all(
            a == w if w is not None else not is_option(a)
            for w, a in zip(self.words, argv, strict=True)
        )

    @property
    def text(self) -> str:
        """The pattern as the operator wrote it: literal words quoted where a shell
        would need it (a literal `*` reads `'*'`), wildcards as `*`."""
        return " ".join(WILD if w is None else quote_word(w) for w in self.words)


@dataclass(frozen=True)
class Bound:
    """How long a grant lasts: uses (1..MAX_USES) and/or minutes (1..MAX_MINUTES),
    at least one; with both, whichever ends first."""

    uses: int | None
    minutes: int | None


@dataclass(frozen=True)
class BoundedGrant:
    """A live bounded grant, as the book keeps it and the gate reads it."""

    id: str
    card_id: str  # the command card whose yes made it
    session_id: str  # the session it extends, and ends with
    subject_key: SubjectKey
    host: str
    user: str
    boot_id: str
    vault_epoch: int
    entry_digest: str
    pattern: Pattern
    uses_left: int | None  # None: bounded by time alone
    expires_at: float | None  # None: bounded by uses alone
    made_at: float

    def live(self, now: float) -> bool:
        """Not used up, not expired."""
        return self.end_reason(now) is None

    def holds(
        self,
        *,
        session_id: str,
        subject_key: SubjectKey,
        host: str,
        user: str,
        boot_id: str,
        vault_epoch: int,
        entry_digest: str,
        now: float,
    ) -> bool:
        """Live, and bound to exactly this session, subject, entry, lifetime and epoch."""
        return (
            self.live(now)
            and self.session_id == session_id
            and self.subject_key == subject_key
            and self.host.lower() == host.lower()
            and self.user == user
            and self.boot_id == boot_id
            and self.vault_epoch == vault_epoch
            and self.entry_digest == entry_digest
        )

    def end_reason(self, now: float) -> GrantEnd | None:
        """Why it is no longer live, if it is not."""
        if self.uses_left is not None and self.uses_left <= 0:
            return GrantEnd.USED_UP
        if self.expires_at is not None and now >= self.expires_at:
            return GrantEnd.EXPIRED
        return None

    def as_json(self) -> dict[str, object]:
        """What `bastion sessions` and the journal show of it."""
        return {
            "id": self.id,
            "card": self.card_id,
            "session_id": self.session_id,
            "pattern": self.pattern.text,
            "pattern_words": list(self.pattern.words),
            "uses_left": self.uses_left,
            "expires_at": self.expires_at,
            "made_at": self.made_at,
        }


def parse_grant(card_argv: tuple[str, ...] | None, text: str) -> Pattern:
    """The operator's PATTERN, read against the card's own argv: split as a POSIX
    shell splits words, it has as many words as the argv, each the argv's word or
    `*`, the program and the card's options literal (`why_literal`: a `*` there could
    not match even the card's own command). A word that is literally `*` on the card
    stays literal (the narrower reading); every other mismatch is refused, never
    guessed."""
    if card_argv is None:
        raise GrantError(
            "this card's command is shell source, which has no argv: a grant covers argv "
            "words only, so answer this card alone"
        )
    words = split_pattern(text)
    if len(words) != len(card_argv):
        raise GrantError(
            f"the grant pattern has {len(words)} word(s) and the card's command has "
            f"{len(card_argv)}: write the card's argv with the words to widen replaced by *"
            f" (the card's argv: {Pattern(tuple(card_argv)).text})"
        )
    for i, (word, card_word) in enumerate(zip(words, card_argv, strict=True)):
        if word is None and (why := why_literal(card_argv, i)) is not None:
            raise GrantError(f"word {i + 1} of the grant pattern cannot be *: {why}")
        if word is not None and word != card_word:
            raise GrantError(
                f"word {i + 1} of the grant pattern is {quote_word(word)}, the card's is "
                f"{quote_word(card_word)}: each word is the card's own, or * (unquoted)"
            )
    return Pattern(tuple(words))


def why_literal(argv: tuple[str, ...], index: int) -> str | None:
    """Why word `index` of a card's argv (0: the program) cannot become a `*` in a
    pattern, or None when it can. Without the word's number: `parse_grant` counts the
    program as word 1, the prompt's digits count it as 0."""
    if index == 0:
        return "it is the first word (the program), which a grant pattern keeps literal"
    if is_option(argv[index]):
        return f"{quote_word(argv[index])} is an option, and {OPTION_KEPT}"
    return None


def split_pattern(text: str) -> list[str | None]:
    """The operator's pattern as words: blanks separate them, 'single' and "double"
    quotes hold literal text (a quoted '*' is a literal star), and an unquoted `*`
    standing alone is a wildcard (None). A `*` inside a word, a backslash, `$` or a
    backquote is refused: a pattern is words, never a glob or shell text."""
    words: list[str | None] = []
    word: list[str] | None = None
    wild = False  # the current word is one unquoted `*`, so far
    i, n = 0, len(text)
    while i <= n:
        ch = text[i] if i < n else " "
        if ch in _BLANKS:
            if word is not None:
                words.append(None if wild else "".join(word))
            word, wild = None, False
            i += 1
            continue
        if word is None:
            word, wild = [], ch == WILD
        elif wild or ch == WILD:
            raise GrantError(
                "a * in a grant pattern stands alone for one whole word; it is never a glob "
                "inside a word (quote it, '*', for a literal star)"
            )
        if ch in "'\"":
            end = text.find(ch, i + 1)
            if end < 0:
                raise GrantError("the grant pattern has an unclosed quote")
            inner = text[i + 1 : end]
            if ch == '"' and any(c in inner for c in "$`\\!"):
                raise GrantError("use single quotes in a grant pattern for $ ` \\ or ! in a word")
            word.extend(inner)
            i = end + 1
            continue
        if ch in "\\$`;|&<>()\n":
            raise GrantError(
                f"the grant pattern holds {ch!r}: a pattern is the card's argv words, quoted "
                "where needed ('like this'), with * for a word that may vary"
            )
        if ch != WILD:
            word.append(ch)
        i += 1
    return words


def quote_word(word: str) -> str:
    """A literal word as a pattern (and a POSIX shell) reads it back: bare when plain,
    else in single quotes."""
    if _PLAIN.fullmatch(word):
        return word
    return "'" + word.replace("'", "'\"'\"'") + "'"


def parse_bound(uses: int | None, minutes: int | None) -> Bound:
    """The grant's bound, checked: at least one of uses and minutes, each in range."""
    if uses is None and minutes is None:
        raise GrantError("a grant needs a bound: uses (1..100) and/or minutes (1..480)")
    for name, value, most in (("uses", uses, MAX_USES), ("minutes", minutes, MAX_MINUTES)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
            raise GrantError(f"a grant's {name} must be a whole number from 1 to {most}")
    return Bound(uses, minutes)
