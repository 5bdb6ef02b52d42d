"""The agent-facing error contract (DESIGN.md §4), in one place.

An agent reads exactly two things when the gateway ends its request: the exit
status and the last stderr line, a JSON object. Both are derived here from a
single `Code`, so a code can never travel with the wrong exit status or the
wrong `retryable` flag.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass


class Exit(enum.IntEnum):
    """Exit statuses that tell an agent which kind of ending it met."""

    DENIED = 77  # denied by the gateway; nothing was sent
    NOT_REACHED = 69  # target not reached; nothing was sent
    STATUS_UNKNOWN = 76  # dispatched, outcome not observed
    INTERNAL = 70  # gateway fault


class Code(enum.Enum):
    """Every way the gateway itself can end a request.

    The value is `(exit status, retryable)`: whether repeating *this* request
    unchanged could succeed without a person or the target being looked at.
    """

    VAULT_LOCKED = (Exit.DENIED, False)
    POLICY_DENIED = (Exit.DENIED, False)
    POLICY_UNAVAILABLE = (Exit.DENIED, False)
    UNKNOWN_HOST = (Exit.DENIED, False)
    SESSION_DENIED = (Exit.DENIED, False)
    CALL_DENIED = (Exit.DENIED, False)
    APPROVAL_TIMEOUT = (Exit.DENIED, False)
    NO_APPROVER = (Exit.DENIED, False)
    UNSUPPORTED_REQUEST = (Exit.DENIED, False)
    ACTION_OUTCOME_UNKNOWN = (Exit.DENIED, False)
    UNREACHABLE = (Exit.NOT_REACHED, True)
    HOST_KEY_MISMATCH = (Exit.NOT_REACHED, False)
    TARGET_AUTH_FAILED = (Exit.NOT_REACHED, False)
    STATUS_UNKNOWN = (Exit.STATUS_UNKNOWN, False)
    INTERNAL = (Exit.INTERNAL, False)

    @property
    def exit_status(self) -> int:
        return int(self.value[0])

    @property
    def retryable(self) -> bool:
        return bool(self.value[1])


@dataclass(frozen=True)
class Failure:
    """A request ended by the gateway: what the agent is told, verbatim."""

    code: Code
    message: str
    request_id: str
    reauth_reason: str | None = None

    def json_line(self) -> bytes:
        """The single JSON line the agent finds last on stderr."""
        error: dict[str, object] = {
            "code": self.code.name,
            "message": self.message,
            "request_id": self.request_id,
            "retryable": self.code.retryable,
        }
        if self.reauth_reason is not None:
            error["reauth_reason"] = self.reauth_reason
        return json.dumps({"ok": False, "error": error}, ensure_ascii=True).encode() + b"\n"
