"""Attacks on presence-signed approvals that must fail (issue 34), each with its control.

Every attacker here is what the issue names: a process of the operator's uid, outside
every run, with the operator socket, `bastion decide`, the console's cookie and CSRF
token, a page of its own on another loopback port, a clone of the authenticator's key,
or the journal's files. Each test first shows the attack refused and nothing sent to
the target (a marker file the command would make stays absent), then the same card
approved the honest way, and the command run: the refusal has teeth.
"""

from __future__ import annotations

import http.server
import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bastion import journal
from bastion.core.events import EventType
from bastion.core.presence import Proof, approval_challenge, b64url, unb64url
from bastion.journal import IDENTITY_LABEL
from bastion.ops import unlocked
from bastion.ops.opsock import OperatorError
from bastion.vault import Vault
from tests.browser_helper import (
    Browser,
    Enrolment,
    Stolen,
    approve,
    browser,
    card_element,
    enroll,
    first_command,
    free_port,
    log_in,
    next_card,
    register,
)
from tests.harness import PASSPHRASE, Bastion, wait_for
from tests.soft_authenticator import SoftAuthenticator

Console = tuple[Bastion, str, Browser]
# A signature made on whatever page the browser is on: the options the gateway gave,
# the browser's own WebAuthn call, the answer as JSON.
SIGN_HERE = """
const [options, done] = arguments;
const publicKey = PublicKeyCredential.parseRequestOptionsFromJSON(options);
navigator.credentials.get({ publicKey })
  .then((c) => done(c.toJSON()), (e) => done({ error: e.message }));
"""


def pending_ids(b: Bastion) -> set[str]:
    return {c["id"] for c in b.op("pending", wait=0)}


def marked_card(b: Bastion, web: Browser, marker: Path) -> tuple[int, dict[str, Any]]:
    """An agent's `touch MARKER` waiting on its command card (its session approved)."""
    agent = b.agent()
    rid = first_command(b, web, agent, f"touch {marker}")
    card = next_card(b, "command")
    card_element(web, card["id"])
    return rid, card


def honest_approval(b: Bastion, web: Browser, rid: int, card: dict[str, Any], marker: Path) -> None:
    """The control: the console's own page, a real signature: the command runs."""
    approve(web, card["id"])
    result = b.agents[-1].wait(rid)
    assert result.rc == 0, result.stderr
    assert marker.exists()


def test_a_same_uid_process_cannot_approve_without_a_signature(
    console: Console, tmp_path: Path
) -> None:
    b, origin, web = console
    marker = tmp_path / "ran"
    rid, card = marked_card(b, web, marker)
    # the operator socket, as any process of the uid outside every run reaches it
    with pytest.raises(OperatorError, match=f"approve it in the console \\({origin}/"):
        b.op("answer", card=card["id"], approve=True)
    # `bastion decide`, the operator's own command
    decided = b.cli("decide", card["id"], "approve", check=False)
    assert decided.returncode != 0 and "presence-signed approval" in decided.stderr
    # the console's HTTP API, with the browser's cookie and CSRF token but no signature
    thief = Stolen.from_browser(web, origin)
    status, said = thief.request("POST", f"/api/cards/{card['id']}/approve", {})
    assert status == 409 and "presence-signed approval" in said["error"], said
    # ... nor with a signature by a key of its own over the right challenge
    status, ask = thief.request("POST", f"/api/cards/{card['id']}/challenge", {})
    assert status == 200, ask
    own = SoftAuthenticator()
    forged = own.sign(unb64url(ask["options"]["challenge"]), origin)
    status, said = thief.request(
        "POST", f"/api/cards/{card['id']}/sign", {"nonce": ask["nonce"], "assertion": forged}
    )
    assert status == 409 and "not enrolled" in said["error"], said
    assert card["id"] in pending_ids(b) and not marker.exists()
    honest_approval(b, web, rid, card, marker)


def test_the_console_answers_only_its_own_page(console: Console) -> None:
    """Host, Origin, login and CSRF token, each checked; the page loads nothing from
    elsewhere and its cookie is HttpOnly, SameSite=Strict. The control: all four right,
    the same request is served."""
    b, origin, web = console
    agent = b.agent()
    rid = agent.start("echo never")
    card = next_card(b, "session")
    thief = Stolen.from_browser(web, origin)
    deny = f"/api/cards/{card['id']}/deny"
    for headers, status in (
        ({"Host": "attacker.example:80"}, 421),  # a DNS-rebinding page names its own host
        ({"Origin": None}, 403),
        ({"Origin": "http://localhost:1"}, 403),
        ({"X-CSRF-Token": None}, 403),
        ({"X-CSRF-Token": "guessed"}, 403),
        ({"Cookie": None}, 401),
    ):
        got, said = thief.request("POST", deny, {}, headers)
        assert got == status, (headers, said)
    assert card["id"] in pending_ids(b)
    got, said = thief.request("POST", deny, {})  # the control: every check right
    assert got == 200 and said["approved"] is False, said
    assert agent.wait(rid).code == "SESSION_DENIED"
    cookie = web.driver.get_cookie("bastion_console")
    assert cookie is not None and cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    assert "domain" not in cookie or cookie["domain"] == "localhost"
    page = web.driver.page_source
    assert "http://" not in page and "https://" not in page  # no CDN, nothing from elsewhere
    status, _ = thief.request("GET", "/", headers={"Cookie": None})
    assert status == 200


def test_a_signature_for_one_card_approves_no_other_and_only_once(console: Console) -> None:
    b, _, web = console
    first, second = b.agent(), b.agent()
    rid_a = first.start("echo card-a")
    card_a = next_card(b, "session")
    rid_b = second.start("echo card-b")
    wait_for(lambda: len(pending_ids(b)) == 2, 30)
    card_b = next(c for c in b.op("pending", wait=0) if c["id"] != card_a["id"])
    got = web.script(
        """
        const [a, b, done] = arguments;
        (async () => {
          const out = {};
          const tryIt = async (key, card, body) => {
            try { await call("POST", `/api/cards/${card}/sign`, body); out[key] = "accepted"; }
            catch (e) { out[key] = e.message; }
          };
          const askA = await call("POST", `/api/cards/${a}/challenge`, {});
          const signedA = await assertion(askA.options);
          await tryIt("a_nonce_for_b", b, { nonce: askA.nonce, assertion: signedA });
          const askB = await call("POST", `/api/cards/${b}/challenge`, {});
          await tryIt("a_signature_for_b", b, { nonce: askB.nonce, assertion: signedA });
          await tryIt("a_for_a", a, { nonce: askA.nonce, assertion: signedA });
          await tryIt("a_again", a, { nonce: askA.nonce, assertion: signedA });
          done(out);
        })().catch((e) => done({ error: e.message }));
        """,
        card_a["id"],
        card_b["id"],
    )
    assert "no outstanding challenge" in got["a_nonce_for_b"], got
    assert "its challenge is not this card's" in got["a_signature_for_b"], got
    assert got["a_for_a"] == "accepted", got  # the control: A's signature approves A
    assert "no pending card" in got["a_again"], got  # replayed after it ended
    assert card_b["id"] in pending_ids(b)
    b.answer(card_b, False)
    assert second.wait(rid_b).code == "SESSION_DENIED"
    b.answer(next_card(b, "command"), False)
    first.wait(rid_a)


class _Page(http.server.BaseHTTPRequestHandler):
    """Another loopback port's page, served by a process of the operator's uid."""

    def do_GET(self) -> None:
        body = b"<!doctype html><title>not the console</title><p>hello"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def other_origin() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), _Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://localhost:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_page_on_another_origin_cannot_make_a_signature_that_counts(
    console: Console, tmp_path: Path, other_origin: str
) -> None:
    b, origin, web = console
    marker = tmp_path / "ran"
    rid, card = marked_card(b, web, marker)
    thief = Stolen.from_browser(web, origin)
    status, ask = thief.request("POST", f"/api/cards/{card['id']}/challenge", {})
    assert status == 200, ask
    web.get(f"{other_origin}/")
    # the page's own request to the console: the browser sends the cookie (another port
    # is the same site), and the console refuses it by its Origin -- even a deny (the
    # browser then withholds the answer from the page: the console's resource policy)
    web.script(
        """
        const [url, done] = arguments;
        fetch(url, { method: "POST", credentials: "include", mode: "no-cors",
                     headers: { "Content-Type": "text/plain" }, body: "{}" })
          .then(() => done("sent"), (e) => done(e.message));
        """,
        f"{origin}/api/cards/{card['id']}/deny",
    )
    assert card["id"] in pending_ids(b)
    # the operator is got to touch the key on that page: a real signature, but made there
    signed = web.script(
        SIGN_HERE,
        ask["options"],
    )
    assert "error" not in signed, signed
    status, said = thief.request(
        "POST", f"/api/cards/{card['id']}/sign", {"nonce": ask["nonce"], "assertion": signed}
    )
    assert status == 409 and "another origin" in said["error"], said
    assert card["id"] in pending_ids(b) and not marker.exists()
    web.get(f"{origin}/")
    web.find("#app")
    honest_approval(b, web, rid, card, marker)


def test_enrolling_needs_the_passphrase_and_the_page_s_code(
    presence_bastion: tuple[Bastion, str], web: Browser
) -> None:
    b, origin = presence_bastion
    web.authenticator()
    wrong = b.cli(
        "operator",
        "enroll",
        "--name",
        "mallory",
        "--passphrase-stdin",
        "--no-open",
        stdin="not the passphrase\n",
        check=False,
        timeout=120,
    )
    assert wrong.returncode != 0 and "wrong passphrase" in wrong.stderr, wrong
    assert "enroll#" not in wrong.stdout
    with pytest.raises(OperatorError, match="wrong passphrase"):
        b.op("operator_enroll", passphrase="bm9wZQ==", signer_name="mallory")
    # a registration whose code is not the one its page showed is not kept
    enrolment = Enrolment(b, "mallory")
    try:
        shown = register(web, enrolment.url)
        done = enrolment.finish("000-000" if shown != "000-000" else "111-111")
    finally:
        enrolment.close()
    assert done.returncode != 0 and "not the code" in done.stderr, done.stderr
    assert b.op("operator_list") == []
    # a token nobody was given
    thief = Stolen(origin, "")
    status, said = thief.request("POST", "/api/enroll/options", {"token": "made-up"})
    assert status == 409 and "unknown" in said["error"], said
    # the control: the passphrase and the code, and it is enrolled
    got = enroll(b, web, "alice", origin)
    assert "enrolled 'alice'" in got["out"]
    assert [c["name"] for c in b.op("operator_list")] == ["alice"]


def test_a_removed_signer_signs_nothing(
    presence_bastion: tuple[Bastion, str], tmp_path: Path, chromium: None
) -> None:
    b, origin = presence_bastion
    marker = tmp_path / "ran"
    with browser() as alice, browser() as bob:
        for web, name in ((alice, "alice"), (bob, "bob")):
            web.authenticator()
            enroll(b, web, name, origin)
            log_in(web, origin)
        rid, card = marked_card(b, bob, marker)
        alice_id = next(c["id"] for c in b.op("operator_list") if c["name"] == "alice")
        removed = b.cli(
            "operator",
            "remove",
            "alice",
            "--passphrase-stdin",
            stdin=PASSPHRASE + "\n",
            timeout=120,
        )
        assert "removed 'alice'" in removed.stdout
        alice.find("#login")  # her login ended with her signer, at once
        # her authenticator still holds the key: a signature by it is refused
        thief = Stolen.from_browser(bob, origin)
        status, ask = thief.request("POST", f"/api/cards/{card['id']}/challenge", {})
        options = ask["options"] | {"allowCredentials": [{"type": "public-key", "id": alice_id}]}
        signed = alice.script(
            SIGN_HERE,
            options,
        )
        assert "error" not in signed, signed
        status, said = thief.request(
            "POST", f"/api/cards/{card['id']}/sign", {"nonce": ask["nonce"], "assertion": signed}
        )
        assert status == 409 and "not enrolled" in said["error"], said
        assert card["id"] in pending_ids(b) and not marker.exists()
        honest_approval(b, bob, rid, card, marker)  # the control: bob's key, still enrolled


def test_a_cloned_authenticator_is_refused_and_named_by_audit_verify(
    console: Console, tmp_path: Path
) -> None:
    """A copy of the key with its counter behind the original's: refused, and `audit
    verify` names the refusal. The control: the counter ahead again, and it signs."""
    b, _, web = console
    marker = tmp_path / "ran"
    rid, card = marked_card(b, web, marker)
    authenticator = web.authenticators[0]
    (original,) = web.credentials(authenticator)

    def put(count: int) -> None:
        web.cdp(
            "WebAuthn.removeCredential",
            authenticatorId=authenticator,
            credentialId=original["credentialId"],
        )
        web.cdp(
            "WebAuthn.addCredential",
            authenticatorId=authenticator,
            credential=original | {"signCount": count},
        )

    put(0)  # the clone: behind every count the gateway has seen
    approve(web, card["id"])
    error = web.find(f'[data-card="{card["id"]}"] .card-error')
    assert "sign counter did not rise" in error.text, error.text
    assert card["id"] in pending_ids(b) and not marker.exists()
    verified = b.cli("audit", "verify")
    assert "intact" in verified.stdout and "sign counter did not rise" in verified.stdout
    put(original["signCount"] + 100)
    honest_approval(b, web, rid, card, marker)


def test_a_forged_or_edited_approval_record_is_named_by_audit_verify(
    console: Console, tmp_path: Path
) -> None:
    b, origin, web = console
    marker = tmp_path / "ran"
    rid, card = marked_card(b, web, marker)
    honest_approval(b, web, rid, card, marker)
    cred = b.op("operator_list")[0]
    b.stop_daemon()
    verified = b.cli("audit", "verify")  # the control: the real journal holds
    assert "intact" in verified.stdout, verified.stdout
    # edited: one byte of a signature in the journal's files
    edited = tmp_path / "edited"
    shutil.copytree(b.home.journal, edited)
    for segment in sorted(edited.glob("*.jsonl")):
        lines = segment.read_text().splitlines(keepends=True)
        for i, line in enumerate(lines):
            rec = json.loads(line)
            if rec["type"] == "presence_signed":
                sig = rec["meta"]["proof"]["signature"]
                rec["meta"]["proof"]["signature"] = (
                    sig[:5] + ("A" if sig[5] != "A" else "B") + sig[6:]
                )
                lines[i] = json.dumps(rec, separators=(",", ":")) + "\n"
                break
        else:
            continue
        segment.write_text("".join(lines))
        break

    out = b.cli("audit", "verify", "--journal", str(edited), check=False)
    assert out.returncode == 1 and "edited" in out.stdout, out.stdout
    assert "presence: seq" in out.stdout and "signature does not verify" in out.stdout
    # forged: a whole, well-chained, vouched lifetime written by someone with the passphrase
    # (the journal identity) but not the authenticator: its approval claims alice signed
    with unlocked(Vault.open(b.home.vault), PASSPHRASE.encode()) as vault:
        identity_key = vault.private_key(IDENTITY_LABEL).pyca_key
        pin = journal.read_identity(b.home.journal)
        forger = journal.Journal(b.home.journal, pin, "boot_forged")
        forger.open()
        forger.append(
            EventType.CONSOLE_STARTED,
            {"origin": origin, "rp_id": "localhost"},
            {},
        )
        forger.append(
            EventType.CARD_RAISED,
            {"request_id": "req_f", "card": "cc_f", "kind": "command", "presence": 1},
            {},
        )
        # its counter ahead of the real one: only the signature itself can give it away
        fake = SoftAuthenticator(signer_id=unb64url(cred["id"]), count=10**6)
        nonce = b"n" * 32
        proof = Proof.from_browser(fake.sign(approval_challenge("d" * 64, nonce, None), origin))
        forger.append(
            EventType.PRESENCE_SIGNED,
            {
                "request_id": "req_f",
                "card": "cc_f",
                "signer": cred["id"],
                "card_digest": "d" * 64,
                "nonce": b64url(nonce),
                "grant": None,
                "proof": proof.as_json(),
            },
            {},
        )
        forger.append(
            EventType.CARD_CLOSED,
            {"request_id": "req_f", "card": "cc_f", "kind": "command", "answer": "approved"},
            {},
        )
        forger.vouch(identity_key)
        forger.close()
    out = b.cli("audit", "verify", check=False)
    assert out.returncode == 1, out.stdout
    assert "signature on card cc_f" in out.stdout and "does not verify" in out.stdout, out.stdout
    assert "card cc_f is recorded approved with 0 valid presence signature(s)" in out.stdout


def test_a_process_that_sees_the_enrolment_url_cannot_enroll_its_own_authenticator(
    presence_bastion: tuple[Bastion, str], chromium: None
) -> None:
    """The URL is in the browser's argv, which the uid can read. A process that takes it
    registers its own authenticator first and knows its page's code; keeping it still
    takes the passphrase, and the operator, whose page could not register, has no code
    to type. The control: the operator's own enrolment, with both, keeps theirs."""
    b, origin = presence_bastion
    enrolment = Enrolment(b, "alice")
    try:
        with browser() as mallory, browser() as alice:
            mallory.authenticator()
            code = register(mallory, enrolment.url)  # the thief's page, first
            for passphrase in (None, "d3Jvbmc="):  # none, and a wrong one
                args = {"token": enrolment.token, "code": code}
                if passphrase is not None:
                    args["passphrase"] = passphrase
                with pytest.raises(OperatorError):
                    b.op("operator_enroll_confirm", **args)
            alice.authenticator()
            alice.get(enrolment.url)
            alice.find("#enroll-button").click()
            assert "already registered" in alice.find("#notice").text
        done = enrolment.finish("")  # alice's page showed no code: she has none to type
    finally:
        enrolment.close()
    assert done.returncode != 0 and "not the code" in done.stderr, done.stderr
    assert b.op("operator_list") == []
    with browser() as alice:
        alice.authenticator()
        assert "enrolled 'alice'" in enroll(b, alice, "alice", origin)["out"]
    assert [s["name"] for s in b.op("operator_list")] == ["alice"]
