"""An approval belongs to one exec of one process (issue 18): an interpreter that
execs itself, a binary rewritten in place behind the hash cache's back, an exec
with address randomisation off, and an executable path that is not UTF-8 -- each
with real ssh, a real sshd and a real gateway, and a marker file on the target
that says whether anything ran."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.harness import HELPER, Agent, Bastion, approved_agent, python_copy


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def exec_and_ask(
    bastion: Bastion, agent: Agent, argv: list[str], marker: Path
) -> tuple[dict[str, Any], int]:
    """The approved `agent` execs `argv`, then asks to touch `marker`: the card it
    raises (while nothing has run yet), and the request."""
    agent.exec(argv)
    rid = agent.start(f"touch {marker}")
    card = bastion.next_card()
    assert not marker.exists(), "the command ran before anyone approved the new program"
    return card, rid


@pytest.mark.parametrize("script", ["the same script", "another script"])
def test_an_interpreter_that_execs_itself_asks_again(
    bastion: Bastion, tmp_path: Path, script: str
) -> None:
    """`python3 a.py` execs `python3 b.py`: same pid, same start time, same
    executable and sha256 -- and a new card saying `process_changed`."""
    agent = approved_agent(bastion)
    before = bastion.op("sessions")[0]["subject"]
    b_py = HELPER if script == "the same script" else tmp_path / "b.py"
    if b_py != HELPER:
        shutil.copyfile(HELPER, b_py)
    marker = tmp_path / "ran-after-exec"
    card, rid = exec_and_ask(bastion, agent, [sys.executable, str(b_py)], marker)
    now = card["subject"]
    assert card["reason"] == "process_changed", card
    assert (now["pid"], now["start_time"]) == (before["pid"], before["start_time"])
    assert (now["exe"], now["exe_sha256"]) == (before["exe"], before["exe_sha256"])
    assert now["image"] != before["image"]
    assert bastion.op("sessions") == []  # the old approval ended; nothing covers the new one
    bastion.answer(card, True)
    assert agent.wait(rid).rc == 0 and marker.exists()


def test_a_process_that_does_not_exec_keeps_its_approval(bastion: Bastion) -> None:
    """The positive control: many requests, some at once, and not one card."""
    agent = approved_agent(bastion)
    session = bastion.op("sessions")[0]
    for i in range(12):
        r = agent.run(f"echo {i}")
        assert (r.rc, r.stdout) == (0, f"{i}\n".encode()), r.stderr
    rids = [agent.start(f"echo together-{i}") for i in range(6)]
    for i, rid in enumerate(rids):
        r = agent.wait(rid)
        assert (r.rc, r.stdout) == (0, f"together-{i}\n".encode()), r.stderr
    assert bastion.op("pending") == []
    [still] = bastion.op("sessions")
    assert still["id"] == session["id"]
    assert still["subject"].get("exec_watch") != "nothing: every request asks"


def test_a_binary_rewritten_in_place_is_hashed_anew(bastion: Bastion, tmp_path: Path) -> None:
    """Same size, mtime put back with utime: the card shows the sha256 of the
    file as it is now, not the one cached when it was first run."""
    program = python_copy(tmp_path, "py-rewritten")
    first = Agent(bastion.config, python=str(program))
    bastion.agents.append(first)
    rid = first.start("true")
    card = bastion.next_card()
    assert card["subject"]["exe_sha256"] == sha256(program)
    bastion.answer(card, False)
    assert first.wait(rid).code == "SESSION_DENIED"
    first.close()  # nothing runs it now: it can be written (no ETXTBSY)

    rewrite_in_place(program)
    second = Agent(bastion.config, python=str(program))
    bastion.agents.append(second)
    rid = second.start("true")
    card = bastion.next_card()
    assert card["subject"]["exe_sha256"] == sha256(program), "the card shows a stale sha256"
    bastion.answer(card, False)
    assert second.wait(rid).code == "SESSION_DENIED"


def rewrite_in_place(program: Path) -> None:
    """Change the last byte (ELF ignores trailing bytes), then put the access and
    modification times back: only the ctime, which no user can set, moves."""
    before = os.stat(program)
    with open(program, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(b"Z" if last != b"Z" else b"Y")
    os.utime(program, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(program)
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert after.st_ino == before.st_ino


def test_an_exec_into_a_binary_rewritten_in_place_asks_again(
    bastion: Bastion, tmp_path: Path
) -> None:
    """The approved process runs A; B was a byte-for-byte copy of A, then was
    rewritten in place keeping its size and mtime. An exec into B must not ride
    A's approval on B's stale cached hash."""
    program_a = python_copy(tmp_path, "py-a")
    program_b = tmp_path / "py-b"
    shutil.copyfile(program_a, program_b)
    program_b.chmod(0o755)
    seen = Agent(bastion.config, python=str(program_b))  # the gateway hashes B once
    bastion.agents.append(seen)
    rid = seen.start("true")
    card = bastion.next_card()
    assert card["subject"]["exe_sha256"] == sha256(program_a)
    bastion.answer(card, False)
    assert seen.wait(rid).code == "SESSION_DENIED"
    seen.close()
    rewrite_in_place(program_b)
    assert sha256(program_b) != sha256(program_a)

    agent = Agent(bastion.config, python=str(program_a))
    bastion.agents.append(agent)
    rid = agent.start("true")
    bastion.approve_next()
    assert agent.wait(rid).rc == 0
    marker = tmp_path / "ran-in-the-rewritten-binary"
    card, rid = exec_and_ask(bastion, agent, [str(program_b), str(HELPER)], marker)
    assert card["reason"] == "process_changed"
    assert card["subject"]["exe"] == str(program_b)
    assert card["subject"]["exe_sha256"] == sha256(program_b)
    bastion.answer(card, False)
    assert agent.wait(rid).code == "SESSION_DENIED"
    assert not marker.exists()


def test_an_exec_with_address_randomisation_off_is_seen(bastion: Bastion, tmp_path: Path) -> None:
    """`setarch -R` (personality ADDR_NO_RANDOMIZE, inherited by every exec): the
    same program execs with the same layout, address for address. The address
    space the gateway holds is gone all the same."""
    if shutil.which("setarch") is None:
        pytest.skip("setarch is not installed (util-linux)")
    agent = Agent(bastion.config, launcher=("setarch", "-R"))
    bastion.agents.append(agent)
    rid = agent.start("true")
    bastion.approve_next()
    assert agent.wait(rid).rc == 0
    personality = int(Path(f"/proc/{agent.pid}/personality").read_text(), 16)
    assert personality & 0x0040000, "setarch -R did not turn randomisation off"
    marker = tmp_path / "ran-without-aslr"
    card, rid = exec_and_ask(bastion, agent, [sys.executable, str(HELPER)], marker)
    assert card["reason"] == "process_changed"
    bastion.answer(card, False)
    assert agent.wait(rid).code == "SESSION_DENIED"
    assert not marker.exists()


def test_an_executable_path_that_is_not_utf8_gets_a_normal_card(
    bastion: Bastion, tmp_path: Path
) -> None:
    """A byte 0xff in the agent's executable path: the card shows it escaped, the
    command runs once approved, and the journal keeps the exact bytes."""
    weird = tmp_path / os.fsdecode(b"bin\xff")
    weird.mkdir()
    python = python_copy(weird, "python")
    agent = Agent(bastion.config, python=str(python))
    bastion.agents.append(agent)
    marker = tmp_path / "ran-from-a-weird-path"
    rid = agent.start(f"touch {marker}")
    card = bastion.next_card()
    subject = card["subject"]
    shown = os.fsencode(python).replace(b"\xff", b"\\xff").decode()
    assert subject["exe"] == shown and "\\xff" in subject["exe"]
    assert base64.b64decode(subject["exe_base64"]) == os.fsencode(python)
    assert f"{tmp_path}/bin\\xff/python" in bastion.cli("pending").stdout  # as a person sees it
    bastion.answer(card, True)
    assert agent.wait(rid).rc == 0 and marker.exists()

    export = bastion.cli("audit", "export").stdout.splitlines()
    received = [json.loads(line) for line in export if '"request_received"' in line]
    journaled = received[-1]["subject"]
    assert journaled["exe"] == shown
    assert base64.b64decode(journaled["exe_base64"]) == os.fsencode(python)
    # Valid Unicode throughout: a lone surrogate would not encode (nor parse outside Python).
    json.dumps(received, ensure_ascii=False).encode("utf-8")


def test_a_run_keeps_its_approval_when_a_process_inside_it_execs(
    bastion: Bastion, tmp_path: Path
) -> None:
    """`bastion run` is one subject for its whole tree: an exec below the run is not
    an exec of the run. The run keeps a thread that an exec of its own would end,
    and its card says that is how the gateway sees it."""
    cli = (sys.executable, "-m", "bastion.cli", "--home", str(bastion.home.root))
    agent = Agent(bastion.config, launcher=(*cli, "run", "--label", "exec-inside", "--"))
    bastion.agents.append(agent)
    rid = agent.start("true")
    card = bastion.next_card()
    assert card["subject"]["kind"] == "registered run" and card["subject"]["pid"] == agent.pid
    assert card["subject"]["exec_watch"] == "a thread an exec would end"
    bastion.answer(card, True)
    assert agent.wait(rid).rc == 0
    agent.exec([sys.executable, str(HELPER)])  # the helper below the run execs
    marker = tmp_path / "ran-in-the-run"
    r = agent.run(f"touch {marker}")
    assert r.rc == 0 and marker.exists(), r.stderr
    assert bastion.op("pending") == []
