"""Warm connections for certificate accounts: key exchange done, authentication not begun.

A certificate pins one command, so its connection cannot be pooled: it carries that one
command and closes. But TCP, key exchange and the host-key check against the pin do not
depend on the command. So once a certificate account's command has logged in and run,
the next connection to the same (target, user) is opened and *parked* at the auth step:
asyncssh asks `Parked.public_key_auth_requested`, which waits until the next command's
certificate exists. That command then only authenticates and opens its channel.

What keeps this as strict as a fresh connection per command:
- nothing authenticates before the certificate, and the certificate is made only after
  the gate let its request through (`gateway/certify.py`); a parked connection holds no
  key material at all;
- a parked connection is handed to one command (`take` removes it) and answers the auth
  step once: a second ask gets no key, so it can never log in twice;
- the pin is checked in key exchange, before parking, as on a fresh connection, and is
  part of the warm set's key: another pin never finds it;
- the warm set is per vault epoch and `retire_all` (a lock or unlock) closes it whole;
  a command decided in an epoch before it (still on its way) parks nothing.

Staying polite to the target: at most `per_key` (1) parked per (target, user, pin, epoch),
well inside sshd's `MaxStartups` (10:30:100); each is closed after `recycle` seconds
(30 s, well before sshd's default `LoginGraceTime` of 120 s) and replaced only while its
key took a connection in the last `keep_warm` seconds: a target nobody used in the last
minutes has none. A parked connection the target dropped (LoginGraceTime, MaxStartups) is
simply not handed out; the command that finds none opens its own, as before this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import asyncssh

PER_KEY = 1  # parked connections per (target, user, pin) and vault epoch
RECYCLE = 30.0  # seconds a parked connection waits before it is closed and replaced
KEEP_WARM = 120.0  # replaced only while its key took a connection this recently


class Parked(asyncssh.SSHClient):
    """The client side of one outbound connection that stops at the auth step until
    `give` hands it the login (a certificate and its key), and answers that step once."""

    def __init__(self) -> None:
        self.lost = False  # the connection is gone (closed by either side)
        self.parked = asyncio.Event()  # key exchange done, pin matched, auth asked for
        self.sent = False  # the login left for the target: it may have been used
        self._login: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._asked = False
        self._conn: asyncssh.SSHClientConnection | None = None

    def connection_made(self, conn: asyncssh.SSHClientConnection) -> None:
        self._conn = conn

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if not self._login.done():
            self._login.cancel()

    async def public_key_auth_requested(self) -> Any:
        if self._asked:
            return None  # one login per connection: no second key to try
        self._asked = True
        self.parked.set()
        login = await self._login
        self.sent = True
        return [login]

    def give(self, login: Any) -> None:
        """The login for the one command this connection carries."""
        if not self._login.done():
            self._login.set_result(login)

    @property
    def given(self) -> bool:
        return self._login.done() and not self._login.cancelled()

    def close(self) -> None:
        if not self._login.done():
            self._login.cancel()
        if self._conn is not None:
            self._conn.close()


@dataclass(eq=False)
class Opening:
    """One outbound connection on its way: `task` is asyncssh's connect, which returns
    the connection once `client` was given a login and the target accepted it."""

    client: Parked
    task: asyncio.Future[asyncssh.SSHClientConnection]
    born: float = 0.0
    watch: asyncio.Future[None] | None = None  # what bounds its key exchange

    def __post_init__(self) -> None:
        self.task.add_done_callback(_retrieved)

    @property
    def gone(self) -> bool:
        """It can no longer carry a command (failed, dropped or closed)."""
        return self.task.done() or self.client.lost

    def close(self) -> None:
        self.client.close()
        self.task.cancel()


def _retrieved(task: asyncio.Future[Any]) -> None:
    """A parked connection that fails unused is not an error anyone waits for."""
    if not task.cancelled():
        task.exception()


Open = Callable[[], Opening]
Schedule = Callable[[float, Callable[[], None]], Any]  # loop.call_later's shape


@dataclass(eq=False)
class _Entry:
    opener: Open
    parked: list[Opening] = field(default_factory=list)
    used: float = 0.0  # when it last took a connection


class Warm:
    """The warm set: parked connections per key, made ahead of the next command."""

    def __init__(
        self,
        per_key: int = PER_KEY,
        recycle: float = RECYCLE,
        keep_warm: float = KEEP_WARM,
        clock: Callable[[], float] = time.monotonic,
        schedule: Schedule | None = None,
    ) -> None:
        self.per_key = per_key
        self.recycle = recycle
        self.keep_warm = keep_warm
        self.clock = clock
        self._schedule = schedule
        self._entries: dict[Hashable, _Entry] = {}
        self._generation = 0  # a retire_all ends every timer set before it
        self._seen = 0  # the newest vault epoch a command took a connection in
        self._stale = -1  # epochs up to this one were retired: none is parked for them
        self.opened = 0  # parked connections opened ahead of a command
        self.rode = 0  # commands that took one
        self.missed = 0  # commands that found none usable and opened their own

    def take(self, key: Hashable, epoch: int, opener: Open) -> Opening | None:
        """A parked (or still handshaking) connection for `key` in vault epoch `epoch`,
        never handed out again, or None. `opener` makes the next one (`fill`)."""
        if epoch <= self._stale:
            return None  # decided before the vault changed state: no warm set for it
        self._seen = max(self._seen, epoch)
        entry = self._entries.setdefault((key, epoch), _Entry(opener))
        entry.opener = opener  # the newest policy's timeouts
        entry.used = self.clock()
        while entry.parked:
            candidate = entry.parked.pop(0)
            if not candidate.gone:
                self.rode += 1
                return candidate
            candidate.close()
        self.missed += 1
        return None

    def fill(self, key: Hashable, epoch: int) -> None:
        """Open what `key` lacks of its warm set in `epoch`, if it took a connection in
        that epoch and the vault has not changed state since (a login just succeeded:
        the target is there)."""
        entry = self._entries.get((key, epoch))
        if entry is not None and epoch > self._stale:
            self._fill((key, epoch), entry)

    def _fill(self, key: Hashable, entry: _Entry) -> None:
        entry.parked = [p for p in entry.parked if not p.gone]
        while len(entry.parked) < self.per_key:
            try:
                opening = entry.opener()
            except Exception:  # the next command connects itself
                return
            opening.born = self.clock()
            entry.parked.append(opening)
            self.opened += 1
            self._later(self.recycle, lambda o=opening, g=self._generation: self._expire(key, o, g))

    def _expire(self, key: Hashable, opening: Opening, generation: int) -> None:
        """Its time is up: close it; replace it only if the key was used lately."""
        if generation != self._generation:
            return
        entry = self._entries.get(key)
        if entry is None or opening not in entry.parked:
            return  # taken, or dropped with its entry
        entry.parked.remove(opening)
        opening.close()
        if self.clock() - entry.used < self.keep_warm:
            self._fill(key, entry)
        elif not entry.parked:
            del self._entries[key]  # nobody used it lately: no warm set

    def _later(self, delay: float, callback: Callable[[], None]) -> None:
        if self._schedule is not None:
            self._schedule(delay, callback)
        else:
            asyncio.get_running_loop().call_later(delay, callback)

    def parked(self) -> int:
        """Connections parked (or handshaking) now."""
        return sum(len([p for p in e.parked if not p.gone]) for e in self._entries.values())

    def stats(self) -> dict[str, int]:
        """For `status`: parked now, opened ahead, commands that rode one, and commands
        that found none."""
        return {
            "parked": self.parked(),
            "opened": self.opened,
            "rode": self.rode,
            "missed": self.missed,
        }

    def retire_all(self) -> None:
        """The vault changed state (or the gateway stops): close every parked connection
        and forget who used what, so none is opened until a command asks again. Every
        epoch a command has used so far is stale from now on: a command decided before
        (it may still be on its way) parks nothing."""
        self._generation += 1
        self._stale = max(self._stale, self._seen)
        for entry in self._entries.values():
            for opening in entry.parked:
                with contextlib.suppress(Exception):
                    opening.close()
        self._entries.clear()
