"""Which later card an ended approval explains (issue 22): the same run, or outside
runs the same process -- or, where the agent gave a conversation ref, its executable
in that conversation (issue 3's replacement process) -- never every process of the
same executable. And a withdrawn card's reason travels with its ending, once."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from bastion.core.cards import Withdrawal
from bastion.core.gate import CardEnding, EndReason, Session
from bastion.core.subject import Run, Subject, SubjectKind
from bastion.gateway.approvals import ENDED_REMEMBERED, ApprovalBook, _Live

PY = "/usr/bin/python3.11"


def subject(pid: int = 4242, **kw: object) -> Subject:
    base = Subject(pid, 1000.0 + pid, PY, "ab" * 32, 1000, f"n{pid}", None, SubjectKind.PROCESS)
    return replace(base, **kw)  # type: ignore[arg-type]


def ended(book: ApprovalBook, who: Subject, conversation: str | None, reason: EndReason) -> None:
    """`who` held an approval for u@web1, and it ended with `reason`."""
    grant = Session(f"ses_{who.pid}", who.key, "web1", "u", "boot", 1, "d", 0.0)
    book._sessions[(who.key, "web1", "u")] = _Live(grant, who, conversation)
    assert book.end_sessions(lambda g: g.id == grant.id, reason) == [grant.id]


def test_another_process_of_the_same_executable_is_told_nothing() -> None:
    book = ApprovalBook("boot")
    ended(book, subject(1), None, EndReason.PROCESS_CHANGED)
    assert book.session_for(subject(2), "web1", "u", None) == (None, None)
    # The control: the same process (after an exec: another image) is told why.
    again = replace(subject(1), image="img2", exe="/usr/bin/node")
    assert book.session_for(again, "web1", "u", None) == (None, EndReason.PROCESS_CHANGED)


def test_a_replacement_in_the_same_conversation_is_told_why() -> None:
    """Issue 3: a new process of the same program continuing the conversation the
    agent named hears why the last one's approval ended; another conversation does not."""
    book = ApprovalBook("boot")
    ended(book, subject(1), "conv-7", EndReason.PROCESS_CHANGED)
    assert book.session_for(subject(2), "web1", "u", "conv-7") == (
        None,
        EndReason.PROCESS_CHANGED,
    )
    assert book.session_for(subject(2), "web1", "u", "conv-8") == (None, None)
    assert book.session_for(subject(2), "web1", "u", None) == (None, None)


def test_a_run_is_told_only_of_its_own_approvals() -> None:
    run = Run("deploy", None, "boot-1:4242:777", 0.0, 1000)
    book = ApprovalBook("boot")
    ended(book, subject(1, run=run, kind=SubjectKind.RUN), None, EndReason.REVOKED)
    other = replace(run, lasting="boot-1:5000:888")
    fresh = subject(2, run=other, kind=SubjectKind.RUN)
    assert book.session_for(fresh, "web1", "u", None) == (None, None)
    back = subject(1, run=run, kind=SubjectKind.RUN, nonce="n-later")
    assert book.session_for(back, "web1", "u", None) == (None, EndReason.REVOKED)


def test_a_restart_is_said_to_the_process_that_outlived_it() -> None:
    first = ApprovalBook("boot_a")
    live = subject(1)
    grant = Session("ses_1", live.key, "web1", "u", "boot_a", 1, "d", 0.0)
    first._sessions[(live.key, "web1", "u")] = _Live(grant, live, None)
    second = ApprovalBook("boot_b")
    second.previous_lifetime(first.live_match_keys())
    ended(second, subject(2), None, EndReason.PROCESS_CHANGED)  # another python3, since
    back = replace(live, nonce="n-new-lifetime")
    assert second.session_for(back, "web1", "u", None) == (None, EndReason.GATEWAY_RESTARTED)
    assert second.session_for(subject(3), "web1", "u", None) == (None, None)


def test_the_ended_reasons_kept_are_bounded() -> None:
    book = ApprovalBook("boot")
    for pid in range(1, ENDED_REMEMBERED + 11):
        ended(book, subject(pid), None, EndReason.PROCESS_CHANGED)
    assert len(book._ended) == ENDED_REMEMBERED
    assert book.session_for(subject(1), "web1", "u", None) == (None, None)  # the oldest
    newest = subject(ENDED_REMEMBERED + 10)
    assert book.session_for(newest, "web1", "u", None) == (None, EndReason.PROCESS_CHANGED)


def test_a_withdrawal_says_why_once() -> None:
    async def scenario() -> None:
        seen: list[tuple[CardEnding | None, Withdrawal | None]] = []
        book = ApprovalBook("boot", on_card=lambda c, a, w: seen.append((a, w)))
        card = type("C", (), {"id": "sc_1"})()
        fut = book.open_card(card)  # type: ignore[arg-type]
        assert book.close_card("sc_1", CardEnding.WITHDRAWN_GONE, Withdrawal.AGENT_EXITED)
        assert await fut is CardEnding.WITHDRAWN_GONE
        # A later close (the request's own, as it stops waiting) changes nothing.
        assert not book.close_card("sc_1", CardEnding.WITHDRAWN_GONE, Withdrawal.CONNECTION_CLOSED)
        assert book.withdrawal("sc_1") is Withdrawal.AGENT_EXITED
        assert book.withdrawal("sc_1") is None
        assert seen == [(None, None), (CardEnding.WITHDRAWN_GONE, Withdrawal.AGENT_EXITED)]
        # The control: an answered card has no withdrawal.
        book.open_card(type("C", (), {"id": "sc_2"})())  # type: ignore[arg-type]
        assert book.close_card("sc_2", CardEnding.DECLINED)
        assert book.withdrawal("sc_2") is None

    asyncio.run(scenario())
