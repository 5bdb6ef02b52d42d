"""The operator socket's "export" stream: the journal, decrypted, for log collectors.

`bastion audit export` (cli/export.py) reads it; `lifetime.py` registers
`export_stream` as the stream "export". Every line the client gets:

* `{"event": "hello", "boot_id"}` first, once the request is accepted;
* `{"event": "record", "record": E}` for each journal record with seq >
  `since`, in seq order, E being `core.events.export_event` of the record
  (command text only with `with_commands`);
* without `follow`: `{"event": "end", "seq": LAST}` after the records on disk;
  with it, the records appended later, as the recorder reports them on disk
  (`Recorder.sinks`), and `{"event": "ping"}` after PING idle seconds;
* a refusal ends the stream: `{"ok": false, "error", "retryable"}`;
  `retryable` is true when the vault is locked (at the start, or a lock
  mid-stream): the client waits for an unlock and asks again, `since` the
  last seq it printed -- so a lock, a restart or a lost connection costs
  neither a gap nor a duplicate.

The journal identity's private key never leaves the gateway, and the stream
holds no key between batches: it asks the vault again for each batch (a
locked vault ends the stream) and keeps only the public BOOT records each
batch is decrypted from. The files are read in worker threads, so a long
journal does not stall the gateway's loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

from bastion import journal
from bastion.core.errors import BastionError
from bastion.core.events import EventType, export_event
from bastion.journal import IDENTITY_LABEL, Record
from bastion.vault import VaultError, VaultLocked

PING = 10.0  # seconds between keep-alive lines to an idle follower
CHUNK = 500  # records read and decrypted per worker-thread hop
MAX_QUEUED = 10_000  # records queued for a slow follower before it re-reads the files
LOCKED = (
    "the vault is locked, and exporting needs its journal identity: run `bastion unlock`, "
    "or export offline with --passphrase-stdin or --keyring"
)


class _Vault(Protocol):
    @property
    def locked(self) -> bool: ...

    def private_key(self, label: str) -> Any: ...


class _Recorder(Protocol):
    @property
    def sinks(self) -> list[Callable[[Any, dict[str, Any]], None]]: ...


class _Home(Protocol):
    @property
    def journal(self) -> Path: ...


class GatewayView(Protocol):
    """The part of the one `lifetime.Gateway` the export stream reads."""

    @property
    def boot_id(self) -> str: ...
    @property
    def vault(self) -> _Vault: ...
    @property
    def recorder(self) -> _Recorder: ...
    @property
    def home(self) -> _Home: ...


def arguments(args: dict[str, Any]) -> tuple[int, bool, bool]:
    """(since, follow, with_commands), checked; ValueError names a wrong one."""
    since = args.get("since", 0)
    if isinstance(since, bool) or not isinstance(since, int) or since < 0:
        raise ValueError('"since" must be a whole number >= 0')
    flags = []
    for name in ("follow", "with_commands"):
        value = args.get(name, False)
        if not isinstance(value, bool):
            raise ValueError(f'"{name}" must be true or false')
        flags.append(value)
    return since, flags[0], flags[1]


class StreamStopped(BastionError):
    """The stream cannot go on; `retryable` when asking again later may work."""

    def __init__(self, message: str, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable

    def line(self) -> dict[str, Any]:
        return {"ok": False, "error": str(self), "retryable": self.retryable}


def _identity(gw: GatewayView) -> Any:
    """The journal identity's private key, for one batch (never kept across one)."""
    if gw.vault.locked:
        raise StreamStopped(LOCKED, retryable=True)
    try:
        return gw.vault.private_key(IDENTITY_LABEL).pyca_key
    except VaultLocked:  # locked meanwhile
        raise StreamStopped(LOCKED, retryable=True) from None
    except VaultError as exc:
        raise StreamStopped(f"cannot read the journal identity: {exc}") from None


class Exporter:
    """Shapes records for one stream: remembers each boot's (public) BOOT record,
    so that any later batch can be decrypted on its own, and the last seq sent."""

    def __init__(self, since: int, with_commands: bool) -> None:
        self.last = since
        self.with_commands = with_commands
        self.boots: dict[str, Record] = {}

    def batch(self, records: list[Record], identity: Any) -> list[dict[str, Any]]:
        """The export events of `records` after the last one sent, in order
        (runs in a worker thread; `identity` is dropped when it returns)."""
        for r in records:
            if r.type == EventType.BOOT.value:
                self.boots.setdefault(r.boot, r)
        wanted: list[Record] = []
        for r in records:
            if r.seq > (wanted[-1].seq if wanted else self.last):
                wanted.append(r)
        if not wanted:
            return []
        chosen = {id(r) for r in wanted}
        announced = [
            self.boots[b]
            for b in dict.fromkeys(r.boot for r in wanted)
            if b in self.boots and id(self.boots[b]) not in chosen
        ]
        out = [
            export_event(r, event, self.with_commands)
            for r, event in journal.decrypt([*announced, *wanted], identity)
            if id(r) in chosen
        ]
        self.last = wanted[-1].seq
        return out


class Feed:
    """The records the recorder reports on disk, queued for one stream. The sink
    never blocks: past MAX_QUEUED it only notes the overflow, and the stream
    reads the files again instead."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: deque[Record] = deque()
        self._ready = asyncio.Event()
        self.overflowed = False

    def sink(self, record: Any, event: dict[str, Any]) -> None:
        if not isinstance(record, Record):
            return
        if len(self._queue) >= MAX_QUEUED:
            self.overflowed = True
        else:
            self._queue.append(record)
        self._loop.call_soon_threadsafe(self._ready.set)

    async def wait(self, timeout: float) -> bool:
        """True when something was queued within `timeout` seconds."""
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
        except TimeoutError:
            return False
        self._ready.clear()
        return True

    def take(self) -> tuple[list[Record], bool]:
        """What was queued, and whether some of it was dropped."""
        out = []
        while self._queue:
            out.append(self._queue.popleft())
        overflowed, self.overflowed = self.overflowed, False
        return out, overflowed


def _contiguous(last: int, records: list[Record]) -> bool:
    seqs = [last, *(r.seq for r in records)]
    return all(b == a + 1 for a, b in itertools.pairwise(seqs))


async def _catch_up(gw: GatewayView, exporter: Exporter) -> AsyncIterator[dict[str, Any]]:
    """A record line for every record on disk after `exporter.last`, read and
    decrypted chunk by chunk in worker threads; StreamStopped when the vault locks."""
    records: Iterator[Record] = journal.records(gw.home.journal)
    while True:
        chunk = await asyncio.to_thread(lambda: list(itertools.islice(records, CHUNK)))
        if not chunk:
            return
        identity = _identity(gw)
        events = await asyncio.to_thread(exporter.batch, chunk, identity)
        del identity  # not held while the client reads
        for event in events:
            yield {"event": "record", "record": event}


async def _follow(gw: GatewayView, exporter: Exporter, feed: Feed) -> AsyncIterator[dict[str, Any]]:
    """Records as the recorder reports them on disk; a ping when idle."""
    while True:
        if not await feed.wait(PING):
            if gw.vault.locked:
                raise StreamStopped(LOCKED, retryable=True)
            yield {"event": "ping"}
            continue
        queued, overflowed = feed.take()
        fresh = [r for r in queued if r.seq > exporter.last]
        if overflowed or not _contiguous(exporter.last, fresh):
            # A record the sink did not see, or a reader too slow for the queue:
            # the files have everything, in order.
            async with contextlib.aclosing(_catch_up(gw, exporter)) as lines:
                async for line in lines:
                    yield line
            continue
        if not fresh:
            continue
        identity = _identity(gw)
        events = await asyncio.to_thread(exporter.batch, fresh, identity)
        del identity
        for event in events:
            yield {"event": "record", "record": event}


async def export_stream(gw: GatewayView, args: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """The "export" stream of the operator socket (see the module's docstring)."""
    feed = Feed(asyncio.get_running_loop())
    sinks = gw.recorder.sinks
    try:
        try:
            since, follow, with_commands = arguments(args)
        except ValueError as exc:
            raise StreamStopped(str(exc)) from None
        _identity(gw)  # refuse a locked vault before anything else (the key is not kept)
        sinks.append(feed.sink)  # before the files are read: every later record is queued
        exporter = Exporter(since, with_commands)
        yield {"event": "hello", "boot_id": gw.boot_id}
        async with contextlib.aclosing(_catch_up(gw, exporter)) as lines:
            async for line in lines:
                yield line
        if not follow:
            yield {"event": "end", "seq": exporter.last}
            return
        async with contextlib.aclosing(_follow(gw, exporter, feed)) as lines:
            async for line in lines:
                yield line
    except StreamStopped as exc:
        yield exc.line()
    finally:
        if feed.sink in sinks:
            sinks.remove(feed.sink)
