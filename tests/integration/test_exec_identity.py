"""An approval belongs to one exec of one process (issue 18). Here: an executable
path that is not UTF-8, with real ssh, a real sshd and a real gateway, and a
marker file on the target that says whether anything ran."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

from tests.harness import Agent, Bastion, python_copy


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
