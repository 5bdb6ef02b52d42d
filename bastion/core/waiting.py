"""The waiting line: what an agent's ssh shows while its card waits for a person.

Without it an agent hears nothing until the operator answers or the card expires,
and an agent that hears nothing gives up, retries or guesses. One fixed template,
written to the agent's stderr only (its stdout stays the target's bytes); nothing
in it comes from the agent, and the card id and target, names the gateway and the
policy made, are escaped anyway, so the line cannot move an agent's terminal.
"""

from __future__ import annotations

from bastion.core.cards import Card
from bastion.core.display import escape_text
from bastion.core.gate import CardKind

# Set by the agent (ssh `SetEnv`, or `SendEnv` from its environment) to "0" for no line.
WAIT_LINE_ENV = "BASTION_WAIT_LINE"
_OFF = frozenset({"0", "no", "false", "off"})


def wanted(account_shows: bool, agent_says: str | None) -> bool:
    """Is the line written? The account (`waiting_line = false`) and the agent
    (`BASTION_WAIT_LINE=0`) may each turn it off; unset, or any other value, is on."""
    return account_shows and (agent_says or "").strip().lower() not in _OFF


def waiting_line(card: Card) -> bytes:
    """The one line for one raised card, in ASCII (an agent's stderr may be read as bytes)."""
    kind = "command card" if card.kind is CardKind.COMMAND else "session card"
    target = f"{card.binding.user}@{card.host}"
    expires = max(round(card.expires_at - card.created_at), 0)
    text = (
        f"bastion: waiting for approval of card {escape_text(card.id)} "
        f"({kind} for {escape_text(target)}); the operator answers in `bastion approve`; "
        f"nothing is sent until then (the card expires in {expires} s)\n"
    )
    return text.encode("ascii", "backslashreplace")
