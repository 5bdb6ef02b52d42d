"""`bastion approve` gets attention and keeps the operator informed (issue 12): a new
card rings the terminal bell and raises a desktop notification naming the account,
the host and the program (the command only with `--notify-command`); between cards
one status line says locked/unlocked, sessions, pending cards and the witness's lag;
`L` locks the vault at once.

A real pty (`Terminal`), rendered with pyte where what matters is what the screen
shows now (the status line is redrawn in place). `notify-send` is a stand-in first on
PATH that records its argv.
"""

from __future__ import annotations

import json
import os
import select
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyte
import pytest

from bastion.cli import notify
from bastion.cli.notify import MAX_RUNNING, Notification, Notifier
from bastion.cli.promptkeys import GUARD
from bastion.devtools.sshd_fixture import SshdInfo
from tests.harness import USER, Bastion, Terminal, cli_argv, make_bastion, policy_toml, wait_for

SECRET = "notify-secret-5c1f"  # the command text: never in a notification unless asked

FAKE_NOTIFY_SEND = f"""#!{sys.executable}
import json, os, sys
with open(os.environ["NOTIFY_LOG"], "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
"""


@pytest.fixture
def per_command(tmp_path: Path, sshd: SshdInfo, client_key: tuple[Path, str]) -> Iterator[Bastion]:
    """A gateway whose account needs a session card, then a card for each command."""
    b = make_bastion(tmp_path, sshd, client_key[0], policy_toml(sshd, approval="per-command"))
    try:
        yield b
    finally:
        b.close()


def fake_notify_send(tmp_path: Path) -> Path:
    directory = tmp_path / "fakebin"
    directory.mkdir(exist_ok=True)
    program = directory / "notify-send"
    program.write_text(FAKE_NOTIFY_SEND)
    program.chmod(0o755)
    return directory


def approve_on_a_terminal(b: Bastion, path_first: Path, log: Path, *flags: str) -> Terminal:
    term = Terminal(
        [
            "env",
            f"PATH={path_first}{os.pathsep}{os.environ['PATH']}",
            f"NOTIFY_LOG={log}",
            *cli_argv(b.home.root, "approve", *flags),
        ]
    )
    term.expect("waiting for cards")
    return term


def notes(log: Path) -> list[list[str]]:
    """Each notify-send run's argv, in order."""
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def current_line(term: Terminal) -> str:
    """The line the cursor is on, as the terminal shows it now."""
    screen = pyte.Screen(200, 60)
    pyte.ByteStream(screen).feed(term.raw)
    return screen.display[screen.cursor.y].rstrip()


def wait_for_line(term: Terminal, *wanted: str, timeout: float = 20) -> str:
    """Read the program's output until the cursor's line shows every `wanted`."""
    deadline = time.monotonic() + timeout
    while True:
        line = current_line(term)
        if all(w in line for w in wanted):
            return line
        left = deadline - time.monotonic()
        assert left > 0, f"{wanted} not on the cursor's line; it shows {line!r}"
        ready, _, _ = select.select([term.master], [], [], left)
        if ready:
            chunk = os.read(term.master, 65536)
            term.raw += chunk
            term.seen += chunk


def exe_name(pid: int) -> str:
    return os.path.basename(os.path.realpath(f"/proc/{pid}/exe"))


def test_a_new_card_rings_the_bell_and_notifies_without_the_command(
    per_command: Bastion, tmp_path: Path
) -> None:
    b = per_command
    log = tmp_path / "notes.jsonl"
    term = approve_on_a_terminal(b, fake_notify_send(tmp_path), log)
    try:
        assert b"\a" not in term.raw and notes(log) == []
        agent = b.agent()
        rid = agent.start(f"echo {SECRET}")
        term.expect("session approval")
        term.expect("approve? [y/n then Enter")
        assert term.raw.count(b"\a") == 1
        assert term.raw.index(b"\a") < term.raw.index(b"session approval")  # before the card
        wait_for(lambda: len(notes(log)) == 1, timeout=20)

        term.answer("y")
        term.expect("command approval")
        term.expect("approve? [y/n then Enter")
        assert term.raw.count(b"\a") == 2
        wait_for(lambda: len(notes(log)) == 2, timeout=20)
        term.answer("y")
        assert agent.wait(rid).stdout == f"{SECRET}\n".encode()
    finally:
        term.close()
    for argv in notes(log):
        assert argv[:2] == ["--app-name=bastion", f"bastion: card for {USER}@web1"], argv
        assert f"{exe_name(agent.pid)} (pid {agent.pid}) asks for" in argv[2], argv
        assert SECRET not in json.dumps(argv), argv
    assert [n[2].split(" asks for ")[1].split(";")[0] for n in notes(log)] == [
        "a session",
        "a command",
    ]


def test_notify_command_shows_the_command_and_no_notify_keeps_only_the_bell(
    per_command: Bastion, tmp_path: Path
) -> None:
    b = per_command
    fake = fake_notify_send(tmp_path)
    shown_log, quiet_log = tmp_path / "shown.jsonl", tmp_path / "quiet.jsonl"
    shown = approve_on_a_terminal(b, fake, shown_log, "--notify-command")
    quiet = approve_on_a_terminal(b, fake, quiet_log, "--no-notify")
    try:
        agent = b.agent()
        rid = agent.start(f"echo {SECRET}")
        b.approve_next()  # the session card
        wait_for(lambda: len(notes(shown_log)) == 2, timeout=20)  # then the command card
        quiet.expect("command approval")
        quiet.expect("approve? [y/n then Enter")
        b.approve_next()
        assert agent.wait(rid).stdout == f"{SECRET}\n".encode()
    finally:
        shown.close()
        quiet.close()
    # Two notify-send runs at nearly the same moment: their lines may come in either order.
    by_kind = {n[2].split(" asks for ")[1].split(";")[0]: n for n in notes(shown_log)}
    session_note, command_note = by_kind["a session"], by_kind["a command"]
    assert SECRET not in json.dumps(session_note)  # a session card has no command
    assert command_note[1] == f"bastion: card for {USER}@web1"
    assert command_note[2].endswith(f"\ncommand: echo {SECRET}"), command_note
    assert not quiet_log.exists()
    assert quiet.raw.count(b"\a") == 2


def test_the_status_line_between_cards_and_the_lock_key(bastion: Bastion, tmp_path: Path) -> None:
    log = tmp_path / "notes.jsonl"
    term = approve_on_a_terminal(bastion, fake_notify_send(tmp_path), log, "--no-notify")
    try:
        line = wait_for_line(term, "vault unlocked", "sessions 0", "pending 0", "L lock")
        assert "witness none" in line, line
        agent = bastion.agent()
        rid = agent.start("echo first")
        term.expect("approve? [y/n then Enter")
        card_id = bastion.next_card()["id"]  # the question owns the line, and names the card
        assert current_line(term).startswith(f"{card_id} (session on web1): approve? [y/n")
        term.answer("y")
        term.expect("approved")
        assert agent.wait(rid).stdout == b"first\n"
        wait_for_line(term, "vault unlocked", "sessions 1", "pending 0")

        term.type("L")
        term.expect("locked (vault epoch")
        status = json.loads(bastion.cli("status", "--json").stdout)
        assert status["locked"] is True and status["sessions"] == 0
        wait_for_line(term, "vault locked", "sessions 0")
        r = agent.run("echo after-lock")
        assert r.code == "VAULT_LOCKED" and r.stdout == b""
        # A key within GUARD of the screen's last change is ignored (promptkeys.decide);
        # a person reads the line first. Where the refused command came back sooner than
        # that (a fast machine), `q` fell inside the guard and the prompt stayed.
        time.sleep(GUARD + 0.2)
        term.type("q")
        assert term.proc.wait(10) == 0
        assert not notes(log)
    finally:
        term.close()


def test_lock_key_while_a_card_waits_withdraws_it(bastion: Bastion, tmp_path: Path) -> None:
    term = approve_on_a_terminal(bastion, fake_notify_send(tmp_path), tmp_path / "n", "--no-notify")
    try:
        agent = bastion.agent()
        rid = agent.start("echo never")
        term.expect("approve? [y/n then Enter")
        term.type("L")  # at once: locking waits out no guard
        term.expect("withdrawn: the vault locked")
        assert agent.wait(rid).code == "VAULT_LOCKED"
        assert bastion.op("status")["locked"] is True
        wait_for_line(term, "vault locked", "pending 0")
    finally:
        term.close()


def test_a_hung_notify_send_is_never_waited_for_and_is_killed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hang = tmp_path / "notify-send"
    hang.write_text("#!/bin/sh\nexec sleep 600\n")
    hang.chmod(0o755)
    monkeypatch.setattr(notify, "NOTIFY_TIMEOUT", 0.5)
    n = Notifier(str(hang))
    started = time.monotonic()
    for _ in range(MAX_RUNNING + 2):
        n.send(Notification("bastion: card for a@b", "x"))
    assert time.monotonic() - started < 5  # started, not waited for
    procs: list[Any] = [p for p, _ in n.running]
    assert len(procs) == MAX_RUNNING  # a burst of cards spawns no more than this

    def all_reaped() -> bool:
        n.reap()
        return not n.running

    wait_for(all_reaped, timeout=15)
    assert [p.returncode for p in procs] == [-9] * MAX_RUNNING  # killed past their time
    monkeypatch.setattr(notify, "NOTIFY_TIMEOUT", 600.0)
    n.send(Notification("s", "b"))
    ((last, _),) = n.running
    started = time.monotonic()
    n.close()  # quitting the prompt does not wait out a hung notify-send
    assert time.monotonic() - started < 5 and last.returncode == -9 and n.running == []
    Notifier(None).send(Notification("s", "b"))  # no notify-send: nothing, no error
