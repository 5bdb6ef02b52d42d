"""The witness's parts: the spool (order, cursors, restarts, torn tails), the
transports (a file; RFC 5424 over TCP with octet counting to a collector that
goes away and comes back), the summaries, the lines read back, and the check
`bastion audit verify --witness` runs."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from bastion import journal
from bastion.config import SyslogTarget, WitnessConfig
from bastion.core.events import EventType, activity
from bastion.journal import courier, witness
from bastion.journal import witness_reading as witness_check
from bastion.journal.courier import AUDIT, HEAD, Spool

# -- helpers ----------------------------------------------------------------------------------


def wait_until(predicate: Callable[[], object], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(courier, "BACKOFF", (0.01, 0.05))


def heads_in(path: Path) -> list[dict[str, Any]]:
    return witness_check.read_entries([path]) if path.exists() else []


class Journaled:
    """A real journal whose records go to a witness's sink, as the recorder does."""

    def __init__(self, directory: Path, sink: Callable[[Any, dict[str, Any]], None]) -> None:
        self.key = Ed25519PrivateKey.generate()
        self.identity = journal.write_identity(directory, self.key)
        self.journal = journal.Journal(directory, self.identity, "boot_unit")
        self.journal.open()
        self.sink = sink

    def add(self, kind: EventType, meta: dict[str, Any], event: dict[str, Any] | None = None):
        stamped = {"t": time.time(), **(event or {})}
        record = self.journal.append(kind, meta, stamped)
        self.sink(record, stamped)
        return record

    def request(self, rid: str, command: str = "true", exit_status: int = 0) -> None:
        self.add(
            EventType.REQUEST_RECEIVED,
            {"request_id": rid, "action": None},
            {"host": "web1", "user": "u", "command": command, "subject": {"pid": 7}},
        )
        self.add(EventType.DISPATCH_STARTED, {"request_id": rid, "session_id": "s1"})
        self.add(EventType.COMPLETED, {"request_id": rid, "exit_status": exit_status})

    def vouch(self) -> None:
        self.sink(self.journal.vouch(self.key), {})


# -- the spool -------------------------------------------------------------------------------


def test_the_spool_keeps_order_and_resumes_after_its_cursor(tmp_path: Path) -> None:
    spool = Spool(tmp_path, ["a", "b"])
    spool.open()
    for i in range(10):
        spool.append(HEAD, {"i": i}, float(i))
    got = spool.read("a", limit=4)
    assert [e.doc["i"] for e in got] == [0, 1, 2, 3]
    spool.commit("a", got[-1])
    assert spool.waiting("a") == 6 and spool.waiting("b") == 10 and spool.waiting() == 10
    spool.close()  # a restart: a new spool over the same files
    again = Spool(tmp_path, ["a", "b"])
    again.open()
    assert [e.doc["i"] for e in again.read("a")] == [4, 5, 6, 7, 8, 9]
    assert [e.doc["i"] for e in again.read("b")] == list(range(10))
    assert again.append(HEAD, {"i": 10}, 10.0) == 11  # numbering continues


def test_a_crash_leaves_uncommitted_entries_to_send_and_nothing_twice(tmp_path: Path) -> None:
    """Sent and committed: never again. Read but not committed (a crash before the
    collector confirmed): sent again. A torn last line: cut, never half-sent."""
    spool = Spool(tmp_path, ["syslog"])
    spool.open()
    for i in range(5):
        spool.append(AUDIT, {"i": i}, 0.0)
    batch = spool.read("syslog")
    spool.commit("syslog", batch[2])  # 0..2 confirmed; 3, 4 were in flight
    # no close(): the process died here, mid-way through writing another entry
    seg = next(tmp_path.glob("*.jsonl"))
    with open(seg, "ab") as f:
        f.write(b'{"doc":{"i":5},"kind":"bastion-au')
    after = Spool(tmp_path, ["syslog"])
    after.open()
    assert [e.doc["i"] for e in after.read("syslog")] == [3, 4]
    assert seg.read_bytes().endswith(b"\n")
    after.append(AUDIT, {"i": 5}, 0.0)
    assert [e.n for e in after.read("syslog")] == [4, 5, 6]


def test_segments_rotate_and_delivered_ones_are_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(courier, "SEGMENT_ENTRIES", 3)
    spool = Spool(tmp_path, ["a", "b"])
    spool.open()
    for i in range(10):
        spool.append(HEAD, {"i": i}, 0.0)
    assert len(list(tmp_path.glob("*.jsonl"))) == 4
    seen: list[int] = []
    while batch := spool.read("a", limit=2):
        seen += [e.doc["i"] for e in batch]
        spool.commit("a", batch[-1])
    assert seen == list(range(10))
    assert len(list(tmp_path.glob("*.jsonl"))) == 4  # "b" has not caught up
    while batch := spool.read("b", limit=5):
        spool.commit("b", batch[-1])
    assert len(list(tmp_path.glob("*.jsonl"))) == 1  # only the one being written
    spool.close()
    again = Spool(tmp_path, ["a", "b"])
    again.open()
    assert again.read("a") == [] and again.append(HEAD, {}, 0.0) == 11


# -- the file witness, through the sink --------------------------------------------------------


def test_heads_reach_the_file_once_across_restarts_and_outages(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere" / "witness.log"  # its mount is not there yet
    config = WitnessConfig(file=target)
    w = witness.Witness(config, tmp_path / "spool", "jid")
    j = Journaled(tmp_path / "journal", w.sink)
    w.start()
    j.request("req_1")
    j.vouch()
    wait_until(lambda: w.health()["targets"]["file"]["failing"])
    h = w.health()
    assert h["waiting"] == 3 and h["oldest_age"] is not None  # the intent's head too
    assert "No such file or directory" in h["targets"]["file"]["last_error"]
    w.close(timeout=0.5)
    target.parent.mkdir()
    w2 = witness.Witness(config, tmp_path / "spool", "jid")
    j.sink = w2.sink
    w2.start()
    j.request("req_2")
    wait_until(lambda: w2.health()["waiting"] == 0)
    w2.close()
    heads = heads_in(target)
    records = {r.seq: r for r in journal.records(tmp_path / "journal")}
    intent, done = "dispatch_started", "completed"
    assert [h["type"] for h in heads] == [intent, done, "vouch", intent, done]
    assert all(h["hash"] == records[h["seq"]].hash for h in heads)
    assert all(h["sig"] == records[h["seq"]].sig and h["journal"] == "jid" for h in heads)


def test_a_witness_directory_gets_one_file_that_verify_reads_back(tmp_path: Path) -> None:
    offbox = tmp_path / "offbox"
    offbox.mkdir()
    j = Journaled(tmp_path / "journal", lambda record, event: None)
    w = witness.Witness(
        WitnessConfig(file=offbox), tmp_path / "spool", witness.journal_id(j.identity)
    )
    j.sink = w.sink
    w.start()
    j.request("req_1")
    j.vouch()
    wait_until(lambda: w.health()["waiting"] == 0)
    w.close()
    assert [p.name for p in offbox.iterdir()] == [courier.WITNESS_FILE]
    heads = witness_check.read_entries([offbox])  # `audit verify --witness DIR`
    assert [h["type"] for h in heads] == ["dispatch_started", "completed", "vouch"]
    assert witness_check.check(tmp_path / "journal", j.identity, heads).ok


def test_every_n_records_and_every_vouch(tmp_path: Path) -> None:
    w = witness.Witness(WitnessConfig(file=tmp_path / "w.log", every=4), tmp_path / "s", "j")
    j = Journaled(tmp_path / "journal", w.sink)
    w.start()
    for i in range(3):
        j.request(f"req_{i}")  # 9 records after the boot
    j.vouch()
    wait_until(lambda: w.health()["waiting"] == 0)
    w.close()
    # Every intent (seq 3, 6, 9) is a head whatever `every` says, and counts as one.
    assert [h["seq"] for h in heads_in(tmp_path / "w.log")] == [3, 6, 9, 11]


# -- syslog over TCP, to a collector that goes away -------------------------------------------


class Collector:
    """A minimal RFC 6587 octet-counting TCP syslog receiver."""

    def __init__(self, port: int = 0) -> None:
        self.messages: list[bytes] = []
        self.listener = socket.create_server(("127.0.0.1", port), reuse_port=False)
        self.port = self.listener.getsockname()[1]
        self.conns: list[socket.socket] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.listener.accept()
                self.conns.append(conn)
                threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        buf = b""
        with contextlib.suppress(OSError):
            while chunk := conn.recv(65536):
                buf += chunk
                while b" " in buf:
                    size, _, rest = buf.partition(b" ")
                    if len(rest) < int(size):
                        break
                    self.messages.append(rest[: int(size)])
                    buf = rest[int(size) :]

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes accept(); close() alone would not
        self.listener.close()
        for c in self.conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()


@pytest.fixture
def collector() -> Iterator[Collector]:
    c = Collector()
    yield c
    c.stop()


def test_syslog_messages_are_rfc5424_with_octet_counting(tmp_path: Path, collector: Collector):
    target = SyslogTarget("tcp", f"127.0.0.1:{collector.port}")
    w = witness.Witness(WitnessConfig(syslog=target), tmp_path / "s", "jid")
    j = Journaled(tmp_path / "journal", w.sink)
    w.start()
    j.request("req_1", command="echo secret-in-command")
    wait_until(lambda: len(collector.messages) == 3)
    w.close()
    intent, head, summary = (m.decode() for m in collector.messages)
    assert '"type":"dispatch_started"' in intent and '"type":"completed"' in head
    assert (
        head.startswith("<85>1 ") and " bastion " in head and " witness - bastion-witness {" in head
    )
    assert summary.startswith("<86>1 ") and " audit - bastion-audit {" in summary
    assert "secret-in-command" not in summary
    kind, row = witness_check.parse_line(summary)  # type: ignore[misc]
    assert kind == AUDIT and row["request_id"] == "req_1" and row["command"] is None
    assert row["outcome"] == "completed" and row["exit_status"] == 0 and row["session_id"] == "s1"


def test_a_collector_that_comes_back_gets_the_backlog_once(tmp_path: Path) -> None:
    first = Collector()
    port = first.port
    target = SyslogTarget("tcp", f"127.0.0.1:{port}")
    w = witness.Witness(WitnessConfig(syslog=target), tmp_path / "s", "jid")
    j = Journaled(tmp_path / "journal", w.sink)
    w.start()
    j.request("req_0")
    wait_until(lambda: len(first.messages) == 3)
    first.stop()
    for i in range(1, 6):
        j.request(f"req_{i}")
    wait_until(lambda: w.health()["targets"]["syslog"]["failing"])
    assert w.health()["waiting"] == 15  # two heads and a summary each
    second = Collector(port)
    try:
        wait_until(lambda: w.health()["waiting"] == 0)
        w.close()
    finally:
        second.stop()
    rows = [witness_check.parse_line(m.decode()) for m in first.messages + second.messages]
    ids = [doc["request_id"] for kind, doc in rows if kind == AUDIT]  # type: ignore[misc]
    assert ids == [f"req_{i}" for i in range(6)]


# -- summaries ---------------------------------------------------------------------------------


def summaries(w: witness.Witness) -> list[dict[str, Any]]:
    out = []
    while batch := w.spool.read("syslog"):
        out += [e.doc for e in batch if e.kind == AUDIT]
        w.spool.commit("syslog", batch[-1])
    return out


def test_a_summary_is_the_activity_row(tmp_path: Path) -> None:
    target = SyslogTarget("unix", str(tmp_path / "nobody-listens"))
    for with_commands in (False, True):
        w = witness.Witness(
            WitnessConfig(syslog=target), tmp_path / f"s{with_commands}", "j", with_commands
        )
        w.spool.open()  # no couriers: the rows stay in the spool for us to read
        w._open.load()
        j = Journaled(tmp_path / f"journal{with_commands}", w.sink)
        j.request("req_a", command="uptime", exit_status=3)
        j.add(EventType.REQUEST_RECEIVED, {"request_id": "req_b"}, {"command": "x", "host": "h"})
        j.add(EventType.DENIED, {"request_id": "req_b", "code": "POLICY_DENIED"}, {"message": "no"})
        rows = activity(journal.decrypt(journal.records(j.journal.directory), j.key))
        if not with_commands:
            rows = [{**r, "command": None} for r in rows]
        assert summaries(w) == rows
        assert w.health()["open_requests"] == 0


def test_a_request_closed_by_the_next_lifetime_keeps_its_summary(tmp_path: Path) -> None:
    target = SyslogTarget("unix", str(tmp_path / "nobody-listens"))
    w = witness.Witness(WitnessConfig(syslog=target), tmp_path / "s", "j")
    w.spool.open()
    w._open.load()
    j = Journaled(tmp_path / "journal", w.sink)
    j.add(EventType.REQUEST_RECEIVED, {"request_id": "req_x"}, {"host": "h", "command": "c"})
    j.add(EventType.DISPATCH_STARTED, {"request_id": "req_x", "session_id": "s9"})
    # the gateway is killed; the next lifetime's recovery closes the request
    w.spool.close()
    w2 = witness.Witness(WitnessConfig(syslog=target), tmp_path / "s", "j")
    w2.spool.open()
    w2._open.load()
    assert w2.health()["open_requests"] == 1
    j.sink = w2.sink
    j.add(EventType.UNKNOWN, {"request_id": "req_x", "code": "STATUS_UNKNOWN", "cause": "c"})
    (row,) = summaries(w2)
    expected = activity(journal.decrypt(journal.records(j.journal.directory), j.key))[0]
    assert row == {**expected, "command": None}
    assert row["host"] == "h" and row["session_id"] == "s9" and row["outcome"] == "unknown"


# -- when the witness falls behind --------------------------------------------------------------


@pytest.mark.parametrize("when_full", ["continue", "refuse"])
def test_past_buffer_max(tmp_path: Path, when_full: str, caplog: pytest.LogCaptureFixture):
    # Two heads per request: its intent and its ending.
    config = WitnessConfig(file=tmp_path / "missing" / "w.log", buffer_max=6, when_full=when_full)
    w = witness.Witness(config, tmp_path / "s", "j")
    j = Journaled(tmp_path / "journal", w.sink)
    w.start()
    try:
        for i in range(3):
            j.request(f"req_{i}")
            assert w.refusing() is None
        j.request("req_3")
        assert w.health()["full"] is True
        j.request("req_4")
        behind = [r for r in caplog.records if "WITNESS BEHIND" in r.getMessage()]
        assert len(behind) == 1  # once per crossing
        if when_full == "refuse":
            wait_until(lambda: w.health()["targets"]["file"]["failing"])
            message = w.refusing()
            assert message and "10 entries behind" in message and "retry later" in message
            assert str(tmp_path) not in message  # the witness's path stays the operator's
            assert "No such file" in w.health()["targets"]["file"]["last_error"]
        else:
            assert w.refusing() is None
        (tmp_path / "missing").mkdir()
        wait_until(lambda: w.health()["waiting"] == 0)
        assert w.refusing() is None and w.health()["full"] is False
    finally:
        w.close()


# -- reading lines back ------------------------------------------------------------------------


def test_lines_are_found_by_their_marker() -> None:
    doc = {"journal": "j", "seq": 3, "hash": "ab"}
    body = json.dumps(doc)
    for line in (
        f"2024-06-11T10:00:00.1+00:00 vm bastion[12] bastion-witness {body}",  # RSYSLOG_FileFormat
        f"Jun 11 10:00:00 vm bastion[12]: bastion-witness {body}",  # traditional
        f"bastion-witness {body}",  # the witness file
        f"<85>1 2024-06-11T10:00:00Z vm bastion 12 witness - bastion-witness {body} trailing",
    ):
        assert witness_check.parse_line(line) == (HEAD, doc), line
    assert witness_check.parse_line("vm sshd[1]: Accepted publickey") is None
    assert witness_check.parse_line("bastion-witness {torn") is None
    assert witness_check.parse_line("bastion-witness [1, 2]") is None
    # An agent's command quoting a marker, exported with commands, is still an audit row.
    fake = 'bastion-witness {"journal": "j", "seq": 99, "hash": "00"}'
    row = json.dumps({"request_id": "r", "command": fake})
    assert witness_check.parse_line(f"vm bastion[1] bastion-audit {row}") == (
        AUDIT,
        json.loads(row),
    )


# -- the check ---------------------------------------------------------------------------------


@pytest.fixture
def chain(tmp_path: Path) -> tuple[Path, journal.Identity, list[journal.Record]]:
    key = Ed25519PrivateKey.generate()
    identity = journal.write_identity(tmp_path, key)
    j = journal.Journal(tmp_path, identity, "boot_c")
    j.open()
    for i in range(8):
        j.append(EventType.REQUEST_RECEIVED, {"request_id": f"r{i}"}, {})
    j.vouch(key)
    j.close()
    return tmp_path, identity, list(journal.records(tmp_path))


def head_of(identity: journal.Identity, r: journal.Record, **change: Any) -> dict[str, Any]:
    return {"journal": witness.journal_id(identity), "seq": r.seq, "hash": r.hash, **change}


def test_the_check_passes_when_every_witnessed_head_is_held(chain) -> None:
    directory, identity, recs = chain
    c = witness_check.check(
        directory, identity, [head_of(identity, recs[3]), head_of(identity, recs[7])]
    )
    assert c.ok and c.heads == 2 and c.last == 8
    assert c.notes == ["2 record(s) after seq 8 are not witnessed yet"]
    other = {"journal": "someone-else", "seq": 999, "hash": "00"}
    assert witness_check.check(directory, identity, [other, head_of(identity, recs[9])]).ok


def test_the_check_names_a_truncation(chain) -> None:
    directory, identity, recs = chain
    heads = [head_of(identity, recs[4]), head_of(identity, recs[9])]
    seg = journal.segments(directory)[0]
    seg.write_bytes(b"".join(r.line() for r in recs[:6]))
    (directory / "head.json").unlink()
    c = witness_check.check(directory, identity, heads)
    assert not c.ok and c.problem.startswith("truncated: the witness saw seq 10")
    assert "ends at seq 6" in c.problem


def test_the_check_names_a_fork(chain) -> None:
    directory, identity, recs = chain
    heads = [head_of(identity, recs[2]), head_of(identity, recs[5], hash="f" * 64)]
    c = witness_check.check(directory, identity, heads)
    assert not c.ok and c.problem.startswith("forked: seq 6 has hash")
    both = [head_of(identity, recs[5]), head_of(identity, recs[5], hash="f" * 64)]
    c = witness_check.check(directory, identity, both)
    assert not c.ok and "seq 6: the witness saw two hashes" in c.problem


def test_nothing_witnessed_is_not_proof(chain) -> None:
    directory, identity, _ = chain
    c = witness_check.check(directory, identity, [])
    assert not c.ok and "no witnessed head of this journal" in c.problem
    c = witness_check.check(directory, identity, [{"journal": "other", "seq": 1, "hash": "00"}])
    assert not c.ok and "1 head(s) of other journals" in c.problem
