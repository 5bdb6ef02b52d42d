"""The witness off the box: real gateways witnessing to a real rsyslogd (over TCP and
its unix socket) and to a witness file, and `bastion audit verify --witness`
catching what a same-uid attacker does to the journal once the gateway is gone:
laundering (truncate to the last vouch, forge a boot and a harmless
request), truncation, rollback to an older copy, a re-chained journal -- with
head.json deleted or rewritten. Also: the per-request syslog stream is the
`audit activity` view, a collector outage costs nothing, and a bad bastion.toml
stops the gateway."""

from __future__ import annotations

import base64
import collections
import json
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from bastion import journal
from bastion.core.events import EventType
from bastion.devtools.rsyslog import Rsyslog, rsyslog_available
from bastion.devtools.sshd_fixture import SshdInfo
from bastion.journal.courier import AUDIT, HEAD
from bastion.journal.witness_reading import read_entries
from tests.harness import (
    PASSPHRASE,
    Agent,
    Bastion,
    Terminal,
    approved_agent,
    cli_argv,
    make_bastion,
    secret_needles,
    wait_for,
    witness_caught_up,
    write_bastion_toml,
)
from tests.harness import (
    bastion_cli as cli,
)

COMMAND_MARKER = "witness-cmd-marker-7d1e"
OUTPUT_MARKER = "witness-out-marker-4b2c"


def new_rsyslog(root: Path) -> Rsyslog:
    reason = rsyslog_available()
    if reason:
        pytest.skip(reason)
    return Rsyslog(root).start()


@pytest.fixture
def rsyslog(tmp_path: Path) -> Iterator[Rsyslog]:
    r = new_rsyslog(tmp_path / "rsyslog")
    try:
        yield r
    finally:
        r.stop()


def witnessed(root: Path, sshd: SshdInfo, key: Path, toml: str) -> Bastion:
    """A home with this bastion.toml, its gateway started and unlocked."""
    b = make_bastion(root, sshd, key, start=False)
    write_bastion_toml(b, toml)
    b.start_daemon()
    b.unlock()
    return b


def verify(home: Path, *witnesses: Path) -> subprocess.CompletedProcess[str]:
    return cli(home, "audit", "verify", *(a for w in witnesses for a in ("--witness", str(w))))


def run_all(agent: Agent, commands: list[str], width: int = 6) -> None:
    """Run commands through the gateway, `width` at a time; each must succeed."""
    with ThreadPoolExecutor(width) as pool:
        for r in pool.map(agent.run, commands):
            assert r.rc == 0, r.stderr


def last_seq(home: Path) -> int:
    return journal.head(home / "journal")[0]


def head_seqs(path: Path) -> list[int]:
    return [h["seq"] for h in read_entries([path], HEAD)]


# -- a witnessed home, two lifetimes (file + rsyslog over its unix socket) ---------------------


@pytest.fixture(scope="module")
def busy(
    tmp_path_factory: pytest.TempPathFactory, sshd_server: Any, client_key: tuple[Path, str]
) -> Iterator[dict[str, Path]]:
    root = tmp_path_factory.mktemp("witnessed")
    collector = new_rsyslog(root / "rsyslog")
    paths = {"file": root / "offbox" / "witness.log", "rsyslog": collector.output}
    paths["file"].parent.mkdir()
    toml = f'[witness]\nfile = "{paths["file"]}"\nsyslog = "{collector.unix}"\n'
    b = witnessed(root, sshd_server.info, client_key[0], toml)
    try:
        agent = approved_agent(b)
        run_all(agent, ["true"] * 3)
        b.stop_daemon()  # certifies at stop; the witness catches up before it exits
        shutil.copytree(b.home.root, root / "older", ignore=shutil.ignore_patterns("*.sock"))
        b.start_daemon()
        b.unlock()
        rid = agent.start("true")  # a new lifetime asks again
        b.approve_next()
        assert agent.wait(rid).rc == 0
        run_all(agent, ["true"] * 2)
        b.stop_daemon()
        end = last_seq(b.home.root)
        for path in paths.values():
            wait_for(lambda p=path: end in head_seqs(p), 30)
        yield {**paths, "home": b.home.root, "older": root / "older"}
    finally:
        b.close()
        collector.stop()


def test_an_intact_journal_holds_every_witnessed_head(busy: dict[str, Path]) -> None:
    end = last_seq(busy["home"])
    for source in ("file", "rsyslog"):
        r = verify(busy["home"], busy[source])
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"the last at seq {end}" in r.stdout
    r = cli(busy["home"], "audit", "verify", "--json", "--witness", str(busy["rsyslog"]))
    w = json.loads(r.stdout)["witness"]
    assert w["ok"] and w["last"] == end and w["heads"] >= 8  # 2 lifetimes x (3 requests, 2 vouches)
    types = [h["type"] for h in read_entries([busy["file"]], HEAD)]
    assert types.count("vouch") >= 4  # each lifetime: at unlock and at stop
    assert types.count("completed") == 7  # one head per request, 7 requests in all


def tamper_copy(busy: dict[str, Path], tmp_path: Path) -> Path:
    home = tmp_path / "home"
    shutil.copytree(busy["home"], home, ignore=shutil.ignore_patterns("*.sock"))
    return home


def fix_anchor(home: Path, how: str) -> None:
    """What a careful attacker does to head.json: delete it, or make it agree."""
    anchor = home / "journal" / "head.json"
    if how == "deleted":
        anchor.unlink(missing_ok=True)
    else:
        seq, digest = journal.head(home / "journal")
        anchor.write_text(json.dumps({"seq": seq, "hash": digest}))


@pytest.mark.parametrize("anchor", ["deleted", "rewritten"])
@pytest.mark.parametrize("source", ["file", "rsyslog"])
def test_truncation_is_caught(busy: dict[str, Path], tmp_path: Path, source: str, anchor: str):
    home = tamper_copy(busy, tmp_path)
    seg = journal.segments(home / "journal")[-1]
    lines = seg.read_bytes().split(b"\n")[:-1]
    seg.write_bytes(b"\n".join(lines[:-4]) + b"\n")
    fix_anchor(home, anchor)
    end = last_seq(home)
    r = verify(home, busy[source])
    assert r.returncode == 1, r.stdout
    missing = min(s for s in head_seqs(busy[source]) if s > end)
    assert f"truncated: the witness saw seq {missing}" in r.stdout, r.stdout
    assert f"the journal ends at seq {end}" in r.stdout


@pytest.mark.parametrize("anchor", ["kept", "deleted"])
@pytest.mark.parametrize("source", ["file", "rsyslog"])
def test_a_rollback_to_an_older_copy_is_caught(
    busy: dict[str, Path], tmp_path: Path, source: str, anchor: str
) -> None:
    home = tamper_copy(busy, tmp_path)
    shutil.rmtree(home / "journal")
    shutil.copytree(busy["older"] / "journal", home / "journal")  # its head.json agrees
    if anchor == "deleted":
        fix_anchor(home, anchor)
    assert verify(home).returncode == 0  # consistent in itself: only the witness knows more
    end = last_seq(home)
    r = verify(home, busy[source])
    assert r.returncode == 1
    missing = min(s for s in head_seqs(busy[source]) if s > end)
    assert f"truncated: the witness saw seq {missing}" in r.stdout, r.stdout


@pytest.mark.parametrize("source", ["file", "rsyslog"])
def test_a_rechained_journal_is_caught(busy: dict[str, Path], tmp_path: Path, source: str):
    """test_journal.py's rebuilt chain: new boot key, events re-encrypted to the public
    key, hashes recomputed, head.json rewritten by the forger's own writer."""
    home = tamper_copy(busy, tmp_path)
    jdir = home / "journal"
    original = list(journal.records(jdir))
    for seg in journal.segments(jdir):
        seg.unlink()
    (jdir / "head.json").unlink()
    forger = journal.Journal(jdir, journal.read_identity(jdir), original[0].boot)
    forger.open()
    for r in original[1:]:
        if r.type != "boot":
            forger.append(EventType(r.type), dict(r.meta), {"forged": True})
    forger.close()
    r = verify(home, busy[source])
    assert r.returncode == 1
    first = min(head_seqs(busy[source]))
    assert f"forked: seq {first} has hash" in r.stdout, r.stdout


def test_a_witness_without_heads_is_not_proof(busy: dict[str, Path], tmp_path: Path) -> None:
    empty = tmp_path / "empty.log"
    empty.write_text("Jun 11 10:00:00 vm sshd[1]: nothing of bastion's\n")
    r = verify(busy["home"], empty)
    assert r.returncode == 1 and "Nothing witnessed is not proof" in r.stdout, r.stdout


# -- the reviewer's laundering, witnessed by rsyslog over TCP ---------------------------------


def launder(jdir: Path) -> str:
    """The reviewer's attack, with the files and the public identity only: cut the
    journal back to its last vouch, forge a boot and a harmless request.
    Returns the forged boot's id."""
    recs = list(journal.records(jdir))
    cert = max(r.seq for r in recs if r.type == "vouch")
    for seg in journal.segments(jdir):
        kept = [x for x in seg.read_bytes().split(b"\n")[:-1] if json.loads(x)["seq"] <= cert]
        seg.write_bytes(b"".join(x + b"\n" for x in kept))
    forged = "boot_" + secrets.token_hex(12)
    forger = journal.Journal(jdir, journal.read_identity(jdir), forged)
    forger.open()  # a forged boot record, with the forger's own boot key
    forger.append(
        EventType.REQUEST_RECEIVED,
        {"request_id": "req_harmless", "action": None},
        {"host": "web1", "user": "u", "command": "uptime"},
    )
    forger.append(EventType.COMPLETED, {"request_id": "req_harmless", "exit_status": 0}, {})
    # A notice of its own, hoping the next gateway takes its boot as already reported.
    forger.append(EventType.FOREIGN_RECORDS, {"boots": [forged], "records": 0}, {})
    forger.close()  # head.json now names the forged end
    return forged


def test_laundering_after_a_kill_is_caught(
    tmp_path: Path, sshd: SshdInfo, client_key: tuple[Path, str], rsyslog: Rsyslog
) -> None:
    """Caught three ways: the witness names the head the journal lost; after the
    operator's restart and unlock, `verify --strict` names the forged boot, and the
    gateway journals a `foreign_records` notice shown in `status` and `approve`."""
    b = witnessed(tmp_path, sshd, client_key[0], f'[witness]\nsyslog = "{rsyslog.tcp}"\n')
    try:
        agent = approved_agent(b)
        run_all(agent, ["true"] * 3)
        witness_caught_up(b)
        end = last_seq(b.home.root)
        rsyslog.wait_for(lambda _: end in head_seqs(rsyslog.output))
        assert b.daemon is not None
        b.kill_daemon()
    finally:
        b.close()
    jdir = b.home.journal
    cert = max(r.seq for r in journal.records(jdir) if r.type == "vouch")
    forged = launder(jdir)
    forged_seqs = [r.seq for r in journal.records(jdir) if r.boot == forged]
    witnessed_after = min(s for s in head_seqs(rsyslog.output) if s > cert)
    r = verify(b.home.root, rsyslog.output)
    assert r.returncode == 1, r.stdout
    assert f"seq {witnessed_after}" in r.stdout.split("witness ")[-1], r.stdout
    (jdir / "head.json").unlink()
    r = verify(b.home.root, rsyslog.output)
    assert r.returncode == 1 and f"seq {witnessed_after}" in r.stdout

    # The operator restarts and unlocks, a prompt already watching.
    b.start_daemon()
    prompt = Terminal(cli_argv(b.home.root, "approve"))
    try:
        prompt.expect("waiting for cards")
        b.unlock()
        shown = prompt.expect("bastion audit verify --witness")
        assert forged in shown and f"seq {forged_seqs[0]}..{forged_seqs[-1]}" in shown
        status = b.op("status")
        assert [s["boot"] for s in status["foreign_records"]] == [forged]
        human = b.cli("status").stdout
        assert "WARNING" in human and forged in human
        notices = [
            r for r in journal.records(jdir) if r.type == "foreign_records" and r.boot != forged
        ]
        assert len(notices) == 1 and notices[0].meta["boots"] == [forged]
        r = cli(b.home.root, "audit", "verify", "--strict")
        assert r.returncode == 1
        assert f"signed by boot key {forged}, never vouched for (--strict)" in r.stdout, r.stdout
        r = cli(b.home.root, "audit", "verify")  # without --strict: named, not fatal
        assert r.returncode == 0 and forged in r.stdout, r.stdout
        # A new prompt sees it in the hello, not only as a notice when it happened.
        late = Terminal(cli_argv(b.home.root, "approve"))
        try:
            late.expect("waiting for cards")
            assert forged in late.expect("bastion audit verify --witness")
        finally:
            late.close()
    finally:
        prompt.close()
        b.close()
    # Reported once: the next lifetime names it in verify still, but does not re-journal.
    b.start_daemon()
    try:
        b.unlock()
        assert b.op("status")["foreign_records"] == []
        notices = [r for r in journal.records(jdir) if r.type == "foreign_records"]
        assert len([n for n in notices if n.boot != forged]) == 1
    finally:
        b.close()
    r = cli(b.home.root, "audit", "verify", "--strict")
    assert r.returncode == 1 and forged in r.stdout


# -- the intent is witnessed before the exec leaves (issue 18) ---------------------------------


def cut_to(home: Path, seq: int) -> None:
    """The attacker's edit, with the gateway's uid: keep the records up to `seq`, make
    head.json agree, and empty the witness spool (its open requests and its backlog)."""
    jdir = home / "journal"
    for seg in journal.segments(jdir):
        kept = [x for x in seg.read_bytes().split(b"\n")[:-1] if json.loads(x)["seq"] <= seq]
        seg.write_bytes(b"".join(x + b"\n" for x in kept))
    fix_anchor(home, "rewritten")
    spool = home / "witness-spool"
    shutil.rmtree(spool)
    spool.mkdir(mode=0o700)
    (spool / "open.jsonl").write_text("")


def killed_mid_command(
    root: Path, sshd: SshdInfo, key: Path, rsyslog: Rsyslog
) -> tuple[Bastion, str, list[journal.Record]]:
    """A witnessed gateway SIGKILLed while an approved command runs on the target: the
    home, the request id, and the request's records (received first)."""
    b = witnessed(root, sshd, key, f'[witness]\nsyslog = "{rsyslog.tcp}"\n')
    marker = root / "it-ran"
    try:
        agent = approved_agent(b)
        witness_caught_up(b)
        agent.start(f"touch {marker}; sleep 120")
        wait_for(marker.exists, 30)  # it reached the target
        assert b.daemon is not None
        b.kill_daemon()
    finally:
        b.close()
    recs = list(journal.records(b.home.journal))
    rid = [r for r in recs if r.type == "request_received"][-1].meta["request_id"]
    return b, rid, [r for r in recs if r.meta.get("request_id") == rid]


def test_a_command_that_reached_its_target_cannot_be_cut_from_the_journal(
    tmp_path: Path, sshd: SshdInfo, client_key: tuple[Path, str], rsyslog: Rsyslog
) -> None:
    """The reviewer's attack: SIGKILL the gateway while a command runs, cut the journal
    back to before it (the last head the witness heard, before issue 18), rewrite
    head.json, empty the spool, restart and unlock. The witness confirmed the intent's
    head before the exec left, so `audit verify --strict --witness` names it. Before,
    heads went out only at endings and vouches, and verify said intact."""
    b, _, ours = killed_mid_command(tmp_path, sshd, client_key[0], rsyslog)
    intent = next(r.seq for r in ours if r.type == "dispatch_started")
    rsyslog.wait_for(lambda _: intent in head_seqs(rsyslog.output))
    cut_to(b.home.root, max(s for s in head_seqs(rsyslog.output) if s < ours[0].seq))
    b.start_daemon()
    try:
        b.unlock()  # a new lifetime certifies the cut journal: only the witness knows
    finally:
        b.close()
    assert cli(b.home.root, "audit", "verify", "--strict").returncode == 0
    r = cli(b.home.root, "audit", "verify", "--strict", "--witness", str(rsyslog.output))
    (said,) = [line for line in r.stdout.splitlines() if line.startswith("witness ")]
    assert r.returncode == 1 and f"BROKEN: forked: seq {intent} has hash" in said, r.stdout


def test_cut_at_the_last_witnessed_head_the_command_is_still_on_record(
    tmp_path: Path, sshd: SshdInfo, client_key: tuple[Path, str], rsyslog: Rsyslog
) -> None:
    """The same kill, cut back exactly to the last head the witness heard: that head is
    the intent's, so the command is not gone -- it reads `status_unknown` -- and the
    journal verifies against the witness. (Before issue 18 the last witnessed head was
    the previous request's end, and the command vanished.)"""
    b, rid, ours = killed_mid_command(tmp_path, sshd, client_key[0], rsyslog)
    intent = next(r.seq for r in ours if r.type == "dispatch_started")
    rsyslog.wait_for(lambda _: intent in head_seqs(rsyslog.output))
    cut_to(b.home.root, max(head_seqs(rsyslog.output)))
    b.start_daemon()
    try:
        b.unlock()
        state = json.loads(b.cli("request", rid, "--json").stdout)
        assert state["state"] == "status_unknown", state
    finally:
        b.close()
    r = cli(b.home.root, "audit", "verify", "--strict", "--witness", str(rsyslog.output))
    assert r.returncode == 0, r.stdout


def test_a_forged_head_in_the_witness_is_named_forged(busy: dict[str, Path], tmp_path: Path):
    """A head with a real record's seq and hash, signed by a key that is not its boot's:
    someone else wrote to the witness. (A false alarm either way; now it says which.)"""
    forged_log = tmp_path / "witness.log"
    shutil.copy(busy["file"], forged_log)
    head = read_entries([forged_log], HEAD)[0]
    digest = bytes.fromhex(head["hash"])
    fake = base64.b64encode(Ed25519PrivateKey.generate().sign(digest)).decode()
    with open(forged_log, "a") as f:
        f.write(f"{HEAD} {json.dumps({**head, 'sig': fake})}\n")
    assert verify(busy["home"], busy["file"]).returncode == 0  # the real witness: intact
    r = verify(busy["home"], forged_log)
    assert (
        r.returncode == 1 and f"forged: the witness holds a head for seq {head['seq']}" in r.stdout
    )


# -- the syslog stream ------------------------------------------------------------------------


def activity(b: Bastion) -> list[dict[str, Any]]:
    return json.loads(b.cli("audit", "activity", "--json").stdout)


def test_one_summary_per_request_is_the_activity_row(
    tmp_path: Path, sshd: SshdInfo, client_key: tuple[Path, str], rsyslog: Rsyslog
) -> None:
    b = witnessed(tmp_path, sshd, client_key[0], f'[witness]\nsyslog = "{rsyslog.tcp}"\n')
    try:
        agent = approved_agent(b)
        assert OUTPUT_MARKER.encode() in agent.run(f"echo {OUTPUT_MARKER}").stdout
        run_all(agent, [f"true {COMMAND_MARKER}"] * 200)
        witness_caught_up(b)
        rows = activity(b)
        assert len(rows) == 202
        text = rsyslog.wait_for(lambda _: len(read_entries([rsyslog.output], AUDIT)) >= 202)
    finally:
        b.close()
    summaries = read_entries([rsyslog.output], AUDIT)
    assert len(summaries) == 202
    by_id = {s["request_id"]: s for s in summaries}
    assert len(by_id) == 202
    for row in rows:
        assert by_id[row["request_id"]] == {**row, "command": None}
    data = text.encode()
    for needle in (COMMAND_MARKER.encode(), OUTPUT_MARKER.encode(), PASSPHRASE.encode()):
        assert needle not in data
    for needle in secret_needles(client_key[0]):
        assert needle not in data


def test_a_collector_outage_costs_nothing(
    tmp_path: Path, sshd: SshdInfo, client_key: tuple[Path, str], rsyslog: Rsyslog
) -> None:
    b = witnessed(tmp_path, sshd, client_key[0], f'[witness]\nsyslog = "{rsyslog.tcp}"\n')
    try:
        agent = approved_agent(b)
        run_all(agent, ["true"] * 5)
        witness_caught_up(b)
        rsyslog.stop()
        run_all(agent, ["true"] * 20)  # when_full = "continue": the requests go on
        wait_for(lambda: b.op("status")["witness"]["targets"]["syslog"]["failing"])
        status = json.loads(b.cli("status", "--json").stdout)["witness"]
        # Two heads (the intent, the ending) and a summary each.
        assert status["waiting"] >= 60 and status["oldest_age"] > 0
        # Sent before a witness held their intent: counted, and said at 2 a.m.
        assert status["unwitnessed_dispatches"] == 20
        assert status["targets"]["syslog"]["last_error"].startswith("cannot reach tcp://")
        assert status["refusing"] is None
        human = b.cli("status").stdout  # what the operator reads at 2 a.m.
        assert "witness:   ok: " in human and "FAILING: cannot reach tcp://" in human, human
        assert "UNWITNESSED: 20 command(s)" in human, human
        rsyslog.start()  # the same port
        caught_up = witness_caught_up(b, timeout=60)
        assert caught_up["targets"]["syslog"]["failing"] is False
        rows = activity(b)
        rsyslog.wait_for(lambda _: len(read_entries([rsyslog.output], AUDIT)) >= len(rows))
    finally:
        b.close()
    sent = collections.Counter(s["request_id"] for s in read_entries([rsyslog.output], AUDIT))
    assert sorted(sent) == sorted(r["request_id"] for r in rows)  # none lost
    assert set(sent.values()) == {1}  # none twice
    heads = collections.Counter(head_seqs(rsyslog.output))
    assert set(heads.values()) == {1}


def test_when_full_refuse_sends_nothing_the_witness_cannot_hold(
    tmp_path: Path, sshd: SshdInfo, client_key: tuple[Path, str], rsyslog: Rsyslog
) -> None:
    """`when_full = "refuse"`: a command whose intent no witness confirmed is not sent
    (GATEWAY_BUSY: nothing was sent, the same request later may run), and past
    `buffer_max` new requests are refused before the gate; both end once the collector
    is back."""
    toml = f'[witness]\nsyslog = "{rsyslog.tcp}"\nbuffer_max = 4\nwhen_full = "refuse"\n'
    b = witnessed(tmp_path, sshd, client_key[0], toml)
    marker = tmp_path / "never-sent"
    try:
        agent = approved_agent(b)
        witness_caught_up(b)
        rsyslog.stop()
        refused = agent.run(f"touch {marker}")
        assert refused.code == "GATEWAY_BUSY" and refused.stdout == b"", refused.stderr
        assert refused.error is not None and refused.error["retryable"] is True
        assert "did not confirm that it holds this command's intent" in refused.error["message"]
        assert not marker.exists()
        state = json.loads(b.cli("request", refused.error["request_id"], "--json").stdout)
        assert state["state"] == "retry_safe", state
        codes = []  # denials fill the spool too, until new work is refused before the gate
        while "GATEWAY_BUSY" not in codes:
            codes.append(agent.run("true", host="nowhere").code)
            assert len(codes) <= 8 and set(codes) <= {"UNKNOWN_HOST", "GATEWAY_BUSY"}, codes
        before_gate = agent.run(f"touch {marker}")
        assert before_gate.code == "GATEWAY_BUSY" and before_gate.error is not None
        assert "audit witness" in before_gate.error["message"]
        assert "REFUSING NEW WORK" in b.cli("status").stdout
        rsyslog.start()
        witness_caught_up(b, timeout=60)
        assert agent.run(f"touch {marker}").rc == 0  # caught up: work is taken again
        assert marker.exists()
    finally:
        b.close()
    r = cli(b.home.root, "audit", "activity", "--json", "--passphrase-stdin", stdin=PASSPHRASE)
    rows = {row["request_id"]: row for row in json.loads(r.stdout)}
    at_intent = rows[refused.error["request_id"]]  # its intent is on record, then its end
    assert (at_intent["outcome"], at_intent["code"]) == ("denied", "GATEWAY_BUSY")
    assert at_intent["session_id"] is not None
    early = rows[before_gate.error["request_id"]]  # refused before the gate: no intent
    assert (early["outcome"], early["code"], early["session_id"]) == (
        "denied",
        "GATEWAY_BUSY",
        None,
    )


# -- bastion.toml -----------------------------------------------------------------------------


def test_without_bastion_toml_there_is_no_witness(bastion: Bastion) -> None:
    assert bastion.op("status")["witness"] is None
    assert not bastion.home.witness_spool.exists()


@pytest.mark.parametrize(
    "toml,expect",
    [
        (
            '[witness]\nfiel = "/mnt/w.log"\n',
            '[witness]: unknown key "fiel" (did you mean "file"?)',
        ),
        ('[witness]\nbuffer_max = "lots"\n', '"buffer_max" must be a whole number'),
        ("[witness]\nsyslog = 514\n", '"syslog" must be "tcp://HOST:PORT" or "unix:/PATH"'),
    ],
)
def test_a_bad_bastion_toml_stops_the_gateway(
    tmp_path: Path, sshd: SshdInfo, client_key: tuple[Path, str], toml: str, expect: str
) -> None:
    b = make_bastion(tmp_path, sshd, client_key[0], start=False)
    write_bastion_toml(b, toml)
    r = subprocess.run(
        [sys.executable, "-m", "bastion.cli", "--home", str(b.home.root), "daemon"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0
    assert str(b.home.config) in r.stderr and expect in r.stderr, r.stderr
    assert "the gateway does not start" in r.stderr and "Traceback" not in r.stderr
    assert not os.path.exists(b.home.operator_socket)
