"""What a "yes" is bound to: one Binding, shown by the card, held unchanged by the
command grant, and compared whole by the gate (core/binding)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib

import pytest

from bastion.core.binding import Binding
from bastion.core.cards import Card, make_card
from bastion.core.gate import (
    AskCommand,
    AskSession,
    CardKind,
    CommandGrant,
    Request,
    Session,
    World,
    command_grant_holds,
    evaluate,
)
from bastion.core.policy import Policy, entry_digest, host_key_fingerprint, parse_policy_text
from bastion.core.subject import Peer, ProcessInfo, Subject
from bastion.gateway.approvals import ApprovalBook

KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKwqVd3vMikqXGyJKL6mRiDHH8Ym3yLu2zkTPeUe2xx0"
HOSTS = parse_policy_text(
    f"""
[hosts.web1]
address = "10.0.0.5"
port = 2200
host_key = "{KEY}"

[[hosts.web1.accounts]]
user = "ops"
credential = "ops-key"
approval = "per-command"
""",
    "test.toml",
)
HOST = HOSTS["web1"]
ACCOUNT = HOST.account("ops")
assert ACCOUNT is not None
BOOT, EPOCH, NOW = "boot_a", 3, 1000.0
INFO = ProcessInfo(42, 41, 7.5, 1000, "/usr/bin/node", "ab" * 32, "node", ("node",))
SUBJECT = Subject(42, 7.5, "/usr/bin/node", "ab" * 32, 1000, "n1", image="img1")
PEER = Peer(43, 1000, 1000, (INFO,), SUBJECT)
COMMAND = b"systemctl restart app"
DIGEST = hashlib.sha256(COMMAND).hexdigest()
SESSION = Session(
    "ses_1", SUBJECT.key, "web1", "ops", BOOT, EPOCH, entry_digest(HOST, ACCOUNT), 0.0
)

# Card.as_json's keys, in order, as the journal's card_raised records and the
# operator's prompt have always read them.
CARD_KEYS = [
    "id",
    "kind",
    "request_id",
    "reason",
    "host",
    "address",
    "port",
    "user",
    "credential",
    "host_key_fingerprint",
    "command",
    "command_sha256",
    "argv",
    "shell_syntax",
    "command_marks",
    "subject",
    "chain",
    "conversation",
    "vault_epoch",
    "created_at",
    "expires_at",
    "stdin",
    "terminal",
]


def request() -> Request:
    return Request("req_1", "web1", "ops", COMMAND, SUBJECT.key)


def world(session: Session | None) -> World:
    return World(
        locked=False,
        vault_epoch=EPOCH,
        boot_id=BOOT,
        policy=Policy(hosts=HOSTS, digest="d", files=("test.toml",)),
        subject_alive=True,
        session=session,
        ended=None,
        command_grant=None,
        now=NOW,
    )


def card(session: Session | None) -> Card:
    verdict = evaluate(request(), world(session))
    assert isinstance(verdict, AskSession | AskCommand)
    return make_card("cc_1", request(), verdict, PEER, None, BOOT, EPOCH, NOW, 60.0)


def test_the_binding_is_the_policy_entry_and_what_the_request_does() -> None:
    assert Binding.of(HOST, ACCOUNT, DIGEST) == Binding(
        "10.0.0.5", 2200, host_key_fingerprint(KEY), "ops", "ops-key", DIGEST
    )


def test_a_command_card_shows_its_binding_under_the_keys_it_always_had() -> None:
    doc = card(SESSION).as_json()
    assert list(doc) == CARD_KEYS
    assert doc["kind"] == "command"
    assert {k: doc[k] for k in CARD_KEYS[5:10]} == {
        "address": "10.0.0.5",
        "port": 2200,
        "user": "ops",
        "credential": "ops-key",
        "host_key_fingerprint": host_key_fingerprint(KEY),
    }
    assert doc["command_sha256"] == DIGEST


def test_a_session_card_is_bound_to_the_entry_and_no_command() -> None:
    c = card(None)
    assert c.kind is CardKind.SESSION
    assert c.binding == Binding.of(HOST, ACCOUNT, None)
    doc = c.as_json()
    assert list(doc) == CARD_KEYS
    assert doc["command"] is None and doc["command_sha256"] is None


def test_the_grant_holds_the_binding_the_card_showed() -> None:
    async def approve() -> CommandGrant | None:
        book = ApprovalBook(boot_id=BOOT, clock=lambda: NOW)
        c = card(SESSION)
        book.open_card(c)
        book.answer(c.id, True, EPOCH, False)
        return book.command_grant(c.id)

    grant = asyncio.run(approve())
    assert grant is not None and grant.binding == card(SESSION).binding
    assert command_grant_holds(grant, request(), HOST, ACCOUNT, SESSION, NOW)


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(Binding)])
def test_a_grant_whose_binding_differs_in_any_field_does_not_hold(field: str) -> None:
    bound = Binding.of(HOST, ACCOUNT, DIGEST)
    other = {str: "other", int: 2201, bool: True, type(None): "other"}[type(getattr(bound, field))]
    grant = CommandGrant("cmd_1", "ses_1", dataclasses.replace(bound, **{field: other}), NOW + 60)
    assert not command_grant_holds(grant, request(), HOST, ACCOUNT, SESSION, NOW)
    assert command_grant_holds(
        dataclasses.replace(grant, binding=bound), request(), HOST, ACCOUNT, SESSION, NOW
    )
