"""Certificate accounts through the real gateway: the target's own sshd enforces the approval.

The target here trusts only the bastion vault's user CA and holds no authorized key at
all, so every command that runs proves a certificate was presented -- one signed for
that request, whose key id is the request id sshd logs, and whose serial the journal
keeps. (The certificate's own limits, checked by sshd with a certificate in hand, are
in test_certificate_enforcement.py.)
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bastion.ca import vault_ca
from bastion.devtools.sshd_fixture import Sshd, SshdInfo, login_certificates
from bastion.vault import Vault
from tests.harness import (
    CERT,
    Bastion,
    after_waiting,
    ca_bastion,
    journal_frozen,
    make_bastion,
)


@pytest.fixture
def cert_bastion(tmp_path: Path, ca_sshd: Sshd, client_key: tuple[Path, str]) -> Iterator[Bastion]:
    b = ca_bastion(tmp_path, ca_sshd, client_key[0], True, **CERT)
    try:
        yield b
    finally:
        b.close()


def _rows(b: Bastion) -> list[dict[str, Any]]:
    return [r for r in b.op("audit", view="activity") if r["command"] != "true"]


def test_an_approved_command_runs_with_exact_output_and_sshd_logs_its_request_and_serial(
    cert_bastion: Bastion, ca_sshd: Sshd
) -> None:
    b = cert_bastion
    agent = b.agent()
    rid = agent.start("printf 'out put\\n'; printf 'err\\n' >&2; exit 3")
    card = b.approve_next()
    assert card["kind"] == "session"
    first = agent.wait(rid)
    assert (first.rc, first.stdout, after_waiting(first.stderr, card)) == (3, b"out put\n", "err\n")
    second = agent.run("echo second")
    assert (second.rc, second.stdout) == (0, b"second\n")

    rows = _rows(b)
    assert [r["outcome"] for r in rows] == ["completed", "completed"]
    signer = vault_ca.public(Vault.open(b.home.vault).list_keys())["authorities"][-1]["fingerprint"]
    certs = [r["certificate"] for r in rows]
    for row, cert in zip(rows, certs, strict=True):
        assert cert["key_id"] == row["request_id"] and cert["ca"] == signer
    assert certs[0]["serial"] < certs[1]["serial"]  # monotonic, never reused
    # The target's own log ties each login to the request, by key id and serial.
    logged = login_certificates(ca_sshd.log_text())
    for cert in certs:
        assert (cert["key_id"], cert["serial"]) in logged
    # `bastion request ID` reads the same from the journal's plaintext.
    state = json.loads(b.cli("request", rows[0]["request_id"], "--json").stdout)
    assert state["certificate"]["serial"] == certs[0]["serial"]
    assert state["exit_status"] == 3


def test_per_command_approval_signs_exactly_the_approved_bytes(
    tmp_path: Path, ca_sshd: Sshd, client_key: tuple[Path, str]
) -> None:
    b = ca_bastion(
        tmp_path, ca_sshd, client_key[0], True, approval="per-command", shell="card", **CERT
    )
    try:
        agent = b.agent()
        command = "printf '%s|' \"a  b\" 'c'; echo $((6*7))"
        rid = agent.start(command)
        b.approve_next()  # the session
        card = b.approve_next()  # the command, shown as shell source
        assert card["kind"] == "command" and card["command"] == command
        result = agent.wait(rid)
        assert (result.rc, result.stdout) == (0, b"a  b|c|42\n")
        (row,) = _rows(b)
        assert row["certificate"]["key_id"] == row["request_id"]
    finally:
        b.close()


def test_a_vault_without_a_ca_is_a_policy_error_naming_the_account_and_nothing_is_sent(
    tmp_path: Path, ca_sshd: Sshd, client_key: tuple[Path, str]
) -> None:
    b = ca_bastion(tmp_path, ca_sshd, client_key[0], False, **CERT)
    try:
        before = len(ca_sshd.log_text())
        result = b.agent().run("echo should-not-run")
        assert result.rc == 77 and result.code == "POLICY_UNAVAILABLE", result.stderr
        message = result.error["message"]  # type: ignore[index]
        assert f"{b.sshd.user}@web1" in message and "bastion ca init" in message
        assert b.op("pending") == []  # no card for a login that cannot happen
        assert "Connection from" not in ca_sshd.log_text()[before:]  # nothing reached it
    finally:
        b.close()


def test_a_target_that_sees_another_source_address_refuses_and_nothing_runs(
    tmp_path: Path, ca_sshd: Sshd, client_key: tuple[Path, str]
) -> None:
    b = ca_bastion(
        tmp_path, ca_sshd, client_key[0], True, auth="certificate", source_address=["127.0.0.2"]
    )
    try:
        agent = b.agent()
        rid = agent.start("echo should-not-run")
        b.approve_next()
        result = agent.wait(rid)
        assert result.rc == 69 and result.code == "TARGET_AUTH_FAILED", result.stderr
        assert "source_address" in result.error["message"]  # type: ignore[index]
        assert b"should-not-run" not in result.stdout
        (row,) = _rows(b)
        assert row["outcome"] == "not_started" and row["certificate"]["serial"] >= 1
    finally:
        b.close()


def test_a_key_account_on_the_same_gateway_is_unchanged(
    tmp_path: Path, sshd: SshdInfo, client_key: tuple[Path, str]
) -> None:
    """The pooled key path is untouched: no certificate is signed for it."""
    b = make_bastion(tmp_path, sshd, client_key[0])
    try:
        agent = b.agent()
        rid = agent.start("echo keyed")
        b.approve_next()
        assert agent.wait(rid).stdout == b"keyed\n"
        (row,) = _rows(b)
        assert row["certificate"] is None
    finally:
        b.close()


def test_a_certificate_that_cannot_be_journaled_never_leaves_the_gateway(
    cert_bastion: Bastion, ca_sshd: Sshd, tmp_path: Path
) -> None:
    """With the journal unwritable nothing is signed or sent: since issue 18 the request
    is refused at its first record, before the gate (the certificate's own record
    failing is `tests/unit/test_certs.py`'s)."""
    b = cert_bastion
    agent = b.agent()
    rid = agent.start("true")
    b.approve_next()
    assert agent.wait(rid).rc == 0
    marker = tmp_path / "sent-without-a-record"
    logins = len(login_certificates(ca_sshd.log_text()))
    with journal_frozen(b.home):
        r = agent.run(f"touch {marker}")
    assert r.rc == 70 and r.code == "INTERNAL", r.stderr
    assert "could not write this request to its journal" in r.error["message"]  # type: ignore[index]
    assert not marker.exists()
    assert len(login_certificates(ca_sshd.log_text())) == logins  # no login was made
    assert "could not journal the request" in b.log.read_text()
