"""Certificate accounts through the real gateway, signed by a team's OpenBao (issue 13,
acceptance 7).

A real `bao server -dev` with bastion's role (`bastion.devtools.openbao`) and a file audit
device; the fixture's sshd trusts only OpenBao's CA and holds no authorized key, and
allows every forwarding in its config, so whatever it refuses, the certificate refused.
The gateway reads `[ca] backend = "openbao"` from bastion.toml and logs in with the AppRole
that `bastion ca openbao-login` sealed in its vault. Shown here: an approved command runs
with its exact output and exit status, sshd logs the request id and serial of each login,
and OpenBao's audit log holds exactly one signing per request with that request id
(acceptance 1); nothing but certificates log in, and OpenBao's certificates grant no pty,
forward or agent (acceptance 4); and once OpenBao stops, new requests end `INTERNAL` and
nothing reaches the target.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncssh
import pytest

from bastion.ca.openbao import Login, OpenBaoCA
from bastion.ca.vault_ca import Issued
from bastion.config import CaConfig
from bastion.core.certs import cert_spec
from bastion.devtools.openbao import OpenBao, bao_available, sign_policy
from bastion.devtools.sshd_fixture import Sshd, login_certificates, sshd_available
from tests.harness import (
    PASSPHRASE,
    Bastion,
    after_waiting,
    make_bastion,
    policy_toml,
    ssh_agent,
    through_local_forward,
    wait_for,
    write_bastion_toml,
)

CERT = {"auth": "certificate", "source_address": ["127.0.0.1"]}
SIGN_PATH = "ssh/sign/bastion"
SSH_TIMEOUT = 30.0


def _skip_reason() -> str | None:
    reason = bao_available() or sshd_available()
    for tool in ("ssh", "ssh-agent", "ssh-add"):
        if reason is None and shutil.which(tool) is None:
            reason = f"{tool} is not installed: apt-get install -y openssh-client"
    return reason


pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sshd]:
    """No authorized key; forwarding allowed by its config, so only a certificate refuses."""
    with Sshd(tmp_path_factory.mktemp("openbao-gw-sshd"), allow_forwarding=True) as server:
        yield server


class Team:
    """The team's OpenBao, the target that trusts its CA, and a gateway that uses it."""

    def __init__(self, root: Path, bao: OpenBao, target: Sshd, b: Bastion, login: Login) -> None:
        self.root, self.bao, self.target, self.b, self.login = root, bao, target, b, login
        self.audit = root / "openbao-audit.log"

    def audit_entries(self, kind: str, path: str = SIGN_PATH) -> list[dict[str, Any]]:
        lines = self.audit.read_text().splitlines() if self.audit.exists() else []
        entries = [json.loads(line) for line in lines if line]
        return [e for e in entries if e["type"] == kind and e["request"]["path"] == path]

    def signed_ids(self) -> list[str]:
        return [e["request"]["data"]["key_id"] for e in self.audit_entries("request")]

    def rows(self) -> list[dict[str, Any]]:
        return [r for r in self.b.op("audit", view="activity") if r["command"] != "true"]


@pytest.fixture
def team(tmp_path: Path, target: Sshd, client_key: tuple[Path, str]) -> Iterator[Team]:
    with OpenBao(tmp_path / "bao") as bao:
        target.trust_user_cas([bao.enable_ssh_ca(principals=[target.info.user])])
        role_id, secret_id = bao.approle("bastion-gateway", sign_policy())
        b = make_bastion(
            tmp_path, target.info, client_key[0], policy_toml(target.info, **CERT), start=False
        )
        team = Team(tmp_path, bao, target, b, Login(role_id=role_id, secret_id=secret_id))
        bao.enable_file_audit(team.audit)
        try:
            write_bastion_toml(
                b,
                f'[ca]\nbackend = "openbao"\naddress = "{bao.address}"\nrole = "bastion"\n'
                "timeout = 5\n",
            )
            stored = b.cli(
                "ca", "openbao-login", "--approle", role_id, "--passphrase-stdin",
                stdin=f"{PASSPHRASE}\n{secret_id}\n",
            )  # fmt: skip
            assert "sealed the OpenBao AppRole" in stored.stdout
            assert secret_id not in stored.stdout + stored.stderr
            b.start_daemon()
            b.unlock()
            yield team
        finally:
            b.close()
            target.trust_user_cas([])


# -- acceptance 1, and one audited signing per request ---------------------------------------


def test_an_approved_command_runs_and_openbao_audits_one_signing_per_request(
    team: Team,
) -> None:
    b = team.b
    agent = b.agent()
    rid = agent.start("printf 'out put\\n'; printf 'err\\n' >&2; exit 3")
    card = b.approve_next()
    assert card["kind"] == "session"
    first = agent.wait(rid)
    second = agent.run("echo second")

    assert (first.rc, first.stdout, after_waiting(first.stderr, card)) == (3, b"out put\n", "err\n")
    assert (second.rc, second.stdout) == (0, b"second\n")
    rows = team.rows()
    assert [r["outcome"] for r in rows] == ["completed", "completed"]
    ca_fingerprint = asyncssh.import_public_key(team.bao.ca_public_key()).get_fingerprint("sha256")
    certs = [r["certificate"] for r in rows]
    for row, cert in zip(rows, certs, strict=True):
        assert cert["key_id"] == row["request_id"] and cert["ca"] == ca_fingerprint
    # The target's log ties each login to its request, by key id and serial...
    logged = login_certificates(team.target.log_text())
    for cert in certs:
        assert (cert["key_id"], cert["serial"]) in logged
    # ...and OpenBao's audit log holds one signing per request, under the same request id
    # and serial, with the command itself HMACed.
    assert team.signed_ids() == [r["request_id"] for r in rows]
    audited = [
        int(e["response"]["data"]["serial_number"], 16) for e in team.audit_entries("response")
    ]
    assert audited == [c["serial"] for c in certs]
    assert "out put" not in team.audit.read_text()
    assert team.login.secret_id not in b.log.read_text()  # nor the AppRole's secret
    state = json.loads(b.cli("request", rows[0]["request_id"], "--json").stdout)
    assert state["certificate"]["serial"] == certs[0]["serial"] and state["exit_status"] == 3


# -- acceptance 4: nothing but certificates, and no permit-* in OpenBao's -----------------------


def _ssh(
    team: Team,
    key: Path,
    *options: str,
    cert: Path | None = None,
    command: str = "echo hijacked",
    agent: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    info = team.target.info
    known = team.root / "known_hosts"
    known.write_text(info.known_hosts_line() + "\n")
    env = {k: v for k, v in os.environ.items() if k != "SSH_AUTH_SOCK"}
    env["SHELL"] = "/bin/sh"
    if agent is not None:
        env["SSH_AUTH_SOCK"] = str(agent)
    argv = [
        "ssh", "-F", "/dev/null", "-i", str(key),
        *(["-o", f"CertificateFile={cert}"] if cert else []),
        "-o", "IdentitiesOnly=yes", "-o", f"UserKnownHostsFile={known}",
        "-o", "GlobalKnownHostsFile=/dev/null", "-o", "StrictHostKeyChecking=yes",
        "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-p", str(info.port),
        *options, f"{info.user}@{info.address}", command,
    ]  # fmt: skip
    return subprocess.run(
        argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
        timeout=SSH_TIMEOUT, env=env,
    )  # fmt: skip


def _gateway_backend(team: Team) -> OpenBaoCA:
    """The shipped backend with the gateway's settings and the AppRole its vault holds
    (not read from that vault: unlocking it here would bump the gateway's vault epoch)."""
    config = CaConfig(backend="openbao", address=team.bao.address, role="bastion", timeout=5)
    return OpenBaoCA(config, team.login.sealed)


def _save(team: Team, issued: Issued) -> tuple[Path, Path]:
    key, cert = team.root / issued.key_id, team.root / f"{issued.key_id}.certificate"
    issued.key.write_private_key(str(key))
    key.chmod(0o600)
    issued.certificate.write_certificate(str(cert))
    return key, cert


def _through_local_forward(team: Team, key: Path, cert: Path) -> str:
    """`ssh -N -L` to the target's own port; ssh's stderr once the first connection
    through it was refused (nothing came back)."""
    info = team.target.info
    known = team.root / "known_hosts"
    known.write_text(info.known_hosts_line() + "\n")

    def argv(options: list[str]) -> list[str]:
        return [
            "ssh", "-F", "/dev/null", "-i", str(key), "-o", f"CertificateFile={cert}",
            "-o", "IdentitiesOnly=yes", "-o", f"UserKnownHostsFile={known}",
            "-o", "BatchMode=yes", "-p", str(info.port), *options, f"{info.user}@{info.address}",
        ]  # fmt: skip

    err_path = team.root / "forward.err"
    got, err = through_local_forward(argv, info.port, err_path, timeout=SSH_TIMEOUT)
    assert got == b"", err  # the channel was refused: no sshd banner came back
    return err


@pytest.fixture
def client_agent(tmp_path: Path) -> Iterator[Path]:
    with ssh_agent(tmp_path, SSH_TIMEOUT) as sock:
        yield sock


def test_only_openbao_certificates_log_in_and_they_permit_nothing(
    team: Team, client_key: tuple[Path, str], client_agent: Path
) -> None:
    b = team.b
    # Through the gateway, certificate logins work...
    agent = b.agent()
    rid = agent.start("echo through-the-gateway")
    b.approve_next()
    assert agent.wait(rid).stdout == b"through-the-gateway\n"
    # ...while the account's plain key, which the target does not list, logs in nowhere.
    assert team.target.authorized_keys_path.read_text() == ""
    plain = _ssh(team, client_key[0], command="echo plain")
    assert plain.returncode == 255 and "Permission denied (publickey)" in plain.stderr

    # A certificate OpenBao signs with the gateway's role and login, used with plain ssh:
    backend = _gateway_backend(team)
    spec = cert_spec(
        "req_direct", team.target.info.user, b'tty; echo "${SSH_AUTH_SOCK:-none}"; echo forced',
        ("127.0.0.1/32",), 60, time.time(),
    )  # fmt: skip
    issued = asyncio.run(backend.issue(spec))
    key, cert = _save(team, issued)

    other = _ssh(team, key, cert=cert, command="echo hijacked")
    assert other.returncode == 0 and other.stdout == "not a tty\nnone\nforced\n", other.stderr
    pty = _ssh(team, key, "-tt", cert=cert)
    assert "PTY allocation request failed" in pty.stderr and "/dev/pts/" not in pty.stdout
    remote = _ssh(team, key, "-R", f"0:127.0.0.1:{team.target.info.port}",
                  "-o", "ExitOnForwardFailure=yes", cert=cert)  # fmt: skip
    assert remote.returncode == 255 and "remote port forwarding failed" in remote.stderr
    forwarded = _ssh(team, key, "-A", cert=cert, agent=client_agent)
    assert forwarded.stdout == "not a tty\nnone\nforced\n", forwarded.stderr  # no agent socket
    assert "administratively prohibited" in _through_local_forward(team, key, cert)
    assert "refused local port forward" in team.target.log_text()
    assert ("req_direct", issued.serial) in login_certificates(team.target.log_text())

    # The control: the same target grants a pty to an OpenBao certificate that permits one.
    team.bao.write_role(
        "ssh", "control", key_type="ca", allow_user_certificates=True,
        allowed_users=team.target.info.user, allowed_extensions="permit-pty",
        allow_user_key_ids=True, ttl="60s",
    )  # fmt: skip
    control_key = asyncssh.generate_private_key("ssh-ed25519")
    signed = team.bao.client().write_data(
        "ssh/sign/control",
        data={
            "public_key": control_key.export_public_key().decode(),
            "valid_principals": team.target.info.user, "cert_type": "user",
            "key_id": "req_control", "extensions": {"permit-pty": ""},
            "critical_options": {"force-command": "tty", "source-address": "127.0.0.1/32"},
        },
    )["data"]["signed_key"]  # fmt: skip
    control_path, control_cert = team.root / "control", team.root / "control.certificate"
    control_key.write_private_key(str(control_path))
    control_path.chmod(0o600)
    control_cert.write_text(signed)
    granted = _ssh(team, control_path, "-tt", cert=control_cert)
    assert granted.returncode == 0 and granted.stdout.startswith("/dev/pts/"), granted.stderr


def _after_last_login(log: str) -> str:
    return log[log.rindex("Accepted publickey") :]


# -- OpenBao stops mid-run ----------------------------------------------------------------------


def test_openbao_stopping_mid_run_is_internal_and_nothing_is_sent(team: Team) -> None:
    b = team.b
    agent = b.agent()
    rid = agent.start("echo before")
    b.approve_next()
    assert agent.wait(rid).stdout == b"before\n"
    # The next command's connection is opened and parked at the auth step once this one
    # ran (gateway/warm.py): count what reaches the target after it arrived.
    wait_for(lambda: "Connection from" in _after_last_login(team.target.log_text()))
    team.bao.stop()
    sshd_before = len(team.target.log_text())

    started = time.monotonic()
    after = agent.run("echo after-openbao-stopped")
    took = time.monotonic() - started

    assert after.rc == 70 and after.code == "INTERNAL", after.stderr
    message = after.error["message"]  # type: ignore[index]
    assert team.bao.address in message and "Nothing was sent" in message
    assert "after-openbao-stopped" not in message
    assert after.stdout == b"", took
    assert "Connection from" not in team.target.log_text()[sshd_before:]  # nothing reached it
    rows = team.rows()
    assert rows[-1]["outcome"] == "not_started", rows[-1]  # refused before any intent
    assert rows[-1]["code"] == "INTERNAL" and rows[-1]["certificate"] is None
    assert b.op("status")["locked"] is False  # the gateway carries on


# -- the role is checked at each unlock -------------------------------------------------------


def test_each_unlock_checks_the_role_and_says_what_it_lacks(team: Team) -> None:
    b = team.b
    assert "certificate CA:" not in b.log.read_text()  # the fixture's role is fit
    team.bao.write_role(
        "ssh",
        "bastion",
        key_type="ca",
        allow_user_certificates=True,
        allowed_users=team.target.info.user,
        allowed_critical_options="source-address",
        allow_user_key_ids=True,
        ttl="60s",
    )
    b.cli("lock")
    b.unlock()
    wait_for(lambda: "certificate CA:" in b.log.read_text(), 20)
    warned = [line for line in b.log.read_text().splitlines() if "certificate CA:" in line]
    assert "allowed_critical_options" in warned[0]
    assert "bao write ssh/roles/bastion" in warned[0]  # the fix, whole
