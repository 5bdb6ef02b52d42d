"""Bounded grants (core/grants): the pattern, its bound, the policy field, and the
request path against fakes -- uses taken once each, concurrent requests, the endings
it shares with its session, and what a grant never covers."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bastion.core.command import is_option
from bastion.core.contract import Code, Failure
from bastion.core.events import EventType, Outcome, Result, activity, export_event
from bastion.core.gate import CardKind, Request
from bastion.core.grants import (
    Bound,
    GrantError,
    Pattern,
    parse_bound,
    parse_grant,
    quote_word,
    split_pattern,
    why_literal,
)
from bastion.core.policy import PolicyError, build_policy, entry_digest
from bastion.core.stdin import Stdin, StdinEnd
from bastion.gateway.approvals import CardError, GrantAsk
from bastion.gateway.control import grant_arg
from bastion.gateway.service import AgentConn, Case, new_request_id
from bastion.gateway.stdin import Taken
from bastion.ops.opsock import OperatorError
from tests.unit.fakes import (
    KEY,
    PASSPHRASE,
    FakeGateway,
    FakeJournal,
    FakeOutbound,
    FakePolicy,
    FakeProcessTree,
    FakeVault,
    idle,
)

ARGV = ("systemctl", "restart", "a")


# -- the pattern -----------------------------------------------------------------------------


def test_a_star_replaces_one_whole_word_and_the_rest_stay_the_cards() -> None:
    p = parse_grant(ARGV, "systemctl restart *")
    assert p == Pattern(("systemctl", "restart", None))
    assert p.text == "systemctl restart *"
    assert p.matches(("systemctl", "restart", "b"))
    assert p.matches(("systemctl", "restart", "now"))  # one word, any value but an option
    assert not p.matches(("systemctl", "restart", "--now"))  # never an option (below)
    assert not p.matches(("systemctl", "stop", "b"))
    assert not p.matches(("systemctl", "restart"))  # never fewer words
    assert not p.matches(("systemctl", "restart", "b", "c"))  # never any number of words
    assert not p.matches(None)  # shell source has no argv
    exact = parse_grant(ARGV, "systemctl restart a")  # no *: the same command, again
    assert exact.matches(ARGV) and not exact.matches(("systemctl", "restart", "b"))


@pytest.mark.parametrize(
    "text,fragment",
    [
        ("* restart a", "first word"),
        ("systemctl *", "has 2 word(s)"),
        ("systemctl restart a b", "has 4 word(s)"),
        ("systemctl stop *", "word 2"),
        ("systemctl restart a*", "never a glob inside a word"),
        ("systemctl restart *a", "never a glob inside a word"),
        ("systemctl re* *", "never a glob inside a word"),
        ("systemctl restart 'a", "unclosed quote"),
        ("systemctl restart $X", "holds '$'"),
        ("systemctl restart a; id", "holds ';'"),
        ("systemctl restart `id`", "holds '`'"),
        ('systemctl restart "$X"', "single quotes"),
        ("systemctl restart \\*", "holds '\\\\'"),
    ],
)
def test_a_pattern_that_is_not_the_cards_words_or_a_star_is_refused(
    text: str, fragment: str
) -> None:
    with pytest.raises(GrantError) as refused:
        parse_grant(ARGV, text)
    assert fragment in str(refused.value)


MAKE = ("make", "-C", "/srv/app", "x")


@pytest.mark.parametrize(
    "word", ["--eval=x:;touch /tmp/m", "-f/tmp/evil.mk", "-", "--", "--x=y", "-C"]
)
def test_a_star_never_matches_an_option_word(word: str) -> None:
    """Issue 32 item 2: `make -C DIR *` admitted `make -C DIR '--eval=...'`. As in every
    admitting rule, a `*` covers no word that begins with `-` (`is_option`)."""
    p = parse_grant(MAKE, "make -C /srv/app *")
    assert p.matches(MAKE) and p.matches(("make", "-C", "/srv/app", "all"))  # the control
    assert p.matches(("make", "-C", "/srv/app", "x-y"))  # a `-` inside a word: no option
    assert not p.matches(("make", "-C", "/srv/app", word))


def test_an_option_is_covered_where_the_pattern_spells_it_as_the_cards_own_word() -> None:
    p = parse_grant(MAKE, "make -C * x")
    assert p.words == ("make", "-C", None, "x")
    assert p.matches(("make", "-C", "/srv/other", "x"))
    assert not p.matches(("make", "-f", "/srv/other", "x"))  # another option: not the card's
    assert not p.matches(("make", "-C", "--eval=x", "x"))


@pytest.mark.parametrize(
    "argv,text,fragment",
    [
        (MAKE, "make * /srv/app x", "word 2 of the grant pattern cannot be *: -C is an option"),
        (MAKE, "make * * *", "word 2 of the grant pattern cannot be *: -C is an option"),
        ((*MAKE, "-"), "make -C /srv/app x *", "word 5 of the grant pattern cannot be *: - is"),
        (("tar", "--to-command=a b"), "tar *", "'--to-command=a b' is an option"),
    ],
)
def test_widening_one_of_the_cards_options_is_refused_with_why(
    argv: tuple[str, ...], text: str, fragment: str
) -> None:
    """A `*` where the card has an option could not match even the card's own command:
    refused, saying which word, why, and what to write instead -- never made inert."""
    with pytest.raises(GrantError) as refused:
        parse_grant(argv, text)
    said = str(refused.value)
    assert fragment in said
    assert "a * never matches a word that begins with -" in said
    assert "keep the option as spelled" in said


def test_why_a_word_stays_literal_the_program_and_the_cards_options() -> None:
    assert why_literal(MAKE, 0) is not None and "program" in str(why_literal(MAKE, 0))
    assert "-C is an option" in str(why_literal(MAKE, 1))
    assert why_literal(MAKE, 2) is None and why_literal(MAKE, 3) is None
    quoted = why_literal(("tar", "--to-command=touch m"), 1)
    assert quoted is not None and quoted.startswith("'--to-command=touch m' is an option")


WORDS = st.one_of(
    st.text(alphabet="-=abx*/ ", min_size=0, max_size=6),
    st.sampled_from(["-", "--", "-C", "--eval=x", "all", "*", ""]),
)
OPTIONS = st.text(alphabet="-=abx*/ ", max_size=6).map(lambda w: "-" + w)


@given(
    st.lists(WORDS, min_size=1, max_size=6).flatmap(
        lambda argv: st.tuples(
            st.just(tuple(argv)),
            st.sets(st.integers(0, len(argv) - 1)),
            st.lists(OPTIONS, min_size=len(argv), max_size=len(argv)),
        )
    )
)
def test_a_wildcard_never_covers_an_option_word(
    case: tuple[tuple[str, ...], set[int], list[str]],
) -> None:
    """For any argv and any of its words as `*` (a pattern built directly, as a record
    anyone may build, so parse_grant's refusals do not hide it): the pattern covers the
    argv exactly when no `*` stands on an option, and an option put where a `*` stands
    is never covered."""
    argv, wild, options = case
    pattern = Pattern(tuple(None if i in wild else w for i, w in enumerate(argv)))
    assert pattern.matches(argv) is not any(is_option(argv[i]) for i in wild)
    for i in wild:
        assert not pattern.matches((*argv[:i], options[i], *argv[i + 1 :]))


@given(
    st.lists(WORDS, min_size=1, max_size=6).flatmap(
        lambda argv: st.tuples(st.just(tuple(argv)), st.sets(st.integers(0, len(argv) - 1)))
    )
)
def test_a_pattern_parse_grant_makes_always_matches_its_cards_own_command(
    case: tuple[tuple[str, ...], set[int]],
) -> None:
    """Widen any words of any card: either refused (the program or an option among them,
    named) or a pattern that covers the card's own command and no option at a `*`."""
    argv, wild = case
    text = " ".join("*" if i in wild else quote_word(w) for i, w in enumerate(argv))
    kept = [i for i in sorted(wild) if why_literal(argv, i) is not None]
    if kept:
        with pytest.raises(GrantError, match=f"word {kept[0] + 1} of the grant pattern"):
            parse_grant(argv, text)
        return
    pattern = parse_grant(argv, text)
    assert pattern.matches(argv)
    assert all(not is_option(argv[i]) for i in wild)
    for i in wild:
        assert not pattern.matches((*argv[:i], "--eval=x", *argv[i + 1 :]))


def test_quoted_words_are_literal_and_a_quoted_star_is_a_star() -> None:
    argv = ("echo", "a b", "*", "it's")
    assert split_pattern("echo 'a b' '*' *") == ["echo", "a b", "*", None]
    p = parse_grant(argv, "echo \"a b\" '*' *")
    assert p.words == ("echo", "a b", "*", None)
    assert p.matches(("echo", "a b", "*", "x")) and not p.matches(("echo", "a b", "z", "x"))
    assert p.text == "echo 'a b' '*' *"
    assert split_pattern(p.text) == ["echo", "a b", "*", None]  # the text reads back
    assert quote_word("it's") == "'it'\"'\"'s'" and split_pattern(quote_word("it's")) == ["it's"]


def test_shell_source_is_never_granted() -> None:
    with pytest.raises(GrantError, match="shell source"):
        parse_grant(None, "systemctl restart *")


@pytest.mark.parametrize(
    "uses,minutes,ok",
    [
        (2, None, True),
        (None, 10, True),
        (100, 480, True),
        (None, None, False),
        (0, None, False),
        (101, None, False),
        (None, 0, False),
        (None, 481, False),
        (True, None, False),
        (1.5, None, False),
    ],
)
def test_a_bound_is_uses_and_or_minutes_in_range(uses: Any, minutes: Any, ok: bool) -> None:
    if ok:
        assert parse_bound(uses, minutes) == Bound(uses, minutes)
    else:
        with pytest.raises(GrantError):
            parse_bound(uses, minutes)


# -- the policy field ------------------------------------------------------------------------


def text(grants: str | None = None, approval: str = "per-command") -> str:
    line = f"grants = {grants}\n" if grants is not None else ""
    return f"""
[hosts.web1]
address = "10.0.0.5"
host_key = "{KEY}"

[[hosts.web1.accounts]]
user = "deploy"
credential = "deploy-key"
approval = "session"
allow = ["echo *"]

[[hosts.web1.accounts]]
user = "gr"
credential = "gr-key"
approval = "{approval}"
deny = ["* halt*"]
{line}"""


def digest_of(policy_text: str, user: str = "gr") -> str:
    host = build_policy([("p.toml", "p.toml", policy_text)]).hosts["web1"]
    account = host.account(user)
    assert account is not None
    return entry_digest(host, account)


def test_grants_are_off_unless_written_and_the_default_keeps_the_entry_digest() -> None:
    policy = build_policy([("p.toml", "p.toml", text())])
    assert policy.hosts["web1"].account("gr").grants is False  # type: ignore[union-attr]
    assert digest_of(text("false")) == digest_of(text())  # sessions survive an upgrade
    assert digest_of(text("true")) != digest_of(text())  # turning it on is a new entry


@pytest.mark.parametrize(
    "grants,approval,fragment",
    [("true", "session", "per-command"), ('"yes"', "per-command", "true or false")],
)
def test_grants_on_a_session_account_or_not_a_boolean_are_refused(
    grants: str, approval: str, fragment: str
) -> None:
    with pytest.raises(PolicyError, match=fragment):
        build_policy([("p.toml", "p.toml", text(grants, approval))])


# -- the request path, over fakes ------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Rig:
    def __init__(self, grants: bool = True, stdin: bytes = b"") -> None:
        self.vault = FakeVault()
        self.policy = FakePolicy(
            build_policy([("p.toml", "p.toml", text("true" if grants else None))])
        )
        self.journal = FakeJournal()
        self.tree = FakeProcessTree()
        self.outbound = FakeOutbound(auto=True)
        self.clock = Clock()
        self.stdin = stdin

        async def take(streams: Any) -> Taken:
            return Taken(Stdin.of(self.stdin, StdinEnd.CLOSED), streams)

        self.life = FakeGateway(
            self.vault,
            self.policy,
            self.journal,
            self.tree,
            self.outbound,
            self.clock,
            take_stdin=take,
        )
        self.agent = self.tree.spawn()
        self.conn = self.life.connect(self.agent, user="gr")

    def send(self, command: bytes, conn: AgentConn | None = None) -> asyncio.Task[Any]:
        conn = conn or self.conn
        req = Request(new_request_id(), "web1", "gr", command, conn.peer.subject.key)
        return asyncio.ensure_future(
            self.life.service.handle(Case(conn, req, None, req.request_id))
        )

    async def card(self) -> Any:
        await idle()
        pending = self.life.book.pending()
        assert pending, "no card was raised"
        return pending[-1]

    async def no_card(self, task: asyncio.Task[Any]) -> Result:
        """The request runs to its end with no card raised on the way."""
        raised = len(self.journal.of(EventType.CARD_RAISED))
        result = await asyncio.wait_for(task, 10)
        assert len(self.journal.of(EventType.CARD_RAISED)) == raised
        assert isinstance(result, Result) and result.outcome is Outcome.COMPLETED, result
        return result

    async def granted(self, pattern: str = "systemctl restart *", **bound: int) -> Any:
        """The first command, approved with a grant; returns the grant."""
        await self.life.authority.unlock(PASSPHRASE)
        task = self.send(b"systemctl restart a")
        self.life.authority.answer((await self.card()).id, True)  # the session card
        card = await self.card()
        assert card.kind is CardKind.COMMAND and card.grantable
        ask = GrantAsk(pattern, bound.get("uses"), bound.get("minutes"))
        self.life.authority.answer(card.id, True, ask)
        assert isinstance(await task, Result)
        (grant,) = self.life.book.grants()
        return grant


async def test_a_grant_of_two_uses_runs_two_matching_commands_then_a_card() -> None:
    rig = Rig()
    grant = await rig.granted(uses=2)
    assert grant.uses_left == 2  # the card's own command is not a use
    first = rig.send(b"systemctl restart b")
    await rig.no_card(first)
    await rig.no_card(rig.send(b"systemctl restart c"))
    assert rig.life.book.grants() == []  # used up: gone from `sessions`
    third = rig.send(b"systemctl restart d")
    card = await rig.card()
    assert card.kind is CardKind.COMMAND
    rig.life.authority.answer(card.id, False)
    assert isinstance(await third, Failure)
    # the journal: made once, each use with its id on the request's records, then its end
    (made,) = rig.journal.of(EventType.GRANT_MADE)
    assert made.meta["grant"] == grant.id and made.event["pattern"] == "systemctl restart *"
    used = rig.journal.of(EventType.GRANT_USED)
    assert [u.meta["grant"] for u in used] == [grant.id, grant.id]
    assert [u.meta["uses_left"] for u in used] == [1, 0]
    intents = [r for r in rig.journal.of(EventType.DISPATCH_STARTED) if "grant" in r.meta]
    assert {r.meta["request_id"] for r in intents} == {u.meta["request_id"] for u in used}
    (ended,) = rig.journal.of(EventType.GRANT_ENDED)
    assert ended.meta == {"grant": grant.id, "reason": "used_up"}
    rows = activity((r, r.event) for r in rig.journal.records)
    assert sorted(r["command"] for r in rows if r["grant"] == grant.id) == [
        "systemctl restart b",
        "systemctl restart c",
    ]
    shown = sorted((r["grant_pattern"], r["grant_uses_left"]) for r in rows if r["grant"])
    assert shown == [("systemctl restart *", 0), ("systemctl restart *", 1)]


async def test_without_a_grant_each_matching_command_raises_a_card() -> None:
    """The negative control: the same commands, answered yes without a grant."""
    rig = Rig()
    await rig.life.authority.unlock(PASSPHRASE)
    task = rig.send(b"systemctl restart a")
    rig.life.authority.answer((await rig.card()).id, True)
    rig.life.authority.answer((await rig.card()).id, True)
    await task
    for command in (b"systemctl restart b", b"systemctl restart c"):
        waiting = rig.send(command)
        card = await rig.card()
        assert card.kind is CardKind.COMMAND
        rig.life.authority.answer(card.id, True)
        assert isinstance(await waiting, Result)


async def test_two_concurrent_requests_and_one_use_left_exactly_one_runs_without_a_card() -> None:
    rig = Rig()
    await rig.granted(uses=1)
    rig.outbound.auto = False  # both requests decide before either exec leaves
    a, b = rig.send(b"systemctl restart b"), rig.send(b"systemctl restart c")
    await idle()
    cards = rig.life.book.pending()
    assert len(cards) == 1 and len(rig.outbound.waiting()) == 1
    assert len(rig.journal.of(EventType.GRANT_USED)) == 1
    rig.life.authority.answer(cards[0].id, False)
    (call,) = rig.outbound.waiting()
    call.connect()
    await idle()
    call.finish(Result(Outcome.COMPLETED, exit_status=0))
    results = await asyncio.gather(a, b)
    assert sorted(type(r).__name__ for r in results) == ["Failure", "Result"]
    assert len(rig.outbound.sent) == 2  # the card's own command, and the one use


@pytest.mark.parametrize(
    "command", [b"systemctl restart x; id", b"systemctl stop x", b"systemctl restart x y"]
)
async def test_shell_source_and_other_argv_raise_cards(command: bytes) -> None:
    rig = Rig()
    await rig.granted(uses=5)
    task = rig.send(command)
    card = await rig.card()
    assert card.kind is CardKind.COMMAND
    rig.life.authority.answer(card.id, False)
    assert isinstance(await task, Failure)
    assert rig.life.book.grants()[0].uses_left == 5


async def test_an_option_where_the_star_stands_raises_a_card_and_takes_no_use() -> None:
    """The request path: `systemctl restart *` does not cover `systemctl restart --force`
    (nor `--`): each raises a command card; a plain word there is covered (the control)."""
    rig = Rig()
    await rig.granted(uses=5)
    for command in (b"systemctl restart --force", b"systemctl restart --", b"systemctl restart -"):
        task = rig.send(command)
        card = await rig.card()
        assert card.kind is CardKind.COMMAND and card.argv[2].startswith("-")
        rig.life.authority.answer(card.id, False)
        assert isinstance(await task, Failure)
    assert rig.life.book.grants()[0].uses_left == 5
    await rig.no_card(rig.send(b"systemctl restart force"))
    assert rig.life.book.grants()[0].uses_left == 4


async def test_the_account_rules_come_first_a_grant_never_widens_them() -> None:
    rig = Rig()
    await rig.granted("systemctl * *", uses=5)
    result = await rig.send(b"systemctl halt now")
    assert isinstance(result, Failure) and result.code is Code.POLICY_DENIED


async def test_a_command_with_stdin_bytes_is_not_covered() -> None:
    rig = Rig()
    await rig.granted(uses=5)
    rig.stdin = b"input"
    task = rig.send(b"systemctl restart b")
    card = await rig.card()
    assert card.stdin is not None and card.stdin.size == 5
    rig.life.authority.answer(card.id, False)
    await task
    rig.stdin = b""  # the control: empty stdin is covered
    await rig.no_card(rig.send(b"systemctl restart b"))


@pytest.mark.parametrize("ending", ["lock", "revoke", "exec", "exit", "policy", "minutes"])
async def test_a_grant_ends_with_its_session_and_with_its_minutes(ending: str) -> None:
    rig = Rig()
    grant = await rig.granted(uses=5, minutes=10)
    await rig.no_card(rig.send(b"systemctl restart b"))  # live: the control
    conn = rig.conn
    if ending == "lock":
        await rig.life.authority.lock(terminate=False)
        await rig.life.authority.unlock(PASSPHRASE)
    elif ending == "revoke":
        assert rig.life.authority.revoke(grant.session_id)
    elif ending == "exec":  # the same process, another program: not what was approved
        rig.agent.exe = "/usr/bin/other"
        conn = rig.life.connect(rig.agent, user="gr")
    elif ending == "exit":
        rig.life.authority.subject_exited(conn.peer.subject)
    elif ending == "policy":
        rig.policy.value = build_policy(
            [("p.toml", "p.toml", text("true").replace('"* halt*"', '"* halt*", "x"'))]
        )
    else:
        rig.clock.now += 600
    task = rig.send(b"systemctl restart c", conn)
    card = await rig.card()  # a session card or a command card: never no card
    rig.life.authority.answer(card.id, False)
    await task
    assert rig.life.book.grants() == []
    reasons = [r.meta["reason"] for r in rig.journal.of(EventType.GRANT_ENDED)]
    expected = {
        "lock": "vault_state_changed",
        "revoke": "revoked",
        "exec": "process_changed",
        "exit": "process_changed",
        "policy": "policy_changed",
        "minutes": "expired",
    }[ending]
    assert reasons == [expected]


async def test_a_grant_is_refused_where_it_cannot_be_made_and_the_card_stays_open() -> None:
    rig = Rig(grants=False)
    await rig.life.authority.unlock(PASSPHRASE)
    task = rig.send(b"systemctl restart a")
    rig.life.authority.answer((await rig.card()).id, True)
    card = await rig.card()
    assert not card.grantable
    with pytest.raises(GrantError, match="does not allow grants"):
        rig.life.authority.answer(card.id, True, GrantAsk("systemctl restart *", 2, None))
    assert rig.life.book.pending() == [card]  # unanswered: no half-made answer
    rig.life.authority.answer(card.id, True)
    await task
    assert rig.life.book.grants() == [] and rig.journal.of(EventType.GRANT_MADE) == []


@pytest.mark.parametrize(
    "command,ask,fragment",
    [
        (b"systemctl restart a", GrantAsk("systemctl restart *", 2, None), "with a no"),
        (b"systemctl restart a", GrantAsk("systemctl restart *", None, None), "needs a bound"),
        (b"systemctl restart a", GrantAsk("* restart a", 2, None), "first word"),
        (b"systemctl restart a; id", GrantAsk("systemctl restart *", 2, None), "cannot be"),
    ],
)
async def test_a_bad_grant_refuses_the_whole_answer(
    command: bytes, ask: GrantAsk, fragment: str
) -> None:
    rig = Rig()
    await rig.life.authority.unlock(PASSPHRASE)
    task = rig.send(command)
    rig.life.authority.answer((await rig.card()).id, True)
    card = await rig.card()
    approve = "with a no" not in fragment
    with pytest.raises(GrantError, match=fragment):
        rig.life.authority.answer(card.id, approve, ask)
    assert rig.life.book.pending() == [card]
    rig.life.authority.answer(card.id, False)
    await task


async def test_a_session_card_cannot_carry_a_grant() -> None:
    rig = Rig()
    await rig.life.authority.unlock(PASSPHRASE)
    task = rig.send(b"systemctl restart a")
    card = await rig.card()
    assert card.kind is CardKind.SESSION
    with pytest.raises(GrantError, match="not one"):
        rig.life.authority.answer(card.id, True, GrantAsk("systemctl restart *", 2, None))
    rig.life.authority.answer(card.id, False)
    await task
    with pytest.raises(CardError):
        rig.life.authority.answer(card.id, True)


async def test_a_grants_pattern_is_command_text_collectors_get_only_when_asked() -> None:
    rig = Rig()
    await rig.granted(uses=2)
    (made,) = rig.journal.of(EventType.GRANT_MADE)
    shown = export_event(made, made.event, with_commands=True)
    assert shown["pattern"] == "systemctl restart *" and shown["grant"] == made.meta["grant"]
    quiet = export_event(made, made.event)
    assert quiet["pattern"] is None and quiet["pattern_words"] is None
    assert quiet["grant"] == made.meta["grant"] and quiet["uses"] == 2


@pytest.mark.parametrize(
    "value,ok",
    [
        (None, True),
        ({"pattern": "systemctl restart *", "uses": 2, "minutes": None}, True),
        ({"pattern": "systemctl restart *", "minutes": 10}, True),
        ("systemctl restart *", False),
        ({"pattern": "systemctl restart *", "uses": "2"}, False),
        ({"pattern": "systemctl restart *", "uses": True}, False),
        ({"pattern": 7, "uses": 2}, False),
        ({"pattern": "systemctl restart *", "uses": 2, "words": 3}, False),
    ],
)
def test_the_answer_requests_grant_argument_is_checked_for_its_shape(value: Any, ok: bool) -> None:
    args = {"card": "cc_1", "approve": True} | ({"grant": value} if value is not None else {})
    if ok:
        ask = grant_arg(args)
        assert (ask is None) == (value is None)
    else:
        with pytest.raises(OperatorError):
            grant_arg(args)
