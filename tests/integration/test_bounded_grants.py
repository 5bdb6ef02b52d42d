"""Bounded grants end to end (issue 22, acceptance 5): the real ssh client, a real
sshd, a gateway process, and the operator's own CLI (`bastion decide --grant`).

The fixture sshd has no systemd, so `echo restart NAME` stands in for `systemctl
restart NAME` (the pattern `echo restart *`): the same shape, a harmless command.
Nobody answers a card unless the test does, so a command that raised one would end
APPROVAL_TIMEOUT or NO_APPROVER: a command that completes was covered by the grant.
"""

from __future__ import annotations

import io
import json
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bastion import journal
from bastion.cli.promptkeys import GUARD
from bastion.devtools.sshd_fixture import SshdInfo
from tests.harness import Agent, Bastion, Terminal, make_bastion, policy_toml, run_agent


@pytest.fixture
def granting(tmp_path: Path, sshd: SshdInfo, client_key: tuple[Path, str]) -> Iterator[Bastion]:
    """A gateway whose one account is per-command with `grants = true`; the card timeout
    is short, since an unanswered card is how a test sees that a card was raised."""
    policy = policy_toml(sshd, approval="per-command", grants=True)
    b = make_bastion(tmp_path, sshd, client_key[0], policy=policy, start=False)
    b.daemon_args = ("--approval-timeout", "8")
    b.start_daemon()
    b.unlock()
    try:
        yield b
    finally:
        b.close()


def first_command(b: Bastion, agent: Agent, command: str, *grant: str) -> dict[str, Any]:
    """Run `command` as the agent's first: its session card yes, then its command card
    yes with `bastion decide ... --grant` (when `grant` is given); returns the card."""
    rid = agent.start(command)
    assert b.approve_next()["kind"] == "session"
    card = b.next_card()
    assert card["kind"] == "command" and card.get("grantable") is True, card
    if grant:
        out = b.cli("decide", card["id"], "approve", *grant).stdout
        assert "grant grt_" in out, out
    else:
        b.answer(card, True)
    result = agent.wait(rid)
    assert result.rc == 0, result.stderr
    return card


def covered(b: Bastion, agent: Agent, command: str) -> None:
    """The command runs to its end with no card: `pending` stays empty throughout."""
    rid = agent.start(command)
    result = agent.wait(rid, timeout=60)
    assert result.rc == 0, result.stderr
    assert result.stdout.decode().strip() == command.removeprefix("echo ")
    assert b.op("pending") == []


def carded(b: Bastion, agent: Agent, command: str) -> dict[str, Any]:
    """The command raises a command card; the test denies it and nothing runs."""
    rid = agent.start(command)
    card = b.next_card()
    assert card["kind"] == "command", card
    b.answer(card, False)
    result = agent.wait(rid)
    assert result.code == "CALL_DENIED", result.stderr
    return card


def live_grants(b: Bastion) -> list[dict[str, Any]]:
    return [g for s in json.loads(b.cli("sessions", "--json").stdout) for g in s["grants"]]


def test_a_grant_of_two_uses_covers_two_matching_commands_and_no_more(granting: Bastion) -> None:
    b = granting
    agent = b.agent()
    card = first_command(b, agent, "echo restart a", "--grant", "echo restart *", "--uses", "2")
    (grant,) = live_grants(b)
    assert grant["pattern"] == "echo restart *" and grant["uses_left"] == 2
    assert grant["card"] == card["id"] and grant["expires_at"] is None
    covered(b, agent, "echo restart b")
    assert live_grants(b)[0]["uses_left"] == 1
    covered(b, agent, "echo restart c")
    assert live_grants(b) == []  # used up
    carded(b, agent, "echo restart d")  # the third raises a card
    # The journal: the grant made once, and each use with its id on the request's records.
    records = list(journal.records(b.home.journal))
    (made,) = [r for r in records if r.type == "grant_made"]
    assert made.meta["grant"] == grant["id"] and made.meta["card"] == card["id"]
    used = [r.meta for r in records if r.type == "grant_used"]
    assert [u["grant"] for u in used] == [grant["id"]] * 2
    # The gateway's log names the grant by its id, never its pattern (command text).
    log = b.log.read_text()
    assert grant["id"] in log and "restart *" not in log
    intents = {r.meta["request_id"]: r.meta for r in records if r.type == "dispatch_started"}
    assert all(intents[u["request_id"]]["grant"] == grant["id"] for u in used)
    rows = {r["request_id"]: r for r in b.op("audit", view="activity")}
    assert sorted(rows[u["request_id"]]["command"] for u in used) == [
        "echo restart b",
        "echo restart c",
    ]
    assert all(rows[u["request_id"]]["outcome"] == "completed" for u in used)


def test_shell_source_and_other_argv_raise_cards_under_a_live_grant(granting: Bastion) -> None:
    b = granting
    agent = b.agent()
    first_command(b, agent, "echo restart a", "--grant", "echo restart *", "--minutes", "10")
    carded(b, agent, "echo restart x; id")  # shell source: never covered
    carded(b, agent, "echo stop x")  # another argv
    carded(b, agent, "echo restart x y")  # one * is one word
    covered(b, agent, "echo restart x")  # the control: the grant is still live
    (grant,) = live_grants(b)
    assert grant["uses_left"] is None and grant["expires_at"] is not None


def test_locking_the_vault_ends_the_grant(granting: Bastion) -> None:
    b = granting
    agent = b.agent()
    first_command(b, agent, "echo restart a", "--grant", "echo restart *", "--uses", "5")
    covered(b, agent, "echo restart b")  # live before the lock: the control
    b.cli("lock")
    b.unlock()
    assert live_grants(b) == []
    rid = agent.start("echo restart c")
    assert b.next_card()["kind"] == "session"  # the session ended with the lock
    b.approve_next()
    card = b.next_card()  # and its grant with it: the command asks again
    assert card["kind"] == "command"
    b.answer(card, True)
    assert agent.wait(rid).rc == 0
    ended = [r.meta for r in journal.records(b.home.journal) if r.type == "grant_ended"]
    assert [e["reason"] for e in ended] == ["vault_state_changed"]


def test_without_a_grant_each_of_the_same_commands_raises_a_card(granting: Bastion) -> None:
    """The negative control: the same commands, the first answered yes alone."""
    b = granting
    agent = b.agent()
    first_command(b, agent, "echo restart a")
    assert live_grants(b) == []
    for command in ("echo restart b", "echo restart c", "echo restart x; id", "echo stop x"):
        carded(b, agent, command)


def test_a_grant_the_policy_or_the_card_does_not_allow_is_refused(
    tmp_path: Path, sshd: SshdInfo, client_key: tuple[Path, str]
) -> None:
    """An account without `grants = true`: `decide --grant` is refused, the card stays
    open (and a plain yes still answers it)."""
    b = make_bastion(tmp_path, sshd, client_key[0], policy_toml(sshd, approval="per-command"))
    try:
        agent = b.agent()
        rid = agent.start("echo restart a")
        b.approve_next()
        card = b.next_card()
        assert "grantable" not in card
        refused = b.cli(
            "decide", card["id"], "approve", "--grant", "echo restart *", "--uses", "2", check=False
        )
        assert refused.returncode != 0 and "does not allow grants" in refused.stderr
        assert [c["id"] for c in b.op("pending")] == [card["id"]]
        bad = b.cli("decide", card["id"], "approve", "--grant", "echo restart *", check=False)
        assert bad.returncode != 0 and "--uses and/or --minutes" in bad.stderr
        b.answer(card, True)
        assert agent.wait(rid).rc == 0
    finally:
        b.close()


def test_a_grant_is_for_its_run_alone(granting: Bastion) -> None:
    """Made for one `bastion run`, a grant covers that run's commands (each its own ssh
    process) and no other agent's: another run, and a process outside any run, ask."""
    b = granting
    run = run_agent(b, "--label", "granted")
    card = first_command(b, run, "echo restart a", "--grant", "echo restart *", "--uses", "5")
    assert card["subject"]["kind"] == "registered run", card["subject"]
    covered(b, run, "echo restart b")  # the control: its own run
    for other in (run_agent(b, "--label", "other"), b.agent()):
        rid = other.start("echo restart c")
        assert b.approve_next()["kind"] == "session"
        card = b.next_card()
        assert card["kind"] == "command", card
        b.answer(card, False)
        assert other.wait(rid).code == "CALL_DENIED"
    (grant,) = live_grants(b)
    assert grant["uses_left"] == 4


def keys(term: Terminal, *steps: tuple[str, str]) -> None:
    """Each key a read of its own, typed past the guard, and what it shows awaited."""
    for key, shown in steps:
        time.sleep(GUARD + 0.2)
        term.type(key)
        term.expect(shown)


def test_the_prompt_widens_a_yes_to_a_grant_one_key_a_step(granting: Bastion) -> None:
    """`bastion approve` in a real pty: g, the word to widen, Enter, the bound, Enter on
    the grant read back. The two uses run without cards, the third is carded. The
    control: the same card answered with y alone covers nothing after it."""
    term = Terminal(
        [sys.executable, "-m", "bastion.cli", "--home", str(granting.home.root), "approve"]
    )
    try:
        term.expect("waiting for cards")
        agent = granting.agent()
        rid = agent.start("echo restart a")
        term.expect("session approval")
        term.answer("y")
        term.expect("g widens a yes")
        keys(
            term,
            ("g", "a digit widens that word"),
            ("2", "pattern: echo restart *"),
            ("\r", "for: 1) 1 use"),
            ("2", "for 2 uses"),
            ("\r", "approved, with grant grt_"),
        )
        assert agent.wait(rid).rc == 0
        for name in ("b", "c"):
            covered(granting, agent, f"echo restart {name}")
        rid = agent.start("echo restart d")
        term.expect(granting.next_card()["id"])  # the third is carded, on the prompt's screen
        term.answer("n")
        assert agent.wait(rid).code == "CALL_DENIED"

        control = granting.agent()  # a process of its own: its yes is its own
        rid = control.start("echo restart x")
        term.expect("session approval")
        term.answer("y")
        term.expect("g widens a yes")
        term.answer("y")
        assert control.wait(rid).rc == 0
        carded(granting, control, "echo restart y")
    finally:
        term.close()


@pytest.fixture
def archive(tmp_path: Path) -> tuple[str, Path]:
    """`tar -C OUT -xf ARCHIVE` on the target (the fixture sshd's host is this machine):
    an archive of members `a` and `b`, and the empty directory they are extracted to."""
    out, path = tmp_path / "out", tmp_path / "members.tar"
    out.mkdir()
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        for name in ("a", "b"):
            data = f"member {name}\n".encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return f"tar -C {out} -xf {path}", out


def test_a_star_never_covers_an_option_word(
    granting: Bastion, archive: tuple[str, Path], tmp_path: Path
) -> None:
    """Issue 32 item 2: a grant's `*` matched option words, so `tar -C OUT -xf ARCHIVE *`
    ran `... '--to-command=touch MARKER'` (a command per member) without a card. As in
    `allow` and `preapproved` rules, a `*` matches no word that begins with `-`: the
    attack raises a card (denied here) and the marker never appears. The control: a
    member's name in the same place is covered and extracted. Widening a card's own
    option (`tar * OUT ...`) is refused with why, the card left open."""
    b = granting
    base, out = archive
    marker = tmp_path / "marker"
    agent = b.agent()
    first_command(b, agent, f"{base} a", "--grant", f"{base} *", "--uses", "2")
    assert (out / "a").read_text() == "member a\n"

    attack = f"'--to-command=touch {marker}'"
    rid = agent.start(f"{base} {attack}")
    cards = b.op("pending", wait=20)
    ran = agent.wait(rid) if not cards else None
    assert cards and not marker.exists(), f"covered by the grant: {ran}, marker {marker.exists()}"
    card = cards[0]
    assert card["kind"] == "command" and card["argv"][-1] == f"--to-command=touch {marker}"
    widened = base.replace("-C", "*", 1)  # the card's own option as a *: could never match
    refused = b.cli(
        "decide",
        card["id"],
        "approve",
        "--grant",
        f"{widened} {attack}",
        "--uses",
        "2",
        check=False,
    )
    assert refused.returncode != 0, refused.stdout
    assert "word 2 of the grant pattern cannot be *: -C is an option" in refused.stderr
    assert "keep the option as spelled" in refused.stderr
    assert [c["id"] for c in b.op("pending")] == [card["id"]]  # refused whole: still open
    b.answer(card, False)
    assert agent.wait(rid).code == "CALL_DENIED"
    assert not marker.exists()
    assert live_grants(b)[0]["uses_left"] == 2  # the attack took no use

    rid = agent.start(f"{base} b")  # the control: a plain word where the * stands
    result = agent.wait(rid, timeout=60)
    assert result.rc == 0, result.stderr
    assert (out / "b").read_text() == "member b\n" and b.op("pending") == []
    assert live_grants(b)[0]["uses_left"] == 1 and not marker.exists()


def test_the_prompt_keeps_the_cards_options_as_spelled(
    granting: Bastion, archive: tuple[str, Path]
) -> None:
    """`bastion approve` in a real pty: after g, the card's options are marked as staying;
    a digit on one widens nothing and says why; a digit on the member widens it."""
    base, out = archive
    term = Terminal(
        [sys.executable, "-m", "bastion.cli", "--home", str(granting.home.root), "approve"]
    )
    try:
        term.expect("waiting for cards")
        agent = granting.agent()
        rid = agent.start(f"{base} a")
        term.expect("session approval")
        term.answer("y")
        term.expect("g widens a yes")
        keys(
            term,
            ("g", "-C  (an option: stays as spelled)"),
            ("1", "word 1 cannot be *: -C is an option"),
            ("3", "word 3 cannot be *: -xf is an option"),
            ("5", f"pattern: {base} *"),
            ("\r", "for: 1) 1 use"),
            ("1", "for 1 use"),
            ("\r", "approved, with grant grt_"),
        )
        assert agent.wait(rid).rc == 0 and (out / "a").exists()
        (grant,) = live_grants(granting)
        assert grant["pattern"] == f"{base} *"
    finally:
        term.close()
