"""Group commit: `append(sync=False)` writes, `sync()` makes it durable in one
fdatasync, from the writer's thread or another, and head.json only ever names a
durable record. The recorder's use of it (intent synced, the rest deferred, sinks
told only of durable records) is checked against a real journal too."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from bastion.core.events import EventType
from bastion.gateway import recorder as recorder_mod
from bastion.gateway.recorder import Recorder
from bastion.journal import chain as journal
from bastion.journal import verify as journal_verify

pytestmark = pytest.mark.unit


SECRET = Ed25519PrivateKey.generate()


def new_journal(tmp_path: Path) -> tuple[journal.Journal, journal.Identity]:
    directory = tmp_path / "journal"
    ident = journal.write_identity(directory, SECRET)
    j = journal.Journal(directory, ident, "boot_commit")
    j.open()
    return j, ident


def head_json(j: journal.Journal) -> int:
    return int(json.loads((j.directory / "head.json").read_text())["seq"])


def test_unsynced_records_are_written_and_one_sync_covers_them(tmp_path: Path) -> None:
    j, ident = new_journal(tmp_path)
    booted, fsyncs = j.seq, j.fsyncs
    for i in range(5):
        j.append(EventType.REQUEST_RECEIVED, {"request_id": f"r{i}"}, {}, sync=False)
    assert [r.seq for r in journal.records(j.directory)][-5:] == list(range(2, 7))  # written
    assert j.synced_seq == booted and head_json(j) == booted  # head.json: durable only
    assert j.sync() == j.seq == 6 and j.fsyncs == fsyncs + 1
    assert head_json(j) == 6 and j.sync() == 6 and j.fsyncs == fsyncs + 1  # nothing new
    j.close()
    assert journal_verify.verify(j.directory, ident).records == 6


def test_a_sync_from_another_thread_while_the_writer_appends_and_rotates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(journal, "SEGMENT_MAX", 2048)  # rotate every few records
    j, ident = new_journal(tmp_path)
    stop = threading.Event()
    synced: list[int] = []

    def syncer() -> None:
        while not stop.is_set():
            synced.append(j.sync())

    t = threading.Thread(target=syncer)
    t.start()
    try:
        for i in range(300):
            j.append(EventType.REQUEST_RECEIVED, {"request_id": f"r{i}"}, {"x": "y" * 40}, False)
    finally:
        stop.set()
        t.join(10)
    j.vouch(SECRET)
    j.close()
    assert synced == sorted(synced)  # durability only moves forward
    assert len(journal.segments(j.directory)) > 5
    report = journal_verify.verify(j.directory, ident, strict=True)
    assert report.ok and report.records == 302, report.problem
    assert head_json(j) == 302


async def test_the_recorder_syncs_the_intent_now_and_the_rest_soon(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(recorder_mod, "FLUSH_DELAY", 0.01)
    j, _ = new_journal(tmp_path)
    rec = Recorder(j)
    told: list[int] = []
    rec.sinks.append(lambda record, event: told.append(record.seq))
    rec.record(EventType.REQUEST_RECEIVED, {"request_id": "r1"}, {})
    assert j.synced_seq == 1 and told == []  # written, not yet durable, sinks wait
    rec.intent("r1", "s1")
    assert j.synced_seq == 3 and told == [2, 3]  # the intent: durable with all before it
    rec.record(EventType.COMPLETED, {"request_id": "r1", "exit_status": 0}, {})
    assert told == [2, 3]
    for _ in range(100):
        if told == [2, 3, 4]:
            break
        await asyncio.sleep(0.01)
    assert told == [2, 3, 4] and j.synced_seq == 4 and head_json(j) == 4
    j.close()


async def test_flush_tells_the_sinks_everything_in_order(tmp_path: Path) -> None:
    j, _ = new_journal(tmp_path)
    rec = Recorder(j)
    told: list[tuple[int, Any]] = []
    rec.sinks.append(lambda record, event: told.append((record.seq, event.get("n"))))
    for n in range(3):
        rec.record(EventType.REQUEST_RECEIVED, {"request_id": f"r{n}"}, {"n": n})
    rec.flush()
    assert told == [(2, 0), (3, 1), (4, 2)] and j.synced_seq == 4
    j.close()
