"""A certification vouches only for the boot key that wrote it (issue 10).

The laundering the reviewer did -- records appended under a boot key of the
attacker's own, then certified over by the next legitimate unlock -- must
stay visible: those records are named, `--strict` fails on them, for good.
"""

from __future__ import annotations

from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from bastion import journal, journal_verify
from bastion.core.events import EventType


def lifetime(directory: Path, ident: journal.Identity, boot: str, n: int) -> journal.Journal:
    j = journal.Journal(directory, ident, boot)
    j.open()
    for i in range(n):
        j.append(EventType.REQUEST_RECEIVED, {"request_id": f"{boot}-{i}"}, {"command": "true"})
    return j


def test_records_under_a_boot_key_never_certified_stay_uncertified(tmp_path: Path) -> None:
    directory = tmp_path / "journal"
    secret = Ed25519PrivateKey.generate()
    ident = journal.write_identity(directory, secret)
    first = lifetime(directory, ident, "boot_a", 3)
    first.certify(secret)  # an unlock
    first.close()
    forged = lifetime(directory, ident, "boot_forged", 2)  # the public identity only
    forged.close()
    later = lifetime(directory, ident, "boot_c", 1)
    later.certify(secret)  # the operator's next unlock certifies its own boot key...
    later.close()

    report = journal_verify.verify(directory, ident)
    assert report.ok  # the chain itself is whole
    assert [u["boot"] for u in report.uncertified] == ["boot_forged"]  # ...and no other's
    assert any("never certified" in note and "boot_forged" in note for note in report.notes)
    strict = journal_verify.verify(directory, ident, strict=True)
    assert not strict.ok and "boot_forged" in (strict.problem or "")
    assert strict.problem is not None and "uncertified" in strict.problem

    spans = journal_verify.uncertified_boots(journal.records(directory), ident)
    assert list(spans) == ["boot_forged"] and spans["boot_forged"][2] == 3  # boot + 2


def test_a_boot_key_cannot_be_announced_twice(tmp_path: Path) -> None:
    directory = tmp_path / "journal"
    secret = Ed25519PrivateKey.generate()
    ident = journal.write_identity(directory, secret)
    first = lifetime(directory, ident, "boot_a", 1)
    first.certify(secret)
    first.close()
    again = lifetime(directory, ident, "boot_a", 1)  # same boot id, another key
    again.close()
    report = journal_verify.verify(directory, ident)
    assert not report.ok and "announced a key twice" in (report.problem or "")
