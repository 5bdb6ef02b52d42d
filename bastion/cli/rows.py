"""One line per request, session or card: what `audit activity`, `sessions` and `pending`
print, and what `bastion approve` can show in its status line.

Pure: the rows the journal's views (`core/events.activity`, `events.sessions`) and the
gateway's `sessions`/`pending` answers hold go in, with a width and the time now; lines
come out, each at most `width - 1` terminal cells (the last column is left free, as in
`statusline`: writing it makes some terminals wrap), cut with an ellipsis. A width of
None cuts nothing (output to a file or a pipe). Every string an agent could have
influenced -- host, account, label, executable, command -- goes through `escape_text`
or `escape_command` before it is measured, so a cut never splits an escape's meaning
from the screen and nothing drives the terminal.
"""

from __future__ import annotations

import datetime
import os
import re
import time
import unicodedata
from collections.abc import Iterable, Mapping
from typing import Any

from bastion.core.display import escape_command, escape_text

ELLIPSIS = "…"
WHO_CELLS = 24  # the widest run label, process or user@host column before it is cut
SHRUNK_CELLS = 10  # ... and the narrowest it is cut to, to leave the last column room
LAST_CELLS = 16  # the room the last column (the command) is given, where a row can

# `audit activity --outcome`: what the journal says of a request's end (`events.Outcome`,
# denied, in_flight), and `failed`: completed with a non-zero exit status, or signalled.
OUTCOMES = (
    "completed",
    "failed",
    "signalled",
    "denied",
    "remote_rejected",
    "not_started",
    "unknown",
    "in_flight",
)


def cells(text: str) -> int:
    """How many terminal cells `text` takes: East Asian wide and fullwidth characters
    two, every other one (escaped text has no zero-width characters) one."""
    return sum(2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in text)


def cut(text: str, width: int | None) -> str:
    """`text` in at most `width` cells, ending with an ellipsis when something was cut."""
    if width is None or cells(text) <= width:
        return text
    if width <= 0:
        return ""
    out, used = [], 0
    for ch in text:
        w = 2 if unicodedata.east_asian_width(ch) in "WF" else 1
        if used + w > width - 1:
            break
        out.append(ch)
        used += w
    return "".join(out) + ELLIPSIS


def pad(text: str, width: int) -> str:
    """`text` cut to `width` cells, then filled with spaces to exactly `width`."""
    text = cut(text, width)
    return text + " " * (width - cells(text))


def line(text: str, width: int | None) -> str:
    """One finished row: at most `width - 1` cells."""
    return text if width is None else cut(text, max(1, width - 1))


def clock(ts: object, now: float) -> str:
    """A journal time as a person reads it: HH:MM:SS today, with the date otherwise."""
    if not isinstance(ts, int | float):
        return "-"
    when = time.localtime(ts)
    if time.strftime("%Y-%m-%d", when) == time.strftime("%Y-%m-%d", time.localtime(now)):
        return time.strftime("%H:%M:%S", when)
    return time.strftime("%Y-%m-%d %H:%M:%S", when)


def who(subject: object) -> str:
    """The run's label (the run's own claim), or the process: pid and executable name."""
    if not isinstance(subject, Mapping):
        return "?"
    info = subject.get("run_info")
    if isinstance(info, Mapping) and isinstance(info.get("label"), str):
        return f'run "{escape_text(info["label"])}"'
    exe = os.path.basename(str(subject.get("exe") or "?"))
    return escape_text(f"pid {subject.get('pid')} {exe}")


def target(row: Mapping[str, Any]) -> str:
    return escape_text(f"{row.get('user')}@{row.get('host')}")


def grant_part(grant: object) -> str | None:
    """A bounded grant: on an activity row the id of the grant a use came from (the
    journal names only it); on a session row the grant itself (`BoundedGrant.as_json`: its
    pattern and the uses left)."""
    if isinstance(grant, str):
        return escape_text(f"grant {grant}")
    if not isinstance(grant, Mapping):
        return None
    left = grant.get("uses_left", grant.get("remaining"))
    uses = "" if left is None else f", {left} use{'' if left == 1 else 's'} left"
    pattern = grant.get("pattern")
    if isinstance(pattern, list | tuple):
        pattern = " ".join(str(w) for w in pattern)
    return escape_text(f"grant {grant.get('id')}: {pattern}{uses}")


def command_text(row: Mapping[str, Any]) -> str:
    """What the request asked for, escaped byte for byte as a card shows it."""
    f = row.get("file")
    if isinstance(f, Mapping):
        what = f"{f.get('op')} {f.get('path')}" + (f" -> {f['to']}" if f.get("to") else "")
        if isinstance(f.get("acts_on"), list) and f["acts_on"]:
            what += " (at " + " -> ".join(str(p) for p in f["acts_on"]) + ")"
        return escape_text(what)
    command = row.get("command")
    if not isinstance(command, str):
        return "-"
    return escape_command(command.encode("utf-8", "surrogatepass"))


def ending(row: Mapping[str, Any]) -> str:
    """The outcome, its code and its exit status."""
    end = str(row.get("outcome") or "?")
    if row.get("code"):
        end += f" {row['code']}"
    if row.get("exit_status") is not None:
        end += f" exit {row['exit_status']}"
    cert = row.get("certificate")
    if isinstance(cert, Mapping) and cert.get("serial") is not None:
        end += f" cert serial {cert['serial']}"  # what the target's sshd logged for this login
    return escape_text(end)


def table(fields: list[list[str]], shrinkable: frozenset[int], width: int | None) -> list[str]:
    """Rows of fields as aligned columns two spaces apart, the last one free: each column
    as wide as its widest field (at most WHO_CELLS), and when the columns would leave the
    last fewer than LAST_CELLS of `width` (or what it needs, if less), the `shrinkable`
    ones (who, user@host) cut down, widest first, to no fewer than SHRUNK_CELLS. Every
    line at most `width - 1` cells."""
    if not fields:
        return []
    n = len(fields[0])
    widths = [
        min(max(cells(f[i]) for f in fields), WHO_CELLS if i in shrinkable else 10_000)
        for i in range(n - 1)
    ]
    if width is not None:
        room = max(1, width - 1) - min(LAST_CELLS, max(cells(f[-1]) for f in fields))

        def over() -> int:
            return sum(widths) + 2 * (n - 1) - room

        while over() > 0:
            i = max(shrinkable, key=lambda j: widths[j])
            if widths[i] <= SHRUNK_CELLS:
                break
            widths[i] -= 1  # the widest first, a cell at a time: both keep what they can
    out = []
    for f in fields:
        head = "  ".join(pad(text, w) for text, w in zip(f, widths, strict=False))
        out.append(line(f"{head}  {f[-1]}" if n > 1 else f[-1], width))
    return out


WHO, TARGET = 1, 2  # where who and user@host stand in every view's fields
SHRINKABLE = frozenset({WHO, TARGET})


def activity_fields(row: Mapping[str, Any], now: float) -> list[str]:
    """time, who, user@host, outcome, command"""
    end = ending(row)
    grant = row.get("grant")
    if isinstance(grant, str) and row.get("grant_pattern") is not None:
        grant = {
            "id": grant,
            "pattern": row["grant_pattern"],
            "uses_left": row.get("grant_uses_left"),
        }
    if (g := grant_part(grant)) is not None:
        end += f" [{g}]"
    return [
        clock(row.get("received_at"), now),
        who(row.get("subject")),
        target(row),
        end,
        command_text(row),
    ]


def activity_rows(
    rows: Iterable[Mapping[str, Any]], width: int | None, now: float | None = None
) -> list[str]:
    at = time.time() if now is None else now
    return table([activity_fields(r, at) for r in rows], SHRINKABLE, width)


def activity_row(row: Mapping[str, Any], width: int | None, now: float) -> str:
    return activity_rows([row], width, now)[0]


def approver(by: object, signed_by: object = None) -> str:
    """Who approved a session: its card's signers (a presence account's), or the uid the
    operator socket saw (the pid, which names no one once that process is gone, is in
    --json); older journals: not recorded."""
    if isinstance(signed_by, list) and signed_by:
        return "signed by " + ", ".join(escape_text(str(n)) for n in signed_by)
    if not isinstance(by, Mapping):
        return "by: not recorded"
    return f"by uid {by.get('uid')}"


def session_fields(row: Mapping[str, Any], now: float) -> list[str]:
    """id, who, user@host, when (since START, or START-END and why it ended) and who
    approved it: a live session (the gateway's `sessions` answer: `id`) or one from the
    journal (`session_id`; `end_reason` None while it lives)."""
    sid = row.get("session_id") or row.get("id")
    started = clock(row.get("approved_at"), now)
    if "session_id" not in row or row.get("end_reason") is None:
        when = f"since {started}"
    else:
        ended = clock(row.get("ended_at"), now)
        when = f"{started}-{ended} {escape_text(str(row['end_reason']))}"
    by = approver(row.get("approved_by"), row.get("signed_by"))
    grants = row.get("grants")
    for grant in [row.get("grant"), *(grants if isinstance(grants, list) else [])]:
        if (g := grant_part(grant)) is not None:
            by += f"  {g}"
    return [escape_text(str(sid)), who(row.get("subject")), target(row), when, by]


def session_rows(
    rows: Iterable[Mapping[str, Any]], width: int | None, now: float | None = None
) -> list[str]:
    at = time.time() if now is None else now
    return table([session_fields(r, at) for r in rows], SHRINKABLE, width)


def session_row(row: Mapping[str, Any], width: int | None, now: float) -> str:
    return session_rows([row], width, now)[0]


def expiry(expires_at: object, now: float) -> str:
    """When a card stops waiting: "in 43 s (21:53:10)", or "at 21:53:10, passed"."""
    if not isinstance(expires_at, int | float):
        return "unknown"
    if expires_at <= now:
        return f"at {clock(expires_at, now)}, passed"
    return f"in {expires_at - now:.0f} s ({clock(expires_at, now)})"


def pending_fields(card: Mapping[str, Any], now: float) -> list[str]:
    """id, who, user@host, kind, expiry, and what it asks (command, file, or a session)"""
    if card.get("file"):
        what = command_text(card)
    elif card.get("command") is not None:
        # a card's command is escaped already (`Card.as_json`); escape_text keeps it as is
        what = escape_text(str(card["command"]))
    else:
        what = "(a session)"
    return [
        escape_text(str(card.get("id"))),
        who(card.get("subject")),
        target(card),
        escape_text(str(card.get("kind"))),
        "expires " + expiry(card.get("expires_at"), now),
        what,
    ]


def pending_rows(
    cards: Iterable[Mapping[str, Any]], width: int | None, now: float | None = None
) -> list[str]:
    at = time.time() if now is None else now
    return table([pending_fields(c, at) for c in cards], SHRINKABLE, width)


def pending_row(card: Mapping[str, Any], width: int | None, now: float) -> str:
    return pending_rows([card], width, now)[0]


_DURATION = re.compile(r"(?:(\d+)([smhd]))+")
_PART = re.compile(r"(\d+)([smhd])")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
WHEN_HELP = (
    "a duration meaning that long ago (30s, 10m, 2h, 1d, 1h30m), or a local time: "
    "2026-12-01T21:00, 2026-12-01 21:00:05, 2026-12-01, or 21:00 (today)"
)


def parse_when(text: str, now: float) -> float:
    """`--since`/`--until`: a time (seconds since the epoch) from a duration ago or a
    local ISO time; ValueError says what is accepted."""
    text = text.strip()
    if _DURATION.fullmatch(text):
        return now - sum(int(n) * _SECONDS[u] for n, u in _PART.findall(text))
    try:
        if re.fullmatch(r"\d{1,2}:\d{2}(:\d{2})?", text):
            today = datetime.datetime.fromtimestamp(now).date()
            clock_time = datetime.time.fromisoformat(text if text.index(":") == 2 else "0" + text)
            return datetime.datetime.combine(today, clock_time).timestamp()
        when = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"{text!r} is not {WHEN_HELP}") from None
    return when.timestamp()  # a time without a zone is local time
