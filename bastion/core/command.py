"""Reading a command the way the target's shell will: an argv, or shell source.

sshd runs every exec request as `$SHELL -c STRING`, so a rule over the string
decides nothing: `systemctl status x; id` starts with `systemctl status `.
`read_command` turns the string into an argv only when every POSIX shell
(sh, bash, dash, zsh, ksh) would run exactly that argv: words of plain
characters, `'single'` and `"double"` quoted text without `$`, a backquote,
a backslash or `!` inside, separated by blanks. A word is judged where the
shell judges it, after quote removal too: zsh expands `''=ls` as it does
`=ls`, and runs `'ex'ec` as `exec`. Anything else is *shell source*,
reported with every construct found and its byte offset. When in doubt it is
shell source: a plain command that reads as source only costs a card, a
source command that read as plain would cost the target.

Rules (`allow`, `preapproved`, `deny`) are word patterns, parsed here too:
each word is an `fnmatch` glob over exactly one argv word, and a final `...`
matches any further words.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

MAX_CONSTRUCTS = 32  # a card lists this many; the count says if there were more

# Characters some POSIX shell gives a meaning to when they stand unquoted.
_UNQUOTED = {
    ";": "command separator",
    "&": "background or and-list",
    "|": "pipe or or-list",
    "<": "redirection",
    ">": "redirection",
    "(": "subshell or substitution",
    ")": "subshell or substitution",
    "$": "parameter expansion or substitution",
    "`": "command substitution",
    "\\": "backslash escape",
    "{": "brace expansion or group",
    "}": "brace expansion or group",
    "*": "glob",
    "?": "glob",
    "[": "glob",
    "]": "glob",
    "~": "tilde expansion",
    "#": "comment",
    "!": "history expansion or negation",
    "^": "pattern (zsh) or pipe (old sh)",
}
# Inside either kind of quotes: what still expands somewhere, or ends the quote early.
_QUOTED = {
    "$": "expansion inside quotes",
    "`": "command substitution inside quotes",
    "\\": "backslash inside quotes",
    "!": "history expansion inside quotes",
}
# A command position taken by one of these changes the grammar of what follows.
_RESERVED = frozenset(
    {
        *("if", "then", "else", "elif", "fi", "case", "esac", "for", "select", "while"),
        *("until", "do", "done", "in", "function", "time", "coproc", "repeat", "foreach"),
        *("nocorrect", "noglob", "builtin", "command", "exec", "eval"),
        "-",  # zsh's precommand modifier: `'-' touch x` runs touch
    }
)
_PATTERN_CHARS = frozenset("*?[]")  # rules: glob characters are pattern syntax, not shell
_BLANKS = frozenset(" \t")
REST = "..."  # a rule's final word: any further words


@dataclass(frozen=True)
class Construct:
    """One piece of shell syntax: where it starts (a byte offset), what it is."""

    offset: int
    text: str
    what: str

    def describe(self) -> str:
        return f"{self.text!r} at byte {self.offset} ({self.what})"

    def as_json(self) -> dict[str, object]:
        return {"offset": self.offset, "text": self.text, "what": self.what}


@dataclass(frozen=True)
class Reading:
    """What a command is: an argv every POSIX shell agrees on, or shell source."""

    argv: tuple[str, ...] | None
    constructs: tuple[Construct, ...] = ()
    more: int = 0  # constructs found beyond MAX_CONSTRUCTS

    @property
    def is_argv(self) -> bool:
        return self.argv is not None

    def summary(self) -> str:
        """The constructs, for a person or a model rewriting the command."""
        listed = ", ".join(c.describe() for c in self.constructs)
        return listed + (f", and {self.more} more" if self.more else "")


def _construct(text: str, i: int, what: str) -> tuple[int, str, str]:
    return (i, text[i], what)


def _scan(text: str, patterns: bool) -> tuple[list[str], list[tuple[int, str, str]]]:
    """Split into words, noting every construct (as character offsets)."""
    words: list[str] = []
    found: list[tuple[int, str, str]] = []
    word: list[str] | None = None  # None between words
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch in _BLANKS:
            if word is not None:
                words.append("".join(word))
                word = None
            i += 1
            continue
        if word is None:
            word = []
        if ch == "=" and not word:  # zsh expands `=ls`, `''=ls` and `""=ls` alike
            found.append((i, ch, "'=' expansion (zsh) at the start of a word"))
        if ch in "'\"":
            end = text.find(ch, i + 1)
            if end < 0:
                found.append((i, ch, "unclosed quote"))
                break
            for j in range(i + 1, end):
                c = text[j]
                if c in _QUOTED:
                    found.append((j, c, _QUOTED[c]))
                elif not (" " <= c <= "~" or c == "\t"):
                    found.append(_odd(text, j))
            word.extend(text[i + 1 : end])
            i = end + 1
            continue
        if " " <= ch <= "~":
            if ch in _UNQUOTED and not (patterns and ch in _PATTERN_CHARS):
                found.append((i, ch, _UNQUOTED[ch]))
            word.append(ch)
        else:
            found.append(_odd(text, i))
            word.append(ch)
        i += 1
    if word is not None:
        words.append("".join(word))
    return words, found


def _odd(text: str, i: int) -> tuple[int, str, str]:
    ch = text[i]
    if ch == "\n":
        return (i, ch, "newline (a command separator)")
    if ch == "\r":
        return (i, ch, "carriage return")
    if ord(ch) < 0x20 or ord(ch) == 0x7F:
        return (i, ch, f"control character U+{ord(ch):04X}")
    return (i, ch, f"non-ASCII character U+{ord(ch):04X} (may look like syntax it is not)")


def _byte_offsets(text: str, positions: list[int]) -> list[int]:
    if text.isascii():
        return positions
    out, seen, last = [], 0, 0
    for pos in positions:  # ascending
        seen += len(text[last:pos].encode("utf-8", "surrogatepass"))
        last = pos
        out.append(seen)
    return out


def read_command(command: str) -> Reading:
    """The argv the target's shell would run, or why it is shell source."""
    words, found = _scan(command, patterns=False)
    if words and "=" in words[0] and not found:
        found.append((command.index("="), "=", "variable assignment before the command"))
    if words and words[0] in _RESERVED and not found:
        start = len(command) - len(command.lstrip(" \t"))
        found.append((start, words[0], "a shell keyword or builtin that runs what follows"))
    if not found:
        return Reading(tuple(words))
    found.sort()
    offsets = _byte_offsets(command, [f[0] for f in found])
    constructs = tuple(
        Construct(off, text, what) for off, (_, text, what) in zip(offsets, found, strict=True)
    )
    return Reading(None, constructs[:MAX_CONSTRUCTS], max(0, len(constructs) - MAX_CONSTRUCTS))


@dataclass(frozen=True)
class WordRule:
    """A rule over argv: one glob per word, and `...` last for any further words."""

    text: str
    words: tuple[str, ...]
    rest: bool

    def matches(self, argv: tuple[str, ...]) -> bool:
        if len(argv) < len(self.words) or (len(argv) > len(self.words) and not self.rest):
            return False
        return all(fnmatch.fnmatchcase(a, w) for a, w in zip(argv, self.words, strict=False))

    def matches_text(self, command: str) -> bool:
        """Deny rules only: the rule as one glob over the raw string (a guardrail)."""
        return fnmatch.fnmatchcase(command, self.text)


class RuleError(ValueError):
    """A rule that is not a list of words; the message shows the new form."""


def parse_rule(text: str) -> WordRule:
    words, found = _scan(text, patterns=True)
    if found:
        first = Construct(*found[0])
        raise RuleError(
            f"rule {text!r} uses shell syntax ({first.describe()}): a rule is a list of "
            "words matched against the command's argv, each word a glob over one word "
            '(* ? [abc]), with "..." last for any further words, e.g. '
            '"systemctl status *" or "journalctl -u app ..."'
        )
    rest = bool(words) and words[-1] == REST
    if rest:
        words = words[:-1]
    if not words:
        raise RuleError(f"rule {text!r} names no command")
    if REST in words:
        raise RuleError(f'rule {text!r}: "..." may only be the last word')
    return WordRule(text, tuple(words), rest)
