"""`bastion approve`: the operator's terminal prompt, and how a card reads.

Events come from the gateway's watch stream; answers go back as ordinary
`answer` requests over the operator socket, and the lock key sends the same
`lock` request as `bastion lock`. Every string on a card comes from the
gateway already escaped where it must be (the command); the prompt adds only
styling, and only when writing to a terminal. On a terminal it also rings the
bell for a new card and, between cards, keeps one status line
(`statusline.py`) redrawn in place; the desktop notification is `notify.py`'s.
What a key means (confirmation, the guard time, pastes) is `promptkeys.py`'s.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import sys
import termios
import time
import tty
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.cells import cell_len

from bastion.cli.cardview import Style, clock, fit, render_card, render_details
from bastion.cli.notify import BELL, Alerts, Notifier, notification_for
from bastion.cli.promptkeys import (
    BOUND_CHOICES,
    CONFIRMING,
    HELP,
    NOTES,
    PASTE_OFF,
    PASTE_ON,
    Act,
    GrantDraft,
    Mode,
    bound_text,
    decide,
)
from bastion.cli.rows import activity_rows, cells, session_rows
from bastion.cli.statusline import status_line
from bastion.core.display import escape_text
from bastion.core.events import foreign_warning
from bastion.ops.opsock import OperatorError, WrongServer, call, check_server


def _shown(value: object) -> str:
    """Every value the prompt shows goes through the one escaping function."""
    return escape_text(str(value))


CLEAR_LINE = "\r\033[K"  # back to the line's start, erase it: the status line is redrawn
STATUS_EVERY = 3.0  # seconds between status refreshes when nothing happens
STATUS_GAP = 0.3  # at least this long between two refreshes, however many events come
STATUS_TIMEOUT = 2.0  # seconds a status request may take before the line says so
QUESTION = "approve? [y/n then Enter"  # then the keys that fit the line
# Why a card left the screen unanswered: the gateway's withdrawal (`core/cards.Withdrawal`),
# else how it ended.
WITHDRAWN = {
    "agent_exited": "its agent exited",
    "connection_closed": "its connection closed",
    "vault_locked": "the vault locked",
}
ENDED = {
    "withdrawn_locked": "the vault locked",
    "withdrawn_gone": "its process exited or disconnected",
    "timeout": "nobody answered in time",
    "unseen": "nobody answered in time",
}
ROWS_SHOWN = 5  # requests `a` shows (all of them: `bastion audit activity`)
VIEW_TIMEOUT = 30.0  # seconds `a` or `s` may wait for the gateway's rows
READ_SIZE = 4096  # one read takes a whole paste, so it is discarded whole


class Prompt:
    """`bastion approve`: shows each card as it arrives and asks for an answer.

    Events come from the gateway's watch stream; answers go back as ordinary
    `answer` requests. When the gateway goes away the prompt says so, waits,
    and reconnects: cards of the old lifetime died with it. An answer is `y`
    or `n` then Enter, given to the card still shown (`promptkeys.decide`).
    `L` locks the vault at any moment, with no question asked: locking only
    ever takes authority away, and it must be quicker than any second thought.
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
        resized: int | None = None,
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
        self.refused: str | None = None  # why the socket's server is not the gateway, once said
        self.resized = resized  # readable when the terminal changed size (SIGWINCH)
        self.inputs = [infd] + ([resized] if resized is not None else [])
        self.mode = Mode.IDLE  # what the keyboard's next read is decided in
        self.carry = ""  # inside a paste, the last read's tail: an end marker may be split
        self.changed_at = float("-inf")  # monotonic time the card on screen last changed
        self.lock_hinted = False  # "l: nothing; L locks" is said once
        self.line_open = False  # the last write left the cursor on its line (a question)
        self.key = ""  # the digit of the last read, for a grant's steps
        self.draft: GrantDraft | None = None  # the grant being chosen for the card shown

    def write(self, text: str) -> None:
        """All output goes here: the status line is erased before anything else."""
        if self.status_shown:
            text = CLEAR_LINE + text
            self.status_shown = False
        self.out.write(text)
        self.out.flush()
        if text:
            self.line_open = not text.endswith("\n")

    def say(self, text: str) -> None:
        """A line of its own: a question still waiting on its line is ended first."""
        self.write(("\n" if self.line_open else "") + text + "\n")

    def tell(self, text: str, tone: Callable[[str], str]) -> None:
        """One of the prompt's own messages (escaped already), fitted to the width."""
        for line in fit(text, self._width()):
            self.say(tone(line))

    def end_line(self) -> None:
        """Off the question's line, if it is still open."""
        if self.line_open:
            self.write("\n")

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
                ready, _, _ = select.select(self.inputs, [], [], self.RETRY)
                if self.resized in ready:
                    self._resize()
                if self.infd in ready and self._input() == "quit":
                    return 0
                continue
            waiting_said = False
            with sock:
                if self._session(sock) == "quit":
                    return 0
            self.cards.clear()
            self.current = None
            self._changed()
            self.stale = True
            self.say(self.style.warn("lost the gateway (stopped or restarted); reconnecting..."))

    def _connect(self) -> socket.socket | None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(str(self.path))
            check_server(sock, self.path)  # nothing to a process that is not the gateway
            sock.sendall(json.dumps({"op": "watch"}).encode() + b"\n")
        except WrongServer as exc:
            sock.close()
            if str(exc) != self.refused:
                self.refused = str(exc)
                self.say(self.style.bad(f"not the gateway: {_shown(str(exc))}"))
            return None
        except OSError:
            sock.close()
            return None
        self.refused = None
        return sock

    def _session(self, sock: socket.socket) -> str:
        buf = b""
        self.greeted = False
        while True:
            ready, _, _ = select.select([sock, *self.inputs], [], [], self._until_refresh())
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
            if self.resized in ready:
                self._resize()
            if self.infd in ready and self._input() == "quit":
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
            self.tell(
                f"{'reconnected to a restarted' if again else 'connected to'} "
                f"gateway {_shown(event['boot_id'])} (vault {state})",
                self.style.dim,
            )
            self.tell(f"waiting for cards -- {HELP}", self.style.dim)
            for span in event.get("foreign_records") or []:
                self.tell("  " + _shown(foreign_warning(span)), self.style.bad)
        elif kind == "card":
            self.cards[event["card"]["id"]] = event["card"]
            self._alert(event["card"])
            self._show_next()
        elif kind == "closed":
            card_id, answer = event["card"], event["answer"]
            self.cards.pop(card_id, None)
            if card_id == self.current:
                self.current = None
                self._changed()
                if answer not in ("approved", "declined"):
                    why = WITHDRAWN.get(event.get("why") or "") or ENDED.get(answer, answer)
                    self.tell(f"  {_shown(card_id)} withdrawn: {_shown(why)}", self.style.warn)
                self._show_next()
        elif kind == "notice":
            self.tell(f"  notice: {_shown(event['text'])}", self.style.dim)
        elif kind == "grant":
            g = event.get("grant") or {}
            left = g.get("uses_left")
            self.tell(
                f"  grant {_shown(g.get('id'))} made: {_shown(g.get('pattern'))}"
                + (f", {left} use(s)" if left is not None else "")
                + (f", until {clock(g['expires_at'])}" if g.get("expires_at") else ""),
                self.style.dim,
            )
        elif kind == "grant_ended":
            self.tell(
                f"  grant {_shown(event.get('grant'))} ended: {_shown(event.get('reason'))}",
                self.style.dim,
            )

    def _alert(self, card: dict[str, Any]) -> None:
        """A new card: the bell on a terminal, a desktop notification if wanted."""
        if self.terminal and self.alerts.bell:
            self.write(BELL)
        if self.alerts.desktop:
            self.notifier.send(notification_for(card, self.alerts.with_command))

    def _show_next(self) -> None:
        if self.current is None and self.cards:
            self.current = next(iter(self.cards))
            self._present(self.cards[self.current])

    def _present(self, card: dict[str, Any]) -> None:
        """The card on screen (again), its question under it; the guard starts now."""
        self._drop_begun()
        self.say("")
        self.say(self._draw(card, details=False))
        self._ask()
        self._changed()

    def _draw(self, card: dict[str, Any], details: bool) -> str:
        """The one place the prompt draws a card, at the terminal's width now; with
        `details`, only what `d` adds (the header is on screen already)."""
        if details:
            return render_details(card, style=self.style, width=self._width())
        return render_card(card, style=self.style, width=self._width())

    def _question(self, card: dict[str, Any]) -> str:
        """The question line names the card a key answers, so none answers another."""
        who = f"{_shown(card['id'])} ({_shown(card['kind'])} on {_shown(card['host'])}): "
        for line in (who + QUESTION + ", d details, L lock] ", who + QUESTION + "] "):
            if cell_len(line) < self._width():
                return line
        return f"{_shown(card['id'])}: {QUESTION}] "

    def _ask(self) -> None:
        card = self.cards.get(self.current or "")
        if card is not None:
            self.write(self.style.bold(self._question(card)))

    def _changed(self) -> None:
        """The card on screen changed: keys are ignored for GUARD seconds from now."""
        self._drop_begun()
        self.changed_at = time.monotonic()

    def _drop_begun(self) -> None:
        """An answer begun for the card that was shown ends: its Enter answers no other."""
        self.draft = None
        if self.mode in CONFIRMING:
            self.mode = Mode.IDLE
            self.say(self.style.dim("  the answer begun was cancelled: the card changed"))

    def _resize(self) -> None:
        """The terminal changed size: the card is drawn again, at the new width."""
        with contextlib.suppress(OSError):
            while os.read(self.resized, 512):  # type: ignore[arg-type]  # one redraw for many
                pass
        self.stale = True
        card = self.cards.get(self.current or "")
        if card is not None:
            self._present(card)

    def _note(self, text: str) -> None:
        """A line under the question, then the question again."""
        self.tell(text, self.style.warn)
        self._ask()

    def _input(self) -> str | None:
        """One read of the keyboard, decided whole."""
        data = os.read(self.infd, READ_SIZE)
        if not data:
            return "quit"
        card = self.cards.get(self.current or "")
        chunk = self.carry + data.decode("utf-8", "replace")
        decision = decide(self.mode, chunk, time.monotonic() - self.changed_at, card is not None)
        self.mode, self.carry, self.key = decision.mode, decision.carry, decision.key
        for act in decision.acts:
            if self._act(act, card) == "quit":
                return "quit"
        if decision.acts == (Act.CANCEL,):
            self._ask()
        return None

    def _act(self, act: Act, card: dict[str, Any] | None) -> str | None:
        if act is Act.QUIT:
            return "quit"
        if act is Act.LOCK:
            self._lock()
            self._ask()
        elif act in NOTES and not (act is Act.HINT_LOCK and self.lock_hinted):
            self.lock_hinted = self.lock_hinted or act is Act.HINT_LOCK  # the hint: once
            self._note(NOTES[act])
        elif act is Act.CANCEL and card is not None:
            self.draft = None
            self.say(self.style.dim(f"  cancelled: {_shown(card['id'])} not answered"))
        elif act in (Act.ASK_APPROVE, Act.ASK_DENY) and card is not None:
            verb = "approve" if act is Act.ASK_APPROVE else "deny"
            self.end_line()
            self.write(
                self.style.warn(
                    f"{verb} {_shown(card['id'])}? press Enter to confirm, "
                    "Esc/any other key to cancel "
                )
            )
        elif act is Act.DETAILS and card is not None:
            self.say("\n" + self._draw(card, details=True))
            self._ask()
        elif act in (Act.APPROVE, Act.DENY) and card is not None:
            self._answer(card, act is Act.APPROVE)
        elif act in (Act.SHOW_ACTIVITY, Act.SHOW_SESSIONS):
            self._rows(act is Act.SHOW_ACTIVITY)
        elif card is not None:
            self._grant_step(act, card)
        return None

    def _rows(self, activity: bool) -> None:
        """The rows `bastion audit activity` (the last few) or `bastion sessions` print,
        at this width, under the status line or the question, which comes back."""
        self.end_line()
        width = self._width()
        try:
            if activity:  # the gateway decrypts the journal for it: a long one takes a while
                last = call(
                    self.path, "audit", timeout=VIEW_TIMEOUT, view="activity", last=ROWS_SHOWN
                )
                rows = activity_rows(last or [], width)
            else:
                rows = session_rows(call(self.path, "sessions", timeout=VIEW_TIMEOUT), width)
        except (OperatorError, OSError) as exc:
            rows = [f"not available: {_shown(exc)}"]
        title = f"last {ROWS_SHOWN} requests:" if activity else "live sessions:"
        self.say(self.style.dim(title))
        for row in rows or ["(none)"]:
            self.say("  " + row if cells(row) < width - 2 else row)
        self.stale = True
        self._ask()

    def _grant_step(self, act: Act, card: dict[str, Any]) -> None:
        """One step of widening a yes to a bounded grant (`promptkeys`, `core/grants`)."""
        cid = _shown(card["id"])
        if act is Act.ASK_GRANT:
            if not card.get("grantable") or card.get("argv") is None:
                self.mode = Mode.IDLE
                self._note(
                    f"{cid}: this yes cannot be widened to a grant (the account's `grants` is "
                    "off, or the command is shell source, a file, or runs with a terminal)"
                )
                return
            self.draft = GrantDraft(tuple(card["argv"]))
            self.tell(
                f"grant on {cid}: a digit widens that word to * (again: back), Enter when "
                "done; any other key cancels. A * never matches a word that begins with -: "
                "options stay as spelled",
                self.style.warn,
            )
            for i, word in enumerate(card["argv"][1:10], 1):
                fixed = self.draft.why_not(str(i)) is not None
                kept = self.style.dim("  (an option: stays as spelled)") if fixed else ""
                self.say(f"  {i}  {_shown(word)}{kept}")
        elif act is Act.GRANT_WORD and self.draft is not None:
            toggled = self.draft.toggled(self.key)
            if toggled is None:
                self.tell(f"  {_shown(self.draft.why_not(self.key) or '')}", self.style.dim)
            self.draft = toggled or self.draft
        elif act is Act.ASK_BOUND and self.draft is not None:
            self.tell(f"  for: {BOUND_CHOICES} -- a digit", self.style.warn)
            return
        elif act is Act.GRANT_BOUND and self.draft is not None:
            self.draft = self.draft.bounded(self.key)
            assert self.draft.bound is not None
            self.end_line()
            self.write(
                self.style.warn(
                    f"approve {cid} and grant `{_shown(self.draft.pattern())}` for "
                    f"{bound_text(self.draft.bound)} (this run's or process's commands only; "
                    "it ends with its session)? press Enter to confirm, any other key to "
                    "cancel "
                )
            )
            return
        elif act is Act.APPROVE_GRANT and self.draft is not None:
            self._answer(card, True, self.draft.request())
            return
        if self.draft is not None:
            self.say(f"  pattern: {self.style.bold(_shown(self.draft.pattern()))}")

    def _answer(
        self, card: dict[str, Any], approve: bool, grant: dict[str, object] | None = None
    ) -> None:
        self.end_line()
        self.draft = None
        try:
            extra = {"grant": grant} if grant is not None else {}
            reply = call(self.path, "answer", card=card["id"], approve=approve, **extra)
            made = (reply or {}).get("grant") if isinstance(reply, dict) else None
            if made:
                left = made.get("uses_left")
                self.say(
                    self.style.good(
                        f"approved, with grant {_shown(made.get('id'))}: "
                        f"{_shown(made.get('pattern'))}"
                        + (f", {left} use(s)" if left is not None else "")
                    )
                )
            else:
                self.say(self.style.good("approved") if approve else self.style.bad("denied"))
        except OperatorError as exc:
            self.say(self.style.bad(f"not applied: {_shown(exc)}"))
            # a grant refused, or a yes to a presence card (approved in the console only),
            # leaves the card open: ask again
            if grant is not None or (approve and card.get("presence")):
                self._ask()
                return
        self.cards.pop(card["id"], None)
        self.current = None
        self._changed()
        self._show_next()

    def _lock(self) -> None:
        """The `lock` request `bastion lock` sends: every approval ends at once."""
        self.end_line()
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
    """Run the prompt on this terminal: cbreak mode (a key arrives when pressed; the
    prompt asks for Enter itself), pastes marked by the terminal, a redraw on resize."""
    infd = sys.stdin.fileno()
    is_tty = os.isatty(infd)
    terminal = is_tty and sys.stdout.isatty()
    alerts = Alerts(bell=True, desktop=notify, with_command=notify_command)
    notifier = Notifier.find() if notify else Notifier(None)
    if not is_tty:
        return Prompt(path, infd, sys.stdout, Style(terminal), terminal, alerts, notifier).run()

    resized, poke = os.pipe()
    os.set_blocking(resized, False)
    os.set_blocking(poke, False)

    def on_resize(_signum: int, _frame: object) -> None:
        with contextlib.suppress(OSError):  # a full pipe already says "resized"
            os.write(poke, b"w")

    prompt = Prompt(path, infd, sys.stdout, Style(terminal), terminal, alerts, notifier, resized)
    saved = termios.tcgetattr(infd)
    before = signal.signal(signal.SIGWINCH, on_resize)
    try:
        tty.setcbreak(infd)
        if terminal:
            prompt.write(PASTE_ON)  # the terminal marks what is pasted: it is discarded
        return prompt.run()
    except KeyboardInterrupt:
        return 130
    finally:
        if terminal:
            prompt.write(PASTE_OFF)
        termios.tcsetattr(infd, termios.TCSADRAIN, saved)
        signal.signal(signal.SIGWINCH, before)
        os.close(resized)
        os.close(poke)
