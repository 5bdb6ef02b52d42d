"""`bastion approve`: the operator's terminal prompt, and how a card reads.

Events come from the gateway's watch stream; answers go back as ordinary
`answer` requests over the operator socket, and the lock key sends the same
`lock` request as `bastion lock`. Every string on a card comes from the
gateway already escaped where it must be (the command); the prompt adds only
styling, and only when writing to a terminal. On a terminal it also rings the
bell for a new card and, between cards, keeps one status line
(`statusline.py`) redrawn in place; the desktop notification is `notify.py`'s.
"""

from __future__ import annotations

import json
import os
import select
import socket
import sys
import termios
import time
import tty
from pathlib import Path
from typing import Any

from bastion.cli.cardview import Style, render_card, render_details
from bastion.cli.notify import BELL, Alerts, Notifier, notification_for
from bastion.cli.statusline import status_line
from bastion.core.display import escape_text
from bastion.core.events import foreign_warning
from bastion.opsock import OperatorError, call


def _shown(value: object) -> str:
    """Every value the prompt shows goes through the one escaping function."""
    return escape_text(str(value))


CLEAR_LINE = "\r\033[K"  # back to the line's start, erase it: the status line is redrawn
STATUS_EVERY = 3.0  # seconds between status refreshes when nothing happens
STATUS_GAP = 0.3  # at least this long between two refreshes, however many events come
STATUS_TIMEOUT = 2.0  # seconds a status request may take before the line says so
HELP = "y approve, n deny, d details, L lock the vault, q quit"


class Prompt:
    """`bastion approve`: shows each card as it arrives and asks y/n/d.

    Events come from the gateway's watch stream; answers go back as ordinary
    `answer` requests. When the gateway goes away the prompt says so, waits,
    and reconnects: cards of the old lifetime died with it. `L` locks the
    vault at any moment, with no question asked: locking only ever takes
    authority away, and it must be quicker than any second thought.
    """

    RETRY = 1.0

    def __init__(
        self,
        path: Path,
        infd: int,
        out: Any,
        style: Style,
        terminal: bool = False,
        alerts: Alerts = Alerts(),  # noqa: B008 -- frozen, so sharing it is safe
        notifier: Notifier | None = None,
    ) -> None:
        self.path = path
        self.infd = infd
        self.out = out
        self.style = style
        self.terminal = terminal  # bell and status line only where a person looks
        self.alerts = alerts
        self.notifier = notifier if notifier is not None else Notifier(None)
        self.cards: dict[str, dict[str, Any]] = {}
        self.current: str | None = None
        self.boot_id: str | None = None
        self.greeted = False  # this connection's hello arrived: there is a status to show
        self.status_shown = False  # the status line is on screen, to be erased before output
        self.fetched_at = -STATUS_EVERY  # monotonic time of the last status request
        self.stale = True  # something happened since: refresh soon

    def write(self, text: str) -> None:
        """All output goes here: the status line is erased before anything else."""
        if self.status_shown:
            text = CLEAR_LINE + text
            self.status_shown = False
        self.out.write(text)
        self.out.flush()

    def say(self, text: str) -> None:
        self.write(text + "\n")

    def run(self) -> int:
        try:
            return self._run()
        finally:
            if self.status_shown:
                self.write("")
            self.notifier.close()

    def _run(self) -> int:
        waiting_said = False
        while True:
            sock = self._connect()
            if sock is None:
                if not waiting_said:
                    self.say(
                        self.style.warn(
                            f"gateway not running ({self.path}); waiting for it... (q to quit)"
                        )
                    )
                    waiting_said = True
                ready, _, _ = select.select([self.infd], [], [], self.RETRY)
                if ready and self._quit_requested():
                    return 0
                continue
            waiting_said = False
            with sock:
                if self._session(sock) == "quit":
                    return 0
            self.cards.clear()
            self.current = None
            self.stale = True
            self.say(self.style.warn("lost the gateway (stopped or restarted); reconnecting..."))

    def _connect(self) -> socket.socket | None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(str(self.path))
            sock.sendall(json.dumps({"op": "watch"}).encode() + b"\n")
        except OSError:
            sock.close()
            return None
        return sock

    def _quit_requested(self) -> bool:
        data = os.read(self.infd, 64)
        return not data or b"q" in data.lower()

    def _session(self, sock: socket.socket) -> str:
        buf = b""
        self.greeted = False
        while True:
            ready, _, _ = select.select([sock, self.infd], [], [], self._until_refresh())
            if sock in ready:
                chunk = sock.recv(65536)
                if not chunk:
                    return "lost"
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    event = json.loads(line)
                    if "event" not in event:  # the gateway refused this operator
                        self.say(self.style.bad(f"refused: {_shown(event.get('error'))}"))
                        return "quit"
                    self._event(event)
            if self.infd in ready:
                data = os.read(self.infd, 64)
                if not data:
                    return "quit"
                for key in data.decode("utf-8", "replace").lower():
                    if self._key(key) == "quit":
                        return "quit"
            self.notifier.reap()
            self._status_tick()

    # -- the status line between cards ---------------------------------------------------

    def _until_refresh(self) -> float | None:
        """How long the prompt may sleep before the status line is due."""
        if not self.terminal or not self.greeted or self.current is not None:
            return None  # no line to keep: a card and its question own the screen
        due = self.fetched_at + (STATUS_GAP if self.stale else STATUS_EVERY)
        return max(0.0, due - time.monotonic())

    def _status_tick(self) -> None:
        left = self._until_refresh()
        if left is None or left > 0:
            return
        self.fetched_at, self.stale = time.monotonic(), False
        try:
            status = call(self.path, "status", timeout=STATUS_TIMEOUT)
        except (OperatorError, OSError):
            status = None
        self.write(CLEAR_LINE + self.style.dim(status_line(status, self._width())))
        self.status_shown = True

    def _width(self) -> int:
        try:
            return os.get_terminal_size(self.out.fileno()).columns or 80
        except (OSError, ValueError, AttributeError):
            return 80

    # -- events and keys -----------------------------------------------------------------

    def _event(self, event: dict[str, Any]) -> None:
        kind = event.get("event")
        if kind != "ping":
            self.stale = True
        if kind == "hello":
            self.greeted = True
            again = self.boot_id is not None and self.boot_id != event["boot_id"]
            self.boot_id = event["boot_id"]
            state = "locked" if event["locked"] else "unlocked"
            self.say(
                self.style.dim(
                    f"{'reconnected to a restarted' if again else 'connected to'} "
                    f"gateway {_shown(event['boot_id'])} (vault {state}); "
                    f"waiting for cards -- {HELP}"
                )
            )
            for span in event.get("foreign_records") or []:
                self.say(self.style.bad("  " + _shown(foreign_warning(span))))
        elif kind == "card":
            self.cards[event["card"]["id"]] = event["card"]
            self._alert(event["card"])
            self._show_next()
        elif kind == "closed":
            card_id, answer = event["card"], event["answer"]
            self.cards.pop(card_id, None)
            if card_id == self.current:
                self.current = None
                if answer not in ("approved", "declined"):
                    why = {
                        "withdrawn_locked": "the vault locked",
                        "withdrawn_gone": "its process exited or disconnected",
                        "timeout": "nobody answered in time",
                        "unseen": "nobody answered in time",
                    }.get(answer, answer)
                    self.say(self.style.warn(f"  {_shown(card_id)} withdrawn: {_shown(why)}"))
                self._show_next()
        elif kind == "notice":
            self.say(self.style.dim(f"  notice: {_shown(event['text'])}"))

    def _alert(self, card: dict[str, Any]) -> None:
        """A new card: the bell on a terminal, a desktop notification if wanted."""
        if self.terminal and self.alerts.bell:
            self.write(BELL)
        if self.alerts.desktop:
            self.notifier.send(notification_for(card, self.alerts.with_command))

    def _show_next(self) -> None:
        if self.current is None and self.cards:
            self.current = next(iter(self.cards))
            self.say("")
            self.say(render_card(self.cards[self.current], style=self.style, width=self._width()))
            self.write(self.style.bold("approve? [y/n/d] "))

    def _key(self, key: str) -> str | None:
        if key == "q":
            return "quit"
        if key == "l":
            self._lock()
            return None
        card = self.cards.get(self.current or "")
        if card is None:
            return None
        if key == "d":
            self.say("\n" + render_details(card, style=self.style, width=self._width()))
            self.write(self.style.bold("approve? [y/n/d] "))
        elif key in ("y", "n"):
            try:
                call(self.path, "answer", card=card["id"], approve=key == "y")
                self.say(self.style.good("approved") if key == "y" else self.style.bad("denied"))
            except OperatorError as exc:
                self.say(self.style.bad(f"not applied: {_shown(exc)}"))
            self.cards.pop(card["id"], None)
            self.current = None
            self._show_next()
        return None

    def _lock(self) -> None:
        """The `lock` request `bastion lock` sends: every approval ends at once."""
        if self.current is not None:
            self.say("")  # off the question's line
        try:
            result = call(self.path, "lock", timeout=60)
        except (OperatorError, OSError) as exc:
            self.say(self.style.bad(f"NOT locked: {_shown(exc)}; run `bastion lock`"))
            return
        self.stale = True
        self.say(
            self.style.warn(
                f"locked (vault epoch {result['vault_epoch']}): every approval ended; "
                "`bastion unlock` to unlock"
            )
        )


def approve(path: Path, notify: bool = True, notify_command: bool = False) -> int:
    """Run the prompt on this terminal (cbreak mode: one key, no Enter)."""
    infd = sys.stdin.fileno()
    is_tty = os.isatty(infd)
    terminal = is_tty and sys.stdout.isatty()
    alerts = Alerts(bell=True, desktop=notify, with_command=notify_command)
    notifier = Notifier.find() if notify else Notifier(None)
    prompt = Prompt(path, infd, sys.stdout, Style(terminal), terminal, alerts, notifier)
    if not is_tty:
        return prompt.run()

    saved = termios.tcgetattr(infd)
    try:
        tty.setcbreak(infd)
        return prompt.run()
    except KeyboardInterrupt:
        return 130
    finally:
        termios.tcsetattr(infd, termios.TCSADRAIN, saved)
