"""Per-command certificates: what they say (pure), how the policy asks for them, how the
gate refuses a certificate account nothing can sign for, and the vault's CA and serials."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
from dataclasses import replace
from pathlib import Path

import asyncssh
import pytest

from bastion.ca import vault_ca
from bastion.ca.issuer import SERIAL_BLOCK, VaultCA
from bastion.core.certs import BACKDATE, Auth, CertError, cert_spec, source_networks
from bastion.core.contract import Code, Refusal
from bastion.core.gate import Request, World, evaluate
from bastion.core.policy import (
    Policy,
    PolicyError,
    _account_doc,
    entry_digest,
    parse_policy_text,
)
from bastion.vault import Vault, VaultError

PW = b"pw"
KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKwqVd3vMikqXGyJKL6mRiDHH8Ym3yLu2zkTPeUe2xx0"


def policy(account: str) -> str:
    return f"""
[hosts.web1]
address = "10.0.0.5"
host_key = "{KEY}"

[[hosts.web1.accounts]]
user = "deploy"
{account}
"""


# -- the certificate's contents ----------------------------------------------------------


def test_the_spec_holds_the_exact_command_the_request_id_and_a_short_window() -> None:
    now = 1_700_000_000.7
    spec = cert_spec("req_1", "deploy", b"echo 'a  b' | wc -c", ("10.0.0.1/32",), 60, now)
    assert (spec.principal, spec.key_id) == ("deploy", "req_1")
    assert spec.force_command == "echo 'a  b' | wc -c"
    assert spec.valid_after == math.floor(now) - BACKDATE
    assert spec.valid_before == math.floor(now) + 60
    assert spec.critical_options == {
        "force-command": "echo 'a  b' | wc -c",
        "source-address": "10.0.0.1/32",
    }


@pytest.mark.parametrize("command", [b"\xff\xfe", b"echo a\0b", b"  "])
def test_a_command_a_certificate_cannot_carry_exactly_is_refused(command: bytes) -> None:
    with pytest.raises(CertError):
        cert_spec("req_1", "deploy", command, ("10.0.0.1/32",), 60, 0.0)


def test_source_addresses_are_normalised_and_bad_ones_named() -> None:
    assert source_networks(["10.0.0.7", "10.1.0.0/16", "::1", "10.0.0.7"]) == (
        "10.0.0.7/32",
        "10.1.0.0/16",
        "::1/128",
    )
    for bad in (["10.0.0.0/8x"], ["10.0.0.1/8"], [], "10.0.0.1", [7]):
        with pytest.raises(CertError):
            source_networks(bad)


def test_sign_makes_a_certificate_with_no_extension_that_ssh_keygen_reads(
    tmp_path: Path,
) -> None:
    authority = asyncssh.generate_private_key("ssh-ed25519")
    spec = cert_spec("req_9", "deploy", b"uptime", ("127.0.0.1/32",), 60, 1_700_000_000)
    issued = vault_ca.sign(authority, spec, 41)
    path = tmp_path / "c-cert.pub"
    issued.certificate.write_certificate(str(path))
    shown = subprocess.run(
        ["ssh-keygen", "-L", "-f", str(path)], capture_output=True, text=True, timeout=30
    ).stdout
    assert 'Key ID: "req_9"' in shown and "Serial: 41" in shown
    assert "force-command uptime" in shown and "source-address 127.0.0.1/32" in shown
    assert "Extensions: (none)" in shown
    assert issued.ca == authority.get_fingerprint("sha256")
    assert issued.journal_meta() == {"serial": 41, "key_id": "req_9", "ca": issued.ca}


# -- the policy --------------------------------------------------------------------------


def test_a_certificate_account_needs_source_address_and_may_drop_the_credential() -> None:
    hosts = parse_policy_text(
        policy('auth = "certificate"\nsource_address = ["10.0.0.1"]\ncert_ttl = 30'), "p.toml"
    )
    account = hosts["web1"].account("deploy")
    assert account is not None
    assert (account.auth, account.source_address, account.cert_ttl) == (
        Auth.CERTIFICATE,
        ("10.0.0.1/32",),
        30,
    )
    assert account.credential == ""
    with pytest.raises(PolicyError, match=r'p.toml: hosts.web1.accounts\[0\].*"source_address"'):
        parse_policy_text(policy('auth = "certificate"'), "p.toml")
    with pytest.raises(PolicyError, match="only for accounts with auth"):
        parse_policy_text(policy('credential = "k"\nsource_address = ["10.0.0.1"]'), "p.toml")
    with pytest.raises(PolicyError, match='"cert_ttl"'):
        parse_policy_text(
            policy('auth = "certificate"\nsource_address = ["10.0.0.1"]\ncert_ttl = 1'), "p.toml"
        )
    with pytest.raises(PolicyError, match='"auth"'):
        parse_policy_text(policy('auth = "password"\ncredential = "k"'), "p.toml")
    with pytest.raises(PolicyError, match='"credential"'):
        parse_policy_text(policy(""), "p.toml")  # a key account still needs its key


def test_switching_an_account_to_certificates_voids_its_session_approvals() -> None:
    keyed = parse_policy_text(policy('credential = "k"'), "p.toml")["web1"]
    certified = parse_policy_text(
        policy('credential = "k"\nauth = "certificate"\nsource_address = ["10.0.0.1"]'), "p.toml"
    )["web1"]
    assert entry_digest(keyed, keyed.accounts[0]) != entry_digest(certified, certified.accounts[0])
    # A key account's digest covers what it covered before certificates existed.
    assert set(_account_doc(keyed.accounts[0])) == {
        "user",
        "credential",
        "approval",
        "allow",
        "deny",
        "preapproved",
        "shell",
        "login_shell",
    }


# -- the gate ----------------------------------------------------------------------------


def _world(text: str, problem: str | None) -> World:
    hosts = parse_policy_text(text, "p.toml")
    return World(
        locked=False,
        vault_epoch=1,
        boot_id="boot",
        policy=Policy(hosts, "d", ("p.toml",)),
        subject_alive=True,
        session=None,
        ended=None,
        command_grant=None,
        now=0.0,
        certify_problem=problem,
    )


def test_the_gate_refuses_a_certificate_account_nothing_can_sign_for_before_any_card() -> None:
    req = Request("req_1", "web1", "deploy", b"uptime", (1, 1.0, "n", "e"))
    cert = policy('auth = "certificate"\nsource_address = ["10.0.0.1"]')
    verdict = evaluate(req, _world(cert, "the vault holds no user CA"))
    assert isinstance(verdict, Refusal) and verdict.code is Code.POLICY_UNAVAILABLE
    assert "deploy@web1" in verdict.message and "the vault holds no user CA" in verdict.message
    assert not isinstance(evaluate(req, _world(cert, None)), Refusal)  # a card, then
    keyed = policy('credential = "k"')
    assert not isinstance(evaluate(req, _world(keyed, "no CA")), Refusal)  # key accounts: no matter


# -- the vault's CA ----------------------------------------------------------------------


@pytest.fixture
def vault(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Vault:
    monkeypatch.setenv("BASTION_KDF_PROFILE", "test")
    return Vault.create(tmp_path / "vault.json", PW)


def test_ca_lifecycle_init_rotate_retire(vault: Vault) -> None:
    with pytest.raises(VaultError, match="ca init"):
        vault_ca.public(vault.list_keys())
    first = vault_ca.init(vault)
    with pytest.raises(VaultError, match="ca rotate"):
        vault_ca.init(vault)
    second = vault_ca.rotate(vault)
    shown = vault_ca.public(vault.list_keys())
    assert [a["label"] for a in shown["authorities"]] == ["bastion-ca-1", "bastion-ca-2"]
    assert shown["signing"] == second.label
    assert (
        first.public_key.split()[1] in shown["sshd_config"] and "rotation" in shown["sshd_config"]
    )
    with pytest.raises(VaultError, match="signs now"):
        vault_ca.retire(vault, second.fingerprint)
    assert vault_ca.retire(vault, first.fingerprint).label == "bastion-ca-1"
    assert [a["label"] for a in vault_ca.public(vault.list_keys())["authorities"]] == [
        "bastion-ca-2"
    ]
    third = vault_ca.rotate(vault)
    assert third.label == "bastion-ca-3"  # numbers are never reused


def test_the_vault_ca_signs_with_the_newest_ca_and_serials_never_repeat(vault: Vault) -> None:
    issuer = VaultCA(vault)
    assert issuer.problem() is not None and "bastion ca init" in issuer.problem()  # type: ignore[operator]
    spec = cert_spec("req_1", "deploy", b"uptime", ("127.0.0.1/32",), 60, 1_700_000_000)
    with pytest.raises(Refusal) as refused:
        asyncio.run(issuer.issue(spec))
    assert refused.value.code is Code.POLICY_UNAVAILABLE
    vault_ca.init(vault)
    assert issuer.problem() is None
    first = asyncio.run(issuer.issue(spec))
    rotated = vault_ca.rotate(vault)
    second = asyncio.run(issuer.issue(replace(spec, key_id="req_2")))
    assert second.ca == rotated.fingerprint and first.ca != second.ca
    assert (first.serial, second.serial) == (1, 2)
    # Another handle on the same file (a restarted gateway) reserves its own block:
    # the unused rest of the first block is skipped, never handed out twice.
    again = Vault.open(vault.path)
    again.unlock(PW)
    restarted = asyncio.run(VaultCA(again).issue(spec))
    assert restarted.serial == SERIAL_BLOCK + 1
    assert asyncio.run(issuer.issue(spec)).serial == 3  # the first keeps its own block
    assert json.loads(vault.path.read_text())["cert_serial"] == 2 * SERIAL_BLOCK


def test_a_locked_vault_signs_nothing(vault: Vault) -> None:
    vault_ca.init(vault)
    issuer = VaultCA(vault)
    vault.lock()
    spec = cert_spec("req_1", "deploy", b"uptime", ("127.0.0.1/32",), 60, 1_700_000_000)
    with pytest.raises(Refusal) as refused:
        asyncio.run(issuer.issue(spec))
    assert refused.value.code is Code.VAULT_LOCKED


def test_a_certificate_the_journal_cannot_record_is_never_handed_out(vault: Vault) -> None:
    """`certificate_issued` is fsynced before the login: if it cannot be written, the
    signed certificate goes nowhere (the dispatcher gets a Refusal, INTERNAL)."""
    from bastion.core.events import EventType
    from bastion.gateway.certify import Certifier
    from bastion.gateway.recorder import Recorder
    from tests.unit.fakes import FakeJournal

    vault_ca.init(vault)
    journal = FakeJournal(fail={EventType.CERTIFICATE_ISSUED})
    text = policy('auth = "certificate"\nsource_address = ["127.0.0.1"]')
    account = parse_policy_text(text, "p.toml")["web1"].accounts[0]
    certifier = Certifier(VaultCA(vault), Recorder(journal.writer("boot_1")))
    with pytest.raises(Refusal) as refused:
        asyncio.run(certifier.issue("req_1", account, b"uptime"))
    assert refused.value.code is Code.INTERNAL
    assert "could not record the command's certificate" in refused.value.message
    assert journal.records == []


# -- sealed secrets ----------------------------------------------------------------------


def test_secrets_are_sealed_replaced_and_tamper_evident(vault: Vault) -> None:
    vault.put_secret("bastion-openbao", b'{"token": "s.TOPSECRET"}')
    assert b"TOPSECRET" not in vault.path.read_bytes()
    vault.put_secret("bastion-openbao", b'{"token": "s.NEWER"}')
    assert vault.secret("bastion-openbao") == b'{"token": "s.NEWER"}'
    assert vault.secret_labels() == ["bastion-openbao"]
    with pytest.raises(VaultError, match="no secret labelled 'other'"):
        vault.secret("other")
    doc = json.loads(vault.path.read_text())
    doc["secrets"][0]["label"] = "moved"  # the associated data binds the label
    vault.path.write_text(json.dumps(doc))
    with pytest.raises(VaultError, match="tampered"):
        vault.secret("moved")
    vault.lock()
    with pytest.raises(VaultError, match="locked"):
        vault.secret("moved")
