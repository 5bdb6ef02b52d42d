"""File operations: the `files` rules, `check_file`, the gate's file cards, and the
gateway's sftp server leaving nothing to asyncssh's local-filesystem server."""

from __future__ import annotations

import hashlib
import inspect
from dataclasses import replace

import asyncssh
import pytest

from bastion.core.binding import Binding
from bastion.core.cards import make_card
from bastion.core.contract import Code, Refusal
from bastion.core.defaults import MAX_FILE_CARD_BYTES
from bastion.core.files import (
    FileKind,
    FileOp,
    FilesError,
    Resolution,
    absolute,
    check_file,
    parse_files,
    parse_rule,
)
from bastion.core.gate import (
    AskCommand,
    AskSession,
    Channel,
    CommandGrant,
    Dispatch,
    Request,
    Session,
    World,
    evaluate,
    file_resolved,
)
from bastion.core.policy import Policy, PolicyError, entry_digest, parse_policy_text
from bastion.core.subject import Peer, ProcessInfo, Subject, SubjectKey
from bastion.gateway.sftp import Brokered

KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKwqVd3vMikqXGyJKL6mRiDHH8Ym3yLu2zkTPeUe2xx0"
TEXT = f"""
[hosts.web1]
address = "10.0.0.5"
host_key = "{KEY}"

[[hosts.web1.accounts]]
user = "app"
credential = "k"
files = {{ read = ["/var/log/**", "~/notes/*.txt"], write = ["/srv/app/**"] }}

[[hosts.web1.accounts]]
user = "pc"
credential = "k"
approval = "per-command"
files = {{ read = ["/var/log/**"], write = ["/srv/app/**"] }}

[[hosts.web1.accounts]]
user = "any"
credential = "k"

[[hosts.web1.accounts]]
user = "listed"
credential = "k"
allow = ["uptime"]

[[hosts.web1.accounts]]
user = "pcbare"
credential = "k"
approval = "per-command"
"""
HOSTS = parse_policy_text(TEXT, "t.toml")
POLICY = Policy(HOSTS, "d", ("t.toml",))
HOST = HOSTS["web1"]
SUBJECT = SubjectKey(100, 1.5, "nonce", "image", "exe")


def account(user: str):  # type: ignore[no-untyped-def]
    a = HOST.account(user)
    assert a is not None
    return a


def check(user: str, op: FileOp) -> tuple[bool, str]:
    a = account(user)
    c = check_file(a.file_rules, a.label, op)
    return c.allowed, c.reason


@pytest.mark.parametrize(
    "rule,path,matches",
    [
        ("/var/log/**", "/var/log/syslog", True),
        ("/var/log/**", "/var/log/nginx/access.log", True),
        ("/var/log/**", "/var/log", True),  # the directory itself, to list it
        ("/var/log/**", "/var/logs/x", False),
        ("/var/log/*", "/var/log/syslog", True),
        ("/var/log/*", "/var/log/nginx/access.log", False),  # * stops at /
        ("/srv/*.conf", "/srv/a.conf", True),
        ("/srv/?.conf", "/srv/ab.conf", False),
        ("/srv/[ab].conf", "/srv/b.conf", True),
        ("/srv/[!ab].conf", "/srv/b.conf", False),
        ("/etc/app.conf", "/etc/app.conf", True),
        ("/etc/app.conf", "/etc/app.conf.bak", False),
    ],
)
def test_globs(rule: str, path: str, matches: bool) -> None:
    assert parse_rule(rule, "read").matches(path, None) is matches


def test_home_rules_match_only_once_the_home_is_known() -> None:
    rule = parse_rule("~/notes/*.txt", "read")
    assert not rule.matches("/home/app/notes/a.txt", None)
    assert rule.matches("/home/app/notes/a.txt", "/home/app")
    assert not rule.matches("/home/other/notes/a.txt", "/home/app")


@pytest.mark.parametrize(
    "raw,words",
    [
        ({"read": ["var/log/**"]}, "not an absolute path"),
        ({"read": ["/var/../etc/**"]}, ". or .. segment"),
        ({"write": ["/srv/\0x"]}, "NUL or control"),
        ({"read": [5]}, "must list strings"),
        ({"read": "/var/log/**"}, "must be a list"),
        ({"reed": []}, "unknown key"),
        ({"read": ["/srv/[ab"]}, "unclosed ["),
        ("all", "must be a table"),
    ],
)
def test_bad_files_tables_are_refused(raw: object, words: str) -> None:
    with pytest.raises(FilesError, match=words.replace("[", r"\[").replace(".", r"\.")):
        parse_files(raw)


def test_a_bad_files_table_makes_the_policy_unavailable_naming_where() -> None:
    text = TEXT.replace('"/srv/app/**"] }', '"srv/app/**"] }', 1)
    with pytest.raises(PolicyError, match=r"t\.toml: hosts\.web1\.accounts\[0\].*files\.write"):
        parse_policy_text(text, "t.toml")
    cert = (
        TEXT
        + '\n[[hosts.web1.accounts]]\nuser = "c"\nauth = "certificate"\n'
        + 'source_address = ["10.0.0.1"]\nfiles = { read = ["/x"] }\n'
    )
    with pytest.raises(PolicyError, match="certificate account"):
        parse_policy_text(cert, "t.toml")


def test_files_leave_digests_of_accounts_without_them_unchanged() -> None:
    """An account without `files` keeps the entry digest it had before `files` existed
    (the digest of fcef418's account document), so session approvals survive."""
    any_account = account("any")
    assert any_account.files is None
    assert entry_digest(HOST, any_account) == (
        "a0de3ee034444fac82944441bf3341c65415c752a210c330138fe2b9887f585b"
    )
    assert entry_digest(HOST, account("app")) != entry_digest(
        HOST, replace(account("app"), files=None)
    )


def test_check_file_names_the_rule_or_says_none_matched() -> None:
    assert check("app", FileOp(FileKind.READ, "/var/log/syslog")) == (
        True,
        'read matches files.read rule "/var/log/**"',
    )
    ok, why = check("app", FileOp(FileKind.READ, "/etc/shadow"))
    assert not ok and '"/etc/shadow" matches no files.read rule for app@web1' in why
    # write implies read
    assert check("app", FileOp(FileKind.READ, "/srv/app/x"))[0]
    # a mutation needs files.write, whatever files.read says
    ok, why = check("app", FileOp(FileKind.WRITE, "/var/log/syslog"))
    assert not ok and "matches no files.write rule" in why
    assert check("app", FileOp(FileKind.WRITE, "/srv/app/x"))[0]
    # a rename needs both ends writable
    assert not check("app", FileOp(FileKind.RENAME, "/srv/app/x", to="/etc/x"))[0]
    assert check("app", FileOp(FileKind.RENAME, "/srv/app/x", to="/srv/app/y"))[0]
    # where the target resolves a path counts too (a symlink out of the rules)
    ok, why = check("app", FileOp(FileKind.READ, "/var/log/l", resolved=("/etc/shadow",)))
    assert not ok and "where the target resolves it" in why


def test_defaults_by_kind_of_account() -> None:
    anything = FileOp(FileKind.WRITE, "/etc/passwd")
    assert check("any", anything)[0]  # a session account that may run anything
    for user in ("listed", "pcbare"):
        ok, why = check(user, FileOp(FileKind.READ, "/var/log/syslog"))
        assert not ok and "has no file access" in why, user


def test_paths_are_made_absolute_and_folded() -> None:
    assert absolute("a/./b/../c", "/home/app") == "/home/app/a/c"
    assert absolute("/srv/app/../../etc/passwd", None) == "/etc/passwd"
    assert absolute("x", None) is None
    assert absolute("//srv//app/", None) == "/srv/app"


def world(**changes: object) -> World:
    w = World(False, 7, "boot", POLICY, True, None, None, None, 1000.0)
    return replace(w, **changes)  # type: ignore[arg-type]


def session(user: str) -> Session:
    return Session("ses_1", SUBJECT, "web1", user, "boot", 7, entry_digest(HOST, account(user)), 0)


def req(user: str, op: FileOp) -> Request:
    return Request("req_1", "web1", user, b"", SUBJECT, channel=Channel.SFTP, file=op)


def test_a_first_file_operation_asks_a_session_card() -> None:
    assert isinstance(
        evaluate(req("app", FileOp(FileKind.READ, "/var/log/x")), world()), AskSession
    )


def test_per_command_mutations_ask_a_file_card_and_reads_do_not() -> None:
    w = world(session=session("pc"))
    read = evaluate(req("pc", FileOp(FileKind.READ, "/var/log/x")), w)
    assert isinstance(read, Dispatch) and read.command_grant is None
    data = b"exact bytes"
    op = FileOp(
        FileKind.WRITE, "/srv/app/f", size=len(data), sha256=hashlib.sha256(data).hexdigest()
    )
    asked = evaluate(req("pc", op), w)
    assert isinstance(asked, AskCommand)
    for kind in (FileKind.REMOVE, FileKind.MKDIR, FileKind.RMDIR, FileKind.SETSTAT):
        assert isinstance(evaluate(req("pc", FileOp(kind, "/srv/app/f")), w), AskCommand)
    # the grant is bound to the operation's digest: the same op dispatches, another asks
    grant = CommandGrant("cmd_1", "ses_1", Binding.of(HOST, account("pc"), op.digest), 2000.0)
    done = evaluate(req("pc", op), replace(w, command_grant=grant))
    assert isinstance(done, Dispatch) and done.command_grant == grant
    other = replace(op, sha256=hashlib.sha256(b"other bytes").hexdigest())
    assert isinstance(evaluate(req("pc", other), replace(w, command_grant=grant)), AskCommand)
    moved = replace(op, path="/srv/app/g")
    assert isinstance(evaluate(req("pc", moved), replace(w, command_grant=grant)), AskCommand)
    # a session account's mutations need no card
    s = world(session=session("app"))
    assert isinstance(evaluate(req("app", replace(op, path="/srv/app/f")), s), Dispatch)


def test_per_command_writes_are_whole_and_bounded() -> None:
    w = world(session=session("pc"))
    big = evaluate(req("pc", FileOp(FileKind.WRITE, "/srv/app/f", size=MAX_FILE_CARD_BYTES + 1)), w)
    assert isinstance(big, Refusal) and big.code is Code.UNSUPPORTED_REQUEST
    assert str(MAX_FILE_CARD_BYTES) in big.message
    fits = evaluate(req("pc", FileOp(FileKind.WRITE, "/srv/app/f", size=MAX_FILE_CARD_BYTES)), w)
    assert isinstance(fits, AskCommand)  # the positive control
    appended = evaluate(req("pc", FileOp(FileKind.WRITE, "/srv/app/f", whole=False)), w)
    assert isinstance(appended, Refusal) and "whole files only" in appended.message


def test_a_locked_vault_refuses_file_operations_first() -> None:
    v = evaluate(req("app", FileOp(FileKind.READ, "/etc/shadow\0")), world(locked=True))
    assert isinstance(v, Refusal) and v.code is Code.VAULT_LOCKED


def test_the_resolved_check_refuses_a_symlink_escape() -> None:
    op = FileOp(FileKind.READ, "/var/log/link")
    assert file_resolved(account("app"), op, (Resolution("/var/log/real", links=1),)) is None
    refused = file_resolved(account("app"), op, (Resolution("/etc/shadow", links=1),))
    assert refused is not None and refused.code is Code.POLICY_DENIED


def test_a_file_card_shows_path_size_sha256_and_mode() -> None:
    data = b"content"
    op = FileOp(
        FileKind.WRITE,
        "/srv/app/\x1b[31mf",
        size=7,
        sha256=hashlib.sha256(data).hexdigest(),
        mode=0o640,
    )
    w = world(session=session("pc"))
    verdict = evaluate(req("pc", op), w)
    assert isinstance(verdict, AskCommand)
    proc = ProcessInfo(100, 1, 1.5, 0, "/usr/bin/sftp", "exe", "sftp", ("sftp",))
    subject = Subject(100, 1.5, "/usr/bin/sftp", "exe", 0, "nonce")
    peer = Peer(100, 0, 0, (proc,), subject)
    card = make_card("cc_1", req("pc", op), verdict, peer, None, "boot", 7, 0, 60)
    shown = card.as_json()
    assert shown["command"] is None and shown["command_sha256"] == op.digest
    f = shown["file"]
    assert isinstance(f, dict) and f["sha256"] == op.sha256 and f["size"] == 7
    assert f["mode"] == "0640" and "\x1b" not in str(f["path"])
    assert card.binding.what == op.digest


def test_the_agents_sftp_server_serves_none_of_the_gateways_files() -> None:
    """Every method of asyncssh's SFTPServer (whose defaults open the local file system)
    is the gateway's own."""
    base = {
        name
        for name, member in vars(asyncssh.SFTPServer).items()
        if inspect.isfunction(member) and not name.startswith("_")
    }
    kept = {"convert_attrs", "channel", "connection", "env", "logger"}
    missing = sorted(n for n in base - kept if n not in vars(Brokered))
    assert not missing, missing


def test_bastion_approve_renders_a_file_card() -> None:
    from bastion.cli.cardview import render_card

    data = b"content"
    op = FileOp(
        FileKind.WRITE, "/srv/app/f", size=7, sha256=hashlib.sha256(data).hexdigest(), mode=0o640
    )
    verdict = evaluate(req("pc", op), world(session=session("pc")))
    assert isinstance(verdict, AskCommand)
    proc = ProcessInfo(100, 1, 1.5, 0, "/usr/bin/sftp", "exe", "sftp", ("sftp",))
    subject = Subject(100, 1.5, "/usr/bin/sftp", "exe", 0, "nonce")
    card = make_card(
        "cc_1", req("pc", op), verdict, Peer(100, 0, 0, (proc,), subject), None, "b", 7, 0, 60
    )
    text = render_card(card.as_json(), details=True)
    assert "change a file" in text and "write /srv/app/f" in text
    assert f"sha256:   {op.sha256}" in text and "size:     7 bytes" in text and "0640" in text


class _Target:
    """A target file of `data`, read as an OpenSSH sftp-server reads: at most `most` bytes
    a request, b"" past the end; it counts the requests."""

    def __init__(self, data: bytes, most: int) -> None:
        self.data, self.most, self.asked = data, most, 0

    async def read(self, size: int, offset: int) -> bytes:
        self.asked += 1
        return self.data[offset : offset + min(size, self.most)]


@pytest.mark.parametrize(
    ("offset", "size", "requests"),
    [
        (0, 1000, 1),  # within the target's read length: one request
        (0, 4096, 4),  # larger: the target's pieces, at once
        (500, 4096, 4),
        (9000, 4096, 4),  # reaches the end: the bytes there are
        (20000, 4096, 4),  # past the end: none
    ],
)
def test_a_read_through_gives_the_agent_exactly_the_targets_bytes(
    offset: int, size: int, requests: int
) -> None:
    import asyncio

    from bastion.gateway.sftp import read_through

    data = bytes(range(256)) * 40  # 10240 bytes
    target = _Target(data, 1024)
    got = asyncio.run(read_through(target, 1024, offset, size))
    assert got == data[offset : offset + size]
    assert target.asked == requests
