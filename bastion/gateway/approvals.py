"""The approval book: open cards, and the grants their answers create.

Grants live in memory only: a gateway restart ends them all, by construction.
A bounded grant (`core/grants`) is kept beside the session it extends and ends
with it (lock, revoke, process change, policy change), or on its own when its
uses or minutes run out; each use is taken here (`use_grant`) as a command grant
for one exact command, spent like a card's.
Once the world a card was asked in is gone -- the process exited, the
connection closed, the vault locked -- the card is withdrawn and an answer to
it is refused. An answer never sends anything by itself: it only wakes the
waiting request, which asks the gate again.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from bastion.core.binding import Binding
from bastion.core.cards import Card, Withdrawal
from bastion.core.defaults import COMMAND_TTL
from bastion.core.errors import BastionError
from bastion.core.gate import CardEnding, CardKind, CommandGrant, EndReason, Session
from bastion.core.grants import BoundedGrant, GrantEnd, GrantError, parse_bound, parse_grant
from bastion.core.opguard import Operator
from bastion.core.presence import (
    NONCE_BYTES,
    Signature,
    approval_challenge,
    b64url,
    card_digest,
    grant_doc,
    second_signature,
    signed_enough,
    unsigned_answer,
)
from bastion.core.subject import Subject, SubjectKey

ENDED_REMEMBERED = 4096  # ended approvals kept to explain later cards (oldest forgotten)
ASKS_KEPT = 16  # a presence card's outstanding challenges (oldest forgotten past this)


class CardError(BastionError):
    """An operator answer that cannot be applied (unknown, stale, or void card)."""


@dataclass(frozen=True)
class GrantAsk:
    """What the operator asked to widen a yes to: PATTERN (the card's argv with words
    replaced by `*`), uses and/or minutes (`core/grants`)."""

    pattern: str
    uses: int | None
    minutes: int | None


@dataclass(frozen=True)
class PresenceAsk:
    """A challenge handed out for one presence card: what its signature will approve."""

    card: Card
    digest: str  # `presence.card_digest(card)`
    nonce: str  # base64url, single use
    grant: GrantAsk | None
    challenge: bytes

    def grant_json(self) -> dict[str, object] | None:
        g = self.grant
        return None if g is None else grant_doc(g.pattern, g.uses, g.minutes)


@dataclass
class _Open:
    card: Card
    future: asyncio.Future[CardEnding]
    approver_seen: bool = False
    signatures: tuple[Signature, ...] = ()  # presence cards: counted signatures, in order
    signed_grant: GrantAsk | None = None  # what the first signature asked with its yes
    asks: dict[str, PresenceAsk] = field(default_factory=dict)  # nonce -> outstanding ask


@dataclass
class _Live:
    session: Session
    subject: Subject
    conversation: str | None


def _who(subject: Subject, conversation: str | None) -> str:
    """Who 'the same agent' is for explaining a card: a registered run is itself
    (its lasting name: that run process in this kernel boot, whatever its label or
    the executable it runs). Outside runs, an agent that gave a conversation ref is
    its executable in that conversation (a replacement process continuing it hears
    why the last one's approval ended); any other is its own process (pid and start
    time, whatever it execs), never every process of the same executable: a new
    python3 is not told that another python3's approval ended."""
    if subject.run is not None:
        return "run\0" + subject.run.lasting
    if conversation:
        return "exe\0" + subject.exe
    return f"process\0{subject.pid}\0{subject.start_time!r}"


def _match_key(subject: Subject, conversation: str | None, host: str, user: str) -> str:
    """Which later subject counts as 'the same agent' for explaining a new
    card: the same `_who`, same conversation ref, same host and account. It
    explains; it never authorises. Hashed, because it outlives the gateway (see
    `live_match_keys`) and a conversation ref is the agent's text. Encoded with
    surrogateescape: a path is bytes, and may not be UTF-8."""
    who = _who(subject, conversation)
    joined = "\0".join((who, conversation or "", host.lower(), user))
    return hashlib.sha256(joined.encode("utf-8", "surrogateescape")).hexdigest()


@dataclass
class ApprovalBook:
    """The gateway's memory of who may do what right now.

    Sessions are found by the host name the agent gave, case-folded: OpenSSH
    lowercases it, and the policy refuses aliases that differ only by case,
    so the gate alone resolves the alias and checks the entry's digest.
    """

    boot_id: str
    command_ttl: float = COMMAND_TTL  # how long an approved command may wait to be sent
    # where a presence card is approved, told to an answer that cannot approve it
    presence_where: str = "run `bastion console` (the console is off: [console] in bastion.toml)"
    clock: Callable[[], float] = time.time
    # A session began (reason None) or ended (with its reason).
    on_session: Callable[[Session, Subject, EndReason | None], None] | None = None
    # A card opened (None), or closed: its ending, and why if it was withdrawn.
    on_card: Callable[[Card, CardEnding | None, Withdrawal | None], None] | None = None
    _cards: dict[str, _Open] = field(default_factory=dict)
    _sessions: dict[tuple[SubjectKey, str, str], _Live] = field(default_factory=dict)
    _ended: dict[str, EndReason] = field(default_factory=dict)
    _command_grants: dict[str, CommandGrant] = field(default_factory=dict)  # card id -> grant
    _withdrawn: dict[str, Withdrawal] = field(default_factory=dict)  # card id -> why, until read
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    # A bounded grant was made (reason None) or ended (its session's reason, or its own).
    on_grant: Callable[[BoundedGrant, EndReason | GrantEnd | None], None] | None = None
    _grants: dict[str, BoundedGrant] = field(default_factory=dict)  # grant id -> bounded grant

    # -- cards -----------------------------------------------------------------

    def open_card(self, card: Card) -> asyncio.Future[CardEnding]:
        fut: asyncio.Future[CardEnding] = asyncio.get_running_loop().create_future()
        self._cards[card.id] = _Open(card, fut)
        self._notify()
        if self.on_card is not None:
            self.on_card(card, None, None)
        return fut

    def pending(self) -> list[Card]:
        return [o.card for o in self._cards.values() if not o.future.done()]

    def note_operator(self) -> None:
        """An operator is looking: a timeout now means nobody answered, not
        that nobody could have."""
        for o in self._cards.values():
            o.approver_seen = True

    def close_card(self, card_id: str, answer: CardEnding, why: Withdrawal | None = None) -> bool:
        """End a card's life; True if it was still open (and is now answered). A
        withdrawal says `why`; the request that waited reads it (`withdrawal`)."""
        o = self._cards.pop(card_id, None)
        if o is None or o.future.done():
            return False
        if why is not None:
            self._withdrawn[card_id] = why
        o.future.set_result(answer)
        self._notify()
        if self.on_card is not None:
            self.on_card(o.card, answer, why)
        return True

    def withdrawal(self, card_id: str) -> Withdrawal | None:
        """Why the card was withdrawn (None: it was not), told once, to the request
        that raised it."""
        return self._withdrawn.pop(card_id, None)

    def expire(self, card_id: str) -> bool:
        """Nobody answered in time: say whether anybody was looking."""
        o = self._cards.get(card_id)
        seen = bool(o and o.approver_seen)
        return self.close_card(card_id, CardEnding.TIMEOUT if seen else CardEnding.UNSEEN)

    def answer(
        self,
        card_id: str,
        approve: bool,
        vault_epoch: int,
        locked: bool,
        grant: GrantAsk | None = None,
        by: Operator | None = None,
    ) -> Card:
        """Apply an operator's answer (`by`: who gave it, journaled with a session
        approval), or refuse it if the card's world is gone. With `grant`, a yes to a
        command card also makes a bounded grant (`grant_of_card`); a grant that cannot be
        made refuses the whole answer (`GrantError`), and the card stays open."""
        card = self._current(card_id, vault_epoch, locked)
        if (why := unsigned_answer(card, approve, self.presence_where)) is not None:
            raise CardError(why)
        made: BoundedGrant | None = None
        if grant is not None:
            made = self._check_grant(card, approve, grant)
        if approve:
            self._approve(card, made, by)
        else:
            self.close_card(card_id, CardEnding.DECLINED)
        return card

    def _current(self, card_id: str, vault_epoch: int, locked: bool) -> Card:
        """The open card `card_id`, or CardError: unknown, already ended, or void (the
        vault changed state, or the gateway restarted, since it was raised)."""
        o = self._cards.get(card_id)
        if o is None or o.future.done():
            raise CardError(f"no pending card {card_id} (answered, withdrawn or expired)")
        card = o.card
        if locked or card.vault_epoch != vault_epoch or card.boot_id != self.boot_id:
            self.close_card(card_id, CardEnding.WITHDRAWN_LOCKED, Withdrawal.VAULT_LOCKED)
            raise CardError(f"card {card_id} is void: the vault changed state since it was raised")
        return card

    def _approve(
        self,
        card: Card,
        made: BoundedGrant | None,
        by: Operator | None,
        signed_by: tuple[str, ...] = (),
    ) -> None:
        if card.kind is CardKind.SESSION:
            self._open_session(card, by, signed_by)
        else:
            self._grant_command(card)
        if made is not None:
            self._grants[made.id] = made
            if self.on_grant is not None:
                self.on_grant(made, None)
        self.close_card(card.id, CardEnding.APPROVED)

    # -- presence ----------------------------------------------------------------

    def presence_ask(
        self, card_id: str, grant: GrantAsk | None, vault_epoch: int, locked: bool
    ) -> PresenceAsk:
        """A fresh challenge for one signature on a presence card: it commits to the card's
        digest, the grant asked with the yes (checked now, so a grant that cannot be made
        is refused before anyone touches a key) and a nonce used once."""
        card = self._current(card_id, vault_epoch, locked)
        if card.presence is None:
            raise CardError(f"card {card_id} does not ask for a presence signature")
        if grant is not None:
            self._check_grant(card, True, grant)
        o = self._cards[card_id]
        nonce = secrets.token_bytes(NONCE_BYTES)
        digest = card_digest(card)
        doc = None if grant is None else grant_doc(grant.pattern, grant.uses, grant.minutes)
        ask = PresenceAsk(
            card, digest, b64url(nonce), grant, approval_challenge(digest, nonce, doc)
        )
        o.asks[ask.nonce] = ask
        while len(o.asks) > ASKS_KEPT:
            del o.asks[next(iter(o.asks))]
        return ask

    def take_ask(self, card_id: str, nonce: str, vault_epoch: int, locked: bool) -> PresenceAsk:
        """The outstanding ask `nonce` of an open card, taken (a nonce is used once,
        whether or not its signature then holds); CardError if there is none."""
        self._current(card_id, vault_epoch, locked)
        ask = self._cards[card_id].asks.pop(nonce, None)
        if ask is None:
            raise CardError(
                f"no outstanding challenge {nonce[:12]}... for card {card_id}: it was made "
                "for another card, or already used; ask for a new one"
            )
        return ask

    def signed(self, card_id: str) -> tuple[Signature, ...]:
        """The signatures counted on an open card so far."""
        o = self._cards.get(card_id)
        return o.signatures if o is not None else ()

    def sign_refusal(self, ask: PresenceAsk, signature: Signature) -> str | None:
        """Why this checked signature cannot count on its card (None: it can). Every
        signature on a card asks the same thing: the first one's grant (or none) is
        what the others sign for; one signer is one approver."""
        o = self._cards.get(ask.card.id)
        if o is None or o.future.done():
            return f"no pending card {ask.card.id} (answered, withdrawn or expired)"
        if (why := second_signature(o.signatures, signature.signer_id)) is not None:
            return why
        if o.signatures and o.signed_grant != ask.grant:
            return (
                "another approver signed this card for a different answer (a bounded grant "
                "or none): sign the same one, or deny the card"
            )
        return None

    def sign(self, ask: PresenceAsk, signature: Signature, vault_epoch: int, locked: bool) -> bool:
        """Count one checked signature (`presence.check` held for `ask`'s challenge, and
        `sign_refusal` said none); True if it completes the card's approval."""
        card = self._current(ask.card.id, vault_epoch, locked)
        o = self._cards[card.id]
        rule = card.presence
        assert rule is not None and card is ask.card
        if (why := self.sign_refusal(ask, signature)) is not None:
            raise CardError(why)
        made = self._check_grant(card, True, ask.grant) if ask.grant is not None else None
        o.signatures = (*o.signatures, signature)
        o.signed_grant = ask.grant
        if not signed_enough(rule, o.signatures):
            self._notify()
            return False
        self._approve(card, made, None, tuple(s.name for s in o.signatures))
        return True

    def withdraw(
        self, pred: Callable[[Card], bool], answer: CardEnding, why: Withdrawal
    ) -> list[Card]:
        gone = [o.card for o in self._cards.values() if not o.future.done() and pred(o.card)]
        for card in gone:
            self.close_card(card.id, answer, why)
        return gone

    async def wait_changed(self, timeout: float) -> None:
        """Wake when a card opens or closes (or after `timeout`)."""
        event = self._changed
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # -- sessions ----------------------------------------------------------

    def _open_session(
        self, card: Card, by: Operator | None = None, signed_by: tuple[str, ...] = ()
    ) -> Session:
        user = card.binding.user
        session = Session(
            id="ses_" + secrets.token_hex(6),
            subject_key=card.subject.key,
            host=card.host,
            user=user,
            boot_id=card.boot_id,
            vault_epoch=card.vault_epoch,
            entry_digest=card.entry_digest,
            approved_at=self.clock(),
            approved_by=by,
            signed_by=signed_by,
        )
        self._sessions[(card.subject.key, card.host.lower(), user)] = _Live(
            session, card.subject, card.conversation
        )
        self._ended.pop(_match_key(card.subject, card.conversation, card.host, user), None)
        if self.on_session is not None:
            self.on_session(session, card.subject, None)
        return session

    def session_for(
        self, subject: Subject, host: str, user: str, conversation: str | None
    ) -> tuple[Session | None, EndReason | None]:
        """The live grant for this subject and entry, else why a matching one ended.
        Only reads: what an exec ends is the gate's to say (`gate.exec_endings`)."""
        live = self._sessions.get((subject.key, host.lower(), user))
        if live is not None:
            return live.session, None
        return None, self._ended.get(_match_key(subject, conversation, host, user))

    def other_exec(self, subject: Subject) -> tuple[Session, ...]:
        """The grants `subject`'s process holds under another exec than its own."""
        return tuple(
            old.session
            for old in self._sessions.values()
            if old.session.subject_key.process == subject.process_key
            and old.session.subject_key != subject.key
        )

    def end_for_exec(self, subject: Subject, ids: tuple[str, ...]) -> None:
        """End the grants `ids` that `subject`'s process held under its old exec, as
        `process_changed`; its next card for each of their entries says why."""
        stale = [live for live in self._sessions.values() if live.session.id in ids]
        self.end_sessions(lambda g: g.id in ids, EndReason.PROCESS_CHANGED)
        for old in stale:
            key = _match_key(subject, old.conversation, old.session.host, old.session.user)
            self._remember(key, EndReason.PROCESS_CHANGED)

    def sessions(self) -> list[tuple[Session, Subject]]:
        return [(live.session, live.subject) for live in self._sessions.values()]

    def end_sessions(self, pred: Callable[[Session], bool], reason: EndReason) -> list[str]:
        """End every grant matching `pred`, remembering why for the next card."""
        ended: list[str] = []
        for key, live in list(self._sessions.items()):
            if pred(live.session):
                del self._sessions[key]
                g = live.session
                self._remember(_match_key(live.subject, live.conversation, g.host, g.user), reason)
                ended.append(g.id)
                self._command_grants = {
                    c: cg for c, cg in self._command_grants.items() if cg.session_id != g.id
                }
                self._end_grants(lambda b, sid=g.id: b.session_id == sid, reason)
                if self.on_session is not None:
                    self.on_session(g, live.subject, reason)
        return ended

    def live_match_keys(self) -> list[str]:
        """What a later gateway lifetime needs to say `gateway_restarted`."""
        return sorted(
            {
                _match_key(live.subject, live.conversation, live.session.host, live.session.user)
                for live in self._sessions.values()
            }
        )

    def previous_lifetime(self, match_keys: Iterable[str]) -> None:
        """Approvals alive when the last lifetime ended explain the next cards."""
        for key in match_keys:
            if key not in self._ended:
                self._remember(key, EndReason.GATEWAY_RESTARTED)

    def _remember(self, key: str, reason: EndReason) -> None:
        """Why the approvals of `key` ended, latest last; the oldest is forgotten past
        ENDED_REMEMBERED (most belong to processes that exited and never ask again)."""
        self._ended.pop(key, None)
        self._ended[key] = reason
        while len(self._ended) > ENDED_REMEMBERED:
            del self._ended[next(iter(self._ended))]

    def subjects(self) -> Iterable[Subject]:
        return [live.subject for live in self._sessions.values()]

    # -- command grants ----------------------------------------------------------

    def _grant_command(self, card: Card) -> CommandGrant:
        assert card.session_id is not None and card.binding.what is not None
        now = self.clock()
        # Expired grants of requests that never came back for them; a used one stays
        # until its request ends (`discard_command_grant`), so the gate sees it used.
        self._command_grants = {c: g for c, g in self._command_grants.items() if g.expires_at > now}
        grant = CommandGrant(
            id="cmd_" + secrets.token_hex(6),
            session_id=card.session_id,
            binding=card.binding,
            expires_at=now + self.command_ttl,
        )
        self._command_grants[card.id] = grant
        return grant

    def command_grant(self, key: str | None) -> CommandGrant | None:
        """The command grant held under `key` (a command card's id, or a bounded
        grant's use: `use_grant`), as it stands now (used or not)."""
        return self._command_grants.get(key) if key else None

    def consume(self, key: str) -> CommandGrant:
        """Mark a command grant used -- in the final check, before the exec request
        leaves, so the gate itself refuses it to anything that asks again."""
        used = replace(self._command_grants[key], used=True)
        self._command_grants[key] = used
        return used

    def discard_command_grant(self, key: str | None) -> None:
        """The request that asked for it is over: used or not, it is gone."""
        if key:
            self._command_grants.pop(key, None)

    # -- bounded grants ----------------------------------------------------------

    def _check_grant(self, card: Card, approve: bool, ask: GrantAsk) -> BoundedGrant:
        """The grant a yes to this card would make, or why none can be (`GrantError`):
        only with a yes, only on a command card of an account with `grants = true`
        whose command is argv (no shell source, no file, no terminal)."""
        if not approve:
            raise GrantError("a grant widens a yes: it cannot come with a no")
        if card.kind is not CardKind.COMMAND or card.file is not None:
            raise GrantError("a grant widens a command card's yes; this card is not one")
        if not card.grantable:
            raise GrantError(
                "this card cannot be widened: its account does not allow grants "
                "(grants = true in the policy), or its command runs with a terminal"
            )
        pattern = parse_grant(card.argv, ask.pattern)
        bound = parse_bound(ask.uses, ask.minutes)
        assert card.session_id is not None
        now = self.clock()
        return BoundedGrant(
            id="grt_" + secrets.token_hex(6),
            card_id=card.id,
            session_id=card.session_id,
            subject_key=card.subject.key,
            host=card.host,
            user=card.binding.user,
            boot_id=card.boot_id,
            vault_epoch=card.vault_epoch,
            entry_digest=card.entry_digest,
            pattern=pattern,
            uses_left=bound.uses,
            expires_at=None if bound.minutes is None else now + 60.0 * bound.minutes,
            made_at=now,
        )

    def grant_of_card(self, card_id: str) -> BoundedGrant | None:
        """The live bounded grant a yes to this card made, if any."""
        return next((g for g in self._grants.values() if g.card_id == card_id), None)

    def grants_for(self, session_id: str) -> tuple[BoundedGrant, ...]:
        """The bounded grants of one session, oldest first. Only reads: one used up or
        expired is listed until `end_spent_grants` ends it (the gate holds to `live`)."""
        return tuple(g for g in self._grants.values() if g.session_id == session_id)

    def grants(self) -> list[BoundedGrant]:
        """Every live bounded grant (`bastion sessions`)."""
        self.end_spent_grants()
        return list(self._grants.values())

    def use_grant(self, grant_id: str, request_id: str, binding: Binding) -> str | None:
        """Take one use of a bounded grant for one request, with no await between the
        gate's verdict and this: a command grant for these exact bytes, under the same
        session, spent like a card's before the exec leaves. Returns its key (for
        `command_grant`), or None if the grant is no longer live."""
        grant = self._grants.get(grant_id)
        now = self.clock()
        if grant is None or not grant.live(now):
            return None
        left = None if grant.uses_left is None else grant.uses_left - 1
        self._grants[grant_id] = replace(grant, uses_left=left)
        # as `_grant_command`: uses whose requests never came back for them expire
        self._command_grants = {c: g for c, g in self._command_grants.items() if g.expires_at > now}
        key = f"{grant_id}:{request_id}"
        self._command_grants[key] = CommandGrant(
            id="cmd_" + secrets.token_hex(6),
            session_id=grant.session_id,
            binding=binding,
            expires_at=now + self.command_ttl,
            grant_id=grant_id,
        )
        self.end_spent_grants()
        return key

    def end_spent_grants(self) -> None:
        """End, and journal, every bounded grant core says is spent (`BoundedGrant.end_reason`:
        used up or expired)."""
        now = self.clock()
        for grant in list(self._grants.values()):
            why = grant.end_reason(now)
            if why is not None:
                self._end_grants(lambda g, gid=grant.id: g.id == gid, why)

    def _end_grants(
        self, pred: Callable[[BoundedGrant], bool], reason: EndReason | GrantEnd
    ) -> None:
        for grant in [g for g in self._grants.values() if pred(g)]:
            del self._grants[grant.id]
            if self.on_grant is not None:
                self.on_grant(grant, reason)
