"""Who the subject is (issue 9): decided from executables, never from names a
process sets itself, and never a session host such as tmux."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import Bastion, wait_for


def test_a_process_renamed_bash_is_not_a_wrapper(bastion: Bastion) -> None:
    agent = bastion.agent()
    agent.rename("bash")
    assert Path(f"/proc/{agent.pid}/comm").read_text().strip() == "bash"
    rid = agent.start("true")
    card = bastion.next_card()
    # Had the name counted, the walk would have gone on to the agent's parent.
    assert card["subject"]["pid"] == agent.pid
    assert card["subject"]["kind"] == "agent process"
    bastion.answer(card, False)
    assert agent.wait(rid).code == "SESSION_DENIED"


class Tmux:
    """A private tmux server (its own socket) whose panes run bash."""

    def __init__(self, cwd: Path) -> None:
        self.socket = f"bastion-test-{secrets.token_hex(4)}"
        self.cwd = cwd
        self.tmux("new-session", "-d", "-s", "t", "-x", "200", "-y", "50", "bash", "--norc")

    def tmux(self, *args: str) -> str:
        r = subprocess.run(
            ["tmux", "-L", self.socket, *args],
            capture_output=True,
            text=True,
            timeout=30,
            cwd=self.cwd,
            env={**os.environ, "TMUX": ""},
        )
        assert r.returncode == 0, r.stderr
        return r.stdout

    def new_pane(self) -> str:
        return self.tmux(
            "split-window", "-t", "t", "-P", "-F", "#{pane_id}", "bash", "--norc"
        ).strip()

    def first_pane(self) -> str:
        return self.tmux("list-panes", "-t", "t", "-F", "#{pane_id}").split()[0]

    def type(self, pane: str, line: str) -> None:
        self.tmux("send-keys", "-t", pane, "-l", line)
        self.tmux("send-keys", "-t", pane, "Enter")

    def pane_pid(self, pane: str) -> int:
        return int(self.tmux("display-message", "-p", "-t", pane, "#{pane_pid}"))

    def kill(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, timeout=30)


@pytest.fixture
def tmux(tmp_path: Path) -> Iterator[Tmux]:
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed: apt-get install -y tmux")
    t = Tmux(tmp_path)
    try:
        yield t
    finally:
        t.kill()


def test_an_agent_in_a_tmux_pane_is_its_own_subject_and_the_operator_approves_from_another(
    bastion: Bastion, tmux: Tmux, tmp_path: Path
) -> None:
    cli = f"{sys.executable} -m bastion.cli --home {bastion.home.root}"
    agent_pane, operator_pane = tmux.first_pane(), tmux.new_pane()
    out = tmp_path / "agent-out"
    tmux.type(
        agent_pane,
        f"ssh -F {bastion.config} web1 'echo from-the-pane' > {out} 2>&1; echo $? > {out}.rc",
    )
    card = bastion.next_card()
    assert card["subject"]["pid"] == tmux.pane_pid(agent_pane)  # the pane's shell, not tmux
    assert card["subject"]["kind"] == "shell of a terminal session"
    assert "tmux" not in os.path.basename(card["subject"]["exe"])

    # The operator, in another pane of the same tmux, is not inside the agent's tree.
    decided = tmp_path / "decided"
    tmux.type(
        operator_pane, f"{cli} decide {card['id']} approve > {decided} 2>&1; echo $? >> {decided}"
    )
    wait_for(lambda: Path(f"{out}.rc").exists(), timeout=30)
    assert decided.read_text().splitlines()[-1] == "0", decided.read_text()
    assert out.read_text() == "from-the-pane\n" and Path(f"{out}.rc").read_text() == "0\n"

    # The approval covers that pane's shell only: the operator's pane gets its own card.
    second = tmp_path / "second-out"
    tmux.type(
        operator_pane,
        f"ssh -F {bastion.config} web1 'echo second' > {second} 2>&1; echo $? > {second}.rc",
    )
    other = bastion.next_card()
    assert other["subject"]["pid"] == tmux.pane_pid(operator_pane) != card["subject"]["pid"]
    bastion.answer(other, False)
    wait_for(lambda: Path(f"{second}.rc").exists(), timeout=30)
    assert Path(f"{second}.rc").read_text() == "77\n"
