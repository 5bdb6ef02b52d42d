"""`bastion approve` driven through a real pseudo-terminal (issue 3, acceptance 10)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bastion.cli.promptkeys import GUARD
from bastion.devtools.sshd_fixture import SshdInfo
from tests.harness import Bastion, Terminal, make_bastion, policy_toml


@pytest.fixture
def prompt(bastion: Bastion) -> Iterator[Terminal]:
    term = Terminal(
        [sys.executable, "-m", "bastion.cli", "--home", str(bastion.home.root), "approve"]
    )
    term.expect("waiting for cards")
    yield term
    term.close()


def test_approve_and_decline_by_keystroke_with_details(bastion: Bastion, prompt: Terminal) -> None:
    agent = bastion.agent()
    rid = agent.start("echo approved-by-key")
    prompt.expect("session approval")
    prompt.expect(f"pid {agent.pid}")
    prompt.expect("approve? [y/n then Enter")
    time.sleep(GUARD + 0.2)  # keys within the guard of a new card are ignored
    prompt.type("d")
    details = prompt.expect("approve? [y/n then Enter")
    assert "process chain" in details and "exe sha256" in details and str(agent.pid) in details
    prompt.answer("y")
    prompt.expect("approved")
    assert agent.wait(rid).stdout == b"approved-by-key\n"

    other = bastion.agent()
    rid = other.start("echo never")
    prompt.expect(f"pid {other.pid}")
    prompt.answer("n")
    prompt.expect("denied")
    r = other.wait(rid)
    assert r.code == "SESSION_DENIED" and r.stdout == b""


def test_notices_have_no_button_and_restarts_are_survived(
    bastion: Bastion, prompt: Terminal
) -> None:
    bastion.cli("lock")
    r = bastion.agent().run("echo locked")
    assert r.code == "VAULT_LOCKED"
    screen = prompt.expect("notice: denied VAULT_LOCKED")
    assert "approve?" not in screen

    bastion.stop_daemon()
    prompt.expect("lost the gateway")
    bastion.start_daemon()
    prompt.expect("reconnected to a restarted gateway")
    bastion.unlock()
    agent = bastion.agent()
    rid = agent.start("echo after-restart")
    prompt.expect("approve? [y/n then Enter")
    prompt.answer("y")
    assert agent.wait(rid).stdout == b"after-restart\n"


def test_a_withdrawn_card_is_announced(bastion: Bastion, prompt: Terminal) -> None:
    agent = bastion.agent()
    agent.start("echo gone")
    prompt.expect("approve? [y/n then Enter")
    agent.close()
    prompt.expect("withdrawn: its agent exited")
    time.sleep(GUARD + 0.2)  # the card on screen changed: keys wait out the guard
    prompt.type("q")
    assert prompt.proc.wait(10) == 0


def test_a_and_s_show_the_views_rows_in_the_prompt(bastion: Bastion, prompt: Terminal) -> None:
    """The rows of `bastion audit activity` and `bastion sessions`, on a key, at the
    prompt's width; the control is the same rows from the CLI."""
    agent = bastion.agent()
    rid = agent.start("echo seen-in-activity")
    prompt.expect("session approval")
    prompt.answer("y")
    assert agent.wait(rid).stdout == b"seen-in-activity\n"
    session = bastion.op("sessions")[0]["id"]
    assert session in bastion.cli("sessions").stdout
    time.sleep(GUARD + 0.2)
    prompt.type("s")
    assert session in prompt.expect("live sessions:" and session)
    time.sleep(GUARD + 0.2)
    prompt.type("a")
    screen = prompt.expect("echo seen-in-activity")
    assert "last 5 requests:" in screen and "@web1" in screen
    every = bastion.op("audit", view="activity")
    assert bastion.op("audit", view="activity", last=1) == every[-1:] and every


@pytest.fixture
def presence_account(
    tmp_path: Path, sshd: SshdInfo, client_key: tuple[Path, str]
) -> Iterator[Bastion]:
    """An account with `presence = "required"`, the console off: nothing here can
    approve its cards (issue 34)."""
    policy = policy_toml(sshd, presence="required")
    b = make_bastion(tmp_path, sshd, client_key[0], policy=policy)
    try:
        yield b
    finally:
        b.close()


def test_the_prompt_can_deny_a_presence_card_but_not_approve_it(
    presence_account: Bastion,
) -> None:
    """A yes at the terminal is refused and the card stays on screen, with where to approve
    it; n denies it. The control is the first test here: the same keys approve a card of
    an account without presence."""
    b = presence_account
    term = Terminal([sys.executable, "-m", "bastion.cli", "--home", str(b.home.root), "approve"])
    try:
        term.expect("waiting for cards")
        agent = b.agent()
        rid = agent.start("echo never")
        card = term.expect("approve? [y/n then Enter")
        assert "approve it in the console" in card, card
        time.sleep(GUARD + 0.2)  # keys within the guard of a new card are ignored
        term.answer("y")
        term.expect("presence-signed approval")
        term.expect("approve? [y/n then Enter")  # asked again: the card is still open
        assert len(b.op("pending", wait=0)) == 1
        time.sleep(GUARD + 0.2)
        term.answer("n")
        term.expect("denied")
        assert agent.wait(rid).code == "SESSION_DENIED"
    finally:
        term.close()
