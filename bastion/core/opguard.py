"""Who may speak for the operator: the operator socket's one decision.

The operator socket (`gateway/opserver.py`) observes the process on the other
end -- the uid the kernel reports, whether it lives in namespaces other than
the gateway's, and whether it descends from a process the gateway knows as an
agent -- and asks `admit`. Three rules, in this order: the peer runs as the
gateway's own uid (or root); it is not inside a sandbox (another PID or user
namespace: a kernel fact, true whatever this gateway lifetime remembers, so a
run that outlived a gateway restart is still refused); and it is not inside an
agent's process tree, so an agent cannot approve itself even when it runs as
the same user. The refusal's words are chosen here, once; the socket answers them as
`refused: <words>` and serves nothing else on that connection.
"""

from __future__ import annotations

from dataclasses import dataclass

ROOT_UID = 0

INSIDE_A_SANDBOX = (
    "this request comes from inside a sandboxed run (another PID or user namespace "
    "than the gateway's); nothing inside a run can answer for the operator. Run it "
    "from the operator's own terminal, outside every `bastion run`."
)
INSIDE_AN_AGENT = (
    "this request comes from inside an agent's process tree; an agent cannot "
    "answer for the operator. Run it from the operator's own terminal."
)


@dataclass(frozen=True)
class Caller:
    """What the operator socket observed of its peer, nothing decided yet."""

    uid: int  # SO_PEERCRED's uid
    sandboxed: bool  # in another PID or user namespace than the gateway, or unreadable
    below_agent: bool  # it, or an ancestor, is a process the gateway knows as an agent


@dataclass(frozen=True)
class Operator:
    """Who answered a card, as the operator socket's kernel saw the peer (SO_PEERCRED):
    journaled with the session approval it gave, so `sessions` can say who approved."""

    uid: int
    pid: int

    def as_json(self) -> dict[str, int]:
        return {"uid": self.uid, "pid": self.pid}


def admit(caller: Caller, daemon_uid: int) -> str | None:
    """Why `caller` may not speak for the operator, or None if it may."""
    if caller.uid not in (daemon_uid, ROOT_UID):
        return f"uid {caller.uid} is not the gateway's operator"
    if caller.sandboxed:
        return INSIDE_A_SANDBOX
    if caller.below_agent:
        return INSIDE_AN_AGENT
    return None
