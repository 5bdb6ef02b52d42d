"""The sshd fixture's tools: finding and checking what sshd needs, and ending what it ran.

Split from `sshd_fixture.py` so the `Sshd` class reads as its lifecycle only.
Standard library and psutil, like the fixture itself.
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
from collections.abc import Mapping, Sequence
from pathlib import Path
from string import Template

import psutil

from bastion.core.errors import BastionError
from bastion.data import SSHD_TEMPLATE

#: Overrides the template location (the package's own copy is the default).
TEMPLATE_ENV = "BASTION_SSHD_TEMPLATE"

LOOPBACK = "127.0.0.1"

# Debian's compile-time privilege separation directory. sshd refuses to start as root
# without it, and minimal containers never ran the init script that creates it.
PRIVSEP_DIR = Path("/run/sshd")
PRIVSEP_USER = "sshd"

# Bounds for the helper commands; none of them should take more than a fraction of this.
TOOL_TIMEOUT = 30.0
STOP_TIMEOUT = 5.0
POLL_INTERVAL = 0.02
# Characters that would break a double-quoted sshd_config argument or be expanded as an
# sshd token (%h, %u, ...) inside AuthorizedKeysFile.
_UNSAFE_PATH_CHARS = ('"', "%", "\n", "\r")


# What sshd prints when the port we picked was taken between our probe and its bind().
_BIND_FAILURE_MARKERS = ("Bind to port", "Cannot bind any address", "Address already in use")
_LOG_TAIL_LINES = 40


class SshdError(BastionError, RuntimeError):
    """The fixture could not do what was asked; the message carries sshd's own words."""


def gone(proc: psutil.Process) -> bool:
    # A zombie has exited; only its reaping is pending, and orphans are reaped by init,
    # which in some sandboxes (this one's pid 1) takes a second or two.
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def end_processes(procs: list[psutil.Process]) -> None:
    """SIGTERM (and SIGCONT, in case a test stopped them), then SIGKILL what is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(sig)
                proc.resume()
        deadline = time.monotonic() + STOP_TIMEOUT
        while procs and time.monotonic() < deadline:
            procs = [p for p in procs if not gone(p)]
            if procs:
                time.sleep(POLL_INTERVAL)
        if not procs:
            return


def find_template() -> Path:
    """Locate the sshd_config template: the env var's file, else the package's own
    (`bastion/data`, carried by a wheel as by a checkout)."""
    override = os.environ.get(TEMPLATE_ENV)
    if override:
        path = Path(override).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"{TEMPLATE_ENV}={override!r} is not a file")
        return path
    if not SSHD_TEMPLATE.is_file():
        raise FileNotFoundError(
            f"sshd config template not found at {SSHD_TEMPLATE}; set {TEMPLATE_ENV}"
        )
    return SSHD_TEMPLATE


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


def current_user() -> str:
    # The passwd entry, not $USER: containers and sudo often leave $USER unset or stale,
    # and sshd authenticates against the passwd name.
    return pwd.getpwuid(os.geteuid()).pw_name


def free_port(address: str) -> int:
    """A port that was free a moment ago; sshd's bind() is the real test, hence retries."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        return int(sock.getsockname()[1])


def answers_banner(address: str, port: int, timeout: float) -> bool:
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


def unsafe_chars(text: str) -> list[str]:
    return [c for c in _UNSAFE_PATH_CHARS if c in text]


def check_path(path: Path) -> None:
    text = str(path)
    bad = unsafe_chars(text)
    if bad:
        raise ValueError(f"path {text!r} contains characters sshd_config cannot carry: {bad!r}")


def write_private(path: Path, text: str) -> None:
    # Create with 0600 from the start rather than chmod afterwards: no window in which
    # another local user could read or swap the list of trusted keys.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(text)


def replace_private(path: Path, text: str) -> None:
    """Rewrite a 0600 file so that a reader sees the old content or the new, never a
    half-written or empty one: sshd opens authorized_keys, the CA file and the principals
    files at each authentication, possibly while a test is rewriting them."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        write_private(tmp, text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def check_key_line(line: str) -> str:
    line = line.strip()
    if not line or "\n" in line or "\r" in line:
        raise ValueError("an authorized key must be exactly one non-empty line")
    return line


def file_lines(lines: Sequence[str], what: str) -> str:
    """The text of a file of `lines` (comments and blank lines allowed, as sshd allows in
    its key files). A bare string is refused: iterating it would write one character a line."""
    if isinstance(lines, str):
        raise TypeError(f"{what}: pass a sequence of lines, not one string")
    for line in lines:
        if "\n" in line or "\r" in line:
            raise ValueError(f"{what}: {line!r} is more than one line")
    return "".join(line + "\n" for line in lines)


def check_principals(principals: Mapping[str, Sequence[str]]) -> dict[str, str]:
    """Each login user's AuthorizedPrincipalsFile text, the user name being the file name
    (sshd expands %u): so a name must be a plain file name, and a principal one line."""
    files = {}
    for user, names in principals.items():
        if user in ("", ".", "..") or "/" in user or unsafe_chars(user):
            raise ValueError(f"login user {user!r} cannot name a principals file")
        files[user] = file_lines([check_key_line(n) for n in names], f"principals of {user}")
    return files


def write_principals(directory: Path, files: Mapping[str, str]) -> None:
    directory.mkdir(mode=0o700, exist_ok=True)
    for user, text in files.items():
        replace_private(directory / user, text)


def wait_status(pid: int, status: str, *, want: bool) -> None:
    deadline = time.monotonic() + STOP_TIMEOUT
    while time.monotonic() < deadline:
        try:
            if (psutil.Process(pid).status() == status) == want:
                return
        except psutil.NoSuchProcess:
            raise SshdError(f"sshd (pid {pid}) exited") from None
        time.sleep(POLL_INTERVAL)
    raise SshdError(f"sshd (pid {pid}) did not {'enter' if want else 'leave'} {status}")


def ensure_privsep_dir() -> None:
    if os.geteuid() == 0:
        # Root sshd chroots its pre-auth child into this dir and refuses to start
        # ("Missing privilege separation directory") if it is absent.
        PRIVSEP_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)
        os.chmod(PRIVSEP_DIR, 0o755)


def make_host_key(path: Path) -> None:
    """A fresh ed25519 host key at `path` (and `path`.pub), replacing any there."""
    for old in (path, path.with_suffix(".pub")):
        old.unlink(missing_ok=True)  # ssh-keygen would otherwise prompt to overwrite
    keygen = ["ssh-keygen", "-t", "ed25519", "-N", "", "-q", "-C", "bastion-test-sshd"]
    run_tool([*keygen, "-f", str(path)])


def render_config(template: Template, **values: object) -> str:
    try:
        return template.substitute(values)
    except (KeyError, ValueError) as e:
        raise SshdError(f"bad placeholder in sshd config template: {e}") from e


def check_config(sshd_path: str, config_path: Path) -> None:
    result = run_tool([sshd_path, "-t", "-f", str(config_path)], check=False)
    if result.returncode != 0:
        raise SshdError(
            f"sshd -t rejected {config_path} (exit {result.returncode}):\n"
            f"{result.stdout}{result.stderr}"
        )


def public_key(path: Path) -> str:
    """The `type base64` of a .pub file, without its comment: the form a policy pins."""
    fields = path.read_text(encoding="utf-8").split()
    return f"{fields[0]} {fields[1]}"


def run_tool(argv: list[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        result = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=TOOL_TIMEOUT,
            check=False,
        )
    except subprocess.TimeoutExpired as e:
        raise SshdError(f"{argv[0]} did not finish within {TOOL_TIMEOUT}s") from e
    if check and result.returncode != 0:
        raise SshdError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr}")
    return result


def tagged_processes(variable: str, tag: str) -> list[psutil.Process]:
    """Processes started by one fixture's sessions, found by their environment tag.

    Orphans are reparented to init, so ancestry cannot find them; the tag is unique
    per fixture instance, so a concurrent fixture's sessions are never touched.
    """
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.environ().get(variable) == tag:
                found.append(proc)
    return found


def log_since(path: Path, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return ""


def log_tail(path: Path, offset: int) -> str:
    return "\n".join(log_since(path, offset).splitlines()[-_LOG_TAIL_LINES:])


def wait_listening(
    proc: subprocess.Popen[bytes], log_path: Path, offset: int, port: int, deadline: float
) -> tuple[str, str]:
    """Poll a just-started sshd (logging to `log_path` from `offset`) until it serves
    `port`, dies, or runs out of time.

    Returns ("up" | "bind" | "exited" | "timeout", log tail of this attempt); "bind"
    means it died because the port was taken between our probe and its bind().
    """
    while True:
        if proc.poll() is not None:
            tail = log_tail(log_path, offset)
            if any(marker in tail for marker in _BIND_FAILURE_MARKERS):
                return "bind", tail
            return "exited", tail
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return "timeout", log_tail(log_path, offset)
        # The banner alone could come from someone else's server that won the race for
        # this port; sshd logs "Server listening" only once its own bind() succeeded.
        if (
            answers_banner(LOOPBACK, port, timeout=min(0.5, remaining))
            and f"Server listening on {LOOPBACK} port {port}." in log_since(log_path, offset)
            and proc.poll() is None
        ):
            return "up", ""
        time.sleep(min(POLL_INTERVAL, max(0.0, deadline - time.monotonic())))
