"""How the gateway's log is written: every line through the one escaping function.

The log goes to the gateway's stderr, often the very terminal where the
operator runs `bastion approve` (`bastion daemon &`), and its records carry
what agents chose: the proxy header's host and user, executable paths, labels,
exception messages. So escaping is not left to each log call. `setup` installs
one handler whose `Formatter` writes every physical line as `bastion[PID]: `
followed by text that went through `core.display.escape_text`:

* a record's message, after %-formatting, is one line: a newline in it is
  escaped like any control, so an agent cannot start a line of its own;
* a traceback or stack follows it, each of its lines escaped and indented
  under the same prefix, so a line inside it cannot pass for a record.

`setup` also routes what would reach stderr past logging -- an uncaught
exception in the main thread or another thread, an exception ignored in a
destructor, a warning -- through the same handler.
"""

from __future__ import annotations

import logging
import sys
import threading
import types
from typing import Any

from bastion.core.display import escape_text

log = logging.getLogger(__name__)


class EscapingFormatter(logging.Formatter):
    """`bastion[PID]: MESSAGE`, then `bastion[PID]:   TRACEBACK LINE` per line; all escaped."""

    def format(self, record: logging.LogRecord) -> str:
        lines = [record.getMessage()]
        if record.exc_info:
            lines += _indented(self.formatException(record.exc_info))
        elif record.exc_text:
            lines += _indented(record.exc_text)
        if record.stack_info:
            lines += _indented(self.formatStack(record.stack_info))
        head = f"bastion[{record.process}]: "
        return "\n".join(head + escape_text(line) for line in lines)


def _indented(text: str) -> list[str]:
    """A traceback's lines, split at newlines only (a CR in it is escaped, not obeyed)."""
    return ["  " + line for line in text.rstrip("\n").split("\n")]


def handler(stream: Any = None) -> logging.Handler:
    """A stream handler (stderr by default) that writes only escaped lines."""
    out = logging.StreamHandler(stream)
    out.setFormatter(EscapingFormatter())
    return out


def _uncaught(
    kind: type[BaseException], exc: BaseException, tb: types.TracebackType | None
) -> None:
    log.critical("uncaught exception", exc_info=(kind, exc, tb))


def _uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else "?"
    log.error(
        "uncaught exception in thread %s",
        name,
        exc_info=(args.exc_type, args.exc_value or args.exc_type(), args.exc_traceback),
    )


def _unraisable(u: Any) -> None:
    log.error(
        "%s: %r",
        u.err_msg or "Exception ignored in",
        u.object,
        exc_info=(u.exc_type, u.exc_value, u.exc_traceback) if u.exc_type else None,
    )


def setup(level: int = logging.INFO) -> None:
    """The gateway's logging: the root logger at `level`, one escaping handler on
    stderr, and every other way text reaches stderr from Python routed to it."""
    logging.basicConfig(level=level, handlers=[handler()], force=True)
    logging.captureWarnings(True)
    sys.excepthook = _uncaught
    threading.excepthook = _uncaught_in_thread
    sys.unraisablehook = _unraisable
