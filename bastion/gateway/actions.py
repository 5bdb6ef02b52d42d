"""Which logical actions must be looked at before they are tried again.

An agent names a logical action with BASTION_ACTION_KEY (bound to the process
that sent it: `events.bound_action`). If an attempt ended with an unknown
outcome, the gate refuses the next one (`World.action_unknown`,
`ACTION_OUTCOME_UNKNOWN`) until the agent acknowledges it. This is the one
piece of that rule that changes as requests end, so it lives in the gateway,
beside the service that keeps it; `events.recover` rebuilds it after a restart.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bastion.core.events import Outcome


@dataclass
class ActionKeys:
    """Which logical actions (BASTION_ACTION_KEY, bound to their subject) must be looked at
    before they are tried again: an action's last attempt decides -- an unknown
    outcome blocks it, any other outcome clears it, and so does the agent's
    acknowledgement."""

    blocked: dict[str, str] = field(default_factory=dict)  # action -> request id

    def outcome(self, action: str, request_id: str, outcome: Outcome) -> None:
        if outcome is Outcome.UNKNOWN:
            self.blocked[action] = request_id
        else:
            self.blocked.pop(action, None)

    def acknowledge(self, action: str) -> bool:
        """The agent inspected the target; True if the action was blocked."""
        return self.blocked.pop(action, None) is not None

    def blocking(self, action: str | None) -> str | None:
        return self.blocked.get(action) if action else None
