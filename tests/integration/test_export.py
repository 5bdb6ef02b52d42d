"""`bastion audit export`: the journal as a stream for collectors, from a real
gateway that served real ssh commands -- through the gateway and offline,
and `--follow` across a lock and a gateway restart with no gap and no duplicate.
"""

from __future__ import annotations

import contextlib
import json
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bastion import journal
from bastion.devtools.sshd_fixture import SshdInfo
from tests.harness import PASSPHRASE, Bastion, make_bastion, policy_toml, secret_needles

PASS = PASSPHRASE + "\n"
# The command holds a marker of its own; its output is another string entirely.
COMMAND = "printf %s-%s cmdmark7f3a outmark9c2b"
OUTPUT = b"cmdmark7f3a-outmark9c2b"
TERMINAL = {"denied", "completed", "signalled", "remote_rejected", "unknown", "not_started"}


@pytest.fixture(scope="module")
def busy(
    tmp_path_factory: pytest.TempPathFactory, sshd_server: Any, client_key: tuple[Path, str]
) -> Iterator[Bastion]:
    """A gateway (running, unlocked) whose journal holds command cards approved and
    declined, outcomes with exit statuses, and a denial."""
    info: SshdInfo = sshd_server.info
    b = make_bastion(
        tmp_path_factory.mktemp("export"),
        info,
        client_key[0],
        policy_toml(info, approval="per-command"),
    )
    try:
        a = b.agent()
        rid = a.start(COMMAND)
        b.approve_next()  # the session card
        b.approve_next()  # the command card
        assert a.wait(rid).stdout == OUTPUT
        rid = a.start("exit 4")
        b.approve_next()
        assert a.wait(rid).rc == 4
        rid = a.start("false")
        b.answer(b.next_card(), False)
        assert a.wait(rid).code == "CALL_DENIED"
        assert a.run("true", host="nowhere").code == "UNKNOWN_HOST"
        yield b
    finally:
        b.close()


def export(b: Bastion, *args: str, stdin: str | None = None) -> list[dict[str, Any]]:
    out = b.cli("audit", "export", *args, stdin=stdin).stdout
    return [json.loads(line) for line in out.splitlines()]


def seqs(events: list[dict[str, Any]]) -> list[int]:
    return [e["seq"] for e in events]


def journal_seqs(b: Bastion) -> list[int]:
    return [r.seq for r in journal.records(b.home.journal)]


def test_export_prints_every_record_with_the_fields_the_views_agree_with(
    busy: Bastion, client_key: tuple[Path, str]
) -> None:
    b = busy
    events = export(b)
    records = list(journal.records(b.home.journal))
    assert seqs(events) == [r.seq for r in records] == list(range(1, len(records) + 1))
    assert [e["type"] for e in events] == [r.type for r in records]
    assert [e["boot"] for e in events] == [r.boot for r in records]
    assert all(isinstance(e["time"], float) for e in events)

    activity = json.loads(b.cli("audit", "activity", "--json").stdout)
    assert len(activity) == 4
    for row in activity:
        mine = [e for e in events if e.get("request_id") == row["request_id"]]
        received = mine[0]
        assert received["type"] == "request_received"
        assert (received["host"], received["user"], received["command_sha256"]) == (
            row["host"],
            row["user"],
            row["command_sha256"],
        )
        assert received["command"] is None and row["command"] is not None
        (end,) = [e for e in mine if e["type"] in TERMINAL]
        assert end["type"] == row["outcome"]
        assert (end.get("exit_status"), end.get("code")) == (row["exit_status"], row["code"])
    outcomes = sorted((r["outcome"], r["exit_status"], r["code"]) for r in activity)
    assert outcomes == [
        ("completed", 0, None),
        ("completed", 4, None),
        ("denied", None, "CALL_DENIED"),
        ("denied", None, "UNKNOWN_HOST"),
    ]
    cards = [e for e in events if e["type"] == "card_raised"]
    assert sorted(c["kind"] for c in cards) == ["command", "command", "command", "session"]
    assert all(c["card"]["command"] is None and c["card"]["argv"] is None for c in cards)
    answers = sorted(e["answer"] for e in events if e["type"] == "card_closed")
    assert answers == ["approved", "approved", "approved", "declined"]

    text = b.cli("audit", "export").stdout.encode()
    for needle in (*secret_needles(client_key[0]), PASSPHRASE.encode(), OUTPUT, b"cmdmark7f3a"):
        assert needle not in text, needle


def test_command_text_only_with_the_flag_and_never_an_output_or_a_key(
    busy: Bastion, client_key: tuple[Path, str]
) -> None:
    b = busy
    raw = b.cli("audit", "export", "--with-commands").stdout
    events = [json.loads(line) for line in raw.splitlines()]
    activity = json.loads(b.cli("audit", "activity", "--json").stdout)
    commands = {e["request_id"]: e["command"] for e in events if e["type"] == "request_received"}
    assert commands == {row["request_id"]: row["command"] for row in activity}
    assert COMMAND in commands.values()
    shown = [e["card"]["command"] for e in events if e["type"] == "card_raised"]
    assert COMMAND in shown
    for needle in (*secret_needles(client_key[0]), PASSPHRASE.encode(), OUTPUT):
        assert needle not in raw.encode(), needle


def test_offline_prints_the_same_lines_as_the_gateway(busy: Bastion) -> None:
    b = busy
    for flags in ((), ("--with-commands",), ("--since", "7"), ("--format", "rfc5424")):
        online = b.cli("audit", "export", *flags).stdout
        offline = b.cli("audit", "export", *flags, "--passphrase-stdin", stdin=PASS).stdout
        assert online == offline and online, flags
    wrong = b.cli("audit", "export", "--passphrase-stdin", stdin="wrong\n", check=False)
    assert wrong.returncode == 1 and wrong.stdout == "", wrong
    assert wrong.stderr.startswith("bastion: wrong passphrase") and "Traceback" not in wrong.stderr


RFC5424 = re.compile(
    r"<(\d+)>1 (\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z) (\S+) bastion (boot_[0-9a-f]+) (\w+) - (.*)"
)


def test_since_and_the_syslog_format(busy: Bastion) -> None:
    b = busy
    everything = b.cli("audit", "export").stdout.splitlines()
    assert b.cli("audit", "export", "--since", "5").stdout.splitlines() == everything[5:]
    lines = b.cli("audit", "export", "--format", "rfc5424").stdout.splitlines()
    assert len(lines) == len(everything)
    for line, plain in zip(lines, everything, strict=True):
        m = RFC5424.fullmatch(line)
        assert m, line
        event = json.loads(m[6])
        assert m[6] == plain and (m[4], m[5]) == (event["boot"], event["type"])
        assert int(m[1]) in (84, 85)  # authpriv.warning, authpriv.notice


def test_a_locked_gateway_refuses_and_says_how_to_read_anyway(busy: Bastion) -> None:
    b = busy
    b.cli("lock")
    try:
        r = b.cli("audit", "export", check=False)
        assert r.returncode == 1 and r.stdout == "", r
        assert "locked" in r.stderr and "`bastion unlock`" in r.stderr
        assert "--passphrase-stdin" in r.stderr and len(r.stderr.splitlines()) == 1
        offline = b.cli("audit", "export", "--passphrase-stdin", stdin=PASS).stdout
        assert len(offline.splitlines()) == len(journal_seqs(b))
    finally:
        b.unlock()


# -- following ---------------------------------------------------------------------------------


def cli(b: Bastion) -> list[str]:
    return [sys.executable, "-m", "bastion.cli", "--home", str(b.home.root)]


class Follower:
    """`bastion audit export --follow` in a subprocess; its lines, as they come."""

    def __init__(self, b: Bastion, *args: str, stdin: str | None = None) -> None:
        self.proc = subprocess.Popen(
            [*cli(b), "audit", "export", "--follow", *args],
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        if stdin is not None:
            assert self.proc.stdin is not None
            self.proc.stdin.write(stdin.encode())
            self.proc.stdin.close()
        self.lines: queue.Queue[bytes] = queue.Queue()
        self.events: list[dict[str, Any]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def upto(self, seq: int, timeout: float = 30) -> None:
        """Wait until the record `seq` (or a later one) is printed."""
        deadline = time.monotonic() + timeout
        while not self.events or self.events[-1]["seq"] < seq:
            left = deadline - time.monotonic()
            assert left > 0, f"seq {seq} not printed; got {seqs(self.events)[-5:]}"
            with contextlib.suppress(queue.Empty):
                self.events.append(json.loads(self.lines.get(timeout=left)))

    def rest(self) -> None:
        """Once the process has exited: every line it printed."""
        self._reader.join(10)
        while not self.lines.empty():
            self.events.append(json.loads(self.lines.get()))

    def stop(self) -> str:
        """SIGINT: a quiet exit (130), no traceback. Returns stderr."""
        self.proc.send_signal(signal.SIGINT)
        rc = self.proc.wait(20)
        assert self.proc.stderr is not None
        err = self.proc.stderr.read().decode(errors="replace")
        assert rc == 130 and "Traceback" not in err, (rc, err)
        return err


def head(b: Bastion) -> int:
    return journal.head(b.home.journal)[0]


def run_approved(b: Bastion, command: str) -> None:
    a = b.agent()
    rid = a.start(command)
    b.approve_next()
    assert a.wait(rid).rc == 0
    a.close()


def check_whole(b: Bastion, f: Follower) -> None:
    """Every record of the journal, from the first to the last printed: no gap, no duplicate."""
    printed = seqs(f.events)
    assert printed == sorted(set(printed)), "a duplicate or a record out of order"
    assert printed == [s for s in journal_seqs(b) if s <= printed[-1]]
    assert printed == list(range(1, printed[-1] + 1))
    assert len({e["boot"] for e in f.events}) >= 2


def test_follow_survives_a_lock_and_a_gateway_restart_without_a_gap(bastion: Bastion) -> None:
    """Acceptance: "`audit export --follow` survives a gateway restart and
    resumes by seq without a gap"."""
    b = bastion
    f = Follower(b)
    run_approved(b, "echo one")
    f.upto(head(b))
    b.cli("lock")  # the stream ends with the lock; the follower waits for an unlock
    b.unlock()
    run_approved(b, "echo two")
    f.upto(head(b))
    b.stop_daemon()
    b.start_daemon()
    b.unlock()
    run_approved(b, "echo three")
    f.upto(head(b))
    err = f.stop()
    check_whole(b, f)
    assert err.count("reconnected to gateway") >= 2, err
    assert "echo" not in json.dumps(f.events)  # no command text without --with-commands


def test_offline_follow_reads_on_across_a_restart(bastion: Bastion) -> None:
    b = bastion
    f = Follower(b, "--passphrase-stdin", "--with-commands", stdin=PASS)
    run_approved(b, "echo one")
    f.upto(head(b))
    b.stop_daemon()
    b.start_daemon()
    b.unlock()
    run_approved(b, "echo two")
    f.upto(head(b))
    assert f.stop() == ""
    check_whole(b, f)
    commands = [e["command"] for e in f.events if e["type"] == "request_received"]
    assert commands == ["echo one", "echo two"]


def test_follow_gives_up_when_the_gateway_does_not_come_back(bastion: Bastion) -> None:
    b = bastion
    f = Follower(b, "--retry-for", "2", "--since", "2")
    f.upto(head(b))
    b.stop_daemon()  # and it never comes back
    assert f.proc.wait(30) == 1
    f.rest()
    assert f.proc.stderr is not None
    err = f.proc.stderr.read().decode()
    assert "Traceback" not in err, err
    last = f.events[-1]["seq"]
    assert err.strip().endswith(f"was the last printed: resume with --since {last}"), err
    assert seqs(f.events) == list(range(3, last + 1))


def test_follow_ends_quietly_when_its_reader_goes(bastion: Bastion) -> None:
    """`| head -n 1`: once nobody reads, the next line ends the command, exit 0."""
    b = bastion
    proc = subprocess.Popen(
        [*cli(b), "audit", "export", "--follow"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert json.loads(proc.stdout.readline())["seq"] == 1
    proc.stdout.close()
    b.cli("lock")  # something new to print: the next write finds nobody
    b.unlock()
    assert proc.wait(30) == 0
    err = proc.stderr.read().decode()
    assert "Traceback" not in err and "Broken pipe" not in err, err
