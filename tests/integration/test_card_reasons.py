"""Reasons that are true (issue 22, acceptance 3): a card says "an earlier approval
ended" only when an approval of *this* run -- or, outside runs, this process -- ended,
and with the real reason; a card withdrawn because its agent left is announced as
withdrawn, and why, never as "denied". Real ssh, a real sshd, real gateways, real
`bastion run`s; each negative with its positive control beside it."""

from __future__ import annotations

import json
import queue
import socket
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.harness import HELPER, Agent, Bastion, run_agent, wait_for

# A process that names itself to the gateway as a run (as `bastion run` does, with its
# exec-witness thread), then becomes the agent helper: the registered run's own process
# is the one that runs ssh, and an exec of it is an exec of the run.
REGISTER_THEN_EXEC = """
import os, sys
from pathlib import Path
from bastion.cli.run import _register
_register(Path(sys.argv[1]), "self-run", None)
os.execv(sys.executable, [sys.executable, *sys.argv[2:]])
"""


def a_run(b: Bastion, label: str, sandboxed: bool) -> Agent:
    """A `bastion run`, sandboxed (the default) or not (`--no-sandbox`)."""
    return run_agent(b, *(() if sandboxed else ("--no-sandbox",)), "--label", label)


SANDBOXED = pytest.mark.parametrize("sandboxed", [True, False], ids=["sandboxed", "unsandboxed"])


def approved(b: Bastion, agent: Agent) -> dict[str, Any]:
    """`agent` asks once; its session card is approved; the command ran."""
    rid = agent.start("true")
    card = b.approve_next()
    assert card["subject"]["pid"] == agent.pid, card
    result = agent.wait(rid)
    assert result.rc == 0, result.stderr
    return card


def first_card(b: Bastion, agent: Agent) -> tuple[dict[str, Any], int]:
    rid = agent.start("true")
    card = b.next_card()
    assert card["subject"]["pid"] == agent.pid, card
    return card, rid


@contextmanager
def watching(b: Bastion) -> Iterator[queue.Queue[dict[str, Any]]]:
    """The operator's event stream (`watch`, what `bastion approve` reads), as a queue."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(60)
    sock.connect(str(b.home.operator_socket))
    sock.sendall(json.dumps({"op": "watch"}).encode() + b"\n")
    events: queue.Queue[dict[str, Any]] = queue.Queue()

    def read() -> None:
        with sock.makefile("rb") as f:
            for line in f:
                doc = json.loads(line)
                events.put(doc.get("result", doc) if isinstance(doc, dict) else doc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        yield events
    finally:
        sock.shutdown(socket.SHUT_RDWR)
        sock.close()
        reader.join(10)


def next_event(events: queue.Queue[dict[str, Any]], kind: str, about: str) -> dict[str, Any]:
    """The next `kind` event about a card or request id (a bounded queue read)."""
    while True:
        event = events.get(timeout=60)
        if event.get("event") != kind:
            continue
        card = event.get("card")
        ids = (card.get("id") if isinstance(card, dict) else card, event.get("request_id"))
        if about in ids:
            return event


# -- (a) a new run, a new process: no reason ---------------------------------------------


@SANDBOXED
def test_a_new_runs_first_card_has_no_reason(bastion: Bastion, sandboxed: bool) -> None:
    """An earlier run of the same python3 had its approval end (it exited): a brand-new
    run's first card says nothing ended. The positive control: a reason is said where one
    is true (the revoked run's own next card)."""
    first = a_run(bastion, "first", sandboxed)
    approved(bastion, first)
    [session] = bastion.op("sessions")
    bastion.op("revoke", session=session["id"])
    card, rid = first_card(bastion, first)
    assert card["reason"] == "revoked", card  # the control: this run's approval ended
    bastion.answer(card, True)
    assert first.wait(rid).rc == 0
    first.close()
    wait_for(lambda: bastion.op("sessions") == [], 30)

    second = a_run(bastion, "second", sandboxed)
    card, rid = first_card(bastion, second)
    assert card["subject"]["exe"] == session["subject"]["exe"]  # the same python3
    assert card["reason"] is None, card
    bastion.answer(card, False)
    assert second.wait(rid).code == "SESSION_DENIED"


def test_a_new_process_outside_runs_has_no_reason(bastion: Bastion) -> None:
    """Outside runs: another python3 process whose approval ended (it exited) is not
    this one. The control: the same process, after an exec, is told `process_changed`."""
    first = bastion.agent()
    approved(bastion, first)
    first.close()
    wait_for(lambda: bastion.op("sessions") == [], 30)

    second = bastion.agent()
    card, rid = first_card(bastion, second)
    assert card["reason"] is None, card
    bastion.answer(card, True)
    assert second.wait(rid).rc == 0
    second.exec([sys.executable, str(HELPER)])
    card, rid = first_card(bastion, second)
    assert card["reason"] == "process_changed", card  # the control
    bastion.answer(card, False)
    assert second.wait(rid).code == "SESSION_DENIED"


# -- (b) a gateway restart ---------------------------------------------------------------


@SANDBOXED
def test_a_run_that_outlived_a_restart_hears_gateway_restarted(
    bastion: Bastion, sandboxed: bool
) -> None:
    """The run re-registers from runs.json; its next card says `gateway_restarted`, even
    after another process's approval (same python3) ended in the new lifetime with
    `process_changed`. A run started after the restart hears nothing."""
    survivor = a_run(bastion, "survivor", sandboxed)
    approved(bastion, survivor)
    bastion.stop_daemon()
    bastion.start_daemon()
    bastion.unlock()

    other = bastion.agent()  # outside runs, the same python3; it exits approved
    approved(bastion, other)
    other.close()
    wait_for(lambda: bastion.op("sessions") == [], 30)

    card, rid = first_card(bastion, survivor)
    assert card["subject"]["run"] == "survivor"
    assert card["reason"] == "gateway_restarted", card
    bastion.answer(card, True)
    assert survivor.wait(rid).rc == 0

    newcomer = a_run(bastion, "newcomer", sandboxed)
    card, rid = first_card(bastion, newcomer)
    assert card["reason"] is None, card
    bastion.answer(card, False)
    assert newcomer.wait(rid).code == "SESSION_DENIED"


def test_a_process_that_outlived_a_kill_hears_gateway_restarted(bastion: Bastion) -> None:
    """Outside runs, SIGKILL of the gateway: the still-running agent's card says
    `gateway_restarted` -- though another python3's approval ended since, with
    `process_changed` -- and a new agent's none."""
    agent = bastion.agent()
    approved(bastion, agent)
    bastion.kill_daemon()
    bastion.start_daemon()
    bastion.unlock()
    other = bastion.agent()
    approved(bastion, other)
    other.close()
    wait_for(lambda: bastion.op("sessions") == [], 30)
    card, rid = first_card(bastion, agent)
    assert card["reason"] == "gateway_restarted", card
    bastion.answer(card, True)
    assert agent.wait(rid).rc == 0
    newcomer = bastion.agent()
    card, rid = first_card(bastion, newcomer)
    assert card["reason"] is None, card
    bastion.answer(card, False)
    assert newcomer.wait(rid).code == "SESSION_DENIED"


# -- (c) the run's own process execs -------------------------------------------------------


def test_a_run_whose_process_execs_hears_process_changed(bastion: Bastion) -> None:
    """The registered run's own process execs (same pid, same python3): its next card says
    `process_changed`; the control: before the exec, no card at all."""
    agent = Agent(
        bastion.config,
        launcher=(
            sys.executable,
            "-c",
            REGISTER_THEN_EXEC,
            str(bastion.home.agent_socket),
            str(HELPER),
        ),
    )
    bastion.agents.append(agent)
    card = approved(bastion, agent)
    assert (card["subject"]["kind"], card["subject"]["run"]) == ("registered run", "self-run")
    assert card["reason"] is None, card
    assert agent.run("true").rc == 0  # the control: approved, no new card
    agent.exec([sys.executable, str(HELPER)])
    card, rid = first_card(bastion, agent)
    assert card["subject"]["run"] == "self-run"
    assert card["reason"] == "process_changed", card
    bastion.answer(card, False)
    assert agent.wait(rid).code == "SESSION_DENIED"


# -- (d) withdrawn, never denied -------------------------------------------------------------


def test_a_card_whose_agent_exited_is_announced_withdrawn(bastion: Bastion) -> None:
    """The agent is killed while its card waits: the watch stream's `closed` event is
    `withdrawn_gone` and says the agent exited; no notice calls it denied. The control: a
    card the operator declines is announced as denied."""
    with watching(bastion) as events:
        agent = bastion.agent()
        card, rid = first_card(bastion, agent)
        next_event(events, "card", card["id"])
        agent.close()
        closed = next_event(events, "closed", card["id"])
        assert closed["answer"] == "withdrawn_gone", closed
        assert closed["why"] == "agent_exited", closed
        notice = next_event(events, "notice", card["request_id"])
        assert "denied" not in notice["text"] and "SESSION_DENIED" not in notice["text"], notice
        assert "withdrawn" in notice["text"] and "exited" in notice["text"], notice
        state = json.loads(bastion.cli("request", card["request_id"], "--json").stdout)
        assert (state["state"], state["withdrawn"]) == ("denied", "agent_exited"), state

        declined = bastion.agent()
        card, rid = first_card(bastion, declined)
        next_event(events, "card", card["id"])
        bastion.answer(card, False)
        assert next_event(events, "closed", card["id"])["answer"] == "declined"
        notice = next_event(events, "notice", card["request_id"])
        assert "denied SESSION_DENIED" in notice["text"], notice  # the control
        assert declined.wait(rid).code == "SESSION_DENIED"


def test_a_card_whose_connection_closed_is_announced_withdrawn(bastion: Bastion) -> None:
    """The agent's ssh is killed while its card waits (the agent lives on): withdrawn,
    because the connection closed."""
    with watching(bastion) as events:
        agent = bastion.agent()
        card, rid = first_card(bastion, agent)
        next_event(events, "card", card["id"])
        ssh = [p for p in _children(agent.pid) if _comm(p) == "ssh"]
        assert ssh, "the agent's ssh is not running"
        for pid in ssh:
            Path(f"/proc/{pid}").exists() and _kill(pid)
        closed = next_event(events, "closed", card["id"])
        assert (closed["answer"], closed["why"]) == ("withdrawn_gone", "connection_closed"), closed
        notice = next_event(events, "notice", card["request_id"])
        assert "denied" not in notice["text"] and "connection closed" in notice["text"], notice
        agent.wait(rid)


def test_a_card_withdrawn_by_a_lock_is_announced_withdrawn(bastion: Bastion) -> None:
    with watching(bastion) as events:
        agent = bastion.agent()
        card, rid = first_card(bastion, agent)
        next_event(events, "card", card["id"])
        bastion.op("lock")
        closed = next_event(events, "closed", card["id"])
        assert (closed["answer"], closed["why"]) == ("withdrawn_locked", "vault_locked"), closed
        notice = next_event(events, "notice", card["request_id"])
        assert "denied" not in notice["text"] and "vault locked" in notice["text"], notice
        assert agent.wait(rid).code == "VAULT_LOCKED"  # what the agent reads is unchanged


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids = (task / "children").read_text().split()
        for kid in kids:
            out += [int(kid), *_children(int(kid))]
    return out


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _kill(pid: int) -> None:
    import os
    import signal

    os.kill(pid, signal.SIGKILL)
