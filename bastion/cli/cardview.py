"""How a card is drawn: lines that fit the terminal, digests that are never split.

Every line `render_card` writes is at most `width` terminal cells, measured in cells
(rich's `cell_len`: a CJK character, which `escape_text` lets through, is two). rich
measures, holds the styled text (its spans keep the shell-syntax highlights on their
characters across a break) and writes the ANSI codes; where lines break is decided here,
because a card has two rules no general wrapper has:

- A field's value wraps at word boundaries with a hanging indent under its label. A token
  never splits if it fits on a line of its own; a digest (a sha256, a `SHA256:` host-key
  fingerprint, a request or card id) wider than the line itself is abbreviated
  (first 12 + "..." + last 4) with a note that `d` shows it whole. Other text too wide for
  a line (a long path) is cut at the cell width: it is text, not a digest.
- Exact text (the command, a file card's paths, stdin's preview, an argv word) loses
  nothing: it breaks before a run of spaces, and a continuation line is indented two
  cells more than the first, so the text is each line after its indent, joined. The
  spaces at a break open the next line, where they can be counted.

All values have passed `escape_text`/`escape_command` (the gateway's or `_shown`) before
they are wrapped: wrapping only ever splits what escaping made.
"""

from __future__ import annotations

import io
import re
import shlex
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from rich.cells import cell_len, get_character_cell_size
from rich.console import Console
from rich.segment import Segment
from rich.text import Text

from bastion.core.display import describe_run, escape_text
from bastion.core.subject import ExecWatch

CLAIM_SHOWN = 200  # characters of the conversation ref a card shows
INDENT = 12  # where a field's value starts: "  target:   "
MORE = 2  # a continuation line of exact text starts this much further in
UNWRAPPED = 1_000_000  # a width no card reaches: its lines whole (`pending` into a pipe)
MIN_WIDTH = 30  # narrower terminals get lines of this width
ROOM = 28  # a hanging indent shrinks rather than leave a value less room than this
HEAD, TAIL = 12, 4  # what an abbreviated digest keeps of its start and end
# Tokens that are digests or ids: a person compares them, so they are never split.
DIGEST = re.compile(
    r"SHA256:[A-Za-z0-9+/]{16,}=*|[0-9a-fA-F]{32,}|(?:req|cc|sc|ses|cmd|boot|gone)_[0-9a-f]{6,}"
)
SHORTENED = "values shortened with ... are shown whole under d (details)"
TOO_NARROW = "values shortened with ... do not fit this terminal whole: widen it"

BOLD, WARN, GOOD, BAD, DIM = "bold", "yellow", "green", "red", "dim"


class Style:
    """ANSI styling, only when writing to a terminal."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def _wrap(self, code: str, text: str) -> str:
        return f"\033[{code}m{text}\033[0m" if self.enabled else text

    def bold(self, text: str) -> str:
        return self._wrap("1", text)

    def warn(self, text: str) -> str:
        return self._wrap("33", text)

    def good(self, text: str) -> str:
        return self._wrap("32", text)

    def bad(self, text: str) -> str:
        return self._wrap("31", text)

    def dim(self, text: str) -> str:
        return self._wrap("2", text)


PLAIN = Style(False)
# Only renders Text to ANSI (never prints): width and terminal checks play no part.
_CONSOLE = Console(
    file=io.StringIO(), force_terminal=True, color_system="standard", width=10_000, highlight=False
)


def _shown(value: object) -> str:
    """Every value a card shows goes through the one escaping function."""
    return escape_text(str(value))


def _text(*pieces: str | tuple[str, str]) -> Text:
    """Styled text from plain pieces and (piece, rich style) pairs."""
    out = Text()
    for piece in pieces:
        if isinstance(piece, tuple):
            out.append(piece[0], piece[1])
        else:
            out.append(piece)
    return out


@dataclass(frozen=True)
class Row:
    """One field of a card: a label, its value, and how the value may break."""

    label: str  # "  target:" -- the value starts at `indent`, or after the label if wider
    value: Text
    exact: bool = False  # exact text: nothing dropped at a break, continuations indented
    whole: bool = False  # details: a digest drops the indent before it is abbreviated
    indent: int = INDENT
    style: str | None = None  # the whole row, label too (a warning line)


@dataclass(frozen=True)
class _Line:
    indent: int
    text: Text


class _Layout:
    """Lines for a width, and whether any digest had to be abbreviated to fit."""

    def __init__(self, width: int) -> None:
        self.width = max(width, MIN_WIDTH)
        self.shortened = False

    def row(self, row: Row) -> list[_Line]:
        indent = min(row.indent, max(MORE, self.width - ROOM))
        size = cell_len(row.label)
        fill = indent - size if size < indent or not row.label else 1
        label = row.label + " " * fill
        value = row.value.copy()
        if row.style:
            value.stylize_before(row.style)
        first = self.width - cell_len(label)
        if row.exact:
            pieces = self._exact(value, first, indent + MORE)
        else:
            pieces = self._words(value, first, indent, row.whole)
        head = pieces[0][1]
        lines = [_Line(0, Text(label if head.plain else row.label, row.style or "") + head)]
        if not head.plain and not row.label.strip() and len(pieces) > 1:
            lines = []  # a row with no label whose value starts on the next line
        return lines + [_Line(at, text) for at, text in pieces[1:]]

    def _words(self, value: Text, first: int, indent: int, whole: bool) -> list[tuple[int, Text]]:
        """Word wrap: the label's line first, then (indent, text) lines."""
        lines: list[tuple[int, Text]] = [(0, Text())]
        room, used, last = first, 0, 0
        for start, end in _tokens(value.plain):
            token, gap = value[start:end], value[last:start]
            last = end
            size = cell_len(token.plain)
            if used and used + cell_len(gap.plain) + size <= room:
                lines[-1][1].append_text(gap + token)
                used += cell_len(gap.plain) + size
                continue
            if used or size > room:
                lines.append((indent, Text()))
                room, used = self.width - indent, 0
            if size > room and DIGEST.search(token.plain):
                if whole and size <= self.width:  # details: the whole value, at column 0
                    lines[-1] = (0, token)
                    room, used = self.width, size
                    continue
                token = _abbreviated(token)
                self.shortened = True
                size = cell_len(token.plain)
            for chunk in _chop(token, room):  # one piece, unless no line holds it
                if used:
                    lines.append((indent, Text()))
                lines[-1][1].append_text(chunk)
                used = cell_len(chunk.plain)
        return lines

    def _exact(self, value: Text, first: int, indent: int) -> list[tuple[int, Text]]:
        """Break before a run of spaces, or inside a word no line holds; drop nothing."""
        cuts: list[tuple[int, int]] = [(0, 0)]  # (indent, where the line starts)
        room, used = first, 0
        plain = value.plain
        for start, end in _units(plain):
            size = cell_len(plain[start:end])
            if used and used + size > room:
                cuts.append((indent, start))
                room, used = self.width - indent, 0
            if used + size <= room:
                used += size
                continue
            for i in range(start, end):
                cells = get_character_cell_size(plain[i])
                if used and used + cells > room:
                    cuts.append((indent, i))
                    room, used = self.width - indent, 0
                used += cells
        ends = [at for _, at in cuts[1:]] + [len(plain)]
        return [(at, value[s:e]) for (at, s), e in zip(cuts, ends, strict=True)]

    def note(self, details: bool) -> list[_Line]:
        """The one line that says a shortened value is whole one key away."""
        if not self.shortened:
            return []
        return self.row(Row("", Text(f"({TOO_NARROW if details else SHORTENED})", DIM), indent=2))


def _tokens(text: str) -> Iterator[tuple[int, int]]:
    for match in re.finditer(r"\S+", text):
        yield match.start(), match.end()


def _units(text: str) -> Iterator[tuple[int, int]]:
    """Spaces and the word after them: the pieces exact text breaks between."""
    for match in re.finditer(r" *[^ ]+| +$", text):
        yield match.start(), match.end()


def _chop(text: Text, room: int) -> list[Text]:
    """Cut at cell boundaries into pieces of at most `room` cells (text, never a digest)."""
    pieces, start, used = [], 0, 0
    room = max(room, 2)
    for i, ch in enumerate(text.plain):
        size = get_character_cell_size(ch)
        if used + size > room and i > start:
            pieces.append(text[start:i])
            start, used = i, 0
        used += size
    pieces.append(text[start:])
    return pieces


def _abbreviated(token: Text) -> Text:
    """A digest too wide for any line: its start and end, with `...` between. The
    digest's own prefix (`SHA256:`) and what stands around it stay."""
    plain = token.plain
    match = DIGEST.search(plain)
    assert match is not None
    body = match.group()
    prefix = "SHA256:" if body.startswith("SHA256:") else ""
    core = body[len(prefix) :]
    short = core[:HEAD] + "..." + core[-TAIL:] if len(core) > HEAD + TAIL + 3 else core
    start, end = match.start(), match.end()
    style = token.get_style_at_offset(_CONSOLE, start) if plain else ""
    return token[:start] + Text(prefix + short, style) + token[end:]


# The only escape sequences a card writes, one per attribute (never combined, as in
# `1;31`), so the prompt's whole vocabulary is a short list a test can hold it to.
SGR = {"bold": "1", "dim": "2", "red": "31", "green": "32", "yellow": "33"}


def _sgr(segment: Segment) -> str:
    style = segment.style
    if style is None:
        return segment.text
    codes = [SGR[a] for a in ("bold", "dim") if getattr(style, a)]
    if style.color is not None:
        codes.append(SGR[style.color.name])
    if not codes:
        return segment.text
    return "".join(f"\033[{c}m" for c in codes) + segment.text + "\033[0m"


def _draw(lines: list[_Line], style: Style) -> str:
    out = []
    for line in lines:
        body = line.text
        if style.enabled:
            drawn = "".join(map(_sgr, Segment.simplify(body.render(_CONSOLE, end=""))))
        else:
            drawn = body.plain
        out.append(" " * line.indent + drawn)
    return "\n".join(out)


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def clock(ts: float) -> str:
    """A start time as a person reads it on a card: today's as the time only."""
    when = time.localtime(ts)
    if time.strftime("%Y-%m-%d", when) == time.strftime("%Y-%m-%d"):
        return time.strftime("%H:%M:%S", when)
    return _when(ts)


# -- the rows of a card -------------------------------------------------------------------


def _command_lines(card: dict[str, Any]) -> list[Row]:
    """The command as the argv it is, one word a line, or as shell source with
    every construct named and highlighted where it stands."""
    argv = card.get("argv")
    if argv is not None:
        rows = [
            Row("  command:", Text(f"{len(argv)} word(s), run as this argv (no shell syntax):"))
        ]
        rows += [
            Row(f"{' ' * INDENT}{i:>3} ", _text((shlex.quote(_shown(w)), BOLD)), True, indent=17)
            for i, w in enumerate(argv)
        ]
        return rows
    text = _shown(card["command"])
    shown = Text(text, BOLD)
    for start, end in sorted((int(a), int(b)) for a, b in card.get("command_marks") or []):
        shown.stylize(BAD, start, end)
    rows = [
        Row(
            "  command:",
            Text("USES SHELL SYNTAX -- the target's shell decides what runs:"),
            style=WARN,
        )
    ]
    rows += [
        Row("", Text(f"{_shown(c['text'])!r} at byte {c['offset']}: {_shown(c['what'])}"))
        for c in card.get("shell_syntax") or []
    ]
    rows.append(Row("", shown, exact=True))
    return rows


def stdin_lines(stdin: dict[str, Any]) -> list[Row]:
    """What the command reads on stdin, read whole before the card: a yes approves these
    bytes too, and the target gets exactly them, then EOF."""
    size, digest = int(stdin["size"]), _shown(stdin["sha256"])
    if size == 0:
        if stdin.get("end") == "silent":
            words = "none yet: still open, nothing sent; the command gets none"
            return [Row("  stdin:", Text(words), style=WARN)]
        return [Row("  stdin:", Text("none (closed empty)"))]
    rows = [Row("  stdin:", Text(f"{size} bytes -- the command reads these:"), style=WARN)]
    if "preview" in stdin:
        more = size - int(stdin.get("preview_bytes", size))
        rows.append(Row("", Text(_shown(stdin["preview"]), BOLD), exact=True))
        if more > 0:
            rows.append(Row("", Text(f"... and {more} more bytes (not shown)", DIM)))
    rows.append(Row("  stdin sha256:", Text(digest), style=WARN))
    return rows


def _file_lines(f: dict[str, Any]) -> list[Row]:
    """A file card: the operation, its path(s), and for a write the exact bytes' size,
    sha256 and mode -- what is written if the answer is yes."""
    rows = [Row("  file:", _text((_shown(f["op"]), BOLD), " ", (_shown(f["path"]), BOLD)), True)]
    if f.get("to") is not None:
        rows.append(Row("", _text("to ", (_shown(f["to"]), BOLD)), True))
    if f.get("size") is not None:
        rows.append(Row("  size:", Text(f"{int(f['size'])} bytes")))
    if f.get("sha256"):
        rows.append(Row("  sha256:", Text(_shown(f["sha256"]))))
    if f.get("mode") is not None:
        rows.append(Row("  mode:", Text(_shown(f["mode"]))))
    return rows


def card_rows(card: dict[str, Any]) -> list[Row]:
    """A card as a person reads it: who asks, for what, and what changed."""
    s = card["subject"]
    what = "run a command" if card["kind"] == "command" else "use this host and account"
    if card.get("file"):
        what = "change a file"
    asked = _text(f"pid {s['pid']}  {_shown(s['exe'])}")
    if s.get("kind"):
        asked.append(f"  ({_shown(s['kind'])})")
    if s.get("exe_deleted"):
        asked.append("  [executable deleted or replaced]", BAD)
    rows = [
        Row(
            f"{_shown(card['id'])}:",
            Text(f"{_shown(card['kind'])} approval -- {what}"),
            indent=2,
            style=BOLD,
        ),
        Row(
            "  target:",
            Text(
                f"{_shown(card['user'])}@{_shown(card['host'])}  "
                f"({_shown(card['address'])}:{card['port']}, "
                f"host key {_shown(card['host_key_fingerprint'])})"
            ),
        ),
        Row("  key:", Text(_shown(card["credential"]))),
        Row("  asked by:", asked),
        Row("", Text(f"uid {s['uid']}, started {_when(s['start_time'])}")),
    ]
    run = describe_run(s, clock(s["start_time"]))
    if run is not None:
        rows.append(Row("  run:", Text(run)))
    elif s.get("sandboxed"):
        words = "the asking process is in another namespace than the gateway's"
        rows.append(Row("  sandbox:", Text(words)))
    if s.get("exec_watch") == ExecWatch.NOTHING.value:
        words = "not visible for this process: approving covers this request only"
        rows.append(Row("  exec:", Text(words), style=WARN))
    if card.get("reason"):
        words = f"an earlier approval ended: {_shown(card['reason'])}"
        rows.append(Row("  changed:", Text(words), style=WARN))
    if card.get("conversation"):
        claim = _shown(card["conversation"])
        claim = claim if len(claim) <= CLAIM_SHOWN else claim[:CLAIM_SHOWN] + "..."
        rows.append(
            Row("  conversation:", _text("(the agent's claim, not checked) ", (claim, DIM)))
        )
    if card.get("command") is not None:
        rows += _command_lines(card)
    if card.get("stdin") is not None:
        rows += stdin_lines(card["stdin"])
    if card.get("file"):
        rows += _file_lines(card["file"])
    if card.get("terminal"):
        words = "runs with a terminal (its stdout and stderr arrive merged)"
        rows.append(Row("  terminal:", Text(words), style=WARN))
    if card.get("grantable"):
        words = "g widens a yes to this run's commands matching a pattern, for uses or minutes"
        rows.append(Row("  grant:", Text(words)))
    if card.get("presence"):
        rows.append(Row("  presence:", Text(presence_words(card["presence"])), style=WARN))
    return rows


def presence_words(rule: dict[str, Any]) -> str:
    """A presence card's rule, and where it is approved: not here."""
    n = int(rule.get("approvers", 1))
    who = "an enrolled authenticator" if n == 1 else f"{n} distinct enrolled authenticators"
    uv = " with user verification" if rule.get("user_verification") else ""
    return f"signed by {who}{uv}: approve it in the console (`bastion console`); here, n denies"


def details_rows(card: dict[str, Any]) -> list[Row]:
    """What `d` adds: the digests and the process chain, every value whole."""
    s = card["subject"]
    rows = [Row("  exe sha256:", Text(_shown(s["exe_sha256"])), whole=True)]
    if s.get("exec_watch"):
        rows.append(Row("  exec seen by:", Text(_shown(s["exec_watch"]))))
    if card.get("command_sha256"):
        label = "  file op digest:" if card.get("file") else "  command sha256:"
        rows.append(Row(label, Text(_shown(card["command_sha256"])), whole=True))
        if card.get("command") is not None:
            rows.append(Row("", Text(_shown(card["command"])), exact=True))
    rows.append(
        Row(
            "  request:",
            Text(f"{_shown(card['request_id'])} (vault epoch {card['vault_epoch']})"),
            whole=True,
        )
    )
    rows.append(Row("  process chain:", Text("(the asking process first)")))
    for p in card.get("chain", []):
        cmd = _shown(" ".join(p.get("cmdline") or []))[:120]
        value = _text(f"uid {p['uid']}  {_shown(p['exe'])}  ", (cmd, DIM))
        rows.append(Row(f"    pid {p['pid']:>7} ", value, whole=True, indent=6))
        rows.append(Row("", Text(f"sha256 {_shown(p['exe_sha256'])}"), whole=True, indent=6))
    return rows


def _render(rows: list[Row], style: Style, width: int, details: bool) -> str:
    layout = _Layout(width)
    lines = [line for row in rows for line in layout.row(row)]
    return _draw(lines + layout.note(details), style)


def render_card(
    card: dict[str, Any], details: bool = False, style: Style = PLAIN, width: int = 80
) -> str:
    """A card as a person reads it, every line at most `width` cells; with `details`,
    the details (`render_details`) below it."""
    shown = _render(card_rows(card), style, width, False)
    return shown + ("\n" + render_details(card, style, width) if details else "")


def fit(text: str, width: int, indent: int = 4) -> list[str]:
    """A line of the prompt's own (a greeting, a notice, a note), already escaped, in
    lines of at most `width` cells: broken between words, continuations indented."""
    width = max(width, MIN_WIDTH)
    lines: list[str] = []
    line = ""
    for word in text.split(" "):
        joined = f"{line} {word}" if line.strip() else line + word
        if cell_len(joined) <= width:
            line = joined
            continue
        if line.strip():
            lines.append(line)
        line = " " * indent + word
        while cell_len(line) > width:  # one word wider than a line: cut by cells
            head, *rest = _chop(Text(line), width)
            lines.append(head.plain)
            line = " " * indent + "".join(r.plain for r in rest)
    lines.append(line)
    return lines


def render_details(card: dict[str, Any], style: Style = PLAIN, width: int = 80) -> str:
    """The details alone (what `d` shows under a card already on screen): the
    executable's and the command's sha256, the request, the process chain."""
    return _render(details_rows(card), style, width, True)
