"""A throwaway OpenSSH server on a loopback port, for tests and ``bastion demo``.

The bastion is only as trustworthy as its behaviour against a *real* sshd, so tests run
the distribution's ``/usr/sbin/sshd`` directly (CI has no Docker engine) with the config
in ``fixtures/sshd/sshd_config.template``; the container tier runs the same template in
the image ``fixtures/sshd/Dockerfile`` builds.

This module is deliberately self-contained (stdlib + psutil, no pytest, no imports from
the test suite or the product): it is a development tool shipped for the demo, outside
bastion's trust path. Its helpers are in ``sshd_setup.py``.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from string import Template
from types import TracebackType

import psutil

from bastion.devtools.sshd_setup import (
    LOOPBACK,
    STOP_TIMEOUT,
    TEMPLATE_ENV,
    SshdError,
    check_config,
    check_key_line,
    check_path,
    check_principals,
    current_user,
    end_processes,
    ensure_privsep_dir,
    file_lines,
    find_template,
    make_host_key,
    public_key,
    render_config,
    replace_private,
    sshd_available,
    tagged_processes,
    wait_listening,
    wait_status,
    write_principals,
    write_private,
)
from bastion.devtools.sshd_setup import free_port as _free_port  # tests replace it

__all__ = [
    "SESSION_TAG_ENV",
    "TEMPLATE_ENV",
    "Sshd",
    "SshdError",
    "SshdInfo",
    "find_template",
    "login_certificates",
    "sshd_available",
]

#: Set in every session's environment (sshd_config SetEnv) to the owning fixture's id.
SESSION_TAG_ENV = "BASTION_SSHD_FIXTURE"

_PORT_ATTEMPTS = 5
# sshd (LogLevel VERBOSE) on a certificate login, e.g.
#   Accepted publickey for root from 127.0.0.1 port 50312 ssh2: ED25519-CERT SHA256:...
#   ID req_x (serial 42) CA ED25519 SHA256:...
_CERT_LOGIN = re.compile(
    r"Accepted publickey for \S+ from \S+ port \d+ ssh2: \S+-CERT \S+ "
    r"ID (?P<key_id>.*?) \(serial (?P<serial>\d+)\) CA \S+ \S+"
)


def login_certificates(log_text: str) -> list[tuple[str, int]]:
    """(key id, serial) of each certificate login in an sshd log, oldest first.

    A bastion certificate's key id is the request id, so this is how a test -- or an
    operator reading a target's auth log -- ties a login to `bastion request ID`.
    Logins with a plain key are not listed."""
    return [(m["key_id"], int(m["serial"])) for m in _CERT_LOGIN.finditer(log_text)]


@dataclass(frozen=True)
class SshdInfo:
    """Everything a client (or a bastion policy) needs to reach and pin the server."""

    address: str  # "127.0.0.1"
    port: int
    host_key: str  # "ssh-ed25519 AAAA...", no comment: the form a policy pins
    user: str  # the login user: whoever runs the tests (often root in containers)
    run_dir: Path
    log_path: Path  # sshd's stderr (-e), accumulated across restarts
    authorized_keys: Path

    def known_hosts_line(self) -> str:
        """The known_hosts entry OpenSSH expects for a non-22 port."""
        return f"[{self.address}]:{self.port} {self.host_key}"


class Sshd:
    """A throwaway OpenSSH server on a free loopback port.

    One instance owns one run dir and one host key for its whole life, so ``stop()`` then
    ``start()`` behaves like a rebooted server: same key, same authorized_keys, new port.
    """

    def __init__(
        self,
        run_dir: Path,
        authorized_keys: list[str] | tuple[str, ...] = (),
        sshd_path: str = "/usr/sbin/sshd",
        template: Path | None = None,
        session_home: bool = True,
        *,
        trusted_user_ca_keys: Sequence[str] = (),
        principals: Mapping[str, Sequence[str]] | None = None,
        allow_forwarding: bool = False,
        login_grace_time: int | None = None,
    ) -> None:
        """`session_home`: sessions get an empty HOME of their own, so the target's shell
        reads none of the user's rc files -- on a machine whose ~/.bashrc starts pyenv,
        every command would cost ~150 ms of CPU, and a command killed mid-rc by a test
        leaves pyenv's lock behind, stalling every later shell for a minute.

        `trusted_user_ca_keys`: the lines of the TrustedUserCAKeys file (none: no CA is
        trusted); `trust_user_cas` replaces them while sshd runs. `principals`: login user
        -> the certificate principals it accepts (AuthorizedPrincipalsFile); by default the
        current user accepts its own name. `allow_forwarding`: AllowTcpForwarding and
        AllowStreamLocalForwarding yes, so only a certificate can refuse a forward.
        `login_grace_time`: sshd's LoginGraceTime in seconds (default 120), so a test can
        have the target drop a connection that did not authenticate in time."""
        self.run_dir = Path(run_dir)
        self.session_home = session_home
        self.sshd_path = sshd_path
        self.template = template
        self.config_path = self.run_dir / "sshd_config"
        self.host_key_path = self.run_dir / "ssh_host_ed25519_key"
        self.authorized_keys_path = self.run_dir / "authorized_keys"
        self.trusted_ca_path = self.run_dir / "trusted_user_ca_keys"
        self.principals_dir = self.run_dir / "principals"
        self.allow_forwarding = allow_forwarding
        if login_grace_time is not None and login_grace_time <= 0:
            raise SshdError(f"login_grace_time must be > 0 (0 is no limit), got {login_grace_time}")
        self.login_grace_time = login_grace_time
        self.pid_file = self.run_dir / "sshd.pid"
        self.log_path = self.run_dir / "sshd.log"
        self.fixture_id = f"{os.getpid()}-{secrets.token_hex(8)}"
        self._pending_keys: list[str] = [check_key_line(k) for k in authorized_keys]
        self._ca_text = file_lines(trusted_user_ca_keys, "trusted_user_ca_keys")
        self._principals = check_principals(
            {current_user(): [current_user()]} if principals is None else principals
        )
        self._prepared = False
        self._proc: subprocess.Popen[bytes] | None = None
        self._info: SshdInfo | None = None

    # -- lifecycle -------------------------------------------------------------------

    def start(self, timeout: float = 10.0) -> SshdInfo:
        """Start sshd and return only once it answers with an SSH banner.

        Raises SshdError with sshd's log tail on any failure, so a broken fixture reads as
        a fixture problem rather than a mysterious client-side 255.
        """
        if self.running:
            raise SshdError(f"sshd already running (pid {self.pid})")
        reason = sshd_available(self.sshd_path)
        if reason is not None:
            raise SshdError(reason)
        deadline = time.monotonic() + timeout
        self._prepare()
        template = Template((self.template or find_template()).read_text(encoding="utf-8"))

        last_log = ""
        try:
            for attempt in range(_PORT_ATTEMPTS):
                port = _free_port(LOOPBACK)
                self._write_config(template, port)
                if attempt == 0:
                    check_config(self.sshd_path, self.config_path)
                outcome, last_log = self._launch_and_wait(port, deadline)
                if outcome == "up":
                    self._info = SshdInfo(
                        address=LOOPBACK,
                        port=port,
                        host_key=public_key(self.host_key_path.with_suffix(".pub")),
                        user=current_user(),
                        run_dir=self.run_dir,
                        log_path=self.log_path,
                        authorized_keys=self.authorized_keys_path,
                    )
                    return self._info
                if outcome == "timeout":
                    raise SshdError(
                        f"sshd did not answer an SSH banner on {LOOPBACK}:{port} within "
                        f"{timeout}s; log tail:\n{last_log}"
                    )
                # "bind": the port was taken between _free_port() and sshd's bind(); retry.
        except BaseException:
            # Also on KeyboardInterrupt: never leave a half-started daemon behind.
            self.stop()
            raise
        raise SshdError(
            f"sshd could not bind a free loopback port in {_PORT_ATTEMPTS} attempts; "
            f"log tail:\n{last_log}"
        )

    def stop(self) -> None:
        """Stop the listener and every session it spawned; safe to call repeatedly.

        sshd's listener exits on SIGTERM without touching established sessions, and a
        command whose connection a test cut keeps running as an orphan; either would leak
        into the next test, so both are ended here.
        """
        proc = self._proc
        self._proc = None
        self._info = None
        victims: dict[int, psutil.Process] = {}
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                # Freeze the listener first so it cannot fork a new session between our
                # listing its children and its exit.
                os.kill(proc.pid, signal.SIGSTOP)
                children = psutil.Process(proc.pid).children(recursive=True)
                victims.update((c.pid, c) for c in children)
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
                # A stopped process acts on SIGTERM only once continued; this also covers
                # a fixture left paused by a test.
                os.kill(proc.pid, signal.SIGCONT)
            try:
                proc.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=STOP_TIMEOUT)
        if self._prepared:
            victims.update((v.pid, v) for v in tagged_processes(SESSION_TAG_ENV, self.fixture_id))
        end_processes(list(victims.values()))

    def pause(self) -> None:
        """SIGSTOP the listener: new connections hang in the backlog, sessions carry on.

        Returns once the kernel reports the process stopped, so a test's next step really
        runs against a frozen server.
        """
        pid = self._require_running()
        os.kill(pid, signal.SIGSTOP)
        wait_status(pid, psutil.STATUS_STOPPED, want=True)

    def resume(self) -> None:
        """SIGCONT the listener; connections queued while paused are then served."""
        pid = self._require_running()
        os.kill(pid, signal.SIGCONT)
        wait_status(pid, psutil.STATUS_STOPPED, want=False)

    def __enter__(self) -> Sshd:
        if not self.running:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- state -----------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def info(self) -> SshdInfo:
        if self._info is None or not self.running:
            raise SshdError("sshd is not running; call start() first")
        return self._info

    def authorize(self, public_key_line: str) -> None:
        """Trust another client key. sshd re-reads the file per authentication attempt, so
        this affects new connections only, with no restart needed."""
        line = check_key_line(public_key_line)
        if not self._prepared:
            self._pending_keys.append(line)
            return
        fd = os.open(self.authorized_keys_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with os.fdopen(fd, "a", encoding="utf-8") as f:
            f.write(line + "\n")

    def set_authorized_keys(self, lines: Sequence[str]) -> None:
        """Replace the trusted client keys (none: only certificates log in), atomically;
        like `authorize`, from the next authentication on."""
        keys = [check_key_line(k) for k in file_lines(lines, "authorized_keys").splitlines()]
        if not self._prepared:
            self._pending_keys = keys
            return
        replace_private(self.authorized_keys_path, "".join(k + "\n" for k in keys))

    def trust_user_cas(self, lines: Sequence[str]) -> None:
        """Replace the TrustedUserCAKeys file: CA public key lines, comments allowed (the
        whole `bastion ca public` snippet is such a file). sshd opens it at each
        authentication, so the next login sees the new set with no restart or SIGHUP --
        how a target adds a new CA and retires the old one during a rotation."""
        self._ca_text = file_lines(lines, "trusted_user_ca_keys")
        if self._prepared:
            replace_private(self.trusted_ca_path, self._ca_text)

    def session_pids(self) -> list[int]:
        """Pids of the per-connection sshd processes (direct children of the listener).

        Killing one cuts that connection as a network failure would; the remote command
        lives on as an orphan until stop(), as it would on a real target. For a root login
        this child *is* the session ("sshd: root@notty": OpenSSH skips the post-auth
        privilege drop for uid 0); for other users it is the "[priv]" monitor of one. A
        connection still in pre-auth (even a banner probe) has such a child too.
        """
        pid = self._require_running()
        try:
            children = psutil.Process(pid).children(recursive=False)
        except psutil.NoSuchProcess:
            return []
        return [c.pid for c in sorted(children, key=lambda c: (c.create_time(), c.pid))]

    def log_text(self) -> str:
        """sshd's log so far: tests grep it for what the bastion did or did not request."""
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    # -- internals -------------------------------------------------------------------

    def _require_running(self) -> int:
        if self._proc is None or self._proc.poll() is not None:
            raise SshdError("sshd is not running")
        return self._proc.pid

    def _prepare(self) -> None:
        """One-time per instance: fresh host key, initial authorized_keys, privsep dir."""
        ensure_privsep_dir()
        if self._prepared:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for path in (self.run_dir, self.host_key_path, self.authorized_keys_path):
            check_path(path)  # the CA file and principals dir are fixed names in run_dir
        make_host_key(self.host_key_path)
        write_private(self.authorized_keys_path, "".join(k + "\n" for k in self._pending_keys))
        self._pending_keys.clear()
        write_private(self.trusted_ca_path, self._ca_text)
        write_principals(self.principals_dir, self._principals)
        self._prepared = True

    def _write_config(self, template: Template, port: int) -> None:
        text = render_config(
            template,
            listen_address=LOOPBACK,
            port=port,
            host_key=self.host_key_path,
            authorized_keys=self.authorized_keys_path,
            pid_file=self.pid_file,
            run_dir=self.run_dir,
            user=current_user(),
            fixture_id=self.fixture_id,
            trusted_user_ca_keys=self.trusted_ca_path,
            principals_dir=self.principals_dir,
            allow_tcp_forwarding="yes" if self.allow_forwarding else "no",
        )
        tag = f"SetEnv {SESSION_TAG_ENV}={self.fixture_id}"
        if self.session_home and tag in text:
            home = self.run_dir / "session-home"
            home.mkdir(mode=0o700, exist_ok=True)
            text = text.replace(tag, f'{tag} "HOME={home}"')  # quoted: a path may hold spaces
        if self.login_grace_time is not None:  # the template leaves it at sshd's default
            text += f"\nLoginGraceTime {int(self.login_grace_time)}\n"
        self.config_path.write_text(text, encoding="utf-8")

    def _launch_and_wait(self, port: int, deadline: float) -> tuple[str, str]:
        """Run sshd and poll until it is up, dead, or out of time.

        Returns ("up" | "bind" | "timeout", log tail of this attempt).
        """
        with open(self.log_path, "ab") as log:
            offset = log.tell()
            argv = [self.sshd_path, "-D", "-e", "-f", str(self.config_path)]
            log.write(f"--- bastion fixture: {' '.join(argv)} (port {port})\n".encode())
            log.flush()
            proc = self._proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log
            )
        outcome, tail = wait_listening(proc, self.log_path, offset, port, deadline)
        if outcome in ("bind", "exited"):
            self._proc = None
        if outcome == "exited":
            raise SshdError(f"sshd exited with {proc.returncode} on startup; log tail:\n{tail}")
        return outcome, tail
