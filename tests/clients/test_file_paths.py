"""Where a file operation lands is where the path policy judged it (issue 32, item 1).

A hostile review got sftp writes past the `files` rules with a chain of 34..40 symlinks
inside an allowed tree: OpenSSH's sftp-server `realpath` gives up after 33 links and
says "no such file", the kernel's open() follows 40, and the gateway judged the path
lexically. Each test here is the stock client (sftp, scp, paramiko, rsync, `bastion
mcp`) against the real gateway and a real sshd, with a marker file outside the rules
(`secret/victim`, standing for `~/.bashrc`) that must keep its bytes, and a positive
control: the same operation on a path that does lead inside the rules lands there.
The trees of links stand for what one approved command (a `tar x`) could leave.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.clients.test_file_transfer import (
    Approver,
    activity,
    client,
    files_policy,
    paramiko_sftp,
    ssh_opts,
)
from tests.harness import Bastion, policy_toml
from tests.unit.test_file_walk import chain

ORIGINAL = b"VICTIM-ORIGINAL-BYTES\n"
EVIL = b"EVIL-BYTES-FROM-THE-AGENT\n"


@pytest.fixture
def area(tmp_path: Path) -> Path:
    root = tmp_path / "target"
    for d in ("readable", "rw", "secret"):
        (root / d).mkdir(parents=True)
    (root / "secret" / "victim").write_bytes(ORIGINAL)
    return root


@pytest.fixture
def local(tmp_path: Path) -> Path:
    f = tmp_path / "upload.bin"
    f.write_bytes(EVIL)
    return f


def sftp_batch(
    b: Bastion, tmp_path: Path, lines: str, cards: list[dict[str, Any]] | None = None
) -> Any:
    """One `sftp -b` run, its cards answered yes (and kept in `cards` when given: one
    approver only, so no card is taken by another)."""
    batch = tmp_path / "batch"
    batch.write_text(lines)
    approver = Approver(b)
    try:
        agent = b.agent()
        argv = ["sftp", *ssh_opts(b), "-b", str(batch), "web1"]
        return agent.wait(agent.start([], argv=argv), timeout=120)
    finally:
        approver.close()
        if cards is not None:
            cards += approver.cards


def victim_untouched(area: Path) -> None:
    assert (area / "secret" / "victim").read_bytes() == ORIGINAL


def refused_in_words(stderr: str | bytes, *words: str) -> dict[str, Any]:
    """The gateway's JSON line on the sftp channel's stderr, with its code and words."""
    text = stderr.decode() if isinstance(stderr, bytes) else stderr
    lines = [ln for ln in text.splitlines() if ln.startswith('{"ok": false')]
    assert lines, stderr
    error = json.loads(lines[-1])["error"]
    assert error["code"] == "POLICY_DENIED", error
    for w in words:
        assert w in error["message"], error["message"]
    return error  # type: ignore[no-any-return]


def test_a_chain_longer_than_sftp_servers_realpath_writes_nothing_outside(
    bastion: Bastion, area: Path, local: Path, tmp_path: Path
) -> None:
    """Failed before the fix: the 36-link chain read as "no such file", its parent was
    judged, and the upload replaced the victim's bytes (no card: a session account)."""
    b = bastion
    b.write_policy(files_policy(b.sshd, area))
    victim = area / "secret" / "victim"
    top = chain(area / "rw", 36, victim)
    assert os.path.realpath(top) == str(victim)  # the kernel follows it all the way
    r = sftp_batch(b, tmp_path, f"put {local} {top}\n")
    assert r.rc != 0
    refused_in_words(r.stderr, "cannot tell exactly where", "more than 32 symlinks")
    victim_untouched(area)
    # Control: a short chain to a file inside the rules is followed, and lands there.
    inside = area / "rw" / "real.txt"
    inside.write_bytes(b"old")
    short = chain(area / "rw", 3, inside, "s")
    ok = sftp_batch(b, tmp_path, f"put {local} {short}\nget {short} {tmp_path}/back\n")
    assert ok.rc == 0, ok.stderr
    assert inside.read_bytes() == EVIL and (tmp_path / "back").read_bytes() == EVIL
    assert short.is_symlink()  # written through, never replaced
    # The journal names where it acted, beside what was asked.
    rows = [r for r in activity(b) if (r.get("file") or {}).get("path") == str(short)]
    assert any((r["file"].get("acts_on") or [None])[0] == str(inside) for r in rows), rows


def test_a_short_link_out_of_the_rules_and_a_dangling_link_are_refused(
    bastion: Bastion, area: Path, local: Path, tmp_path: Path
) -> None:
    b = bastion
    b.write_policy(files_policy(b.sshd, area))
    (area / "rw" / "out").symlink_to(area / "secret" / "victim")
    (area / "rw" / "dang").symlink_to(area / "secret" / "new")
    (area / "rw" / "dirlink").symlink_to(area / "secret")
    for dest, words in (
        (area / "rw" / "out", ("where the target resolves it",)),
        (area / "rw" / "dang", ("does not exist",)),
        (area / "rw" / "dirlink" / "victim", ("where the target resolves it",)),
        (area / "rw" / "dirlink" / "new", ("where the target resolves it",)),
    ):
        r = sftp_batch(b, tmp_path, f"put {local} {dest}\n")
        assert r.rc != 0, dest
        refused_in_words(r.stderr, *words)
    victim_untouched(area)
    assert not (area / "secret" / "new").exists()
    ok = sftp_batch(b, tmp_path, f"put {local} {area}/rw/plain\n")  # the control
    assert ok.rc == 0, ok.stderr
    assert (area / "rw" / "plain").read_bytes() == EVIL


def test_a_file_card_shows_the_path_the_write_lands_on(
    bastion: Bastion, area: Path, local: Path, tmp_path: Path
) -> None:
    """Per-command: before the fix the card and the journal named the in-tree link while
    the bytes landed where the chain led. Now the card's path is where the write lands,
    or nothing is written: a link, even to an allowed file, is refused after the card
    with the path to ask for instead."""
    b = bastion
    b.write_policy(files_policy(b.sshd, area, approval="per-command"))
    top = chain(area / "rw", 36, area / "secret" / "victim")
    r = sftp_batch(b, tmp_path, f"put {local} {top}\n")
    assert r.rc != 0
    refused_in_words(r.stderr, "more than 32 symlinks")
    victim_untouched(area)
    inside = area / "rw" / "real.txt"
    inside.write_bytes(b"old")
    link = area / "rw" / "tolink"
    link.symlink_to(inside)
    seen: list[dict[str, Any]] = []
    moved = sftp_batch(b, tmp_path, f"put {local} {link}\n", seen)
    ok = sftp_batch(b, tmp_path, f"put {local} {inside}\n", seen)  # the control
    refused_in_words(moved.stderr, "leads through a symlink", f'"{inside}" itself')
    assert ok.rc == 0, ok.stderr
    assert inside.read_bytes() == EVIL
    cards = [c["file"] for c in seen if c.get("file")]
    assert [c["path"] for c in cards] == [str(link), str(inside)]


def test_rename_moves_names_only_inside_the_rules_and_links_are_never_made(
    bastion: Bastion, area: Path, local: Path, tmp_path: Path
) -> None:
    """rename and posix-rename act on the names themselves; hardlink and symlink are
    refused with a sentence; a link renamed into place is walked at its next use."""
    b = bastion
    b.write_policy(files_policy(b.sshd, area))
    rw = area / "rw"
    (rw / "a").write_bytes(b"a")
    out = sftp_batch(b, tmp_path, f"rename {rw}/a {area}/secret/a\n")
    refused_in_words(out.stderr, "matches no files.write rule")
    assert (rw / "a").exists() and not (area / "secret" / "a").exists()
    for line in (f"ln {rw}/a {rw}/hard\n", f"ln -s {rw}/a {rw}/soft\n"):
        r = sftp_batch(b, tmp_path, line)
        assert r.rc != 0
        error = json.loads(r.stderr.splitlines()[-2 if r.stderr.endswith("\n") else -1])
        assert error["error"]["code"] == "UNSUPPORTED_REQUEST", r.stderr
        assert "does not create symlinks or hard links" in error["error"]["message"]
    assert not (rw / "hard").exists() and not os.path.lexists(rw / "soft")
    # A relative link that leads inside where it is made leads outside once moved.
    (rw / "deep" / "er").mkdir(parents=True)
    (rw / "deep" / "er" / "up").symlink_to("../../../secret/victim"[3:])  # -> rw/secret/victim
    (rw / "secret").mkdir()
    (rw / "secret" / "victim").write_bytes(b"inside")
    moved = sftp_batch(b, tmp_path, f"rename {rw}/deep/er/up {rw}/up\nput {local} {rw}/up\n")
    assert moved.rc != 0
    refused_in_words(moved.stderr, "does not exist")  # rw/up -> ../secret/victim: nothing
    assert os.path.islink(rw / "up")  # the rename (names inside the rules) was carried
    victim_untouched(area)
    ok = sftp_batch(b, tmp_path, f"rename {rw}/a {rw}/b\n")  # the control
    assert ok.rc == 0, ok.stderr
    assert (rw / "b").read_bytes() == b"a"


def test_setstat_shows_and_sends_every_change_and_only_inside_the_rules(
    bastion: Bastion, area: Path
) -> None:
    """A setstat's mode, owner, times and size each reach the card and the journal, and
    only they are sent; a path outside the rules, or a link out of them, is refused."""
    b = bastion
    b.write_policy(files_policy(b.sshd, area, approval="per-command"))
    f = area / "rw" / "f.txt"
    f.write_bytes(b"0123456789")
    (area / "rw" / "out").symlink_to(area / "secret" / "victim")
    approver = Approver(b)
    try:
        transport, sftp = paramiko_sftp(b)
        sftp.chmod(str(f), 0o600)
        sftp.truncate(str(f), 4)
        uid, gid = os.getuid(), os.getgid()
        sftp.chown(str(f), uid, gid)
        sftp.utime(str(f), (1_000_000_000, 1_000_000_001))
        for attack in (
            lambda: sftp.chmod(str(area / "secret" / "victim"), 0o777),
            lambda: sftp.truncate(str(area / "rw" / "out"), 0),
        ):
            with pytest.raises(PermissionError):
                attack()
        transport.close()
    finally:
        approver.close()
    assert f.read_bytes() == b"0123" and (f.stat().st_mode & 0o777) == 0o600
    assert int(f.stat().st_mtime) == 1_000_000_001
    victim_untouched(area)
    assert ((area / "secret" / "victim").stat().st_mode & 0o777) != 0o777
    shown = [c["file"] for c in approver.cards if c.get("file")]
    assert [
        (c["op"], c.get("mode"), c.get("times"), c.get("size"), c.get("owner")) for c in shown
    ] == [
        ("setstat", "0600", None, None, None),
        ("setstat", None, None, 4, None),
        ("setstat", None, None, None, f"{uid}:{gid}"),
        ("setstat", None, {"atime": 1_000_000_000, "mtime": 1_000_000_001}, None, None),
        ("setstat", None, None, 0, None),  # the link: carded as asked, refused once walked
    ]


def test_two_handles_and_writes_at_offsets_each_card_the_bytes_they_write(
    bastion: Bastion, area: Path
) -> None:
    """Per-command: each close is a file card of the exact bytes that handle writes
    (a write past the end makes the bytes before it zeros, shown in the sha256), and
    the file holds the last approved card's bytes."""
    b = bastion
    b.write_policy(files_policy(b.sshd, area, approval="per-command"))
    path = str(area / "rw" / "two.bin")
    approver = Approver(b)
    try:
        transport, sftp = paramiko_sftp(b)
        one, two = sftp.open(path, "wb"), sftp.open(path, "wb")
        one.write(b"first")
        two.seek(10)
        two.write(b"second")
        one.close()
        two.close()
        transport.close()
    finally:
        approver.close()
    expected_two = bytes(10) + b"second"
    assert (area / "rw" / "two.bin").read_bytes() == expected_two
    shown = [c["file"] for c in approver.cards if c.get("file")]
    assert [(c["size"], c["sha256"]) for c in shown] == [
        (5, hashlib.sha256(b"first").hexdigest()),
        (16, hashlib.sha256(expected_two).hexdigest()),
    ]


def test_scp_legacy_protocol_and_rsync_are_commands_the_command_rules_judge(
    bastion: Bastion, area: Path, local: Path, tmp_path: Path
) -> None:
    """`scp -O` and rsync run a command on the target (`scp -t PATH`, `rsync --server
    ...`): the account's command rules judge it, as any command; its own `--rsync-path`
    is shell source. Control: the same upload over sftp, which the path rules judge."""
    b = bastion
    files = {"read": [f"{area}/rw/**"], "write": [f"{area}/rw/**"]}
    b.write_policy(policy_toml(b.sshd, files=files, allow=["uptime"]))
    marker = tmp_path / "rsync-path-ran"
    legacy = client(b, b.agent(), ["scp", "-O", *ssh_opts(b), str(local), f"web1:{area}/rw/x"])
    assert legacy.code == "POLICY_DENIED", legacy.stderr
    assert "matches no allow rule" in legacy.error["message"]  # type: ignore[index]
    cfg = f"ssh -F {b.config}"
    rsync = client(b, b.agent(), ["rsync", "-e", cfg, str(local), f"web1:{area}/rw/y"])
    assert rsync.rc != 0 and "POLICY_DENIED" in rsync.stderr, rsync.stderr
    sneaky = client(
        b,
        b.agent(),
        [
            "rsync",
            "-e",
            cfg,
            f"--rsync-path=touch {marker}; rsync",
            str(local),
            f"web1:{area}/rw/z",
        ],
    )
    assert sneaky.rc != 0 and "uses shell syntax" in sneaky.stderr, sneaky.stderr
    assert not marker.exists()
    assert not any((area / "rw" / n).exists() for n in ("x", "y", "z"))
    commands = [r["command"] for r in activity(b) if r.get("command")]
    assert any(c.startswith("scp -t ") for c in commands), commands
    assert any(c.startswith("rsync --server ") for c in commands), commands
    ok = client(b, b.agent(), ["scp", *ssh_opts(b), str(local), f"web1:{area}/rw/x"])
    assert ok.rc == 0, ok.stderr


def test_the_mcp_file_tool_meets_the_same_walk(
    bastion: Bastion, area: Path, tmp_path: Path
) -> None:
    """`bastion mcp`'s sftp_put rides the same sftp channel: the long chain is refused
    with the gateway's own error, and nothing lands outside."""
    from tests.integration.test_mcp_files import approving
    from tests.mcp_client_helper import McpClient, error_of

    b = bastion
    b.write_policy(files_policy(b.sshd, area))
    top = chain(area / "rw", 36, area / "secret" / "victim")
    mcp = McpClient(b)
    try:
        args = {"host": "web1", "path": str(top), "content": EVIL.decode()}
        rid = mcp.start("call", name="sftp_put", arguments=args)
        approving(b, mcp, rid)
        err = error_of(mcp.wait(rid))
        assert err["code"] == "POLICY_DENIED", err
        assert "more than 32 symlinks" in err["message"], err
        victim_untouched(area)
        inside = area / "rw" / "ok.txt"  # the control
        r = mcp.call("sftp_put", host="web1", path=str(inside), content=EVIL.decode())
        assert not r["is_error"], r
        assert inside.read_bytes() == EVIL
    finally:
        mcp.close()


def test_the_kernel_follows_the_chain_directly(area: Path) -> None:
    """The chains above are real: outside bastion, the same write through them lands on
    the victim (the positive control for every refusal here)."""
    top = chain(area / "rw", 36, area / "secret" / "victim")
    subprocess.run(["sh", "-c", f"printf x > {top}"], check=True)
    assert (area / "secret" / "victim").read_bytes() == b"x"
