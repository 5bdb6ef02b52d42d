"""The one line `bastion approve` shows between cards: is the vault locked, how
many sessions live and cards wait, how far behind the witness is.

Pure: the gateway's `status` reply in, one line of text out, cut to the
terminal's width (a line that wrapped could not be redrawn in place). The
prompt draws it; `bastion status` says the same things at length.
"""

from __future__ import annotations

from typing import Any

from bastion.core.display import escape_text

KEYS = "L lock, q quit, a activity, s sessions"  # cut from the end on a narrow terminal


def witness_part(w: dict[str, Any] | None) -> str:
    """The witness's lag in a few words (`bastion status` has the details)."""
    if w is None:
        return "witness none"
    waiting = int(w.get("waiting") or 0)
    age = w.get("oldest_age")
    lag = f"{waiting} behind" + (f", oldest {age:.0f} s" if age is not None and waiting else "")
    trouble = [
        word
        for word, bad in (
            ("REFUSING NEW WORK", w.get("refusing")),
            ("FULL", w.get("full") and not w.get("refusing")),
            ("FAILING", any(t.get("failing") for t in (w.get("targets") or {}).values())),
        )
        if bad
    ]
    return "witness " + (" ".join(trouble) + ": " if trouble else "") + lag


def status_line(status: dict[str, Any] | None, width: int = 80) -> str:
    """What the prompt shows between cards, at most `width - 1` characters (the
    last column is left free: writing it makes some terminals wrap)."""
    if status is None:
        text = f"gateway status not available | {KEYS}"
    else:
        parts = [
            "vault " + ("locked" if status.get("locked") else "unlocked"),
            f"sessions {status.get('sessions', '?')}",
            f"pending {status.get('pending', '?')}",
            witness_part(status.get("witness")),
            KEYS,
        ]
        text = " | ".join(parts)
    text = escape_text(text)
    limit = max(1, width - 1)
    return text if len(text) <= limit else text[: limit - 3] + "..."
