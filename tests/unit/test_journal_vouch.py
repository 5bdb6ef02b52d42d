"""A vouch covers only the boot key that wrote it (issue 10), and is checked in one place.

The laundering the reviewer did -- records appended under a boot key of the
attacker's own, then vouched over by the next legitimate unlock -- must
stay visible: those records are named, `--strict` fails on them, for good.
`journal.vouched` is the one check of a vouch (issue 19), so `verify` and
`unvouched_boots` cannot disagree; journals older gateways wrote, whose vouches
are typed `certify`, read the same.
"""

from __future__ import annotations

import enum
from dataclasses import replace
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from bastion.core.events import EventType, event_type, recover
from bastion.journal import chain as journal
from bastion.journal import verify as journal_verify


def lifetime(directory: Path, ident: journal.Identity, boot: str, n: int) -> journal.Journal:
    j = journal.Journal(directory, ident, boot)
    j.open()
    for i in range(n):
        j.append(EventType.REQUEST_RECEIVED, {"request_id": f"{boot}-{i}"}, {"command": "true"})
    return j


def test_records_under_a_boot_key_never_vouched_for_stay_unvouched(tmp_path: Path) -> None:
    directory = tmp_path / "journal"
    secret = Ed25519PrivateKey.generate()
    ident = journal.write_identity(directory, secret)
    first = lifetime(directory, ident, "boot_a", 3)
    first.vouch(secret)  # an unlock
    first.close()
    forged = lifetime(directory, ident, "boot_forged", 2)  # the public identity only
    forged.close()
    later = lifetime(directory, ident, "boot_c", 1)
    later.vouch(secret)  # the operator's next unlock vouches for its own boot key...
    later.close()

    report = journal_verify.verify(directory, ident)
    assert report.ok  # the chain itself is whole
    assert [u["boot"] for u in report.unvouched] == ["boot_forged"]  # ...and no other's
    assert any("never vouched for" in note and "boot_forged" in note for note in report.notes)
    strict = journal_verify.verify(directory, ident, strict=True)
    assert not strict.ok and "boot_forged" in (strict.problem or "")
    assert strict.problem is not None and "unvouched" in strict.problem

    spans = journal_verify.unvouched_boots(journal.records(directory), ident)
    assert list(spans) == ["boot_forged"] and spans["boot_forged"][2] == 3  # boot + 2


def test_a_boot_key_cannot_be_announced_twice(tmp_path: Path) -> None:
    directory = tmp_path / "journal"
    secret = Ed25519PrivateKey.generate()
    ident = journal.write_identity(directory, secret)
    first = lifetime(directory, ident, "boot_a", 1)
    first.vouch(secret)
    first.close()
    again = lifetime(directory, ident, "boot_a", 1)  # same boot id, another key
    again.close()
    report = journal_verify.verify(directory, ident)
    assert not report.ok and "announced a key twice" in (report.problem or "")


class _Older(enum.Enum):
    """What an older gateway's `Journal` appended for a vouch: the same record, typed so."""

    VOUCH = "certify"


def vouch_as_older_gateways_did(j: journal.Journal, secret: Ed25519PrivateKey) -> journal.Record:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(journal, "EventType", _Older)
        return j.vouch(secret)


def test_a_vouch_is_typed_vouch_and_checked_by_one_function(tmp_path: Path) -> None:
    directory = tmp_path / "journal"
    secret, stranger = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    ident = journal.write_identity(directory, secret)
    j = lifetime(directory, ident, "boot_a", 1)
    record = j.vouch(secret)
    assert record.type == "vouch" and event_type(record) is EventType.VOUCH
    vouch = journal.vouched(record, ident)
    assert vouch is not None and vouch.boot == "boot_a" and vouch.head.hex() == record.meta["head"]
    assert journal.vouched(j.append(EventType.GATEWAY_STOPPED, {}, {}), ident) is None
    strangers = journal.Journal(
        tmp_path / "other", journal.write_identity(tmp_path / "other", stranger), "boot_a"
    )
    strangers.open()
    assert journal.vouched(strangers.vouch(stranger), ident) is None  # another identity's
    assert journal.vouched(replace_meta(record, head="00" * 32), ident) is None  # another head
    assert journal.vouched(replace_meta(record, cert=None), ident) is None  # malformed


def replace_meta(record: journal.Record, **meta: object) -> journal.Record:
    return replace(record, meta={**record.meta, **meta})


def test_verify_and_unvouched_boots_agree_on_a_vouch_the_identity_did_not_sign(
    tmp_path: Path,
) -> None:
    """A rebuilt chain: vouched by a key that is not the journal identity."""
    directory = tmp_path / "journal"
    secret, forger = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    ident = journal.write_identity(directory, secret)
    j = lifetime(directory, ident, "boot_a", 1)
    j.vouch(forger)
    j.close()
    report = journal_verify.verify(directory, ident)
    assert not report.ok and "the vouch does not verify" in (report.problem or "")
    assert list(journal_verify.unvouched_boots(journal.records(directory), ident)) == ["boot_a"]


def test_a_journal_an_older_gateway_vouched_as_certify_reads_the_same(tmp_path: Path) -> None:
    """Verify, the unlock's foreign-records check and recovery read an old `certify`
    record as a vouch, beside the `vouch` records this version writes after it."""
    directory = tmp_path / "journal"
    secret = Ed25519PrivateKey.generate()
    ident = journal.write_identity(directory, secret)
    old = lifetime(directory, ident, "boot_old", 1)
    old.append(EventType.DISPATCH_STARTED, {"request_id": "boot_old-0"}, {})  # then a crash
    assert vouch_as_older_gateways_did(old, secret).type == "certify"
    old.close()
    assert journal_verify.verify(directory, ident, strict=True).ok
    assert journal_verify.unvouched_boots(journal.records(directory), ident) == {}

    new = journal.Journal(directory, ident, "boot_new")
    found = new.open()
    assert [event_type(r) for r in found][-1] is EventType.VOUCH
    assert recover(found).unknown == ("boot_old-0",)
    new.vouch(secret)
    new.close()
    assert [r.type for r in journal.records(directory)].count("certify") == 1
    report = journal_verify.verify(directory, ident, strict=True)
    assert report.ok and report.unvouched == [], report.problem
    assert journal_verify.unvouched_boots(journal.records(directory), ident) == {}
