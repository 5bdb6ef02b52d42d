"""What a person is shown: strings that cannot drive or fool a terminal.

Every string a card, a notice, a CLI line or a log line shows -- the command,
the conversation ref, executable paths, command lines, host aliases, labels,
reasons -- comes from somewhere an agent could influence. `escape_text` is the
one function they all pass through before they reach a terminal. It is an
allowlist, not a list of what to escape: a character stays as it is only if it
draws something and moves the cursor one cell or two -- a letter, digit,
punctuation mark or symbol (Unicode categories L*, N*, P*, S*), or the ASCII
space -- and is not one of the few in those categories that draw nothing
(`BLANK`). Everything else becomes a visible `\\x..`/`\\u....`/`\\U........`
escape: control characters (ESC, CR, ...), format characters (bidi controls,
zero-width characters, tags, the BOM), combining marks (which draw over the
character before them), every separator but the space (line and paragraph
separators, no-break and ideographic spaces), surrogates, private use and
code points this Python's Unicode tables do not know. An escape is made of
allowed ASCII, so applying the function twice changes nothing; the escapes
are fixed-length, so text without a backslash is shown differently for every
different input. `escape_command` is stricter, for the one string a person
approves byte for byte: only printable ASCII stays as it is.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Mapping
from typing import Any

from bastion.core.subject import RUN_LABEL_CLAIM

# The categories whose characters draw a glyph of their own and advance the cursor:
# letters, numbers, punctuation, symbols. Not marks (M*: drawn over their neighbour),
# separators (Z*), or others (C*: controls, formats, surrogates, private use, unassigned).
SHOWN_CATEGORIES = frozenset(
    {"Lu", "Ll", "Lt", "Lm", "Lo", "Nd", "Nl", "No"}
    | {"Pc", "Pd", "Ps", "Pe", "Pi", "Pf", "Po", "Sm", "Sc", "Sk", "So"}
)
# Characters in those categories that draw nothing, so a name could hide in them:
# the Hangul fillers (Lo; default-ignorable in Unicode), the blank braille pattern
# and the null notehead (So). Variation selectors, tags and U+FEFF need no entry:
# they are marks or formats, outside the categories above.
BLANK = frozenset(
    {
        0x115F,  # HANGUL CHOSEONG FILLER
        0x1160,  # HANGUL JUNGSEONG FILLER
        0x3164,  # HANGUL FILLER
        0xFFA0,  # HALFWIDTH HANGUL FILLER
        0x2800,  # BRAILLE PATTERN BLANK
        0x1D159,  # MUSICAL SYMBOL NULL NOTEHEAD
    }
)


def is_shown(ch: str) -> bool:
    """Does this one character stay as it is on a person's screen?"""
    if ch == " ":
        return True
    return unicodedata.category(ch) in SHOWN_CATEGORIES and ord(ch) not in BLANK


def _escape_char(ch: str) -> str:
    code = ord(ch)
    if 0xDC80 <= code <= 0xDCFF:  # an undecodable byte, kept by surrogateescape
        return f"\\x{code - 0xDC00:02x}"
    if code < 0x80:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def escape_text(text: str) -> str:
    """Any shown string: every character not on the allowlist escaped, the rest as is."""
    if text.isascii() and text.isprintable():
        return text
    return "".join(ch if is_shown(ch) else _escape_char(ch) for ch in text)


def escape_command(command: bytes) -> str:
    """Show exactly what will run: printable ASCII as is, everything else escaped,
    so a person can never be shown something other than the bytes."""
    return escape_command_marked(command, ())[0]


def escape_command_marked(
    command: bytes,
    byte_offsets: tuple[int, ...] | list[int],
    lengths: tuple[int, ...] | list[int] | None = None,
) -> tuple[str, list[tuple[int, int]]]:
    """`escape_command`, and where in its text each byte offset's character landed
    (start, end), so a prompt can highlight shell syntax in what it shows. With
    `lengths` (bytes, one per offset), a mark covers that many bytes: a whole `&&`,
    `$(...)` or keyword."""
    extent = dict(zip(byte_offsets, lengths or [1] * len(byte_offsets), strict=True))
    wanted = set(byte_offsets)
    out: list[str] = []
    marks: list[tuple[int, int]] = []
    open_marks: list[tuple[int, int, int]] = []  # (index in marks, start, end byte offset)
    length = 0
    offset = 0
    for ch in command.decode("utf-8", errors="surrogateescape"):
        if ch == "\\":
            piece = "\\\\"
        elif " " <= ch <= "~":
            piece = ch
        elif ch == "\n":
            piece = "\\n"
        elif ch == "\t":
            piece = "\\t"
        else:
            piece = _escape_char(ch)
        if offset in wanted:
            open_marks.append((len(marks), length, offset + max(1, extent[offset])))
            marks.append((length, length + len(piece)))
        out.append(piece)
        length += len(piece)
        code = ord(ch)
        offset += 1 if 0xDC80 <= code <= 0xDCFF else len(ch.encode("utf-8", "surrogatepass"))
        for k, start, end in open_marks:
            if offset <= end:
                marks[k] = (start, length)
        open_marks = [m for m in open_marks if offset < m[2]]
    return "".join(out), marks


def describe_run(subject: Mapping[str, Any], started: str) -> str | None:
    """What a card (and `bastion sessions`) says of a subject's run, from its JSON
    (`Subject.as_json`), escaped; None when it is not a run. Whether it is sandboxed
    is the kernel's word (the asking process's namespaces); its label and what it
    was given are what its start said, and shown as that."""
    run = subject.get("run_info")
    if not isinstance(run, Mapping):
        return None
    label = escape_text(str(run.get("label", "")))
    given = run.get("given")
    head = f'run "{label}" ({RUN_LABEL_CLAIM}), started {escape_text(started)}'
    if not subject.get("sandboxed"):
        claimed = " (it registered as sandboxed)" if given is not None else ""
        return f"{head} -- not sandboxed{claimed}"
    if given is None:
        words = "not said"
    else:
        words = ", ".join(escape_text(str(w)) for w in given) or "nothing beyond the defaults"
    return f"sandboxed {head}, given: {words}"
