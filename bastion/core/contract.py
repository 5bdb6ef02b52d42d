"""The agent-facing error contract, in one place (docs/policies.md, "What the agent sees").

An agent reads exactly two things when the gateway ends its request: the exit
status and the last stderr line, a JSON object. Both are derived here from a
single `Code`, so a code can never travel with the wrong exit status or the
wrong `retryable` flag.
"""

from __future__ import annotations

import enum
import json
from dataclasses import FrozenInstanceError, dataclass

from bastion.core.errors import BastionError


class Exit(enum.IntEnum):
    """Exit statuses that tell an agent which kind of ending it met."""

    DENIED = 77  # denied by the gateway; nothing was sent
    NOT_REACHED = 69  # target not reached; nothing was sent
    STATUS_UNKNOWN = 76  # dispatched, outcome not observed
    INTERNAL = 70  # gateway fault


class EndReason(enum.Enum):
    """Why an earlier approval of a matching subject no longer holds: the
    `reauth_reason` an agent reads beside the code."""

    PROCESS_CHANGED = "process_changed"
    GATEWAY_RESTARTED = "gateway_restarted"
    VAULT_STATE_CHANGED = "vault_state_changed"
    POLICY_CHANGED = "policy_changed"
    REVOKED = "revoked"


class Code(enum.Enum):
    """Every way the gateway itself can end a request."""

    VAULT_LOCKED = "VAULT_LOCKED"
    POLICY_DENIED = "POLICY_DENIED"
    POLICY_UNAVAILABLE = "POLICY_UNAVAILABLE"
    UNKNOWN_HOST = "UNKNOWN_HOST"
    SESSION_DENIED = "SESSION_DENIED"
    CALL_DENIED = "CALL_DENIED"
    APPROVAL_TIMEOUT = "APPROVAL_TIMEOUT"
    NO_APPROVER = "NO_APPROVER"
    UNSUPPORTED_REQUEST = "UNSUPPORTED_REQUEST"
    ACTION_OUTCOME_UNKNOWN = "ACTION_OUTCOME_UNKNOWN"
    UNREACHABLE = "UNREACHABLE"
    HOST_KEY_MISMATCH = "HOST_KEY_MISMATCH"
    TARGET_AUTH_FAILED = "TARGET_AUTH_FAILED"
    STATUS_UNKNOWN = "STATUS_UNKNOWN"
    INTERNAL = "INTERNAL"
    GATEWAY_BUSY = "GATEWAY_BUSY"

    @property
    def exit_status(self) -> int:
        return int(CONTRACT[self][0])

    @property
    def retryable(self) -> bool:
        """Whether repeating *this* request unchanged could succeed without a
        person or the target being looked at first."""
        return CONTRACT[self][1]


# The contract table: code -> (exit status, retryable). Kept apart from the enum so
# that two codes with the same contract stay two codes.
CONTRACT: dict[Code, tuple[Exit, bool]] = {
    Code.VAULT_LOCKED: (Exit.DENIED, False),
    Code.POLICY_DENIED: (Exit.DENIED, False),
    Code.POLICY_UNAVAILABLE: (Exit.DENIED, False),
    Code.UNKNOWN_HOST: (Exit.DENIED, False),
    Code.SESSION_DENIED: (Exit.DENIED, False),
    Code.CALL_DENIED: (Exit.DENIED, False),
    Code.APPROVAL_TIMEOUT: (Exit.DENIED, False),
    Code.NO_APPROVER: (Exit.DENIED, False),
    Code.UNSUPPORTED_REQUEST: (Exit.DENIED, False),
    Code.ACTION_OUTCOME_UNKNOWN: (Exit.DENIED, False),
    Code.UNREACHABLE: (Exit.NOT_REACHED, True),
    Code.HOST_KEY_MISMATCH: (Exit.NOT_REACHED, False),
    Code.TARGET_AUTH_FAILED: (Exit.NOT_REACHED, False),
    Code.STATUS_UNKNOWN: (Exit.STATUS_UNKNOWN, False),
    Code.INTERNAL: (Exit.INTERNAL, False),
    # Too many commands in flight for too long: nothing was sent, and the same
    # request a little later may well run (sysexits' EX_UNAVAILABLE, like UNREACHABLE).
    Code.GATEWAY_BUSY: (Exit.NOT_REACHED, True),
}


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
            "code": self.code.value,
            "message": self.message,
            "request_id": self.request_id,
            "retryable": self.code.retryable,
        }
        if self.reauth_reason is not None:
            error["reauth_reason"] = self.reauth_reason
        return json.dumps({"ok": False, "error": error}, ensure_ascii=True).encode() + b"\n"


NOT_SENT = "Nothing was sent to the target."


@dataclass(frozen=True)
class Refusal(BastionError):
    """Nothing was sent: the one shape of every ending before an exec request left.

    The gate returns one as its verdict; the parts that carry a decided command out
    (the slot wait, the intent, the signer, the outbound connection) raise one; the
    request path journals it (`denied`, or `not_started` once the dispatch began) and
    the agent reads `failure(request_id)`. Its code is always chosen in `core/`.
    """

    code: Code
    message: str
    reauth_reason: EndReason | None = None
    cause: str | None = None  # for the journal: what is known of why nothing ran

    def __str__(self) -> str:
        return self.message

    def failure(self, request_id: str, reason: EndReason | None = None) -> Failure:
        """What the agent is told; `reason` explains a refusal that followed a card."""
        why = self.reauth_reason or reason
        return Failure(self.code, self.message, request_id, why.value if why else None)


def _exception_state(self: Refusal, name: str, value: object) -> None:
    """The fields stay frozen; the interpreter's own bookkeeping of a raised
    exception (`__traceback__`, `__context__`, ... which `contextlib` assigns as a
    refusal passes through a `with`) is let through."""
    if not (name.startswith("__") and name.endswith("__")):
        raise FrozenInstanceError(f"cannot assign to field {name!r}")
    object.__setattr__(self, name, value)


# Set after the class is made: a frozen dataclass may not define `__setattr__` itself.
Refusal.__setattr__ = _exception_state  # type: ignore[method-assign, assignment]
