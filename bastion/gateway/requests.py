"""The agent socket's `request` answers, from memory: the state of the most
recent requests, folded record by record as the gateway writes them.

`bastion request` (the CLI) reads the whole journal. The agent socket must not:
an agent asking in a loop made the gateway re-read every record for every
question (0.8 s each at 100,000 records), in the worker threads every identity
walk needed. So the index is built at start from the records `Journal.open()`
returns (read anyway, for recovery) and kept up to date by `IndexedJournal`,
the journal as the recorder writes to it, which tells the index of each record
the moment it is written -- as the file the CLI reads has it. Not
`Recorder.sinks`: they hear of a record once it is durable, up to a group
commit (and a slow disk's fsync) later, while the agent's ssh hears the
outcome at once; a `request_status` asked right after would read `in_flight`
for a command the agent saw end. It holds the most recent
`REQUESTS_REMEMBERED` requests, by when they were received; an older (or
unknown) id is answered "no request ... among the last N", and the operator's
`bastion request ID` reads the journal for it. Every answer is a dict lookup;
the fold is `events.RequestStory`, the same one the CLI runs.

It also keeps each action key's latest request (action keys are bound to their
subject: `events.bound_action`), told by `Recorder.on_received` the moment a
request is received -- a name for the request, nothing of how it ended -- so
`bastion mcp` can name the request it just ran.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import Any

from bastion.core.defaults import REQUESTS_REMEMBERED
from bastion.core.events import Entry, EventType, RequestStory, event_type
from bastion.gateway.recorder import JournalWriter

ACTIONS_REMEMBERED = 4096  # action -> latest request id, for `bastion mcp`


class RequestIndex:
    def __init__(
        self, remembered: int = REQUESTS_REMEMBERED, actions: int = ACTIONS_REMEMBERED
    ) -> None:
        self.remembered = remembered
        self._actions_remembered = actions
        self._stories: collections.OrderedDict[str, RequestStory] = collections.OrderedDict()
        self._actions: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._boots: dict[str, str] = {}  # one string per lifetime, shared by its stories

    def __len__(self) -> int:
        return len(self._stories)

    def load(self, entries: Iterable[Entry]) -> None:
        """The journal as it was at start (what earlier lifetimes wrote)."""
        for entry in entries:
            self.read(entry)
            if event_type(entry) is EventType.REQUEST_RECEIVED:
                rid, action = entry.meta.get("request_id"), entry.meta.get("action")
                if isinstance(rid, str) and isinstance(action, str):
                    self.received(action, rid)

    def read(self, entry: Entry) -> None:
        rid = entry.meta.get("request_id")
        if not isinstance(rid, str):
            return
        if event_type(entry) is EventType.REQUEST_RECEIVED:
            boot = self._boots.setdefault(entry.boot, entry.boot)
            self._stories[rid] = RequestStory(boot)
            self._stories.move_to_end(rid)
            while len(self._stories) > self.remembered:
                self._stories.popitem(last=False)
        elif (story := self._stories.get(rid)) is not None:
            self._stories[rid] = story.step(entry)

    def received(self, action: str | None, request_id: str) -> None:
        """`Recorder.on_received`: the latest request of an action."""
        if not action:
            return
        self._actions[action] = request_id
        self._actions.move_to_end(action)
        while len(self._actions) > self._actions_remembered:
            self._actions.popitem(last=False)

    def latest(self, action: str) -> str | None:
        return self._actions.get(action)

    def state(self, request_id: str, live_boot: str) -> dict[str, Any] | None:
        """`bastion request --json`'s object, or None for a request not remembered."""
        story = self._stories.get(request_id)
        return None if story is None else story.answer(request_id, live_boot)


class IndexedJournal:
    """The journal as the recorder writes to it (`recorder.JournalWriter`): each
    record written is read by the index too. A record that could not be written
    raises before the index hears of it."""

    def __init__(self, journal: JournalWriter, index: RequestIndex) -> None:
        self._journal = journal
        self._index = index

    def append(
        self, kind: EventType, meta: dict[str, Any], event: dict[str, Any], sync: bool = True
    ) -> Any:
        record = self._journal.append(kind, meta, event, sync=sync)
        self._index.read(record)
        return record

    def sync(self) -> int:
        return self._journal.sync()
