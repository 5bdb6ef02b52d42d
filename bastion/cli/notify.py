"""How `bastion approve` gets a person's attention when a card arrives.

Two signals: the terminal bell (the prompt writes it, only on a terminal) and,
where `notify-send` exists, a desktop notification. The notification names
the account, the host, the run (its label) and the asking program -- never the
command text unless
the operator asked for it (`bastion approve --notify-command`): a desktop
notification shows on a screen others may see, stays in a history and may be
mirrored to a phone, and a command can carry a secret. Nor does it carry an
action (no `--action` button): a card is answered in `bastion approve` only,
where the guard time and the confirmation apply.

`notify-send` runs beside the prompt, never in its way: started without
waiting, killed if it hangs (no session bus, a stuck notification daemon),
and any failure is silent -- the card is on the terminal either way.
"""

from __future__ import annotations

import html
import os
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass
from typing import Any

from bastion.core.display import escape_text

BELL = "\a"
NOTIFY_PROGRAM = "notify-send"
NOTIFY_TIMEOUT = 5.0  # seconds a notify-send may run before it is killed
CLOSE_GRACE = 0.5  # seconds, in all, that quitting waits for notify-send runs to end
MAX_RUNNING = 4  # notify-send processes at once; more cards in a burst go unnotified
COMMAND_SHOWN = 200  # characters of the command a notification shows, when asked


@dataclass(frozen=True)
class Alerts:
    """What `bastion approve` does when a card arrives, as the operator chose."""

    bell: bool = True
    desktop: bool = True
    with_command: bool = False


@dataclass(frozen=True)
class Notification:
    summary: str
    body: str


def _plain(value: object) -> str:
    """Shown text: control and invisible characters escaped, as on a card."""
    return escape_text(str(value))


def _markup_safe(text: str) -> str:
    """Notification bodies may be read as markup (`<b>`, `<a href>`) by the
    notification daemon: what an agent chose (its executable's name, its
    command) is shown as text, never as markup."""
    return html.escape(text, quote=False)


def command_text(card: dict[str, Any]) -> str:
    """The command as one line: the argv re-quoted, or the escaped shell source."""
    argv = card.get("argv")
    text = shlex.join(_plain(w) for w in argv) if argv is not None else _plain(card["command"])
    return text if len(text) <= COMMAND_SHOWN else text[:COMMAND_SHOWN] + "..."


def notification_for(card: dict[str, Any], with_command: bool = False) -> Notification:
    """The desktop notification for a card: who asks, for which account and host."""
    s = card.get("subject") or {}
    exe = _plain(os.path.basename(str(s.get("exe", ""))) or "?")
    what = "a command" if card.get("kind") == "command" else "a session"
    if card.get("file"):
        what = "a file change"
    run = s.get("run_info")
    who = f"{exe} (pid {_plain(s.get('pid'))})"
    if isinstance(run, dict):  # the label its start gave: a claim, shown as one
        who = f'run "{_plain(run.get("label", ""))}": {who}'
    lines = [f"{who} asks for {what}; answer in bastion approve"]
    if with_command and card.get("command") is not None:
        lines.append(f"command: {command_text(card)}")
    return Notification(
        summary=f"bastion: card for {_plain(card['user'])}@{_plain(card['host'])}",
        body="\n".join(_markup_safe(line) for line in lines),
    )


class Notifier:
    """Runs `notify-send` without waiting for it, and keeps the runs bounded."""

    def __init__(self, program: str | None) -> None:
        self.program = program
        self.running: list[tuple[subprocess.Popen[bytes], float]] = []

    @classmethod
    def find(cls) -> Notifier:
        """The notifier this session has: `notify-send` from PATH, or none."""
        return cls(shutil.which(NOTIFY_PROGRAM))

    def send(self, note: Notification) -> None:
        self.reap()
        if self.program is None or len(self.running) >= MAX_RUNNING:
            return
        try:
            proc = subprocess.Popen(
                [self.program, "--app-name=bastion", note.summary, note.body],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # a ^C at the prompt is not its business
            )
        except OSError:
            return
        self.running.append((proc, time.monotonic() + NOTIFY_TIMEOUT))

    def reap(self) -> None:
        """Forget the runs that ended; kill the ones past their time."""
        now = time.monotonic()
        alive = []
        for proc, deadline in self.running:
            if proc.poll() is not None:
                continue
            if now >= deadline:
                proc.kill()
                proc.wait()
                continue
            alive.append((proc, deadline))
        self.running = alive

    def close(self) -> None:
        """The prompt is ending: a moment for runs still delivering, then kill them
        (quitting must not wait on a stuck notification daemon)."""
        until = time.monotonic() + CLOSE_GRACE
        for proc, _ in self.running:
            try:
                proc.wait(max(0.0, until - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.running = []
