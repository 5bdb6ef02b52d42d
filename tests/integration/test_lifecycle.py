"""Gateway lifetime, process lifetime, keyring unlock, key import (issue 2)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from bastion.devtools.sshd_fixture import SshdInfo
from tests.harness import PASSPHRASE, Bastion, wait_for

REPO = Path(__file__).resolve().parents[2]


def test_sigterm_shuts_down_cleanly(bastion: Bastion) -> None:
    assert bastion.daemon is not None
    bastion.daemon.send_signal(signal.SIGTERM)
    assert bastion.daemon.wait(20) == 0
    assert not bastion.home.agent_socket.exists()
    assert not bastion.home.operator_socket.exists()
    assert "gateway stopped" in bastion.log.read_text()
    r = bastion.agent().run("true")
    assert r.rc == 255 and r.code == "INTERNAL" and "not running" in r.error["message"]
    # Everywhere else the JSON line is the last line on stderr.
    assert r.stderr.strip().splitlines()[-1].startswith("proxy dialer")


def test_gateway_restart_ends_every_approval(bastion: Bastion, tmp_path: Path) -> None:
    agent = bastion.agent()
    rid = agent.start("true")
    bastion.approve_next()
    assert agent.wait(rid).rc == 0
    bastion.stop_daemon()
    bastion.start_daemon()
    assert json.loads(bastion.cli("status", "--json").stdout)["locked"] is True
    bastion.unlock()
    marker = tmp_path / "marker-restart"
    rid = agent.start(f"touch {marker}")
    card = bastion.next_card()
    assert card["subject"]["pid"] == agent.pid
    assert not marker.exists()  # nothing runs before the answer
    bastion.answer(card, False)
    assert agent.wait(rid).code == "SESSION_DENIED"
    assert not marker.exists()


def test_process_exit_ends_its_session_without_a_new_request(bastion: Bastion) -> None:
    agent = bastion.agent()
    rid = agent.start("true")
    bastion.approve_next()
    assert agent.wait(rid).rc == 0
    assert [s["subject"]["pid"] for s in bastion.op("sessions")] == [agent.pid]
    agent.close()
    wait_for(lambda: bastion.op("sessions") == [])


def test_a_card_dies_with_its_process(bastion: Bastion) -> None:
    agent = bastion.agent()
    agent.start("true")
    card = bastion.next_card()
    agent.close()
    wait_for(lambda: bastion.op("pending") == [])
    r = bastion.cli("decide", card["id"], "approve", check=False)
    assert r.returncode == 1 and "no pending card" in r.stderr


def test_keyring_unlock(tmp_path: Path, sshd: SshdInfo, client_key: tuple[Path, str]) -> None:
    env = {
        **os.environ,
        "PYTHON_KEYRING_BACKEND": "tests.keyring_file_backend.FileKeyring",
        "BASTION_TEST_KEYRING": str(tmp_path / "keyring.json"),
        "PYTHONPATH": str(REPO),
    }
    home = tmp_path / "home"

    def cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "bastion.cli", "--home", str(home), *args],
            input=stdin,
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )

    assert cli("init", "--passphrase-stdin", "--keyring", stdin=PASSPHRASE + "\n").returncode == 0
    assert PASSPHRASE in (tmp_path / "keyring.json").read_text()
    b = Bastion(tmp_path, sshd)
    b.start_daemon()
    try:
        r = cli("unlock", "--keyring")
        assert r.returncode == 0, r.stderr
        assert json.loads(cli("status", "--json").stdout)["locked"] is False
        (tmp_path / "keyring.json").write_text("{}")
        cli("lock")
        r = cli("unlock", "--keyring")
        assert r.returncode == 1 and "no passphrase" in r.stderr
    finally:
        b.close()


def test_import_encrypted_key_asks_for_its_passphrase(bastion: Bastion, tmp_path: Path) -> None:
    key = tmp_path / "enc"
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ecdsa", "-N", "s3cret", "-f", str(key)], check=True, timeout=30
    )
    r = bastion.cli("key", "import", "enc", str(key), check=False)
    assert r.returncode == 1 and "--key-passphrase-stdin" in r.stderr
    r = bastion.cli(
        "key", "import", "enc", str(key), "--key-passphrase-stdin", stdin="wrong\n", check=False
    )
    assert r.returncode == 1 and "passphrase" in r.stderr
    bastion.cli("key", "import", "enc", str(key), "--key-passphrase-stdin", stdin="s3cret\n")
    public = bastion.cli("key", "public", "enc").stdout.split()[:2]
    assert public == key.with_suffix(".pub").read_text().split()[:2]
