"""A throwaway OpenSSH server on a loopback port, for tests and ``bastion demo``.

The bastion is only as trustworthy as its behaviour against a *real* sshd, so tests run
the distribution's ``/usr/sbin/sshd`` directly (CI has no Docker engine) with the config
in ``fixtures/sshd/sshd_config.template``.

This module is deliberately self-contained (stdlib + psutil, no pytest, no imports from
the test suite or the product) so it can be moved into the ``bastion`` package unchanged.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from string import Template
from types import TracebackType

import psutil

__all__ = [
    "SESSION_TAG_ENV",
    "TEMPLATE_ENV",
    "Sshd",
    "SshdError",
    "SshdInfo",
    "find_template",
    "sshd_available",
]

#: Overrides the template location, e.g. when this module runs from an installed package
#: that does not ship the fixtures directory.
TEMPLATE_ENV = "BASTION_SSHD_TEMPLATE"

LOOPBACK = "127.0.0.1"

# Debian's compile-time privilege separation directory. sshd refuses to start as root
# without it, and minimal containers never ran the init script that creates it.
PRIVSEP_DIR = Path("/run/sshd")
PRIVSEP_USER = "sshd"

#: Set in every session's environment (sshd_config SetEnv) to the owning fixture's id.
SESSION_TAG_ENV = "BASTION_SSHD_FIXTURE"

_TEMPLATE_NAME = "sshd_config.template"
_PORT_ATTEMPTS = 5
# What sshd prints when the port we picked was taken between our probe and its bind().
_BIND_FAILURE_MARKERS = ("Bind to port", "Cannot bind any address", "Address already in use")
# Bounds for the helper commands; none of them should take more than a fraction of this.
_TOOL_TIMEOUT = 30.0
_STOP_TIMEOUT = 5.0
_POLL_INTERVAL = 0.02
_LOG_TAIL_LINES = 40
# Characters that would break a double-quoted sshd_config argument or be expanded as an
# sshd token (%h, %u, ...) inside AuthorizedKeysFile.
_UNSAFE_PATH_CHARS = ('"', "%", "\n", "\r")


def _gone(proc: psutil.Process) -> bool:
    # A zombie has exited; only its reaping is pending, and orphans are reaped by init,
    # which in some sandboxes (this one's pid 1) takes a second or two.
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _end_processes(procs: list[psutil.Process]) -> None:
    """SIGTERM (and SIGCONT, in case a test stopped them), then SIGKILL what is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(sig)
                proc.resume()
        deadline = time.monotonic() + _STOP_TIMEOUT
        while procs and time.monotonic() < deadline:
            procs = [p for p in procs if not _gone(p)]
            if procs:
                time.sleep(_POLL_INTERVAL)
        if not procs:
            return


class SshdError(RuntimeError):
    """sshd could not be prepared or started; the message carries sshd's own words."""


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


def find_template() -> Path:
    """Locate the sshd_config template.

    The env var wins so an installed copy of this module (``bastion demo``) can be pointed
    at a checkout; then a copy next to this file (how it would be shipped as package
    data); then ``../fixtures/sshd`` relative to this file, which holds both for
    ``tests/`` and for ``bastion/`` in a source checkout.
    """
    override = os.environ.get(TEMPLATE_ENV)
    if override:
        path = Path(override).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"{TEMPLATE_ENV}={override!r} is not a file")
        return path
    here = Path(__file__).resolve().parent
    candidates = [here / _TEMPLATE_NAME, here.parent / "fixtures" / "sshd" / _TEMPLATE_NAME]
    for path in candidates:
        if path.is_file():
            return path
    tried = ", ".join(str(p) for p in candidates)
    raise FileNotFoundError(f"sshd config template not found (tried {tried}); set {TEMPLATE_ENV}")


def sshd_available(sshd_path: str = "/usr/sbin/sshd") -> str | None:
    """Say why a fixture sshd cannot run here, or None if it can.

    Meant for ``pytest.skip(reason)``: the reason names the fix, not just the symptom.
    """
    if not os.path.isabs(sshd_path):
        return f"sshd must be given by absolute path (it re-executes itself): {sshd_path!r}"
    if not os.path.exists(sshd_path):
        return "openssh-server is not installed: apt-get install -y openssh-server"
    if not os.access(sshd_path, os.X_OK):
        return f"{sshd_path} is not executable by this user"
    if shutil.which("ssh-keygen") is None:
        return "ssh-keygen is not installed: apt-get install -y openssh-client"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(PRIVSEP_USER)
        except KeyError:
            return (
                f"privilege separation user {PRIVSEP_USER!r} is missing "
                "(reinstall openssh-server, or: useradd -r -d /run/sshd -s /usr/sbin/nologin sshd)"
            )
        if not PRIVSEP_DIR.is_dir() and not os.access(PRIVSEP_DIR.parent, os.W_OK):
            return f"{PRIVSEP_DIR} is missing and {PRIVSEP_DIR.parent} is not writable"
    return None


def _current_user() -> str:
    # The passwd entry, not $USER: containers and sudo often leave $USER unset or stale,
    # and sshd authenticates against the passwd name.
    return pwd.getpwuid(os.geteuid()).pw_name


def _free_port(address: str) -> int:
    """A port that was free a moment ago; sshd's bind() is the real test, hence retries."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        return int(sock.getsockname()[1])


def _answers_banner(address: str, port: int, timeout: float) -> bool:
    """True once sshd accepts a connection *and* speaks SSH.

    An open port alone is not enough: the kernel accepts into the backlog before sshd is
    ready, and a stale listener on the same port would fool a plain connect().
    """
    try:
        with socket.create_connection((address, port), timeout=timeout) as sock:
            data = b""
            while b"\n" not in data and len(data) < 256:
                chunk = sock.recv(256)
                if not chunk:
                    break
                data += chunk
    except OSError:
        return False
    return data.startswith(b"SSH-2.0-")


def _check_path(path: Path) -> None:
    text = str(path)
    bad = [c for c in _UNSAFE_PATH_CHARS if c in text]
    if bad:
        raise ValueError(f"path {text!r} contains characters sshd_config cannot carry: {bad!r}")


def _write_private(path: Path, text: str) -> None:
    # Create with 0600 from the start rather than chmod afterwards: no window in which
    # another local user could read or swap the list of trusted keys.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(text)


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
    ) -> None:
        self.run_dir = Path(run_dir)
        self.sshd_path = sshd_path
        self.template = template
        self.config_path = self.run_dir / "sshd_config"
        self.host_key_path = self.run_dir / "ssh_host_ed25519_key"
        self.authorized_keys_path = self.run_dir / "authorized_keys"
        self.pid_file = self.run_dir / "sshd.pid"
        self.log_path = self.run_dir / "sshd.log"
        self.fixture_id = f"{os.getpid()}-{secrets.token_hex(8)}"
        self._pending_keys: list[str] = [self._check_key_line(k) for k in authorized_keys]
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
                    self._validate_config()
                outcome, last_log = self._launch_and_wait(port, deadline)
                if outcome == "up":
                    self._info = SshdInfo(
                        address=LOOPBACK,
                        port=port,
                        host_key=self._public_host_key(),
                        user=_current_user(),
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
                proc.wait(timeout=_STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=_STOP_TIMEOUT)
        if self._prepared:
            victims.update((v.pid, v) for v in self._tagged_processes())
        _end_processes(list(victims.values()))

    def _tagged_processes(self) -> list[psutil.Process]:
        """Processes started by this fixture's sessions, found by the SetEnv tag.

        Orphans are reparented to init, so ancestry cannot find them; the tag is unique
        per instance, so a concurrent fixture's sessions are never touched.
        """
        found = []
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if proc.environ().get(SESSION_TAG_ENV) == self.fixture_id:
                    found.append(proc)
        return found

    def pause(self) -> None:
        """SIGSTOP the listener: new connections hang in the backlog, sessions carry on.

        Returns once the kernel reports the process stopped, so a test's next step really
        runs against a frozen server.
        """
        pid = self._require_running()
        os.kill(pid, signal.SIGSTOP)
        self._wait_status(pid, psutil.STATUS_STOPPED, want=True)

    def resume(self) -> None:
        """SIGCONT the listener; connections queued while paused are then served."""
        pid = self._require_running()
        os.kill(pid, signal.SIGCONT)
        self._wait_status(pid, psutil.STATUS_STOPPED, want=False)

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
        line = self._check_key_line(public_key_line)
        if not self._prepared:
            self._pending_keys.append(line)
            return
        fd = os.open(self.authorized_keys_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with os.fdopen(fd, "a", encoding="utf-8") as f:
            f.write(line + "\n")

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

    @staticmethod
    def _check_key_line(line: str) -> str:
        line = line.strip()
        if not line or "\n" in line or "\r" in line:
            raise ValueError("an authorized key must be exactly one non-empty line")
        return line

    def _require_running(self) -> int:
        if self._proc is None or self._proc.poll() is not None:
            raise SshdError("sshd is not running")
        return self._proc.pid

    @staticmethod
    def _wait_status(pid: int, status: str, *, want: bool) -> None:
        deadline = time.monotonic() + _STOP_TIMEOUT
        while time.monotonic() < deadline:
            try:
                if (psutil.Process(pid).status() == status) == want:
                    return
            except psutil.NoSuchProcess:
                raise SshdError(f"sshd (pid {pid}) exited") from None
            time.sleep(_POLL_INTERVAL)
        raise SshdError(f"sshd (pid {pid}) did not {'enter' if want else 'leave'} {status}")

    def _prepare(self) -> None:
        """One-time per instance: fresh host key, initial authorized_keys, privsep dir."""
        if os.geteuid() == 0:
            # Root sshd chroots its pre-auth child into this dir and refuses to start
            # ("Missing privilege separation directory") if it is absent.
            PRIVSEP_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)
            os.chmod(PRIVSEP_DIR, 0o755)
        if self._prepared:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for path in (self.run_dir, self.host_key_path, self.authorized_keys_path):
            _check_path(path)
        for path in (self.host_key_path, self.host_key_path.with_suffix(".pub")):
            path.unlink(missing_ok=True)  # ssh-keygen would otherwise prompt to overwrite
        keygen = ["ssh-keygen", "-t", "ed25519", "-N", "", "-q", "-C", "bastion-test-sshd"]
        self._run_tool([*keygen, "-f", str(self.host_key_path)])
        _write_private(self.authorized_keys_path, "".join(k + "\n" for k in self._pending_keys))
        self._pending_keys.clear()
        self._prepared = True

    def _public_host_key(self) -> str:
        fields = self.host_key_path.with_suffix(".pub").read_text(encoding="utf-8").split()
        return f"{fields[0]} {fields[1]}"

    def _write_config(self, template: Template, port: int) -> None:
        try:
            text = template.substitute(
                listen_address=LOOPBACK,
                port=port,
                host_key=self.host_key_path,
                authorized_keys=self.authorized_keys_path,
                pid_file=self.pid_file,
                run_dir=self.run_dir,
                user=_current_user(),
                fixture_id=self.fixture_id,
            )
        except (KeyError, ValueError) as e:
            raise SshdError(f"bad placeholder in sshd config template: {e}") from e
        self.config_path.write_text(text, encoding="utf-8")

    def _validate_config(self) -> None:
        result = self._run_tool([self.sshd_path, "-t", "-f", str(self.config_path)], check=False)
        if result.returncode != 0:
            raise SshdError(
                f"sshd -t rejected {self.config_path} (exit {result.returncode}):\n"
                f"{result.stdout}{result.stderr}"
            )

    @staticmethod
    def _run_tool(argv: list[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
        try:
            result = subprocess.run(
                argv,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=_TOOL_TIMEOUT,
                check=False,
            )
        except subprocess.TimeoutExpired as e:
            raise SshdError(f"{argv[0]} did not finish within {_TOOL_TIMEOUT}s") from e
        if check and result.returncode != 0:
            raise SshdError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr}")
        return result

    def _launch_and_wait(self, port: int, deadline: float) -> tuple[str, str]:
        """Run sshd and poll until it is up, dead, or out of time.

        Returns ("up" | "bind" | "timeout", log tail of this attempt).
        """
        with open(self.log_path, "ab") as log:
            offset = log.tell()
            argv = [self.sshd_path, "-D", "-e", "-f", str(self.config_path)]
            log.write(f"--- bastion fixture: {' '.join(argv)} (port {port})\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log
            )
        proc = self._proc
        while True:
            if proc.poll() is not None:
                self._proc = None
                tail = self._log_tail(offset)
                if any(marker in tail for marker in _BIND_FAILURE_MARKERS):
                    return "bind", tail
                raise SshdError(f"sshd exited with {proc.returncode} on startup; log tail:\n{tail}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return "timeout", self._log_tail(offset)
            # The banner alone could come from someone else's server that won the race for
            # this port; sshd logs "Server listening" only once its own bind() succeeded.
            if (
                _answers_banner(LOOPBACK, port, timeout=min(0.5, remaining))
                and f"Server listening on {LOOPBACK} port {port}." in self._log_since(offset)
                and proc.poll() is None
            ):
                return "up", ""
            time.sleep(min(_POLL_INTERVAL, max(0.0, deadline - time.monotonic())))

    def _log_since(self, offset: int) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                return f.read().decode("utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    def _log_tail(self, offset: int) -> str:
        return "\n".join(self._log_since(offset).splitlines()[-_LOG_TAIL_LINES:])
