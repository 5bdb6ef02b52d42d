"""stdin is part of what is approved (issue 21, acceptance 3): on a per-command account
the agent's stdin is read whole before the command card, the card shows its size,
sha256 and first bytes, a yes is bound to it, and the target gets exactly those
bytes; more than the bound is refused and nothing runs. A session account streams.
Real OpenSSH client, real sshd, real gateway."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bastion.core.defaults import MAX_CARD_STDIN
from tests.harness import PASSPHRASE, Bastion, Result, make_bastion, policy_toml

# Runs ssh with a stdin pipe it writes SEND to (if set) and then keeps open, never
# closing it, until ssh exits: an agent whose stdin is inherited and left open.
HOLD_OPEN = """
import os, subprocess, sys
p = subprocess.Popen(sys.argv[1:], stdin=subprocess.PIPE)
if os.environ.get("SEND"):
    p.stdin.write(os.environ["SEND"].encode()); p.stdin.flush()
sys.exit(p.wait())
"""


@pytest.fixture
def pc(tmp_path: Path, sshd: Any, client_key: tuple[Path, str]) -> Iterator[Bastion]:
    """A gateway whose web1 account is per-command."""
    b = make_bastion(tmp_path, sshd, client_key[0], policy_toml(sshd, approval="per-command"))
    try:
        yield b
    finally:
        b.close()


def ssh(b: Bastion, command: str) -> list[str]:
    return ["ssh", "-F", str(b.config), "web1", command]


def piped(b: Bastion, data_file: Path, command: str) -> list[str]:
    """`cat FILE | ssh web1 COMMAND`: stdin is a pipe that ends."""
    line = f"cat {shlex.quote(str(data_file))} | {shlex.join(ssh(b, command))}"
    return ["sh", "-c", line]


def command_card(b: Bastion) -> dict[str, Any]:
    """Approve session cards until the command card comes; return it, unanswered."""
    while True:
        card = b.next_card(timeout=30)
        if card["kind"] == "command":
            return card
        b.answer(card, True)


def journal_state(b: Bastion, result: Result) -> dict[str, Any]:
    assert result.error is not None, result.stderr
    r = b.cli("request", result.error["request_id"], "--json")
    return json.loads(r.stdout)


def test_a_piped_script_is_on_the_card_and_a_no_runs_nothing(pc: Bastion, tmp_path: Path) -> None:
    marker = tmp_path / "M"
    script = tmp_path / "script"
    script.write_bytes(f"touch {marker}\n".encode())
    agent = pc.agent()
    rid = agent.start([], argv=piped(pc, script, "sh"))
    card = command_card(pc)
    stdin = card["stdin"]
    assert stdin["size"] == len(script.read_bytes()) and stdin["end"] == "closed"
    assert stdin["sha256"] == hashlib.sha256(script.read_bytes()).hexdigest()
    assert f"touch {marker}\\n" == stdin["preview"]
    shown = pc.cli("pending").stdout
    assert f"stdin:    {stdin['size']} bytes -- the command reads these:" in shown
    assert f"stdin sha256: {stdin['sha256']}" in shown
    assert f"touch {marker}" in shown
    pc.answer(card, False)
    result = agent.wait(rid)
    assert result.code == "CALL_DENIED", result.stderr
    assert not marker.exists()


def test_an_approved_script_runs_and_the_target_gets_exactly_those_bytes(
    pc: Bastion, tmp_path: Path
) -> None:
    marker = tmp_path / "M"
    agent = pc.agent()
    line = f"printf 'touch {marker}\\n' | " + shlex.join(ssh(pc, "sh"))
    rid = agent.start([], argv=["sh", "-c", line])
    card = command_card(pc)
    assert card["stdin"]["sha256"] == hashlib.sha256(f"touch {marker}\n".encode()).hexdigest()
    pc.answer(card, True)
    result = agent.wait(rid)
    assert result.rc == 0, result.stderr
    assert marker.exists()
    # Binary bytes, past a chunk and the preview: the target's copy is byte-exact.
    data = tmp_path / "data"
    data.write_bytes(os.urandom(300_000) + b"\x00\xff\x1b[2J")
    copy = tmp_path / "copy"
    rid = agent.start([], argv=piped(pc, data, f"tee {copy}"))
    card = command_card(pc)
    assert card["stdin"]["size"] == data.stat().st_size
    assert card["stdin"]["sha256"] == hashlib.sha256(data.read_bytes()).hexdigest()
    pc.answer(card, True)
    result = agent.wait(rid)
    assert result.rc == 0, result.stderr
    assert copy.read_bytes() == data.read_bytes()
    assert result.stdout_sha256 == hashlib.sha256(data.read_bytes()).hexdigest()


def test_stdin_over_the_bound_is_refused_naming_file_transfer_and_nothing_runs(
    pc: Bastion, tmp_path: Path
) -> None:
    big = tmp_path / "big"
    with big.open("wb") as f:
        f.truncate(64 * 1024 * 1024)
    marker = tmp_path / "M"
    agent = pc.agent()
    rid = agent.start([], argv=piped(pc, big, f"tee {marker}"))
    pc.approve_next(timeout=30)  # the session card; no command card follows
    result = agent.wait(rid)
    assert result.rc == 77 and result.code == "UNSUPPORTED_REQUEST", result.stderr
    assert result.error is not None and result.error["retryable"] is False
    message = result.error["message"]
    assert f"larger than {MAX_CARD_STDIN} bytes" in message
    assert "scp" in message and "sftp" in message and "Nothing was sent" in message
    assert not marker.exists()
    state = journal_state(pc, result)
    assert state["state"] == "denied" and state["code"] == "UNSUPPORTED_REQUEST"
    assert state["stdin"]["end"] == "too_large"
    assert pc.op("pending") == []
    # Control: the same command with a stdin under the bound raises its card and runs.
    small = tmp_path / "small"
    small.write_bytes(b"x" * 1000)
    rid = agent.start([], argv=piped(pc, small, f"tee {marker}"))
    pc.answer(command_card(pc), True)
    assert agent.wait(rid).rc == 0 and marker.read_bytes() == small.read_bytes()


def test_a_session_account_still_streams_a_large_stdin(bastion: Bastion, tmp_path: Path) -> None:
    big = tmp_path / "big"
    big.write_bytes(os.urandom(4 * MAX_CARD_STDIN))
    agent = bastion.agent()
    rid = agent.start([], argv=piped(bastion, big, "sha256sum"))
    card = bastion.approve_next(timeout=30)
    assert card["kind"] == "session" and card["stdin"] is None
    result = agent.wait(rid)
    assert result.rc == 0, result.stderr
    assert result.stdout.split()[0].decode() == hashlib.sha256(big.read_bytes()).hexdigest()


def hold_open(b: Bastion, command: str) -> list[str]:
    return [sys.executable, "-c", HOLD_OPEN, *ssh(b, command)]


def test_an_open_stdin_that_sends_nothing_gets_a_card_saying_none_and_an_eof(
    pc: Bastion, tmp_path: Path
) -> None:
    """`ssh host cmd` from a script whose stdin is a pipe left open: after STDIN_WAIT
    the card says the command gets no stdin, and the target gets EOF (it ends)."""
    copy = tmp_path / "copy"
    agent = pc.agent()
    rid = agent.start([], argv=hold_open(pc, f"tee {copy}"))
    card = command_card(pc)
    assert card["stdin"]["end"] == "silent" and card["stdin"]["size"] == 0
    assert "still open, nothing sent; the command gets none" in pc.cli("pending").stdout
    pc.answer(card, True)
    result = agent.wait(rid)
    assert result.rc == 0, result.stderr
    assert copy.read_bytes() == b""


def test_an_open_stdin_that_sent_part_is_refused_and_nothing_runs(
    pc: Bastion, tmp_path: Path
) -> None:
    marker = tmp_path / "M"
    agent = pc.agent(SEND="partial line\n")
    rid = agent.start([], argv=hold_open(pc, f"tee {marker}"))
    pc.approve_next(timeout=30)  # the session card
    result = agent.wait(rid)
    assert result.code == "UNSUPPORTED_REQUEST", result.stderr
    assert "no end (EOF)" in result.error["message"]  # type: ignore[index]
    assert not marker.exists()
    assert journal_state(pc, result)["state"] == "denied"


def test_no_stdin_content_in_the_journal_or_the_gateway_log(
    pc: Bastion, tmp_path: Path, client_key: tuple[Path, str]
) -> None:
    needle = b"stdin-marker-5e1d"
    data = tmp_path / "data"
    data.write_bytes(b"echo " + needle + b" > /dev/null\n")
    agent = pc.agent()
    rid = agent.start([], argv=piped(pc, data, "sh"))
    card = command_card(pc)
    assert needle.decode() in card["stdin"]["preview"]  # control: the card shows it
    pc.answer(card, True)
    assert agent.wait(rid).rc == 0
    pc.stop_daemon()
    for path in [pc.log, *(pc.home.journal).rglob("*")]:
        if path.is_file():
            assert needle not in path.read_bytes(), path
    # Not even in the journal's encrypted events.
    from bastion import journal
    from bastion.journal import IDENTITY_LABEL
    from bastion.ops import unlocked
    from bastion.vault import Vault

    with unlocked(Vault.open(pc.home.vault), PASSPHRASE.encode()) as vault:
        key = vault.private_key(IDENTITY_LABEL).pyca_key
        events = [e for _, e in journal.decrypt(journal.records(pc.home.journal), key)]
    text = json.dumps(events)
    assert needle.decode() not in text
    assert card["stdin"]["sha256"] in text  # control: the events were read, and say its digest
