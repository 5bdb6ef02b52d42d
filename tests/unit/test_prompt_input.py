"""What a read of the operator's keyboard means (`cli/promptkeys.decide`): an answer is a key
then Enter for the card still shown; nothing typed ahead, pasted or rushed answers a card."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bastion.cli.promptkeys import (
    CONFIRMING,
    GUARD,
    NOTES,
    PASTE_END,
    PASTE_START,
    Act,
    Decision,
    GrantDraft,
    Mode,
    decide,
    one_key,
)
from bastion.core.command import is_option
from bastion.core.grants import parse_grant

LATER = GUARD + 1.0  # long after the card changed


def test_an_answer_is_a_key_then_enter() -> None:
    asked = decide(Mode.IDLE, "y", LATER, card_shown=True)
    assert asked.mode is Mode.CONFIRM_APPROVE and asked.acts == (Act.ASK_APPROVE,)
    for enter in ("\n", "\r"):
        assert decide(asked.mode, enter, LATER, True).acts == (Act.APPROVE,)
    asked = decide(Mode.IDLE, "n", LATER, card_shown=True)
    assert asked.mode is Mode.CONFIRM_DENY and asked.acts == (Act.ASK_DENY,)
    assert decide(asked.mode, "\n", LATER, True) == decide(Mode.CONFIRM_DENY, "\r", LATER, True)
    assert decide(asked.mode, "\n", LATER, True).acts == (Act.DENY,)


@pytest.mark.parametrize("key", ["\x1b", "y", "n", "x", "q", "d", " ", "\x1b[A", "Y"])
@pytest.mark.parametrize("mode", sorted(CONFIRMING, key=lambda m: m.value))
def test_anything_but_enter_cancels_and_does_nothing_else(mode: Mode, key: str) -> None:
    assert decide(mode, key, LATER, True) == Decision(Mode.IDLE, (Act.CANCEL,))


def test_lock_is_capital_l_alone_and_needs_no_confirmation() -> None:
    assert decide(Mode.IDLE, "L", LATER, True).acts == (Act.LOCK,)
    assert decide(Mode.IDLE, "L", LATER, False).acts == (Act.LOCK,)
    assert decide(Mode.CONFIRM_APPROVE, "L", LATER, True).acts == (Act.CANCEL, Act.LOCK)
    # Locking only takes authority away: a stream of new cards cannot keep it from the
    # operator, so the guard does not hold it back.
    assert decide(Mode.IDLE, "L", 0.0, True).acts == (Act.LOCK,)
    assert decide(Mode.IDLE, "l", LATER, True).acts == (Act.HINT_LOCK,)
    assert Act.HINT_LOCK in NOTES and "L locks" in NOTES[Act.HINT_LOCK]
    assert Act.LOCK not in decide(Mode.IDLE, "clear", LATER, True).acts


def test_keys_are_case_sensitive() -> None:
    for key in ("Y", "N", "D", "Q"):
        assert decide(Mode.IDLE, key, LATER, True) == decide(Mode.IDLE, "x", LATER, True)
        assert decide(Mode.IDLE, key, LATER, True).acts == ()


def test_input_within_the_guard_answers_nothing_and_says_so() -> None:
    for key in ("y", "n", "d", "q", "\n"):
        assert decide(Mode.IDLE, key, GUARD - 0.01, True).acts == (Act.IGNORED_GUARD,)
        assert decide(Mode.IDLE, key, 0.0, True).mode is Mode.IDLE
    assert GUARD >= 0.3 and Act.IGNORED_GUARD in NOTES
    assert decide(Mode.CONFIRM_APPROVE, "\n", 0.1, True).acts == (Act.CANCEL, Act.IGNORED_GUARD)
    assert decide(Mode.IDLE, "y", GUARD, True).acts == (Act.ASK_APPROVE,)  # positive control


def test_several_keys_in_one_read_answer_nothing() -> None:
    for burst in ("y\n", "yes\n", "yy", "n\r", "qq", "xq", "dy"):
        d = decide(Mode.IDLE, burst, LATER, True)
        assert d == decide(Mode.IDLE, "??", LATER, True)
        assert d.acts == (Act.IGNORED_BURST,) and d.mode is Mode.IDLE
    assert decide(Mode.CONFIRM_APPROVE, "\n\n", LATER, True).acts == (
        Act.CANCEL,
        Act.IGNORED_BURST,
    )


def test_one_key_may_be_several_bytes() -> None:
    assert one_key("\x1b") == "\x1b" and one_key("\x1b[A") == "\x1b[A"
    assert one_key("\x1bOP") == "\x1bOP" and one_key("é") == "é"
    assert one_key("\x1b[Ay") is None and one_key("") is None and one_key("ab") is None


def test_a_bracketed_paste_is_discarded_whole_even_across_reads() -> None:
    whole = decide(Mode.IDLE, PASTE_START + "yes\n" + PASTE_END, LATER, True)
    assert whole == decide(Mode.IDLE, PASTE_START + "y" + PASTE_END, LATER, True)
    assert whole.mode is Mode.IDLE and whole.acts == (Act.IGNORED_PASTE,)
    begun = decide(Mode.CONFIRM_APPROVE, PASTE_START + "y", LATER, True)
    assert begun.mode is Mode.PASTE and begun.acts == (Act.CANCEL, Act.IGNORED_PASTE)
    for inside in ("y", "\n", "L", "q", "more text"):  # nothing inside a paste is a key
        d = decide(Mode.PASTE, inside, LATER, True)
        assert d.mode is Mode.PASTE and d.acts == () and inside.endswith(d.carry)
    ended = decide(Mode.PASTE, "\n" + PASTE_END, LATER, True)
    assert ended.mode is Mode.IDLE and ended.acts == ()
    again = decide(Mode.IDLE, PASTE_END + "x" + PASTE_START, LATER, True)
    assert again.mode is Mode.PASTE
    assert decide(ended.mode, "y", LATER, True).acts == (Act.ASK_APPROVE,)  # positive control


def test_a_paste_end_split_across_reads_still_ends_it() -> None:
    begun = decide(Mode.IDLE, PASTE_START + "yes" + PASTE_END[:3], LATER, True)
    assert begun.mode is Mode.PASTE and PASTE_END[:3] in begun.carry
    ended = decide(begun.mode, begun.carry + PASTE_END[3:], LATER, True)
    assert ended.mode is Mode.IDLE and ended.carry == ""
    assert decide(ended.mode, "y", LATER, True).acts == (Act.ASK_APPROVE,)


def test_without_a_card_only_lock_and_quit_mean_something() -> None:
    for key in ("y", "n", "d"):
        assert decide(Mode.IDLE, key, LATER, False).acts == ()
    assert decide(Mode.IDLE, "q", LATER, False).acts == (Act.QUIT,)


@given(
    st.sampled_from(list(Mode)),
    st.text(alphabet="yYnNdlLq\r\n\x1b[]~0123 xe", max_size=12),
    st.floats(min_value=0, max_value=5),
    st.booleans(),
)
def test_only_enter_after_a_begun_answer_answers(
    mode: Mode, chunk: str, since: float, card: bool
) -> None:
    """Over every mode and read: an answer is given only by a lone Enter, after the guard,
    to an answer begun, outside a paste; each read leaves the prompt in one known mode."""
    d = decide(mode, chunk, since, card)
    answered = {Act.APPROVE, Act.DENY, Act.APPROVE_GRANT} & set(d.acts)
    if answered:
        assert chunk in ("\r", "\n") and since >= GUARD and mode in CONFIRMING
        want = {
            Mode.CONFIRM_APPROVE: Act.APPROVE,
            Mode.CONFIRM_DENY: Act.DENY,
            Mode.CONFIRM_GRANT: Act.APPROVE_GRANT,
        }
        assert d.acts == (want[mode],)
    if Act.QUIT in d.acts:
        assert chunk == "q" and mode is Mode.IDLE
    if Act.LOCK in d.acts:
        assert chunk == "L"
    begun = {
        (Act.ASK_APPROVE,): Mode.CONFIRM_APPROVE,
        (Act.ASK_DENY,): Mode.CONFIRM_DENY,
        (Act.ASK_GRANT,): Mode.GRANT_WORDS,
        (Act.GRANT_WORD,): Mode.GRANT_WORDS,
        (Act.ASK_BOUND,): Mode.GRANT_BOUND,
        (Act.GRANT_BOUND,): Mode.CONFIRM_GRANT,
    }
    assert d.mode in (Mode.IDLE, Mode.PASTE) or begun.get(d.acts) is d.mode
    if d.mode in (Mode.GRANT_WORDS, Mode.GRANT_BOUND, Mode.CONFIRM_GRANT):
        assert since >= GUARD and one_key(chunk) == chunk  # one deliberate key a step


def test_a_grant_is_chosen_one_key_a_step_and_confirmed_with_enter() -> None:
    """g, a digit per word, Enter, a digit for the bound, Enter: each step one key after
    the guard; any other key drops the whole grant, and a burst is never a step."""
    late = GUARD + 1
    d = decide(Mode.IDLE, "g", late, True)
    assert (d.mode, d.acts) == (Mode.GRANT_WORDS, (Act.ASK_GRANT,))
    d = decide(Mode.GRANT_WORDS, "2", late, True)
    assert (d.mode, d.acts, d.key) == (Mode.GRANT_WORDS, (Act.GRANT_WORD,), "2")
    assert decide(Mode.GRANT_WORDS, "0", late, True).acts == (Act.CANCEL,)  # the program
    d = decide(Mode.GRANT_WORDS, "\r", late, True)
    assert (d.mode, d.acts) == (Mode.GRANT_BOUND, (Act.ASK_BOUND,))
    d = decide(Mode.GRANT_BOUND, "2", late, True)
    assert (d.mode, d.acts, d.key) == (Mode.CONFIRM_GRANT, (Act.GRANT_BOUND,), "2")
    assert decide(Mode.CONFIRM_GRANT, "\r", late, True).acts == (Act.APPROVE_GRANT,)
    for mode in (Mode.GRANT_WORDS, Mode.GRANT_BOUND, Mode.CONFIRM_GRANT):
        assert decide(mode, "x", late, True).acts == (Act.CANCEL,)
        assert decide(mode, "2\r", late, True).acts == (Act.CANCEL, Act.IGNORED_BURST)
        assert decide(mode, "\r", 0.1, True).acts == (Act.CANCEL, Act.IGNORED_GUARD)
    assert decide(Mode.GRANT_BOUND, "9", late, True).acts == (Act.CANCEL,)  # no such bound
    assert decide(Mode.IDLE, "g", late, False).acts == ()  # no card: nothing to widen


def test_a_digit_on_one_of_the_cards_options_widens_nothing_and_says_why() -> None:
    """A `*` never matches an option (`core/grants`), so the prompt never drafts one there:
    the digit leaves the draft as it was, with the reason to show, as for a missing word."""
    draft = GrantDraft(("make", "-C", "/srv/app", "x"))
    assert draft.toggled("1") is None
    why = draft.why_not("1")
    assert why is not None and why.startswith("word 1 cannot be *: -C is an option")
    assert "a * never matches a word that begins with -" in why
    assert draft.why_not("9") == "no word 9 to widen" and draft.toggled("9") is None
    widened = draft.toggled("3")
    assert widened is not None and draft.why_not("3") is None
    assert widened.pattern() == "make -C /srv/app *"
    assert widened.toggled("3") == draft  # again: back


@given(
    st.lists(
        st.sampled_from(["-C", "--", "-", "--eval=x", "dir", "a b", "*", "x-y"]),
        min_size=1,
        max_size=9,
    ),
    st.lists(st.sampled_from("123456789"), max_size=12),
)
def test_any_digits_draft_a_pattern_the_gateway_accepts_for_the_cards_own_command(
    words: list[str], keys: list[str]
) -> None:
    argv = ("make", *words)
    draft = GrantDraft(argv)
    for key in keys:
        draft = draft.toggled(key) or draft
    assert not any(is_option(argv[i]) for i in draft.wild)
    assert parse_grant(argv, draft.pattern()).matches(argv)
