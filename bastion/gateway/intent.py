"""The intent: what must hold, and be on disk, before an exec request leaves.

A decided command is sent only if, at the last moment, the gate still says so
(`final_check`), its command grant is spent, and the journal holds the whole
story so far: its first record, every record since (none lost to a full disk),
and `dispatch_started`, fsynced. With a witness the intent must also have left
the box: it is written before the exec channel opens and the dispatch waits
for the witness to confirm its head (`prepare`), then the gate is asked once
more with no await before the exec request (`__call__`, from
`outbound._IntentProcess.connection_made`). See docs/architecture.md, "The
promises": nothing is sent that the gate did not allow in the world as it is
when it leaves, and nothing that the journal -- or the witness -- could not tell.
The words and codes of its refusals are the gate's (`core/gate.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from bastion.core.contract import Refusal
from bastion.core.gate import not_durable, unwitnessed
from bastion.gateway.approvals import ApprovalBook
from bastion.gateway.recorder import Recorder
from bastion.journal import JournalError

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Intent:
    """One decided command's last steps before it leaves. Each refuses by raising
    a `Refusal` (nothing was sent), which it also keeps in `refusal`, so the request
    path tells its own refusals from the outbound side's."""

    request_id: str
    session_id: str
    final_check: Callable[[], Refusal | None]  # the gate, asked again in the world as it is now
    # The book, and the key of the command grant spent (`Decided.command_key`), if any.
    command: tuple[ApprovalBook, str | None]
    sent: Callable[[], None]  # the command is now in flight
    recorder: Recorder
    witnessed: Callable[[int], Awaitable[str | None]] | None = None
    written: bool = False
    refusal: Refusal | None = None
    grant_id: str | None = None  # the bounded grant whose use this is, journaled on the intent
    # a file operation's paths as the walk found them, where they are not those asked
    # (a symlink on the way): journaled on the intent, the paths it acts on
    acts_on: tuple[str, ...] = ()

    def _refuse(self, refusal: Refusal) -> Refusal:
        self.refusal = refusal
        return refusal

    def _ready(self) -> None:
        """The gate, in the world as it is now: grants, vault, and a journal that
        lost no record of this request since it was received (`World.records_lost`)."""
        refusal = self.final_check()
        if refusal is not None:
            raise self._refuse(refusal)

    def _write(self) -> Any:
        """`dispatch_started`, fsynced with everything before it; or nothing is sent."""
        try:
            record = self.recorder.intent(
                self.request_id, self.session_id, self.grant_id, self.acts_on
            )
        except (OSError, JournalError) as exc:
            log.error("%s: could not journal the intent: %s", self.request_id, exc)
            raise self._refuse(not_durable()) from None
        self.written = True
        return record

    async def prepare(self) -> None:
        """With a witness, before the exec channel opens: the intent on disk and its
        head confirmed off the box (`Witness.intent`), or nothing is sent. A wait that
        ends unconfirmed asks the gate first: a vault locked meanwhile says so."""
        if self.witnessed is None or self.written:
            return
        self._ready()
        record = self._write()
        why = await self.witnessed(record.seq)
        if why is not None:
            self._ready()
            raise self._refuse(unwitnessed(why))

    def __call__(self) -> None:
        """Immediately before the exec request is written, with no await in between."""
        self._ready()
        book, key = self.command
        if key is not None:
            book.consume(key)  # single use, marked before it is sent
        if not self.written:
            self._write()
        self.sent()
