"""The journal's last mile, at the file level: a write the disk refused in part is
cut off again (no fragment is ever followed by the next record), a whole record that
lacks only its newline is a record, a torn write left inside a segment by an older
version is told apart from an edit, and a journal with an identity and no record was
emptied."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from bastion import journal
from bastion.core.events import EventType
from bastion.journal import verify as journal_verify

pytestmark = pytest.mark.unit

SECRET = Ed25519PrivateKey.generate()


def opened(directory: Path) -> journal.Journal:
    j = journal.Journal(directory, journal.read_identity(directory), "boot_damage")
    j.open()
    return j


def new(tmp_path: Path) -> tuple[Path, journal.Identity]:
    directory = tmp_path / "journal"
    return directory, journal.create(directory, SECRET)


def test_a_new_journal_has_its_genesis_and_an_emptied_one_fails(tmp_path: Path) -> None:
    directory, ident = new(tmp_path)
    report = journal_verify.verify(directory, ident, strict=True)
    assert report.ok and report.records == 2, report.problem
    assert [r.type for r in journal.records(directory)] == ["boot", "vouch"]
    for seg in journal.segments(directory):
        seg.unlink()
    (directory / "head.json").unlink()
    for strict in (False, True):
        report = journal_verify.verify(directory, ident, strict=strict)
        assert not report.ok and report.problem and "emptied" in report.problem


def test_a_write_the_disk_refuses_in_part_is_cut_off_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory, ident = new(tmp_path)
    j = opened(directory)
    seg = journal.segments(directory)[-1]
    size = seg.stat().st_size
    real_write = os.write

    def short(fd: int, data: bytes) -> int:
        return real_write(fd, data[: len(data) // 3])  # ENOSPC after a third of it

    monkeypatch.setattr(os, "write", short)
    with pytest.raises(journal.JournalError, match="short write"):
        j.append(EventType.REQUEST_RECEIVED, {"request_id": "req_lost"}, {"command": "x" * 500})
    assert seg.stat().st_size == size  # nothing of it is left
    monkeypatch.setattr(os, "write", real_write)
    j.append(EventType.REQUEST_RECEIVED, {"request_id": "req_next"}, {})
    j.vouch(SECRET)
    j.close()
    report = journal_verify.verify(directory, ident, strict=True)
    assert report.ok and not report.notes, (report.problem, report.notes)
    assert [r.meta.get("request_id") for r in journal.records(directory)][-2] == "req_next"


def test_until_a_failed_write_is_cut_off_nothing_more_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory, ident = new(tmp_path)
    j = opened(directory)
    real_write, real_truncate = os.write, os.ftruncate
    monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, data[:10]))

    def broken(fd: int, length: int) -> None:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "ftruncate", broken)
    with pytest.raises(journal.JournalError, match="could not be cut off"):
        j.append(EventType.DENIED, {"request_id": "req_a"}, {})
    monkeypatch.setattr(os, "write", real_write)
    with pytest.raises(journal.JournalError, match="could not be cut off"):
        j.append(EventType.DENIED, {"request_id": "req_b"}, {})  # refused, not appended
    monkeypatch.setattr(os, "ftruncate", real_truncate)
    j.append(EventType.DENIED, {"request_id": "req_c"}, {})  # cut off first, then written
    j.vouch(SECRET)
    j.close()
    assert journal_verify.verify(directory, ident, strict=True).ok
    assert "req_b" not in {r.meta.get("request_id") for r in journal.records(directory)}


def test_a_whole_record_without_its_newline_is_kept_and_completed(tmp_path: Path) -> None:
    directory, ident = new(tmp_path)
    j = opened(directory)
    j.append(EventType.DISPATCH_STARTED, {"request_id": "req_x", "session_id": "s"}, {})
    j.close()
    seg = journal.segments(directory)[-1]
    seg.write_bytes(seg.read_bytes()[:-1])
    assert [r.type for r in journal.records(directory)][-1] == "dispatch_started"
    report = journal_verify.verify(directory, ident)
    assert report.ok and any("lacks its final newline" in n for n in report.notes)
    again = opened(directory)  # the next start adds the newline; nothing is set aside
    again.close()
    assert seg.read_bytes().endswith(b"\n") and not list(directory.glob("torn-*"))
    assert "torn_tail" not in [r.type for r in journal.records(directory)]


def test_a_torn_write_inside_a_segment_is_not_an_edit(tmp_path: Path) -> None:
    """What an older bastion left after a short write: the first bytes of a record that
    failed, and then, on the same line, the next record."""
    directory, ident = new(tmp_path)
    j = opened(directory)
    for i in range(3):
        j.append(EventType.REQUEST_RECEIVED, {"request_id": f"req_{i}"}, {})
    j.vouch(SECRET)
    j.close()
    seg = journal.segments(directory)[-1]
    lines = seg.read_bytes().split(b"\n")[:-1]
    fragment = lines[3][:57]  # a record's first bytes: '{"boot":"...","ct":"...'
    lines[3] = fragment + lines[3]
    seg.write_bytes(b"".join(x + b"\n" for x in lines))
    assert len(list(journal.records(directory))) == len(lines)  # the record is still read
    report = journal_verify.verify(directory, ident)
    assert report.ok and any("a torn write, not an edit" in n for n in report.notes)
    strict = journal_verify.verify(directory, ident, strict=True)
    assert not strict.ok and strict.problem and "torn write" in strict.problem
    lines[3] = lines[3][len(fragment) :].replace(b'"req_0"', b'"req_9"')  # an edit
    seg.write_bytes(b"".join(x + b"\n" for x in lines))
    edited = journal_verify.verify(directory, ident)
    assert not edited.ok and edited.problem and "edited" in edited.problem
