"""What `bastion approve` puts in its status line and in a desktop notification:
pure functions of the gateway's replies (bastion/cli/statusline.py, notify.py)."""

from __future__ import annotations

from typing import Any

from bastion.cli.notify import COMMAND_SHOWN, notification_for
from bastion.cli.statusline import status_line, witness_part


def status(**over: Any) -> dict[str, Any]:
    return {"locked": False, "sessions": 2, "pending": 1, "witness": None, **over}


def card(**over: Any) -> dict[str, Any]:
    return {
        "id": "cc_1",
        "kind": "command",
        "user": "deploy",
        "host": "web1",
        "command": "systemctl restart app",
        "argv": ["systemctl", "restart", "app"],
        "subject": {"pid": 4242, "exe": "/usr/bin/python3.11"},
        **over,
    }


def test_the_status_line_says_vault_sessions_pending_and_witness() -> None:
    assert status_line(status(), 200) == (
        "vault unlocked | sessions 2 | pending 1 | witness none | L lock, q quit, a activity, "
        "s sessions"
    )
    assert "| witness none | L lock, q quit" in status_line(status(), 80)
    assert status_line(status(locked=True, sessions=0)).startswith("vault locked | sessions 0 |")
    assert status_line(None).startswith("gateway status not available")


def test_witness_lag_and_trouble_are_named() -> None:
    w = {"waiting": 0, "oldest_age": None, "targets": {}}
    assert witness_part(w) == "witness 0 behind"
    w = {"waiting": 12, "oldest_age": 31.6, "targets": {"syslog": {"failing": True}}}
    assert witness_part(w) == "witness FAILING: 12 behind, oldest 32 s"
    w = {"waiting": 500, "oldest_age": 90.0, "full": True, "refusing": True, "targets": {}}
    assert witness_part(w) == "witness REFUSING NEW WORK: 500 behind, oldest 90 s"


def test_the_status_line_never_wraps() -> None:
    line = status_line(status(witness={"waiting": 3, "oldest_age": 4.0, "targets": {}}), 30)
    assert len(line) == 29 and line.endswith("...")


def test_a_notification_names_account_host_and_program_never_the_command() -> None:
    note = notification_for(card())
    assert note.summary == "bastion: card for deploy@web1"
    assert note.body == "python3.11 (pid 4242) asks for a command; answer in bastion approve"
    assert "systemctl" not in note.summary + note.body


def test_a_notification_names_the_run_and_carries_no_action() -> None:
    run = {"pid": 9, "exe": "/usr/bin/python3", "run_info": {"label": "fix <db>", "given": []}}
    note = notification_for(card(subject=run))
    assert note.body.startswith('run "fix &lt;db&gt;": python3 (pid 9) asks for a command;')
    file = notification_for(card(command=None, argv=None, file={"op": "write"}))
    assert "asks for a file change" in file.body


def test_notify_send_is_given_no_action(monkeypatch: Any) -> None:
    """A notification is a signal, not a door: no `--action` that could answer a card."""
    import subprocess

    from bastion.cli.notify import Notifier

    argvs: list[list[str]] = []

    class Fake:
        def __init__(self, argv: list[str], **_: Any) -> None:
            argvs.append(argv)

        def poll(self) -> int:
            return 0

    monkeypatch.setattr(subprocess, "Popen", Fake)
    Notifier("/usr/bin/notify-send").send(notification_for(card()))
    assert argvs and not any(w.startswith(("--action", "-A")) for w in argvs[0])


def test_the_command_only_when_asked_as_text_not_markup() -> None:
    note = notification_for(card(), with_command=True)
    assert note.body.endswith("\ncommand: systemctl restart app")
    shell = card(argv=None, command="echo <b>hi</b> && id")
    assert notification_for(shell, True).body.endswith(
        "command: echo &lt;b&gt;hi&lt;/b&gt; &amp;&amp; id"
    )
    long = card(argv=["echo", "x" * 1000])
    assert len(notification_for(long, True).body.split("command: ")[1]) == COMMAND_SHOWN + 3


def test_what_the_agent_chose_is_escaped() -> None:
    odd = card(
        kind="session",
        command=None,
        argv=None,
        user="de\x1b[31mploy",
        subject={"pid": 7, "exe": "/tmp/x/<i>evil\u202e"},
    )
    note = notification_for(odd, with_command=True)
    assert "\x1b" not in note.summary and "\u202e" not in note.body
    assert "<i>" not in note.body and "&lt;i&gt;" in note.body
    assert "command:" not in note.body  # a session card has none to show
