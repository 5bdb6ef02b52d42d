"""Presence (issue 34): the one check of an assertion, the card digest it commits to,
the policy fields, and the approval book's rules for presence cards.

Each flaw `presence.check` names is made here by one wrong field of an otherwise good
assertion from a software authenticator (tests/soft_authenticator.py), and the good one
is the positive control: it holds.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from bastion.core import presence
from bastion.core.cards import Card
from bastion.core.gate import CardEnding, CardKind
from bastion.core.policy import PolicyError, Presence, entry_digest, parse_policy_text
from bastion.core.presence import Checked, Flaw, Proof, Signature, Signer
from bastion.gateway.approvals import ApprovalBook, CardError, GrantAsk
from tests.soft_authenticator import SoftAuthenticator
from tests.unit import test_binding as tb

ORIGIN = "http://localhost:7433"
RP_ID = "localhost"


def enrolled(soft: SoftAuthenticator, name: str = "alice") -> Signer:
    options = {"challenge": presence.b64url(b"c" * 32)}
    cred, count = presence.enrolled_from(
        soft.register(options, ORIGIN),
        challenge=b"c" * 32,
        rp_id=RP_ID,
        origin=ORIGIN,
        name=name,
        now=1.0,
    )
    assert count == soft.count and cred.id == soft.id and cred.fmt == "none"
    return cred


def checked(
    soft: SoftAuthenticator,
    cred: Signer | None,
    challenge: bytes,
    uv_required: bool = False,
    last: int = 0,
    edit: Callable[[dict[str, Any]], None] | None = None,
    **sign: Any,
) -> Checked | Flaw:
    doc = soft.sign(challenge, sign.pop("origin", ORIGIN), **sign)
    if edit is not None:
        edit(doc)
    return presence.check(
        Proof.from_browser(doc),
        cred,
        challenge=challenge,
        origin=ORIGIN,
        rp_id=RP_ID,
        user_verification=uv_required,
        last_count=last,
    )


CHALLENGE = presence.approval_challenge("d" * 64, b"n" * 32, None)


def test_a_good_assertion_holds_and_reports_its_counter() -> None:
    soft = SoftAuthenticator()
    got = checked(soft, enrolled(soft), CHALLENGE)
    assert got == Checked(soft.id, 1, False)


@pytest.mark.parametrize(
    ("flaw", "how"),
    [
        (Flaw.CHALLENGE, {"challenge": presence.approval_challenge("e" * 64, b"n" * 32, None)}),
        (Flaw.ORIGIN, {"origin": "http://localhost:9999"}),
        (Flaw.RP_ID, {"rp_id": "evil.example"}),
        (Flaw.PRESENCE, {"up": False}),
        (Flaw.VERIFICATION, {"uv_required": True}),
        (Flaw.COUNTER, {"count": 3, "last": 5}),
        (Flaw.COUNTER, {"count": 5, "last": 5}),
        (Flaw.MALFORMED, {"kind": "webauthn.create"}),
    ],
)
def test_each_wrong_field_is_named(flaw: Flaw, how: dict[str, Any]) -> None:
    soft = SoftAuthenticator()
    cred = enrolled(soft)
    signed_for = how.pop("challenge", CHALLENGE)
    uv_required = how.pop("uv_required", False)
    last = how.pop("last", 0)
    doc = soft.sign(signed_for, how.pop("origin", ORIGIN), **how)
    got = presence.check(
        Proof.from_browser(doc),
        cred,
        challenge=CHALLENGE,
        origin=ORIGIN,
        rp_id=RP_ID,
        user_verification=uv_required,
        last_count=last,
    )
    assert got is flaw


def test_user_verification_holds_when_the_authenticator_verified() -> None:
    soft = SoftAuthenticator()
    got = checked(soft, enrolled(soft), CHALLENGE, uv_required=True, uv=True)
    assert isinstance(got, Checked) and got.user_verified


def test_a_signature_by_another_key_or_edited_is_named_signature() -> None:
    soft, other = SoftAuthenticator(), SoftAuthenticator()
    cred = enrolled(soft)
    other.signer_id = soft.signer_id  # same id, another private key: a forgery
    assert checked(other, cred, CHALLENGE) is Flaw.SIGNATURE

    def flip(doc: dict[str, Any]) -> None:
        sig = bytearray(presence.unb64url(doc["response"]["signature"]))
        sig[-1] ^= 1
        doc["response"]["signature"] = presence.b64url(bytes(sig))

    assert checked(soft, cred, CHALLENGE, edit=flip) is Flaw.SIGNATURE


def test_a_signer_not_enrolled_is_named() -> None:
    soft = SoftAuthenticator()
    assert checked(soft, None, CHALLENGE) is Flaw.SIGNER
    assert checked(soft, enrolled(SoftAuthenticator()), CHALLENGE) is Flaw.SIGNER


def test_a_browser_answer_of_another_shape_is_refused() -> None:
    for doc in (None, {}, {"id": "x", "response": {}}, {"id": "x", "response": "no"}):
        with pytest.raises(presence.PresenceError):
            Proof.from_browser(doc)


def test_a_proof_survives_the_journal() -> None:
    soft = SoftAuthenticator()
    proof = Proof.from_browser(soft.sign(CHALLENGE, ORIGIN))
    assert Proof.from_json(proof.as_json()) == proof
    cred = enrolled(soft)
    assert Signer.from_json(cred.as_json()) == cred


# -- what the challenge commits to ---------------------------------------------------------

CARD = tb.card(tb.SESSION)


@pytest.mark.parametrize(
    "change",
    [
        {"id": "cc_2"},
        {"host": "web2"},
        {"boot_id": "boot_b"},
        {"vault_epoch": 4},
        {"argv": ("systemctl", "stop", "app")},
        {"session_id": "ses_2"},
        {"entry_digest": "0" * 64},
        {"binding": dataclasses.replace(CARD.binding, what="0" * 64)},
        {"binding": dataclasses.replace(CARD.binding, stdin="1" * 64)},
        {"binding": dataclasses.replace(CARD.binding, address="10.0.0.6")},
        {"binding": dataclasses.replace(CARD.binding, user="root")},
    ],
)
def test_the_card_digest_covers_each_field_a_yes_is_bound_to(change: dict[str, Any]) -> None:
    assert presence.card_digest(dataclasses.replace(CARD, **change)) != presence.card_digest(CARD)


def test_the_challenge_commits_to_the_grant_and_the_nonce() -> None:
    d = presence.card_digest(CARD)
    plain = presence.approval_challenge(d, b"n" * 32, None)
    grant = presence.approval_challenge(d, b"n" * 32, presence.grant_doc("echo *", 3, None))
    assert len({plain, grant, presence.approval_challenge(d, b"m" * 32, None)}) == 3
    assert presence.login_challenge(b"n" * 32) not in (plain, grant)


# -- the policy ----------------------------------------------------------------------------

POLICY = """
[hosts.web1]
address = "10.0.0.5"
host_key = "{key}"

[[hosts.web1.accounts]]
user = "ops"
credential = "ops-key"
{extra}
"""


def account(extra: str) -> Any:
    hosts = parse_policy_text(POLICY.format(key=tb.KEY, extra=extra), "p.toml")
    return hosts["web1"], hosts["web1"].account("ops")


def test_presence_is_off_unless_written_and_old_digests_stay() -> None:
    host, plain = account("")
    assert plain.presence is None
    _, signed = account('presence = "required"')
    assert signed.presence == Presence(approvers=1, user_verification=False)
    assert entry_digest(host, plain) != entry_digest(host, signed)
    _, two = account('presence = "required"\napprovers = 2\nuser_verification = "required"')
    assert two.presence == Presence(approvers=2, user_verification=True)


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ('presence = "yes"', 'field "presence" must be "required" or "off"'),
        ("approvers = 2", 'it needs presence = "required"'),
        ('user_verification = "required"', 'it needs presence = "required"'),
        ('presence = "required"\napprovers = 0', 'field "approvers" must be from 1 to 16'),
        ('presence = "required"\napprovers = true', 'field "approvers" must be a whole number'),
        ('presence = "required"\nuser_verification = "always"', "must be"),
    ],
)
def test_presence_fields_written_wrong_are_refused(extra: str, words: str) -> None:
    with pytest.raises(PolicyError, match=words):
        account(extra)


# -- the approval book ---------------------------------------------------------------------


def presence_card(approvers: int = 1, **kw: Any) -> Card:
    return dataclasses.replace(
        CARD, presence=Presence(approvers=approvers), kind=CardKind.COMMAND, **kw
    )


def run(scenario: Callable[[ApprovalBook], Any]) -> Any:
    async def go() -> Any:
        book = ApprovalBook(tb.BOOT, clock=lambda: tb.NOW, presence_where="the console")
        return await scenario(book)

    return asyncio.run(go())


def sig(name: str) -> Signature:
    return Signature("cred-" + name, name, tb.NOW)


def test_an_unsigned_yes_is_refused_and_says_where_a_no_ends_it() -> None:
    async def scenario(book: ApprovalBook) -> None:
        card = presence_card()
        fut = book.open_card(card)
        with pytest.raises(CardError, match=r"presence-signed approval .* the console"):
            book.answer(card.id, True, tb.EPOCH, False)
        assert not fut.done()  # the card stays pending
        book.answer(card.id, False, tb.EPOCH, False)
        assert fut.result() is CardEnding.DECLINED

    run(scenario)


def test_the_control_an_unsigned_yes_approves_a_card_without_presence() -> None:
    async def scenario(book: ApprovalBook) -> None:
        fut = book.open_card(CARD)
        book.answer(CARD.id, True, tb.EPOCH, False)
        assert fut.result() is CardEnding.APPROVED

    run(scenario)


def test_one_signature_approves_a_one_approver_card() -> None:
    async def scenario(book: ApprovalBook) -> None:
        card = presence_card()
        fut = book.open_card(card)
        ask = book.presence_ask(card.id, None, tb.EPOCH, False)
        assert ask.digest == presence.card_digest(card)
        assert book.take_ask(card.id, ask.nonce, tb.EPOCH, False) is ask
        assert book.sign(ask, sig("alice"), tb.EPOCH, False)
        assert fut.result() is CardEnding.APPROVED

    run(scenario)


def test_a_nonce_is_used_once_and_only_for_its_card() -> None:
    async def scenario(book: ApprovalBook) -> None:
        a, b = presence_card(), presence_card(id="cc_2")
        book.open_card(a)
        book.open_card(b)
        ask = book.presence_ask(a.id, None, tb.EPOCH, False)
        with pytest.raises(CardError, match="no outstanding challenge"):
            book.take_ask(b.id, ask.nonce, tb.EPOCH, False)  # A's challenge sent for B
        book.take_ask(a.id, ask.nonce, tb.EPOCH, False)
        with pytest.raises(CardError, match="no outstanding challenge"):
            book.take_ask(a.id, ask.nonce, tb.EPOCH, False)  # replayed

    run(scenario)


def test_two_approvers_need_two_distinct_signers() -> None:
    async def scenario(book: ApprovalBook) -> None:
        card = presence_card(approvers=2)
        fut = book.open_card(card)
        first = book.presence_ask(card.id, None, tb.EPOCH, False)
        assert not book.sign(first, sig("alice"), tb.EPOCH, False)
        assert [s.name for s in book.signed(card.id)] == ["alice"]
        again = book.presence_ask(card.id, None, tb.EPOCH, False)
        assert book.sign_refusal(again, sig("alice")) is not None
        with pytest.raises(CardError, match="already signed"):
            book.sign(again, sig("alice"), tb.EPOCH, False)
        assert not fut.done()
        assert book.sign(again, sig("bob"), tb.EPOCH, False)
        assert fut.result() is CardEnding.APPROVED

    run(scenario)


def test_any_one_deny_ends_a_multi_party_card() -> None:
    async def scenario(book: ApprovalBook) -> None:
        card = presence_card(approvers=2)
        fut = book.open_card(card)
        book.sign(book.presence_ask(card.id, None, tb.EPOCH, False), sig("a"), tb.EPOCH, False)
        book.answer(card.id, False, tb.EPOCH, False)
        assert fut.result() is CardEnding.DECLINED
        with pytest.raises(CardError, match="no pending card"):
            book.presence_ask(card.id, None, tb.EPOCH, False)

    run(scenario)


def test_every_signature_on_a_card_signs_the_same_grant() -> None:
    async def scenario(book: ApprovalBook) -> None:
        card = presence_card(approvers=2, grantable=True)
        book.open_card(card)
        grant = GrantAsk("systemctl restart *", 3, None)
        first = book.presence_ask(card.id, grant, tb.EPOCH, False)
        book.sign(first, sig("a"), tb.EPOCH, False)
        plain = book.presence_ask(card.id, None, tb.EPOCH, False)
        with pytest.raises(CardError, match="different answer"):
            book.sign(plain, sig("b"), tb.EPOCH, False)
        same = book.presence_ask(card.id, grant, tb.EPOCH, False)
        assert book.sign(same, sig("b"), tb.EPOCH, False)
        made = book.grant_of_card(card.id)
        assert made is not None and made.uses_left == 3

    run(scenario)


def test_a_lock_voids_an_outstanding_challenge() -> None:
    async def scenario(book: ApprovalBook) -> None:
        card = presence_card()
        fut = book.open_card(card)
        ask = book.presence_ask(card.id, None, tb.EPOCH, False)
        with pytest.raises(CardError, match="void"):
            book.take_ask(card.id, ask.nonce, tb.EPOCH + 1, True)
        assert fut.result() is CardEnding.WITHDRAWN_LOCKED

    run(scenario)


def test_a_card_without_presence_gives_no_challenge() -> None:
    async def scenario(book: ApprovalBook) -> None:
        book.open_card(CARD)
        with pytest.raises(CardError, match="does not ask for a presence signature"):
            book.presence_ask(CARD.id, None, tb.EPOCH, False)

    run(scenario)


# -- audit verify's fold: every presence record checked again, offline --------------------


@dataclasses.dataclass(frozen=True)
class Rec:
    seq: int
    type: str
    meta: dict[str, Any]
    boot: str = "boot_a"


class Journal:
    """The plaintext of a journal's presence records, as the gateway writes them."""

    def __init__(self) -> None:
        self.recs: list[Rec] = []

    def add(self, kind: str, **meta: Any) -> None:
        self.recs.append(Rec(len(self.recs) + 1, kind, meta))

    def signed(self, soft: SoftAuthenticator, card: str, **sign: Any) -> None:
        digest, nonce = "d" * 64, presence.b64url(bytes([len(self.recs)]) * 32)
        challenge = presence.approval_challenge(digest, presence.unb64url(nonce), None)
        proof = Proof.from_browser(soft.sign(challenge, sign.pop("origin", ORIGIN), **sign))
        self.add(
            "presence_signed",
            card=card,
            card_digest=digest,
            nonce=nonce,
            grant=None,
            signer=proof.signer_id,
            proof=proof.as_json(),
        )


def journal_with(soft: SoftAuthenticator) -> Journal:
    j = Journal()
    j.add("console_started", origin=ORIGIN, rp_id=RP_ID)
    j.add("operator_enrolled", **enrolled(soft).as_json())
    return j


def problems(j: Journal) -> list[str]:
    return [f.words for f in presence.audit(j.recs) if f.problem]


def test_a_journal_of_good_signatures_has_no_problem() -> None:
    soft = SoftAuthenticator()
    j = journal_with(soft)
    j.add("card_raised", card="cc_1", presence=1)
    j.signed(soft, "cc_1")
    j.add("card_closed", card="cc_1", answer="approved")
    assert presence.audit(j.recs) == []


def test_an_approval_without_its_signatures_is_named() -> None:
    soft = SoftAuthenticator()
    j = journal_with(soft)
    j.add("card_raised", card="cc_1", presence=2)
    j.signed(soft, "cc_1")
    j.add("card_closed", card="cc_1", answer="approved")
    assert problems(j) == [
        "card cc_1 is recorded approved with 1 valid presence signature(s) of the 2 its "
        "account asks"
    ]


def test_a_forged_signature_is_named_and_does_not_count() -> None:
    soft, forger = SoftAuthenticator(), SoftAuthenticator()
    forger.signer_id = soft.signer_id
    j = journal_with(soft)
    j.add("card_raised", card="cc_1", presence=1)
    j.signed(forger, "cc_1")
    j.add("card_closed", card="cc_1", answer="approved")
    found = problems(j)
    assert "does not hold: its signature does not verify" in found[0]
    assert "recorded approved with 0 valid" in found[1]


def test_a_signature_after_removal_or_from_another_origin_is_named() -> None:
    soft = SoftAuthenticator()
    j = journal_with(soft)
    j.signed(soft, "cc_1", origin="http://localhost:9999")
    j.add("operator_removed", id=soft.id, name="alice")
    j.signed(soft, "cc_2")
    found = problems(j)
    assert "another origin" in found[0] and "not enrolled" in found[1]


def test_a_counter_going_backwards_is_named() -> None:
    soft = SoftAuthenticator()
    j = journal_with(soft)
    j.signed(soft, "cc_1", count=10)
    j.signed(soft, "cc_2", count=4)  # a clone of the key, behind the original
    assert "sign counter did not rise" in problems(j)[0]


def test_a_signature_the_gateway_refused_is_told_not_a_problem() -> None:
    soft = SoftAuthenticator()
    j = journal_with(soft)
    j.add("presence_refused", card="cc_1", signer=soft.id, flaw="counter")
    found = presence.audit(j.recs)
    assert [f.problem for f in found] == [False]
    assert "refused by the gateway: its sign counter did not rise" in found[0].words
