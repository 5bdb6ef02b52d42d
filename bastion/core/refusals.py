"""What the edges may say, and the code each saying carries: one table, chosen here.

The edges -- the outbound connection, the certificate signers, the agent socket's
query doors, the agent-side helpers -- observe: a connect error, a vault that is
locked, a journal write that failed, an argument a model sent. They do not choose
what the agent is told. They name what they saw (a `Fact`, or for the agent-side
helpers an `Observed`) with the words that describe it, and this module returns
the `Refusal` (or the error object, or the `Result` after the exec) with its code
and its exact message. As OpenSSH's monitor.c lists every request its child may
make in one table, `SAID` lists every refusal an edge may make; the gate's own
refusals are in `gate.py` (docs/architecture.md, "The gate").
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from bastion.core.contract import Code, Refusal
from bastion.core.events import CAUSE_KILLED, CAUSE_LOST, Outcome, Result


class Fact(enum.Enum):
    """What an edge of the gateway saw before the exec request left: nothing was sent."""

    # the outbound connection (gateway/outbound.py)
    KEY_LOCKED = "key_locked"  # the vault locked before the login key was read
    KEY_UNAVAILABLE = "key_unavailable"  # the vault cannot give the credential the policy names
    HOST_KEY_CHANGED = "host_key_changed"  # the target's host key is not the pinned one
    KEY_REFUSED = "key_refused"  # the target refused the account's key
    CERTIFICATE_REFUSED = "certificate_refused"  # the target refused the command's certificate
    NETWORK = "network"  # no connection: refused, reset, timed out
    SESSION_REFUSED = "session_refused"  # the target refused an exec channel (MaxSessions)
    TERMINAL_REFUSED = "terminal_refused"  # the target refused the terminal (PermitTTY no)
    # the sftp subsystem (gateway/sftp.py)
    WALK_CUT = "walk_cut"  # the target's connection failed while a path's walk read it
    # the agent socket's SSH server (gateway/agent_ssh.py)
    FORWARDING = "forwarding"  # a forwarded connection or tunnel asked of the gateway (-W, -L)
    # a certificate account's certificate (gateway/certify.py, issuer.py, openbao.py)
    UNCERTIFIABLE = "uncertifiable"  # no certificate can carry the command exactly
    NO_CA = "no_ca"  # the vault holds no user CA
    CA_LOCKED = "ca_locked"  # the vault locked before the CA signed
    CA_FAILED = "ca_failed"  # the vault's CA could not sign
    SIGNER_LOCKED = "signer_locked"  # the vault locked before the OpenBao login was read
    SIGNER_FAILED = "signer_failed"  # OpenBao did not sign, or signed something else
    CERTIFICATE_NOT_JOURNALED = "certificate_not_journaled"
    # the agent socket's query doors (gateway/agent_doors.py)
    POLICY_UNREADABLE = "policy_unreadable"  # the policy did not load


@dataclass(frozen=True)
class Saying:
    """One row of the table: the code, the message (a `str.format` template over the
    words the edge observed), and the journal's cause when it is not the code's value."""

    code: Code
    text: str
    cause: str | None = None


_SIGN_FIX = (
    "An operator must make the target trust the CA (`bastion ca public` prints the "
    'sshd_config), list "{user}" as its principal, and check that the account\'s '
    "source_address is the address the target sees the gateway connect from."
)

SAID: dict[Fact, Saying] = {
    Fact.KEY_LOCKED: Saying(
        Code.VAULT_LOCKED,
        "The credential vault was locked before the command could be sent. "
        "It was not queued or sent.",
    ),
    Fact.KEY_UNAVAILABLE: Saying(
        Code.INTERNAL,
        'The policy names credential "{credential}" for {user}@{host}, but the vault cannot '
        "provide it ({why}). Nothing was sent; an operator must add the key (`bastion key "
        "import`) or fix the policy.",
    ),
    Fact.HOST_KEY_CHANGED: Saying(
        Code.HOST_KEY_MISMATCH,
        'The host key of "{host}" ({address}:{port}) does not match the key pinned in the '
        "policy. Do not retry: an operator must check the host and update the pin if the "
        "change is legitimate.",
    ),
    Fact.KEY_REFUSED: Saying(
        Code.TARGET_AUTH_FAILED,
        '"{host}" refused the credential "{credential}" for user "{user}". An operator must '
        "install its public key on the target.",
    ),
    Fact.CERTIFICATE_REFUSED: Saying(
        Code.TARGET_AUTH_FAILED,
        '"{host}" refused the certificate (key id {key_id}, serial {serial}) for user '
        '"{user}". ' + _SIGN_FIX,
    ),
    Fact.NETWORK: Saying(
        Code.UNREACHABLE,
        'Could not reach "{host}" at {address}:{port} ({why}). Nothing ran; it is safe to '
        "retry later.",
    ),
    Fact.SESSION_REFUSED: Saying(
        Code.UNREACHABLE,
        '"{host}" refused a new session ({why}); nothing ran. It is safe to retry later.',
        cause="session_refused",
    ),
    Fact.TERMINAL_REFUSED: Saying(
        Code.UNSUPPORTED_REQUEST,
        '"{host}" refused to make a terminal (sshd\'s PermitTTY, no-pty in '
        "authorized_keys, or a certificate without permit-pty); the command did not run. "
        "Run it without -t/-tt (or with -o RequestTTY=no); for ansible, turn pipelining on.",
        cause="terminal_refused",
    ),
    Fact.WALK_CUT: Saying(
        Code.UNREACHABLE,
        'The connection to "{host}" failed while the gateway read where the path leads '
        "({why}); the file operation was not sent. It is safe to retry later.",
        cause="walk_cut",
    ),
    Fact.FORWARDING: Saying(
        Code.UNSUPPORTED_REQUEST,
        "bastion forwards nothing (asked: {what}); it runs one command per ssh call: ssh "
        "HOST 'COMMAND'. Nothing was sent.",
    ),
    Fact.UNCERTIFIABLE: Saying(
        Code.UNSUPPORTED_REQUEST,
        "No certificate can carry this command for {account} ({why}). Nothing was sent.",
    ),
    Fact.NO_CA: Saying(Code.POLICY_UNAVAILABLE, "{problem}"),
    Fact.CA_LOCKED: Saying(
        Code.VAULT_LOCKED,
        "The credential vault was locked before the command's certificate could be signed. "
        "It was not queued or sent.",
    ),
    Fact.CA_FAILED: Saying(
        Code.INTERNAL,
        "The vault's CA could not sign the command's certificate ({why}). Nothing was sent.",
    ),
    Fact.SIGNER_LOCKED: Saying(
        Code.VAULT_LOCKED,
        "The credential vault is locked, so the gateway cannot log in to OpenBao to sign the "
        "command's certificate. It was not queued or sent.",
    ),
    # What failed in OpenBao and what an operator must fix there is the signer's to say.
    Fact.SIGNER_FAILED: Saying(Code.INTERNAL, "{detail}"),
    Fact.CERTIFICATE_NOT_JOURNALED: Saying(
        Code.INTERNAL,
        "The gateway could not record the command's certificate durably, so it did not use "
        "it. Nothing was sent.",
    ),
    Fact.POLICY_UNREADABLE: Saying(
        Code.POLICY_UNAVAILABLE,
        "The policy is unavailable; the operator must fix it (see `bastion status`). Every "
        "request is refused until then.",
    ),
}


def refusal(fact: Fact, **words: object) -> Refusal:
    """The refusal for what an edge saw; its journal cause is the code's value unless
    the table names another."""
    saying = SAID[fact]
    return Refusal(
        saying.code, saying.text.format(**words), cause=saying.cause or saying.code.value
    )


def error_object(code: Code, message: str, request_id: str | None = None) -> dict[str, object]:
    """The agent-facing error object (`Failure.json_line`'s "error") for an answer that
    has no request behind it, or whose request the caller names."""
    return {
        "code": code.value,
        "message": message,
        "request_id": request_id,
        "retryable": code.retryable,
    }


def answer(fact: Fact, **words: object) -> dict[str, object]:
    """A query door's refusal, whole: `{"ok": false, "error": ...}` without a request."""
    said = refusal(fact, **words)
    return {"ok": False, "error": error_object(said.code, said.message)}


def not_started(refused: Refusal) -> Result:
    """The journal's ending for a refusal raised once the dispatch began: `not_started`,
    with the refusal's code, message and cause."""
    return Result(
        Outcome.NOT_STARTED, code=refused.code, message=refused.message, cause=refused.cause
    )


# -- after the exec request left: not a refusal, an ending as it is known -------------------


def rejected(host: str) -> Result:
    """The target answered the exec request with a failure: the command did not run."""
    return Result(
        Outcome.REMOTE_REJECTED,
        code=Code.UNREACHABLE,
        message=f'"{host}" refused to start the command; it did not run.',
        cause="exec_refused",
    )


def lost(host: str, why: str) -> Result:
    """The exec request left and no exit status or signal came back: it may have run."""
    return Result(
        Outcome.UNKNOWN,
        cause=CAUSE_LOST,
        code=Code.STATUS_UNKNOWN,
        message=f'The command was sent to "{host}" but {why}. It may or may not have run: '
        "inspect the target before retrying.",
    )


def killed(cut_off: Result) -> Result:
    """The operator ended the command (`bastion kill`) before an exit status came back:
    still unknown, but the agent is told who ended it, so it does not blame the target."""
    return Result(
        Outcome.UNKNOWN,
        code=cut_off.code,
        message="The operator ended this command before it reported an exit status; it "
        "may or may not have finished. Inspect the target before retrying.",
        cause=CAUSE_KILLED,
    )


# -- the agent side: `bastion mcp` and `agent.client`, which end a call themselves -----------


class Observed(enum.Enum):
    """What an agent-side helper saw when it ends a call without the gateway's answer."""

    GATEWAY_UNUSABLE = "gateway_unusable"  # the gateway could not be asked, or answered nonsense
    GATEWAY_SLOW = "gateway_slow"  # the gateway did not answer in time; nothing was sent
    GATEWAY_DECLINED = "gateway_declined"  # the gateway answered a question with ERR
    ARGUMENT = "argument"  # a model's argument that cannot be used: nothing was sent
    HELPER_FAILED = "helper_failed"  # the helper itself, or ssh before the gateway, failed
    STILL_HELD = "still_held"  # the call's time ran out; the gateway still holds the command


AGENT_SIDE: dict[Observed, Code] = {
    Observed.GATEWAY_UNUSABLE: Code.INTERNAL,
    Observed.GATEWAY_SLOW: Code.GATEWAY_BUSY,
    Observed.GATEWAY_DECLINED: Code.INTERNAL,
    Observed.ARGUMENT: Code.UNSUPPORTED_REQUEST,
    Observed.HELPER_FAILED: Code.INTERNAL,
    Observed.STILL_HELD: Code.STATUS_UNKNOWN,
}


def agent_error(
    observed: Observed, message: str, request_id: str | None = None
) -> dict[str, object]:
    """The error object an agent-side helper hands the model for what it observed."""
    return error_object(AGENT_SIDE[observed], message, request_id)


def waited_out(recorded: str | None) -> str:
    """The code of a call whose time ran out while the gateway still waited (for an
    approval or a free slot): the one the journal recorded, else APPROVAL_TIMEOUT."""
    return recorded or Code.APPROVAL_TIMEOUT.value


# -- the agent socket before SSH: a connection turned away with one `ERR` line -------------


class Turned(enum.Enum):
    """Why the agent socket turned a connection away before any SSH (`agent_ssh`)."""

    FULL = "full"  # its tenant's share of connections, all agents' ceiling, no walker turn
    REFUSED = "refused"  # a header, an identity or a registration it cannot take


# The code each carries on the `ERR` line, which the proxy and the agent client read
# (`agent/wire.refusal_line`). A full gateway is worth retrying; a refusal is not.
TURNED: dict[Turned, Code] = {Turned.FULL: Code.GATEWAY_BUSY, Turned.REFUSED: Code.INTERNAL}
