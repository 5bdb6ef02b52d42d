"""Policy files: which hosts exist, which accounts on them, which commands they may run.

The policy is the operator's written intent, so every doubt fails closed: a typo, a wrong
type or a file someone else could have written makes the whole policy unavailable rather
than silently narrower or wider. Parsing is pure; only the loader and the store touch disk.
"""

from __future__ import annotations

import difflib
import enum
import fnmatch
import hashlib
import json
import math
import os
import re
import stat
import time
import tomllib
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, NoReturn

import asyncssh

NAME_PATTERN = "[A-Za-z0-9][A-Za-z0-9._-]{0,63}"
_NAME_RE = re.compile(NAME_PATTERN)
_HOST_FIELDS = ("address", "port", "host_key", "connect_timeout", "accounts")
_ACCOUNT_FIELDS = ("user", "credential", "approval", "allow", "deny", "preapproved")
# ctime too: unlike mtime it cannot be set back with utime(), so no edit can hide.
_STAMP_FIELDS = ("st_dev", "st_ino", "st_mtime_ns", "st_ctime_ns", "st_size", "st_mode", "st_uid")


class PolicyError(Exception):
    """The policy cannot be trusted as written; the message names file, host and field."""


class ApprovalMode(enum.Enum):
    SESSION = "session"
    PER_COMMAND = "per-command"


@dataclass(frozen=True)
class Account:
    user: str
    credential: str
    approval: ApprovalMode
    allow: tuple[str, ...] | None
    deny: tuple[str, ...]
    preapproved: tuple[str, ...]
    host: str = ""  # alias of the owning host, so reasons can say "deploy@web1"

    @property
    def label(self) -> str:
        return f"{self.user}@{self.host}" if self.host else self.user


@dataclass(frozen=True)
class Host:
    alias: str
    address: str
    port: int
    host_key: str
    connect_timeout: float
    accounts: tuple[Account, ...]
    source: str

    def account(self, user: str) -> Account | None:
        return next((a for a in self.accounts if a.user == user), None)


@dataclass(frozen=True)
class Policy:
    hosts: Mapping[str, Host]
    digest: str
    files: tuple[str, ...]

    def host(self, alias: str) -> Host | None:
        """Case-insensitive fallback because OpenSSH lowercases the destination (%h).

        Aliases that differ only by case are rejected at load, so this is unambiguous.
        """
        found = self.hosts.get(alias)
        if found is None:
            found = next((h for a, h in self.hosts.items() if a.lower() == alias.lower()), None)
        return found


@dataclass(frozen=True)
class CommandCheck:
    allowed: bool
    rule: str | None
    reason: str


def _q(value: object) -> str:
    # JSON quoting escapes control bytes, so a hostile string cannot drive the terminal.
    return json.dumps(value, ensure_ascii=True, default=str)


def _fail(where: str, message: str) -> NoReturn:
    raise PolicyError(f"{where}: {message}")


def _plain(text: str) -> bool:
    """Names travel into SSH handshakes and cards; whitespace or control chars there hide."""
    return bool(text) and all(not c.isspace() and unicodedata.category(c)[0] != "C" for c in text)


def _check_fields(table: dict[str, Any], known: tuple[str, ...], where: str) -> None:
    for key, value in table.items():
        if key in known:
            continue
        close = difflib.get_close_matches(key, known, n=1)
        hint = f'did you mean "{close[0]}"?' if close else f"known fields: {', '.join(known)}"
        if isinstance(value, dict) and "address" in known:
            hint += '; an alias containing dots must be quoted: [hosts."db1.example.com"]'
        _fail(where, f"unknown field {_q(key)} ({hint})")


def _require(table: dict[str, Any], key: str, where: str) -> Any:
    if key not in table:
        _fail(where, f'missing required field "{key}"')
    return table[key]


def _name(value: object, field: str, where: str) -> str:
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value):
        _fail(where, f'field "{field}" must be a string matching {NAME_PATTERN}, got {_q(value)}')
    return value


def _globs(table: dict[str, Any], field: str, where: str) -> tuple[str, ...] | None:
    if field not in table:
        return None
    value = table[field]
    if not isinstance(value, list):
        _fail(where, f'field "{field}" must be a list of glob strings, got {_q(value)}')
    for i, glob in enumerate(value):
        if not isinstance(glob, str) or not glob:
            _fail(where, f'field "{field}"[{i}] must be a non-empty string, got {_q(glob)}')
    return tuple(value)


def _host_key(value: object, where: str) -> str:
    line = value.strip() if isinstance(value, str) else ""
    # One line only: import_public_key also accepts PEM blocks and even private keys.
    if not line or "\n" in line or "\r" in line:
        _fail(where, 'field "host_key" must be one OpenSSH public key line ("ssh-ed25519 AAAA…")')
    try:
        key = asyncssh.import_public_key(line)
    except Exception as exc:  # asyncssh raises several types; all mean "not a usable key"
        _fail(where, f'field "host_key" is not a valid OpenSSH public key: {exc}')
    if line.split()[0] != key.get_algorithm():
        _fail(where, 'field "host_key" must be in OpenSSH format ("ssh-ed25519 AAAA… comment")')
    return line


def _parse_account(raw: object, host: str, where: str) -> Account:
    if not isinstance(raw, dict):
        _fail(where, "each account must be a table: [[hosts.<alias>.accounts]]")
    _check_fields(raw, _ACCOUNT_FIELDS, where)
    user = _require(raw, "user", where)
    if not isinstance(user, str) or not _plain(user):
        _fail(where, f'field "user" must be a non-empty string without spaces, got {_q(user)}')
    credential = _name(_require(raw, "credential", where), "credential", where)
    approval = raw.get("approval", ApprovalMode.SESSION.value)
    modes = [m.value for m in ApprovalMode]
    if approval not in modes:
        _fail(
            where,
            f'field "approval" must be one of {", ".join(map(_q, modes))}, got {_q(approval)}',
        )
    return Account(
        user=user,
        credential=credential,
        approval=ApprovalMode(approval),
        allow=_globs(raw, "allow", where),
        deny=_globs(raw, "deny", where) or (),
        preapproved=_globs(raw, "preapproved", where) or (),
        host=host,
    )


def _parse_host(alias: str, raw: object, source: str) -> Host:
    where = f"{source}: hosts.{alias}"
    if not isinstance(raw, dict):
        _fail(where, f"must be a table: [hosts.{alias}]")
    _check_fields(raw, _HOST_FIELDS, where)
    address = _require(raw, "address", where)
    if not isinstance(address, str) or not _plain(address) or address.startswith("-"):
        _fail(where, f'field "address" must be a hostname or IP address, got {_q(address)}')
    port = raw.get("port", 22)
    if type(port) is not int or not 1 <= port <= 65535:
        _fail(where, f'field "port" must be an integer 1..65535, got {_q(port)}')
    timeout = raw.get("connect_timeout", 10)
    if type(timeout) not in (int, float) or not math.isfinite(timeout) or timeout <= 0:
        _fail(where, f'field "connect_timeout" must be a number of seconds > 0, got {_q(timeout)}')
    host_key = _host_key(_require(raw, "host_key", where), where)
    raw_accounts = raw.get("accounts")
    if not isinstance(raw_accounts, list) or not raw_accounts:
        _fail(where, f'field "accounts" is missing or empty: add a [[hosts.{alias}.accounts]]')
    accounts: list[Account] = []
    for i, raw_account in enumerate(raw_accounts):
        account = _parse_account(raw_account, alias, f"{where}.accounts[{i}]")
        if any(a.user == account.user for a in accounts):
            _fail(f"{where}.accounts[{i}]", f'duplicate "user" {_q(account.user)} on this host')
        accounts.append(account)
    return Host(alias, address, port, host_key, float(timeout), tuple(accounts), source)


def parse_policy_text(text: str, source: str) -> dict[str, Host]:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PolicyError(f"{source}: invalid TOML: {exc}") from None
    _check_fields(data, ("hosts",), source)
    raw_hosts = data.get("hosts", {})
    if not isinstance(raw_hosts, dict):
        _fail(source, 'field "hosts" must be a table: [hosts.<alias>]')
    hosts: dict[str, Host] = {}
    for alias, raw in raw_hosts.items():
        if not _NAME_RE.fullmatch(alias):
            _fail(f"{source}: hosts.{_q(alias)}", f"host alias must match {NAME_PATTERN}")
        if any(a.lower() == alias.lower() for a in hosts):
            _fail(f"{source}: hosts.{alias}", "alias differs from another only by case")
        hosts[alias] = _parse_host(alias, raw, source)
    return hosts


def _check_stat(st: os.stat_result, what: str, label: str) -> None:
    euid = os.geteuid()
    if st.st_uid not in (euid, 0):
        _fail(what, f"refusing {label} owned by uid {st.st_uid} (must be uid {euid} or root)")
    if st.st_mode & 0o022:
        _fail(
            what,
            f"refusing {label} writable by group or others "
            f"(mode {stat.S_IMODE(st.st_mode):o}); fix with: chmod go-w {what}",
        )


def _read_policy_file(path: Path) -> str:
    source = str(path)
    try:
        if path.is_symlink():
            target = path.resolve(strict=True)
            _check_stat(os.stat(target.parent), str(target.parent), "directory of policy file")
        # O_NONBLOCK: a FIFO named *.toml must not hang the gateway; fstat checks what we read.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with open(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                _fail(source, "policy file is not a regular file")
            _check_stat(st, source, "policy file")
            data = f.read()
    except OSError as exc:
        raise PolicyError(f"{source}: cannot read policy file: {exc.strerror or exc}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PolicyError(f"{source}: not UTF-8 text: {exc}") from None


def _sha256_json(doc: object) -> str:
    blob = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _host_doc(host: Host) -> dict[str, Any]:
    return {
        "alias": host.alias,
        "address": host.address,
        "port": host.port,
        "host_key": host.host_key,
        "connect_timeout": host.connect_timeout,
    }


def _account_doc(a: Account) -> dict[str, Any]:
    return {
        "user": a.user,
        "credential": a.credential,
        "approval": a.approval.value,
        "allow": None if a.allow is None else list(a.allow),
        "deny": list(a.deny),
        "preapproved": list(a.preapproved),
    }


def entry_digest(host: Host, account: Account) -> str:
    """Session approvals are bound to this: only a change to *this* entry voids them."""
    return _sha256_json(
        {
            "v": 1,
            "kind": "bastion.policy-entry",
            "host": _host_doc(host),
            "account": _account_doc(account),
        }
    )


def load_policy_dir(directory: Path) -> Policy:
    directory = Path(directory)
    try:
        dir_stat = os.stat(directory)
        if not stat.S_ISDIR(dir_stat.st_mode):
            _fail(str(directory), "policy path is not a directory")
        _check_stat(dir_stat, str(directory), "policy directory")
        names = sorted(n for n in os.listdir(directory) if n.endswith(".toml"))
    except FileNotFoundError:
        _fail(
            str(directory),
            f"policy directory does not exist; create it with: "
            f"mkdir -p -m 700 {directory} and add *.toml files "
            f"(see policies/example.toml)",
        )
    except OSError as exc:
        _fail(str(directory), f"cannot read policy directory: {exc.strerror or exc}")
    hosts: dict[str, Host] = {}
    files: list[str] = []
    for name in names:
        path = directory / name
        for alias, host in parse_policy_text(_read_policy_file(path), str(path)).items():
            prev = next((h for h in hosts.values() if h.alias.lower() == alias.lower()), None)
            if prev is not None:
                _fail(f"{path}: hosts.{alias}", f"host alias already defined in {prev.source}")
            hosts[alias] = host
        files.append(str(path))
    digest = _sha256_json(
        {
            "v": 1,
            "kind": "bastion.policy",
            "files": names,
            "hosts": {
                h.alias: {
                    **_host_doc(h),
                    "source": Path(h.source).name,
                    "accounts": [_account_doc(a) for a in h.accounts],
                }
                for h in hosts.values()
            },
        }
    )
    return Policy(MappingProxyType(hosts), digest, tuple(files))


def check_command(account: Account, command: str) -> CommandCheck:
    """Deny wins; a present allow list is exhaustive. `*` spans spaces, `;` and `/`,
    so globs describe the exact string the remote shell gets, not a sandbox."""
    who = account.label
    for rule in account.deny:
        if fnmatch.fnmatchcase(command, rule):
            return CommandCheck(False, rule, f"command matches deny rule {_q(rule)} for {who}")
    if account.allow is None:
        return CommandCheck(True, None, f"no deny rule matches and {who} has no allow list")
    for rule in account.allow:
        if fnmatch.fnmatchcase(command, rule):
            return CommandCheck(True, rule, f"command matches allow rule {_q(rule)} for {who}")
    if not account.allow:
        return CommandCheck(False, None, f"{who} allows no commands (allow = [])")
    allowed = ", ".join(_q(r) for r in account.allow)
    return CommandCheck(False, None, f"command matches no allow rule for {who}; allowed: {allowed}")


def is_preapproved(account: Account, command: str) -> bool:
    """Also requires check_command to pass, so a preapproval can never outrank deny/allow."""
    return check_command(account, command).allowed and any(
        fnmatch.fnmatchcase(command, rule) for rule in account.preapproved
    )


def host_key_fingerprint(host_key: str) -> str:
    return asyncssh.import_public_key(host_key).get_fingerprint("sha256")


class PolicyStore:
    """Re-reads the policy when any file changes (checked before each request, no restart).

    The hot path is one listdir plus a few stat() calls. A snapshot taken while a file's mtime
    is younger than RACY_NS is not trusted: a same-size rewrite within one timestamp tick
    would otherwise keep a stale (possibly wider) policy in force.
    """

    RACY_NS = 2_000_000_000

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self._stamp: tuple[Any, ...] | None = None
        self._result: Policy | PolicyError = PolicyError(f"{self.directory}: not loaded yet")

    def _snapshot(self) -> tuple[tuple[Any, ...], bool]:
        now = time.time_ns()
        try:
            names = sorted(n for n in os.listdir(self.directory) if n.endswith(".toml"))
        except OSError as exc:
            return ("unreadable", exc.errno), False
        stamp: list[tuple[Any, ...]] = []
        racy = False
        for name in ("", *names):
            for follow in (False, True):
                try:
                    st = os.stat(self.directory / name, follow_symlinks=follow)
                except OSError as exc:
                    stamp.append((name, follow, exc.errno))
                    continue
                stamp.append((name, *(getattr(st, f) for f in _STAMP_FIELDS)))
                racy = racy or now - st.st_mtime_ns < self.RACY_NS
        return tuple(stamp), racy

    def current(self) -> Policy | PolicyError:
        stamp, racy = self._snapshot()  # taken before loading, so an edit mid-load is seen next
        if stamp == self._stamp:
            return self._result
        try:
            self._result = load_policy_dir(self.directory)
        except PolicyError as exc:
            self._result = exc
        self._stamp = None if racy else stamp
        return self._result
