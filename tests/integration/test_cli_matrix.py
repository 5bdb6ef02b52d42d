"""Every CLI command, with a running gateway and without one.

Acceptance: "Each operator action has one implementation; every CLI command is
tested both with a running gateway and, where it works offline, without one."

`ROWS` has one row per leaf command path of the click tree (a meta-test keeps
it complete: a new command without a row fails). Each row says how to run the
command and what a correct result is ONLINE (gateway running, vault unlocked)
and OFFLINE (no gateway). A command that works offline is checked on its real
output -- mostly the same output both ways, since both ways run the same
`bastion.ops` code; one that needs the gateway must fail cleanly: exit 1, one
`bastion: ` line that says the gateway is not running, no traceback.

One home and one gateway serve the whole module: `test_offline` runs every
row with the gateway stopped, then `test_online` with it running and
unlocked. What an offline row changes (a key generated or removed on the vault
file) is checked again by the online rows that come after it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import pytest

from bastion.cli.main import main as cli_main
from bastion.vault import Vault
from tests.harness import PASSPHRASE, USER, Agent, Bastion, make_bastion, subcommands, wait_for

OFFLINE, ONLINE = "offline", "online"
PASS = PASSPHRASE + "\n"
MARKED_COMMAND = "echo cli-matrix-request"

Out = subprocess.CompletedProcess[str]


# -- the world the rows run in -------------------------------------------------------------


@dataclass
class World:
    """One bastion home (its gateway started and stopped between the phases),
    the values rows refer to as `{name}`, and what earlier rows observed."""

    b: Bastion
    tmp: Path
    vars: dict[str, str]
    seen: dict[str, Any] = field(default_factory=dict)
    mode: str = OFFLINE

    def cli(
        self, *args: str, stdin: str | None = None, home: Path | None = None, timeout: float = 60
    ) -> Out:
        """The real CLI in a subprocess; stdin is closed unless given."""
        feed: dict[str, Any] = (
            {"stdin": subprocess.DEVNULL} if stdin is None else {"input": stdin.encode()}
        )
        root = home or self.b.home.root
        r = subprocess.run(
            [sys.executable, "-m", "bastion.cli", "--home", str(root), *args],
            capture_output=True,
            timeout=timeout,
            **feed,
        )
        return subprocess.CompletedProcess(
            r.args,
            r.returncode,
            r.stdout.decode(errors="replace"),
            r.stderr.decode(errors="replace"),
        )

    def vault_digest(self) -> str:
        return hashlib.sha256(self.b.home.vault.read_bytes()).hexdigest()

    def record(self, name: str, value: Any) -> Any:
        """Note what this mode saw; return what the other mode saw, if it ran."""
        seen = self.seen.setdefault(name, {})
        seen[self.mode] = value
        return seen.get(ONLINE if self.mode == OFFLINE else OFFLINE)

    def agent(self) -> Agent:
        return self.b.agent()


def ssh_fingerprint(public_key_file: Path) -> str:
    out = subprocess.run(
        ["ssh-keygen", "-l", "-E", "sha256", "-f", str(public_key_file)],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    return out.split()[1]


def keygen(path: Path, kind: str) -> Path:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", kind, "-N", "", "-C", path.name, "-f", str(path)],
        check=True,
        timeout=30,
    )
    return path


@pytest.fixture(scope="module")
def world(
    tmp_path_factory: pytest.TempPathFactory, sshd_server: Any, client_key: tuple[Path, str]
) -> Iterator[World]:
    """A home with the deploy key, a one-host policy, and one completed
    request (and its ended session) in the journal; the gateway running."""
    root = tmp_path_factory.mktemp("cli-matrix")
    info = sshd_server.info
    b = make_bastion(root, info, client_key[0])
    try:
        a = b.agent()
        rid = a.start(MARKED_COMMAND)
        b.approve_next()
        assert a.wait(rid).stdout == b"cli-matrix-request\n"
        a.close()
        wait_for(lambda: b.op("sessions") == [])
        (row,) = [r for r in b.op("audit", view="activity") if r["command"] == MARKED_COMMAND]
        (session,) = b.op("audit", view="sessions")
        b.op("key_generate", label="doomed-offline")  # for the offline `key remove` row
        keys = root / "keys"
        keys.mkdir()
        given = root / "given"
        given.mkdir()
        w = World(
            b,
            root,
            {
                "req": row["request_id"],
                "session": session["session_id"],
                "address": info.address,
                "port": str(info.port),
                "user": USER,
                "deploy_pub": client_key[1],
                "deploy_fp": ssh_fingerprint(client_key[0].with_suffix(".pub")),
                "import_offline": str(keygen(keys / "imp-offline", "ecdsa")),
                "import_online": str(keygen(keys / "imp-online", "ed25519")),
                # What a run is given (--rw): a run writes only there.
                "given": str(given),
                "marker_offline": str(given / "run-offline.marker"),
                "marker_online": str(given / "run-online.marker"),
            },
        )
        yield w
    finally:
        b.close()


def to_mode(w: World, mode: str) -> None:
    """Idempotent: the gateway stopped (OFFLINE) or running and unlocked (ONLINE)."""
    b = w.b
    running = b.daemon is not None and b.daemon.poll() is None
    if mode == OFFLINE and running:
        b.stop_daemon()
    elif mode == ONLINE:
        if not running:
            b.start_daemon()
        if b.op("status")["locked"]:
            b.unlock()
    w.mode = mode


# -- what a correct result looks like -------------------------------------------------------


def ok(r: Out) -> Out:
    assert r.returncode == 0, f"exit {r.returncode}\nstdout: {r.stdout}\nstderr: {r.stderr}"
    assert "Traceback" not in r.stderr, r.stderr
    return r


def refused(r: Out, *phrases: str) -> None:
    """A clean refusal: exit 1, one `bastion: ` line naming the problem, no traceback."""
    assert r.returncode == 1, f"exit {r.returncode}\nstdout: {r.stdout}\nstderr: {r.stderr}"
    assert r.stderr.startswith("bastion: "), r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    for phrase in phrases:
        assert phrase in r.stderr, r.stderr


def needs_gateway(w: World, r: Out) -> None:
    refused(r, "the gateway is not running", "`bastion daemon`")
    assert r.stdout == "", r.stdout


def json_out(r: Out) -> Any:
    return json.loads(ok(r).stdout)


@dataclass(frozen=True)
class Case:
    """How to run a command in one mode, and how to judge it.

    `args` follow the command path; `{name}` is filled from `World.vars`.
    `drive`, when set, replaces the plain run (interactive or long-running
    commands) and asserts by itself."""

    args: tuple[str, ...] = ()
    check: Callable[[World, Out], None] = needs_gateway
    stdin: str | None = None
    setup: Callable[[World], None] | None = None
    cleanup: Callable[[World], None] | None = None
    drive: Callable[[World], None] | None = None


@dataclass(frozen=True)
class Row:
    path: tuple[str, ...]
    online: Case
    offline: Case

    @property
    def id(self) -> str:
        return " ".join(self.path)


def run_case(w: World, row: Row, case: Case) -> None:
    if case.setup:
        case.setup(w)
    try:
        if case.drive:
            case.drive(w)
            return
        args = [a.format(**w.vars) for a in case.args]
        r = w.cli(*row.path, *args, stdin=case.stdin)
        assert "Traceback" not in r.stderr, r.stderr
        case.check(w, r)
    finally:
        if case.cleanup:
            case.cleanup(w)


# -- interactive commands -------------------------------------------------------------------


def read_until(proc: subprocess.Popen[bytes], text: str, timeout: float = 20) -> str:
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    seen = b""
    deadline = time.monotonic() + timeout
    while text.encode() not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"{text!r} not printed; got {seen.decode(errors='replace')!r}"
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 65536)
            assert chunk, f"exited before printing {text!r}; got {seen.decode(errors='replace')!r}"
            seen += chunk
    return seen.decode(errors="replace")


@contextlib.contextmanager
def popen_cli(w: World, *args: str) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "bastion.cli", "--home", str(w.b.home.root), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


def approve_quits_on_q(expected: str) -> Callable[[World], None]:
    """`bastion approve` without a terminal: prints `expected`, then quits on `q`."""

    def drive(w: World) -> None:
        with popen_cli(w, "approve") as proc:
            shown = read_until(proc, expected)
            assert proc.stdin is not None
            proc.stdin.write(b"q")
            proc.stdin.flush()
            assert proc.wait(10) == 0, shown
            assert proc.stderr is not None
            err = proc.stderr.read().decode(errors="replace")
            assert "Traceback" not in err, err

    return drive


def approve_online(w: World) -> None:
    boot = w.b.op("status")["boot_id"]
    approve_quits_on_q(f"connected to gateway {boot} (vault unlocked)")(w)


def mcp_session(online: bool) -> Callable[[World], None]:
    """`bastion mcp` speaks MCP on stdio: it lists its three tools either way, and
    `ssh_hosts` answers from the gateway online, and says it is not running offline."""

    def drive(w: World) -> None:
        msgs = [
            {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
                "protocolVersion": "2025-06-18", "capabilities": {},
                "clientInfo": {"name": "matrix", "version": "0"}}},
            {"jsonrpc": "2.0", "method": "notifications/initialized"},
            {"jsonrpc": "2.0", "id": 2, "method": "tools/list"},
            {"jsonrpc": "2.0", "id": 3, "method": "tools/call",
             "params": {"name": "ssh_hosts", "arguments": {}}},
        ]  # fmt: skip
        with popen_cli(w, "mcp") as proc:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(b"".join(json.dumps(m).encode() + b"\n" for m in msgs))
            proc.stdin.flush()
            replies: dict[int, Any] = {}
            while 3 not in replies:
                line = proc.stdout.readline()
                assert line, "bastion mcp closed stdout before answering"
                doc = json.loads(line)
                if "id" in doc:
                    replies[doc["id"]] = doc
            proc.stdin.close()
            assert proc.wait(20) == 0
        names = {t["name"] for t in replies[2]["result"]["tools"]}
        assert names == {"ssh_exec", "ssh_hosts", "request_status", "sftp_get", "sftp_put"}, names
        result = replies[3]["result"]
        text = result["content"][0]["text"]
        if online:
            assert not result.get("isError"), text
        else:
            assert result["isError"] and "not running" in text, text

    return drive


def daemon_offline(w: World) -> None:
    """`bastion daemon` with none running starts, locked, and answers `status`."""
    w.b.start_daemon()
    try:
        r = ok(w.cli("status"))
        assert "vault:     locked" in r.stdout and "policy:    ok" in r.stdout, r.stdout
    finally:
        w.b.stop_daemon()
    assert not w.b.home.operator_socket.exists()


def daemon_online(w: World) -> None:
    """A second gateway for the same home refuses to start and leaves the first alone."""
    before = w.b.op("status")
    r = w.cli("daemon", timeout=30)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert f"bastion: a gateway is already running for {w.b.home.root}" in r.stderr, r.stderr
    after = w.b.op("status")
    assert (after["boot_id"], after["pid"], after["locked"]) == (
        before["boot_id"],
        before["pid"],
        False,
    )


def init_offline(w: World) -> None:
    """`init` creates a fresh home that the offline commands can read at once."""
    fresh = w.tmp / "fresh-home"
    r = ok(w.cli("init", "--passphrase-stdin", stdin="another passphrase\n", home=fresh))
    assert r.stdout.startswith(f"Initialised {fresh}\n"), r.stdout
    assert (fresh / "vault.json").stat().st_mode & 0o077 == 0
    assert (fresh / "known_hosts").read_text().startswith("bastion-gateway ssh-ed25519 ")
    assert (fresh / "policies").is_dir()
    keys = ok(w.cli("key", "list", home=fresh)).stdout.splitlines()
    assert [k.split("\t")[:2] for k in keys] == [["bastion-journal", "ssh-ed25519"]], keys
    assert "intact" in ok(w.cli("audit", "verify", home=fresh)).stdout


def snapshot_home(w: World) -> None:
    h = w.b.home
    w.seen["home_before"] = (w.vault_digest(), h.host_key.read_bytes(), h.known_hosts.read_text())


def init_online(w: World, r: Out) -> None:
    refused(r, f"{w.b.home.root} is already initialised", "nothing was changed")
    h = w.b.home
    after = (w.vault_digest(), h.host_key.read_bytes(), h.known_hosts.read_text())
    assert after == w.seen["home_before"]
    assert w.b.op("status")["locked"] is False


# -- checks for commands that work both ways ------------------------------------------------


def key_line(w: World, label: str, r: Out) -> list[str]:
    lines = [line.split("\t") for line in ok(r).stdout.splitlines()]
    return next((parts for parts in lines if parts[0] == label), [])


def check_key_list(w: World, r: Out) -> None:
    assert key_line(w, "deploy-key", r) == ["deploy-key", "ssh-ed25519", w.vars["deploy_fp"]]
    assert key_line(w, "bastion-journal", r)[:2] == ["bastion-journal", "ssh-ed25519"]
    if w.mode == ONLINE:  # what the offline rows did to the vault file, seen by the gateway
        for label, fingerprint in w.seen.get("made_offline", {}).items():
            assert key_line(w, label, r)[2] == fingerprint, r.stdout
        for label in w.seen.get("removed_offline", ()):
            assert key_line(w, label, r) == [], r.stdout
    other = w.record("key list deploy-key", key_line(w, "deploy-key", r))
    assert other in (None, key_line(w, "deploy-key", r))


def check_key_public(w: World, r: Out) -> None:
    public = ok(r).stdout.strip()
    assert public.split()[:2] == w.vars["deploy_pub"].split()[:2], public
    assert w.record("key public deploy-key", public) in (None, public)


def key_generate_setup(w: World) -> None:
    w.seen["vault_before"] = w.vault_digest()


def check_key_generate(w: World, r: Out) -> None:
    label = f"gen-{w.mode}"
    public = ok(r).stdout.strip()
    assert re.fullmatch(r"ssh-ed25519 [A-Za-z0-9+/=]+( \S+)?", public), public
    assert w.vault_digest() != w.seen["vault_before"], "the vault file did not change"
    info = json_out(w.cli("key", "public", label, "--json"))
    assert (info["label"], info["public_key"]) == (label, public)
    if w.mode == OFFLINE:
        w.seen.setdefault("made_offline", {})[label] = info["fingerprint"]


def check_key_import(w: World, r: Out) -> None:
    label = f"imp-{w.mode}"
    file = Path(w.vars[f"import_{w.mode}"])
    algorithm = "ecdsa-sha2-nistp256" if w.mode == OFFLINE else "ssh-ed25519"
    fingerprint = ssh_fingerprint(file.with_suffix(".pub"))
    assert ok(r).stdout == f"imported {label}\t{algorithm}\t{fingerprint}\n", r.stdout
    public = ok(w.cli("key", "public", label)).stdout.strip()
    assert public.split()[:2] == file.with_suffix(".pub").read_text().split()[:2]
    if w.mode == OFFLINE:
        w.seen.setdefault("made_offline", {})[label] = fingerprint


def key_remove_setup(w: World) -> None:
    label = f"doomed-{w.mode}"
    if w.mode == ONLINE:
        w.b.op("key_generate", label=label)
    # (doomed-offline was made by the world fixture, through the gateway: one passphrase less)
    assert label in {k.label for k in Vault.open(w.b.home.vault).list_keys()}
    w.seen["vault_before"] = w.vault_digest()


def check_key_remove(w: World, r: Out) -> None:
    label = f"doomed-{w.mode}"
    assert ok(r).stdout == f"removed {label}\n"
    assert w.vault_digest() != w.seen["vault_before"], "the vault file did not change"
    assert key_line(w, label, w.cli("key", "list")) == []
    if w.mode == ONLINE:
        refused(w.cli("key", "remove", label), f"no key labelled {label!r}")
    else:
        w.seen.setdefault("removed_offline", []).append(label)


def ca_labels(w: World) -> list[str]:
    """The user CAs on the vault file, oldest first (the last one signs)."""
    from bastion.ca import vault_ca

    return [k.label for k in vault_ca.authorities(Vault.open(w.b.home.vault).list_keys())]


def check_ca_init(w: World, r: Out) -> None:
    """Offline: the first CA, made with the passphrase. Online there is one already
    (the offline rows made it): the gateway -- nothing else could answer without a
    passphrase or a terminal -- refuses a second and points at `ca rotate`."""
    if w.mode == ONLINE:
        refused(r, "already holds a user CA", "`bastion ca rotate`")
        return
    line, hint = ok(r).stdout.splitlines()
    assert re.fullmatch(r"ssh-ed25519 [A-Za-z0-9+/=]+ \S+", line), line
    assert hint.startswith("# created bastion-ca-1 (SHA256:"), hint
    assert ca_labels(w) == ["bastion-ca-1"]


def check_ca_public(w: World, r: Out) -> None:
    doc = json_out(r)
    labels = ca_labels(w)
    assert [c["label"] for c in doc["authorities"]] == labels and doc["signing"] == labels[-1]
    if w.mode == ONLINE and w.seen.get("ca retired offline"):  # seen by the gateway
        assert "bastion-ca-1" not in [c["label"] for c in doc["authorities"]]
    text = ok(w.cli("ca", "public")).stdout
    assert text == doc["sshd_config"] + "\n"
    assert [line for line in text.splitlines() if not line.startswith("#")] == [
        " ".join([*c["public_key"].split()[:2], c["label"]]) for c in doc["authorities"]
    ]
    assert "TrustedUserCAKeys" in text and "AuthorizedPrincipalsFile" in text


def ca_snapshot(w: World) -> None:
    w.seen["cas_before"] = ca_labels(w)


def check_ca_rotate(w: World, r: Out) -> None:
    line, hint = ok(r).stdout.splitlines()
    before, after = w.seen["cas_before"], ca_labels(w)
    new = f"bastion-ca-{int(before[-1].rsplit('-', 1)[1]) + 1}"
    assert after == [*before, new], (before, after)  # the older CAs stay, listed first
    assert hint.startswith(f"# {new} (SHA256:") and "signs from now on" in hint, hint
    doc = json_out(w.cli("ca", "public", "--json"))
    assert doc["signing"] == new and doc["authorities"][-1]["public_key"] == line


def ca_retire_setup(w: World) -> None:
    """Name the oldest CA (a label offline, its fingerprint online) to retire."""
    (oldest, *_) = json_out(w.cli("ca", "public", "--json"))["authorities"]
    w.vars["ca_old"] = oldest["label" if w.mode == OFFLINE else "fingerprint"]
    w.seen["cas_before"] = ca_labels(w)


def check_ca_retire(w: World, r: Out) -> None:
    oldest, *rest = w.seen["cas_before"]
    assert ok(r).stdout.startswith(f"retired {oldest} ("), r.stdout
    assert ca_labels(w) == rest
    passphrase = ("--passphrase-stdin",) if w.mode == OFFLINE else ()
    signing = w.cli("ca", "retire", rest[-1], *passphrase, stdin=PASS if passphrase else None)
    refused(signing, f"{rest[-1]} is the CA that signs now")
    assert ca_labels(w) == rest
    if w.mode == OFFLINE:
        w.seen["ca retired offline"] = True


OPENBAO_TOKEN = {OFFLINE: "hvs.matrix-offline-8c1d", ONLINE: "hvs.matrix-online-3e7f"}


def check_ca_openbao_login(w: World, r: Out) -> None:
    """The token went in on stdin; it is sealed in the vault (read back offline with the
    passphrase) and shown nowhere: not in the output, not in plaintext in any file."""
    token = OPENBAO_TOKEN[w.mode]
    assert ok(r).stdout == "sealed the OpenBao token in the vault (secret bastion-openbao)\n"
    assert token not in r.stdout + r.stderr and token not in " ".join(map(str, r.args))
    vault = Vault.open(w.b.home.vault)
    assert "bastion-openbao" in vault.secret_labels()
    if w.mode == OFFLINE:  # no gateway holds the vault: read it back here
        vault.unlock(PASSPHRASE.encode())
        try:
            assert json.loads(vault.secret("bastion-openbao")) == {"token": token}
        finally:
            vault.lock()
    assert not [p for p in w.b.root.rglob("*") if p.is_file() and token.encode() in p.read_bytes()]


def check_request(w: World, r: Out) -> None:
    state = json_out(r)
    assert state["request_id"] == w.vars["req"]
    assert (state["state"], state["exit_status"], state["code"]) == ("completed", 0, None)
    assert w.record("request", state) in (None, state)
    human = ok(w.cli("request", w.vars["req"]))
    assert human.stdout == f"{w.vars['req']}: completed (exit 0)\n"
    refused(w.cli("request", "req_nope"), "no request req_nope in the journal")


def check_audit_verify(w: World, r: Out) -> None:
    assert ok(r).stdout.startswith(f"journal {w.b.home.journal}: intact ("), r.stdout


def check_audit_head(w: World, r: Out) -> None:
    head = json_out(r)
    assert isinstance(head["seq"], int) and head["seq"] > 0, head
    assert re.fullmatch(r"[0-9a-f]{64}", head["hash"]), head
    text = ok(w.cli("audit", "head")).stdout
    if w.mode == OFFLINE:  # nothing writes now: the head pins the journal as it is
        assert text == f"{head['seq']} {head['hash']}\n"
        pinned = w.cli("audit", "verify", "--expect-head", head["hash"])
        assert "intact" in ok(pinned).stdout
    previous = w.record("audit head", head)
    if previous is not None and w.mode == ONLINE:  # the journal only grows
        assert head["seq"] >= previous["seq"]


def check_audit_activity(w: World, r: Out) -> None:
    rows = {row["request_id"]: row for row in json_out(r)}
    mine = rows[w.vars["req"]]
    assert (mine["command"], mine["outcome"], mine["exit_status"]) == (
        MARKED_COMMAND,
        "completed",
        0,
    )
    assert (mine["host"], mine["user"]) == ("web1", USER)
    assert w.record("audit activity", mine) in (None, mine)


def check_audit_sessions(w: World, r: Out) -> None:
    rows = {row["session_id"]: row for row in json_out(r)}
    mine = rows[w.vars["session"]]
    assert (mine["host"], mine["user"]) == ("web1", USER)
    assert mine["end_reason"], mine  # the fixture's agent exited: the session ended
    assert w.record("audit sessions", mine) in (None, mine)


def check_audit_export(w: World, r: Out) -> None:
    """Every record once, in seq order; the marked request's story with its command
    (asked for) and outcome; no command text without --with-commands. Offline
    reads the same journal the gateway does: the online lines extend the offline."""
    lines = ok(r).stdout.splitlines()
    events = [json.loads(line) for line in lines]
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    mine = {e["type"]: e for e in events if e.get("request_id") == w.vars["req"]}
    assert mine["request_received"]["command"] == MARKED_COMMAND
    assert (mine["completed"]["exit_status"], mine["completed"]["boot"]) == (
        0,
        mine["request_received"]["boot"],
    )
    passphrase = ("--passphrase-stdin",) if w.mode == OFFLINE else ()
    plain = ok(w.cli("audit", "export", *passphrase, stdin=PASS if passphrase else None))
    assert len(plain.stdout.splitlines()) == len(lines)
    assert MARKED_COMMAND not in plain.stdout and "cli-matrix-request" not in plain.stdout
    if w.mode == OFFLINE:
        needs_gateway(w, w.cli("audit", "export"))
    previous = w.record("audit export", lines)
    if previous is not None and w.mode == ONLINE:
        assert lines[: len(previous)] == previous


def check_hostkey(w: World, r: Out) -> None:
    out = ok(r).stdout
    assert f"# {w.vars['address']}:{w.vars['port']} SHA256:" in out
    assert "trust on first use" in out
    assert f'host_key = "{w.b.sshd.host_key}"' in out.splitlines()


def check_ssh_config(w: World, r: Out) -> None:
    text = ok(r).stdout
    assert text == w.b.config.read_text()  # what make_bastion wrote and the agents use
    assert f"Host web1\n    User {USER}\n" in text
    pinned = " ".join(w.b.home.known_hosts.read_text().split()[:3])
    assert f"    KnownHostsCommand /bin/echo {pinned}\n" in text


def check_check_command(w: World, r: Out) -> None:
    """The policy's verdict needs no gateway: the same answer both ways."""
    verdict = json_out(r)
    assert verdict["argv"] == ["echo", "hello world"] and verdict["verdict"] == "no_command_card"
    source = ok(w.cli("check-command", "web1", USER, "echo hi; id"))  # a session account
    assert "reads as: shell source: ';' at byte 7 (command separator)" in source.stdout
    assert "verdict:  no command card" in source.stdout  # without `allow`, as before
    unknown = w.cli("check-command", "nope", USER, "true")
    assert unknown.returncode == 1 and "denied UNKNOWN_HOST" in unknown.stdout


def check_proxy_offline(w: World, r: Out) -> None:
    assert r.returncode == 70, r
    assert r.stdout == ""
    (line,) = r.stderr.splitlines()
    doc = json.loads(line)
    assert doc["ok"] is False
    assert doc["error"]["code"] == "INTERNAL"
    assert "not running" in doc["error"]["message"]
    assert (doc["error"]["request_id"], doc["error"]["retryable"]) == (None, False)


def check_proxy_online(w: World, r: Out) -> None:
    """Without fd passing the proxy relays: the gateway's SSH banner comes back."""
    assert ok(r).stdout.startswith("SSH-2.0-"), r.stdout[:200]


def check_run_offline(w: World, r: Out) -> None:
    refused(r, "cannot reach the gateway", "`bastion daemon`")
    assert not Path(w.vars["marker_offline"]).exists(), "the command ran without a gateway"


def check_run_online(w: World, r: Out) -> None:
    assert r.returncode == 3, r  # the command's own status
    assert re.search(
        r"^bastion: registered run_\S+ \(pid \d+\); starting sh in its sandbox\n",
        r.stderr,
        re.MULTILINE,
    ), r.stderr
    assert Path(w.vars["marker_online"]).exists()


def check_demo_help(w: World, r: Out) -> None:
    assert "Throwaway sshd" in ok(r).stdout


def check_completion(w: World, r: Out) -> None:
    """The bash script registers click's completion for `bastion`; the same both ways."""
    script = ok(r).stdout
    assert "complete -o nosort -F _bastion_completion bastion" in script, script
    assert "_BASTION_COMPLETE=bash_complete" in script, script
    assert w.record("completion bash", script) in (None, script)


def check_doctor(w: World, r: Out) -> None:
    """Offline the gateway is down (a failed check naming `bastion daemon`), online it
    answers with the vault open; both ways the policy host shows its pinned key and the
    matrix's advisory isolation fails, so doctor exits 1 (one `bastion: ` line)."""
    refused(r, "bastion: doctor: failed: ")
    checks = {c["name"]: c for c in json.loads(r.stdout)["checks"]}
    assert checks["isolation"]["status"] == "fail" and "isolate setup" in checks["isolation"]["fix"]
    assert checks["policy"]["status"] == checks["host.web1"]["status"] == "ok", checks
    gateway, vault = checks["gateway"], checks["vault"]
    if w.mode == OFFLINE:
        assert gateway["status"] == "fail" and "`bastion daemon`" in gateway["fix"], gateway
        assert vault["status"] == "skip", vault
    else:
        assert gateway["status"] == vault["status"] == "ok", (gateway, vault)


ISO_USER = "bastion-test-iso"


def isolate_setup(w: World) -> None:
    """As root: strong isolation recorded for `bastion daemon`, and a running gateway
    started without it told to restart. Cleaned up after, so later rows see advisory."""
    if os.geteuid() != 0:
        refused(w.cli("isolate", "setup"), "needs root", f"--home {w.b.home.root} isolate setup")
        return
    parent = Path(tempfile.mkdtemp(prefix="bastion-iso-matrix-"))
    parent.chmod(0o755)  # the agent user must be able to pass through to the socket dir
    door = parent / "door"
    created = False
    try:
        r = ok(w.cli("isolate", "setup", "--user", ISO_USER, "--socket-dir", str(door)))
        created = "(created now)" in r.stdout
        assert "FAIL" not in r.stdout and f"recorded:    {w.b.home.isolation}\n" in r.stdout, r
        assert json.loads(w.b.home.isolation.read_text())["agent_socket"] == f"{door}/agent.sock"
        restart = f"restart `bastion daemon` to use {door}/agent.sock"
        assert (restart in r.stdout) == (w.mode == ONLINE), r.stdout
        check = w.cli("isolate", "check")
        assert check.returncode == 1, check  # no gateway or no memory check: not everything holds
        if w.mode == ONLINE:
            assert "mode:      advisory\n" in check.stdout, check.stdout
            assert "started without isolation.json: restart `bastion daemon`" in check.stdout
        else:
            assert "mode:      strong\n" in check.stdout, check.stdout
            assert "(not checked: the gateway is not running)" in check.stdout
    finally:
        w.b.home.isolation.unlink(missing_ok=True)
        shutil.rmtree(parent, ignore_errors=True)
        if created:
            subprocess.run(["userdel", ISO_USER], capture_output=True, timeout=60)


def isolate_check(w: World) -> None:
    """Without isolation.json: advisory, and what it does not stop, said plainly."""
    r = w.cli("isolate", "check")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r
    out = r.stdout
    assert out.startswith("mode:      advisory\n"), out
    assert ("the gateway is not running" in out) == (w.mode == OFFLINE), out
    assert "NOT HELD  agents run as another uid than the gateway's" in out
    assert "NOT HELD  a process of the operator's uid outside every `bastion run` tree" in out
    assert "ok        a process inside a `bastion run` tree cannot answer for the operator" in out
    doc = json.loads(w.cli("isolate", "check", "--json").stdout)  # exit 1, as above
    assert doc["mode"] == "advisory" and doc["isolation"] is None
    assert doc["gateway_running"] == (w.mode == ONLINE)


# -- commands that need the gateway: online checks ------------------------------------------


def check_status(w: World, r: Out) -> None:
    out = ok(r).stdout
    for line in (
        "vault:     unlocked (epoch ",
        "policy:    ok\n",
        "hosts:     web1\n",
        "boot:      ",
    ):
        assert line in out, out
    s = json_out(w.cli("status", "--json"))
    assert s["locked"] is False and s["policy"]["hosts"] == ["web1"]


def lock_vault(w: World) -> None:
    w.b.op("lock")
    w.seen["epoch_before"] = w.b.op("status")["vault_epoch"]


def check_unlock(w: World, r: Out) -> None:
    m = re.fullmatch(r"unlocked \(vault epoch (\d+)\)\n", ok(r).stdout)
    assert m, r.stdout
    s = w.b.op("status")
    assert s["locked"] is False and s["vault_epoch"] == int(m[1]) > w.seen["epoch_before"]
    ok(w.cli("lock"))
    refused(w.cli("unlock", "--passphrase-stdin", stdin="wrong\n"), "wrong passphrase")
    assert w.b.op("status")["locked"] is True


def check_lock(w: World, r: Out) -> None:
    m = re.fullmatch(r"locked \(vault epoch (\d+)\)\n", ok(r).stdout)
    assert m, r.stdout
    s = w.b.op("status")
    assert s["locked"] is True and s["vault_epoch"] == int(m[1])


def relock(w: World) -> None:
    if w.b.op("status")["locked"]:
        w.b.unlock()


def raise_card(w: World) -> None:
    """A new agent process asks: a card waits for the operator."""
    a = w.agent()
    w.seen["card_agent"] = (a, a.start("true"))
    wait_for(lambda: w.b.op("pending"), timeout=20)


def deny_card(w: World) -> None:
    a, rid = w.seen.pop("card_agent")
    for card in w.b.op("pending"):
        w.b.answer(card, False)
    assert a.wait(rid, timeout=30).code == "SESSION_DENIED"
    a.close()


def check_pending(w: World, r: Out) -> None:
    (card,) = json_out(r)
    a, _ = w.seen["card_agent"]
    assert (card["host"], card["user"], card["subject"]["pid"]) == ("web1", USER, a.pid)
    human = ok(w.cli("pending")).stdout
    assert f"decide:   bastion decide {card['id']} approve|deny" in human, human


def open_session(w: World) -> None:
    a = w.agent()
    rid = a.start("true")
    w.b.approve_next()
    assert a.wait(rid).rc == 0
    w.seen["session_agent"] = a


def close_session(w: World) -> None:
    w.seen.pop("session_agent").close()
    wait_for(lambda: w.b.op("sessions") == [])


def check_sessions(w: World, r: Out) -> None:
    (row,) = json_out(r)
    a = w.seen["session_agent"]
    assert (row["host"], row["user"], row["subject"]["pid"]) == ("web1", USER, a.pid)
    human = ok(w.cli("sessions")).stdout
    assert human.startswith(f"{row['id']}  pid {a.pid} "), human
    assert f"  {USER}@web1  since " in human, human


def unknown_id(ident: str, *phrases: str) -> Callable[[World, Out], None]:
    def check(w: World, r: Out) -> None:
        refused(r, ident, *phrases)
        assert w.b.op("status")["locked"] is False  # and nothing else happened

    return check


def console_off(w: World, r: Out) -> None:
    """This home's bastion.toml keeps the console off: said, with the fix."""
    refused(r, "the console is off", "enabled = true")
    assert "enroll#" not in r.stdout


def check_operator_list(w: World, r: Out) -> None:
    assert "(no signer enrolled: `bastion operator enroll`)" in ok(r).stdout
    assert json_out(w.cli("operator", "list", "--json")) == []


def check_service_install(w: World, r: Out) -> None:
    """The unit needs no gateway: the same text both ways, this home's daemon in it."""
    unit = ok(r).stdout
    assert unit.startswith("# Written by `bastion service install`."), unit
    assert f"-m bastion.cli --home {w.b.home.root} daemon\n" in unit
    assert "Type=notify\n" in unit and "WatchdogSec=" in unit
    assert w.record("service install --stdout", unit) in (None, unit)
    target = w.tmp / f"bastion-{w.mode}.service"
    written = ok(w.cli("service", "install", "--output", str(target)))
    assert target.read_text() == unit
    assert ("a gateway runs for this home now" in written.stdout) == (w.mode == ONLINE)


# -- the table --------------------------------------------------------------------------------

# A Case judges by `needs_gateway` unless told otherwise: `Case(args)` is a command that
# must refuse cleanly without a gateway; NEEDS_GATEWAY is one that takes no arguments.
NEEDS_GATEWAY = Case()

ROWS: list[Row] = [
    Row(
        ("init",),
        online=Case(("--passphrase-stdin",), init_online, PASS, setup=snapshot_home),
        offline=Case(drive=init_offline),
    ),
    Row(("daemon",), online=Case(drive=daemon_online), offline=Case(drive=daemon_offline)),
    Row(
        ("unlock",),
        online=Case(("--passphrase-stdin",), check_unlock, PASS, setup=lock_vault, cleanup=relock),
        offline=Case(("--passphrase-stdin",), stdin=PASS),
    ),
    Row(("lock",), online=Case((), check_lock, cleanup=relock), offline=NEEDS_GATEWAY),
    Row(("status",), online=Case((), check_status), offline=NEEDS_GATEWAY),
    Row(
        ("pending",),
        online=Case(("--json",), check_pending, setup=raise_card, cleanup=deny_card),
        offline=Case(("--json",)),
    ),
    Row(
        ("approve",),
        online=Case(drive=approve_online),
        offline=Case(drive=approve_quits_on_q("gateway not running (")),
    ),
    Row(
        ("decide",),
        online=Case(("card_nope", "approve"), unknown_id("card_nope", "no pending card")),
        offline=Case(("card_nope", "approve")),
    ),
    Row(
        ("sessions",),
        online=Case(("--json",), check_sessions, setup=open_session, cleanup=close_session),
        offline=NEEDS_GATEWAY,
    ),
    Row(
        ("revoke",),
        online=Case(("sess_nope",), unknown_id("sess_nope", "no live session")),
        offline=Case(("sess_nope",)),
    ),
    Row(
        ("kill",),
        online=Case(("req_nope",), unknown_id("req_nope", "not in flight")),
        offline=Case(("req_nope",)),
    ),
    # presence (issue 34): this gateway's console is off, and no signer is enrolled; the
    # console itself is driven in tests/browser/
    Row(("console",), online=Case(("--no-open",), console_off), offline=Case(("--no-open",))),
    Row(
        ("operator", "enroll"),
        online=Case(("--name", "x", "--passphrase-stdin", "--no-open"), console_off, PASS),
        offline=Case(("--name", "x", "--passphrase-stdin", "--no-open"), stdin=PASS),
    ),
    Row(("operator", "list"), online=Case((), check_operator_list), offline=NEEDS_GATEWAY),
    Row(
        ("operator", "remove"),
        online=Case(
            ("nobody", "--passphrase-stdin"), unknown_id("nobody", "no enrolled signer"), PASS
        ),
        offline=Case(("nobody", "--passphrase-stdin"), stdin=PASS),
    ),
    Row(
        ("request",),
        online=Case(("{req}", "--json"), check_request),
        offline=Case(("{req}", "--json"), check_request),
    ),
    # `bastion demo` builds its own sshd, home and gateway and ignores --home: it runs
    # end to end in test_demo_and_cli.py::test_demo_exits_zero; here only its entry point.
    Row(
        ("demo",),
        online=Case(("--help",), check_demo_help),
        offline=Case(("--help",), check_demo_help),
    ),
    Row(("mcp",), online=Case(drive=mcp_session(True)), offline=Case(drive=mcp_session(False))),
    Row(
        ("completion",),
        online=Case(("bash",), check_completion),
        offline=Case(("bash",), check_completion),
    ),
    Row(
        ("key", "generate"),
        online=Case(("gen-online",), check_key_generate, setup=key_generate_setup),
        offline=Case(
            ("gen-offline", "--passphrase-stdin"),
            check_key_generate,
            PASS,
            setup=key_generate_setup,
        ),
    ),
    Row(
        ("key", "import"),
        online=Case(("imp-online", "{import_online}"), check_key_import),
        offline=Case(
            ("imp-offline", "{import_offline}", "--passphrase-stdin"), check_key_import, PASS
        ),
    ),
    Row(("key", "list"), online=Case((), check_key_list), offline=Case((), check_key_list)),
    Row(
        ("key", "public"),
        online=Case(("deploy-key",), check_key_public),
        offline=Case(("deploy-key",), check_key_public),
    ),
    Row(
        ("key", "remove"),
        online=Case(("doomed-online",), check_key_remove, setup=key_remove_setup),
        offline=Case(
            ("doomed-offline", "--passphrase-stdin"),
            check_key_remove,
            PASS,
            setup=key_remove_setup,
        ),
    ),
    Row(
        ("ca", "init"),
        online=Case((), check_ca_init),
        offline=Case(("--passphrase-stdin",), check_ca_init, PASS),
    ),
    Row(
        ("ca", "public"),
        online=Case(("--json",), check_ca_public),
        offline=Case(("--json",), check_ca_public),
    ),
    Row(
        ("ca", "rotate"),
        online=Case((), check_ca_rotate, setup=ca_snapshot),
        offline=Case(("--passphrase-stdin",), check_ca_rotate, PASS, setup=ca_snapshot),
    ),
    Row(
        ("ca", "retire"),
        online=Case(("{ca_old}",), check_ca_retire, setup=ca_retire_setup),
        offline=Case(
            ("{ca_old}", "--passphrase-stdin"), check_ca_retire, PASS, setup=ca_retire_setup
        ),
    ),
    Row(
        ("ca", "openbao-login"),
        online=Case((), check_ca_openbao_login, OPENBAO_TOKEN[ONLINE] + "\n"),
        offline=Case(
            ("--passphrase-stdin",),
            check_ca_openbao_login,
            PASS + OPENBAO_TOKEN[OFFLINE] + "\n",
        ),
    ),
    Row(
        ("audit", "verify"),
        online=Case((), check_audit_verify),
        offline=Case((), check_audit_verify),
    ),
    Row(
        ("audit", "head"),
        online=Case(("--json",), check_audit_head),
        offline=Case(("--json",), check_audit_head),
    ),
    Row(
        ("audit", "activity"),
        online=Case(("--json",), check_audit_activity),
        offline=Case(("--json", "--passphrase-stdin"), check_audit_activity, PASS),
    ),
    Row(
        ("audit", "sessions"),
        online=Case(("--json",), check_audit_sessions),
        offline=Case(("--json", "--passphrase-stdin"), check_audit_sessions, PASS),
    ),
    Row(
        ("audit", "export"),
        online=Case(("--with-commands",), check_audit_export),
        offline=Case(("--with-commands", "--passphrase-stdin"), check_audit_export, PASS),
    ),
    Row(
        ("hostkey",),
        online=Case(("{address}", "--port", "{port}"), check_hostkey),
        offline=Case(("{address}", "--port", "{port}"), check_hostkey),
    ),
    Row(("ssh-config",), online=Case((), check_ssh_config), offline=Case((), check_ssh_config)),
    Row(
        ("check-command",),
        online=Case(("--json", "web1", "{user}", "echo 'hello world'"), check_check_command),
        offline=Case(("--json", "web1", "{user}", "echo 'hello world'"), check_check_command),
    ),
    Row(
        ("proxy",),
        online=Case(("web1", "22", "{user}"), check_proxy_online, stdin=""),
        offline=Case(("web1", "22", "{user}"), check_proxy_offline),
    ),
    Row(
        ("isolate", "setup"),
        online=Case(drive=isolate_setup),
        offline=Case(drive=isolate_setup),
    ),
    Row(
        ("isolate", "check"),
        online=Case(drive=isolate_check),
        offline=Case(drive=isolate_check),
    ),
    Row(
        ("run",),
        online=Case(
            (
                "--label",
                "matrix",
                "--rw",
                "{given}",
                "--",
                "sh",
                "-c",
                "touch {marker_online}; exit 3",
            ),
            check_run_online,
        ),
        offline=Case(("--", "sh", "-c", "touch {marker_offline}"), check_run_offline),
    ),
    Row(
        ("doctor",),
        online=Case(("--json",), check_doctor),
        offline=Case(("--json",), check_doctor),
    ),
    Row(
        ("service", "install"),
        online=Case(("--stdout",), check_service_install),
        offline=Case(("--stdout",), check_service_install),
    ),
]


# -- the tests ----------------------------------------------------------------------------------


def leaf_paths(command: click.Command, prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    if isinstance(command, click.Group):
        for name, sub in subcommands(command):
            yield from leaf_paths(sub, (*prefix, name))
    else:
        yield prefix


def test_every_command_has_a_row() -> None:
    table = [row.path for row in ROWS]
    assert len(table) == len(set(table)), "a command has two rows"
    commands = set(leaf_paths(cli_main))
    assert not commands - set(table), f"commands without a row: {sorted(commands - set(table))}"
    assert not set(table) - commands, f"rows for no command: {sorted(set(table) - commands)}"


@pytest.mark.parametrize("row", ROWS, ids=lambda row: row.id)
def test_offline(world: World, row: Row) -> None:
    to_mode(world, OFFLINE)
    run_case(world, row, row.offline)


@pytest.mark.parametrize("row", ROWS, ids=lambda row: row.id)
def test_online(world: World, row: Row) -> None:
    to_mode(world, ONLINE)
    run_case(world, row, row.online)
