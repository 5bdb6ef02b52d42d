"""A stock sshd enforces bastion's per-command certificates by itself (issue 13, acceptance
2 to 5), with no gateway in the way.

Each certificate here is made by the shipped issuing code (`core.certs.cert_spec`, then
`vault_ca.sign`) with a test CA that the fixture's sshd trusts, and is used by the real OpenSSH
client against a target that has no authorized key at all and allows every forwarding in
its config. So whatever sshd refuses -- another command, an expired certificate, the
wrong source address, a pty, a forward, an agent, an untrusted CA -- the certificate
refused it. Each refusal of a `permit-*` feature has a control: the same sshd grants it to
a certificate that differs only by that one extension. (The gateway issuing these
certificates per request is test_certificate_accounts.py.)
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import asyncssh
import pytest

from bastion.ca import vault_ca
from bastion.core.certs import CertSpec, cert_spec
from bastion.devtools.sshd_fixture import Sshd, login_certificates, sshd_available
from bastion.vault import Vault
from tests.harness import ssh_agent, through_local_forward, wait_for

SSH_TIMEOUT = 30.0
SOURCE = ("127.0.0.1/32",)
# Several lines, quotes, a pipe, and its own exit status: sshd must run these bytes.
APPROVED = "printf '%s\\n' \"a b\" | wc -c; echo approved; exit 3"
PERMITS = ("x11_forwarding", "agent_forwarding", "port_forwarding", "pty", "user_rc")


def _skip_reason() -> str | None:
    reason = sshd_available()
    for tool in ("ssh", "ssh-agent", "ssh-add"):
        if reason is None and shutil.which(tool) is None:
            reason = f"{tool} is not installed: apt-get install -y openssh-client"
    return reason


pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")


@dataclasses.dataclass(frozen=True)
class Creds:
    """A user key and its certificate, as files the ssh client reads."""

    key: Path
    cert: Path
    public: str  # the plain key's public line


def _public_line(key: asyncssh.SSHKey) -> str:
    return key.export_public_key().decode().strip()


def _save(directory: Path, name: str, key: asyncssh.SSHKey, cert: asyncssh.SSHCertificate) -> Creds:
    # Not NAME-cert.pub: ssh would load that next to `-i NAME` by itself, and a test that
    # means to present the plain key alone must not present the certificate too.
    key_path, cert_path = directory / name, directory / f"{name}.certificate"
    key.write_private_key(str(key_path))
    key_path.chmod(0o600)  # or ssh refuses it: "UNPROTECTED PRIVATE KEY FILE"
    cert.write_certificate(str(cert_path))
    return Creds(key_path, cert_path, _public_line(key))


class Target:
    """The fixture's sshd, trusting one test CA and no plain key, and the real ssh client."""

    def __init__(self, server: Sshd, directory: Path) -> None:
        self.server = server
        self.info = server.info
        self.dir = directory
        self.known_hosts = directory / "known_hosts"
        self.known_hosts.write_text(self.info.known_hosts_line() + "\n")

    def spec(self, request_id: str, command: str = APPROVED, **changes: object) -> CertSpec:
        """What the gateway would certify for this request; `changes` only to shorten the
        validity (the shipped code has no switch for it)."""
        made = cert_spec(request_id, self.info.user, command.encode(), SOURCE, 60, time.time())
        return dataclasses.replace(made, **changes)  # type: ignore[arg-type]

    def issue(self, ca_key: asyncssh.SSHKey, spec: CertSpec, serial: int) -> Creds:
        issued = vault_ca.sign(ca_key, spec, serial)
        assert issued.key_id == spec.key_id and issued.serial == serial
        return _save(self.dir, f"{spec.key_id}-{serial}", issued.key, issued.certificate)

    def issue_permitting(
        self, ca_key: asyncssh.SSHKey, spec: CertSpec, serial: int, permit: str
    ) -> Creds:
        """The control: what `vault_ca.sign` makes for `spec`, plus the one extension `permit`."""
        key = asyncssh.generate_private_key("ssh-ed25519")
        cert = ca_key.generate_user_certificate(
            key,
            spec.key_id,
            serial=serial,
            principals=[spec.principal],
            valid_after=spec.valid_after,
            valid_before=spec.valid_before,
            force_command=spec.force_command,
            source_address=list(spec.source_address),
            **{f"permit_{p}": p == permit for p in PERMITS},
        )
        creds = _save(self.dir, f"{spec.key_id}-{serial}-control", key, cert)
        shown = _certificate_text(creds.cert)
        assert _extensions(shown) == [f"permit-{permit.replace('_', '-')}"], shown
        assert _critical_options(shown) == _critical_options_of(spec), shown
        return creds

    def argv(self, creds: Creds, *options: str, certificate: bool = True) -> list[str]:
        cert = ["-o", f"CertificateFile={creds.cert}"] if certificate else []
        return [
            "ssh", "-F", "/dev/null",
            "-i", str(creds.key), *cert,
            "-o", "IdentitiesOnly=yes",
            "-o", f"UserKnownHostsFile={self.known_hosts}",
            "-o", "GlobalKnownHostsFile=/dev/null",
            "-o", "StrictHostKeyChecking=yes",
            "-o", "BatchMode=yes",
            "-o", "ConnectTimeout=10",
            "-p", str(self.info.port),
            *options,
            f"{self.info.user}@{self.info.address}",
        ]  # fmt: skip

    def ssh(
        self,
        creds: Creds,
        *options: str,
        command: str = "echo hijacked",
        certificate: bool = True,
        agent: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        argv = [*self.argv(creds, *options, certificate=certificate), command]
        return subprocess.run(
            argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
            timeout=SSH_TIMEOUT, env=_client_env(agent),
        )  # fmt: skip


def _client_env(agent: Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "SSH_AUTH_SOCK"}
    env["SHELL"] = "/bin/sh"
    if agent is not None:
        env["SSH_AUTH_SOCK"] = str(agent)
    return env


def _run(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
        timeout=SSH_TIMEOUT, check=True, env=_client_env(),
    )  # fmt: skip


def _certificate_text(cert: Path) -> str:
    return _run(["ssh-keygen", "-L", "-f", str(cert)]).stdout


def _section(text: str, title: str) -> list[str]:
    """The entries of one `ssh-keygen -L` section ("Principals", "Extensions", ...)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(f"{title}:"))
    inline = lines[start].split(":", 1)[1].strip()
    if inline:
        return [] if inline == "(none)" else [inline]
    indent = len(lines[start]) - len(lines[start].lstrip())
    entries = []
    for line in lines[start + 1 :]:
        if not line.strip() or len(line) - len(line.lstrip()) <= indent:
            break
        entries.append(line.strip())
    return entries


def _extensions(text: str) -> list[str]:
    return _section(text, "Extensions")


def _critical_options(text: str) -> list[str]:
    return _section(text, "Critical Options")


def _critical_options_of(spec: CertSpec) -> list[str]:
    return [f"{name} {value}" for name, value in spec.critical_options.items()]


def _stamp(unix: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(unix))


def _new_ca() -> asyncssh.SSHKey:
    """A test CA: its private half lives in this process only, its public line in sshd's
    TrustedUserCAKeys file."""
    return asyncssh.generate_private_key("ssh-ed25519")


@pytest.fixture
def test_ca() -> asyncssh.SSHKey:
    return _new_ca()


@pytest.fixture
def target(tmp_path: Path, test_ca: asyncssh.SSHKey) -> Iterator[Target]:
    server = Sshd(
        tmp_path / "sshd", trusted_user_ca_keys=[_public_line(test_ca)], allow_forwarding=True
    )
    with server:
        assert server.authorized_keys_path.read_text() == ""  # nothing but certificates
        yield Target(server, tmp_path)


# -- acceptance 2: the certificate pins the command and the time ---------------------------


def test_ssh_keygen_shows_exactly_what_was_approved(
    target: Target, test_ca: asyncssh.SSHKey
) -> None:
    spec = target.spec("req_keygen")
    creds = target.issue(test_ca, spec, serial=4242)

    shown = _certificate_text(creds.cert)

    assert "user certificate" in shown
    assert f"Signing CA: ED25519 {test_ca.get_fingerprint('sha256')}" in shown
    assert 'Key ID: "req_keygen"' in shown
    assert "Serial: 4242" in shown
    assert f"Valid: from {_stamp(spec.valid_after)} to {_stamp(spec.valid_before)}" in shown
    assert spec.valid_before - spec.valid_after == 60 + 30  # ttl + the backdating
    assert _section(shown, "Principals") == [target.info.user]
    assert _critical_options(shown) == [
        f"force-command {APPROVED}",  # byte for byte, quotes and pipe included
        "source-address 127.0.0.1/32",
    ]
    assert _extensions(shown) == []  # "Extensions: (none)"
    assert "Extensions: (none)" in shown


def test_sshd_runs_only_the_forced_command(target: Target, test_ca: asyncssh.SSHKey) -> None:
    creds = target.issue(test_ca, target.spec("req_forced"), serial=7)

    result = target.ssh(creds, command="echo hijacked")

    assert (result.stdout, result.returncode) == ("4\napproved\n", 3), result.stderr
    log = target.server.log_text()
    assert login_certificates(log) == [("req_forced", 7)]
    assert "Starting session: forced-command (key-option)" in log


def test_sshd_refuses_the_certificate_once_it_expires(
    target: Target, test_ca: asyncssh.SSHKey
) -> None:
    now = math.floor(time.time())
    spec = target.spec("req_short", valid_before=now + 4)
    creds = target.issue(test_ca, spec, serial=11)
    first = target.ssh(creds)
    assert (first.stdout, first.returncode) == ("4\napproved\n", 3), first.stderr

    # Time passing is the event: sshd compares its clock with valid_before.
    wait_for(lambda: time.time() >= spec.valid_before + 0.5, timeout=10)
    after = target.ssh(creds)

    assert after.returncode == 255 and after.stdout == ""
    assert "Permission denied (publickey)" in after.stderr
    log = target.server.log_text()
    assert "Certificate invalid: expired" in log
    assert login_certificates(log) == [("req_short", 11)]  # the first login only


# -- acceptance 3: the certificate pins where the client connects from -------------------


def test_a_source_address_outside_the_certificate_is_refused(
    target: Target, test_ca: asyncssh.SSHKey
) -> None:
    creds = target.issue(test_ca, target.spec("req_source"), serial=21)

    elsewhere = target.ssh(creds, "-o", "BindAddress=127.0.0.2")
    assert elsewhere.returncode == 255 and elsewhere.stdout == ""
    assert "Permission denied (publickey)" in elsewhere.stderr
    log = target.server.log_text()
    assert (
        "Authentication tried for "
        f"{target.info.user} with valid certificate but not from a permitted source "
        "address (127.0.0.2)."
    ) in log
    assert login_certificates(log) == []

    # The same certificate from the permitted address: the address was the only reason.
    here = target.ssh(creds, "-o", "BindAddress=127.0.0.1")
    assert (here.stdout, here.returncode) == ("4\napproved\n", 3), here.stderr
    assert login_certificates(target.server.log_text()) == [("req_source", 21)]


# -- acceptance 4: nothing but the certified command, and no permit-* at all ---------------


def test_only_certificates_log_in_once_the_plain_key_is_removed(
    target: Target, test_ca: asyncssh.SSHKey
) -> None:
    creds = target.issue(test_ca, target.spec("req_plain", command="echo cert"), serial=31)
    # While the plain key is authorized, it alone runs anything...
    target.server.set_authorized_keys([creds.public])
    plain = target.ssh(creds, command="echo anything", certificate=False)
    assert (plain.stdout, plain.returncode) == ("anything\n", 0), plain.stderr

    # ...removed from authorized_keys, it alone does nothing; its certificate still works.
    target.server.set_authorized_keys([])
    plain = target.ssh(creds, command="echo anything", certificate=False)
    assert plain.returncode == 255 and plain.stdout == ""
    assert "Permission denied (publickey)" in plain.stderr
    certified = target.ssh(creds, command="echo anything")
    assert (certified.stdout, certified.returncode) == ("cert\n", 0), certified.stderr
    assert login_certificates(target.server.log_text()) == [("req_plain", 31)]


def test_no_pty_unless_the_certificate_permits_one(
    target: Target, test_ca: asyncssh.SSHKey
) -> None:
    spec = target.spec("req_pty", command="tty; true")
    refused = target.ssh(target.issue(test_ca, spec, serial=41), "-tt")
    assert refused.returncode == 255, refused
    assert "PTY allocation request failed" in refused.stderr
    assert "/dev/pts/" not in refused.stdout

    granted = target.ssh(target.issue_permitting(test_ca, spec, 42, "pty"), "-tt")
    assert granted.returncode == 0, granted.stderr
    assert granted.stdout.startswith("/dev/pts/"), granted.stdout
    assert login_certificates(target.server.log_text()) == [("req_pty", 41), ("req_pty", 42)]


def test_no_remote_forward_unless_the_certificate_permits_it(
    target: Target, test_ca: asyncssh.SSHKey
) -> None:
    spec = target.spec("req_remote", command="echo ran")
    forward = ("-R", f"0:127.0.0.1:{target.info.port}", "-o", "ExitOnForwardFailure=yes")

    refused = target.ssh(target.issue(test_ca, spec, serial=51), *forward)
    assert refused.returncode == 255, refused
    assert "remote port forwarding failed" in refused.stderr

    granted = target.ssh(target.issue_permitting(test_ca, spec, 52, "port_forwarding"), *forward)
    assert (granted.stdout, granted.returncode) == ("ran\n", 0), granted.stderr
    assert "Allocated port" in granted.stderr


def _through_local_forward(target: Target, creds: Creds, tmp_path: Path) -> tuple[bytes, str]:
    return through_local_forward(
        lambda options: target.argv(creds, *options),
        target.info.port,
        tmp_path / "forward.err",
        env=_client_env(),
    )


def test_no_local_forward_unless_the_certificate_permits_it(
    target: Target, test_ca: asyncssh.SSHKey, tmp_path: Path
) -> None:
    spec = target.spec("req_local", command="echo ran")

    got, stderr = _through_local_forward(target, target.issue(test_ca, spec, 61), tmp_path)
    assert got == b""
    assert "administratively prohibited" in stderr
    assert "refused local port forward" in target.server.log_text()

    control = target.issue_permitting(test_ca, spec, 62, "port_forwarding")
    got, stderr = _through_local_forward(target, control, tmp_path)
    assert got.startswith(b"SSH-2.0-"), stderr  # the target's sshd, reached through the tunnel
    assert target.server.log_text().count("refused local port forward") == 1


@pytest.fixture
def client_agent(tmp_path: Path) -> Iterator[Path]:
    with ssh_agent(tmp_path, SSH_TIMEOUT) as sock:
        yield sock


def test_no_agent_forwarding_unless_the_certificate_permits_it(
    target: Target, test_ca: asyncssh.SSHKey, client_agent: Path
) -> None:
    spec = target.spec("req_agent", command='echo "${SSH_AUTH_SOCK:-none}"; ssh-add -l')

    refused = target.ssh(target.issue(test_ca, spec, 71), "-A", agent=client_agent)
    assert refused.stdout == "none\n", refused.stderr
    assert refused.returncode == 2  # ssh-add: no agent to talk to

    control = target.issue_permitting(test_ca, spec, 72, "agent_forwarding")
    granted = target.ssh(control, "-A", agent=client_agent)
    assert granted.returncode == 0, granted.stderr
    sock_line, key_line = granted.stdout.splitlines()
    assert sock_line != "none"
    assert key_line.endswith("held (ED25519)")  # the client's agent, forwarded


# -- acceptance 5: CA rotation on the target -----------------------------------------------


def test_rotation_trusts_both_cas_then_only_the_new_one(target: Target) -> None:
    old, new = _new_ca(), _new_ca()
    old_creds = target.issue(old, target.spec("req_old", command="echo old"), serial=81)
    new_creds = target.issue(new, target.spec("req_new", command="echo new"), serial=82)

    target.server.trust_user_cas([_public_line(old), _public_line(new)])
    assert target.ssh(old_creds).stdout == "old\n"
    assert target.ssh(new_creds).stdout == "new\n"
    sshd_pid = target.server.pid

    target.server.trust_user_cas([_public_line(new)])
    gone = target.ssh(old_creds)
    assert gone.returncode == 255 and gone.stdout == ""
    assert target.ssh(new_creds).stdout == "new\n"
    assert target.server.pid == sshd_pid  # read at each login: no restart, no SIGHUP
    assert login_certificates(target.server.log_text()) == [
        ("req_old", 81),
        ("req_new", 82),
        ("req_new", 82),
    ]


def test_the_vault_ca_snippet_is_a_target_ca_file_through_a_rotation(
    target: Target, tmp_path: Path
) -> None:
    vault = Vault.create(tmp_path / "vault.json", b"rotation passphrase")
    first = vault_ca.init(vault)
    second = vault_ca.rotate(vault)
    old_creds = target.issue(
        vault.private_key(first.label), target.spec("req_ca1", command="echo one"), serial=91
    )
    new_creds = target.issue(
        vault.private_key(second.label), target.spec("req_ca2", command="echo two"), serial=92
    )

    # The whole `bastion ca public` snippet, comments and all, as the CA file.
    overlap = vault_ca.public(vault.list_keys())["sshd_config"]
    assert first.public_key.split()[1] in overlap and second.public_key.split()[1] in overlap
    target.server.trust_user_cas(overlap.splitlines())
    assert target.ssh(old_creds).stdout == "one\n"
    assert target.ssh(new_creds).stdout == "two\n"

    vault_ca.retire(vault, first.label)
    after = vault_ca.public(vault.list_keys())["sshd_config"]
    assert first.public_key.split()[1] not in after
    target.server.trust_user_cas(after.splitlines())
    refused = target.ssh(old_creds)
    assert refused.returncode == 255 and refused.stdout == ""
    assert target.ssh(new_creds).stdout == "two\n"
    assert login_certificates(target.server.log_text()) == [
        ("req_ca1", 91),
        ("req_ca2", 92),
        ("req_ca2", 92),
    ]
