"""`bastion audit export`: the lines' shapes, resuming by seq, and no duplicate
or gap across a reconnection -- on a real journal in a temporary directory,
with the gateway's stream driven by a fake gateway (a real recorder)."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from bastion import journal
from bastion.cli import export as cli
from bastion.core.events import EventType
from bastion.gateway import export as gwexport
from bastion.gateway.recorder import Recorder
from bastion.vault import VaultLocked

SECRET_COMMAND = "deploy --token=hunter2-in-the-command"
E = EventType

# -- a journal with requests, cards and two lifetimes ------------------------------------------


class World:
    """A journal directory, its identity, and the lifetime writing to it now."""

    def __init__(self, root: Path) -> None:
        self.dir = root / "journal"
        self.secret = Ed25519PrivateKey.generate()
        self.ident = journal.write_identity(self.dir, self.secret)
        self.boots = 0
        self.j = self.new_lifetime()

    def new_lifetime(self) -> journal.Journal:
        self.boots += 1
        j = journal.Journal(self.dir, self.ident, f"boot_{self.boots}")
        j.open()
        self.j = j
        return j

    def request(self, rid: str, exit_status: int = 0, recorder: Recorder | None = None) -> None:
        append = recorder.record if recorder else self.j.append
        card = {
            "id": f"card_{rid}",
            "command": SECRET_COMMAND,
            "argv": SECRET_COMMAND.split(),
            "chain": [{"pid": 7, "cmdline": ["ssh", "web1", SECRET_COMMAND]}],  # the asker's
        }
        append(
            E.REQUEST_RECEIVED,
            {"request_id": rid, "action": None},
            {"host": "web1", "user": "app", "command": SECRET_COMMAND, "command_sha256": "ab"},
        )
        append(
            E.CARD_RAISED,
            {"request_id": rid, "card": card["id"], "kind": "command"},
            {"card": card},
        )
        append(E.DISPATCH_STARTED, {"request_id": rid, "session_id": "sess_1"}, {})
        append(E.COMPLETED, {"request_id": rid, "exit_status": exit_status}, {"message": ""})

    def seqs(self) -> list[int]:
        return [r.seq for r in journal.records(self.dir)]


@pytest.fixture
def world(tmp_path: Path) -> World:
    w = World(tmp_path)
    w.request("req_1")
    w.j.vouch(w.secret)
    return w


class Lines:
    def __init__(self, fmt: str = "jsonl", since: int = 0) -> None:
        self.lines: list[str] = []
        self.said: list[str] = []
        self.out = cli.Output(since, cli.formatter(fmt), self.lines.append, self.said.append)

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.lines]

    def seqs(self) -> list[int]:
        return [e["seq"] for e in self.events()]


def offline(w: World, since: int = 0, with_commands: bool = False, fmt: str = "jsonl") -> Lines:
    got = Lines(fmt, since)
    cli.from_files(cli.file_records(w.dir, False), w.secret, got.out, with_commands)
    return got


# -- shapes -------------------------------------------------------------------------------------


def test_every_line_is_one_json_event_and_command_text_only_when_asked(world: World) -> None:
    plain = offline(world)
    assert all("\n" not in line[:-1] and line.endswith("\n") for line in plain.lines)
    events = plain.events()
    assert [e["seq"] for e in events] == world.seqs()
    assert [e["type"] for e in events][:2] == ["boot", "request_received"]
    received = next(e for e in events if e["type"] == "request_received")
    assert (received["request_id"], received["host"], received["command_sha256"]) == (
        "req_1",
        "web1",
        "ab",
    )
    assert received["command"] is None and isinstance(received["time"], float)
    card = next(e for e in events if e["type"] == "card_raised")["card"]
    assert card["command"] is None and card["argv"] is None
    done = next(e for e in events if e["type"] == "completed")
    assert (done["request_id"], done["exit_status"]) == ("req_1", 0)
    assert "hunter2" not in "".join(plain.lines)

    full = offline(world, with_commands=True).events()
    assert next(e for e in full if e["type"] == "request_received")["command"] == SECRET_COMMAND
    card = next(e for e in full if e["type"] == "card_raised")["card"]
    assert card["command"] == SECRET_COMMAND and card["argv"] == SECRET_COMMAND.split()
    assert card["chain"][0]["cmdline"] == ["ssh", "web1", SECRET_COMMAND]


RFC5424 = re.compile(
    r"<(?P<pri>\d{1,3})>1 (?P<ts>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z|-) (?P<host>[!-~]{1,255}) "
    r"bastion (?P<procid>[!-~]{1,128}) (?P<msgid>[!-~]{1,32}) - (?P<msg>\{.*\})\n"
)


def test_rfc5424_lines(world: World) -> None:
    world.j.append(E.DENIED, {"request_id": "req_2", "code": "POLICY_DENIED"}, {"message": "no"})
    jsonl = offline(world).lines
    lines = offline(world, fmt="rfc5424").lines
    assert len(lines) == len(jsonl)
    for line, plain in zip(lines, jsonl, strict=True):
        m = RFC5424.fullmatch(line)
        assert m, line
        event = json.loads(m["msg"])
        assert m["msg"] + "\n" == plain  # MSG is the jsonl line itself
        assert (m["procid"], m["msgid"]) == (event["boot"], event["type"])
        assert int(m["pri"]) == 10 * 8 + (4 if event["type"] == "denied" else 5)
        assert line.isascii()


def test_rfc5424_header_fields_never_break_the_line() -> None:
    event = {"seq": 1, "boot": "b o\not", "type": "x" * 40, "time": 0.5, "meta": "ü\n"}
    line = cli.rfc5424(event, "host name")
    assert line.startswith("<85>1 1970-01-01T00:00:00.500000Z host_name bastion b_o_ot ")
    assert line.split(" ")[5] == "x" * 32 and "\n" not in line
    assert cli.rfc5424({"seq": 2, "time": None}, "h").split(" ")[1:6] == [
        "-",
        "h",
        "bastion",
        "-",
        "-",
    ]


# -- resuming by seq ------------------------------------------------------------------------------


def test_since_prints_only_later_records(world: World) -> None:
    everything = offline(world).lines
    for since in (0, 1, 3, len(everything), len(everything) + 5):
        assert offline(world, since=since).lines == everything[since:]


def test_output_prints_each_seq_once_and_names_a_gap() -> None:
    got = Lines()
    for seq in (1, 2, 2, 1, 3, 6, 5, 7):
        got.out.event({"seq": seq, "type": "x"})
    assert got.seqs() == [1, 2, 3, 6, 7]
    assert got.said == [
        "warning: seq 4..5 are not in the journal (damaged? see `bastion audit verify`)"
    ]
    got.out.event({"type": "no seq"})
    assert got.out.last == 7 and got.out.printed == 5


# -- through the gateway: the client's reconnections -------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def records(*seqs: int) -> list[dict[str, Any]]:
    return [{"event": "record", "record": {"seq": s, "type": "x", "boot": "b"}} for s in seqs]


HELLO = {"event": "hello", "boot_id": "boot_x"}


def scripted(*sessions: list[dict[str, Any]] | Exception) -> tuple[Any, list[int]]:
    """A `connect` that plays one session per call and notes each `since` asked for."""
    asked: list[int] = []
    queue = list(sessions)

    def connect(since: int) -> Iterator[dict[str, Any]]:
        asked.append(since)
        step = queue.pop(0)
        if isinstance(step, Exception):
            raise step
        yield from step

    return connect, asked


def test_a_follower_reconnects_after_the_last_seq_without_duplicates() -> None:
    connect, asked = scripted(
        [HELLO, *records(1, 2, 3)],  # then the gateway stops: EOF
        cli.Away("the gateway is not running"),
        [{"ok": False, "error": "the vault is locked", "retryable": True}],
        [HELLO, *records(2, 3, 4, 5), {"event": "ping"}],  # an overlap is printed once
        [HELLO, *records(6), {"event": "end"}],
    )
    got, clock = Lines(), Clock()
    cli.from_gateway(connect, got.out, True, 60, got.said.append, clock.sleep, lambda: clock.now)
    assert got.seqs() == [1, 2, 3, 4, 5, 6]
    assert asked == [0, 3, 3, 3, 5]
    assert len(got.said) == 4, got.said
    assert "waiting up to 60s" in got.said[0] and "resume after seq 3" in got.said[0]
    assert got.said[1] == "reconnected to gateway boot_x; resuming after seq 3"
    assert got.said[2].startswith("the gateway ended the stream (stopped or restarted)")


def test_a_follower_gives_up_when_the_gateway_stays_away() -> None:
    away = cli.Away("the gateway is not running")
    connect, asked = scripted([HELLO, *records(1, 2)], *([away] * 100))
    got, clock = Lines(), Clock()
    with pytest.raises(cli.ExportAborted, match=r"within 5s .*resume with --since 2"):
        cli.from_gateway(connect, got.out, True, 5, got.said.append, clock.sleep, lambda: clock.now)
    assert got.seqs() == [1, 2] and 5 <= clock.now < 8 and max(clock.slept) <= 2.0
    assert set(asked[1:]) == {2}


def test_without_follow_a_lost_or_refused_stream_is_an_error() -> None:
    connect, _ = scripted([HELLO, *records(1)])
    got = Lines()
    with pytest.raises(cli.Away, match="ended the stream"):
        cli.from_gateway(connect, got.out, False, 60, got.said.append)
    connect, _ = scripted([{"ok": False, "error": "refused: inside an agent"}])
    with pytest.raises(cli.ExportAborted, match="inside an agent"):
        cli.from_gateway(connect, Lines().out, True, 60)


# -- the gateway's stream, on a real journal and recorder ---------------------------------------


class FakeVault:
    def __init__(self, secret: Ed25519PrivateKey) -> None:
        self.secret = secret
        self.locked = False
        self.asked = 0

    def private_key(self, label: str) -> Any:
        assert label == journal.IDENTITY_LABEL
        if self.locked:
            raise VaultLocked("locked")
        self.asked += 1
        return SimpleNamespace(pyca_key=self.secret)


def gateway(w: World) -> SimpleNamespace:
    return SimpleNamespace(
        boot_id=w.j.boot,
        vault=FakeVault(w.secret),
        recorder=Recorder(w.j),
        home=SimpleNamespace(journal=w.dir),
    )


async def nxt(stream: AsyncIterator[dict[str, Any]], timeout: float = 5) -> dict[str, Any]:
    return await asyncio.wait_for(anext(stream), timeout)


async def drain(stream: AsyncIterator[dict[str, Any]], upto: int) -> list[int]:
    """Record lines until seq `upto`."""
    seqs: list[int] = []
    while not seqs or seqs[-1] < upto:
        line = await nxt(stream)
        if line.get("event") == "record":
            seqs.append(line["record"]["seq"])
    return seqs


async def test_the_stream_sends_the_backlog_then_ends(world: World) -> None:
    gw = gateway(world)
    lines = [line async for line in gwexport.export_stream(gw, {"since": 2})]
    assert lines[0] == {"event": "hello", "boot_id": "boot_1"}
    assert lines[-1] == {"event": "end", "seq": world.seqs()[-1]}
    events = [line["record"] for line in lines[1:-1]]
    assert events == offline(world, since=2).events()  # the same lines both ways
    assert gw.recorder.sinks == []


async def test_the_stream_refuses_a_locked_vault_and_bad_arguments(world: World) -> None:
    gw = gateway(world)
    gw.vault.locked = True
    (line,) = [line async for line in gwexport.export_stream(gw, {})]
    assert line["ok"] is False and line["retryable"] is True and "`bastion unlock`" in line["error"]
    gw.vault.locked = False
    for args in ({"since": -1}, {"since": True}, {"follow": "yes"}, {"with_commands": 1}):
        (line,) = [line async for line in gwexport.export_stream(gw, args)]
        assert line["ok"] is False and line["retryable"] is False, args


async def test_following_sees_new_records_fills_gaps_and_ends_at_a_lock(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gwexport, "PING", 0.05)
    gw = gateway(world)
    stream = gwexport.export_stream(gw, {"follow": True, "with_commands": True})
    head = world.seqs()[-1]
    assert (await nxt(stream))["event"] == "hello"
    assert await drain(stream, head) == list(range(1, head + 1))
    assert (await nxt(stream)) == {"event": "ping"}

    world.request("req_2", exit_status=3, recorder=gw.recorder)
    got = await drain(stream, head + 4)
    assert got == list(range(head + 1, head + 5))

    world.j.append(E.POLICY_LOADED, {}, {})  # not through the recorder: no sink heard it
    gw.recorder.record(E.RUN_REGISTERED, {}, {"subject": {"pid": 1}})
    assert await drain(stream, head + 6) == [head + 5, head + 6]  # the gap, read from the files

    asked = gw.vault.asked
    gw.vault.locked = True
    gw.recorder.record(E.VAULT_LOCKED, {"epoch": 2})
    line = await nxt(stream)
    assert line["ok"] is False and line["retryable"] is True
    assert gw.vault.asked == asked  # no key once locked
    with pytest.raises(StopAsyncIteration):
        await nxt(stream)
    assert gw.recorder.sinks == []


async def test_a_slow_follower_reads_the_files_again(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gwexport, "MAX_QUEUED", 3)
    gw = gateway(world)
    stream = gwexport.export_stream(gw, {"follow": True})
    head = world.seqs()[-1]
    assert (await nxt(stream))["event"] == "hello"
    await drain(stream, head)
    for i in range(3):
        world.request(f"req_{i + 10}", recorder=gw.recorder)  # 12 records, 3 queued
    assert await drain(stream, head + 12) == list(range(head + 1, head + 13))
    await stream.aclose()
    assert gw.recorder.sinks == []


async def test_a_restart_between_two_streams_costs_no_gap_and_no_duplicate(world: World) -> None:
    """What `audit export --follow` does when the gateway restarts: the second
    stream asks after the last seq the first one delivered."""
    gw = gateway(world)
    got = Lines()
    first = gwexport.export_stream(gw, {"follow": True})
    assert (await nxt(first))["event"] == "hello"
    for seq in await drain(first, world.seqs()[-1]):
        got.out.event({"seq": seq})
    world.request("req_2", recorder=gw.recorder)
    for _ in range(2):  # the stream is cut after two of the four new records
        got.out.event((await nxt(first))["record"])
    await first.aclose()
    world.j.close()

    world.new_lifetime()  # the next gateway: a BOOT record, then more requests
    gw = gateway(world)
    world.request("req_3", recorder=gw.recorder)
    second = gwexport.export_stream(gw, {"since": got.out.last})
    for line in [line async for line in second]:
        if line["event"] == "record":
            got.out.event(line["record"])
    assert got.seqs() == world.seqs() == list(range(1, world.seqs()[-1] + 1))
    assert got.said == []


# -- offline: following the files ------------------------------------------------------------------


def test_tail_reads_whole_lines_only_and_new_segments(world: World) -> None:
    tail = cli.Tail(world.dir)
    assert [r.seq for r in tail.read()] == world.seqs()
    assert tail.read() == []
    segment = journal.segments(world.dir)[-1]
    record = world.j.append(E.POLICY_LOADED, {}, {})
    line = segment.read_bytes()[-len(record.line()) :]
    segment.write_bytes(segment.read_bytes()[: -len(line)] + line[:10])  # half written
    assert tail.read() == []
    segment.write_bytes(segment.read_bytes() + line[10:])
    assert [r.seq for r in tail.read()] == [record.seq]
    (world.dir / f"{record.seq + 1:012d}.jsonl").write_bytes(b"")  # a new segment
    assert tail.read() == []


def test_offline_follow_goes_on_across_a_restart(world: World) -> None:
    """The files are all there is: a new lifetime appends to them, and the
    follower prints it with no gap and no duplicate."""
    steps = [
        lambda: world.request("req_2"),
        lambda: (world.j.close(), world.new_lifetime()),
        lambda: world.request("req_3"),
        lambda: None,
    ]
    got = Lines(since=2)

    def sleep(_: float) -> None:
        steps.pop(0)()

    records = cli.file_records(world.dir, True, sleep=sleep, idle=lambda: not steps)
    cli.from_files(records, world.secret, got.out, False)
    assert got.seqs() == world.seqs()[2:] == list(range(3, world.seqs()[-1] + 1))
    assert {e["boot"] for e in got.events()} == {"boot_1", "boot_2"}
    assert all(e["command"] is None for e in got.events() if "command" in e)
