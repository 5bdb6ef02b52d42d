"""What the operator decides, and what ends approvals.

An answer to a card, a revoke, a lock or an unlock, a process exiting: each
of these changes who may do what, and each ends approvals that requests may
be waiting on. They act on the same approval book the request path
(`service.py`) reads, so a waiting request wakes, takes a new snapshot of the
world and asks the gate again -- nothing decided here sends anything.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from bastion.core.cards import Card, Withdrawal
from bastion.core.events import EventType
from bastion.core.gate import CardEnding, EndReason
from bastion.core.opguard import Operator
from bastion.core.presence import Flaw, Proof, Signature
from bastion.core.subject import Subject
from bastion.gateway.approvals import ApprovalBook, CardError, GrantAsk, PresenceAsk
from bastion.gateway.recorder import Recorder
from bastion.gateway.service import VaultState
from bastion.gateway.signers import Signers
from bastion.vault import VaultError, WrongPassphrase

log = logging.getLogger(__name__)

UNLOCK_BACKOFF = 0.5  # seconds after the first wrong passphrase; doubles each time
UNLOCK_MAX = 30.0


class Authority:
    """The operator's side of the approval book. The request path (`Service`) is
    the other side: both are handed the same book, recorder and vault by
    `assembly.build_service`, and neither reaches into the other. Of the requests
    in flight it sees only their ids and the means to end one (`in_flight`, `kill`).
    """

    def __init__(
        self,
        *,
        vault: VaultState,
        book: ApprovalBook,
        recorder: Recorder,
        retire_connections: Callable[[], None],
        alive: Callable[[int, float], bool],
        in_flight: Callable[[], list[str]],
        kill: Callable[[str], Awaitable[None]],
        vouch: Callable[[], None] = lambda: None,
        unlocked: Callable[[], None] = lambda: None,
        signers: Signers | None = None,
    ) -> None:
        self.vault = vault
        self.book = book
        self.recorder = recorder
        # The vault changed state: no pooled connection is reused (`Dispatcher.retire_all`).
        self.retire_connections = retire_connections
        self.alive = alive
        self.in_flight = in_flight  # the ids of the commands in flight, now
        self.kill = kill  # signal one, then stop waiting for it (`Service.kill`)
        self.vouch = vouch
        self.unlocked = unlocked  # what the lifetime does once the identity is at hand
        self.signers = signers  # who can sign presence cards (None: nobody, in tests)
        self._unlocking = asyncio.Lock()
        self._failures = 0  # wrong passphrases in a row

    def subject_exited(self, subject: Subject) -> None:
        """End its grants and withdraw its cards: a new process is a new subject."""
        ended = self.book.end_sessions(
            lambda g: g.subject_key.process == subject.process_key, EndReason.PROCESS_CHANGED
        )
        gone = self.book.withdraw(
            lambda c: c.subject.process_key == subject.process_key,
            CardEnding.WITHDRAWN_GONE,
            Withdrawal.AGENT_EXITED,
        )
        if ended or gone:
            log.info(
                "process %d exited: %d session(s) ended, %d card(s) withdrawn",
                subject.pid,
                len(ended),
                len(gone),
            )

    def answer(
        self,
        card_id: str,
        approve: bool,
        grant: GrantAsk | None = None,
        by: Operator | None = None,
    ) -> Card:
        """An operator's answer to one card (`bastion decide`, the approve prompt); a
        yes to a command card may be widened to a bounded grant (`core/grants`)."""
        card = self.book.answer(
            card_id, approve, self.vault.epoch, self.vault.locked, grant=grant, by=by
        )
        if not self.alive(card.subject.pid, card.subject.start_time):
            self.subject_exited(card.subject)
        log.info(
            "%s: card %s %s by operator%s",
            card.request_id,
            card.id,
            "approved" if approve else "declined",
            ", with a bounded grant" if grant is not None else "",  # its pattern is command text
        )
        return card

    def presence_ask(self, card_id: str, grant: GrantAsk | None) -> PresenceAsk:
        """A fresh challenge to sign one presence card (with the grant asked, if any)."""
        return self.book.presence_ask(card_id, grant, self.vault.epoch, self.vault.locked)

    def sign(self, card_id: str, nonce: str, proof: Proof) -> tuple[Card, bool]:
        """One operator's assertion for a challenge `presence_ask` made: checked against
        the enrolled key (`presence.check`), journaled with its proof before it counts,
        then counted; True once the card has all the signatures it needs and is approved.
        A flaw is journaled too (`presence_refused`) and the card stays open."""
        ask = self.book.take_ask(card_id, nonce, self.vault.epoch, self.vault.locked)
        card = ask.card
        assert card.presence is not None
        if self.signers is None:
            raise CardError("no signer is enrolled in this gateway")
        got = self.signers.verify(proof, ask.challenge, card.presence.user_verification)
        base = {"request_id": card.request_id, "card": card.id, "signer": proof.signer_id}
        if isinstance(got, Flaw):
            self.recorder.record(EventType.PRESENCE_REFUSED, base | {"flaw": got.value})
            log.warning("%s: a signature for card %s refused: %s", card.request_id, card.id, got)
            raise CardError(f"signature refused: {got.words}")
        cred = self.signers.get(got.signer_id)
        assert cred is not None
        signature = Signature(cred.id, cred.name, self.book.clock())
        why = self.book.sign_refusal(ask, signature)
        if why is not None:
            raise CardError(why)
        self.recorder.record(
            EventType.PRESENCE_SIGNED,
            base
            | {
                "name": cred.name,
                "card_digest": ask.digest,
                "nonce": ask.nonce,
                "grant": ask.grant_json(),
                "proof": proof.as_json(),
                "user_verification": card.presence.user_verification,
            },
        )
        done = self.book.sign(ask, signature, self.vault.epoch, self.vault.locked)
        log.info(
            "%s: card %s signed by %r%s",
            card.request_id,
            card.id,
            cred.name,
            ", approved" if done else "",
        )
        if done and not self.alive(card.subject.pid, card.subject.start_time):
            self.subject_exited(card.subject)
        return card, done

    def revoke(self, session: str) -> bool:
        ended = self.book.end_sessions(lambda g: g.id == session, EndReason.REVOKED)
        if ended:
            log.info("session %s revoked by operator", session)
        return bool(ended)

    async def unlock(self, passphrase: bytes) -> None:
        """One attempt at a time; each wrong passphrase in a row costs the caller
        twice the wait of the one before (0.5 s, 1 s, ... up to 30 s), on top of
        the key derivation itself, so guessing through the socket stays slow."""
        async with self._unlocking:
            try:
                await asyncio.to_thread(self.vault.unlock, passphrase)
            except WrongPassphrase:
                self._failures += 1
                await asyncio.sleep(min(UNLOCK_BACKOFF * 2 ** (self._failures - 1), UNLOCK_MAX))
                raise
            self._failures = 0
        self._vault_changed(locked=False)
        self.vouch()
        self.unlocked()

    async def prove_passphrase(self, passphrase: bytes) -> None:
        """The vault passphrase, checked as `unlock` checks it and with its backoff, so
        guessing it through enrolling or removing a signer is no faster."""
        async with self._unlocking:
            try:
                await asyncio.to_thread(self.vault.check_passphrase, passphrase)
            except WrongPassphrase:
                self._failures += 1
                await asyncio.sleep(min(UNLOCK_BACKOFF * 2 ** (self._failures - 1), UNLOCK_MAX))
                raise
            self._failures = 0

    async def lock(self, terminate: bool) -> list[str]:
        """Lock at once: every approval ends, every card is withdrawn, nothing is
        kept to run later. With `terminate`, also end every command in flight."""
        self.vouch()
        self.vault.lock()
        self._vault_changed(locked=True)
        ended: list[str] = []
        if terminate:
            ended = self.in_flight()
            self.recorder.record(EventType.OPERATOR_TERMINATE, {"requests": ended})
            await asyncio.gather(*(self.kill(rid) for rid in ended))
        return ended

    def _vault_changed(self, locked: bool) -> None:
        if self.signers is not None:
            if locked:
                self.signers.forget()
            else:
                try:
                    self.signers.load()
                except (VaultError, ValueError) as exc:
                    log.error("the enrolled signers cannot be read: %s", exc)
        ended = self.book.end_sessions(lambda g: True, EndReason.VAULT_STATE_CHANGED)
        withdrawn = self.book.withdraw(
            lambda c: True, CardEnding.WITHDRAWN_LOCKED, Withdrawal.VAULT_LOCKED
        )
        self.retire_connections()
        kind = EventType.VAULT_LOCKED if locked else EventType.VAULT_UNLOCKED
        self.recorder.record(kind, {"epoch": self.vault.epoch})
        log.info(
            "vault %s (epoch %d): %d session(s) ended, %d card(s) withdrawn",
            "locked" if locked else "unlocked",
            self.vault.epoch,
            len(ended),
            len(withdrawn),
        )
