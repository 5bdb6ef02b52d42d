"""The console end to end (issue 34, acceptance 1): enroll with the CLI and the page,
log in, see a card a real `ssh` raised through a real gateway and sshd, approve it
with an assertion, see the command run and the approval in the activity."""

from __future__ import annotations

from tests.browser_helper import Browser, card_element, enroll, log_in, next_card
from tests.harness import Bastion


def rid_of(b: Bastion, command: str) -> str:
    """The request id of the one request for `command`, from `audit activity`."""
    rows = b.op("audit", view="activity")
    return next(r["request_id"] for r in rows if r["command"] == command)


def test_enroll_log_in_and_approve_a_card_raised_by_real_ssh(
    presence_bastion: tuple[Bastion, str], web: Browser
) -> None:
    b, origin = presence_bastion
    web.authenticator()
    got = enroll(b, web, "alice", origin)
    assert "enrolled 'alice'" in got["out"], got
    log_in(web, origin)
    agent = b.agent()
    rid = agent.start("echo presence-ok")
    session = card_element(web, b.next_card()["id"])
    session.find_element("css selector", ".approve").click()
    command = next_card(b, "command")
    el = card_element(web, command["id"])
    assert "presence required" in el.text.lower(), el.text
    el.find_element("css selector", ".approve").click()
    result = agent.wait(rid)
    assert result.rc == 0, result.stderr
    assert b"presence-ok" in result.stdout
    web.find('[data-tab="activity"]').click()
    row = web.find(f'#activity tr[data-request="{rid_of(b, "echo presence-ok")}"]')
    assert "completed (exit 0)" in row.text, row.text
