"""Who may speak for the operator: the operator socket's one decision.

The operator socket (`gateway/opserver.py`) observes the process on the other
end -- the uid the kernel reports, and whether it descends from a process the
gateway knows as an agent -- and asks `admit`. Two rules, in this order: the
peer runs as the gateway's own uid (or root), and it is not inside an agent's
process tree, so an agent cannot approve itself even when it runs as the same
user. The refusal's words are chosen here, once; the socket answers them as
`refused: <words>` and serves nothing else on that connection.
"""

from __future__ import annotations

from dataclasses import dataclass

ROOT_UID = 0

INSIDE_AN_AGENT = (
    "this request comes from inside an agent's process tree; an agent cannot "
    "answer for the operator. Run it from the operator's own terminal."
)


@dataclass(frozen=True)
class Caller:
    """What the operator socket observed of its peer, nothing decided yet."""

    uid: int  # SO_PEERCRED's uid
    below_agent: bool  # it, or an ancestor, is a process the gateway knows as an agent


def admit(caller: Caller, daemon_uid: int) -> str | None:
    """Why `caller` may not speak for the operator, or None if it may."""
    if caller.uid not in (daemon_uid, ROOT_UID):
        return f"uid {caller.uid} is not the gateway's operator"
    if caller.below_agent:
        return INSIDE_AN_AGENT
    return None
