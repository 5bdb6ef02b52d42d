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
matches any further words. A rule that admits (`allow`, `preapproved`) never
lets a glob or `...` cover an *option*, a word beginning with `-`: options
are where programs hide other programs (`find -exec`, `git -c`, `tar
--checkpoint-action`), so an option is admitted only where the rule spells
it, or writes a pattern that itself begins with `-` (`-*`). A `deny` rule's
globs cover options too: a guardrail must not get weaker.
"""

from __future__ import annotations

import enum
import fnmatch
import json
from dataclasses import dataclass

from bastion.core.errors import BastionError

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
    if command.startswith("-"):  # sshd runs `$SHELL -c COMMAND`: the shell takes it as its own
        found.append((0, "-", "a leading '-': the target's shell reads it as its own option"))
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


class RuleKind(enum.Enum):
    """What a rule is for, which decides whether its globs reach options."""

    ADMIT = "admit"  # allow, preapproved: a glob or `...` never covers an option
    DENY = "deny"  # a guardrail: its globs cover options too, so it never gets weaker


def is_option(word: str) -> bool:
    """A word a program reads as an option (`--` and `-` included): it begins with `-`."""
    return word.startswith("-")


@dataclass(frozen=True)
class Unspelled:
    """An option an admitting rule's glob (or `...`) would have matched, had it not
    been an option: why a command that looks covered by the rule is not."""

    rule: str
    index: int  # in the argv; 0 is the program
    word: str
    pattern: str  # the rule's word that would have matched it, or "..."

    def describe(self) -> str:
        return (
            f"{self.word!r} (word {self.index + 1}) is an option, and {self.pattern!r} "
            f'in rule "{self.rule}" matches no option'
        )

    def as_json(self) -> dict[str, object]:
        return {
            "rule": self.rule,
            "index": self.index,
            "word": self.word,
            "rule_word": self.pattern,
        }


def explain_unspelled(missed: tuple[Unspelled, ...]) -> str:
    """How to read, and how to fix, a refusal that only options caused."""
    listed = "; ".join(m.describe() for m in missed)
    return (
        f'{listed}. In allow and preapproved rules, * ? [..] and "..." never match a word '
        "that begins with -: send the command without the option, or ask the operator to "
        f"admit it by spelling it in a rule (as the word {missed[0].word!r}) or with an "
        "option pattern such as -*"
    )


def no_match(
    rules: tuple[WordRule, ...], argv: tuple[str, ...]
) -> tuple[str, tuple[Unspelled, ...]]:
    """Why no rule of a non-empty list admits argv, for a person or a model, and the
    options that alone stood in the way."""
    missed = tuple(u for r in rules for u in r.unspelled(argv))
    allowed = ", ".join(_quote(r.text) for r in rules)
    why = (
        '(rules match whole words: * stays within one word, "..." last matches any further '
        f"words); allowed: {allowed}"
    )
    return (f"{why}. {explain_unspelled(missed)}" if missed else why), missed


@dataclass(frozen=True)
class WordRule:
    """A rule over argv: one glob per word, and `...` last for any further words."""

    text: str
    words: tuple[str, ...]
    rest: bool
    kind: RuleKind

    def _fits(self, argv: tuple[str, ...]) -> bool:
        """The words' globs match, options or not: how a deny rule matches."""
        if len(argv) < len(self.words) or (len(argv) > len(self.words) and not self.rest):
            return False
        return all(fnmatch.fnmatchcase(a, w) for a, w in zip(argv, self.words, strict=False))

    def _covers(self, argv: tuple[str, ...]) -> list[tuple[int, str]]:
        """(index, rule word) of each option in argv that a rule word or `...` not
        itself an option would have to match."""
        patterns = [*self.words, *[REST] * (len(argv) - len(self.words))]
        return [
            (i, w)
            for i, (a, w) in enumerate(zip(argv, patterns, strict=False))
            if is_option(a) and not is_option(w)
        ]

    def matches(self, argv: tuple[str, ...]) -> bool:
        if not self._fits(argv):
            return False
        return self.kind is RuleKind.DENY or not self._covers(argv)

    def unspelled(self, argv: tuple[str, ...]) -> tuple[Unspelled, ...]:
        """The options that alone keep this admitting rule from matching argv."""
        if self.kind is RuleKind.DENY or not self._fits(argv):
            return ()
        return tuple(Unspelled(self.text, i, argv[i], w) for i, w in self._covers(argv))

    def matches_text(self, command: str) -> bool:
        """Deny rules only: the rule as one glob over the raw string (a guardrail)."""
        return fnmatch.fnmatchcase(command, self.text)


class RuleError(BastionError, ValueError):
    """A rule that is not a list of words; the message shows the new form."""


def parse_rule(text: str, kind: RuleKind) -> WordRule:
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
    return WordRule(text, tuple(words), rest, kind)


def _quote(value: object) -> str:
    """As the policy quotes: JSON escapes control bytes, so a hostile value cannot drive
    the terminal that shows the error."""
    return json.dumps(value, ensure_ascii=True, default=str)


def parse_rules(value: object, field: str, kind: RuleKind) -> tuple[WordRule, ...]:
    """A policy field's list of rules; the error names the field and the entry."""
    if not isinstance(value, list):
        raise RuleError(f'field "{field}" must be a list of rules (strings), got {_quote(value)}')
    rules: list[WordRule] = []
    for i, text in enumerate(value):
        if not isinstance(text, str) or not text.strip():
            raise RuleError(f'field "{field}"[{i}] must be a non-empty string, got {_quote(text)}')
        try:
            rules.append(parse_rule(text, kind))
        except RuleError as exc:
            raise RuleError(f'field "{field}"[{i}]: {exc}') from None
    return tuple(rules)
