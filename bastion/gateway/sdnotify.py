"""Telling systemd how the gateway is doing (the `sd_notify(3)` protocol), stdlib only.

The unit `bastion service install` writes is `Type=notify`: systemd considers
the gateway started only when it says `READY=1`, which it does once both of its
sockets listen -- so `systemctl start bastion` returning means an agent's
`ssh` can connect. `WatchdogSec=` makes systemd restart a gateway whose event
loop stops turning: the pings (`WATCHDOG=1`) are sent *from* the event loop, at
least every half of `WATCHDOG_USEC`, so a wedged loop stops them. `STATUS=`
carries one cheap line for `systemctl status` (locked, or unlocked with the
number of sessions and waiting cards), and `STOPPING=1` says a stop is under
way.

The protocol is one datagram per message to the unix socket named by
`$NOTIFY_SOCKET` (a path, or `@name` in the abstract namespace), lines of
`KEY=value`. Without `$NOTIFY_SOCKET` (not run by systemd) nothing is sent,
ever. Nothing secret is in any message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable, Mapping, Sized
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger(__name__)

STATUS_EVERY = 5.0  # seconds between looks at the status line when no watchdog asks for more
ENV_KEYS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


def socket_address(notify_socket: str) -> bytes | None:
    """The address to send to: a filesystem path, or `@name` for the abstract
    namespace (a leading NUL byte). Anything else (systemd 253's `vsock:` form, a
    relative path) is not understood, so nothing is sent rather than guessed."""
    if notify_socket.startswith("/"):
        return os.fsencode(notify_socket)
    if notify_socket.startswith("@") and len(notify_socket) > 1:
        return b"\0" + os.fsencode(notify_socket[1:])
    return None


def message(*fields: tuple[str, str]) -> bytes:
    """One notification: `KEY=value` lines. A value cannot carry a newline (it would
    start a new assignment), so any line break becomes a space."""
    lines = []
    for key, value in fields:
        flat = " ".join(str(value).splitlines())
        lines.append(f"{key}={flat}")
    return "\n".join(lines).encode()


def watchdog_interval(env: Mapping[str, str], pid: int) -> float | None:
    """Seconds between pings: half of `WATCHDOG_USEC`, as sd_watchdog_enabled(3) asks;
    None when no watchdog is set, or when `WATCHDOG_PID` names another process
    (the variables were inherited, not meant for us)."""
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    if usec <= 0:
        return None
    owner = env.get("WATCHDOG_PID")
    if owner is not None and owner.strip() != str(pid):
        return None
    return usec / 2_000_000


def status_line(locked: bool, sessions: int, pending: int) -> str:
    """What `systemctl status` shows under the unit: the vault's state and, unlocked,
    the live session approvals and the cards waiting for an operator."""
    if locked:
        return "locked: run `bastion unlock`"
    cards = f", {pending} card{'s' if pending != 1 else ''} waiting" if pending else ""
    return f"unlocked, {sessions} session{'s' if sessions != 1 else ''}{cards}"


@dataclass(frozen=True)
class Target:
    """What the environment told this process about its service manager."""

    address: bytes
    watchdog: float | None  # seconds between WATCHDOG=1, or None

    @property
    def period(self) -> float:
        """How often the beat runs: the watchdog's pace, and at least every
        STATUS_EVERY seconds so the status line follows the vault."""
        return min(self.watchdog, STATUS_EVERY) if self.watchdog else STATUS_EVERY

    @staticmethod
    def from_env(env: Mapping[str, str], pid: int) -> Target | None:
        address = socket_address(env.get("NOTIFY_SOCKET", ""))
        if address is None:
            return None
        return Target(address, watchdog_interval(env, pid))


class Lockable(Protocol):
    @property
    def locked(self) -> bool: ...


class Approvals(Protocol):
    def sessions(self) -> Sized: ...

    def pending(self) -> Sized: ...


class Notifier:
    """The gateway's side of the conversation: READY at start, a beat on the event
    loop (watchdog pings, status changes), STOPPING at the end. Without a target
    every method does nothing."""

    def __init__(self, target: Target | None, status: Callable[[], str]) -> None:
        self.target = target
        self._status = status
        self._last_status: str | None = None
        self._sock: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._failed = False
        self._status_failed = False

    def send(self, *fields: tuple[str, str]) -> None:
        """One datagram, never blocking the loop: a full or missing socket drops the
        message (the next beat sends again) and is logged once."""
        if self.target is None:
            return
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.setblocking(False)
            self._sock.sendto(message(*fields), self.target.address)
        except OSError as exc:
            if not self._failed:
                log.warning("could not notify systemd ($NOTIFY_SOCKET): %s", exc)
            self._failed = True

    def ready(self) -> None:
        """The sockets listen: tell systemd, and start the beat on the running loop."""
        if self.target is None:
            return
        self._last_status = self._status()
        self.send(("READY", "1"), ("STATUS", self._last_status))
        self._task = asyncio.get_running_loop().create_task(self._beat())

    def beat(self) -> None:
        """One turn: ping the watchdog (if asked for) and send the status if it changed."""
        fields = [("WATCHDOG", "1")] if self.target and self.target.watchdog else []
        try:
            status = self._status()
        except Exception:  # a status line must never cost the watchdog's pings
            if not self._status_failed:
                log.exception("could not compute the status line for systemd")
            self._status_failed = True
            status = self._last_status
        if status is not None and status != self._last_status:
            self._last_status = status
            fields.append(("STATUS", status))
        if fields:
            self.send(*fields)

    async def _beat(self) -> None:
        assert self.target is not None
        while True:
            await asyncio.sleep(self.target.period)
            self.beat()

    def stopping(self) -> None:
        """The gateway is going down: no more pings (a slow stop is not a hang), and say so."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self.send(("STOPPING", "1"), ("STATUS", "stopping"))
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None


def hand_over(child: int) -> None:
    """The gateway goes on in a child (`bastion.memory.close`), so the process systemd
    started only waits: tell systemd the child is the main process now (MAINPID=), so
    its READY, STATUS and WATCHDOG count under `NotifyAccess=main`. Called in the
    first process, before the child may speak."""
    address = socket_address(os.environ.get("NOTIFY_SOCKET", ""))
    if address is None:
        return
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(message(("MAINPID", str(child))), address)
    except OSError as exc:
        log.warning("could not tell systemd the gateway's pid ($NOTIFY_SOCKET): %s", exc)


def taken_over(parent: int) -> None:
    """In that child: a watchdog systemd set for the first process is this one's."""
    if os.environ.get("WATCHDOG_PID", "").strip() == str(parent):
        os.environ["WATCHDOG_PID"] = str(os.getpid())


def start(vault: Lockable, book: Approvals) -> Notifier:
    """Called by the gateway once its listeners are up: READY=1 and the beat, when a
    service manager asked for them. The variables are taken out of the environment,
    as sd_notify(3)'s `unset_environment` does, so nothing the gateway might start
    later inherits them."""
    env = {key: os.environ.pop(key) for key in ENV_KEYS if key in os.environ}
    notifier = Notifier(
        Target.from_env(env, os.getpid()),
        lambda: status_line(vault.locked, len(book.sessions()), len(book.pending())),
    )
    notifier.ready()
    return notifier
