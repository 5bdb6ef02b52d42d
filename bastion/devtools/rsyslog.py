"""A private rsyslogd for tests and development: a real syslog collector to witness to.

It runs the distribution's ``rsyslogd`` in the foreground (``-n``) with a config
of its own, a pid file and a work directory of its own under ``root``, and
writes every message it receives to ``root/messages.log`` with rsyslog's
default file template. It listens on loopback TCP (imtcp, RFC 6587 framing) and
on a unix datagram socket (imuxsock) at ``root/sock/log``; it never touches the
system's ``/dev/log`` (``SysSock.Use="off"``), its pid file or its spool, so a
system rsyslog, if any, is not disturbed. ``stop`` then ``start`` brings it back
on the same port, as a collector restarted by its operator would be.

Standard library only, like the sshd fixture: a development tool, outside
bastion's trust path.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from bastion.core.errors import BastionError
from bastion.devtools.sshd_setup import LOOPBACK, free_port

RSYSLOGD_ENV = "BASTION_RSYSLOGD"  # another rsyslogd binary than the one on PATH
START_TIMEOUT = 15.0
STOP_TIMEOUT = 10.0
_PORT_ATTEMPTS = 5

CONFIG = """\
global(workDirectory="{work}" maxMessageSize="64k")
module(load="imtcp")
module(load="imuxsock" SysSock.Use="off")
input(type="imtcp" port="{port}" address="{address}")
input(type="imuxsock" Socket="{socket}" CreatePath="on" UseSpecialParser="off")
action(type="omfile" file="{output}")
"""


class RsyslogError(BastionError, RuntimeError):
    """rsyslogd could not be started as asked; the message carries its own words."""


def rsyslogd_path() -> str | None:
    override = os.environ.get(RSYSLOGD_ENV)
    if override:
        return override if os.access(override, os.X_OK) else None
    return shutil.which("rsyslogd") or shutil.which("rsyslogd", path="/usr/sbin:/sbin")


def rsyslog_available() -> str | None:
    """None when a private rsyslogd can run here, else why not (a skip reason)."""
    if rsyslogd_path() is None:
        if os.environ.get(RSYSLOGD_ENV):
            return f"${RSYSLOGD_ENV} ({os.environ[RSYSLOGD_ENV]}) is not an executable"
        return "rsyslogd is not installed (apt-get install -y rsyslog)"
    return None


class Rsyslog:
    """One private rsyslogd. Use as a context manager, or `start()` / `stop()`."""

    def __init__(self, root: Path, port: int | None = None) -> None:
        self.root = root
        self.port = port  # chosen at the first start, kept across restarts
        self.output = root / "messages.log"
        self.socket = root / "sock" / "log"
        self.conf = root / "rsyslog.conf"
        self.pidfile = root / "rsyslogd.pid"
        self.log = root / "rsyslogd.stderr"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def tcp(self) -> str:
        """The address bastion.toml's `syslog` takes for TCP."""
        return f"tcp://{LOOPBACK}:{self.port}"

    @property
    def unix(self) -> str:
        """The address bastion.toml's `syslog` takes for the unix socket."""
        return f"unix:{self.socket}"

    def start(self) -> Rsyslog:
        binary = rsyslogd_path()
        if binary is None:
            raise RsyslogError("rsyslogd is not installed")
        (self.root / "work").mkdir(parents=True, exist_ok=True)
        fixed = self.port is not None
        for _ in range(1 if fixed else _PORT_ATTEMPTS):
            port = self.port if fixed else free_port(LOOPBACK)
            self._write_config(port)
            with open(self.log, "ab") as err:
                self.proc = subprocess.Popen(
                    [binary, "-n", "-f", str(self.conf), "-i", str(self.pidfile)],
                    stdin=subprocess.DEVNULL,
                    stdout=err,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            if self._ready(port):
                self.port = port
                return self
            self._end()
        raise RsyslogError(f"rsyslogd did not start: {self._tail()}")

    def _write_config(self, port: int | None) -> None:
        self.conf.write_text(
            CONFIG.format(
                work=self.root / "work",
                port=port,
                address=LOOPBACK,
                socket=self.socket,
                output=self.output,
            )
        )

    def _ready(self, port: int | None) -> bool:
        """True once a probe sent over TCP is in the output file: the port is ours and
        rsyslogd writes what it receives."""
        assert self.proc is not None and port is not None
        token = f"rsyslog-fixture-ready-{secrets.token_hex(6)}"
        message = f"<14>1 - - rsyslog-fixture - - - {token}".encode()
        deadline = time.monotonic() + START_TIMEOUT
        sent = False
        while time.monotonic() < deadline and self.proc.poll() is None:
            if not sent:
                with contextlib.suppress(OSError):
                    with socket.create_connection((LOOPBACK, port), timeout=1) as sock:
                        sock.sendall(b"%d %s" % (len(message), message))
                    sent = True
            if sent and token in self.text() and self.socket.exists():
                return True
            time.sleep(0.05)
        return False

    def text(self) -> str:
        """Everything rsyslogd has written so far."""
        try:
            return self.output.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def wait_for(self, predicate: Callable[[str], object], timeout: float = 30.0) -> str:
        """Poll the output until `predicate(text)` holds; returns the text."""
        deadline = time.monotonic() + timeout
        while True:
            text = self.text()
            if predicate(text):
                return text
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"rsyslog output never satisfied the condition:\n{text[-2000:]}"
                )
            time.sleep(0.05)

    def stop(self) -> None:
        """SIGTERM (rsyslogd flushes and exits), SIGKILL after a bound."""
        self._end()

    def _end(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_TIMEOUT)

    def _tail(self) -> str:
        try:
            return " | ".join(self.log.read_text(errors="replace").strip().splitlines()[-10:])
        except FileNotFoundError:
            return "(no output)"

    def __enter__(self) -> Rsyslog:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
