"""Reading a command the way the target's shell will: an argv, or shell source.

sshd runs every exec request as `$SHELL -c STRING`, so a rule over the string
decides nothing: `systemctl status x; id` starts with `systemctl status `.
`read_command` turns the string into an argv only when every POSIX shell
(sh, bash, dash, zsh, ksh) would run exactly that argv: words of plain
characters, `'single'` and `"double"` quoted text without `$`, a backquote,
a backslash or `!` inside, separated by blanks. A word is judged where the
shell judges it, after quote removal too: zsh expands `''=ls` as it does
`=ls`, and runs `'ex'ec` as `exec`; and its first word is neither a keyword
(`RESERVED`) nor a *code builtin*, one that runs one of its words or a file as
shell code (`trap 'a; b' EXIT`, `. FILE`: `CODE_BUILTINS`, one table with the
shells each comes from). Anything else is *shell source*, reported with every
construct found and its byte offset. When in doubt it is
shell source: a plain command that reads as source only costs a card, a
source command that read as plain would cost the target.

Whether a command is shell source is decided character by character (`_scan`);
how its constructs are *listed* is decided after, and changes nothing of that:
each construct once (`&&` one and-list, a backquote pair one substitution, a
here-document one, with its extent), compound commands named as what they are
("a for loop") once each (`_grouped`).

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
# A command position taken by one of these changes the grammar of what follows, or runs
# the next word as the command (the code builtins, which run code, are CODE_BUILTINS).
RESERVED = frozenset(
    {
        *("if", "then", "else", "elif", "fi", "case", "esac", "for", "select", "while"),
        *("until", "do", "done", "in", "function", "time", "coproc", "repeat", "foreach"),
        *("nocorrect", "noglob", "builtin", "command", "exec"),
        "-",  # zsh's precommand modifier: `'-' touch x` runs touch
    }
)


class Runs(enum.Enum):
    """When a code builtin's shell code runs."""

    NOW = "now"  # the builtin runs it itself
    LATER = "later"  # at a signal, the shell's exit, or in a later command of the same shell
    EDITOR = "editor"  # when an interactive line editor fires (a key, a prompt, a completion)


@dataclass(frozen=True)
class CodeBuiltin:
    """A builtin that runs one of its words, or a file, as shell code: its words may be
    plain, its command is shell source all the same. `shells` are where it does so."""

    name: str
    shells: tuple[str, ...]
    runs: Runs
    how: str  # completes "a builtin that ..."

    def describe(self) -> str:
        return f"a builtin that {self.how} ({', '.join(self.shells)})"


_ALL = ("bash", "dash", "zsh", "ksh", "mksh", "busybox sh")
_COMPOUND_ARRAY = "reads a quoted name=(...) word as an array whose words expand again"
# One table; tests/integration/test_code_builtins.py runs each entry in the shells it
# names, and holds every builtin those shells list to this table, RESERVED, or a
# reviewed list of builtins that run nothing. A shell a target may have is reason
# enough: the reader cannot know which shell a target runs.
CODE_BUILTINS: tuple[CodeBuiltin, ...] = (
    CodeBuiltin(".", _ALL, Runs.NOW, "runs a file as shell code"),
    CodeBuiltin(
        "source",
        ("bash", "zsh", "ksh", "mksh", "busybox sh"),
        Runs.NOW,
        "runs a file as shell code",
    ),
    CodeBuiltin("eval", _ALL, Runs.NOW, "runs its words as shell code"),
    CodeBuiltin("trap", _ALL, Runs.LATER, "runs a word as shell code at a signal or at exit"),
    CodeBuiltin("alias", _ALL, Runs.LATER, "makes a word into shell code for later commands"),
    CodeBuiltin(
        "fc", ("bash", "zsh", "ksh", "mksh"), Runs.NOW, "runs its editor and history as shell code"
    ),
    CodeBuiltin("hist", ("ksh",), Runs.NOW, "runs its editor and history as shell code"),
    CodeBuiltin("r", ("zsh", "mksh"), Runs.NOW, "runs a line of history as shell code"),
    CodeBuiltin("emulate", ("zsh",), Runs.NOW, "with -c, runs a word as shell code"),
    CodeBuiltin(
        "autoload", ("zsh", "ksh", "mksh"), Runs.NOW, "loads shell code from a file (-k: runs it)"
    ),
    CodeBuiltin("zmodload", ("zsh",), Runs.NOW, "loads a compiled module into the shell"),
    CodeBuiltin("zregexparse", ("zsh",), Runs.NOW, "runs its {actions} as shell code"),
    CodeBuiltin("enable", ("bash",), Runs.NOW, "with -f, loads a compiled builtin into the shell"),
    CodeBuiltin("mapfile", ("bash",), Runs.NOW, "with -C, runs a word as shell code"),
    CodeBuiltin("readarray", ("bash",), Runs.NOW, "with -C, runs a word as shell code"),
    CodeBuiltin("compgen", ("bash",), Runs.NOW, "with -C or -F, runs a command or a function"),
    *(
        CodeBuiltin(name, ("bash",), Runs.NOW, _COMPOUND_ARRAY)
        for name in ("declare", "typeset", "local", "export", "readonly")
    ),
    CodeBuiltin("zstyle", ("zsh",), Runs.LATER, "with -e, stores shell code each lookup runs"),
    CodeBuiltin("sched", ("zsh",), Runs.EDITOR, "runs its words as shell code before a prompt"),
    CodeBuiltin("bind", ("bash",), Runs.EDITOR, "with -x, binds a key to shell code"),
    CodeBuiltin("complete", ("bash",), Runs.EDITOR, "with -C or -F, stores code completion runs"),
    CodeBuiltin("compctl", ("zsh",), Runs.EDITOR, "with -K, stores a function completion runs"),
    CodeBuiltin("zle", ("zsh",), Runs.EDITOR, "with -N or -F, makes a function line-editor code"),
)
RUNS_CODE = {b.name: b for b in CODE_BUILTINS}


def code_builtin(word: str) -> CodeBuiltin | None:
    """The table's entry for a command's first word (after quote removal), if any."""
    return RUNS_CODE.get(word)


_PATTERN_CHARS = frozenset("*?[]")  # rules: glob characters are pattern syntax, not shell
_BLANKS = frozenset(" \t")
REST = "..."  # a rule's final word: any further words


@dataclass(frozen=True)
class Construct:
    """One piece of shell syntax: where it starts (a byte offset), what it is. `text`
    is its opening token (`&&`, `$`, `for`); `length` its extent in bytes from
    `offset` (a whole `$(...)`, a here-document with its body, the keyword)."""

    offset: int
    text: str
    what: str
    length: int = 1

    def describe(self) -> str:
        return f"{self.text!r} at byte {self.offset} ({self.what})"

    def as_json(self) -> dict[str, object]:
        return {"offset": self.offset, "text": self.text, "what": self.what, "length": self.length}


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
    start = len(command) - len(command.lstrip(" \t"))
    if words and words[0] in RESERVED and not found:
        found.append((start, words[0], "a shell keyword or builtin that runs what follows"))
    elif words and (runs := code_builtin(words[0])) is not None:  # `'trap' ...` is trap
        found.append((start, words[0], runs.describe()))
    if not found:
        return Reading(tuple(words))
    found.sort()
    listed = _grouped(command, found)
    ends = [pos + size for pos, _, _, size in listed]
    points = sorted({*(item[0] for item in listed), *ends})
    at = dict(zip(points, _byte_offsets(command, points), strict=True))
    constructs = tuple(
        Construct(at[pos], text, what, at[pos + size] - at[pos]) for pos, text, what, size in listed
    )
    return Reading(None, constructs[:MAX_CONSTRUCTS], max(0, len(constructs) - MAX_CONSTRUCTS))


# -- listing constructs once each (after the decision; it never changes it) --------------

_PAIRS = {
    "&&": "and-list (runs the next command if this one succeeds)",
    "||": "or-list (runs the next command if this one fails)",
    ">>": "redirection (append)",
    ">&": "redirection (duplicate)",
    "<&": "redirection (duplicate)",
    "&>": "redirection (stdout and stderr)",
    ">|": "redirection (clobber)",
    "<>": "redirection (read and write)",
    "|&": "pipe (stdout and stderr)",
}
_COMPOUND = {
    "for": "a for loop",
    "select": "a select loop",
    "while": "a while loop",
    "until": "an until loop",
    "if": "an if statement",
    "case": "a case statement",
    "{": "a brace group",
    "(": "a subshell",
}
# A compound is listed by its keyword, which the scan does not flag; anything else only
# where the scan found something (a `{` opens a brace group or, elsewhere, an expansion).
_COMPOUND_WHAT = frozenset(_COMPOUND.values())
# A compound's later keywords, each with the openers it belongs to (and whether it ends it).
_LATER: dict[str, tuple[frozenset[str], bool]] = {
    "do": (frozenset({"for", "select", "while", "until"}), False),
    "done": (frozenset({"for", "select", "while", "until"}), True),
    "then": (frozenset({"if"}), False),
    "elif": (frozenset({"if"}), False),
    "else": (frozenset({"if"}), False),
    "fi": (frozenset({"if"}), True),
    "esac": (frozenset({"case"}), True),
    "}": (frozenset({"{"}), True),
}
_AFTER_KEYWORD = frozenset({"do", "then", "else", "elif", "if", "while", "until", "{", "!"})
_SEPARATORS = frozenset({";", "&", "|", "&&", "||", "\n", "(", ";;", "|&"})
_NAME = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")
_SPECIAL_PARAMS = frozenset("@*#?-$!0123456789")

# (char position, opening token, what, extent in characters)
_Listed = tuple[int, str, str, int]


def _grouped(text: str, found: list[tuple[int, str, str]]) -> list[_Listed]:
    """The scan's findings (one per character, sorted) listed once per construct: a
    span found in the text (`_spans`) stands for every finding inside it, and the
    compound commands' keywords name the compound once."""
    out: list[_Listed] = []
    taken: list[tuple[int, int]] = []
    found_at = {pos for pos, _, _ in found}
    reach = 0  # the end of the furthest construct listed so far
    for start, token, what, size in sorted(_spans(text), key=lambda s: (s[0], -s[3])):
        if size == 0:  # a closing keyword, or a `;` that belongs to a compound: not listed
            taken.append((start, start + len(token)))
        elif start >= reach and (start in found_at or what in _COMPOUND_WHAT):
            out.append((start, token, what, size))
            taken.append((start, start + size))
            reach = start + size
        # else: inside a construct already listed (`${a:-$(id)}` is one)
    covered, k = _union(taken), 0
    for pos, ch, what in found:  # both sorted: one walk
        while k < len(covered) and covered[k][1] <= pos:
            k += 1
        if k < len(covered) and covered[k][0] <= pos:
            continue
        out.append((pos, ch, what, 1))
    if not out:  # never a card of shell source that lists nothing: each finding, then
        return [(pos, ch, what, 1) for pos, ch, what in found]
    return sorted(out)


def _union(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, disjoint intervals covering exactly what `intervals` cover."""
    merged: list[tuple[int, int]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def _spans(text: str) -> list[_Listed]:
    """Constructs longer than a character, and compound keywords, where a shell reads
    them (quotes respected, roughly: this lists, it does not decide). A span of size
    0 marks what is part of a compound already named (`done`, the `;` before it)."""
    out: list[_Listed] = []
    i, n = 0, len(text)
    command_position = True
    dquote = False
    last_sep: int | None = None  # a `;` or newline just before this word
    compounds: list[str] = []  # the compounds open here, innermost last (their first word)
    bodies: list[tuple[str, bool]] = []  # here-documents whose bodies start at the next line
    while i < n:
        ch = text[i]
        if not dquote and ch in _BLANKS:
            i += 1
            continue
        if ch == "'" and not dquote:
            end = text.find("'", i + 1)
            i = n if end < 0 else end + 1
            command_position, last_sep = False, None
            continue
        if ch == '"':
            dquote = not dquote
            i += 1
            command_position, last_sep = False, None
            continue
        if ch == "\\":
            out.append((i, "\\", _QUOTED["\\"] if dquote else _UNQUOTED["\\"], min(2, n - i)))
            i += 2
            command_position, last_sep = False, None
            continue
        if ch == "$":
            size, what = _dollar(text, i)
            out.append((i, "$", what + (" inside quotes" if dquote else ""), size))
            i += size
            command_position, last_sep = False, None
            continue
        if ch == "`":
            end = _closing_backquote(text, i + 1)
            inside = " inside quotes" if dquote else ""
            out.append((i, "`", "command substitution" + inside, end - i))
            i = end
            command_position, last_sep = False, None
            continue
        if dquote:
            i += 1
            continue
        if text.startswith("<<<", i):
            out.append((i, "<<<", "here-string", 3))
            i += 3
            continue
        if text.startswith("<<", i):
            end, delimiter, strip_tabs = _heredoc_word(text, i)
            out.append((i, "<<", "here-document", end - i))
            if delimiter:
                bodies.append((delimiter, strip_tabs))
            i = end
            continue
        pair = text[i : i + 2]
        if pair == ";;" and compounds and compounds[-1] == "case":
            out += [(i, ";", "", 0), (i + 1, ";", "", 0)]
            i += 2
            command_position, last_sep = True, None
            continue
        if pair in _PAIRS:
            out.append((i, pair, _PAIRS[pair], 2))
            i += 2
            command_position, last_sep = pair in _SEPARATORS, None
            continue
        if ch == "\n" and bodies:  # the here-documents' bodies follow this line: one each
            end = _heredoc_bodies(text, i + 1, bodies)
            out.append((i, text[i:end], "", 0))
            bodies = []
            command_position, last_sep = True, None
            i = end
            continue
        if ch in ";\n":
            command_position, last_sep = True, i
            i += 1
            continue
        if ch in "&|":
            command_position, last_sep = True, None
            i += 1
            continue
        if ch in "()":
            if ch == "(" and command_position:
                out.append((i, "(", _COMPOUND["("], 1))
                compounds.append("(")
            elif ch == ")" and compounds and compounds[-1] in ("(", "case"):
                if compounds[-1] == "(":
                    compounds.pop()
                out.append((i, ")", "", 0))  # a subshell's end, or a case pattern's
            command_position = ch == "("
            last_sep = None
            i += 1
            continue
        word_end = _word_end(text, i)
        word = text[i:word_end]
        later = _LATER.get(word)
        belongs = bool(later and command_position and compounds and compounds[-1] in later[0])
        if command_position and word in _COMPOUND and word != "(":
            out.append((i, word, _COMPOUND[word], len(word)))
            compounds.append(word)
        elif later and belongs:
            if later[1]:
                compounds.pop()
            out.append((i, word, "", 0))
            if last_sep is not None:
                out.append((last_sep, text[last_sep], "", 0))
        elif word.startswith("{") and "}" in word:
            out.append((i, "{", "brace expansion", word.index("}") + 1))
        command_position = word in _AFTER_KEYWORD or belongs
        if word in ("for", "select", "case"):
            command_position = False
        last_sep = None
        i = max(word_end, i + 1)
    return out


def _word_end(text: str, i: int) -> int:
    """Where an unquoted run of ordinary characters starting at `i` ends."""
    j = i
    while j < len(text) and text[j] not in " \t\n;&|()<>'\"`$\\":
        j += 1
    return j


def _dollar(text: str, i: int) -> tuple[int, str]:
    """The extent and name of what `$` at `i` begins."""
    if text.startswith("$((", i):
        return _matching(text, i + 1, "(", ")") - i, "arithmetic expansion"
    if text.startswith("$(", i):
        return _matching(text, i + 1, "(", ")") - i, "command substitution"
    if text.startswith("${", i):
        return _matching(text, i + 1, "{", "}") - i, "parameter expansion"
    if text.startswith("$'", i):
        end = text.find("'", i + 2)
        return (len(text) if end < 0 else end + 1) - i, "ANSI-C quoting"
    j = i + 1
    if j < len(text) and text[j] in _SPECIAL_PARAMS:
        return 2, "parameter expansion"
    while j < len(text) and text[j] in _NAME:
        j += 1
    return max(1, j - i), "parameter expansion" if j > i + 1 else _UNQUOTED["$"]


def _matching(text: str, i: int, open_: str, close: str) -> int:
    """Just past the `close` that matches the `open_` at `i` (or the end of the text),
    skipping quoted text."""
    depth, j, n = 0, i, len(text)
    while j < n:
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c in "'\"":
            end = text.find(c, j + 1)
            j = n if end < 0 else end + 1
            continue
        if c == open_:
            depth += 1
        elif c == close:
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return n


def _closing_backquote(text: str, j: int) -> int:
    while j < len(text):
        if text[j] == "\\":
            j += 2
            continue
        if text[j] == "`":
            return j + 1
        j += 1
    return len(text)


def _heredoc_word(text: str, i: int) -> tuple[int, str, bool]:
    """A here-document's `<<` at `i`: just past its delimiter word, the delimiter (quotes
    removed), and whether its body's leading tabs are stripped (`<<-`)."""
    j = i + 2
    strip_tabs = text.startswith("-", j)
    j += strip_tabs
    while j < len(text) and text[j] in _BLANKS:
        j += 1
    k = j
    while k < len(text) and text[k] not in " \t\n;&|()<>":
        if text[k] in "'\"":
            end = text.find(text[k], k + 1)
            k = len(text) if end < 0 else end + 1
        else:
            k += 1
    return k, text[j:k].replace("'", "").replace('"', "").replace("\\", ""), strip_tabs


def _heredoc_bodies(text: str, at: int, bodies: list[tuple[str, bool]]) -> int:
    """Just past the bodies of `bodies`, in order, from `at`: each up to and with its
    delimiter line (or to the end of the text)."""
    for delimiter, strip_tabs in bodies:
        while at < len(text):
            nl = text.find("\n", at)
            end = len(text) if nl < 0 else nl
            line = text[at:end]
            at = end + 1
            if (line.lstrip("\t") if strip_tabs else line) == delimiter:
                break
    return min(at, len(text))


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
    if kind is not RuleKind.DENY and (why := _source_by_name(words[0])) is not None:
        raise RuleError(
            f"rule {text!r} could never match: {words[0]!r} is {why}, so every command that "
            "begins with it is shell source, which an allow or preapproved rule never admits "
            '(the account\'s "shell" mode decides it). Write a rule for the program it would '
            "run instead, or a deny rule to refuse it"
        )
    return WordRule(text, tuple(words), rest, kind)


def _source_by_name(word: str) -> str | None:
    """Why a command beginning with this word is shell source whatever its words are."""
    if word in RESERVED:
        return "a shell keyword or builtin that runs what follows"
    runs = code_builtin(word)
    return None if runs is None else runs.describe()


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
