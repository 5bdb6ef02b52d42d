"""The agent socket's `request` answers come from memory (issue 18): the index says
what `bastion request` would read from the journal, at every point of every
story, costs a lookup per question, and forgets the oldest requests first."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from bastion.core.events import EventType, request_state
from bastion.gateway.requests import IndexedJournal, RequestIndex
from tests.unit.fakes import Rec

E = EventType

STORIES: dict[str, list[tuple[EventType, dict[str, Any]]]] = {
    "denied": [(E.REQUEST_RECEIVED, {}), (E.DENIED, {"code": "POLICY_DENIED"})],
    "busy": [(E.REQUEST_RECEIVED, {}), (E.DENIED, {"code": "GATEWAY_BUSY"})],
    "completed": [
        (E.REQUEST_RECEIVED, {}),
        (E.CARD_RAISED, {}),
        (E.DISPATCH_STARTED, {"session_id": "s1"}),
        (E.COMPLETED, {"exit_status": 3}),
    ],
    "signalled": [
        (E.REQUEST_RECEIVED, {}),
        (E.DISPATCH_STARTED, {}),
        (E.SIGNALLED, {"signal": "TERM"}),
    ],
    "certified": [
        (E.REQUEST_RECEIVED, {}),
        (E.CERTIFICATE_ISSUED, {"serial": 7, "key_id": "req_x", "ca": "SHA256:c"}),
        (E.DISPATCH_STARTED, {}),
        (E.UNKNOWN, {"code": "STATUS_UNKNOWN", "cause": "connection_lost"}),
    ],
    "unreachable": [
        (E.REQUEST_RECEIVED, {}),
        (E.NOT_STARTED, {"code": "UNREACHABLE", "cause": "UNREACHABLE"}),
    ],
}


def records(boot: str = "b1") -> list[Rec]:
    """Every story at once, their records interleaved as concurrent requests write them."""
    seq = itertools.count(1)
    steps = [[(f"req_{name}", k, m) for k, m in kinds] for name, kinds in STORIES.items()]
    out = []
    for round_ in itertools.zip_longest(*steps):
        for step in round_:
            if step is not None:
                rid, kind, meta = step
                out.append(Rec(next(seq), boot, kind.value, {"request_id": rid, **meta}, {}))
    return out


@pytest.mark.parametrize("live", ["b1", "b2"])
def test_the_index_answers_what_the_journal_says_at_every_point(live: str) -> None:
    recs = records()
    index = RequestIndex()
    for n, rec in enumerate(recs, 1):
        index.read(rec)
        for name in STORIES:
            rid = f"req_{name}"
            assert index.state(rid, live) == request_state(recs[:n], rid, live), (name, n)


def test_an_index_built_at_start_goes_on_with_what_is_written() -> None:
    recs = records()
    loaded = RequestIndex()
    loaded.load(recs[:7])
    for rec in recs[7:]:
        loaded.read(rec)
    for name in STORIES:
        rid = f"req_{name}"
        assert loaded.state(rid, "b2") == request_state(recs, rid, "b2")


def test_the_oldest_requests_are_forgotten_first() -> None:
    index = RequestIndex(remembered=3)
    for i in range(5):
        index.read(Rec(i, "b1", E.REQUEST_RECEIVED.value, {"request_id": f"req_{i}"}, {}))
    assert len(index) == 3
    assert index.state("req_1", "b1") is None and index.state("req_2", "b1") is not None
    index.read(Rec(9, "b1", E.COMPLETED.value, {"request_id": "req_0", "exit_status": 0}, {}))
    assert index.state("req_0", "b1") is None  # an outcome of a forgotten request adds nothing


def test_an_action_names_its_latest_request_and_actions_are_bounded() -> None:
    index = RequestIndex(actions=2)
    index.received("a1", "req_1")
    index.received("a1", "req_2")
    index.received(None, "req_3")
    assert index.latest("a1") == "req_2"
    index.received("a2", "req_4")
    index.received("a3", "req_5")
    assert index.latest("a1") is None and index.latest("a3") == "req_5"
    loaded = RequestIndex()
    received = {"request_id": "req_7", "action": "a9"}
    loaded.load([Rec(1, "b0", E.REQUEST_RECEIVED.value, received, {})])
    assert loaded.latest("a9") == "req_7"  # across a restart


class Writer:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.synced = 0

    def append(
        self, kind: EventType, meta: dict[str, Any], event: dict[str, Any], sync: bool = True
    ) -> Rec:
        if self.fail:
            raise OSError("disk full")
        return Rec(1, "b1", kind.value, meta, event)

    def sync(self) -> int:
        self.synced += 1
        return 1


def test_the_index_hears_of_a_record_as_it_is_written_and_only_then() -> None:
    index = RequestIndex()
    journal = IndexedJournal(Writer(), index)
    journal.append(E.REQUEST_RECEIVED, {"request_id": "req_1"}, {}, sync=False)
    assert index.state("req_1", "b1") == {
        "request_id": "req_1",
        "state": "in_flight",
        "exit_status": None,
        "code": None,
    }
    broken = IndexedJournal(Writer(fail=True), index)
    with pytest.raises(OSError):
        broken.append(E.DENIED, {"request_id": "req_1", "code": "POLICY_DENIED"}, {})
    assert index.state("req_1", "b1")["state"] == "in_flight"  # type: ignore[index]
    assert journal.sync() == 1
