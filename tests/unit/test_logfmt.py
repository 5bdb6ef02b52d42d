"""Every line of the gateway's log goes through the one escaping function (issue 18).

The formatter, on records built as the gateway's log calls build them; and
`setup` in a fresh interpreter, for what reaches stderr without a log call (an
uncaught exception in the main thread or another one, a warning)."""

from __future__ import annotations

import logging
import re
import subprocess
import sys

from bastion.gateway.logfmt import EscapingFormatter

HOSTILE = "\r\x1b[2K\x1b[3Acommand:  uptime\n\u3164\u202e"
SHOWN = "\\x0d\\x1b[2K\\x1b[3Acommand:  uptime\\x0a\\u3164\\u202e"
LINE = re.compile(r"bastion\[\d+\]: (?:  )?[ -~]*")  # the prefix, then printable ASCII only


def record(msg: str, *args: object, exc: BaseException | None = None) -> logging.LogRecord:
    info = (type(exc), exc, exc.__traceback__) if exc is not None else None
    return logging.LogRecord("bastion", logging.INFO, __file__, 1, msg, args, info)


def test_what_an_agent_chose_is_escaped_after_formatting() -> None:
    line = EscapingFormatter().format(
        record("%s: exec request for %s@%s (%s)", "req_1", HOSTILE, "web1", "/tmp/x")
    )
    assert line.endswith(f"req_1: exec request for {SHOWN}@web1 (/tmp/x)")
    assert LINE.fullmatch(line)


def test_a_message_is_one_line_whatever_it_holds() -> None:
    forged = "ok\nbastion[1]: req_2: card cc_1 approved by operator"
    line = EscapingFormatter().format(record("%s", forged))
    assert "\n" not in line and "\\x0abastion[1]: req_2" in line


def test_a_traceback_is_escaped_and_indented_under_the_prefix() -> None:
    try:
        raise ValueError(f"bad header\nbastion[1]: forged {HOSTILE}")
    except ValueError as exc:
        text = EscapingFormatter().format(record("%s: internal error", "req_3", exc=exc))
    lines = text.split("\n")
    assert lines[0].endswith("req_3: internal error")
    assert all(LINE.fullmatch(line) for line in lines), text
    assert all(line.split(": ", 1)[1].startswith("  ") for line in lines[1:])
    assert any("Traceback (most recent call last):" in line for line in lines)
    # Its own newline starts a line of the traceback, under the prefix, indented.
    assert "]:   bastion[1]: forged \\x0d\\x1b[2K\\x1b[3Acommand:  uptime\n" in text
    assert lines[-1].endswith("]:   \\u3164\\u202e")


SCRIPT = """
import logging, threading, warnings
from bastion.gateway import logfmt
logfmt.setup()
hostile = "\\x1b[2J\\u3164"
logging.getLogger("asyncssh").warning("a library: %s", hostile)
warnings.warn("a warning: " + hostile)
t = threading.Thread(target=lambda: exec("raise ValueError(hostile)", {"hostile": hostile}))
t.start(); t.join()
raise RuntimeError("at the top: " + hostile)
"""


def test_setup_routes_every_way_to_stderr_through_the_formatter() -> None:
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, timeout=60)
    err = r.stderr.decode()
    assert r.returncode == 1
    assert "\x1b" not in err and "\u3164" not in err, err
    assert all(LINE.fullmatch(line) for line in err.splitlines()), err
    for said in ("a library: ", "a warning: ", "ValueError: ", "RuntimeError: at the top: "):
        assert said + "\\x1b[2J\\u3164" in err, err
