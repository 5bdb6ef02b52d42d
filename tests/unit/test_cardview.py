"""How a card is drawn (cli/cardview): every card kind at 80 columns against a reviewed
snapshot, and at any width no line wider than the terminal and no digest split.

The fixtures (snapshots/cards/*.json) are real `Card.as_json()` output: `_cards` makes
them with `make_card`, and a test keeps the files equal to what it makes. To rewrite the
fixtures and snapshots after a deliberate change, run with BASTION_UPDATE_SNAPSHOTS=1,
then read every changed snapshot by eye before committing it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.cells import cell_len

from bastion.cli.cardview import INDENT, MIN_WIDTH, MORE, ROOM, Style, render_card, render_details
from bastion.core.cards import make_card
from bastion.core.command import read_command
from bastion.core.contract import EndReason
from bastion.core.files import FileKind, FileOp
from bastion.core.gate import (
    AskCommand,
    AskSession,
    Channel,
    Request,
    Session,
    World,
    evaluate,
)
from bastion.core.policy import Policy, entry_digest, parse_policy_text
from bastion.core.stdin import Stdin, StdinEnd
from bastion.core.subject import ExecWatch, Peer, ProcessInfo, Run, Subject, SubjectKind

SNAPSHOTS = Path(__file__).parent / "snapshots" / "cards"
UPDATE = os.environ.get("BASTION_UPDATE_SNAPSHOTS") == "1"
# Every card kind a prompt shows; a kind's fixture is <kind>.json, its snapshot <kind>.txt.
KINDS = [
    "session",
    "command_argv",
    "command_shell",
    "command_stdin",
    "file_write",
    "grant",  # a command card of an account with `grants = true`: g may widen its yes
]

KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKwqVd3vMikqXGyJKL6mRiDHH8Ym3yLu2zkTPeUe2xx0"
HOSTS = parse_policy_text(
    f"""
[hosts.web1]
address = "10.20.30.40"
port = 2222
host_key = "{KEY}"

[[hosts.web1.accounts]]
user = "deploy"
credential = "deploy-ed25519"
approval = "per-command"
files = {{ write = ["/srv/app/**"] }}

[[hosts.web1.accounts]]
user = "ops"
credential = "deploy-ed25519"
approval = "per-command"
grants = true
""",
    "policy.toml",
)
HOST = HOSTS["web1"]
ACCOUNT = HOST.account("deploy")
assert ACCOUNT is not None
BOOT, EPOCH, NOW = "boot_5b0e7c41d2a98f3361e0c7aa", 4, 1_780_000_000.0  # 2026-05-28
RUN = Run("deploy app", ("--ro /srv/app",), "b:4242:777", NOW - 600, 1000)
CHAIN = (
    ProcessInfo(
        48211,
        48190,
        NOW - 5,
        1000,
        "/usr/bin/ssh",
        hashlib.sha256(b"ssh").hexdigest(),
        "ssh",
        ("ssh", "-o", "BatchMode=yes", "deploy@web1", "systemctl", "restart", "app"),
    ),
    ProcessInfo(
        48190,
        4242,
        NOW - 300,
        1000,
        "/usr/local/bin/python3.11",
        hashlib.sha256(b"python3.11").hexdigest(),
        "python3.11",
        ("python3.11", "-m", "agent", "--task", "restart the app after the config change"),
    ),
)
SUBJECT = Subject(
    48190,
    NOW - 300,
    "/usr/local/bin/python3.11",
    hashlib.sha256(b"python3.11").hexdigest(),
    1000,
    "9f1c2e4b7a6d5e30",
    run=RUN,
    kind=SubjectKind.RUN,
    image="img_3",
    exec_watch=ExecWatch.THREAD,
    sandboxed=True,
)
PEER = Peer(48211, 1000, 1000, CHAIN, SUBJECT)
REQ = "req_8c1d2f3a4b5e6071"


def _world(session: Session | None) -> World:
    policy = Policy(hosts=HOSTS, digest="d", files=("policy.toml",))
    return World(False, EPOCH, BOOT, policy, True, session, None, None, NOW)


SESSION = Session(
    "ses_7e3a91c04b2d", SUBJECT.key, "web1", "deploy", BOOT, EPOCH, entry_digest(HOST, ACCOUNT), 0
)


OPS = HOST.account("ops")
assert OPS is not None
OPS_SESSION = Session(
    "ses_91d4e2b07a3c", SUBJECT.key, "web1", "ops", BOOT, EPOCH, entry_digest(HOST, OPS), 0
)


def _card(card_id: str, req: Request, session: Session | None, **kw: Any) -> dict[str, Any]:
    verdict = evaluate(req, _world(session))
    assert isinstance(verdict, AskSession | AskCommand), verdict
    if "reason" in kw and isinstance(verdict, AskSession):
        verdict = replace(verdict, reason=kw["reason"])
    card = make_card(card_id, req, verdict, PEER, kw.get("conversation"), BOOT, EPOCH, NOW, 120)
    return card.as_json()


def _cards() -> dict[str, dict[str, Any]]:
    """The real cards every fixture is: one of each kind."""
    exec_req = Request(REQ, "web1", "deploy", b"systemctl restart app.service", SUBJECT.key)
    shell = (
        b"cd /srv/app && git pull --ff-only && "
        b'for s in web worker; do systemctl restart "app-$s"; done'
    )
    script = b"#!/bin/sh\nset -e\ncp /srv/app/new.conf /etc/app.conf\nsystemctl reload app\n"
    data = b"listen 8080\nworkers 4\n"
    write = FileOp(
        FileKind.WRITE,
        "/srv/app/config/app.conf",
        size=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        mode=0o640,
    )
    return {
        "session": _card(
            "sc_2f9a4c1e7b03",
            exec_req,
            None,
            reason=EndReason.PROCESS_CHANGED,
            conversation="claude-code session 4f1e: restart the app after the config change",
        ),
        "command_argv": _card("cc_61d0b8e2a94f", exec_req, SESSION),
        "grant": _card(
            "cc_e4b19a7c3d02",
            Request(REQ, "web1", "ops", b"systemctl restart app.service", SUBJECT.key),
            OPS_SESSION,
        ),
        "command_shell": _card(
            "cc_0a7f3e9d12c4", Request(REQ, "web1", "deploy", shell, SUBJECT.key), SESSION
        ),
        "command_stdin": _card(
            "cc_c93b70e15a28",
            Request(
                REQ,
                "web1",
                "deploy",
                b"sh -s",
                SUBJECT.key,
                stdin=Stdin.of(script, StdinEnd.CLOSED),
            ),
            SESSION,
        ),
        "file_write": _card(
            "cc_5d28e6a0f1b7",
            Request(REQ, "web1", "deploy", b"", SUBJECT.key, channel=Channel.SFTP, file=write),
            SESSION,
        ),
    }


def _fixture(kind: str) -> dict[str, Any]:
    path = SNAPSHOTS / f"{kind}.json"
    if not path.exists():
        pytest.skip(f"no {path.name}: BASTION_UPDATE_SNAPSHOTS=1 makes it")
    doc = json.loads(path.read_text())
    assert isinstance(doc, dict)
    return doc


def _fixtures() -> Iterator[tuple[str, dict[str, Any]]]:
    for path in sorted(SNAPSHOTS.glob("*.json")):
        yield path.stem, json.loads(path.read_text())


@pytest.fixture(autouse=True)
def _utc(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Start times are shown in local time: the snapshots are UTC's."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def test_the_fixtures_are_real_cards() -> None:
    """Each fixture is what `make_card` makes today, so its keys are the real ones."""
    for kind, doc in _cards().items():
        path = SNAPSHOTS / f"{kind}.json"
        if UPDATE:
            SNAPSHOTS.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
        assert json.loads(path.read_text()) == json.loads(json.dumps(doc)), kind
    # And the shell card is the one whose constructs the reading names.
    assert read_command(_cards()["command_shell"]["command"]).argv is None


def _snapshot(doc: dict[str, Any]) -> str:
    return (
        render_card(doc, width=80)
        + "\n----- d (details), at 80 columns -----\n"
        + render_details(doc, width=80)
        + "\n"
    )


@pytest.mark.parametrize("kind", KINDS)
def test_every_card_kind_at_80_columns_is_its_reviewed_snapshot(kind: str) -> None:
    shown = _snapshot(_fixture(kind))
    path = SNAPSHOTS / f"{kind}.txt"
    if UPDATE:
        path.write_text(shown)
    assert shown == path.read_text(), f"{kind}: rerun with BASTION_UPDATE_SNAPSHOTS=1, review"


# -- the width and the digests --------------------------------------------------------------

DIGESTS = re.compile(
    r"SHA256:[A-Za-z0-9+/]{43}|[0-9a-f]{64}|(?:req|cc|sc|ses|cmd|boot)_[0-9a-f]{12,24}"
)


def _digests(doc: object) -> set[str]:
    if isinstance(doc, dict):
        return set().union(*(_digests(v) for v in doc.values())) if doc else set()
    if isinstance(doc, list):
        return set().union(*(_digests(v) for v in doc)) if doc else set()
    return set(DIGESTS.findall(doc)) if isinstance(doc, str) else set()


def _abbreviation(digest: str) -> str:
    prefix = "SHA256:" if digest.startswith("SHA256:") else ""
    body = digest[len(prefix) :]
    return f"{prefix}{body[:12]}...{body[-4:]}"


def assert_fits(doc: dict[str, Any], text: str, width: int) -> None:
    """No line wider than `width` cells; every digest of the card that is shown at all
    is whole on one line, or abbreviated on one line."""
    lines = text.split("\n")
    wide = [line for line in lines if cell_len(line) > width]
    assert not wide, f"wider than {width}: {wide}"
    joined = "".join(line.lstrip(" ") for line in lines)
    for digest in _digests(doc):
        whole = any(digest in line for line in lines)
        short = any(_abbreviation(digest) in line for line in lines)
        assert whole or short or digest not in joined, f"{digest} split at {width}: {text}"


@pytest.mark.parametrize("width", [MIN_WIDTH, 40, 80, 200])
def test_no_line_is_wider_than_the_terminal_and_no_digest_is_split(width: int) -> None:
    for kind, doc in _fixtures():
        assert_fits(doc, render_card(doc, width=width), width), kind
        assert_fits(doc, render_details(doc, width=width), width), kind


@settings(max_examples=60, deadline=None)
@given(width=st.integers(MIN_WIDTH, 200))
def test_any_width_from_the_narrowest(width: int) -> None:
    for _, doc in _fixtures():
        assert_fits(doc, render_card(doc, details=True, width=width), width)
        styled = render_card(doc, details=True, style=Style(True), width=width)
        assert_fits(doc, re.sub(r"\x1b\[[0-9;]*m", "", styled), width)


def test_at_80_columns_the_card_shows_every_digest_whole() -> None:
    for kind, doc in _fixtures():
        card, details = render_card(doc, width=80), render_details(doc, width=80)
        assert "..." not in card.replace("... and", ""), kind
        lines = (card + "\n" + details).split("\n")
        for digest in _digests(doc):
            if digest in card + details:
                assert any(digest in line for line in lines), (kind, digest)


def test_a_digest_no_line_holds_is_abbreviated_and_whole_under_d() -> None:
    doc = _fixture("file_write")
    sha = doc["file"]["sha256"]
    narrow = render_card(doc, width=MIN_WIDTH)
    assert sha not in narrow and _abbreviation(sha) in narrow
    assert "shown whole under d" in narrow
    details = render_details(doc, width=70)  # the exe's sha256 at column 0: 64 fit in 70
    assert doc["subject"]["exe_sha256"] in details.split("\n")
    assert "..." not in details


def test_the_header_is_not_repeated_by_details() -> None:
    doc = _fixture("command_argv")
    assert doc["id"] not in render_details(doc)
    both = render_card(doc, details=True)
    assert both == render_card(doc) + "\n" + render_details(doc)
    assert both.count(doc["id"]) == 1


# -- exact text ---------------------------------------------------------------------------

ANSI = re.compile(r"\x1b\[([0-9;]*)m")


def _command_body(doc: dict[str, Any], width: int) -> tuple[str, list[int]]:
    """A shell card's command drawn at `width`, its lines joined back, each without its
    indent, and which characters of it are drawn red (31): a highlighted construct. The
    command's lines are those between the heading ("... decides what runs:") and the
    row after them (`terminal:`); the constructs' own rows are left out."""
    doc = dict(doc, terminal=True, shell_syntax=[])
    drawn = render_card(doc, style=Style(True), width=width).split("\n")
    plain = [ANSI.sub("", line) for line in drawn]
    heading = next(i for i, line in enumerate(plain) if "USES SHELL SYNTAX" in line)
    start = next(i for i in range(heading, len(plain)) if plain[i].endswith("runs:")) + 1
    end = next(i for i, line in enumerate(plain) if line.startswith("  terminal:"))
    first = min(INDENT, max(MORE, width - ROOM))  # where the command's first line starts
    out, red = [], []
    for n, line in enumerate(drawn[start:end]):
        indent = first if n == 0 else first + MORE  # a continuation: two cells further in
        assert plain[start + n].startswith(" " * indent), plain[start + n]
        chars, colour = [], False
        for i, piece in enumerate(ANSI.split(line)):
            if i % 2:  # an SGR code's parameters
                colour = "31" in piece.split(";")
            else:
                chars += [(ch, colour) for ch in piece]
        body = chars[indent:]
        red += [len("".join(out)) + i for i, (_, c) in enumerate(body) if c]
        out.append("".join(ch for ch, _ in body))
    return "".join(out), red


@pytest.mark.parametrize("width", [MIN_WIDTH, 33, 47, 80, 120])
def test_a_commands_text_is_whole_and_its_highlights_stay_on_their_characters(
    width: int,
) -> None:
    doc = _fixture("command_shell")
    command = doc["command"]
    shown, red = _command_body(doc, width)
    assert shown == command  # nothing dropped, nothing added: each line after its indent
    marked = sorted(i for a, b in doc["command_marks"] for i in range(a, b))
    assert red == marked


def test_spaces_at_a_break_open_the_next_line() -> None:
    doc = dict(_fixture("command_shell"), command="echo " + "x" * 50 + "    " + "y" * 20)
    doc["command_marks"] = []
    lines = render_card(doc, width=80).split("\n")
    at = lines.index(" " * 12 + "echo " + "x" * 50)
    assert lines[at + 1] == " " * 14 + "    " + "y" * 20


def test_cells_are_measured_not_characters() -> None:
    """escape_text lets CJK through: two cells each."""
    doc = json.loads(json.dumps(_fixture("file_write")))
    doc["file"]["path"] = "/srv/app/" + "設定ファイル" * 12 + ".conf"
    for width in (MIN_WIDTH, 41, 80):
        text = render_card(doc, width=width)
        assert all(cell_len(line) <= width for line in text.split("\n")), text
        joined = "".join(line.lstrip(" ") for line in text.split("\n"))
        assert doc["file"]["path"] in joined


def test_styling_only_when_enabled() -> None:
    doc = _fixture("command_shell")
    assert "\x1b" not in render_card(doc, details=True)
    styled = render_card(doc, details=True, style=Style(True))
    assert "\x1b[" in styled and ANSI.sub("", styled) == render_card(doc, details=True)
    # One code per sequence, from the prompt's short list (test_cards_cannot_lie holds
    # the screen to it): never a combined `1;31`.
    assert set(ANSI.findall(styled)) <= {"0", "1", "2", "31", "32", "33"}


PIECES = [*"ab cd-/=$&;", "設定", "  ", "e" * 70, "0" * 64]
TEXT = st.lists(st.sampled_from(PIECES), max_size=30).map("".join)


@settings(max_examples=80, deadline=None)
@given(width=st.integers(MIN_WIDTH, 130), command=TEXT, exe=TEXT)
def test_any_text_fits_and_a_commands_text_comes_back_whole(
    width: int, command: str, exe: str
) -> None:
    """Whatever the command and the executable's path: no line wider than the width, and
    the command's lines, each after its indent, are its text."""
    doc = dict(_fixture("command_shell"), command=command, command_marks=[], shell_syntax=[])
    doc["subject"] = dict(doc["subject"], exe="/" + exe)
    text = render_card(doc, width=width)
    assert all(cell_len(line) <= width for line in text.split("\n")), text
    if command.strip(" "):
        shown, _ = _command_body(doc, width)
        assert shown == command
