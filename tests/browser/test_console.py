"""The console end to end (issue 34, acceptance 1 and 2): Debian's headless Chromium with
its virtual authenticator, a real gateway, a real sshd, and the real `ssh` of an agent.

Enroll with the CLI and the page, log in, see a card the agent's ssh raised, approve it
with a signature, and see the command run and the approval in the activity and the
journal; the same for deny, lock, revoke, two approvers, and user verification.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from bastion.devtools.sshd_fixture import SshdInfo
from tests.browser_helper import (
    Browser,
    approve,
    browser,
    card_element,
    console_gateway,
    enroll,
    first_command,
    log_in,
    next_card,
)
from tests.harness import PASSPHRASE, Bastion


def rid_of(b: Bastion, command: str) -> str:
    """The request id of the one request for `command`, from `audit activity`."""
    rows = b.op("audit", view="activity")
    return next(r["request_id"] for r in rows if r["command"] == command)


def journal_types(b: Bastion) -> list[str]:
    out = b.cli("audit", "verify", "--json").stdout
    assert json.loads(out)["ok"], out
    from bastion import journal

    return [r.type for r in journal.records(b.home.journal)]


def test_a_card_raised_by_real_ssh_is_approved_by_a_signature_and_runs(
    console: tuple[Bastion, str, Browser],
) -> None:
    b, _, web = console
    agent = b.agent()
    rid = first_command(b, web, agent, "echo presence-ok")
    card = next_card(b, "command")
    el = card_element(web, card["id"])
    assert "Presence required: 1 signature" in el.text, el.text
    assert "echo" in el.text and "presence-ok" in el.text  # the argv, word by word
    approve(web, card["id"])
    result = agent.wait(rid)
    assert result.rc == 0, result.stderr
    assert b"presence-ok" in result.stdout
    web.find('[data-tab="activity"]').click()
    row = web.find(f'#activity tr[data-request="{rid_of(b, "echo presence-ok")}"]')
    assert "completed (exit 0)" in row.text, row.text
    activity = b.cli("audit", "activity", "--passphrase-stdin", stdin=PASSPHRASE + "\n")
    assert "echo presence-ok" in activity.stdout
    types = journal_types(b)
    assert types.count("presence_signed") == 2  # the session card's, the command card's
    assert "operator_enrolled" in types and "console_login" in types


def test_deny_in_the_console_ends_the_command_and_nothing_runs(
    console: tuple[Bastion, str, Browser], tmp_path: Path
) -> None:
    b, _, web = console
    marker = tmp_path / "ran"
    agent = b.agent()
    rid = first_command(b, web, agent, f"touch {marker}")
    card = next_card(b, "command")
    card_element(web, card["id"]).find_element("css selector", ".deny").click()
    result = agent.wait(rid)
    assert result.rc != 0 and result.code == "CALL_DENIED", result.stderr
    assert not marker.exists()
    web.gone(f'[data-card="{card["id"]}"]')


def test_lock_in_the_console_ends_approvals_and_the_login(
    console: tuple[Bastion, str, Browser],
) -> None:
    b, _, web = console
    agent = b.agent()
    rid = first_command(b, web, agent, "echo before-lock")
    card = next_card(b, "command")
    card_element(web, card["id"])
    web.find("#lock").click()
    result = agent.wait(rid)
    assert result.rc != 0, result.stderr  # its card was withdrawn: nothing ran
    assert b.op("status")["locked"] is True
    web.find("#login")  # a lock ends every login
    assert "vault is locked" in web.find("#login-words").text


def test_revoke_in_the_console_ends_the_session(console: tuple[Bastion, str, Browser]) -> None:
    b, _, web = console
    agent = b.agent()
    rid = first_command(b, web, agent, "echo one")
    approve(web, next_card(b, "command")["id"])
    assert agent.wait(rid).rc == 0
    web.find('[data-tab="sessions"]').click()
    session = b.op("sessions")[0]
    el = web.find(f'[data-session="{session["id"]}"]')
    assert "signed by alice" in el.text, el.text
    el.find_element("css selector", ".revoke").click()
    web.gone(f'[data-session="{session["id"]}"]')
    assert b.op("sessions") == []
    again = agent.start("echo two")  # a new session card: the revoked one is gone
    card = next_card(b, "session")
    assert card["reason"] == "revoked"
    b.answer(card, False)
    assert agent.wait(again).rc != 0


@pytest.fixture
def two_approvers(
    tmp_path: Path, sshd: SshdInfo, client_key: tuple[Path, str], chromium: None
) -> Iterator[tuple[Bastion, Browser, Browser]]:
    """`approvers = 2`: alice and bob, each in a browser of their own, both logged in."""
    b, origin = console_gateway(tmp_path, sshd, client_key[0], approvers=2)
    with browser() as alice, browser() as bob:
        for web, name in ((alice, "alice"), (bob, "bob")):
            web.authenticator(transport="usb")
            enroll(b, web, name, origin)
            log_in(web, origin)
        try:
            yield b, alice, bob
        finally:
            b.close()


def test_two_approvers_each_sign_and_the_names_show_as_they_arrive(
    two_approvers: tuple[Bastion, Browser, Browser],
) -> None:
    b, alice, bob = two_approvers
    agent = b.agent()
    rid = agent.start("echo two-signed")
    card = next_card(b, "session")
    approve(alice, card["id"])
    bob.until(lambda: "Signed: alice (1 of 2)" in card_element(bob, card["id"]).text)
    assert next_card(b, "session")["id"] == card["id"]  # one signature is not enough
    again = alice.find(f'[data-card="{card["id"]}"] .approve')
    again.click()  # alice once more: one signer is one approver
    alice.until(lambda: "already signed" in card_element(alice, card["id"]).text)
    approve(bob, card["id"])
    command = next_card(b, "command")
    approve(bob, command["id"])
    approve(alice, command["id"])
    result = agent.wait(rid)
    assert result.rc == 0, result.stderr
    assert b.op("sessions")[0]["signed_by"] == ["alice", "bob"]


def test_any_one_deny_ends_a_two_approver_card(
    two_approvers: tuple[Bastion, Browser, Browser],
) -> None:
    b, alice, bob = two_approvers
    agent = b.agent()
    rid = agent.start("echo never")
    card = next_card(b, "session")
    approve(alice, card["id"])
    bob.until(lambda: "Signed: alice" in card_element(bob, card["id"]).text)
    card_element(bob, card["id"]).find_element("css selector", ".deny").click()
    result = agent.wait(rid)
    assert result.rc != 0 and result.code == "SESSION_DENIED", result.stderr


@pytest.fixture
def verifying(
    tmp_path: Path, sshd: SshdInfo, client_key: tuple[Path, str], chromium: None
) -> Iterator[tuple[Bastion, str]]:
    b, origin = console_gateway(tmp_path, sshd, client_key[0], user_verification="required")
    try:
        yield b, origin
    finally:
        b.close()


def test_user_verification_required_refuses_a_touch_only_key(
    verifying: tuple[Bastion, str],
) -> None:
    """A security key that cannot verify its user (no PIN, no biometric) cannot approve
    an account that asks it; the control: a platform authenticator that does."""
    b, origin = verifying
    with browser() as touch_only, browser() as verified:
        touch_only.authenticator(transport="usb", user_verification=False)
        enroll(b, touch_only, "touch-key", origin)
        log_in(touch_only, origin)
        verified.authenticator(transport="internal", user_verification=True)
        enroll(b, verified, "laptop", origin)
        log_in(verified, origin)
        agent = b.agent()
        rid = agent.start("echo verified")
        card = next_card(b, "session")
        approve(touch_only, card["id"])
        touch_only.find(f'[data-card="{card["id"]}"] .card-error')
        assert next_card(b, "session")["id"] == card["id"]  # still pending
        approve(verified, card["id"])
        approve(verified, next_card(b, "command")["id"])
        assert agent.wait(rid).rc == 0


def test_screenshots_at_a_desk_and_a_phone_width(
    console: tuple[Bastion, str, Browser], chromium: None
) -> None:
    """Acceptance 2: the console with a command card waiting, at 1280x800 and at a phone's
    390x844, kept under tests/artifacts/ (look at them); at the phone's width nothing needs
    a sideways scroll and the buttons are a thumb's size."""
    b, _, web = console
    agent = b.agent()
    rid = first_command(b, web, agent, "systemctl restart --no-block app.service")
    card = next_card(b, "command")
    card_element(web, card["id"])
    shots = {}
    for name, width, height, mobile in (("desk", 1280, 800, False), ("phone", 390, 844, True)):
        metrics = {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": mobile}
        web.cdp("Emulation.setDeviceMetricsOverride", **metrics)
        shots[name] = web.screenshot(f"console-{width}x{height}")
        wide = web.driver.execute_script("return document.documentElement.scrollWidth")
        assert wide <= width, f"the page is {wide}px wide at {width}"
        for button in card_element(web, card["id"]).find_elements("css selector", "button"):
            assert button.size["height"] >= 40, button.text  # a thumb can press it
    web.find('[data-tab="activity"]').click()
    web.find("#activity tbody tr")
    shots["activity"] = web.screenshot("console-activity-390x844")
    web.cdp("Emulation.clearDeviceMetricsOverride")
    assert all(p.stat().st_size > 0 for p in shots.values())
    b.answer(card, False)
    agent.wait(rid)


@pytest.fixture
def granting(
    tmp_path: Path, sshd: SshdInfo, client_key: tuple[Path, str], web: Browser
) -> Iterator[tuple[Bastion, Browser]]:
    b, origin = console_gateway(tmp_path, sshd, client_key[0], grants=True)
    try:
        web.authenticator()
        enroll(b, web, "alice", origin)
        log_in(web, origin)
        yield b, web
    finally:
        b.close()


def test_a_bounded_grant_on_a_presence_account_is_signed_with_its_yes(
    granting: tuple[Bastion, Browser],
) -> None:
    """The grant is part of what is signed: the challenge commits to its pattern and
    bound, and the journal keeps them beside the signature."""
    b, web = granting
    agent = b.agent()
    rid = first_command(b, web, agent, "echo restart app1")
    card = next_card(b, "command")
    el = card_element(web, card["id"])
    el.find_element("css selector", ".grant-on").click()
    pattern = el.find_element("css selector", ".grant-pattern")
    pattern.clear()
    pattern.send_keys("echo restart *")
    el.find_element("css selector", ".grant-uses").send_keys("2")
    approve(web, card["id"])
    assert agent.wait(rid).rc == 0
    covered = agent.run("echo restart app2")  # no card: the signed grant covers it
    assert covered.rc == 0 and b"restart app2" in covered.stdout, covered.stderr
    from bastion import journal

    signed = [r.meta for r in journal.records(b.home.journal) if r.type == "presence_signed"]
    assert signed[-1]["grant"] == {"pattern": "echo restart *", "uses": 2, "minutes": None}
    sessions = b.cli("audit", "sessions", "--passphrase-stdin", stdin=PASSPHRASE + "\n")
    assert "signed by alice" in sessions.stdout, sessions.stdout
