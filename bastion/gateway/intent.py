"""The intent: what must hold, and be on disk, before an exec request leaves.

A decided command is sent only if, at the last moment, the gate still says so
(`final_check`), its command grant is spent, and the journal holds the whole
story so far: its first record, every record since (none lost to a full disk),
and `dispatch_started`, fsynced. With a witness the intent must also have left
the box: it is written before the session channel opens and the dispatch waits
for the witness to confirm its head (`prepare`), then the gate is asked once
more with no await before the exec request (`__call__`, from
`outbound._IntentProcess.connection_made`). See docs/architecture.md, "The
promises": nothing is sent that the gate did not allow in the world as it is
when it leaves, and nothing that the journal -- or the witness -- could not tell.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from bastion.core.contract import Code, Failure
from bastion.gateway.approvals import ApprovalBook
from bastion.gateway.recorder import Recorder
from bastion.journal import JournalError

log = logging.getLogger("bastion")

STORY_LOST = (
    "The gateway could not journal every record of this request (disk full?), so it did not "
    "send the command: nothing is sent that the journal cannot tell. Nothing was sent. An "
    "operator must make the journal writable again; the gateway's log says why."
)
NOT_JOURNALED = (
    "The gateway could not write this request to its journal ({why}), so it did not take "
    "it. Nothing was sent. An operator must make the journal writable again (disk full?); "
    "the gateway's log says why."
)
NOT_DURABLE = (
    "The gateway could not record its intent durably, so it did not send the command. "
    "Nothing was sent."
)


def not_journaled(request_id: str, exc: Exception) -> Failure:
    """The request's first record could not be written: it is refused at once."""
    log.error("%s: could not journal the request: %s", request_id, exc)
    return Failure(Code.INTERNAL, NOT_JOURNALED.format(why=exc), request_id)


class NotDispatched(Exception):
    """The world changed (or the intent could not be journaled or witnessed) before the
    exec request left: nothing was sent."""

    def __init__(self, failure: Failure) -> None:
        self.failure = failure


@dataclass(eq=False)
class Intent:
    """One decided command's last steps before it leaves."""

    request_id: str
    session_id: str
    final_check: Callable[[], Failure | None]  # the gate, asked again in the world as it is now
    grant: tuple[ApprovalBook, str | None]  # the book, and the command card whose grant is spent
    sent: Callable[[], None]  # the command is now in flight
    recorder: Recorder
    lost: int  # the recorder's count of lost records when the request was received
    witnessed: Callable[[int], Awaitable[str | None]] | None = None
    written: bool = False

    def _ready(self) -> None:
        failure = self.final_check()
        if failure is not None:
            raise NotDispatched(failure)
        if self.recorder.lost != self.lost:
            raise NotDispatched(Failure(Code.INTERNAL, STORY_LOST, self.request_id))

    def _write(self) -> Any:
        """`dispatch_started`, fsynced with everything before it; or nothing is sent."""
        try:
            record = self.recorder.intent(self.request_id, self.session_id)
        except (OSError, JournalError) as exc:
            log.error("%s: could not journal the intent: %s", self.request_id, exc)
            raise NotDispatched(Failure(Code.INTERNAL, NOT_DURABLE, self.request_id)) from None
        self.written = True
        return record

    async def prepare(self) -> None:
        """With a witness, before the session channel opens: the intent on disk and its
        head confirmed off the box (`Witness.intent`), or nothing is sent."""
        if self.witnessed is None or self.written:
            return
        self._ready()
        record = self._write()
        why = await self.witnessed(record.seq)
        if why is not None:
            raise NotDispatched(Failure(Code.GATEWAY_BUSY, why, self.request_id))

    def __call__(self) -> None:
        """Immediately before the exec request is written, with no await in between."""
        self._ready()
        book, card = self.grant
        if card is not None:
            book.consume(card)  # single use, marked before it is sent
        if not self.written:
            self._write()
        self.sent()
