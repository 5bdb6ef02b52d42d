"""Keys stay in the vault; bad input gets a clear error and changes nothing
(issue 2, acceptance 6 and 8)."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from pathlib import Path

import asyncssh
import pytest

from bastion.agent import proxy
from tests.harness import PASSPHRASE, Bastion, secret_needles


def test_deploy_key_never_appears_unencrypted(
    bastion: Bastion, client_key: tuple[Path, str]
) -> None:
    agent = bastion.agent()
    rid = agent.start("echo hi")
    bastion.approve_next()
    assert agent.wait(rid).rc == 0
    outputs = [agent.run("echo again").stderr, agent.run("true", host="nope").stderr]
    for args in (
        ("key", "list", "--json"),
        ("key", "public", "deploy-key"),
        ("status", "--json"),
        ("sessions", "--json"),
    ):
        r = bastion.cli(*args)
        outputs += [r.stdout, r.stderr]
    bastion.stop_daemon()

    needles = [*secret_needles(client_key[0]), PASSPHRASE.encode()]
    haystacks = {
        p: p.read_bytes() for p in bastion.root.rglob("*") if p.is_file() and not p.is_socket()
    }
    haystacks[Path("<cli output>")] = "\n".join(outputs).encode()
    for path, data in haystacks.items():
        for needle in needles:
            assert needle not in data, f"secret material found in {path}"


def test_daemon_argv_and_environment_hold_no_secret(bastion: Bastion) -> None:
    assert bastion.daemon is not None
    pid = bastion.daemon.pid
    for name in ("cmdline", "environ"):
        assert PASSPHRASE.encode() not in Path(f"/proc/{pid}/{name}").read_bytes()


def test_wrong_passphrase_changes_nothing(bastion: Bastion) -> None:
    bastion.cli("lock")
    before = bastion.home.vault.read_bytes()
    epoch = json.loads(bastion.cli("status", "--json").stdout)["vault_epoch"]
    r = bastion.cli("unlock", "--passphrase-stdin", stdin="wrong\n", check=False)
    assert r.returncode == 1 and "passphrase" in r.stderr.lower()
    status = json.loads(bastion.cli("status", "--json").stdout)
    assert status["locked"] is True and status["vault_epoch"] == epoch
    assert bastion.home.vault.read_bytes() == before


def test_duplicate_label_and_malformed_key_file_change_nothing(
    bastion: Bastion, client_key: tuple[Path, str], tmp_path: Path
) -> None:
    before = bastion.home.vault.read_bytes()
    r = bastion.cli("key", "import", "deploy-key", str(client_key[0]), check=False)
    assert r.returncode == 1 and "already exists" in r.stderr
    junk = tmp_path / "junk"
    junk.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nSECRETISHJUNK\n")
    r = bastion.cli("key", "import", "other", str(junk), check=False)
    assert r.returncode == 1 and "private key" in r.stderr and "SECRETISHJUNK" not in r.stderr
    assert bastion.home.vault.read_bytes() == before
    labels = [k["label"] for k in json.loads(bastion.cli("key", "list", "--json").stdout)]
    assert labels == ["bastion-journal", "deploy-key"]
    r = bastion.cli("key", "remove", "bastion-journal", check=False)
    assert r.returncode == 1 and "bastion's own" in r.stderr


def _ssh_direct(bastion: Bastion, command: list[bytes]) -> subprocess.CompletedProcess[bytes]:
    # No card is raised for these requests, so the test process may be the client.
    return subprocess.run(
        [b"ssh", b"-F", str(bastion.config).encode(), b"web1", *command],
        capture_output=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


def _error(stderr: bytes) -> dict:
    return json.loads(stderr.strip().splitlines()[-1])["error"]


def test_oversized_and_non_utf8_commands_are_refused(bastion: Bastion) -> None:
    big = [b"x" * 100_000] * 10  # ~1 MiB in ten arguments (one may be at most 128 KiB)
    r = _ssh_direct(bastion, big)
    assert r.returncode == 77, r.stderr[-300:]
    assert _error(r.stderr)["code"] == "UNSUPPORTED_REQUEST"
    assert "1000009 bytes; the limit is 65536" in _error(r.stderr)["message"]
    r = _ssh_direct(bastion, [b"echo \xff\xfe"])
    assert r.returncode == 77 and _error(r.stderr)["code"] == "UNSUPPORTED_REQUEST"
    assert "UTF-8" in _error(r.stderr)["message"]
    assert bastion.op("pending") == []


def test_nul_in_command_is_refused(bastion: Bastion) -> None:
    """OpenSSH cannot put a NUL in argv, so a raw SSH client sends it."""

    async def run() -> asyncssh.SSHCompletedProcess:
        known = bastion.home.known_hosts.read_text().split(None, 1)[1]
        async with asyncssh.connect(
            "web1",
            username=bastion.sshd.user,
            known_hosts=([asyncssh.import_public_key(known)], [], []),
            proxy_command=[
                sys.executable,
                "-I",
                "-S",
                proxy.__file__,
                "--socket",
                str(bastion.home.agent_socket),
                "web1",
                "22",
                bastion.sshd.user,
            ],
            config=None,
            client_keys=None,
            agent_path=None,
        ) as conn:
            return await conn.run(b"echo a\0b", encoding=None)  # type: ignore[arg-type]

    result = asyncio.run(asyncio.wait_for(run(), 60))
    assert result.exit_status == 77
    err = json.loads(result.stderr.strip().splitlines()[-1])["error"]
    assert err["code"] == "UNSUPPORTED_REQUEST" and "NUL" in err["message"]


@pytest.mark.parametrize("junk", [b"GET / HTTP/1.0\r\n\r\n", b"\x00" * 5000, b"BASTION/1 {]\n"])
def test_garbage_on_the_agent_socket(bastion: Bastion, junk: bytes) -> None:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(str(bastion.home.agent_socket))
        s.sendall(junk)
        reply = s.recv(1000)
        assert reply.startswith(b"ERR ")
        assert s.recv(1000) == b""  # and closed
    # A valid header followed by garbage instead of SSH: closed, nothing else.
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(str(bastion.home.agent_socket))
        s.sendall(b'BASTION/1 {"host": "web1", "port": "22", "user": "root"}\n')
        assert s.recv(3) == b"OK\n"
        s.sendall(junk + b"\r\n")
        data = b""
        while chunk := s.recv(4096):
            data += chunk
        assert b"SSH-2.0-bastion" in data
    # The gateway still serves.
    assert json.loads(bastion.cli("status", "--json").stdout)["locked"] is False
