"""The journal's vocabulary and its folds: recovery, one request's state, the views.

Recovery is tested over every story a request can have and every point a
crash can cut it at: whatever the cut, the next lifetime closes the request
exactly once, with the outcome that is honest for that point.
"""

from __future__ import annotations

import itertools

import pytest

from bastion.core.events import (
    TERMINAL,
    EventType,
    Outcome,
    RequestState,
    activity,
    bound_action,
    recover,
    recovered_meta,
    request_state,
    sessions,
)
from bastion.gateway.actions import ActionKeys
from tests.unit.fakes import Rec

E = EventType

# Every way one request's journal story can run to its end.
STORIES: dict[str, list[EventType]] = {
    "denied at once": [E.REQUEST_RECEIVED, E.DENIED],
    "denied after a card": [E.REQUEST_RECEIVED, E.CARD_RAISED, E.CARD_CLOSED, E.DENIED],
    "target unreachable": [E.REQUEST_RECEIVED, E.NOT_STARTED],
    "refused at the final check": [
        E.REQUEST_RECEIVED,
        E.CARD_RAISED,
        E.SESSION_APPROVED,
        E.CARD_CLOSED,
        E.DENIED,
    ],
    **{
        f"dispatched, {o.value}": [
            E.REQUEST_RECEIVED,
            E.CARD_RAISED,
            E.SESSION_APPROVED,
            E.CARD_CLOSED,
            E.DISPATCH_STARTED,
            E.of(o),
        ]
        for o in Outcome
    },
}


def story(kinds: list[EventType], rid: str = "req_1", boot: str = "b1", **meta: str) -> list[Rec]:
    return [Rec(i + 1, boot, k.value, {"request_id": rid, **meta}, {}) for i, k in enumerate(kinds)]


def closing(rid: str, kind: EventType, seq: int) -> Rec:
    assert kind.outcome is not None
    return Rec(seq, "b2", kind.value, recovered_meta(rid, kind.outcome), {})


CUTS = [(name, k) for name, kinds in STORIES.items() for k in range(1, len(kinds) + 1)]


@pytest.mark.parametrize("name,cut", CUTS, ids=[f"{n}@{k}" for n, k in CUTS])
def test_recovery_closes_every_cut_story_exactly_once(name: str, cut: int) -> None:
    kinds = STORIES[name][:cut]
    found = recover(story(kinds))
    if kinds[-1] in TERMINAL:
        assert (found.unknown, found.not_started) == ((), ())
        return
    if E.DISPATCH_STARTED in kinds:  # the intent was durable: it may have run
        assert (found.unknown, found.not_started) == (("req_1",), ())
        close = closing("req_1", E.UNKNOWN, cut + 1)
        expected = RequestState.STATUS_UNKNOWN
    else:  # no intent on disk: the exec request never left
        assert (found.unknown, found.not_started) == ((), ("req_1",))
        close = closing("req_1", E.NOT_STARTED, cut + 1)
        expected = RequestState.RETRY_SAFE
    # What `bastion request` says with no gateway, before and after the next lifetime.
    before = request_state(story(kinds), "req_1", live_boot=None)
    assert before is not None and before["state"] == expected.value
    after = request_state([*story(kinds), close], "req_1", live_boot="b2")
    assert after is not None and after["state"] == expected.value
    assert after["cause"] == "gateway_restarted"
    # A second restart finds nothing left to close.
    again = recover([*story(kinds), close])
    assert (again.unknown, again.not_started) == ((), ())


def test_a_live_request_is_in_flight_only_while_its_gateway_lives() -> None:
    recs = story([E.REQUEST_RECEIVED, E.DISPATCH_STARTED])
    assert request_state(recs, "req_1", "b1")["state"] == "in_flight"  # type: ignore[index]
    gone = request_state(recs, "req_1", "b9")
    assert gone is not None and (gone["state"], gone["cause"]) == (
        "status_unknown",
        "gateway_stopped",
    )
    assert request_state(recs, "req_other", "b1") is None


@pytest.mark.parametrize("outcome", list(Outcome))
def test_request_state_of_each_outcome(outcome: Outcome) -> None:
    meta = {"exit_status": 3} if outcome is Outcome.COMPLETED else {"code": "UNREACHABLE"}
    recs = [
        *story([E.REQUEST_RECEIVED, E.DISPATCH_STARTED]),
        Rec(3, "b1", outcome.value, {"request_id": "req_1", **meta}, {}),
    ]
    state = request_state(recs, "req_1", "b1")
    assert state is not None
    expected = {
        Outcome.COMPLETED: "completed",
        Outcome.SIGNALLED: "completed",
        Outcome.REMOTE_REJECTED: "retry_safe",
        Outcome.NOT_STARTED: "retry_safe",
        Outcome.UNKNOWN: "status_unknown",
    }[outcome]
    assert state["state"] == expected
    if outcome is Outcome.COMPLETED:
        assert state["exit_status"] == 3


def test_action_keys_follow_the_last_attempt() -> None:
    keys = ActionKeys()
    keys.outcome("a", "req_1", Outcome.UNKNOWN)
    assert keys.blocking("a") == "req_1" and keys.blocking("b") is None
    keys.outcome("a", "req_2", Outcome.COMPLETED)
    assert keys.blocking("a") is None
    keys.outcome("a", "req_3", Outcome.UNKNOWN)
    assert keys.acknowledge("a") and not keys.acknowledge("a")
    assert keys.blocking(None) is None


def test_an_action_key_is_bound_to_the_process_that_sent_it() -> None:
    """The same key from another process is another action (its acknowledgement or
    question touches nothing of the first's); from the same process -- the same
    kernel boot, pid and start tick, whichever gateway lifetime reads them -- it is
    the same one, so a block recovered after a restart still holds."""
    a, b = "boot-1:4242:88001", "boot-1:4243:88002"
    assert bound_action(a, "deploy-42") == bound_action(a, "deploy-42")
    assert bound_action(a, "deploy-42") != bound_action(b, "deploy-42")
    assert bound_action(a, "deploy-42") != bound_action(a, "deploy-43")
    assert bound_action("boot-2:4242:88001", "deploy-42") != bound_action(a, "deploy-42")
    # No owner and key pair can be spelled as another (the separator is not in either).
    assert bound_action("x:1", "2:y") != bound_action("x:1:2", "y")
    keys = ActionKeys()
    keys.outcome(bound_action(a, "deploy-42"), "req_1", Outcome.UNKNOWN)
    assert not keys.acknowledge(bound_action(b, "deploy-42"))
    assert keys.blocking(bound_action(a, "deploy-42")) == "req_1"


@pytest.mark.parametrize("outcome", list(Outcome))
def test_recovery_inherits_blocked_actions(outcome: Outcome) -> None:
    recs = story([E.REQUEST_RECEIVED, E.DISPATCH_STARTED, E.of(outcome)], action="act")
    blocked = outcome is Outcome.UNKNOWN
    assert recover(recs).actions == ({"act": "req_1"} if blocked else {})
    crashed = story([E.REQUEST_RECEIVED, E.DISPATCH_STARTED], action="act")
    assert recover(crashed).actions == {"act": "req_1"}  # closed as unknown: blocked
    acked = [*crashed, Rec(9, "b2", E.ACTION_ACKNOWLEDGED.value, {"action": "act"}, {})]
    # The acknowledgement came after the crash was closed by an earlier recovery.
    closed = [*crashed, closing("req_1", E.UNKNOWN, 3), *acked[2:]]
    assert recover(closed).actions == {}


def test_event_types_are_distinct_and_outcomes_are_events() -> None:
    values = [e.value for e in EventType]
    assert len(values) == len(set(values))
    for outcome, kind in itertools.product(Outcome, [None]):
        assert EventType.of(outcome).outcome is outcome, kind
    assert {k for k in EventType if k.outcome} | {E.DENIED} == set(TERMINAL)


def test_unknown_record_types_are_skipped_by_every_fold() -> None:
    recs = [
        *story([E.REQUEST_RECEIVED]),
        Rec(2, "b1", "from_the_future", {"request_id": "req_1"}, {}),
    ]
    assert recover(recs).not_started == ("req_1",)
    rows = activity((r, {}) for r in recs)
    assert [row["outcome"] for row in rows] == ["in_flight"]


def test_activity_and_sessions_views() -> None:
    recs = [
        Rec(1, "b1", E.BOOT.value, {}, {"t": 1.0}),
        Rec(2, "b1", E.REQUEST_RECEIVED.value, {"request_id": "r1"}, {"host": "web1", "t": 2.0}),
        Rec(3, "b1", E.SESSION_APPROVED.value, {"session_id": "s1"}, {"host": "web1", "t": 3.0}),
        Rec(4, "b1", E.DISPATCH_STARTED.value, {"request_id": "r1", "session_id": "s1"}, {}),
        Rec(5, "b1", E.COMPLETED.value, {"request_id": "r1", "exit_status": 0}, {}),
        Rec(6, "b1", E.REQUEST_RECEIVED.value, {"request_id": "r2"}, {}),
        Rec(7, "b1", E.DENIED.value, {"request_id": "r2", "code": "POLICY_DENIED"}, {}),
        Rec(8, "b1", E.SESSION_APPROVED.value, {"session_id": "s2"}, {"t": 8.0}),
        Rec(9, "b1", E.SESSION_ENDED.value, {"session_id": "s2", "reason": "revoked"}, {"t": 9.0}),
        Rec(10, "b2", E.BOOT.value, {}, {"t": 10.0}),
    ]
    rows = {r["request_id"]: r for r in activity((r, r.event) for r in recs)}
    assert (rows["r1"]["outcome"], rows["r1"]["session_id"], rows["r1"]["exit_status"]) == (
        "completed",
        "s1",
        0,
    )
    assert (rows["r2"]["outcome"], rows["r2"]["code"]) == ("denied", "POLICY_DENIED")
    ended = {r["session_id"]: r["end_reason"] for r in sessions((r, r.event) for r in recs)}
    assert ended == {"s1": "gateway_restarted", "s2": "revoked"}
