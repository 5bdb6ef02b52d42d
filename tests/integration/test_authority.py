"""Authority follows the live process (issue 3, acceptance 1-9, with real ssh and sshd)."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

from bastion.devtools.sshd_fixture import SshdInfo
from tests.harness import Agent, Bastion, policy_toml, python_copy, wait_for

CONV = ("-o", "SetEnv=BASTION_CONVERSATION=conv-7")


def test_two_identical_processes_are_two_subjects(bastion: Bastion) -> None:
    a, b = bastion.agent(), bastion.agent()
    rid = a.start("echo a")
    card = bastion.approve_next()
    assert card["subject"]["pid"] == a.pid
    assert a.wait(rid).stdout == b"a\n"
    rid = b.start("echo b")
    card = bastion.next_card()
    assert card["subject"]["pid"] == b.pid and card["reason"] is None
    assert card["subject"]["exe_sha256"] == bastion.op("sessions")[0]["subject"]["exe_sha256"]
    bastion.answer(card, False)
    assert b.wait(rid).code == "SESSION_DENIED"
    assert a.run("echo a-again").stdout == b"a-again\n"  # a's approval untouched


def test_a_replacement_process_gets_a_new_card_with_process_changed(bastion: Bastion) -> None:
    first = bastion.agent()
    rid = first.start("echo first", ssh_args=CONV)
    card = bastion.approve_next()
    assert card["conversation"] == "conv-7"
    assert first.wait(rid).rc == 0
    first.close()
    wait_for(lambda: bastion.op("sessions") == [])
    replacement = bastion.agent()
    rid = replacement.start("echo second", ssh_args=CONV)
    card = bastion.next_card()
    assert card["reason"] == "process_changed" and card["subject"]["pid"] == replacement.pid
    bastion.answer(card, False)
    r = replacement.wait(rid)
    assert r.code == "SESSION_DENIED" and r.error["reauth_reason"] == "process_changed"


def test_gateway_restart_raises_gateway_restarted(bastion: Bastion, tmp_path: Path) -> None:
    agent = bastion.agent()
    rid = agent.start("true", ssh_args=CONV)
    bastion.approve_next()
    assert agent.wait(rid).rc == 0
    bastion.stop_daemon()
    bastion.start_daemon()
    bastion.unlock()
    marker = tmp_path / "marker-restarted"
    rid = agent.start(f"touch {marker}", ssh_args=CONV)
    card = bastion.next_card()
    assert card["reason"] == "gateway_restarted"
    assert not marker.exists()
    bastion.answer(card, True)
    assert agent.wait(rid).rc == 0 and marker.exists()


def test_lock_and_unlock_raise_vault_state_changed(bastion: Bastion) -> None:
    agent = bastion.agent()
    rid = agent.start("true")
    bastion.approve_next()
    assert agent.wait(rid).rc == 0
    bastion.cli("lock")
    bastion.unlock()
    rid = agent.start("true")
    assert bastion.next_card()["reason"] == "vault_state_changed"


def test_unlock_at_the_wrong_moment(bastion: Bastion, tmp_path: Path) -> None:
    """The seed's test (001): a stale intent must never run after an unrelated unlock."""
    target = tmp_path / "target"
    target.mkdir()
    deployed = target / "deployed"
    allowed = tmp_path / "allowed_revision"  # the world the agent reads before acting
    allowed.write_text("a1b2c3")
    agent = bastion.agent()
    rid = agent.start("true")
    bastion.approve_next()
    assert agent.wait(rid).rc == 0

    plan = f"echo {allowed.read_text()} > {deployed}"  # the agent plans...
    bastion.cli("lock")  # ...the vault locks before it sends
    r = agent.run(plan)
    assert r.rc == 77 and r.code == "VAULT_LOCKED" and r.error["retryable"] is False
    assert not deployed.exists()
    allowed.write_text("d4e5f6")  # the world changes while locked
    bastion.unlock()  # unlocked for an unrelated reason
    assert bastion.op("pending") == []  # nothing was kept to be resumed
    assert not deployed.exists()

    rid = agent.start(f"echo {allowed.read_text()} > {deployed}")  # re-read, new request
    card = bastion.next_card()
    assert card["reason"] == "vault_state_changed"
    bastion.answer(card, True)
    assert agent.wait(rid).rc == 0
    assert deployed.read_text() == "d4e5f6\n"


def two_hosts(sshd: SshdInfo) -> str:
    """web1 (per-command, two accounts) and web2 (per-command), both the test sshd."""
    return (
        policy_toml(sshd, approval="per-command", preapproved=["uptime"])
        + '\n[[hosts.web1.accounts]]\nuser = "other"\ncredential = "deploy-key"\n'
        'approval = "per-command"\n\n' + policy_toml(sshd, alias="web2", approval="per-command")
    )


def test_per_command_approval_is_for_one_exact_command_once(
    bastion: Bastion, sshd: SshdInfo, tmp_path: Path
) -> None:
    bastion.write_policy(two_hosts(sshd))
    agent = bastion.agent()
    rid = agent.start("echo one")
    assert bastion.approve_next()["kind"] == "session"
    card = bastion.next_card()
    assert card["kind"] == "command" and card["command"] == "echo one"
    assert card["command_sha256"] == hashlib.sha256(b"echo one").hexdigest()
    bastion.answer(card, True)
    assert agent.wait(rid).stdout == b"one\n"

    def refused(command: str, host: str = "web1") -> None:
        rid = agent.start(command, host=host)
        card = bastion.next_card()
        if card["kind"] == "session":  # a new host or account also needs its session card
            bastion.answer(card, True)
            card = bastion.next_card()
        assert card["kind"] == "command" and card["command"] == command and card["host"] in host
        bastion.answer(card, False)
        r = agent.wait(rid)
        assert r.rc == 77 and r.code == "CALL_DENIED" and r.stdout == b""

    refused("echo two")  # another command
    refused("echo one")  # the same command a second time
    refused("echo one", host="web2")  # the same command on another host
    refused("echo one", host="other@web1")  # ...or as another account
    # preapproved globs skip the command card, never the session card
    assert agent.run("uptime").rc == 0


def test_non_printable_bytes_are_escaped_on_the_card(bastion: Bastion, sshd: SshdInfo) -> None:
    bastion.write_policy(two_hosts(sshd))
    agent = bastion.agent()
    rid = agent.start("printf 'a\\tb\\033[2J'; echo \x1b[31mred")
    bastion.approve_next()
    card = bastion.next_card()
    assert card["command"] == "printf 'a\\\\tb\\\\033[2J'; echo \\x1b[31mred"
    assert "\x1b" not in card["command"]
    bastion.answer(card, False)
    assert agent.wait(rid).code == "CALL_DENIED"


def test_revoke_ends_a_session(bastion: Bastion) -> None:
    agent = bastion.agent()
    rid = agent.start("true")
    bastion.approve_next()
    assert agent.wait(rid).rc == 0
    session = bastion.op("sessions")[0]["id"]
    bastion.cli("revoke", session)
    assert bastion.op("sessions") == []
    rid = agent.start("true")
    card = bastion.next_card()
    assert card["reason"] == "revoked"


def test_bastion_run_makes_one_subject_across_shells(bastion: Bastion, tmp_path: Path) -> None:
    launch = tmp_path / "launch.py"  # a fresh, non-shell process per ssh call
    launch.write_text("import subprocess, sys\nsys.exit(subprocess.call(sys.argv[1:]))\n")
    ssh = f"{sys.executable} {launch} ssh -F {bastion.config} web1"
    script = ["sh", "-c", f"{ssh} echo one; bash -c '{ssh} echo two'"]
    runner = Agent(bastion.config)
    bastion.agents.append(runner)

    # Without a run, each launcher process is its own subject: two cards.
    rid = runner.start([], argv=script)
    first = bastion.approve_next()
    second = bastion.approve_next()
    assert first["subject"]["pid"] != second["subject"]["pid"]
    assert runner.wait(rid).stdout == b"one\ntwo\n"

    # Under `bastion run`, the whole tree is one subject: one card.
    run = [
        sys.executable,
        "-m",
        "bastion.cli",
        "--home",
        str(bastion.home.root),
        "run",
        "--label",
        "deploy-bot",
        "--",
    ]
    rid = runner.start([], argv=[*run, *script])
    card = bastion.next_card()
    assert card["subject"]["run"] == "deploy-bot"
    bastion.answer(card, True)
    r = runner.wait(rid)
    assert r.rc == 0 and r.stdout == b"one\ntwo\n", r.stderr
    assert bastion.op("pending") == []


def test_an_agent_cannot_approve_itself(bastion: Bastion) -> None:
    agent = bastion.agent()
    rid = agent.start("echo self")
    card = bastion.next_card()
    r = agent.run(
        [],
        argv=[
            sys.executable,
            "-m",
            "bastion.cli",
            "--home",
            str(bastion.home.root),
            "decide",
            card["id"],
            "approve",
        ],
    )
    assert r.rc == 1 and "agent's process tree" in r.stderr
    assert [c["id"] for c in bastion.op("pending")] == [card["id"]]
    bastion.answer(card, False)
    assert agent.wait(rid).code == "SESSION_DENIED"


def test_timeouts_tell_no_approver_from_an_unanswered_card(bastion: Bastion) -> None:
    bastion.stop_daemon()
    bastion.daemon_args = ("--approval-timeout", "1")
    bastion.start_daemon()
    bastion.unlock()
    agent = bastion.agent()
    r = agent.run("true")  # nobody is watching
    assert r.rc == 77 and r.code == "NO_APPROVER" and "bastion approve" in r.error["message"]
    rid = agent.start("true")
    assert bastion.next_card()  # an operator looks, and does not answer
    r = agent.wait(rid)
    assert r.rc == 77 and r.code == "APPROVAL_TIMEOUT"


def test_an_exec_into_another_binary_loses_the_approval(bastion: Bastion, tmp_path: Path) -> None:
    from tests.harness import HELPER

    agent = bastion.agent()
    rid = agent.start("true")
    before = bastion.approve_next()["subject"]
    assert agent.wait(rid).rc == 0
    other = python_copy(tmp_path, "python-other")
    agent.exec([str(other), str(HELPER)])
    rid = agent.start("true")
    card = bastion.next_card()
    now = card["subject"]
    assert (now["pid"], now["start_time"]) == (before["pid"], before["start_time"])
    assert now["exe_sha256"] != before["exe_sha256"] and now["exe"] == str(other)
    assert card["reason"] == "process_changed"
    bastion.answer(card, False)
    assert agent.wait(rid).code == "SESSION_DENIED"


def test_a_deleted_executable_is_reported(bastion: Bastion, tmp_path: Path) -> None:
    doomed = python_copy(tmp_path, "python-doomed")
    agent = Agent(bastion.config, python=str(doomed))
    bastion.agents.append(agent)
    doomed.unlink()
    rid = agent.start("true")
    card = bastion.next_card()
    assert card["subject"]["exe_deleted"] is True and card["subject"]["exe_sha256"]
    bastion.answer(card, False)
    assert agent.wait(rid).code == "SESSION_DENIED"


def test_an_agent_without_a_card_cannot_answer_another_agents_card(bastion: Bastion) -> None:
    asking = bastion.agent()
    rid = asking.start("echo asking")
    card = bastion.next_card()
    runner = Agent(bastion.config)
    bastion.agents.append(runner)
    cli = [sys.executable, "-m", "bastion.cli", "--home", str(bastion.home.root)]
    # A registered run with no card of its own is still an agent: unsandboxed, the
    # operator socket refuses its tree; sandboxed, the run does not even see the socket.
    decide = [*cli, "decide", card["id"], "approve"]
    r = runner.run([], argv=[*cli, "run", "--no-sandbox", "--", *decide])
    assert r.rc == 1 and "agent's process tree" in r.stderr
    r = runner.run([], argv=[*cli, "run", "--", *decide])
    assert r.rc == 1 and "no operator socket" in r.stderr
    assert [c["id"] for c in bastion.op("pending")] == [card["id"]]
    bastion.answer(card, False)
    assert asking.wait(rid).code == "SESSION_DENIED"
