"""The decision: one pure function from (request, world) to a verdict.

This is the audited core of bastion. It does no I/O and keeps no state: the
gateway takes a snapshot of the world (`World`), asks `evaluate`, acts on the
verdict, and -- after any wait for a person -- takes a *new* snapshot and asks
again. That loop is what makes "re-check after every wait" impossible to
forget: nothing decided before a wait is carried across it except the grant
a person just gave, and the gate re-validates that grant against the world
as it is now. `final_check` is the same question asked once more right
before the exec request leaves, `after_wait` the same question after a wait
for a slot or a witness ended badly, and `unanswered` says what a card that
got no "yes" means for the agent.

Every refusal is decided here, from what the edges observed: the channel and
ssh user the agent's client sent (`Request`), a shared connection, the
journal and the witness (`World`). The checks run in the contract's order
(docs/architecture.md, "The gate"); the first that fails decides:

1. the vault is locked (nothing else is looked at);
2. the request's shape (`intake`): a channel that is not one exec (a shell, a
   subsystem, a later channel on a used connection), a terminal that cannot be
   made as asked, an ssh user that is not the proxy's, a connection other
   processes could share, a command that cannot be run exactly as decided. A
   later channel passes when only its client was seen to send through it
   (paramiko), or its subject is a run and every process on the master was
   seen to be the run's (also for a master); a stdin read before a command card
   that was not seen whole (`core/stdin`);
3. the journal could not record the request, or lost a record since;
4. the witness refuses new work;
5. the policy: unavailable, host, account, command, a terminal on an account
   without `pty`, a certificate nobody can sign, an action whose last attempt
   ended unknown;
6. the subject exited; no session valid now asks a session card,
7. and a per-command account with no grant for these exact bytes a command
   card -- unless a bounded grant of this session covers the argv (`core/grants`:
   no shell source, no terminal, stdin read and empty), which dispatches once its
   use is taken; before any card is asked, the tenant's cap on waiting cards;
8. otherwise dispatch.

`intake` is steps 2-4 alone: the service asks it before it records an agent's
acknowledgement of an unknown outcome, which a request refused there never makes.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import KW_ONLY, dataclass, replace

from bastion.core.binding import Binding
from bastion.core.certs import Auth
from bastion.core.contract import NOT_SENT, Code, EndReason, Failure, Refusal
from bastion.core.defaults import (
    MAX_COMMAND_BYTES,
    MAX_FILE_CARD_BYTES,
    MAX_HELD_BYTES_PER_TENANT,
    MAX_PENDING_CARDS_PER_TENANT,
)
from bastion.core.files import (
    NO_LINKS,
    FileCheck,
    FileKind,
    FileOp,
    Resolution,
    check_file,
    json_text,
    needs_file_card,
    op_problem,
)
from bastion.core.grants import BoundedGrant
from bastion.core.opguard import Operator
from bastion.core.policy import (
    Account,
    ApprovalMode,
    CommandCheck,
    Host,
    Policy,
    PolicyError,
    check_command,
    entry_digest,
    needs_command_card,
    preapproval,
)
from bastion.core.sharing import IN_A_RUN, MUX_OUTSIDER, MUX_UNSEEN
from bastion.core.stdin import Stdin, digest_of, stdin_problem
from bastion.core.subject import SubjectKey
from bastion.core.terminal import NO_TERMINAL, Terminal, terminal_problem


class CardKind(enum.Enum):
    """What a card asks: may this process use this entry, or may it run this command."""

    SESSION = "session"
    COMMAND = "command"


class CardEnding(enum.Enum):
    """How a card's life ended, as the waiting request learns it: an answer (yes,
    no), or none (timed out, withdrawn). An operator *answers*; a card *ends*."""

    APPROVED = "approved"
    DECLINED = "declined"
    TIMEOUT = "timeout"  # an operator was watching and did not answer
    UNSEEN = "unseen"  # timed out with no operator watching at any point
    WITHDRAWN_LOCKED = "withdrawn_locked"  # vault locked: the question is void
    WITHDRAWN_GONE = "withdrawn_gone"  # process exited or connection closed


@dataclass(frozen=True)
class Session:
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
    approved_by: Operator | None = None  # the operator socket's peer that answered the card
    signed_by: tuple[str, ...] = ()  # presence accounts: the credentials that signed its card


@dataclass(frozen=True)
class CommandGrant:
    """A person allowed one exact command, once, under one session: the
    binding is the one the card showed (`core/binding`)."""

    id: str
    session_id: str
    binding: Binding
    expires_at: float
    used: bool = False
    grant_id: str | None = None  # the bounded grant whose use made it, not a card (`core/grants`)


class Channel(enum.Enum):
    """What the agent's client opened to send the request. Only `EXEC` runs: one
    command per ssh connection, from the process that opened it."""

    EXEC = "exec"
    SHELL = "shell"  # an exec channel that asked for an interactive shell
    SUBSYSTEM = "subsystem"  # sftp and the like
    SHARED = "shared"  # a later exec channel on a connection that already carried one
    SFTP = "sftp"  # one file operation on the sftp subsystem (`Request.file`)


@dataclass(frozen=True)
class Request:
    """One request, as the agent's client sent it: (channel, target, what)."""

    request_id: str
    host: str
    user: str
    command: bytes
    subject_key: SubjectKey
    action: str | None = None  # sha256 of the agent's BASTION_ACTION_KEY, if it sent one
    channel: Channel = Channel.EXEC
    ssh_user: str | None = None  # the login the ssh client sent, where one was sent
    _: KW_ONLY  # what came with the request besides its command: named, never by position
    # Its stdin, read whole before a command card (`reads_stdin`); None: not read, and
    # it streams to the target as it comes (session accounts, commands with no card).
    stdin: Stdin | None = None
    file: FileOp | None = None  # an sftp request's one file operation (`Channel.SFTP`)
    # It came on a later channel of its connection (a ControlMaster's, or its own
    # client's): an sftp channel opened after a command, as fabric and ansible do.
    later: bool = False
    terminal: Terminal | None = None  # the terminal the client asked for (pty-req), if any

    @property
    def command_sha256(self) -> str:
        """The sha256 of the exec's exact command bytes."""
        return hashlib.sha256(self.command).hexdigest()

    @property
    def what(self) -> str:
        """What this request does, as a card shows it and a grant is bound to it
        (`Binding.what`): the command's sha256, or a file operation's digest."""
        return self.file.digest if self.file is not None else self.command_sha256


@dataclass(frozen=True)
class World:
    """Everything the gate may look at, read at one moment."""

    locked: bool
    vault_epoch: int
    boot_id: str
    policy: Policy | PolicyError
    subject_alive: bool
    session: Session | None  # the grant recorded for (subject, host, user), if any
    ended: EndReason | None  # why the last grant of a matching subject ended
    command_grant: CommandGrant | None  # the grant this request's command card produced
    now: float
    action_unknown: str | None = None  # the request whose outcome blocks this action key
    # Why no per-command certificate can be signed now (no CA in the vault), or None.
    certify_problem: str | None = None
    # Other processes could send commands through the agent's ssh connection (its
    # client is a ControlMaster, or went to the background).
    shared_connection: bool = False
    subject_is_run: bool = False  # the subject is a registered run (`bastion run`)
    # Of a shared connection whose subject is a run: every process connected to its
    # ControlMaster is a process of that run (True), one is not (False), or who is
    # connected could not be seen (None); `mux_seen` says what was seen, in words.
    mux_clients_in_run: bool | None = None
    mux_seen: str = ""
    not_journaled: str | None = None  # why the request's first record could not be written
    records_lost: bool = False  # a journal record was lost since the request was received
    witness_refusing: str | None = None  # why the witness takes no new work, or None
    cards_waiting: int = 0  # cards of the subject's tenant waiting for an operator
    held_bytes: int = 0  # bytes of per-command uploads its tenant holds for their file cards
    tenant: str = ""  # that tenant, as the agent is told of it
    own_connection: bool | None = None  # later channel: only its client can send (None: unseen)
    # The bounded grants of the session found (`core/grants`; `holds` says which are live).
    grants: tuple[BoundedGrant, ...] = ()
    # Sessions the subject's process holds under another exec (another image or
    # executable): observed here, ended by `exec_endings`.
    other_exec: tuple[Session, ...] = ()


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
    session: Session
    # how the command reads (argv or shell source) and why it asks; a file card's rule
    check: CommandCheck | FileCheck


@dataclass(frozen=True)
class Dispatch:
    host: Host
    account: Account
    session: Session
    command_grant: CommandGrant | None
    # A bounded grant covers the command: the service takes one use of it, which is a
    # command grant for these exact bytes, and asks again (`ApprovalBook.use_grant`).
    bounded: BoundedGrant | None = None


Verdict = Refusal | AskSession | AskCommand | Dispatch

ONE_COMMAND = (
    "bastion runs one command per ssh connection, and this connection already carried "
    "one: this command came through an ssh ControlMaster (ControlMaster, ControlPath, "
    "ControlPersist, -M or -S), which would run it as the process that opened the "
    "connection. Nothing was sent. Run each command as its own ssh call: drop those "
    "options, or add -o ControlMaster=no -o ControlPath=none (`ssh -O exit -o "
    f"ControlPath=PATH HOST` stops a master that is still running). {IN_A_RUN}"
)
CONTROL_MASTER = (
    "This ssh connection can be shared: its ssh client is a ControlMaster, or went to the "
    "background (-f, ControlPersist), so other processes could send commands through it "
    "as this process. bastion approves processes: it runs one command per ssh connection, "
    "from the process that opened it. Run ssh without ControlMaster, ControlPath, "
    "ControlPersist or -f (the config from `bastion ssh-config` sets ControlMaster no). "
    f"Nothing was sent. {IN_A_RUN}"
)
NOT_JOURNALED = (
    "The gateway could not write this request to its journal ({why}), so it did not take "
    "it. Nothing was sent. An operator must make the journal writable again (disk full?); "
    "the gateway's log says why."
)
STORY_LOST = (
    "The gateway could not journal every record of this request (disk full?), so it did not "
    "send the command: nothing is sent that the journal cannot tell. Nothing was sent. An "
    "operator must make the journal writable again; the gateway's log says why."
)


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


def session_problem(session: Session, world: World, digest: str) -> EndReason | None:
    """Why a recorded session session does not hold in this world, if it does not."""
    if session.boot_id != world.boot_id:
        return EndReason.GATEWAY_RESTARTED
    if session.vault_epoch != world.vault_epoch:
        return EndReason.VAULT_STATE_CHANGED
    if session.entry_digest != digest:
        return EndReason.POLICY_CHANGED
    return None


def command_grant_holds(
    grant: CommandGrant,
    req: Request,
    host: Host,
    account: Account,
    session: Session,
    now: float,
) -> bool:
    """A per-command grant covers exactly one command, on one host, as one
    account, with one credential, under one session -- once, and briefly."""
    return (
        not grant.used
        and now < grant.expires_at
        and grant.session_id == session.id
        and grant.binding == request_binding(req, host, account)
    )


def request_binding(req: Request, host: Host, account: Account) -> Binding:
    """What a yes to this request is bound to, as the policy says it now: a command
    grant must hold exactly this (a card's, or a bounded grant's use)."""
    return Binding.of(
        host, account, req.what, stdin=digest_of(req.stdin), terminal=req.terminal is not None
    )


def reads_stdin(req: Request, verdict: Verdict) -> bool:
    """Whether the gateway must read the agent's stdin whole before it raises this
    verdict's card: a command card is asked and stdin was not read yet. A yes is bound
    to the exact bytes (`Binding.stdin`), and what a person approved is all the target
    gets. Session cards approve a process, not bytes, and a command that needs no card
    (a session account, a preapproved command) was decided without them: there stdin
    streams as it comes. A file operation has no stdin: a file card shows its bytes."""
    return isinstance(verdict, AskCommand) and req.file is None and req.stdin is None


@dataclass(frozen=True)
class Assessment:
    """What the policy alone says of a command: the entry, how the command reads,
    which rule decided, and whether it will need a command card. The gate acts on
    it; `bastion check-command` prints it, so the two cannot disagree."""

    deny: Refusal | None
    host: Host | None = None
    account: Account | None = None
    check: CommandCheck | FileCheck | None = None
    command_card: bool = False
    preapproved: str | None = None  # the preapproved rule that spares the command card


def assess(
    policy: Policy, host_name: str, user: str, command: bytes, file: FileOp | None = None
) -> Assessment:
    """Step 3 (host, account, command rules -- or, for a file operation, the account's
    `files` rules) and step 5's question: a card or not."""
    host = policy.host(host_name)
    if host is None:
        known = ", ".join(sorted(policy.hosts)) or "none"
        return Assessment(
            Refusal(
                Code.UNKNOWN_HOST,
                f'Host "{host_name}" is not in the gateway policy (known hosts: {known}). '
                f"{NOT_SENT}",
            )
        )
    account = host.account(user)
    if account is None:
        users = ", ".join(a.user for a in host.accounts)
        return Assessment(
            Refusal(
                Code.POLICY_DENIED,
                f'Account "{user}" is not allowed on host "{host_name}" (allowed: {users}). '
                f"{NOT_SENT}",
            ),
            host,
        )
    if file is not None:
        return assess_file(host, account, file)
    check = check_command(account, command.decode("utf-8"))
    if not check.allowed:
        deny = Refusal(
            Code.POLICY_DENIED, f"Policy denies this command: {check.reason}. {NOT_SENT}"
        )
        return Assessment(deny, host, account, check)
    return Assessment(
        None,
        host,
        account,
        check,
        needs_command_card(account, check),
        preapproval(account, check),
    )


def assess_file(host: Host, account: Account, op: FileOp) -> Assessment:
    """A file operation against the account's `files` rules; a mutation on a
    per-command account needs a file card (a command card whose request is a file)."""
    checked = check_file(account.file_rules, account.label, op)
    if not checked.allowed:
        deny = Refusal(
            Code.POLICY_DENIED, f"Policy denies this file operation: {checked.reason}. {NOT_SENT}"
        )
        return Assessment(deny, host, account, checked)
    per_command = account.approval is ApprovalMode.PER_COMMAND
    if per_command and op.kind is FileKind.WRITE:
        unheld = file_card_problem(op)
        if unheld is not None:
            return Assessment(Refusal(Code.UNSUPPORTED_REQUEST, unheld), host, account, checked)
    return Assessment(None, host, account, checked, needs_file_card(per_command, op))


def file_card_problem(op: FileOp) -> str | None:
    """Why a per-command account's write cannot be shown whole on a file card, or None:
    the card holds the exact bytes' sha256, so the file is written whole (truncated
    first) and fits the gateway's buffer."""
    if not op.whole:
        return (
            f"{op.path!r} was opened to be written in place (without truncating it, or "
            "to append); on a per-command account the operator approves a file's whole "
            f"content, so bastion writes whole files only: upload the whole file. {NOT_SENT}"
        )
    if op.size is not None and op.size > MAX_FILE_CARD_BYTES:
        return (
            f"the upload to {op.path!r} is larger than {MAX_FILE_CARD_BYTES} bytes, the most "
            "a per-command account's file card holds (the gateway buffers a write whole so "
            "the operator approves its exact sha256). Upload a smaller file, or ask the "
            f"operator for an account with session approval for this path. {NOT_SENT}"
        )
    return None


def file_resolved(account: Account, op: FileOp, found: tuple[Resolution, ...]) -> Refusal | None:
    """The gate's policy step again, once the walk on the target (`core/files.walk`)
    found where the operation's paths lead, right before it leaves; None when each
    leads somewhere exactly known, where it leads is allowed as the path is, and a
    file card showed the path the operation acts on. The operation is then sent for
    the paths found (`Resolution.path`), which have no symlink in them."""
    if op.kind is FileKind.REALPATH:
        return None  # resolving a name reads no file: the target's own answer is shown
    asked = op.paths
    for path, res in zip(asked, found, strict=True):
        if res.path is None:
            return Refusal(
                Code.POLICY_DENIED,
                f"Policy denies this file operation: bastion cannot tell exactly where "
                f"{json_text(path)} leads on the target ({res.why}), and the files rules "
                "judge the path an operation acts on. Name the file itself, the path its "
                f"symlinks lead to. {NOT_SENT}",
            )
    acting = tuple(r.path for r in found if r.path is not None)
    per_command = account.approval is ApprovalMode.PER_COMMAND
    if acting != asked and needs_file_card(per_command, op):
        moved = next((a, b) for a, b in zip(asked, acting, strict=True) if a != b)
        return Refusal(
            Code.POLICY_DENIED,
            f"Policy denies this file operation: {json_text(moved[0])} leads through a "
            f"symlink to {json_text(moved[1])}, and its file card showed "
            f"{json_text(moved[0])}; the operator approves the path an operation acts on. "
            f"Send it for {json_text(moved[1])} itself. {NOT_SENT}",
        )
    checked = check_file(account.file_rules, account.label, replace(op, resolved=acting))
    if checked.allowed:
        return None
    return Refusal(
        Code.POLICY_DENIED, f"Policy denies this file operation: {checked.reason}. {NOT_SENT}"
    )


def exec_endings(world: World) -> tuple[str, ...]:
    """The sessions an exec ends: the same process in another exec is not what
    was approved, so every grant it holds under the old one ends, for every entry, as
    `process_changed` -- unless this entry already has a grant of the new exec. The
    service carries the ending out; building the world never does."""
    if world.session is not None:
        return ()
    return tuple(grant.id for grant in world.other_exec)


def why_ended(req: Request, world: World) -> EndReason | None:
    """Why this entry has no grant, for its card: an exec that ended one of this entry's
    grants says so, else the reason the approvals of a matching subject last ended."""
    here = (req.host.lower(), req.user)
    if exec_endings(world) and any((g.host.lower(), g.user) == here for g in world.other_exec):
        return EndReason.PROCESS_CHANGED
    return world.ended


def unsupported(req: Request, world: World) -> str | None:
    """What the agent is told when its request is not one exec bastion can run exactly
    as decided, from the process that asked, or None."""
    if req.channel is Channel.SHARED or req.later:
        refused = not_shareable(world, ONE_COMMAND, later_channel=True)
        if refused is not None:
            return refused
    if req.channel is Channel.SFTP:
        if req.file is None:
            return "an sftp request without a file operation. Nothing was sent."
    elif req.channel not in (Channel.EXEC, Channel.SHARED):
        what = "a subsystem" if req.channel is Channel.SUBSYSTEM else "an interactive shell"
        return (
            f"bastion does not open {what}; it runs one command per ssh call: "
            "ssh HOST 'COMMAND'. Nothing was sent."
        )
    if req.terminal is not None and (problem := terminal_problem(req.terminal)) is not None:
        return problem
    if req.ssh_user is not None and req.ssh_user != req.user:
        return (
            f'The ssh user "{req.ssh_user}" does not match the user "{req.user}" '
            "given to the proxy; use USER@HOST. Nothing was sent."
        )
    if world.shared_connection:
        refused = not_shareable(world, CONTROL_MASTER)
        if refused is not None:
            return refused
    if req.file is not None:
        if req.file.kind is FileKind.LINK:
            return f"{NO_LINKS} {NOT_SENT}"
        bad = op_problem(req.file)
        return None if bad is None else malformed(bad).message
    problem = validate_command(req.command) or stdin_problem(req.stdin)
    if problem is not None:
        return malformed(problem).message
    return None


def not_shareable(world: World, words: str, later_channel: bool = False) -> str | None:
    """Why a connection other processes could send through may not carry this request,
    or None: a later channel of a connection only its own client sends through; else only
    a registered run's, and only while every process connected to its ControlMaster is
    one of the run's (anything unseen refuses). `words`: what a non-run is told."""
    if later_channel and world.own_connection is True and not world.shared_connection:
        return None
    if not world.subject_is_run:
        return words
    if world.mux_clients_in_run is None:
        return MUX_UNSEEN.format(seen=world.mux_seen or "nothing was observed")
    if not world.mux_clients_in_run:
        return MUX_OUTSIDER.format(seen=world.mux_seen or "a process outside the run is connected")
    return None


def malformed(problem: str) -> Refusal:
    """A command that cannot be run exactly as decided (`validate_command`)."""
    return Refusal(Code.UNSUPPORTED_REQUEST, f"Refused: {problem}. {NOT_SENT}")


def policy_unavailable() -> Refusal:
    """No policy loaded: no positive work."""
    return Refusal(
        Code.POLICY_UNAVAILABLE,
        "The gateway's policy could not be loaded, so no command can be authorised. "
        f"An operator must fix the policy files. {NOT_SENT}",
    )


def intake(req: Request, world: World) -> Refusal | None:
    """Steps 2-4, the vault aside: whether the gateway takes this request at all --
    its shape, a journal that can tell it, a witness that takes new work."""
    # 2. The request's shape: one exec, as the proxy's user, on a connection of its own.
    shape = unsupported(req, world)
    if shape is not None:
        return Refusal(Code.UNSUPPORTED_REQUEST, shape)
    # 3. Nothing is taken that the journal cannot tell.
    if world.not_journaled is not None:
        return Refusal(Code.INTERNAL, NOT_JOURNALED.format(why=world.not_journaled))
    if world.records_lost:
        return Refusal(Code.INTERNAL, STORY_LOST)
    # 4. A witness that cannot keep up (when_full = refuse) takes no new work.
    if world.witness_refusing is not None:
        return Refusal(Code.GATEWAY_BUSY, world.witness_refusing)
    return None


def crowded(world: World) -> Refusal | None:
    """A cap on waiting cards per tenant (the subject's registered run, else its uid):
    an agent cannot bury the operator, nor take another run's share; and a cap on the
    bytes of uploads it holds in the gateway for their file cards, so it cannot fill the
    gateway's memory either."""
    if world.held_bytes > MAX_HELD_BYTES_PER_TENANT:
        return Refusal(
            Code.GATEWAY_BUSY,
            f"Uploads from {world.tenant} waiting for their file cards already hold "
            f"{world.held_bytes} bytes in the gateway (the limit is "
            f"{MAX_HELD_BYTES_PER_TENANT}). Nothing was sent; finish or abandon those "
            "uploads, then send this one again.",
        )
    if world.cards_waiting < MAX_PENDING_CARDS_PER_TENANT:
        return None
    return Refusal(
        Code.GATEWAY_BUSY,
        f"{world.cards_waiting} approval cards from {world.tenant} are already waiting for "
        f"an operator (the limit is {MAX_PENDING_CARDS_PER_TENANT}). Nothing was sent; send "
        "this request again once some of those are answered.",
    )


def evaluate(req: Request, world: World) -> Verdict:
    """The checks in their contract order; the first that fails decides."""
    # 1. A locked vault ends everything at once; nothing else is evaluated.
    if world.locked:
        return Refusal(
            Code.VAULT_LOCKED,
            "The credential vault is locked. This command was not queued or sent; "
            "ask the operator to unlock, then decide again whether to send it.",
        )
    # 2-4. The request's shape, the journal, the witness.
    refused = intake(req, world)
    if refused is not None:
        return refused
    # 5. No positive work without a valid policy.
    if isinstance(world.policy, PolicyError):
        return policy_unavailable()
    # 5. Policy: host, account, command (read as argv or shell source).
    judged = assess(world.policy, req.host, req.user, req.command, req.file)
    if judged.deny is not None:
        return judged.deny
    host, account, check = judged.host, judged.account, judged.check
    assert host is not None and account is not None and check is not None
    # 5. A terminal, only on an account whose commands run with one (`pty = true`).
    if req.terminal is not None and not account.pty:
        return Refusal(Code.UNSUPPORTED_REQUEST, NO_TERMINAL.format(account=account.label))
    # 5a. A certificate account with nothing to sign its certificate: the policy asks
    # for what this gateway cannot do, so no card is raised for a login that cannot happen.
    if account.auth is Auth.CERTIFICATE and world.certify_problem is not None:
        return Refusal(
            Code.POLICY_UNAVAILABLE,
            f"The policy says {account.label} logs in with per-command certificates, but "
            f"{world.certify_problem}. {NOT_SENT}",
        )
    # 5b. The agent's logical action ended unknown last time: look before acting again.
    if world.action_unknown is not None:
        return Refusal(
            Code.ACTION_OUTCOME_UNKNOWN,
            f"The last attempt of this action ({world.action_unknown}) ended with an unknown "
            "outcome: it may or may not have run. Inspect the target; to send it anyway, "
            f"repeat with SetEnv BASTION_ACK_UNKNOWN=1. {NOT_SENT}",
        )
    # 6. A live subject, and a session valid in this lifetime, epoch and policy
    # entry; before any card, the tenant's cap on waiting cards.
    digest = entry_digest(host, account)
    if not world.subject_alive:
        return Refusal(
            Code.SESSION_DENIED,
            f"The process that asked has exited; a new process needs a new approval. {NOT_SENT}",
            EndReason.PROCESS_CHANGED,
        )
    session = world.session
    if session is None:
        return crowded(world) or AskSession(host, account, digest, why_ended(req, world))
    stale = session_problem(session, world, digest)
    if stale is not None:
        return crowded(world) or AskSession(host, account, digest, stale)
    # 7. This exact command, once: per-command accounts, and shell source where it asks --
    # or a use of a bounded grant that covers it, which asks no card.
    if judged.command_card:
        grant = world.command_grant
        if grant is not None and command_grant_holds(grant, req, host, account, session, world.now):
            return Dispatch(host, account, session, grant)
        covering = grant_covering(req, world, account, check, session, digest)
        if covering is not None:
            if req.stdin is None:  # its stdin first: a grant covers none (`reads_stdin`)
                return AskCommand(host, account, session, check)
            return Dispatch(host, account, session, None, covering)
        return crowded(world) or AskCommand(host, account, session, check)
    return Dispatch(host, account, session, None)


def grant_covering(
    req: Request,
    world: World,
    account: Account,
    check: CommandCheck | FileCheck,
    session: Session,
    digest: str,
) -> BoundedGrant | None:
    """The first live bounded grant that covers this request, or None. Only an exec's
    argv on an account with `grants = true`, bound to this very session, subject,
    entry, lifetime and epoch; never with a terminal, never with stdin bytes (a stdin
    not read yet may still turn out empty: the caller reads it first)."""
    if (
        not account.grants
        or req.file is not None
        or req.terminal is not None
        or not isinstance(check, CommandCheck)
        or check.reading.argv is None
        or (req.stdin is not None and req.stdin.size != 0)
    ):
        return None
    for grant in world.grants:
        bound = grant.holds(
            session_id=session.id,
            subject_key=req.subject_key,
            host=req.host,
            user=account.user,
            boot_id=world.boot_id,
            vault_epoch=world.vault_epoch,
            entry_digest=digest,
            now=world.now,
        )
        if bound and grant.pattern.matches(check.reading.argv):
            return grant
    return None


def final_check(req: Request, world: World, decided: Dispatch) -> Refusal | None:
    """Ask again right before the exec request leaves (connecting was a wait).

    Only the very grants that were decided may be used: the same session, and
    for a per-command account the same, still unused command grant. No card can
    be asked any more, so the cap on waiting cards does not apply.
    """
    verdict = evaluate(req, replace(world, cards_waiting=0))
    if isinstance(verdict, Dispatch) and verdict.session.id == decided.session.id:
        same = decided.command_grant is None or (
            verdict.command_grant is not None
            and verdict.command_grant.id == decided.command_grant.id
        )
        if same:
            return None
    if isinstance(verdict, Refusal):
        return Refusal(verdict.code, verdict.message)
    why = verdict.reason if isinstance(verdict, AskSession) else None
    return Refusal(
        Code.SESSION_DENIED,
        "The approval ended while the gateway was connecting "
        "to the target; nothing was sent. Send the request again to be re-decided.",
        why,
    )


def after_wait(req: Request, world: World, ended: Refusal) -> Refusal:
    """A wait after the decision ended badly (no slot freed, no witness confirmed):
    the request ends with `ended` -- unless the world as it is now refuses it on its
    own, which comes first in the contract (a vault locked meanwhile: VAULT_LOCKED)."""
    verdict = evaluate(req, replace(world, cards_waiting=0))
    return verdict if isinstance(verdict, Refusal) else ended


def no_slot(why: str) -> Refusal:
    """No slot for a decided command freed up within the wait (`admission.NoSlot`)."""
    return Refusal(
        Code.GATEWAY_BUSY,
        f"The gateway is at its limit of commands at once: {why}. Nothing was sent; "
        "retry this command in a few seconds.",
    )


def not_durable() -> Refusal:
    """The intent (`dispatch_started`) could not be written and fsynced."""
    return Refusal(
        Code.INTERNAL,
        "The gateway could not record its intent durably, so it did not send the command. "
        "Nothing was sent.",
    )


def unwitnessed(why: str) -> Refusal:
    """The witness did not confirm the intent in time, and `when_full = refuse`."""
    return Refusal(Code.GATEWAY_BUSY, why)


def gateway_failed(request_id: str) -> Failure:
    """A fault inside the gateway (a bug) while it handled a request: where it stood is
    not known, so the agent is told to look before retrying."""
    return Failure(
        Code.INTERNAL,
        "The gateway failed while handling this request; an operator "
        "can read the gateway's log. Inspect the target before retrying.",
        request_id,
    )


def unanswered(
    kind: CardKind,
    answer: CardEnding,
    target: str,
    reason: EndReason | None,
    approval_timeout: float,
) -> Refusal:
    """What a card that got no "yes" means for the agent. `target` is USER@HOST."""
    what = "this command" if kind is CardKind.COMMAND else "this process"
    if answer is CardEnding.DECLINED:
        return Refusal(
            Code.CALL_DENIED if kind is CardKind.COMMAND else Code.SESSION_DENIED,
            f"The operator declined {what} on {target}. "
            "Nothing was sent; do not retry without asking the person.",
            reason,
        )
    if answer is CardEnding.WITHDRAWN_LOCKED:
        return Refusal(
            Code.VAULT_LOCKED,
            "The credential vault was locked while this request "
            "waited for approval. It was not queued or sent.",
            reason,
        )
    if answer is CardEnding.UNSEEN:
        return Refusal(
            Code.NO_APPROVER,
            f"No operator was watching for approvals within "
            f"{approval_timeout:g}s. Nothing was sent; ask the person "
            "to run `bastion approve` (or `bastion pending`), then retry.",
            reason,
        )
    if answer is CardEnding.TIMEOUT:
        return Refusal(
            Code.APPROVAL_TIMEOUT,
            f"Nobody answered the approval card within {approval_timeout:g}s. Nothing was sent.",
            reason,
        )
    return Refusal(
        Code.SESSION_DENIED,
        "The request ended before it was approved (its "
        "process exited or its connection closed). Nothing was sent.",
        reason,
    )


def rounds_exhausted() -> Refusal:
    """The gate kept asking after approvals: the world kept moving under the request."""
    return Refusal(
        Code.APPROVAL_TIMEOUT,
        "The approval no longer matched the request after "
        "several rounds; nothing was sent. Send the request again.",
    )
