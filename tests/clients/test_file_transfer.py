"""File transfer through bastion with stock clients: scp, sftp and paramiko against the
real sshd, byte-exact, every operation decided by the gate and journaled without content."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

from bastion.core.defaults import MAX_HELD_BYTES_PER_TENANT
from bastion.devtools.rsyslog import Rsyslog, rsyslog_available
from bastion.devtools.sshd_fixture import SshdInfo
from tests.harness import (
    PASSPHRASE,
    Agent,
    Bastion,
    Result,
    make_bastion,
    policy_toml,
    wait_for,
    witness_caught_up,
    write_bastion_toml,
)

MARKER = b"BASTION-CONTENT-MARKER-7f3a"


def payload(size: int) -> bytes:
    """Random bytes around a marker no record may hold."""
    return os.urandom(size // 2) + MARKER + os.urandom(size - size // 2)


def files_policy(sshd: SshdInfo, root: Path, **account: Any) -> str:
    files = {"read": [f"{root}/readable/**", f"{root}/rw/**"], "write": [f"{root}/rw/**"]}
    return policy_toml(sshd, files=files, **account)


@pytest.fixture
def area(tmp_path: Path) -> Path:
    root = tmp_path / "target"
    for d in ("readable", "rw", "secret"):
        (root / d).mkdir(parents=True)
    return root


@pytest.fixture
def session_files(bastion: Bastion, area: Path) -> Bastion:
    bastion.write_policy(files_policy(bastion.sshd, area))
    return bastion


class Approver:
    """Answers every card yes (or no) while a client runs, and keeps the cards."""

    def __init__(self, b: Bastion, approve: bool = True, kinds: tuple[str, ...] = ()) -> None:
        self.b, self.approve, self.kinds = b, approve, kinds
        self.cards: list[dict[str, Any]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            for card in self.b.op("pending", wait=0.5) or []:
                self.cards.append(card)
                yes = self.approve if card["kind"] in (self.kinds or (card["kind"],)) else True
                self.b.answer(card, yes)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)


def client(b: Bastion, agent: Agent, argv: list[str], approve: bool = True, **kw: Any) -> Result:
    approver = Approver(b, approve, **kw)
    try:
        return agent.wait(agent.start([], argv=argv), timeout=120)
    finally:
        approver.close()


def ssh_opts(b: Bastion) -> list[str]:
    return ["-F", str(b.config)]


def journal_bytes(b: Bastion) -> bytes:
    return b"".join(p.read_bytes() for p in (b.home.root / "journal").rglob("*") if p.is_file())


def activity(b: Bastion) -> list[dict[str, Any]]:
    r = b.cli("audit", "activity", "--json", "--passphrase-stdin", stdin=PASSPHRASE + "\n")
    return json.loads(r.stdout)


def exported(b: Bastion) -> str:
    return b.cli("audit", "export", "--passphrase-stdin", stdin=PASSPHRASE + "\n").stdout


def no_content_anywhere(b: Bastion) -> None:
    assert MARKER not in journal_bytes(b)
    assert MARKER.decode() not in exported(b)
    assert MARKER not in b.log.read_bytes()


def test_scp_up_and_down_byte_exact(session_files: Bastion, area: Path, tmp_path: Path) -> None:
    b = session_files
    agent = b.agent()
    data = payload(3 * 1024 * 1024)
    local = tmp_path / "up.bin"
    local.write_bytes(data)
    up = client(b, agent, ["scp", *ssh_opts(b), str(local), f"web1:{area}/rw/up.bin"])
    assert up.rc == 0, up.stderr
    assert (area / "rw" / "up.bin").read_bytes() == data
    back = tmp_path / "down.bin"
    down = client(b, agent, ["scp", *ssh_opts(b), f"web1:{area}/rw/up.bin", str(back)])
    assert down.rc == 0, down.stderr
    assert back.read_bytes() == data
    journal = exported(b)
    assert f"{area}/rw/up.bin" in journal and hashlib.sha256(data).hexdigest() in journal
    no_content_anywhere(b)


def test_sftp_batch_put_get_ls_rm_rename(
    session_files: Bastion, area: Path, tmp_path: Path
) -> None:
    b = session_files
    agent = b.agent()
    data = payload(200_000)
    (tmp_path / "a.bin").write_bytes(data)
    rw = area / "rw"
    batch = tmp_path / "batch"
    batch.write_text(
        f"put {tmp_path}/a.bin {rw}/a.bin\n"
        f"rename {rw}/a.bin {rw}/b.bin\n"
        f"ls -l {rw}\n"
        f"get {rw}/b.bin {tmp_path}/b.bin\n"
        f"mkdir {rw}/sub\n"
        f"rmdir {rw}/sub\n"
        f"rm {rw}/b.bin\n"
    )
    r = client(b, agent, ["sftp", *ssh_opts(b), "-b", str(batch), "web1"])
    assert r.rc == 0, r.stderr
    assert "b.bin" in r.stdout.decode()
    assert (tmp_path / "b.bin").read_bytes() == data
    assert not (rw / "b.bin").exists() and not (rw / "a.bin").exists()
    journal = exported(b)
    for op in ("write", "rename", "list", "read", "mkdir", "rmdir", "remove"):
        assert f'"op": "{op}"' in journal or f'"op":"{op}"' in journal, op
    no_content_anywhere(b)


def test_a_read_outside_files_read_is_policy_denied(
    session_files: Bastion, area: Path, tmp_path: Path
) -> None:
    b = session_files
    agent = b.agent()
    (area / "secret" / "s.txt").write_text("secret\n")
    (area / "readable" / "r.txt").write_text("readable\n")
    ok = client(b, agent, ["scp", *ssh_opts(b), f"web1:{area}/readable/r.txt", str(tmp_path)])
    assert ok.rc == 0, ok.stderr  # the positive control
    assert (tmp_path / "r.txt").read_text() == "readable\n"
    r = client(b, agent, ["scp", *ssh_opts(b), f"web1:{area}/secret/s.txt", str(tmp_path)])
    assert r.rc != 0
    assert r.code == "POLICY_DENIED", r.stderr
    assert "matches no files.read rule" in r.error["message"]  # type: ignore[index]
    assert not (tmp_path / "s.txt").exists()


def test_a_symlink_out_of_the_rules_is_refused(
    session_files: Bastion, area: Path, tmp_path: Path
) -> None:
    b = session_files
    agent = b.agent()
    (area / "secret" / "s.txt").write_text("secret\n")
    (area / "readable" / "link").symlink_to(area / "secret" / "s.txt")
    r = client(b, agent, ["scp", *ssh_opts(b), f"web1:{area}/readable/link", str(tmp_path)])
    assert r.code == "POLICY_DENIED", r.stderr
    assert "where the target resolves it" in r.error["message"]  # type: ignore[index]
    assert not (tmp_path / "link").exists()


def test_per_command_upload_is_a_file_card(bastion: Bastion, area: Path, tmp_path: Path) -> None:
    b = bastion
    b.write_policy(files_policy(b.sshd, area, approval="per-command"))
    agent = b.agent()
    data = payload(300_000)
    local = tmp_path / "f.bin"
    local.write_bytes(data)
    dest = area / "rw" / "f.bin"
    denied = client(
        b, agent, ["scp", *ssh_opts(b), str(local), f"web1:{dest}"], False, kinds=("command",)
    )
    assert denied.rc != 0
    assert denied.code == "CALL_DENIED", denied.stderr
    assert not dest.exists()
    approver = Approver(b)
    try:
        ok = agent.wait(
            agent.start([], argv=["scp", *ssh_opts(b), str(local), f"web1:{dest}"]), 120
        )
    finally:
        approver.close()
    assert ok.rc == 0, ok.stderr
    assert dest.read_bytes() == data
    files = [c["file"] for c in approver.cards if c.get("file")]
    assert files and files[-1]["sha256"] == hashlib.sha256(data).hexdigest()
    assert files[-1]["path"] == str(dest) and files[-1]["size"] == len(data)
    shown = b.cli("pending").stdout  # renders without error when nothing waits
    assert shown is not None
    no_content_anywhere(b)


def test_vault_locked_mid_session_refuses_the_next_operation(
    session_files: Bastion, area: Path, tmp_path: Path
) -> None:
    b = session_files
    (tmp_path / "one").write_bytes(b"one")
    (tmp_path / "two").write_bytes(b"two")
    rw = area / "rw"
    # An interactive sftp session: the first put, then the vault locks, then the second.
    approver = Approver(b)
    proc = subprocess.Popen(
        ["sftp", *ssh_opts(b), "-b", "-", "web1"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stdin is not None
        proc.stdin.write(f"put {tmp_path}/one {rw}/one\n".encode())
        proc.stdin.flush()
        wait_for(lambda: (rw / "one").exists() and (rw / "one").read_bytes() == b"one", 60)
        b.cli("lock")
        _, err = proc.communicate(f"put {tmp_path}/two {rw}/two\n".encode(), timeout=60)
    finally:
        approver.close()
        if proc.poll() is None:
            proc.kill()
    assert not (rw / "two").exists()
    assert b'"VAULT_LOCKED"' in err, err


def paramiko_sftp(b: Bastion) -> tuple[Any, Any]:
    """paramiko's SFTPClient over the proxy line of the ssh-config, `auth_none`."""
    paramiko = pytest.importorskip("paramiko")
    proxy = next(
        line.split(None, 1)[1]
        for line in b.config.read_text().splitlines()
        if line.strip().startswith("ProxyCommand")
    )
    proxy = proxy.replace("%h", "web1").replace("%p", "22").replace("%r", b.sshd.user)
    transport = paramiko.Transport(paramiko.ProxyCommand(proxy))
    transport.start_client(timeout=30)
    transport.auth_none(b.sshd.user)
    return transport, paramiko.SFTPClient.from_transport(transport)


def test_a_write_cut_off_mid_file_ends_unknown(session_files: Bastion, area: Path) -> None:
    b = session_files
    approver = Approver(b)
    try:
        transport, sftp = paramiko_sftp(b)
        f = sftp.open(f"{area}/rw/cut.bin", "wb")
        f.write(b"x" * 100_000)
        f.flush()
        wait_for(lambda: (area / "rw" / "cut.bin").stat().st_size == 100_000, 30)
        transport.close()  # the agent goes away with the file open
    finally:
        approver.close()

    def ended_unknown() -> bool:
        rows = [r for r in activity(b) if "cut.bin" in json.dumps(r)]
        return any(r.get("outcome") == "unknown" for r in rows)

    wait_for(ended_unknown, 30)


def test_paramiko_sftp_client(session_files: Bastion, area: Path) -> None:
    b = session_files
    approver = Approver(b)
    try:
        transport, sftp = paramiko_sftp(b)
        assert sftp is not None
        data = payload(100_000)
        with sftp.open(f"{area}/rw/p.bin", "wb") as f:
            f.write(data)
        with sftp.open(f"{area}/rw/p.bin", "rb") as f:
            assert f.read() == data
        assert "p.bin" in sftp.listdir(f"{area}/rw")
        sftp.close()
        transport.close()
    finally:
        approver.close()
    assert (area / "rw" / "p.bin").read_bytes() == data
    no_content_anywhere(b)


def test_other_subsystems_stay_refused_and_allow_accounts_have_no_files(
    bastion: Bastion, tmp_path: Path
) -> None:
    b = bastion
    agent = b.agent()
    other = client(b, agent, ["ssh", *ssh_opts(b), "-s", "web1", "netconf"])
    assert other.code == "UNSUPPORTED_REQUEST", other.stderr
    assert "does not open a subsystem" in other.error["message"]  # type: ignore[index]
    b.write_policy(policy_toml(b.sshd, allow=["uptime"]))
    (tmp_path / "x").write_bytes(b"x")
    r = client(b, agent, ["scp", *ssh_opts(b), str(tmp_path / "x"), f"web1:{tmp_path}/y"])
    assert r.code == "POLICY_DENIED", r.stderr
    assert "has no file access" in r.error["message"]  # type: ignore[index]
    assert not (tmp_path / "y").exists()


def test_no_file_content_reaches_the_witness_syslog(
    tmp_path: Path, sshd: SshdInfo, client_key: tuple[Path, str], area: Path
) -> None:
    """A witnessed gateway (rsyslog over TCP) sends each file operation's summary off the
    box: the path is there, the content never (nor in the journal or the log). Control:
    the collector got the operations' records at all."""
    reason = rsyslog_available()
    if reason:
        pytest.skip(reason)
    collector = Rsyslog(tmp_path / "rsyslog").start()
    b = make_bastion(tmp_path / "home", sshd, client_key[0], start=False)
    try:
        b.write_policy(files_policy(sshd, area))
        write_bastion_toml(b, f'[witness]\nsyslog = "{collector.tcp}"\n')
        b.start_daemon()
        b.unlock()
        agent = b.agent()
        data = payload(256 * 1024)
        local = tmp_path / "up.bin"
        local.write_bytes(data)
        up = client(b, agent, ["scp", *ssh_opts(b), str(local), f"web1:{area}/rw/witnessed.bin"])
        assert up.rc == 0, up.stderr
        back = tmp_path / "back.bin"
        down = client(b, agent, ["scp", *ssh_opts(b), f"web1:{area}/rw/witnessed.bin", str(back)])
        assert down.rc == 0 and back.read_bytes() == data, down.stderr
        witness_caught_up(b)
        collector.wait_for(lambda text: "witnessed.bin" in text)
        assert MARKER not in collector.output.read_bytes()
        no_content_anywhere(b)
    finally:
        b.close()
        collector.stop()


def test_a_path_that_cannot_be_carried_is_refused_by_the_gate_and_journaled(
    session_files: Bastion, area: Path
) -> None:
    """A path that is not UTF-8, or relative before the target said where home is, is
    a request the gate refuses (`UNSUPPORTED_REQUEST`, journaled `denied`), not a
    status the gateway makes up on the side. Control: the same client's valid path."""
    b = session_files
    approver = Approver(b)
    try:
        transport, sftp = paramiko_sftp(b)
        for bad in (f"{area}/rw/".encode() + b"\xff", b"relative.txt"):
            with pytest.raises(OSError):
                sftp.stat(bad)
        (area / "rw" / "ok.txt").write_bytes(b"ok")
        assert sftp.stat(f"{area}/rw/ok.txt").st_size == 2
        sftp.close()
        transport.close()
    finally:
        approver.close()
    rows = activity(b)
    refused = [r for r in rows if r.get("code") == "UNSUPPORTED_REQUEST"]
    assert len(refused) == 2, rows
    said = exported(b)
    assert "not UTF-8" in said and "a relative path before the target said" in said


def test_uploads_held_for_file_cards_have_a_share_and_give_it_back(
    bastion: Bastion, area: Path
) -> None:
    """A per-command account's uploads are held in the gateway until their cards are
    answered; a tenant holding MAX_HELD_BYTES_PER_TENANT over several open files (never
    closed) gets GATEWAY_BUSY for the write past it, journaled denied, and nothing of it
    reaches the target. Control: once that connection is gone its bytes are given back,
    and the next upload raises its file card as any does."""
    b = bastion
    b.write_policy(files_policy(b.sshd, area, approval="per-command"))
    chunk = os.urandom(1024 * 1024)
    approver = Approver(b)  # the session card
    try:
        transport, sftp = paramiko_sftp(b)
        held = []
        with pytest.raises(OSError):
            for i in range(MAX_HELD_BYTES_PER_TENANT // (64 * 1024 * 1024) + 1):
                f = sftp.open(f"{area}/rw/held-{i}.bin", "wb")
                f.set_pipelined(True)
                held.append(f)
                for _ in range(64):  # 64 MiB: the most one file card holds
                    f.write(chunk)
                f.flush()
        transport.close()
    finally:
        approver.close()
    busy = [r for r in activity(b) if r.get("code") == "GATEWAY_BUSY"]
    assert busy, activity(b)
    assert not list((area / "rw").glob("held-*"))
    wait_for(lambda: "GATEWAY_BUSY" in b.log.read_text(), 30)

    # Given back: a small upload from a new connection asks its file card, and lands.
    approver = Approver(b)
    try:
        transport, sftp = paramiko_sftp(b)
        with sftp.open(f"{area}/rw/after.bin", "wb") as f:
            f.write(b"small")
        sftp.close()
        transport.close()
    finally:
        approver.close()
    assert (area / "rw" / "after.bin").read_bytes() == b"small"
    assert any(c.get("file") for c in approver.cards)
