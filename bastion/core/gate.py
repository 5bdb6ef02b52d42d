"""The decision: one pure function from (request, world) to a verdict.

This is the audited core of bastion. It does no I/O and keeps no state: the
gateway takes a snapshot of the world (`World`), asks `evaluate`, acts on the
verdict, and -- after any wait for a person -- takes a *new* snapshot and asks
again. That loop is what makes "re-check after every wait" impossible to
forget: nothing decided before a wait is carried across it except the grant
a person just gave, and the gate re-validates that grant against the world
as it is now. `final_check` is the same question asked once more right
before the exec request leaves, and `unanswered` says what a card that got no
"yes" means for the agent. The order of the checks is the contract
(docs/architecture.md, "The gate").
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass

from bastion.core.binding import Binding
from bastion.core.certs import Auth
from bastion.core.contract import NOT_SENT, Code, EndReason, Failure
from bastion.core.defaults import MAX_COMMAND_BYTES
from bastion.core.policy import (
    Account,
    CommandCheck,
    Host,
    Policy,
    PolicyError,
    check_command,
    entry_digest,
    needs_command_card,
    preapproval,
)
from bastion.core.subject import SubjectKey


class CardKind(enum.Enum):
    """What a card asks: may this process use this entry, or may it run this command."""

    SESSION = "session"
    COMMAND = "command"


class Answer(enum.Enum):
    """How a card's life ended, as the waiting request learns it."""

    APPROVED = "approved"
    DECLINED = "declined"
    TIMEOUT = "timeout"  # an operator was watching and did not answer
    UNSEEN = "unseen"  # timed out with no operator watching at any point
    WITHDRAWN_LOCKED = "withdrawn_locked"  # vault locked: the question is void
    WITHDRAWN_GONE = "withdrawn_gone"  # process exited or connection closed


@dataclass(frozen=True)
class SessionGrant:
    """A person allowed one subject to use one policy entry, for the life of
    that process, in one gateway lifetime and one vault epoch."""

    id: str
    subject_key: SubjectKey
    host: str
    user: str
    boot_id: str
    vault_epoch: int
    entry_digest: str
    approved_at: float


@dataclass(frozen=True)
class CommandGrant:
    """A person allowed one exact command, once, under one session grant: the
    binding is the one the card showed (`core/binding`)."""

    id: str
    session_id: str
    binding: Binding
    expires_at: float
    used: bool = False


@dataclass(frozen=True)
class Request:
    request_id: str
    host: str
    user: str
    command: bytes
    subject_key: SubjectKey
    action: str | None = None  # sha256 of the agent's BASTION_ACTION_KEY, if it sent one

    @property
    def command_sha256(self) -> str:
        """What this request does, as a card shows it and a grant is bound to it
        (`Binding.what`)."""
        return hashlib.sha256(self.command).hexdigest()


@dataclass(frozen=True)
class World:
    """Everything the gate may look at, read at one moment."""

    locked: bool
    vault_epoch: int
    boot_id: str
    policy: Policy | PolicyError
    subject_alive: bool
    session: SessionGrant | None  # the grant recorded for (subject, host, user), if any
    ended: EndReason | None  # why the last grant of a matching subject ended
    command_grant: CommandGrant | None  # the grant this request's command card produced
    now: float
    action_unknown: str | None = None  # the request whose outcome blocks this action key
    # Why no per-command certificate can be signed now (no CA in the vault), or None.
    certify_problem: str | None = None


@dataclass(frozen=True)
class Deny:
    code: Code
    message: str
    reauth_reason: EndReason | None = None

    def failure(self, request_id: str, reason: EndReason | None = None) -> Failure:
        """What the agent is told; `reason` explains a denial that followed a card."""
        why = self.reauth_reason or reason
        return Failure(self.code, self.message, request_id, why.value if why else None)


@dataclass(frozen=True)
class AskSession:
    host: Host
    account: Account
    entry_digest: str
    reason: EndReason | None


@dataclass(frozen=True)
class AskCommand:
    host: Host
    account: Account
    session: SessionGrant
    check: CommandCheck  # how the command reads (argv or shell source) and why it asks


@dataclass(frozen=True)
class Dispatch:
    host: Host
    account: Account
    session: SessionGrant
    command_grant: CommandGrant | None


Verdict = Deny | AskSession | AskCommand | Dispatch


def validate_command(command: bytes) -> str | None:
    """Why these bytes cannot be run exactly as decided, or None.

    A NUL would cut the command short on the target (sshd hands it to a C
    shell), so what ran would differ from what was approved; non-UTF-8 could
    not be shown to the operator faithfully; an unbounded command is a card
    nobody can read.
    """
    if not command.strip():
        return "an empty command was requested; bastion runs one command per ssh call"
    if len(command) > MAX_COMMAND_BYTES:
        return f"the command is {len(command)} bytes; the limit is {MAX_COMMAND_BYTES} bytes"
    if b"\0" in command:
        return "the command contains a NUL byte, which cannot be passed to the target intact"
    try:
        command.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"the command is not valid UTF-8 (byte {exc.start})"
    return None


def session_problem(grant: SessionGrant, world: World, digest: str) -> EndReason | None:
    """Why a recorded session grant does not hold in this world, if it does not."""
    if grant.boot_id != world.boot_id:
        return EndReason.GATEWAY_RESTARTED
    if grant.vault_epoch != world.vault_epoch:
        return EndReason.VAULT_STATE_CHANGED
    if grant.entry_digest != digest:
        return EndReason.POLICY_CHANGED
    return None


def command_grant_holds(
    grant: CommandGrant,
    req: Request,
    host: Host,
    account: Account,
    session: SessionGrant,
    now: float,
) -> bool:
    """A per-command grant covers exactly one command, on one host, as one
    account, with one credential, under one session -- once, and briefly."""
    return (
        not grant.used
        and now < grant.expires_at
        and grant.session_id == session.id
        and grant.binding == Binding.of(host, account, req.command_sha256)
    )


@dataclass(frozen=True)
class Assessment:
    """What the policy alone says of a command: the entry, how the command reads,
    which rule decided, and whether it will need a command card. The gate acts on
    it; `bastion check-command` prints it, so the two cannot disagree."""

    deny: Deny | None
    host: Host | None = None
    account: Account | None = None
    check: CommandCheck | None = None
    command_card: bool = False
    preapproved: str | None = None  # the preapproved rule that spares the command card


def assess(policy: Policy, host_name: str, user: str, command: bytes) -> Assessment:
    """Step 3 (host, account, command rules) and step 5's question: a card or not."""
    host = policy.host(host_name)
    if host is None:
        known = ", ".join(sorted(policy.hosts)) or "none"
        return Assessment(
            Deny(
                Code.UNKNOWN_HOST,
                f'Host "{host_name}" is not in the gateway policy (known hosts: {known}). '
                f"{NOT_SENT}",
            )
        )
    account = host.account(user)
    if account is None:
        users = ", ".join(a.user for a in host.accounts)
        return Assessment(
            Deny(
                Code.POLICY_DENIED,
                f'Account "{user}" is not allowed on host "{host_name}" (allowed: {users}). '
                f"{NOT_SENT}",
            ),
            host,
        )
    check = check_command(account, command.decode("utf-8"))
    if not check.allowed:
        deny = Deny(Code.POLICY_DENIED, f"Policy denies this command: {check.reason}. {NOT_SENT}")
        return Assessment(deny, host, account, check)
    return Assessment(
        None,
        host,
        account,
        check,
        needs_command_card(account, check),
        preapproval(account, check),
    )


def evaluate(req: Request, world: World) -> Verdict:
    """The checks in their contract order; the first that fails decides."""
    # 1. A locked vault ends everything at once; nothing else is evaluated.
    if world.locked:
        return Deny(
            Code.VAULT_LOCKED,
            "The credential vault is locked. This command was not queued or sent; "
            "ask the operator to unlock, then decide again whether to send it.",
        )
    problem = validate_command(req.command)
    if problem is not None:
        return Deny(Code.UNSUPPORTED_REQUEST, f"Refused: {problem}. {NOT_SENT}")
    # 2. No positive work without a valid policy.
    if isinstance(world.policy, PolicyError):
        return Deny(
            Code.POLICY_UNAVAILABLE,
            "The gateway's policy could not be loaded, so no command can be authorised. "
            f"An operator must fix the policy files. {NOT_SENT}",
        )
    # 3. Policy: host, account, command (read as argv or shell source).
    judged = assess(world.policy, req.host, req.user, req.command)
    if judged.deny is not None:
        return judged.deny
    host, account, check = judged.host, judged.account, judged.check
    assert host is not None and account is not None and check is not None
    # 3a. A certificate account with nothing to sign its certificate: the policy asks
    # for what this gateway cannot do, so no card is raised for a login that cannot happen.
    if account.auth is Auth.CERTIFICATE and world.certify_problem is not None:
        return Deny(
            Code.POLICY_UNAVAILABLE,
            f"The policy says {account.label} logs in with per-command certificates, but "
            f"{world.certify_problem}. {NOT_SENT}",
        )
    # 3b. The agent's logical action ended unknown last time: look before acting again.
    if world.action_unknown is not None:
        return Deny(
            Code.ACTION_OUTCOME_UNKNOWN,
            f"The last attempt of this action ({world.action_unknown}) ended with an unknown "
            "outcome: it may or may not have run. Inspect the target; to send it anyway, "
            f"repeat with SetEnv BASTION_ACK_UNKNOWN=1. {NOT_SENT}",
        )
    # 4 + 6. A live session grant, valid in this lifetime, epoch and policy entry.
    digest = entry_digest(host, account)
    if not world.subject_alive:
        return Deny(
            Code.SESSION_DENIED,
            f"The process that asked has exited; a new process needs a new approval. {NOT_SENT}",
            EndReason.PROCESS_CHANGED,
        )
    session = world.session
    if session is None:
        return AskSession(host, account, digest, world.ended)
    stale = session_problem(session, world, digest)
    if stale is not None:
        return AskSession(host, account, digest, stale)
    # 5. This exact command, once: per-command accounts, and shell source where it asks.
    if judged.command_card:
        grant = world.command_grant
        if grant is None or not command_grant_holds(grant, req, host, account, session, world.now):
            return AskCommand(host, account, session, check)
        return Dispatch(host, account, session, grant)
    return Dispatch(host, account, session, None)


def final_check(req: Request, world: World, decided: Dispatch) -> Failure | None:
    """Ask again right before the exec request leaves (connecting was a wait).

    Only the very grants that were decided may be used: the same session, and
    for a per-command account the same, still unused command grant.
    """
    verdict = evaluate(req, world)
    if isinstance(verdict, Dispatch) and verdict.session.id == decided.session.id:
        same = decided.command_grant is None or (
            verdict.command_grant is not None
            and verdict.command_grant.id == decided.command_grant.id
        )
        if same:
            return None
    if isinstance(verdict, Deny):
        return Failure(verdict.code, verdict.message, req.request_id)
    why = verdict.reason if isinstance(verdict, AskSession) else None
    return Failure(
        Code.SESSION_DENIED,
        "The approval ended while the gateway was connecting "
        "to the target; nothing was sent. Send the request again to be re-decided.",
        req.request_id,
        why.value if why else None,
    )


def unanswered(
    kind: CardKind,
    answer: Answer,
    target: str,
    request_id: str,
    reason: EndReason | None,
    approval_timeout: float,
) -> Failure:
    """What a card that got no "yes" means for the agent. `target` is USER@HOST."""
    why = reason.value if reason else None
    what = "this command" if kind is CardKind.COMMAND else "this process"
    if answer is Answer.DECLINED:
        return Failure(
            Code.CALL_DENIED if kind is CardKind.COMMAND else Code.SESSION_DENIED,
            f"The operator declined {what} on {target}. "
            "Nothing was sent; do not retry without asking the person.",
            request_id,
            why,
        )
    if answer is Answer.WITHDRAWN_LOCKED:
        return Failure(
            Code.VAULT_LOCKED,
            "The credential vault was locked while this request "
            "waited for approval. It was not queued or sent.",
            request_id,
            why,
        )
    if answer is Answer.UNSEEN:
        return Failure(
            Code.NO_APPROVER,
            f"No operator was watching for approvals within "
            f"{approval_timeout:g}s. Nothing was sent; ask the person "
            "to run `bastion approve` (or `bastion pending`), then retry.",
            request_id,
            why,
        )
    if answer is Answer.TIMEOUT:
        return Failure(
            Code.APPROVAL_TIMEOUT,
            f"Nobody answered the approval card within {approval_timeout:g}s. Nothing was sent.",
            request_id,
            why,
        )
    return Failure(
        Code.SESSION_DENIED,
        "The request ended before it was approved (its "
        "process exited or its connection closed). Nothing was sent.",
        request_id,
        why,
    )


def rounds_exhausted(request_id: str) -> Failure:
    """The gate kept asking after approvals: the world kept moving under the request."""
    return Failure(
        Code.APPROVAL_TIMEOUT,
        "The approval no longer matched the request after "
        "several rounds; nothing was sent. Send the request again.",
        request_id,
    )
