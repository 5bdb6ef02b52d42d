"""A sign of life while a card waits (issue 21, acceptance 5): the agent's ssh stderr
shows one line naming bastion, the card and what the operator does, as the card is
raised -- before anyone answers it -- and its stdout stays the target's exact bytes.
Off per account (`waiting_line = false`) or by the agent (`BASTION_WAIT_LINE=0`, sent
by the generated config's `SendEnv`); never for a request that needs no card; not in
`bastion mcp`'s results, whose progress already tells."""

from __future__ import annotations

import shlex
from pathlib import Path

from bastion.devtools.sshd_fixture import SshdInfo
from tests.harness import USER, Agent, Bastion, pending_ids, policy_toml, wait_for
from tests.mcp_client_helper import McpClient

LINE = "bastion: waiting for approval of card "
# The target prints bytes that are not text, and a word on its own stderr.
COMMAND = r"printf 'out\000\377\n'; printf 'err' >&2"
STDOUT = b"out\x00\xff\n"


def start(b: Bastion, agent: Agent, err: Path, env: dict[str, str] | None = None) -> int:
    """The agent's ssh, its stderr to `err` as it is written (the helper reads it only at
    the end); `exec` keeps the agent the ssh client's parent, so the card is the agent's."""
    ssh = shlex.join(["ssh", "-F", str(b.config), "web1", COMMAND])
    return agent.start([], argv=["sh", "-c", f"exec {ssh} 2>{shlex.quote(str(err))}"], env=env)


def told(err: Path) -> list[str]:
    return [line for line in err.read_text().splitlines() if line.startswith(LINE)]


def test_a_waiting_card_is_told_at_once_and_stdout_stays_exact(
    bastion: Bastion, tmp_path: Path
) -> None:
    agent = bastion.agent()
    err = tmp_path / "err1"
    rid = start(bastion, agent, err)
    card = bastion.next_card()
    wait_for(lambda: told(err), timeout=20)  # the issue says 2 s; the bound is generous
    assert pending_ids(bastion) == [card["id"]] and not agent.finished(rid)  # unanswered
    (line,) = told(err)
    assert f"card {card['id']} (session card for {USER}@web1)" in line
    assert "the operator answers in `bastion approve`; nothing is sent until then" in line
    bastion.answer(card, True)
    result = agent.wait(rid)
    assert result.rc == 0, err.read_text()
    assert result.stdout == STDOUT and result.stdout_len == len(STDOUT)  # stdout: exact
    assert err.read_text() == line + "\nerr"  # one line, before the target's own stderr
    again = tmp_path / "err2"  # the session holds: no card, no line
    result = agent.wait(start(bastion, agent, again))
    assert result.rc == 0 and result.stdout == STDOUT
    assert again.read_text() == "err"


def test_each_card_of_a_request_gets_its_own_line(
    bastion: Bastion, sshd: SshdInfo, tmp_path: Path
) -> None:
    bastion.write_policy(policy_toml(sshd, approval="per-command"))
    agent = bastion.agent()
    err = tmp_path / "err"
    rid = start(bastion, agent, err)
    session = bastion.next_card()
    wait_for(lambda: len(told(err)) == 1, timeout=20)
    bastion.answer(session, True)
    command = bastion.next_card()
    assert command["id"] != session["id"] and command["kind"] == "command"
    wait_for(lambda: len(told(err)) == 2, timeout=20)
    first, second = told(err)
    assert f"card {session['id']} (session card for {USER}@web1)" in first
    assert f"card {command['id']} (command card for {USER}@web1)" in second
    bastion.answer(command, True)
    result = agent.wait(rid)
    assert result.rc == 0 and result.stdout == STDOUT
    assert len(told(err)) == 2


def test_the_agent_turns_it_off_through_the_generated_config(
    bastion: Bastion, tmp_path: Path
) -> None:
    """`BASTION_WAIT_LINE=0` in the agent's environment: the config's `SendEnv` sends it.
    (The line is written as the card is raised, before the card is listed as pending: a
    line that were written would be in the file when the command ends.)"""
    assert "SendEnv BASTION_WAIT_LINE" in bastion.config.read_text()
    agent = bastion.agent()
    err = tmp_path / "err"
    rid = start(bastion, agent, err, env={"BASTION_WAIT_LINE": "0"})
    bastion.approve_next()
    result = agent.wait(rid)
    assert result.rc == 0 and result.stdout == STDOUT
    assert err.read_text() == "err"


def test_the_account_turns_it_off(bastion: Bastion, sshd: SshdInfo, tmp_path: Path) -> None:
    bastion.write_policy(policy_toml(sshd, waiting_line=False))
    agent = bastion.agent()
    err = tmp_path / "err"
    rid = start(bastion, agent, err)
    bastion.approve_next()
    result = agent.wait(rid)
    assert result.rc == 0 and result.stdout == STDOUT
    assert err.read_text() == "err"


def test_bastion_mcp_does_not_tell_the_model_twice(bastion: Bastion) -> None:
    client = McpClient(bastion)
    rid = client.start("call", name="ssh_exec", arguments={"host": "web1", "command": COMMAND})
    bastion.approve_next()
    structured = client.wait(rid)["structured"]
    assert structured["exit_status"] == 0, structured
    assert structured["stderr"] == "err", structured
