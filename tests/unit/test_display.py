"""The one escaping function (core/display.escape_text) is an allowlist (issue 18).

A character reaches a person's screen as it is only if it draws a glyph of its
own and moves the cursor: letters, numbers, punctuation, symbols and the ASCII
space, minus the few of those that draw nothing. These tests check the
property over every code point and over random text, and that the function
can be applied twice and still tell different inputs apart."""

from __future__ import annotations

import re
import sys
import unicodedata

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bastion.core.display import escape_command, escape_text

# Reported in the issue: a filler, the blank braille pattern, a grapheme joiner, an overlay.
REPORTED = ["\u3164", "\u2800", "\u034f", "\u0338"]
# The characters of L*, N*, P*, S* known to draw nothing (the spec, restated here).
FILLERS = {0x115F, 0x1160, 0x3164, 0xFFA0, 0x2800, 0x1D159}
ESCAPE = re.compile(r"\\x[0-9a-f]{2}|\\u[0-9a-f]{4}|\\U[0-9a-f]{8}")


def unescape(shown: str) -> str:
    """The inverse of escape_text for text that had no backslash: each escape back to
    its character (a `\\x` above 0x7f was an undecodable byte, kept by surrogateescape)."""

    def back(m: re.Match[str]) -> str:
        code = int(m.group()[2:], 16)
        return chr(0xDC00 + code) if m.group()[1] == "x" and code >= 0x80 else chr(code)

    return ESCAPE.sub(back, shown)


def allowed(ch: str) -> bool:
    """The allowlist, restated from its definition rather than from the code."""
    if ch == " ":
        return True
    return unicodedata.category(ch)[0] in "LNPS" and ord(ch) not in FILLERS


@pytest.mark.parametrize("ch", REPORTED)
def test_the_reported_invisible_characters_are_escaped(ch: str) -> None:
    shown = escape_text(f"web{ch}1")
    assert shown == f"web\\u{ord(ch):04x}1"


@pytest.mark.parametrize(
    "ch",
    [
        "\u115f", "\u1160", "\uffa0", "\U0001d159",  # other fillers, the null notehead
        "\ufe0f", "\U000e0100", "\U000e0041", "\ufeff",  # variation selectors, a tag, BOM
        "\u2028", "\u2029", "\u00a0", "\u3000", "\u2003",  # separators other than the space
        "\u0301", "\u20dd", "\u093f",  # combining marks: Mn, Me, Mc
        "\ue000", "\U000f0000", "\U0010fffd",  # private use
        "\U000e0080", "\u0378",  # unassigned
        "\x00", "\x1b", "\x7f", "\x85", "\u061c", "\u00ad",  # controls and formats
    ],
)  # fmt: skip
def test_what_draws_nothing_or_over_its_neighbour_is_escaped(ch: str) -> None:
    assert "\\" in escape_text(ch) and ch not in escape_text(ch)


@pytest.mark.parametrize("text", ["/opt/café/agent bin", "日本語のホスト", "Ωmega-2 €5 😀", "a\\b"])
def test_visible_text_stays_as_it_is(text: str) -> None:
    assert escape_text(text) == text


def test_every_code_point_is_judged_by_the_allowlist() -> None:
    """All 1,114,112 code points: shown exactly when the allowlist says so, and an
    escaped one becomes ASCII that is itself on the allowlist."""
    for code in range(sys.maxunicode + 1):
        ch = chr(code)
        if (escape_text(ch) == ch) != allowed(ch):
            raise AssertionError(f"U+{code:04X} {unicodedata.category(ch)}")
        shown = escape_text(ch)
        if shown != ch and not (ESCAPE.fullmatch(shown) and shown.isascii()):
            raise AssertionError(f"U+{code:04X} -> {shown!r}")


any_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=60)
no_backslash = st.text(st.characters(exclude_characters="\\", exclude_categories=()), max_size=60)


@given(any_text)
def test_every_character_shown_is_on_the_allowlist(text: str) -> None:
    assert all(allowed(ch) for ch in escape_text(text))


@given(any_text)
def test_escaping_twice_changes_nothing(text: str) -> None:
    once = escape_text(text)
    assert escape_text(once) == once


@given(no_backslash)
def test_text_without_a_backslash_can_be_read_back_from_what_is_shown(text: str) -> None:
    """So two such inputs that differ, if only in a hidden character, look different."""
    assert unescape(escape_text(text)) == text


@given(no_backslash, st.sampled_from([*REPORTED, "\u200b", "\u202e", "\x1b", "\ufe0f"]))
def test_a_hidden_character_always_shows(text: str, hidden: str) -> None:
    for i in range(len(text) + 1):
        assert escape_text(text[:i] + hidden + text[i:]) != escape_text(text)


def test_the_command_stays_printable_ascii_only() -> None:
    assert escape_command("ls café\u3164\\".encode()) == "ls caf\\u00e9\\u3164\\\\"
