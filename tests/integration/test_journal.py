"""The journal a reviewer can verify (issue 4, acceptance 5-7): built by a real
gateway serving real ssh commands, then verified offline and tampered with."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from bastion.core.events import EventType
from bastion.devtools.sshd_fixture import SshdInfo
from bastion.journal import chain as journal
from bastion.journal import verify as journal_verify
from tests.harness import PASSPHRASE, Bastion, make_bastion, secret_needles, wait_for
from tests.harness import bastion_cli as cli

SECRET_COMMAND = "echo marker-in-command-7f3a && echo marker-in-output-9c2b"


@pytest.fixture(scope="module")
def busy(
    tmp_path_factory: pytest.TempPathFactory, sshd_server: object, client_key: tuple[Path, str]
) -> Path:
    """A home whose journal holds approvals, denials, outcomes, two lifetimes,
    a revocation and a lock; the gateway is stopped afterwards."""
    root = tmp_path_factory.mktemp("busy")
    info: SshdInfo = sshd_server.info  # type: ignore[attr-defined]
    b = make_bastion(root, info, client_key[0])
    try:
        a = b.agent()
        rid = a.start(SECRET_COMMAND)
        b.approve_next()
        assert b"marker-in-output-9c2b" in a.wait(rid).stdout
        assert a.run("exit 4").rc == 4
        assert a.run("true", host="nowhere").code == "UNKNOWN_HOST"
        b.cli("revoke", b.op("sessions")[0]["id"])
        rid = a.start("true")
        b.approve_next()
        assert a.wait(rid).rc == 0
        b.cli("lock")
        assert a.run("true").code == "VAULT_LOCKED"
        b.stop_daemon()
        b.start_daemon()  # a second lifetime
        b.unlock()
        rid = a.start("true")
        b.approve_next()
        assert a.wait(rid).rc == 0
        a.close()
        wait_for(lambda: b.op("sessions") == [])
    finally:
        b.close()
    return root / "home"


def verify(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return cli(home, "audit", "verify", *args)


def test_verify_passes_offline_without_a_passphrase(busy: Path) -> None:
    r = verify(busy)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "intact" in r.stdout
    head = json.loads(cli(busy, "audit", "head", "--json").stdout)
    assert head["seq"] > 30
    assert verify(busy, "--expect-head", head["hash"]).returncode == 0


def tampered(busy: Path, tmp_path: Path, change: Callable[[list[bytes]], list[bytes]]) -> Path:
    """A copy of the busy home whose journal lines went through `change`."""
    home = tmp_path / "home"
    shutil.copytree(busy, home, ignore=shutil.ignore_patterns("*.sock"))
    seg = journal.segments(home / "journal")[0]
    lines = seg.read_bytes().split(b"\n")[:-1]
    seg.write_bytes(b"\n".join(change(lines)) + b"\n")
    return home


def _flip_ct(line: bytes) -> bytes:
    d = json.loads(line)
    ct = bytearray(base64.b64decode(d["ct"]))
    ct[3] ^= 0x01
    d["ct"] = base64.b64encode(bytes(ct)).decode()
    return json.dumps(d, sort_keys=True, separators=(",", ":")).encode()


def _change(index: int, fn: Callable[[bytes], bytes]) -> Callable[[list[bytes]], list[bytes]]:
    return lambda ls: [fn(x) if i == index else x for i, x in enumerate(ls)]


@pytest.mark.parametrize(
    "name,change,expect",
    [
        ("one changed byte", _change(9, _flip_ct), "seq 10): edited"),
        (
            "one changed plaintext field",
            _change(9, lambda x: x.replace(b'"seq":10', b'"seq":10 ')),
            "edited",
        ),
        (
            "an outcome relabelled",
            lambda ls: [x.replace(b'"exit_status":4', b'"exit_status":0') for x in ls],
            "edited",
        ),
        ("a deleted record", lambda ls: ls[:12] + ls[13:], "seq 14): deleted: seq 13..13 missing"),
        (
            "two swapped records",
            lambda ls: [*ls[:12], ls[13], ls[12], *ls[14:]],
            "seq 14): reordered",
        ),
        ("a torn last line", lambda ls: [*ls[:-1], ls[-1][:40]], "torn"),
    ],
)
def test_verify_names_the_first_bad_record(
    busy: Path,
    tmp_path: Path,
    name: str,
    change: Callable[[list[bytes]], list[bytes]],
    expect: str,
) -> None:
    home = tampered(busy, tmp_path, change)
    if name == "a torn last line":  # the torn line has no newline after it
        seg = journal.segments(home / "journal")[0]
        seg.write_bytes(seg.read_bytes().rstrip(b"\n"))
    r = verify(home)
    assert r.returncode == 1, name
    assert "BROKEN at 000000000001.jsonl:" in r.stdout and expect in r.stdout, r.stdout


def test_truncation_is_caught_by_the_head_anchor(busy: Path, tmp_path: Path) -> None:
    head = json.loads(cli(busy, "audit", "head", "--json").stdout)["hash"]
    home = tampered(busy, tmp_path, lambda ls: ls[:-3])
    r = verify(home)
    assert r.returncode == 1 and "truncated" in r.stdout  # head.json still names the end
    (home / "journal" / "head.json").unlink()  # a careful attacker removes it too...
    r = verify(home, "--expect-head", head)
    assert r.returncode == 1 and "truncated" in r.stdout  # ...the recorded head still catches it


def test_a_chain_rebuilt_with_the_public_key_fails(busy: Path, tmp_path: Path) -> None:
    """Everything an attacker can do with the files: new boot key, events
    re-encrypted to the public key, hashes recomputed, vouches copied."""
    home = tmp_path / "home"
    shutil.copytree(busy, home, ignore=shutil.ignore_patterns("*.sock"))
    jdir = home / "journal"
    original = list(journal.records(jdir))
    for seg in journal.segments(jdir):
        seg.unlink()
    (jdir / "head.json").unlink()
    identity = journal.read_identity(jdir)
    forger = journal.Journal(jdir, identity, original[0].boot)
    forger.open()  # a boot record with the forger's own key
    for r in original[1:]:
        if r.type == "boot":
            continue
        meta = dict(r.meta)
        if meta.get("exit_status") == 4:
            meta["exit_status"] = 0  # the lie the forgery is for
        forger.append(EventType(r.type), meta, {"forged": True})
    forger.close()
    r = verify(home)
    assert r.returncode == 1 and "the vouch does not verify" in r.stdout, r.stdout
    # And a forged identity.json is caught against the vault's record of it.
    journal.write_identity(jdir, Ed25519PrivateKey.generate())
    r = verify(home)
    assert r.returncode == 1 and "does not match the journal identity in the vault" in r.stderr


def test_no_command_output_key_or_passphrase_in_plaintext(
    busy: Path, client_key: tuple[Path, str]
) -> None:
    needles = [
        b"marker-in-command-7f3a",
        b"marker-in-output-9c2b",
        PASSPHRASE.encode(),
        *secret_needles(client_key[0]),
    ]
    for path in (busy / "journal").rglob("*"):
        data = path.read_bytes()
        for needle in needles:
            assert needle not in data, f"{needle!r} in {path}"


def test_views_show_endings_and_denials(busy: Path) -> None:
    def view(name: str) -> list[dict]:
        r = cli(busy, "audit", name, "--json", "--passphrase-stdin", stdin=PASSPHRASE + "\n")
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    sessions = view("sessions")
    reasons = [s["end_reason"] for s in sessions]
    assert reasons == ["revoked", "vault_state_changed", "process_changed"], sessions
    assert all(s["subject"]["pid"] and s["approved_at"] and s["ended_at"] for s in sessions)

    rows = view("activity")
    by_command = {r["command"]: r for r in rows}
    assert by_command[SECRET_COMMAND]["outcome"] == "completed"
    assert by_command["exit 4"]["exit_status"] == 4
    denied = [r for r in rows if r["outcome"] == "denied"]
    assert {r["code"] for r in denied} == {"UNKNOWN_HOST", "VAULT_LOCKED"}
    assert all(r["session_id"] is None for r in denied)  # denied before any dispatch
    keys = {
        "request_id",
        "session_id",
        "host",
        "user",
        "command",
        "command_sha256",
        "outcome",
        "code",
        "exit_status",
        "subject",
    }
    assert all(keys <= set(r) for r in rows)


def test_views_need_the_passphrase_when_no_gateway_runs(busy: Path) -> None:
    r = cli(busy, "audit", "activity", "--passphrase-stdin", stdin="wrong\n")
    assert r.returncode == 1 and "passphrase" in r.stderr


def test_a_fresh_gateway_that_never_unlocked_is_not_yet_vouched_for(
    tmp_path: Path, sshd: SshdInfo, client_key: tuple[Path, str]
) -> None:
    """`bastion init` vouched for the journal's first records; what a gateway that was
    never unlocked wrote after them is signed by a boot key nobody vouched for: named
    (`--json`: `unvouched`), and refused by --strict."""
    b = make_bastion(tmp_path, sshd, client_key[0], start=False)
    b.start_daemon()
    b.close()
    r = verify(b.home.root)
    assert r.returncode == 0 and "which the journal identity never vouched for" in r.stdout
    r = cli(b.home.root, "audit", "verify", "--strict")
    assert r.returncode == 1 and "never vouched for (--strict)" in r.stdout, r.stdout
    doc = json.loads(cli(b.home.root, "audit", "verify", "--json").stdout)
    assert doc["ok"] and len(doc["unvouched"]) == 1 and "uncertified" not in doc


def test_a_new_journal_verifies_and_an_emptied_one_does_not(
    tmp_path: Path, sshd: SshdInfo, client_key: tuple[Path, str]
) -> None:
    """Every journal starts with records (`bastion init` writes a boot and its
    vouch), so deleting every segment and head.json is not "intact (0
    records)" -- with --strict or without."""
    b = make_bastion(tmp_path, sshd, client_key[0], start=False)
    r = cli(b.home.root, "audit", "verify", "--strict", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["records"] == 2, r.stdout
    for seg in journal.segments(b.home.journal):
        seg.unlink()
    (b.home.journal / "head.json").unlink()
    for strict in ((), ("--strict",)):
        r = cli(b.home.root, "audit", "verify", *strict)
        assert r.returncode == 1 and "emptied" in r.stdout, r.stdout


def test_a_torn_tail_is_set_aside_and_journaled_at_the_next_start(
    tmp_path: Path, sshd: SshdInfo, client_key: tuple[Path, str]
) -> None:
    b: Bastion = make_bastion(tmp_path, sshd, client_key[0])
    b.stop_daemon()
    seg = journal.segments(b.home.journal)[-1]
    with open(seg, "ab") as f:
        f.write(b'{"boot":"boot_x","ct":"half a reco')
    assert "torn" in verify(b.home.root).stdout
    b.start_daemon()
    b.unlock()
    b.close()
    kept = list(b.home.journal.glob("torn-*.bin"))
    assert len(kept) == 1 and kept[0].read_bytes() == b'{"boot":"boot_x","ct":"half a reco'
    assert any(r.type == "torn_tail" for r in journal.records(b.home.journal))
    assert verify(b.home.root).returncode == 0


def test_segments_rotate_by_size_and_verify_across_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(journal, "SEGMENT_MAX", 4096)
    key = Ed25519PrivateKey.generate()
    identity = journal.write_identity(tmp_path, key)
    j = journal.Journal(tmp_path, identity, "boot_test")
    j.open()
    for i in range(60):
        j.append(EventType.REQUEST_RECEIVED, {"request_id": f"req_{i}"}, {"command": "x" * 100})
    j.vouch(key)
    j.close()
    assert len(journal.segments(tmp_path)) > 3
    v = journal_verify.verify(tmp_path, identity)
    assert v.ok and v.records == 62, v.problem
    events = [
        e
        for r, e in journal.decrypt(journal.records(tmp_path), key)
        if r.type == "request_received"
    ]
    assert len(events) == 60 and all(e["command"] == "x" * 100 for e in events)
    # A later lifetime continues the same chain in the newest segment.
    j2 = journal.Journal(tmp_path, identity, "boot_two")
    assert j2.open()[-1].seq == 62
    j2.vouch(key)
    j2.close()
    assert journal_verify.verify(tmp_path, identity).records == 64


# -- the journal's last mile (issue 18) -------------------------------------------------------


def test_a_whole_record_without_its_newline_is_a_record_not_a_torn_tail(
    tmp_path: Path, sshd: SshdInfo, client_key: tuple[Path, str]
) -> None:
    """A crash can end the journal right after a whole, signed record and before its
    newline. Such a `dispatch_started` says the command may have run: the request reads
    `status_unknown` and its action key does not let it run twice. (Before issue 18 it
    was set aside as a torn tail: `retry_safe`, and the retry ran again.)"""
    b = make_bastion(tmp_path, sshd, client_key[0])
    runs = tmp_path / "runs"
    key = ("-o", "SetEnv=BASTION_ACTION_KEY=deploy-7")
    try:
        agent = b.agent()
        first = agent.start(f"echo ran >> {runs}; sleep 120", ssh_args=key)
        b.approve_next()
        wait_for(runs.exists, 30)
        assert b.daemon is not None
        b.kill_daemon()
        agent.wait(first)
        seg = journal.segments(b.home.journal)[-1]
        data = seg.read_bytes()
        last = json.loads(data.rstrip(b"\n").rsplit(b"\n", 1)[-1])
        assert last["type"] == "dispatch_started", last
        seg.write_bytes(data[:-1])  # the crash came just before the newline
        rid = last["meta"]["request_id"]
        state = json.loads(b.cli("request", rid, "--json").stdout)
        assert state["state"] == "status_unknown", state
        r = verify(b.home.root)
        assert "lacks its final newline" in r.stdout and "torn" not in r.stdout, r.stdout
        b.start_daemon()
        b.unlock()
        again = agent.run(f"echo ran >> {runs}", ssh_args=key)
        assert again.code == "ACTION_OUTCOME_UNKNOWN", again.stderr
        assert runs.read_text() == "ran\n"  # it ran once
        assert b.op("pending") == []  # refused before any card
    finally:
        b.close()
    assert seg.read_bytes().endswith(b"\n") and not list(b.home.journal.glob("torn-*"))
    assert verify(b.home.root).returncode == 0


@pytest.fixture
def small_journal_disk(tmp_path: Path) -> Iterator[Callable[[Path], None]]:
    """Puts a home's journal on a filesystem of its own, 1 MiB, that a test can fill."""
    mounted: list[Path] = []

    def mount(jdir: Path) -> None:
        saved = tmp_path / "journal-before-mount"
        shutil.copytree(jdir, saved)
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(jdir)],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            pytest.skip(f"needs a small filesystem of its own (mount, as root): {r.stderr}")
        mounted.append(jdir)
        for f in saved.iterdir():
            shutil.copy2(f, jdir / f.name)

    yield mount
    for jdir in mounted:
        subprocess.run(["umount", "-l", str(jdir)], check=False)


def fill(directory: Path) -> Path:
    """Write zeros until the filesystem refuses (ENOSPC); returns the filler file."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, bytes(4096))
    except OSError:
        pass
    finally:
        os.close(fd)
    return filler


def test_a_request_the_full_journal_cannot_hold_is_refused_and_nothing_runs(
    tmp_path: Path,
    sshd: SshdInfo,
    client_key: tuple[Path, str],
    small_journal_disk: Callable[[Path], None],
) -> None:
    """The journal's disk is full when a request arrives: a record of its story (its
    first, the only one with its command and subject, or one after it, as the last
    page's slack decides) cannot be written, so it is refused with INTERNAL -- at once,
    or at the intent once the disk has room again and its card was approved -- and
    nothing runs. The disk refused part of a write: those bytes are cut off again, so
    verify says intact, not "edited". (Before issue 18 the request went on with a hole
    in its story, and ran once the card was approved.)"""
    b = make_bastion(tmp_path, sshd, client_key[0], start=False)
    small_journal_disk(b.home.journal)
    marker = tmp_path / "must-not-run"
    try:
        b.start_daemon()
        b.unlock()
        filler = fill(b.home.journal)
        agent = b.agent()  # new: its first command would raise a session card
        rid = agent.start(f"touch {marker}")
        wait_for(lambda: agent.finished(rid) or b.op("pending"), 30)
        if b.op("pending"):  # the old behaviour: make room, and approve what it shows
            filler.unlink()
            b.approve_next()
        refused = agent.wait(rid)
        assert refused.rc == 70 and refused.code == "INTERNAL", refused.stderr
        assert refused.error is not None and "journal" in refused.error["message"]
        assert "Nothing was sent" in refused.error["message"]
        assert not marker.exists()
        filler.unlink(missing_ok=True)  # room again: requests are taken, whole
        rid = agent.start(f"touch {marker}")
        wait_for(lambda: agent.finished(rid) or b.op("pending"), 30)
        if b.op("pending"):  # its first request died at receipt, before any card
            b.approve_next()
        assert agent.wait(rid).rc == 0 and marker.exists()
        b.stop_daemon()
        r = verify(b.home.root)
        assert r.returncode == 0 and "edited" not in r.stdout, r.stdout
    finally:
        b.close()
