"""A non-root operator as users live (issue 44): a uid of its own, a home in /home, the
bastion home in `~/.local/share/bastion`, a gateway of its own run as that uid against
the real sshd, and `bastion run` started by that uid.

The test venv's interpreter may live where another uid cannot reach (pyenv under
/root), so the operator runs the system `python3` of the same minor version in a venv
of its own whose one `.pth` adds the test venv's site-packages (same ABI: the compiled
packages load). Helpers only: tests never import each other.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bastion.devtools.sshd_fixture import SshdInfo
from tests.harness import PASSPHRASE, policy_toml, remove_user

SYSTEM_PYTHON = Path("/usr/bin/python3")
CHECKOUT = Path(__file__).resolve().parent.parent
# One per checkout (its .pth names the checkout), kept between test runs.
_TAG = hashlib.sha256(str(CHECKOUT).encode()).hexdigest()[:10]
OPERATOR_VENV = Path("/var/tmp") / f"bt-operator-venv-{_TAG}"


def operator_python() -> Path:
    """The operator's interpreter (see the module's docstring), made once."""
    py = OPERATOR_VENV / "bin" / "python"
    if py.exists():
        return py
    if os.geteuid() != 0 or not shutil.which("useradd") or not shutil.which("setpriv"):
        pytest.skip("a second local uid needs root, useradd and setpriv")
    probe = subprocess.run(
        [str(SYSTEM_PYTHON), "-c", "import sys; print(sys.version_info[:2])"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    if probe.returncode != 0 or probe.stdout.strip() != str(sys.version_info[:2]):
        pytest.skip(f"{SYSTEM_PYTHON} is not Python {sys.version_info[:2]} like the test venv")
    scratch = OPERATOR_VENV.with_name(f"{OPERATOR_VENV.name}.{uuid.uuid4().hex[:6]}")
    subprocess.run([str(SYSTEM_PYTHON), "-m", "venv", "--without-pip", str(scratch)], check=True)
    site = sysconfig.get_paths()["purelib"]
    ver = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    (scratch / "lib" / ver / "site-packages" / "bastion-tests.pth").write_text(
        f"{CHECKOUT}\nimport site; site.addsitedir({site!r})\n"
    )
    subprocess.run(["chmod", "-R", "a+rX", str(scratch)], check=True)
    try:
        os.rename(scratch, OPERATOR_VENV)
    except OSError:  # another test process made it first
        shutil.rmtree(scratch, ignore_errors=True)
    return py


@dataclass
class Operator:
    """One operator uid: its home, its bastion home, its gateway."""

    name: str
    uid: int
    gid: int
    home: Path
    python: Path
    sshd: SshdInfo
    daemon: subprocess.Popen[bytes] | None = None

    @property
    def bastion_home(self) -> Path:
        return self.home / ".local" / "share" / "bastion"

    @property
    def config(self) -> Path:
        return self.home / "agent_ssh_config"

    def env(self) -> dict[str, str]:
        return {
            "HOME": str(self.home),
            "USER": self.name,
            "LOGNAME": self.name,
            "PATH": f"{self.python.parent}:/usr/local/bin:/usr/bin:/bin",
            "SHELL": "/bin/sh",
            "LANG": "C.UTF-8",
            "BASTION_KDF_PROFILE": "test",
        }

    def argv(self, *argv: str) -> list[str]:
        """argv as this uid, with its groups, no capability (setpriv execs it)."""
        return [
            "setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--init-groups",
            "--inh-caps=-all", "--bounding-set=-all", "--", *argv,
        ]  # fmt: skip

    def call(
        self, *argv: str, cwd: Path | None = None, stdin: str | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """argv as this operator, in its environment, from `cwd` (default: its home)."""
        return subprocess.run(
            self.argv(*argv),
            env=self.env(),
            cwd=cwd or self.home,
            input=stdin,
            stdin=None if stdin is not None else subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def sh(
        self, script: str, *, cwd: Path | None = None, stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """A shell script as this operator, outside every run (the positive controls)."""
        return self.call("/bin/sh", "-c", script, cwd=cwd, stdin=stdin)

    def cli(self, *args: str) -> list[str]:
        return [str(self.python), "-m", "bastion.cli", *args]

    def bastion(
        self, *args: str, stdin: str | None = None, cwd: Path | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        return self.call(*self.cli(*args), cwd=cwd, stdin=stdin, timeout=timeout)

    def run(
        self, script: str, *run_args: str, cwd: Path | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """`bastion run [RUN_ARGS] -- sh -c SCRIPT` as this operator, from `cwd`."""
        return self.bastion(
            "run", "--label", "probe", *run_args, "--", "/bin/sh", "-c", script,
            cwd=cwd, timeout=timeout,
        )  # fmt: skip

    def write(self, path: Path, text: str, mode: int = 0o644) -> Path:
        """A file of the operator's, made as the operator would (owned by its uid)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        os.chmod(path, mode)
        for p in [path, *path.parents]:
            if p == self.home.parent:
                break
            os.chown(p, self.uid, self.gid, follow_symlinks=False)
        return path

    def start_daemon(self) -> None:
        log = open(self.home / "gateway.log", "ab")  # noqa: SIM115 - the daemon keeps it
        self.daemon = subprocess.Popen(
            self.argv(*self.cli("daemon", "--approval-timeout", "30")),
            env=self.env(), cwd=self.home, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        log.close()
        sock = self.bastion_home / "run" / "agent.sock"
        deadline = time.monotonic() + 30
        while not sock.exists():
            assert self.daemon.poll() is None, (self.home / "gateway.log").read_text()
            assert time.monotonic() < deadline, "the operator's gateway did not start"
            time.sleep(0.05)
        r = self.bastion("unlock", "--passphrase-stdin", stdin=PASSPHRASE + "\n")
        assert r.returncode == 0, r.stderr

    def stop_daemon(self) -> None:
        if self.daemon is not None and self.daemon.poll() is None:
            self.daemon.terminate()
            try:
                self.daemon.wait(30)
            except subprocess.TimeoutExpired:
                self.daemon.kill()
                self.daemon.wait(30)
        self.daemon = None

    def approve_next(self, timeout: float = 60) -> dict[str, Any]:
        """The next card, approved by the operator's own `bastion decide`."""
        import json

        deadline = time.monotonic() + timeout
        while True:
            r = self.bastion("pending", "--json", "--wait", "5")
            cards = json.loads(r.stdout) if r.returncode == 0 and r.stdout.strip() else []
            if cards:
                card = cards[0]
                d = self.bastion("decide", str(card["id"]), "approve")
                assert d.returncode == 0, d.stderr
                return dict(card)
            assert time.monotonic() < deadline, f"no card came: {r.stderr}"


@contextmanager
def operator(sshd: SshdInfo, key_file: Path) -> Iterator[Operator]:
    """A fresh operator uid, its bastion home with `key_file` as deploy-key and a policy
    for `sshd`, its gateway running and unlocked, its agents' ssh config in its home."""
    import pwd

    python = operator_python()
    name = f"btop{uuid.uuid4().hex[:6]}"
    subprocess.run(["useradd", "-m", "-s", "/bin/bash", name], check=True, timeout=60)
    try:
        pw = pwd.getpwnam(name)
        op = Operator(name, pw.pw_uid, pw.pw_gid, Path(pw.pw_dir), python, sshd)
        key = op.write(op.home / "import-me", key_file.read_text(), 0o600)
        for argv, stdin in (
            (("init", "--passphrase-stdin"), PASSPHRASE + "\n"),
            (("key", "import", "deploy-key", str(key), "--passphrase-stdin"), PASSPHRASE + "\n"),
        ):
            r = op.bastion(*argv, stdin=stdin)
            assert r.returncode == 0, r.stderr
        key.unlink()
        op.write(op.bastion_home / "policies" / "test.toml", policy_toml(sshd), 0o600)
        op.start_daemon()
        r = op.bastion("ssh-config")
        assert r.returncode == 0, r.stderr
        op.write(op.config, r.stdout)
        yield op
    finally:
        with _suppress():
            op.stop_daemon()  # type: ignore[possibly-undefined]
        subprocess.run(["pkill", "-KILL", "-u", name], capture_output=True, timeout=30)
        remove_user(name)
        shutil.rmtree(f"/home/{name}", ignore_errors=True)


@contextmanager
def _suppress() -> Iterator[None]:
    with suppress(Exception):
        yield


def quoted(path: Path) -> str:
    return shlex.quote(str(path))
