"""The sshd fixture itself, exercised with the real OpenSSH client.

Every bastion integration test trusts this fixture; if it silently accepted the wrong host
key or leaked sessions, those tests would prove nothing. So it is checked on its own first.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from bastion.devtools.sshd_fixture import (
    TEMPLATE_ENV,
    Sshd,
    SshdError,
    SshdInfo,
    find_template,
    login_certificates,
    sshd_available,
)

SSH_TIMEOUT = 30.0  # generous: a loaded CI box, but never a hang
WAIT_TIMEOUT = 10.0


def _skip_reason() -> str | None:
    reason = sshd_available()
    if reason is None and shutil.which("ssh") is None:
        reason = "the OpenSSH client is not installed: apt-get install -y openssh-client"
    return reason


pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")


def _keygen(path: Path) -> str:
    subprocess.run(
        ["ssh-keygen", "-t", "ed25519", "-N", "", "-q", "-C", path.name, "-f", str(path)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        check=True,
        timeout=SSH_TIMEOUT,
    )
    return path.with_suffix(".pub").read_text(encoding="utf-8").strip()


def _ssh_argv(info: SshdInfo, key: Path, known_hosts: Path, command: str) -> list[str]:
    # -F /dev/null and explicit options: the test must not depend on whoever's
    # ~/.ssh/config, agent, or known_hosts happens to exist on this machine.
    return [
        "ssh", "-F", "/dev/null",
        "-i", str(key),
        "-o", "IdentitiesOnly=yes",
        "-o", "IdentityAgent=none",
        "-o", f"UserKnownHostsFile={known_hosts}",
        "-o", "GlobalKnownHostsFile=/dev/null",
        "-o", "StrictHostKeyChecking=yes",
        "-o", "BatchMode=yes",
        "-o", "ConnectTimeout=10",
        "-p", str(info.port),
        f"{info.user}@{info.address}",
        command,
    ]  # fmt: skip


def _ssh(
    info: SshdInfo, key: Path, known_hosts: Path, command: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        _ssh_argv(info, key, known_hosts, command),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=SSH_TIMEOUT,
    )


def _known_hosts(tmp_path: Path, info: SshdInfo, host_key: str | None = None) -> Path:
    path = tmp_path / "known_hosts"
    path.write_text(f"[{info.address}]:{info.port} {host_key or info.host_key}\n")
    return path


def _wait_for(predicate: Callable[[], bool], what: str, timeout: float = WAIT_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def _port_is_free(port: int) -> bool:
    # SO_REUSEADDR as sshd itself uses: TIME_WAIT remnants of finished connections are
    # not "the port is still held".
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture
def client_key(tmp_path: Path) -> tuple[Path, str]:
    key = tmp_path / "client_ed25519"
    return key, _keygen(key)


@pytest.fixture
def sshd(tmp_path: Path, client_key: tuple[Path, str]) -> Iterator[Sshd]:
    server = Sshd(tmp_path / "sshd", authorized_keys=[client_key[1]])
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_real_client_runs_command_and_gets_exit_status(
    sshd: Sshd, client_key: tuple[Path, str], tmp_path: Path
) -> None:
    info = sshd.info
    assert info.address == "127.0.0.1"
    assert info.host_key.startswith("ssh-ed25519 ")
    assert len(info.host_key.split()) == 2, "pinned form carries no comment"
    assert info.authorized_keys.stat().st_mode & 0o777 == 0o600

    result = _ssh(info, client_key[0], _known_hosts(tmp_path, info), "echo hello; exit 3")

    assert result.stdout == "hello\n", result.stderr
    assert result.returncode == 3, result.stderr
    assert "Accepted publickey for" in sshd.log_text()


def test_wrong_host_key_is_refused(
    sshd: Sshd, client_key: tuple[Path, str], tmp_path: Path
) -> None:
    other = _keygen(tmp_path / "impostor_host_key")
    known = _known_hosts(tmp_path, sshd.info, host_key=" ".join(other.split()[:2]))

    result = _ssh(sshd.info, client_key[0], known, "echo hello")

    assert result.returncode == 255
    assert result.stdout == ""
    assert "Host key verification failed" in result.stderr
    assert "Accepted publickey" not in sshd.log_text()


def test_unknown_client_key_is_refused_until_authorized(sshd: Sshd, tmp_path: Path) -> None:
    key = tmp_path / "late_key"
    public = _keygen(key)
    known = _known_hosts(tmp_path, sshd.info)

    refused = _ssh(sshd.info, key, known, "echo hello")
    assert refused.returncode == 255
    assert "Permission denied" in refused.stderr

    sshd.authorize(public)
    accepted = _ssh(sshd.info, key, known, "echo hello")
    assert (accepted.returncode, accepted.stdout) == (0, "hello\n"), accepted.stderr


def test_stop_frees_the_port_and_is_idempotent(sshd: Sshd) -> None:
    port, pid = sshd.info.port, sshd.pid
    assert pid is not None
    assert not _port_is_free(port)

    sshd.stop()
    sshd.stop()

    assert not sshd.running
    assert not psutil_pid_alive(pid)
    assert _port_is_free(port)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_restart_keeps_host_key_and_authorized_keys(
    sshd: Sshd, client_key: tuple[Path, str], tmp_path: Path
) -> None:
    before = sshd.info
    sshd.stop()
    after = sshd.start()

    assert after.host_key == before.host_key
    result = _ssh(after, client_key[0], _known_hosts(tmp_path, after), "echo again")
    assert (result.returncode, result.stdout) == (0, "again\n"), result.stderr


def _remote_sleep(
    sshd: Sshd, client_key: tuple[Path, str], tmp_path: Path
) -> tuple[subprocess.Popen[bytes], int]:
    """An ssh client whose remote command sleeps; returns it and the remote pid."""
    marker = tmp_path / "started"
    argv = _ssh_argv(
        sshd.info,
        client_key[0],
        _known_hosts(tmp_path, sshd.info),
        f"echo $$ > {marker}; exec sleep 60",
    )
    client = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    _wait_for(lambda: marker.exists() and marker.read_text().strip() != "", "the remote sleep")
    return client, int(marker.read_text())


def test_killing_a_session_cuts_the_client_and_stop_reaps_the_orphan(
    sshd: Sshd, client_key: tuple[Path, str], tmp_path: Path
) -> None:
    client, remote_sleep = _remote_sleep(sshd, client_key, tmp_path)
    try:
        sessions = sshd.session_pids()
        assert sessions, "an authenticated connection has a per-connection sshd child"
        for pid in sessions:
            os.kill(pid, signal.SIGKILL)
        assert client.wait(timeout=SSH_TIMEOUT) == 255
        # As on a real target, the command outlives its connection ...
        assert psutil_pid_alive(remote_sleep)
        sshd.stop()
        # ... but the fixture does not let it leak into the next test.
        assert not psutil_pid_alive(remote_sleep)
    finally:
        client.kill()
        client.communicate(timeout=SSH_TIMEOUT)


def test_run_dir_with_a_space(tmp_path: Path, client_key: tuple[Path, str]) -> None:
    with Sshd(tmp_path / "run dir", authorized_keys=[client_key[1]]) as server:
        result = _ssh(server.info, client_key[0], _known_hosts(tmp_path, server.info), "echo ok")
        assert (result.returncode, result.stdout) == (0, "ok\n"), result.stderr


def test_stop_ends_live_sessions_too(
    sshd: Sshd, client_key: tuple[Path, str], tmp_path: Path
) -> None:
    client, remote_sleep = _remote_sleep(sshd, client_key, tmp_path)
    try:
        sshd.stop()
        assert client.wait(timeout=SSH_TIMEOUT) == 255
        _wait_for(lambda: not psutil_pid_alive(remote_sleep), "the remote sleep to die")
    finally:
        client.kill()
        client.communicate(timeout=SSH_TIMEOUT)


def test_pause_holds_new_connections_until_resume(sshd: Sshd) -> None:
    sshd.pause()
    with socket.create_connection(("127.0.0.1", sshd.info.port), timeout=2) as sock:
        # The kernel completes the handshake into the backlog, but nobody speaks SSH.
        sock.settimeout(0.3)
        with pytest.raises(TimeoutError):
            sock.recv(64)
        sshd.resume()
        sock.settimeout(WAIT_TIMEOUT)
        assert sock.recv(64).startswith(b"SSH-2.0-")


def test_stop_works_while_paused(sshd: Sshd) -> None:
    port = sshd.info.port
    sshd.pause()
    sshd.stop()
    assert _port_is_free(port)


def test_port_taken_before_sshd_binds_is_retried(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, client_key: tuple[Path, str]
) -> None:
    module = sys.modules[Sshd.__module__]
    real_free_port = module._free_port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        offered = iter([taken])
        monkeypatch.setattr(module, "_free_port", lambda a: next(offered, 0) or real_free_port(a))

        with Sshd(tmp_path / "run", authorized_keys=[client_key[1]]) as server:
            assert server.info.port != taken
            assert f"Bind to port {taken} on 127.0.0.1 failed" in server.log_text()
            result = _ssh(server.info, client_key[0], _known_hosts(tmp_path, server.info), "true")
            assert result.returncode == 0, result.stderr


def test_invalid_config_reports_sshd_t_output(tmp_path: Path) -> None:
    bad = tmp_path / "bad.template"
    bad.write_text(find_template().read_text() + "\nNoSuchOption yes\n")
    server = Sshd(tmp_path / "run", template=bad)
    with pytest.raises(SshdError, match="NoSuchOption"):
        server.start()
    assert not server.running


def test_sshd_available_names_the_fix() -> None:
    assert sshd_available() is None
    reason = sshd_available("/nonexistent/sbin/sshd")
    assert reason is not None
    assert "apt-get install -y openssh-server" in reason
    assert "absolute" in (sshd_available("sshd") or "")


def test_find_template_honours_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    default = find_template()
    assert default.name == "sshd_config.template"
    assert default.parent.parts[-2:] == ("bastion", "data")  # the package's: a wheel has it

    custom = tmp_path / "custom.template"
    custom.write_text(default.read_text())
    monkeypatch.setenv(TEMPLATE_ENV, str(custom))
    assert find_template() == custom

    monkeypatch.setenv(TEMPLATE_ENV, str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError):
        find_template()


# -- user certificates --------------------------------------------------------------


def _sign(tmp_path: Path, ca: Path, key_id: str, principal: str, serial: int) -> Path:
    """A fresh client key (not in authorized_keys) and its certificate, by ssh-keygen:
    `-i KEY` makes ssh present KEY-cert.pub, then the plain key (which is refused)."""
    key = tmp_path / f"user-{serial}"
    _keygen(key)
    subprocess.run(
        ["ssh-keygen", "-q", "-s", str(ca), "-I", key_id, "-n", principal,
         "-z", str(serial), "-V", "-1m:+10m", str(key.with_suffix(".pub"))],
        stdin=subprocess.DEVNULL, capture_output=True, check=True, timeout=SSH_TIMEOUT,
    )  # fmt: skip
    assert Path(f"{key}-cert.pub").is_file()
    return key


def test_by_default_no_ca_is_trusted_and_the_user_accepts_its_own_name(
    sshd: Sshd, tmp_path: Path
) -> None:
    user = sshd.info.user
    assert sshd.trusted_ca_path.read_text() == ""
    assert sshd.trusted_ca_path.stat().st_mode & 0o777 == 0o600
    assert (sshd.principals_dir / user).read_text() == f"{user}\n"
    ca = tmp_path / "ca"
    _keygen(ca)
    key = _sign(tmp_path, ca, "req_untrusted", user, 1)

    refused = _ssh(sshd.info, key, _known_hosts(tmp_path, sshd.info), "echo hello")

    assert refused.returncode == 255 and "Permission denied" in refused.stderr
    assert "ID req_untrusted (serial 1)" in sshd.log_text()  # presented, and failed
    assert login_certificates(sshd.log_text()) == []


def test_trust_user_cas_takes_effect_at_the_next_login_without_a_restart(
    sshd: Sshd, tmp_path: Path
) -> None:
    ca = tmp_path / "ca"
    ca_line = _keygen(ca)
    key = _sign(tmp_path, ca, "req_trusted", sshd.info.user, 7)
    known, pid = _known_hosts(tmp_path, sshd.info), sshd.pid

    sshd.trust_user_cas(["# a comment line, as in `bastion ca public`", ca_line])
    accepted = _ssh(sshd.info, key, known, "echo hello")
    assert (accepted.returncode, accepted.stdout) == (0, "hello\n"), accepted.stderr
    assert login_certificates(sshd.log_text()) == [("req_trusted", 7)]

    sshd.trust_user_cas([])
    refused = _ssh(sshd.info, key, known, "echo hello")
    assert refused.returncode == 255
    assert sshd.pid == pid  # no restart, no SIGHUP: sshd reads the file at each login
    assert login_certificates(sshd.log_text()) == [("req_trusted", 7)]


def test_principals_say_which_certificates_a_user_accepts(
    tmp_path: Path, client_key: tuple[Path, str]
) -> None:
    ca = tmp_path / "ca"
    ca_line = _keygen(ca)
    key = _sign(tmp_path, ca, "req_deploy", "deploy", 3)  # principal "deploy", not the user
    with Sshd(tmp_path / "default", trusted_user_ca_keys=[ca_line]) as server:
        user = server.info.user
        refused = _ssh(server.info, key, _known_hosts(tmp_path, server.info), "echo hi")
        assert refused.returncode == 255
        assert "Certificate does not contain an authorized principal" in server.log_text()
    principals = {user: ["deploy"]}
    with Sshd(tmp_path / "mapped", trusted_user_ca_keys=[ca_line], principals=principals) as server:
        accepted = _ssh(server.info, key, _known_hosts(tmp_path, server.info), "echo hi")
        assert (accepted.returncode, accepted.stdout) == (0, "hi\n"), accepted.stderr


def test_forwarding_is_off_unless_asked_for(tmp_path: Path, client_key: tuple[Path, str]) -> None:
    forward = ["-R", "0:127.0.0.1:9", "-o", "ExitOnForwardFailure=yes"]
    for allow, expect in ((False, 255), (True, 0)):
        run_dir = tmp_path / f"allow-{allow}"
        with Sshd(run_dir, authorized_keys=[client_key[1]], allow_forwarding=allow) as server:
            word = "yes" if allow else "no"
            config = server.config_path.read_text()
            assert f"\nAllowTcpForwarding {word}\n" in config
            assert f"\nAllowStreamLocalForwarding {word}\n" in config
            argv = _ssh_argv(server.info, client_key[0], _known_hosts(run_dir, server.info), "true")
            result = subprocess.run(
                [*argv[:-2], *forward, *argv[-2:]],
                stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=SSH_TIMEOUT,
            )  # fmt: skip
            assert result.returncode == expect, result.stderr
            assert ("Allocated port" in result.stderr) is allow


def test_set_authorized_keys_replaces_the_trusted_keys(
    sshd: Sshd, client_key: tuple[Path, str], tmp_path: Path
) -> None:
    known = _known_hosts(tmp_path, sshd.info)
    sshd.set_authorized_keys([])
    assert sshd.authorized_keys_path.read_text() == ""
    assert sshd.authorized_keys_path.stat().st_mode & 0o777 == 0o600
    assert _ssh(sshd.info, client_key[0], known, "true").returncode == 255

    sshd.set_authorized_keys([client_key[1]])
    result = _ssh(sshd.info, client_key[0], known, "echo back")
    assert (result.returncode, result.stdout) == (0, "back\n"), result.stderr


def test_file_lines_are_checked(sshd: Sshd) -> None:
    with pytest.raises(TypeError, match="sequence of lines"):
        sshd.trust_user_cas("ssh-ed25519 AAAA")
    with pytest.raises(ValueError, match="more than one line"):
        sshd.trust_user_cas(["ssh-ed25519 AAAA\nssh-ed25519 BBBB"])
    with pytest.raises(ValueError, match="principals file"):
        Sshd(sshd.run_dir / "x", principals={"../etc": ["root"]})


def test_login_certificates_reads_accepted_certificate_logins_only() -> None:
    log = "\n".join(
        [
            'Accepted certificate ID "req_a" (serial 42) signed by ED25519 CA SHA256:x via /f',
            "Accepted publickey for root from 127.0.0.1 port 50312 ssh2: ED25519-CERT "
            "SHA256:abc ID req_a (serial 42) CA ED25519 SHA256:def",
            "Accepted publickey for root from 127.0.0.1 port 50313 ssh2: ED25519 SHA256:abc",
            "Failed publickey for root from 127.0.0.2 port 50314 ssh2: ED25519-CERT "
            "SHA256:abc ID req_b (serial 43) CA ED25519 SHA256:def",
            "Accepted publickey for deploy from ::1 port 7 ssh2: ECDSA-CERT "
            "SHA256:abc ID req c (serial 18446744073709551615) CA RSA SHA256:def",
        ]
    )
    assert login_certificates(log) == [("req_a", 42), ("req c", 2**64 - 1)]


def psutil_pid_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
