"""What a person is shown: strings that cannot drive or fool a terminal.

Every string a card or a notice shows -- the command, the conversation ref,
executable paths, command lines, host aliases, labels, reasons -- comes from
somewhere an agent could influence. `escape_text` is the one function they
all pass through before they reach a terminal: control characters (ESC,
CR, ...), bidirectional overrides and isolates, zero-width and other
invisible format characters, line and paragraph separators become visible
`\\x..`/`\\u....` escapes. It leaves every other character alone, so applying
it twice changes nothing. `escape_command` is stricter, for the one string a
person approves byte for byte: only printable ASCII stays as it is.
"""

from __future__ import annotations

import unicodedata

# Unicode categories that render as nothing, or move the cursor, or reorder text.
_HIDDEN = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})


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
    """Any shown string: hidden and control characters escaped, the rest as is."""
    if text.isascii() and text.isprintable():
        return text
    return "".join(_escape_char(ch) if unicodedata.category(ch) in _HIDDEN else ch for ch in text)


def escape_command(command: bytes) -> str:
    """Show exactly what will run: printable ASCII as is, everything else escaped,
    so a person can never be shown something other than the bytes."""
    return escape_command_marked(command, ())[0]


def escape_command_marked(
    command: bytes, byte_offsets: tuple[int, ...] | list[int]
) -> tuple[str, list[tuple[int, int]]]:
    """`escape_command`, and where in its text each byte offset's character landed
    (start, end), so a prompt can highlight shell syntax in what it shows."""
    wanted = set(byte_offsets)
    out: list[str] = []
    marks: list[tuple[int, int]] = []
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
            marks.append((length, length + len(piece)))
        out.append(piece)
        length += len(piece)
        code = ord(ch)
        offset += 1 if 0xDC80 <= code <= 0xDCFF else len(ch.encode("utf-8", "surrogatepass"))
    return "".join(out), marks
