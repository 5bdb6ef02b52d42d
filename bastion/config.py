"""`$BASTION_HOME/bastion.toml`: the gateway's own settings, validated like the policy.

Fail closed: an unknown key (a typo), a wrong type or a bad value is an error
naming the file and the key, and the gateway refuses to start -- it must not
run without a witness the operator asked for. A missing file means defaults
(no witness). Example, with every key:

    [witness]
    file = "/mnt/other-disk/bastion-witness.jsonl"   # an append-only file elsewhere, or
                             # a directory (heads go to DIR/bastion-witness.jsonl)
    syslog = "tcp://127.0.0.1:514"                   # or "unix:/dev/log"-style path
    every = "request"        # emit the head after each record that ends a request,
                             # or an integer N: every N records (vouches always)
    buffer_max = 100000      # witness entries kept on disk while a witness is down
    when_full = "continue"   # or "refuse": refuse new work (INTERNAL) past buffer_max

    [export]
    with_commands = false    # the syslog stream's per-request summaries carry no
                             # command text unless this is true

    [limits]
    inflight = 128           # commands dispatched at once; past it they queue,
                             # each subject in turn
    queue_wait = 30          # seconds a queued command waits before GATEWAY_BUSY

    [ca]                     # who signs the certificates of `auth = "certificate"` accounts
    backend = "vault"        # the vault's own CA (`bastion ca init`), or "openbao": a
                             # team's OpenBao / HashiCorp Vault SSH secrets engine:
    address = "https://bao.example:8200"
    mount = "ssh"            # where the SSH secrets engine is mounted
    role = "bastion"         # the role that signs (`ssh/sign/ROLE`)
    approle_mount = "approle"  # where AppRole auth is mounted, if the login is an AppRole
    tls_ca = "/etc/ssl/certs/bao-ca.pem"  # the CA bundle that verifies OpenBao's TLS
    timeout = 10             # seconds one signing may take before the request fails
    # The token or AppRole secret is never in this file: `bastion ca openbao-login`
    # seals it in the vault.

    [console]                # the browser console (docs/approving.md, "The console")
    enabled = false          # off unless true: served on loopback only
    port = 7433              # http://localhost:PORT/ (the WebAuthn rpId is "localhost")
    session_minutes = 720    # a console login lasts this long (or until the vault locks)
    idle_seconds = 60        # a connection that sends no request for this long is closed
"""

from __future__ import annotations

import difflib
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bastion.core.defaults import CONSOLE_IDLE, MAX_INFLIGHT, QUEUE_WAIT
from bastion.core.errors import BastionError

WITNESS_KEYS = ("file", "syslog", "every", "buffer_max", "when_full")
EXPORT_KEYS = ("with_commands",)
LIMITS_KEYS = ("inflight", "queue_wait")
CA_KEYS = ("backend", "address", "mount", "role", "approle_mount", "tls_ca", "timeout")
CA_BACKENDS = ("vault", "openbao")
CONSOLE_KEYS = ("enabled", "port", "session_minutes", "idle_seconds")
CONSOLE_PORT = 7433
WHEN_FULL = ("continue", "refuse")


class ConfigError(BastionError):
    """bastion.toml cannot be used as written; the message names file and key."""


@dataclass(frozen=True)
class SyslogTarget:
    transport: str  # "tcp" or "unix"
    address: str  # "HOST:PORT" or a socket path

    @property
    def host_port(self) -> tuple[str, int]:
        host, _, port = self.address.rpartition(":")
        return host.strip("[]"), int(port)


@dataclass(frozen=True)
class WitnessConfig:
    file: Path | None = None
    syslog: SyslogTarget | None = None
    every: int | None = None  # None: after each record that ends a request
    buffer_max: int = 100_000
    when_full: str = "continue"

    @property
    def enabled(self) -> bool:
        return self.file is not None or self.syslog is not None


@dataclass(frozen=True)
class Limits:
    inflight: int = MAX_INFLIGHT
    queue_wait: float = QUEUE_WAIT


@dataclass(frozen=True)
class CaConfig:
    """Who signs per-command certificates. For "openbao", the rest says where."""

    backend: str = "vault"
    address: str = ""
    mount: str = "ssh"
    role: str = ""
    approle_mount: str = "approle"
    tls_ca: Path | None = None
    timeout: float = 10.0


@dataclass(frozen=True)
class ConsoleConfig:
    """The browser console: off unless enabled; always on loopback."""

    enabled: bool = False
    port: int = CONSOLE_PORT
    session_minutes: int = 720
    idle_seconds: int = CONSOLE_IDLE  # before an idle connection is closed

    @property
    def approve_where(self) -> str:
        """Where a presence card is approved, for an answer that cannot approve it."""
        if self.enabled:
            return f"{self.origin}/, `bastion console` opens it"
        return (
            "the console is off: set [console] enabled = true in bastion.toml, restart the "
            "gateway, enroll with `bastion operator enroll`, then `bastion console`"
        )

    @property
    def origin(self) -> str:
        """What the browser calls the console's page: WebAuthn needs a name, not an
        address (an IP is no rpId), and `localhost` is a secure context over http."""
        return f"http://localhost:{self.port}"


@dataclass(frozen=True)
class Config:
    witness: WitnessConfig = WitnessConfig()
    export_with_commands: bool = False
    limits: Limits = Limits()
    ca: CaConfig = CaConfig()
    console: ConsoleConfig = ConsoleConfig()


def _unknown(table: dict[str, Any], known: tuple[str, ...], where: str) -> None:
    for key in table:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f'did you mean "{close[0]}"?' if close else f"known keys: {', '.join(known)}"
            raise ConfigError(f'{where}: unknown key "{key}" ({hint})')


def _syslog(value: object, where: str) -> SyslogTarget:
    text = value if isinstance(value, str) else ""
    scheme, sep, rest = text.partition("://") if "://" in text else text.partition(":")
    if scheme == "tcp" and sep and rest:
        target = SyslogTarget("tcp", rest)
        try:
            host, port = target.host_port
        except ValueError:
            host, port = "", 0
        if host and 0 < port < 65536:
            return target
    elif scheme == "unix" and sep and rest.startswith("/"):
        return SyslogTarget("unix", rest)
    raise ConfigError(f'{where}: "syslog" must be "tcp://HOST:PORT" or "unix:/PATH", got {value!r}')


def parse_config(text: str, source: str) -> Config:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: invalid TOML: {exc}") from None
    _unknown(data, ("witness", "export", "limits", "ca", "console"), source)
    raw = data.get("witness", {})
    if not isinstance(raw, dict):
        raise ConfigError(f'{source}: "witness" must be a table: [witness]')
    where = f"{source}: [witness]"
    _unknown(raw, WITNESS_KEYS, where)
    file = raw.get("file")
    if file is not None and (not isinstance(file, str) or not file.startswith("/")):
        raise ConfigError(f'{where}: "file" must be an absolute path, got {file!r}')
    every = raw.get("every", "request")
    if every != "request" and (type(every) is not int or every < 1):
        raise ConfigError(f'{where}: "every" must be "request" or a whole number >= 1')
    buffer_max = raw.get("buffer_max", 100_000)
    if type(buffer_max) is not int or buffer_max < 1:
        raise ConfigError(f'{where}: "buffer_max" must be a whole number >= 1')
    when_full = raw.get("when_full", "continue")
    if when_full not in WHEN_FULL:
        raise ConfigError(f'{where}: "when_full" must be "continue" or "refuse"')
    export = data.get("export", {})
    if not isinstance(export, dict):
        raise ConfigError(f'{source}: "export" must be a table: [export]')
    _unknown(export, EXPORT_KEYS, f"{source}: [export]")
    with_commands = export.get("with_commands", False)
    if type(with_commands) is not bool:
        raise ConfigError(f'{source}: [export]: "with_commands" must be true or false')
    limits = _limits(data.get("limits", {}), source)
    witness = WitnessConfig(
        file=Path(file) if file else None,
        syslog=_syslog(raw["syslog"], where) if "syslog" in raw else None,
        every=None if every == "request" else every,
        buffer_max=buffer_max,
        when_full=when_full,
    )
    return Config(
        witness,
        with_commands,
        limits,
        _ca(data.get("ca", {}), source),
        _console(data.get("console", {}), source),
    )


def _console(raw: object, source: str) -> ConsoleConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f'{source}: "console" must be a table: [console]')
    where = f"{source}: [console]"
    _unknown(raw, CONSOLE_KEYS, where)
    enabled = raw.get("enabled", False)
    if type(enabled) is not bool:
        raise ConfigError(f'{where}: "enabled" must be true or false')
    port = raw.get("port", CONSOLE_PORT)
    if type(port) is not int or not 1 <= port <= 65535:
        raise ConfigError(f'{where}: "port" must be a TCP port, 1 to 65535')
    minutes = raw.get("session_minutes", 720)
    if type(minutes) is not int or not 1 <= minutes <= 10080:
        raise ConfigError(f'{where}: "session_minutes" must be a whole number, 1 to 10080')
    idle = raw.get("idle_seconds", CONSOLE_IDLE)
    if type(idle) is not int or not 1 <= idle <= 3600:
        raise ConfigError(f'{where}: "idle_seconds" must be a whole number, 1 to 3600')
    return ConsoleConfig(enabled, port, minutes, idle)


def _ca(raw: object, source: str) -> CaConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f'{source}: "ca" must be a table: [ca]')
    where = f"{source}: [ca]"
    _unknown(raw, CA_KEYS, where)
    backend = raw.get("backend", "vault")
    if backend not in CA_BACKENDS:
        raise ConfigError(f'{where}: "backend" must be "vault" or "openbao", got {backend!r}')
    texts = {}
    for key in ("address", "mount", "role", "approle_mount"):
        value = raw.get(key, getattr(CaConfig, key))
        if not isinstance(value, str) or any(c.isspace() for c in value):
            raise ConfigError(f'{where}: "{key}" must be a string without spaces')
        texts[key] = value.strip("/")
    if backend == "openbao":
        for key in ("address", "role"):
            if not texts[key]:
                raise ConfigError(f'{where}: backend "openbao" needs "{key}"')
        if not texts["address"].startswith(("https://", "http://")):
            raise ConfigError(f'{where}: "address" must be an http:// or https:// URL')
    tls_ca = raw.get("tls_ca")
    if tls_ca is not None and (not isinstance(tls_ca, str) or not tls_ca.startswith("/")):
        raise ConfigError(f'{where}: "tls_ca" must be an absolute path, got {tls_ca!r}')
    timeout = raw.get("timeout", 10)
    if type(timeout) not in (int, float) or not 0 < timeout <= 120:
        raise ConfigError(f'{where}: "timeout" must be a number of seconds, 0 < s <= 120')
    return CaConfig(
        backend, tls_ca=Path(tls_ca) if tls_ca else None, timeout=float(timeout), **texts
    )


def _limits(raw: object, source: str) -> Limits:
    if not isinstance(raw, dict):
        raise ConfigError(f'{source}: "limits" must be a table: [limits]')
    where = f"{source}: [limits]"
    _unknown(raw, LIMITS_KEYS, where)
    inflight = raw.get("inflight", MAX_INFLIGHT)
    if type(inflight) is not int or inflight < 1:
        raise ConfigError(f'{where}: "inflight" must be a whole number >= 1')
    wait = raw.get("queue_wait", QUEUE_WAIT)
    if type(wait) not in (int, float) or not 0 < wait <= 3600:
        raise ConfigError(f'{where}: "queue_wait" must be a number of seconds, 0 < s <= 3600')
    return Limits(inflight, float(wait))


def load_config(path: Path) -> Config:
    """The settings in `path`, or the defaults when it does not exist."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return Config()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from None
    return parse_config(text, str(path))
