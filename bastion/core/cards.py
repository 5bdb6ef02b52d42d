"""Cards: the questions a person answers, as immutable records.

A card is a question about one request at one moment (one vault epoch, one
gateway lifetime). Its text is built here, from the gate's verdict, so what
the operator reads is exactly what the gate asked: the target, the key, the
process, and for command cards the exact bytes (escaped) and their digest.
Cards are never edited: a changed world means a new card.
"""

from __future__ import annotations

from dataclasses import dataclass

from bastion.core.gate import AskCommand, AskSession, CardKind, EndReason, Request
from bastion.core.subject import Peer, ProcessInfo, Subject


@dataclass(frozen=True)
class Card:
    """What the operator sees and answers."""

    id: str
    kind: CardKind
    request_id: str
    reason: EndReason | None  # why an earlier approval of a matching subject ended
    host: str
    address: str
    port: int
    user: str
    credential: str
    host_key_fingerprint: str
    command: str | None  # exact command, non-printable bytes escaped (command cards)
    command_sha256: str | None
    subject: Subject
    chain: tuple[ProcessInfo, ...]
    conversation: str | None
    boot_id: str
    vault_epoch: int
    entry_digest: str
    created_at: float
    expires_at: float
    session_id: str | None = None  # command cards: the session they extend

    def as_json(self) -> dict[str, object]:
        return {
            "id": self.id,
            "kind": self.kind.value,
            "request_id": self.request_id,
            "reason": self.reason.value if self.reason else None,
            "host": self.host,
            "address": self.address,
            "port": self.port,
            "user": self.user,
            "credential": self.credential,
            "host_key_fingerprint": self.host_key_fingerprint,
            "command": self.command,
            "command_sha256": self.command_sha256,
            "subject": self.subject.as_json(),
            "chain": [p.as_json() for p in self.chain],
            "conversation": self.conversation,
            "vault_epoch": self.vault_epoch,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
        }


def escape_command(command: bytes) -> str:
    """Show exactly what will run: printable ASCII as is, everything else
    escaped, so a person can never be shown something other than the bytes."""
    out: list[str] = []
    for ch in command.decode("utf-8", errors="surrogateescape"):
        code = ord(ch)
        if ch == "\\":
            out.append("\\\\")
        elif 0x20 <= code < 0x7F:
            out.append(ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif code < 0x100:
            out.append(f"\\x{code:02x}")
        elif 0xDC80 <= code <= 0xDCFF:  # an undecodable byte
            out.append(f"\\x{code - 0xDC00:02x}")
        elif code <= 0xFFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    return "".join(out)


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
    return Card(
        id=card_id,
        kind=CardKind.COMMAND if is_command else CardKind.SESSION,
        request_id=req.request_id,
        reason=verdict.reason if isinstance(verdict, AskSession) else None,
        host=host.alias,
        address=host.address,
        port=host.port,
        user=account.user,
        credential=account.credential,
        host_key_fingerprint=host.fingerprint,
        command=escape_command(req.command) if is_command else None,
        command_sha256=req.command_sha256 if is_command else None,
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
    )
