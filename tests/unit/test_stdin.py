"""stdin on a command card: read whole before the card, shown escaped, bound in the
grant, fed to the target, refused when it cannot be read whole (core/stdin,
gateway/stdin, the request path over fakes)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest

from bastion.cli.cardview import render_card
from bastion.core.binding import Binding
from bastion.core.cards import make_card
from bastion.core.contract import Code, Failure, Refusal
from bastion.core.defaults import MAX_CARD_STDIN, STDIN_PREVIEW
from bastion.core.events import EventType, Result, request_state
from bastion.core.gate import (
    AskCommand,
    AskSession,
    CommandGrant,
    Dispatch,
    Request,
    command_grant_holds,
    evaluate,
    reads_stdin,
)
from bastion.core.stdin import Stdin, StdinEnd
from bastion.gateway.stdin import Fed, Taken, read_whole
from tests.unit.fakes import PASSPHRASE, FakeGateway, idle
from tests.unit.test_binding import (
    ACCOUNT,
    BOOT,
    EPOCH,
    HOST,
    NOW,
    PEER,
    SESSION,
    SUBJECT,
    world,
)
from tests.unit.test_service import Rig

SCRIPT = b"touch /tmp/M\n"


def piped(data: bytes, end: StdinEnd = StdinEnd.CLOSED) -> Request:
    return Request("req_1", "web1", "ops", b"sh", SUBJECT.key, stdin=Stdin.of(data, end))


def card_json(req: Request) -> dict[str, Any]:
    verdict = evaluate(req, world(SESSION))
    assert isinstance(verdict, AskCommand)
    return make_card("cc_1", req, verdict, PEER, None, BOOT, EPOCH, NOW, 60.0).as_json()


# -- the card ------------------------------------------------------------------------


def test_the_card_shows_size_digest_and_an_escaped_preview() -> None:
    hostile = b"echo ok\n\x1b[2J\x1b]0;title\x07\r\xff\xfe\\ \xe2\x80\xae"
    doc = card_json(piped(hostile))
    stdin = doc["stdin"]
    assert isinstance(stdin, dict)
    assert stdin["size"] == len(hostile) and stdin["end"] == "closed"
    assert stdin["sha256"] == Stdin.of(hostile, StdinEnd.CLOSED).sha256
    assert stdin["preview"] == ("echo ok\\n\\x1b[2J\\x1b]0;title\\x07\\x0d\\xff\\xfe\\\\ \\u202e")
    shown = render_card(doc)
    assert f"stdin:    {len(hostile)} bytes -- the command reads these:" in shown
    assert f"stdin sha256: {stdin['sha256']}" in shown
    assert "\x1b" not in shown and "\r" not in shown and "\u202e" not in shown
    # The binding holds the digest the card shows.
    assert doc["command_sha256"] is not None


def test_a_long_stdin_shows_its_first_bytes_and_says_how_many_more() -> None:
    data = b"a" * (STDIN_PREVIEW + 100)
    doc = card_json(piped(data))
    stdin = doc["stdin"]
    assert isinstance(stdin, dict) and stdin["preview"] == "a" * STDIN_PREVIEW
    assert "... and 100 more bytes (not shown)" in render_card(doc)


def test_no_stdin_and_a_silent_stdin_say_the_command_gets_none() -> None:
    assert "stdin:    none (closed empty)" in render_card(card_json(piped(b"")))
    silent = render_card(card_json(piped(b"", StdinEnd.SILENT)))
    assert "still open, nothing sent; the command gets none" in silent


def test_the_journals_card_has_no_stdin_content() -> None:
    verdict = evaluate(piped(SCRIPT), world(SESSION))
    assert isinstance(verdict, AskCommand)
    card = make_card("cc_1", piped(SCRIPT), verdict, PEER, None, BOOT, EPOCH, NOW, 60.0)
    kept = card.as_json(preview=False)["stdin"]
    assert kept == {"end": "closed", "size": len(SCRIPT), "sha256": card.binding.stdin}
    assert "touch" not in repr(card.as_json(preview=False))


# -- the binding ---------------------------------------------------------------------


def grant_for(req: Request) -> CommandGrant:
    verdict = evaluate(req, world(SESSION))
    assert isinstance(verdict, AskCommand)
    card = make_card("cc_1", req, verdict, PEER, None, BOOT, EPOCH, NOW, 60.0)
    return CommandGrant("cmd_1", SESSION.id, card.binding, NOW + 60)


def test_a_grant_for_one_stdin_runs_no_other() -> None:
    grant = grant_for(piped(SCRIPT))
    assert command_grant_holds(grant, piped(SCRIPT), HOST, ACCOUNT, SESSION, NOW)  # control
    for other in (
        piped(b"rm -rf /\n"),
        piped(SCRIPT + b"\n"),
        piped(b""),
        replace(piped(SCRIPT), stdin=None),  # not read: it would stream anything
    ):
        assert not command_grant_holds(grant, other, HOST, ACCOUNT, SESSION, NOW), other.stdin
    # ... and a grant for a command with no stdin read holds for no stdin that was read.
    unread = replace(piped(SCRIPT), stdin=None)
    bare = CommandGrant("cmd_1", SESSION.id, Binding.of(HOST, ACCOUNT, unread.command_sha256), 1e9)
    assert command_grant_holds(bare, unread, HOST, ACCOUNT, SESSION, NOW)
    assert not command_grant_holds(bare, piped(b""), HOST, ACCOUNT, SESSION, NOW)


def test_the_gate_dispatches_only_the_stdin_its_grant_holds() -> None:
    grant = grant_for(piped(SCRIPT))
    w = replace(world(SESSION), command_grant=grant)
    assert isinstance(evaluate(piped(SCRIPT), w), Dispatch)
    assert isinstance(evaluate(piped(b"rm -rf /\n"), w), AskCommand)


# -- when stdin is read: the gate says ----------------------------------------------


def test_stdin_is_read_only_before_a_command_card_and_only_once() -> None:
    unread = replace(piped(SCRIPT), stdin=None)
    ask = evaluate(unread, world(SESSION))
    assert isinstance(ask, AskCommand) and reads_stdin(unread, ask)
    assert not reads_stdin(piped(SCRIPT), evaluate(piped(SCRIPT), world(SESSION)))  # read
    session_card = evaluate(unread, world(None))
    assert isinstance(session_card, AskSession) and not reads_stdin(unread, session_card)


@pytest.mark.parametrize(
    "end,words",
    [
        (StdinEnd.TOO_LARGE, f"larger than {MAX_CARD_STDIN} bytes"),
        (StdinEnd.UNFINISHED, "no end (EOF)"),
    ],
)
def test_a_stdin_not_read_whole_is_refused_before_any_card(end: StdinEnd, words: str) -> None:
    verdict = evaluate(piped(b"x" * 10, end), world(None))
    assert isinstance(verdict, Refusal) and verdict.code is Code.UNSUPPORTED_REQUEST
    assert words in verdict.message and "Nothing was sent" in verdict.message
    if end is StdinEnd.TOO_LARGE:
        assert "scp" in verdict.message and "sftp" in verdict.message
    assert not Code.UNSUPPORTED_REQUEST.retryable
    locked = evaluate(piped(b"x", end), replace(world(None), locked=True))
    assert isinstance(locked, Refusal) and locked.code is Code.VAULT_LOCKED


# -- reading it (gateway/stdin) -------------------------------------------------------


class Reader:
    """An agent's stdin: these chunks, then EOF -- or, `open`, nothing more ever."""

    def __init__(self, chunks: list[bytes], open: bool = False) -> None:
        self.chunks = list(chunks)
        self.open = open
        self.never = asyncio.Event()

    async def read(self, n: int) -> bytes:
        if self.chunks:
            head = self.chunks.pop(0)
            self.chunks[:0] = [head[n:]] if head[n:] else []
            return head[:n]
        if self.open:
            await self.never.wait()
        return b""


async def test_read_whole_reads_to_eof() -> None:
    data, end = await read_whole(Reader([b"ab", b"c" * 70000]), wait=30)
    assert (data, end) == (b"ab" + b"c" * 70000, StdinEnd.CLOSED)


async def test_read_whole_stops_one_past_the_bound() -> None:
    data, end = await read_whole(Reader([b"x" * 100], open=True), limit=10, wait=30)
    assert end is StdinEnd.TOO_LARGE and len(data) == 11


async def test_read_whole_of_an_open_stdin_that_sends_nothing_is_silent() -> None:
    assert await read_whole(Reader([], open=True), wait=0.01) == (b"", StdinEnd.SILENT)


async def test_read_whole_of_an_open_stdin_after_some_bytes_is_unfinished() -> None:
    assert await read_whole(Reader([b"ab"], open=True), wait=0.01) == (
        b"ab",
        StdinEnd.UNFINISHED,
    )


async def test_a_trickle_is_not_waited_for_past_the_deadline() -> None:
    ticks = iter(range(0, 1000, 10))
    data, end = await read_whole(
        Reader([b"a"] * 50), wait=30, deadline=25, clock=lambda: float(next(ticks))
    )
    assert end is StdinEnd.UNFINISHED and 0 < len(data) < 50


async def test_fed_gives_exactly_the_bytes_then_eof() -> None:
    fed = Fed(b"abcdef")
    assert [await fed.read(4), await fed.read(4), await fed.read(4)] == [b"abcd", b"ef", b""]


# -- the request path over fakes -------------------------------------------------------


class Streams:
    def __init__(self, stdin: Any) -> None:
        self.stdin = stdin


def rig_reading(data: bytes, end: StdinEnd = StdinEnd.CLOSED) -> tuple[Rig, list[Any]]:
    """A rig whose agents' stdin reads as `data`; the list gets each streams read."""
    read: list[Any] = []

    async def take(streams: Any) -> Taken:
        read.append(streams)
        return Taken(Stdin.of(data, end), Streams(Fed(data)))

    r = Rig()
    r.life = FakeGateway(r.vault, r.policy, r.journal, r.tree, r.outbound, take_stdin=take)
    return r, read


async def test_a_per_command_card_carries_the_stdin_and_the_target_gets_it() -> None:
    r, read = rig_reading(SCRIPT)
    await r.life.authority.unlock(PASSPHRASE)
    conn = r.life.connect(r.tree.spawn(), user="ops")
    task = r.send(conn, b"sh")
    assert (await r.approve()).kind.value == "session"
    await idle()
    assert len(read) == 1  # after the session card, before the command card
    card = await r.approve()
    assert card.stdin == Stdin.of(SCRIPT, StdinEnd.CLOSED)
    assert card.binding.stdin == card.stdin.sha256
    assert isinstance(await task, Result)
    (call,) = r.outbound.sent
    assert await call.streams.stdin.read(1 << 20) == SCRIPT
    story = request_state(r.journal.records, card.request_id, r.life.boot_id)
    assert story is not None and story["stdin"] == {
        "end": "closed",
        "size": len(SCRIPT),
        "sha256": card.stdin.sha256,
    }
    assert E_STDIN in r.journal.for_request(card.request_id)


E_STDIN = EventType.STDIN_READ.value


async def test_too_much_stdin_is_refused_with_no_command_card_and_nothing_sent() -> None:
    r, _ = rig_reading(b"x" * (MAX_CARD_STDIN + 1), StdinEnd.TOO_LARGE)
    await r.life.authority.unlock(PASSPHRASE)
    conn = r.life.connect(r.tree.spawn(), user="ops")
    task = r.send(conn, b"sh")
    await r.approve()  # the session card
    result = await task
    assert isinstance(result, Failure) and result.code is Code.UNSUPPORTED_REQUEST
    assert "scp" in result.message and r.outbound.calls == []
    assert [c.kind.value for c in r.life.book.pending()] == []
    assert r.journal.for_request(result.request_id)[-2:] == [E_STDIN, "denied"]


@pytest.mark.parametrize("user,command", [("deploy", b"echo hi"), ("ops", b"uptime")])
async def test_no_card_for_the_command_means_stdin_streams(user: str, command: bytes) -> None:
    """A session account, and a preapproved command: stdin is never read first."""
    r, read = rig_reading(SCRIPT)
    await r.life.authority.unlock(PASSPHRASE)
    conn = r.life.connect(r.tree.spawn(), user=user)
    task = r.send(conn, command)
    card = await r.approve()
    assert isinstance(await task, Result) and read == [] and card.stdin is None
    (call,) = r.outbound.sent
    assert call.streams == card.request_id  # the request's own streams (`Rig.send`), unread
    assert E_STDIN not in r.journal.for_request(card.request_id)
