"""`bastion mcp`'s file tools (issue 21): sftp_put and sftp_get through the stock ssh
client's sftp channel, the real gateway and a real sshd; the test is the operator.

One file up and down byte-exact, a per-command account's file card (denied: nothing
on the target; approved: exactly those bytes), a read outside `files.read` refused
with the gateway's own error, and paths shaped to be a local command, a batch
command or an ssh option: none runs anything here, each is a file's name there.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import stat
import time
from pathlib import Path
from typing import Any

import pytest

from bastion.devtools.sshd_fixture import SshdInfo
from tests.harness import PASSPHRASE, Bastion, policy_toml
from tests.mcp_client_helper import McpClient, error_of

MARKER = b"BASTION-MCP-CONTENT-MARKER-51c9"


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


def approving(
    b: Bastion, client: McpClient, rid: int, yes: bool = True, hold: float = 0
) -> list[dict[str, Any]]:
    """Answer every card until the call `rid` is answered (session cards yes, file and
    command cards `yes`, after `hold` seconds); the cards, in order."""
    cards: list[dict[str, Any]] = []
    deadline = time.monotonic() + 90
    while not client.finished(rid):
        assert time.monotonic() < deadline, "the call was not answered in time"
        for card in b.op("pending", wait=0.5) or []:
            cards.append(card)
            if card["kind"] != "session" and hold:
                # Not a sync: the card must wait longer than a progress tick (1 s).
                time.sleep(hold)
            b.answer(card, yes if card["kind"] != "session" else True)
    return cards


def exported(b: Bastion) -> str:
    return b.cli("audit", "export", "--passphrase-stdin", stdin=PASSPHRASE + "\n").stdout


def journal_bytes(b: Bastion) -> bytes:
    return b"".join(p.read_bytes() for p in (b.home.root / "journal").rglob("*") if p.is_file())


def test_put_then_get_round_trips_exact_bytes(session_files: Bastion, area: Path) -> None:
    b = session_files
    client = McpClient(b)
    data = os.urandom(300_000) + MARKER + bytes(range(256)) + os.urandom(70_001)
    target = area / "rw" / "blob.bin"
    rid = client.start(
        "call",
        name="sftp_put",
        arguments={
            "host": "web1",
            "path": str(target),
            "content_base64": base64.b64encode(data).decode(),
            "mode": "0640",
        },
    )
    cards = approving(b, client, rid)
    assert [c["kind"] for c in cards] == ["session"], cards  # a session account: one card
    r = client.wait(rid)
    assert not r["is_error"], r
    digest = hashlib.sha256(data).hexdigest()
    assert r["structured"] == {"path": str(target), "size": len(data), "sha256": digest}
    assert target.read_bytes() == data
    assert stat.S_IMODE(target.stat().st_mode) == 0o640  # the exact bits, past the umask
    # Down again: not UTF-8, so base64; the whole file, its size and sha256.
    r = client.call("sftp_get", host="web1", path=str(target), max_bytes=len(data))
    assert not r["is_error"], r
    s = r["structured"]
    assert s["content"] is None and base64.b64decode(s["content_base64"]) == data
    assert (s["size"], s["bytes"], s["sha256"], s["truncated"]) == (
        len(data),
        len(data),
        digest,
        False,
    )
    # Bounded: the file's start, its true size, and `truncated`.
    r = client.call("sftp_get", host="web1", path=str(target), max_bytes=1000)
    s = r["structured"]
    assert base64.b64decode(s["content_base64"]) == data[:1000]
    assert (s["size"], s["bytes"], s["truncated"]) == (len(data), 1000, True), s
    assert s["sha256"] == hashlib.sha256(data[:1000]).hexdigest()
    # Text goes as text, exactly (an empty file too).
    text = "café\n\tline two\r\nno newline at the end"
    for body in (text, ""):
        note = area / "rw" / "note.txt"
        r = client.call("sftp_put", host="web1", path=str(note), content=body)
        assert not r["is_error"] and r["structured"]["size"] == len(body.encode()), r
        assert note.read_bytes() == body.encode()
        r = client.call("sftp_get", host="web1", path=str(note))
        assert r["structured"]["content"] == body and r["structured"]["truncated"] is False, r
    # ssh_hosts says which paths the account's files rules allow; no address or key.
    hosts = client.call("ssh_hosts")["structured"]["hosts"]
    rules = {"read": [f"{area}/readable/**", f"{area}/rw/**"], "write": [f"{area}/rw/**"]}
    assert hosts[0]["accounts"][0]["files"] == rules, hosts
    assert b.sshd.address not in json.dumps(hosts) and "deploy-key" not in json.dumps(hosts)
    # The journal names the file and its digest; never its content.
    journal = exported(b)
    assert str(target) in journal and digest in journal
    assert MARKER not in journal_bytes(b) and MARKER.decode() not in journal
    assert MARKER not in b.log.read_bytes()


def test_per_command_put_is_a_file_card(bastion: Bastion, sshd: SshdInfo, area: Path) -> None:
    bastion.write_policy(files_policy(sshd, area, approval="per-command"))
    client = McpClient(bastion)
    data = b"#!/bin/sh\necho approved\n" + MARKER
    target = area / "rw" / "deploy.sh"
    args = {"host": "web1", "path": str(target), "content": data.decode(), "mode": "0755"}
    # Denied: CALL_DENIED, the gateway's own error object, and nothing on the target.
    rid = client.start("call", name="sftp_put", arguments=args)
    cards = approving(bastion, client, rid, yes=False)
    files = [c for c in cards if c["kind"] != "session"]
    assert len(files) == 1, cards
    card = json.dumps(files[0])
    assert str(target) in card and hashlib.sha256(data).hexdigest() in card, card
    err = error_of(client.wait(rid))
    assert err["code"] == "CALL_DENIED" and err["request_id"].startswith("req_"), err
    assert not target.exists()
    # Approved: exactly those bytes, with that mode.
    rid = client.start("call", name="sftp_put", arguments=args)
    cards = approving(bastion, client, rid, hold=2.5)
    assert [c["kind"] for c in cards if c["kind"] != "session"] == [files[0]["kind"]], cards
    r = client.wait(rid)
    assert not r["is_error"], r
    assert r["structured"]["sha256"] == hashlib.sha256(data).hexdigest()
    assert target.read_bytes() == data
    assert stat.S_IMODE(target.stat().st_mode) == 0o755
    assert any("waiting" in p for p in r["progress"]), r["progress"]  # progress while it waited


def test_get_outside_files_read_is_policy_denied(session_files: Bastion, area: Path) -> None:
    b = session_files
    (area / "secret" / "key").write_bytes(b"secret\n")
    (area / "readable" / "log").write_bytes(b"readable\n")
    client = McpClient(b)
    # The positive control: the same call inside files.read reads the file.
    rid = client.start(
        "call", name="sftp_get", arguments={"host": "web1", "path": str(area / "readable/log")}
    )
    approving(b, client, rid)
    assert client.wait(rid)["structured"]["content"] == "readable\n"
    err = error_of(client.call("sftp_get", host="web1", path=str(area / "secret" / "key")))
    assert err["code"] == "POLICY_DENIED" and err["retryable"] is False, err
    assert "files" in err["message"] or "read" in err["message"], err
    # A write outside files.write: refused too, and nothing made.
    err = error_of(
        client.call("sftp_put", host="web1", path=str(area / "readable" / "new"), content="x")
    )
    assert err["code"] == "POLICY_DENIED", err
    assert not (area / "readable" / "new").exists()
    # The target's own answer is not bastion's: a missing file is a target_error.
    r = client.call("sftp_get", host="web1", path=str(area / "rw" / "absent"))
    assert r["is_error"] and r["structured"]["target_error"]["status"] == "no such file", r


def test_locked_vault_is_the_error_object(session_files: Bastion, area: Path) -> None:
    b = session_files
    client = McpClient(b)
    rid = client.start(
        "call",
        name="sftp_put",
        arguments={"host": "web1", "path": str(area / "rw" / "f"), "content": "one"},
    )
    approving(b, client, rid)
    assert not client.wait(rid)["is_error"]
    b.cli("lock")
    err = error_of(client.call("sftp_put", host="web1", path=str(area / "rw" / "f"), content="2"))
    assert err["code"] == "VAULT_LOCKED", err
    err = error_of(client.call("sftp_get", host="web1", path=str(area / "rw" / "f")))
    assert err["code"] == "VAULT_LOCKED", err
    assert (area / "rw" / "f").read_bytes() == b"one"


def test_the_sftp_batch_a_naive_front_builds_runs_a_local_command(
    session_files: Bastion, area: Path, tmp_path: Path
) -> None:
    """The positive control for the test below: a path pasted into an `sftp -b` batch
    line, newline and all, runs its `!` line as a LOCAL command."""
    b = session_files
    (area / "rw" / "exists").write_bytes(b"x")
    marker = tmp_path / "local-command-ran"
    path = f"{area}/rw/exists\n!touch {marker}"
    batch = tmp_path / "batch"
    batch.write_text(f"lcd {tmp_path}\nget {path} {tmp_path}/out\n")  # lcd: get lands there
    agent = b.agent()
    rid = agent.start([], argv=["sftp", "-F", str(b.config), "-b", str(batch), "web1"])
    deadline = time.monotonic() + 90
    while not agent.finished(rid):
        assert time.monotonic() < deadline
        for card in b.op("pending", wait=0.5) or []:
            b.answer(card, True)
    agent.wait(rid)
    assert marker.exists(), "the naive batch ran no local command"


def test_hostile_paths_never_run_anything_locally(
    session_files: Bastion, area: Path, tmp_path: Path
) -> None:
    b = session_files
    (area / "rw" / "exists").write_bytes(b"x")
    marker = tmp_path / "local-command-ran"
    evil = tmp_path / "evil_ssh_config"
    evil.write_text(f"Host *\n    ProxyCommand touch {marker}\n")
    client = McpClient(b)
    rid = client.start(
        "call", name="sftp_get", arguments={"host": "web1", "path": str(area / "rw/exists")}
    )
    approving(b, client, rid)
    assert client.wait(rid)["structured"]["content"] == "x"
    rw = area / "rw"
    refused = [
        f"!touch {marker}",
        f"-oProxyCommand=touch {marker}",
        f"-F{evil}",
        f"{rw}/exists\n!touch {marker}",
        f"{rw}/exists\r!touch {marker}",
        f"{rw}/x\0!touch {marker}",
        "exists",
        "",
    ]
    for path in refused:
        for tool, extra in (("sftp_get", {}), ("sftp_put", {"content": "y"})):
            err = error_of(client.call(tool, host="web1", path=path, **extra))
            assert err["code"] == "UNSUPPORTED_REQUEST" and "`path`" in err["message"], err
    # Absolute paths that would mean something to a shell, a batch or ssh: each is
    # one file's exact name on the target, nothing more.
    names = [
        f"!touch {marker.name}",
        "-oProxyCommand=touch M",
        "-rf",
        "a; touch M",
        "$(touch M)",
        "`touch M`",
        "*",
        'it\'s "quoted"',
        "glob?[ab]",
        "trailing\\",
    ]
    for name in names:
        r = client.call("sftp_put", host="web1", path=f"{rw}/{name}", content=name)
        assert not r["is_error"], (name, r)
        assert (rw / name).read_text() == name
        r = client.call("sftp_get", host="web1", path=f"{rw}/{name}")
        assert r["structured"]["content"] == name, (name, r)
    assert sorted(p.name for p in rw.iterdir()) == sorted([*names, "exists"])
    assert (rw / "exists").read_bytes() == b"x"
    assert not marker.exists()
    assert not list(Path.cwd().glob("M")) and not (Path("/") / "M").exists()


def test_a_put_whose_card_outlasts_timeout_s_says_so(
    bastion: Bastion, sshd: SshdInfo, area: Path
) -> None:
    bastion.write_policy(files_policy(sshd, area, approval="per-command"))
    client = McpClient(bastion)
    target = area / "rw" / "late"
    args = {"host": "web1", "path": str(target), "content": "late", "timeout_s": 4}
    rid = client.start("call", name="sftp_put", arguments=args)
    bastion.approve_next()  # the session card; the file card is left waiting
    r = client.wait(rid)
    err = error_of(r)
    assert err["code"] == "STATUS_UNKNOWN" and "sftp_get" in err["message"], err
    assert r["progress"], r  # told while it waited
    assert not target.exists()  # the file card was never approved
