"""Cards: the questions a person answers, as immutable records.

A card is a question about one request at one moment (one vault epoch, one
gateway lifetime). Its text is built here, from the gate's verdict, so what
the operator reads is exactly what the gate asked: the target, the key, the
process, and for command cards the exact bytes (escaped) and their digest,
with the argv every POSIX shell would run or, for shell source, every
construct that makes it so and where it stands.
Cards are never edited: a changed world means a new card.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from bastion.core.binding import Binding
from bastion.core.command import Construct, Reading
from bastion.core.display import escape_command, escape_command_marked, escape_text
from bastion.core.files import FileOp
from bastion.core.gate import AskCommand, AskSession, CardKind, EndReason, Request
from bastion.core.policy import CommandCheck, Presence
from bastion.core.stdin import Stdin, digest_of
from bastion.core.subject import Peer, ProcessInfo, Subject


class Withdrawal(enum.Enum):
    """Why a card was withdrawn (its ending `withdrawn_gone` or `withdrawn_locked`):
    what whoever shows that ending says, so that a card nobody answered is never
    announced as denied."""

    AGENT_EXITED = "agent_exited"  # the subject's process exited
    CONNECTION_CLOSED = "connection_closed"  # the agent's connection or channel closed
    VAULT_LOCKED = "vault_locked"  # the vault locked (or changed state) since it was raised

    @property
    def words(self) -> str:
        """For a person: `withdrawn: {words}`."""
        return _WITHDRAWAL_WORDS[self]


_WITHDRAWAL_WORDS = {
    Withdrawal.AGENT_EXITED: "its agent exited",
    Withdrawal.CONNECTION_CLOSED: "its connection closed",
    Withdrawal.VAULT_LOCKED: "the vault locked",
}


@dataclass(frozen=True)
class Card:
    """What the operator sees and answers."""

    id: str
    kind: CardKind
    request_id: str
    reason: EndReason | None  # why an earlier approval of a matching subject ended
    host: str
    binding: Binding  # what a "yes" is bound to; a command card's grant holds it unchanged
    command: str | None  # exact command, non-printable bytes escaped (command cards)
    argv: tuple[str, ...] | None  # command cards: the argv every POSIX shell runs, if it has one
    shell_syntax: tuple[Construct, ...]  # command cards: the constructs of shell source
    command_marks: tuple[tuple[int, int], ...]  # where in `command` each construct is shown
    subject: Subject
    chain: tuple[ProcessInfo, ...]
    conversation: str | None
    boot_id: str
    vault_epoch: int
    entry_digest: str
    created_at: float
    expires_at: float
    session_id: str | None = None  # command cards: the session they extend
    stdin: Stdin | None = None  # command cards: the stdin read before it (None: not read)
    file: FileOp | None = None  # a file card: the operation (path, size, sha256, mode)
    terminal: bool = False  # command cards: it runs with a terminal (the account's `pty`)
    # command cards: a yes may be widened to a bounded grant (`core/grants`): the account
    # has `grants = true` and the command is argv, with no file and no terminal
    grantable: bool = False
    # the account's `presence = "required"`: only enrolled authenticators' signatures
    # approve this card (`core/presence`); None: any operator's answer does
    presence: Presence | None = None

    def as_json(self, preview: bool = True) -> dict[str, object]:
        """The card for an operator's screen; `preview=False` for the journal, which
        records stdin's size and digest, never its content."""
        b = self.binding
        return {
            "id": self.id,
            "kind": self.kind.value,
            "request_id": self.request_id,
            "reason": self.reason.value if self.reason else None,
            "host": self.host,
            "address": b.address,
            "port": b.port,
            "user": b.user,
            "credential": b.credential,
            "host_key_fingerprint": b.host_key_fingerprint,
            "command": self.command,
            "command_sha256": b.what,
            "argv": list(self.argv) if self.argv is not None else None,
            "shell_syntax": [c.as_json() for c in self.shell_syntax],
            "command_marks": [list(m) for m in self.command_marks],
            "subject": self.subject.as_json(),
            "chain": [p.as_json() for p in self.chain],
            "conversation": self.conversation,
            "vault_epoch": self.vault_epoch,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "stdin": stdin_json(self.stdin, preview),
            "terminal": self.terminal,
        } | _extra_json(self)


def _extra_json(card: Card) -> dict[str, object]:
    """The keys only some cards have: a file card's operation; a grantable command card's
    `grantable` (its yes may be widened to a bounded grant, `core/grants`); a presence
    card's rule (how many approvers sign it, and whether each verifies its user)."""
    return (
        ({"file": _file_json(card.file)} if card.file is not None else {})
        | ({"grantable": True} if card.grantable else {})
        | ({"presence": card.presence.doc()} if card.presence is not None else {})
    )


def _file_json(op: FileOp) -> dict[str, object]:
    """A file card's operation, its paths escaped as every shown string is."""
    shown = op.as_json()
    for key in ("path", "to"):
        if isinstance(shown[key], str):
            shown[key] = escape_text(str(shown[key]))
    return shown


def stdin_json(stdin: Stdin | None, preview: bool) -> dict[str, object] | None:
    """A card's stdin: how its read ended, its size and sha256, and (for a screen) its
    first bytes escaped like a command."""
    if stdin is None:
        return None
    shown: dict[str, object] = {"end": stdin.end.value, "size": stdin.size, "sha256": stdin.sha256}
    if preview:
        shown["preview"] = escape_command(stdin.preview)
        shown["preview_bytes"] = len(stdin.preview)
    return shown


def make_card(
    card_id: str,
    req: Request,
    verdict: AskSession | AskCommand,
    peer: Peer,
    conversation: str | None,
    boot_id: str,
    vault_epoch: int,
    now: float,
    timeout: float,
) -> Card:
    """The card for what the gate asked: a session card names the policy entry,
    a command card also the exact bytes it would send."""
    host, account = verdict.host, verdict.account
    is_command = isinstance(verdict, AskCommand)
    file = req.file if is_command else None
    reading: Reading | None = None
    if isinstance(verdict, AskCommand) and isinstance(verdict.check, CommandCheck):
        reading = verdict.check.reading
    constructs = reading.constructs if reading is not None else ()
    shown, marks = escape_command_marked(
        req.command, [c.offset for c in constructs], [c.length for c in constructs]
    )
    is_exec = is_command and file is None
    return Card(
        id=card_id,
        kind=CardKind.COMMAND if is_command else CardKind.SESSION,
        request_id=req.request_id,
        reason=verdict.reason if isinstance(verdict, AskSession) else None,
        host=host.alias,
        binding=(
            Binding.of(
                host,
                account,
                req.what,
                stdin=digest_of(req.stdin),
                terminal=req.terminal is not None,
            )
            if is_command
            else Binding.of(host, account, None)
        ),
        command=shown if is_exec else None,
        argv=reading.argv if reading is not None else None,
        shell_syntax=constructs,
        command_marks=tuple(marks) if is_exec else (),
        subject=peer.subject,
        chain=peer.chain,
        conversation=conversation,
        boot_id=boot_id,
        vault_epoch=vault_epoch,
        entry_digest=(
            verdict.session.entry_digest
            if isinstance(verdict, AskCommand)
            else verdict.entry_digest
        ),
        created_at=now,
        expires_at=now + timeout,
        session_id=verdict.session.id if isinstance(verdict, AskCommand) else None,
        stdin=req.stdin if is_command else None,
        file=file,
        terminal=is_command and req.terminal is not None,
        grantable=(
            is_exec
            and verdict.account.grants
            and reading is not None
            and reading.argv is not None
            and req.terminal is None
        ),
        presence=verdict.account.presence,
    )
