"""The gateway and the CLI do not trust paths (issue 44, item 1).

The attack: an agent renamed the bastion home's parent (`mv ~/.local/share
~/.local/share.x`) and rebuilt `~/.local/share/bastion` with symlinks back to the
real vault, journal and sockets and a `policies/` of its own. A gateway that worked
by path loaded that policy, `status` said `policy: ok`, and a lock and unlock wrote a
real `vault.json` into the agent's directory. With a socket of its own at
`operator/operator.sock`, the operator's next `bastion unlock` sent it the passphrase.

Here: a real gateway on a home at `.local/share/bastion`, real ssh through it, the
real CLI. Before the change each test fails: the rebuilt policy is loaded (the
denied command raises a card instead of POLICY_DENIED), `status` has no `home`, the
unlock replaces the rebuilt home's `vault.json` symlink with a file, and `bastion
unlock` sends the passphrase to whatever listens and prints "unlocked".
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from bastion import journal
from bastion.cli.agents import home_ssh_config
from bastion.devtools.sshd_fixture import SshdInfo
from bastion.home import Home
from bastion.ops import opsock
from bastion.vault import Vault
from tests.harness import (
    FAKE_OPERATOR,
    PASSPHRASE,
    Bastion,
    _copy_made_home,
    _init_home,
    policy_toml,
    wait_for,
)

DENIED = "echo secret*"  # what the real policy denies; the rebuilt one does not


@pytest.fixture
def layout(tmp_path: Path, sshd: SshdInfo, client_key: tuple[Path, str]) -> Iterator[Bastion]:
    """A bastion whose home is `USER/.local/share/bastion`, started and unlocked, with a
    session approved for the agent and a policy that denies `echo secret`."""
    b = Bastion(tmp_path / "b", sshd)
    b.root.mkdir()
    user = Path(tempfile.mkdtemp(prefix="held-"))  # short: the socket paths must fit 107 bytes
    b.home = Home(user / ".local" / "share" / "bastion")
    b.home.root.parent.mkdir(parents=True)
    try:
        if not _copy_made_home(b, client_key[0]):
            _init_home(b, client_key[0])
        b.write_policy(policy_toml(sshd, deny=[DENIED]))
        b.config.write_text(home_ssh_config(b.home))
        b.start_daemon()
        b.unlock()
        yield b
    finally:
        b.close()
        shutil.rmtree(user, ignore_errors=True)


def write_private(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def rebuild(b: Bastion, policy: str) -> tuple[Path, Path]:
    """What the agent did: rename the home's parent, rebuild the home at its path with
    symlinks to everything real but the policies, and a policy directory of its own.
    Returns (the real home where it is now, the rebuilt one)."""
    share = b.home.root.parent
    share.rename(share.with_name("share.x"))
    real, rebuilt = share.with_name("share.x") / b.home.root.name, b.home.root
    rebuilt.mkdir(mode=0o700, parents=True)
    for entry in real.iterdir():
        if entry.name != "policies":
            (rebuilt / entry.name).symlink_to(entry)
    (rebuilt / "policies").mkdir(mode=0o700)
    write_private(rebuilt / "policies" / "test.toml", policy)
    return real, rebuilt


def test_a_home_rebuilt_at_its_path_is_not_read_and_status_and_doctor_say_it_moved(
    layout: Bastion, sshd: SshdInfo
) -> None:
    b = layout
    agent = b.agent()
    rid = agent.start("echo hello")
    b.approve_next()
    assert agent.wait(rid).stdout == b"hello\n"
    assert agent.run("echo secret").code == "POLICY_DENIED"
    epoch = Vault.open(b.home.vault).epoch
    assert json.loads(b.cli("status", "--json").stdout)["home"]["moved"] == []

    real, rebuilt = rebuild(b, policy_toml(sshd))  # the same host, no deny rule
    made = {p.name for p in rebuilt.iterdir()}

    # The policy watch reads before each request: the rebuilt policy is not what it reads.
    r = agent.run("echo secret")
    assert r.rc == 77 and r.code == "POLICY_DENIED", r.stderr
    assert b.op("pending") == []

    status = json.loads(b.cli("status", "--json").stdout)  # through the symlinked operator/
    assert status["policy"]["ok"] is True and status["policy"]["directory"] == str(b.home.policies)
    (sentence,) = status["home"]["moved"]
    assert sentence.startswith(f"the home moved: {rebuilt} is another directory")
    assert f"is now at {real}" in sentence and "restart the gateway" in sentence
    assert f"home:      MOVED: {sentence}" in b.cli("status").stdout
    doctor = b.cli("doctor", "--json", check=False)
    checks = {c["name"]: c for c in json.loads(doctor.stdout)["checks"]}
    assert doctor.returncode == 1 and checks["home"]["status"] == "fail", checks["home"]
    assert (
        checks["home"]["detail"] == sentence
        and "restart `bastion daemon`" in (checks["home"]["fix"])
    )
    assert checks["policy"]["status"] == "skip"
    moved = [r for r in journal.records(real / "journal") if r.type == "home_moved"]
    assert [r.meta for r in moved] == [{"what": "home", "path": str(rebuilt)}]

    # Control: the same edit in the directory the gateway holds is loaded.
    write_private(real / "policies" / "test.toml", policy_toml(sshd))
    rid = agent.start("echo secret")
    card = b.next_card()
    assert card["reason"] == "policy_changed"
    b.answer(card, True)
    assert agent.wait(rid).stdout == b"secret\n"

    # A lock and an unlock replace vault.json in the directory held, never at the path.
    b.cli("lock")
    b.unlock()
    assert (rebuilt / "vault.json").is_symlink()
    assert Vault.open(real / "vault.json").epoch == epoch + 2
    names = {p.name for p in rebuilt.iterdir()}
    assert names == made, names  # nothing new was written there
    assert all((rebuilt / n).is_symlink() for n in names - {"policies"})
    assert [p.name for p in (rebuilt / "policies").iterdir()] == ["test.toml"]


def test_without_a_move_status_and_doctor_say_the_home_is_held(layout: Bastion) -> None:
    home = json.loads(layout.cli("status", "--json").stdout)["home"]
    assert home["path"] == str(layout.home.root) and home["held"] and home["moved"] == []
    assert "MOVED" not in layout.cli("status").stdout
    doctor = layout.cli("doctor", "--json", check=False)
    checks = {c["name"]: c for c in json.loads(doctor.stdout)["checks"]}
    assert checks["home"]["status"] == "ok", checks["home"]
    assert checks["home"]["detail"] == (
        f"{layout.home.root} leads to the directory the gateway holds open"
    )


# -- who answers at the operator socket --------------------------------------------------------


class FakeOperator:
    """A server of the operator wire at `path`, in this process: what an agent could
    bind there. It keeps every byte a client sends and answers an unlock as done."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.received = b""
        self.connections = 0
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(path))
        self.server.listen(4)
        self.server.settimeout(30)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            conn, _ = self.server.accept()
        except OSError:
            return
        self.connections += 1
        with conn:
            conn.settimeout(10)
            while chunk := conn.recv(65536):
                self.received += chunk
                if b"\n" in chunk:
                    conn.sendall(b'{"ok": true, "result": {"locked": false, "vault_epoch": 99}}\n')

    def close(self) -> None:
        self.server.close()
        self.thread.join(15)
        self.path.unlink(missing_ok=True)


def unlock(b: Bastion) -> subprocess.CompletedProcess[str]:
    return b.cli("unlock", "--passphrase-stdin", stdin=PASSPHRASE + "\n", check=False)


def test_unlock_sends_nothing_to_a_socket_the_gateway_did_not_bind(bastion: Bastion) -> None:
    b = bastion
    gateway = b.gateway_pid
    real = b.home.operator_socket
    aside = real.with_name("operator.sock.real")
    real.rename(aside)
    fake = FakeOperator(real)
    try:
        r = unlock(b)
        wait_for(lambda: not fake.thread.is_alive(), timeout=15)  # the CLI hung up
    finally:
        fake.close()
        aside.rename(real)
    assert r.returncode == 1 and "unlocked" not in r.stdout, r
    assert f"is answered by pid {os.getpid()}, not by the gateway" in r.stderr, r.stderr
    assert f"which recorded pid {gateway} in {b.home.gateway_record}" in r.stderr
    assert "nothing was sent" in r.stderr
    assert fake.connections == 1 and fake.received == b""
    # Control: the gateway itself, at the same path.
    b.cli("lock")
    r = unlock(b)
    assert r.returncode == 0 and r.stdout.startswith("unlocked (vault epoch "), r
    assert b.op("status")["locked"] is False


UNSHARE = ("unshare", "--user", "--map-root-user", "--pid", "--fork")  # a sandbox's two


@pytest.mark.skipif(shutil.which("unshare") is None, reason="util-linux unshare is missing")
def test_unlock_sends_nothing_to_a_server_in_namespaces_of_its_own(
    bastion: Bastion, tmp_path: Path
) -> None:
    """What a sandboxed agent could do with a rebuilt home: its own server at the socket's
    path, in the user and PID namespaces of a sandbox, and a record naming that very
    process as the gateway. The namespaces refuse it."""
    b = bastion
    real, record = b.home.operator_socket, b.home.gateway_record
    aside, kept = real.with_name("operator.sock.real"), record.read_bytes()
    out = tmp_path / "received"
    real.rename(aside)
    server = subprocess.Popen([*UNSHARE, sys.executable, "-c", FAKE_OPERATOR, str(real), str(out)])
    try:
        wait_for(real.exists, timeout=20)
        (fake,) = psutil.Process(server.pid).children()
        ticks = int(Path(f"/proc/{fake.pid}/stat").read_text().rsplit(")")[1].split()[19])
        links = {ns: os.readlink(f"/proc/{fake.pid}/ns/{ns}") for ns in opsock.NAMESPACES}
        forged = {**opsock.own_record(), "pid": fake.pid, "start_ticks": ticks, "namespaces": links}
        record.write_text(json.dumps(forged))
        r = unlock(b)
        server.wait(20)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)
        real.unlink(missing_ok=True)
        aside.rename(real)
        record.write_bytes(kept)
    assert r.returncode == 1 and "unlocked" not in r.stdout, r
    assert f"is answered by pid {fake.pid}, which is in another pid namespace" in r.stderr
    assert "a sandbox or a container, not the gateway; nothing was sent" in r.stderr
    assert out.read_bytes() == b""
    # Control: the gateway itself, its own record back.
    b.cli("lock")
    r = unlock(b)
    assert r.returncode == 0 and r.stdout.startswith("unlocked (vault epoch "), r
