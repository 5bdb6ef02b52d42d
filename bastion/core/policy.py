"""The policy model: which hosts exist, which accounts on them, which commands they may run.

The policy is the operator's written intent, so every doubt fails closed: a typo, a wrong
type or an unreadable key makes the whole policy unavailable rather than silently narrower
or wider. Everything here is pure: `policy_files.py` reads the files and hands their text
to `build_policy`; the gate reads the result.
"""

from __future__ import annotations

import base64
import binascii
import difflib
import enum
import hashlib
import json
import math
import re
import tomllib
import unicodedata
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, NoReturn

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives.serialization import load_ssh_public_key

from bastion.core.certs import DEFAULT_TTL, Auth, CertError, account_auth
from bastion.core.command import (
    Reading,
    RuleError,
    RuleKind,
    Unspelled,
    WordRule,
    code_builtin,
    no_match,
    parse_rules,
    read_command,
)
from bastion.core.errors import BastionError
from bastion.core.files import FileRules, FilesError, default_files, parse_files

NAME_PATTERN = "[A-Za-z0-9][A-Za-z0-9._-]{0,63}"
_NAME_RE = re.compile(NAME_PATTERN)
_HOST_FIELDS = ("address", "port", "host_key", "connect_timeout", "accounts")
_ACCOUNT_FIELDS = (
    "user",
    "credential",
    "approval",
    "allow",
    "deny",
    "preapproved",
    "shell",
    "login_shell",
    "auth",
    "source_address",
    "cert_ttl",
    "files",
    "waiting_line",
    "pty",
    "grants",
    "presence",
    "user_verification",
    "approvers",
)
# Login shells that run `sh -c STRING` as POSIX says, so a command read as argv
# (core/command.py) is the argv they run.
POSIX_SHELLS = ("posix", "sh", "bash", "dash", "zsh", "ksh", "mksh", "ash", "busybox")
_HOST_KEY_TYPES = (
    "ssh-ed25519",
    "ssh-rsa",
    "ecdsa-sha2-nistp256",
    "ecdsa-sha2-nistp384",
    "ecdsa-sha2-nistp521",
)


class PolicyError(BastionError):
    """The policy cannot be trusted as written; the message names file, host and field."""


class ApprovalMode(enum.Enum):
    SESSION = "session"
    PER_COMMAND = "per-command"


@dataclass(frozen=True)
class Presence:
    """An account's `presence = "required"`: how many distinct enrolled credentials
    must sign a card (`approvers`), and whether each must have verified its user
    (`user_verification = "required"`: a PIN or a biometric, not only a touch)."""

    approvers: int = 1
    user_verification: bool = False

    def doc(self) -> dict[str, object]:
        return {"approvers": self.approvers, "user_verification": self.user_verification}


MAX_APPROVERS = 16


class ShellMode(enum.Enum):
    """What an account does with a command that is shell source, not plain words."""

    DENY = "deny"  # refused with POLICY_DENIED, naming the first construct
    CARD = "card"  # a command card, marked "uses shell syntax", for every such command
    ALLOW = "allow"  # treated like any command (session accounts without `allow` only)


@dataclass(frozen=True)
class Account:
    user: str
    credential: str
    approval: ApprovalMode
    allow: tuple[WordRule, ...] | None
    deny: tuple[WordRule, ...]
    preapproved: tuple[WordRule, ...]
    host: str = ""  # alias of the owning host, so reasons can say "deploy@web1"
    shell: ShellMode = ShellMode.DENY
    login_shell: str = "posix"
    # "certificate": a fresh key and a per-command certificate (core/certs.py) instead
    # of `credential`, which may stay in the file but is never offered then.
    auth: Auth = Auth.KEY
    source_address: tuple[str, ...] = ()  # where the target sees the gateway come from
    cert_ttl: int = DEFAULT_TTL
    files: FileRules | None = None  # the `files` table as written; None: not written
    # The agent's ssh shows a line while a card waits (`core/waiting`); false: silence.
    waiting_line: bool = True
    # An exec that asks for a terminal (`ssh -t`, ansible without pipelining) runs
    # with one on the target; without, the gate refuses it and nothing runs.
    pty: bool = False
    # The operator may widen a yes to a command card into a bounded grant (`core/grants`):
    # per-command accounts only, off unless written.
    grants: bool = False
    # A card is approved only by signatures of enrolled authenticators (`core/presence`);
    # None: any operator's answer approves, as before.
    presence: Presence | None = None

    @property
    def label(self) -> str:
        return f"{self.user}@{self.host}" if self.host else self.user

    @property
    def file_rules(self) -> FileRules | None:
        """The paths this account may read and write over sftp: as written, or the
        default (`core/files.default_files`); None: no file access."""
        if self.files is not None:
            return self.files
        return default_files(
            self.allow is not None,
            self.approval is ApprovalMode.PER_COMMAND,
            self.auth is Auth.CERTIFICATE,
        )


@dataclass(frozen=True)
class Host:
    alias: str
    address: str
    port: int
    host_key: str
    connect_timeout: float
    accounts: tuple[Account, ...]
    source: str
    fingerprint: str = ""  # of host_key, computed once when the policy is parsed

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
    reading: Reading
    unspelled: tuple[Unspelled, ...] = ()  # options that alone kept an allow rule from matching


def quote(value: object) -> str:
    """JSON quoting escapes control bytes, so a hostile string cannot drive the terminal."""
    return json.dumps(value, ensure_ascii=True, default=str)


def fail(where: str, message: str) -> NoReturn:
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
        fail(where, f"unknown field {quote(key)} ({hint})")


def _require(table: dict[str, Any], key: str, where: str) -> Any:
    if key not in table:
        fail(where, f'missing required field "{key}"')
    return table[key]


def _name(value: object, field: str, where: str) -> str:
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value):
        fail(where, f'field "{field}" must be a string matching {NAME_PATTERN}, got {quote(value)}')
    return value


def _rules(table: dict[str, Any], field: str, where: str) -> tuple[WordRule, ...] | None:
    """Deny rules are guardrails whose globs reach options too; the rest admit."""
    if field not in table:
        return None
    kind = RuleKind.DENY if field == "deny" else RuleKind.ADMIT
    try:
        return parse_rules(table[field], field, kind)
    except RuleError as exc:
        fail(where, str(exc))


def _shell_mode(
    raw: dict[str, Any], approval: ApprovalMode, has_allow: bool, where: str
) -> ShellMode:
    """Safe defaults: an allow list admits plain commands only; a per-command
    account sends shell source to a card; a session account without an allow
    list keeps running what it is sent."""
    if has_allow:
        default, permitted = ShellMode.DENY, (ShellMode.DENY,)
    elif approval is ApprovalMode.PER_COMMAND:
        default, permitted = ShellMode.CARD, (ShellMode.CARD, ShellMode.DENY)
    else:
        default, permitted = ShellMode.ALLOW, tuple(ShellMode)
    value = raw.get("shell", default.value)
    if value not in [m.value for m in ShellMode]:
        modes = ", ".join(quote(m.value) for m in ShellMode)
        fail(where, f'field "shell" must be one of {modes}, got {quote(value)}')
    mode = ShellMode(value)
    if mode not in permitted:
        why = (
            "an allow list admits plain commands only, so shell source is refused"
            if has_allow
            else "a per-command account approves every command, shell source included, on a card"
        )
        allowed = ", ".join(quote(m.value) for m in permitted)
        fail(where, f'field "shell" cannot be {quote(value)} here ({why}); use {allowed}')
    return mode


def _pty(raw: dict[str, Any], where: str) -> bool:
    value = raw.get("pty", False)
    if not isinstance(value, bool):
        fail(where, f'field "pty" must be true or false, got {quote(value)}')
    return value


def _login_shell(raw: dict[str, Any], where: str) -> str:
    value = raw.get("login_shell", "posix")
    if value not in POSIX_SHELLS:
        fail(
            where,
            f'field "login_shell" is {quote(value)}: bastion reads each command as a POSIX '
            "shell runs `sh -c`, and sends it to the account's login shell; a shell that is "
            "not POSIX-compatible would run something else. Give the account a POSIX shell "
            f"({', '.join(POSIX_SHELLS[1:])}) and set login_shell to it.",
        )
    return str(value)


def host_key_fingerprint(host_key: str) -> str:
    """OpenSSH's `SHA256:` fingerprint of a public key line (as `ssh-keygen -l` prints it)."""
    blob = base64.b64decode(host_key.split()[1], validate=True)
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


def _host_key(value: object, where: str) -> str:
    line = value.strip() if isinstance(value, str) else ""
    # One line only: a PEM block or a private key is never a pin.
    if not line or "\n" in line or "\r" in line:
        fail(where, 'field "host_key" must be one OpenSSH public key line ("ssh-ed25519 AAAA…")')
    if line.split()[0] not in _HOST_KEY_TYPES:
        fail(where, 'field "host_key" must be in OpenSSH format ("ssh-ed25519 AAAA… comment")')
    try:
        load_ssh_public_key(line.encode())  # the blob's own type must match the prefix
        host_key_fingerprint(line)
    except (ValueError, UnsupportedAlgorithm, binascii.Error, IndexError) as exc:
        fail(where, f'field "host_key" is not a valid OpenSSH public key: {exc}')
    return line


def _flag(raw: dict[str, Any], field: str, default: bool, where: str) -> bool:
    value = raw.get(field, default)
    if not isinstance(value, bool):
        fail(where, f'field "{field}" must be true or false, got {quote(value)}')
    return value


def _parse_account(raw: object, host: str, where: str) -> Account:
    if not isinstance(raw, dict):
        fail(where, "each account must be a table: [[hosts.<alias>.accounts]]")
    _check_fields(raw, _ACCOUNT_FIELDS, where)
    user = _require(raw, "user", where)
    if not isinstance(user, str) or not _plain(user):
        fail(where, f'field "user" must be a non-empty string without spaces, got {quote(user)}')
    try:
        auth, source_address, ttl = account_auth(raw)
    except CertError as exc:
        fail(where, str(exc))
    credential = raw.get("credential", "")
    if auth is Auth.KEY or credential:
        credential = _name(_require(raw, "credential", where), "credential", where)
    approval = raw.get("approval", ApprovalMode.SESSION.value)
    modes = [m.value for m in ApprovalMode]
    if approval not in modes:
        fail(
            where,
            f'field "approval" must be one of {", ".join(map(quote, modes))}, '
            f"got {quote(approval)}",
        )
    mode = ApprovalMode(approval)
    allow = _rules(raw, "allow", where)
    files = _files(raw, auth, where)
    return Account(
        user=user,
        credential=credential,
        approval=mode,
        allow=allow,
        deny=_rules(raw, "deny", where) or (),
        preapproved=_rules(raw, "preapproved", where) or (),
        host=host,
        shell=_shell_mode(raw, mode, allow is not None, where),
        login_shell=_login_shell(raw, where),
        auth=auth,
        source_address=source_address,
        cert_ttl=ttl,
        files=files,
        waiting_line=_flag(raw, "waiting_line", True, where),
        pty=_pty(raw, where),
        grants=_grants(raw, mode, where),
        presence=_presence(raw, where),
    )


def _presence(raw: dict[str, Any], where: str) -> Presence | None:
    """`presence = "required"` (or absent: "off"), `user_verification = "required"` (or
    "preferred"), `approvers = N`: the last two mean something only with the first, and
    are refused without it rather than silently ignored."""
    value = raw.get("presence", "off")
    if value not in ("off", "required"):
        fail(where, f'field "presence" must be "required" or "off", got {quote(value)}')
    uv = raw.get("user_verification", "preferred")
    if uv not in ("preferred", "required"):
        fail(
            where,
            f'field "user_verification" must be "required" or "preferred", got {quote(uv)}',
        )
    approvers = raw.get("approvers", 1)
    if isinstance(approvers, bool) or not isinstance(approvers, int):
        fail(where, f'field "approvers" must be a whole number, got {quote(approvers)}')
    if not 1 <= approvers <= MAX_APPROVERS:
        fail(where, f'field "approvers" must be from 1 to {MAX_APPROVERS}, got {approvers}')
    if value == "off":
        for name, given in (
            ("user_verification", "user_verification" in raw),
            ("approvers", "approvers" in raw),
        ):
            if given:
                fail(
                    where,
                    f'field "{name}" counts presence-signed approvals: it needs '
                    'presence = "required" on the same account',
                )
        return None
    return Presence(approvers=approvers, user_verification=uv == "required")


def _grants(raw: dict[str, Any], mode: ApprovalMode, where: str) -> bool:
    """`grants = true` widens command cards, so it means something on a per-command
    account only; on a session account it is refused rather than silently ignored."""
    value = _flag(raw, "grants", False, where)
    if value and mode is not ApprovalMode.PER_COMMAND:
        fail(
            where,
            'field "grants" widens the answers to command cards, which only a '
            '"per-command" account asks; this account approves sessions',
        )
    return value


def _files(raw: dict[str, Any], auth: Auth, where: str) -> FileRules | None:
    """The account's `files` table, validated whole (`core/files.parse_files`)."""
    if "files" not in raw:
        return None
    if auth is Auth.CERTIFICATE:
        fail(
            where,
            'field "files" cannot be given to a certificate account: its certificate\'s '
            "force-command holds one command, and no file operation could be held to it",
        )
    try:
        return parse_files(raw["files"])
    except FilesError as exc:
        fail(where, str(exc))


def _parse_host(alias: str, raw: object, source: str) -> Host:
    where = f"{source}: hosts.{alias}"
    if not isinstance(raw, dict):
        fail(where, f"must be a table: [hosts.{alias}]")
    _check_fields(raw, _HOST_FIELDS, where)
    address = _require(raw, "address", where)
    if not isinstance(address, str) or not _plain(address) or address.startswith("-"):
        fail(where, f'field "address" must be a hostname or IP address, got {quote(address)}')
    port = raw.get("port", 22)
    if type(port) is not int or not 1 <= port <= 65535:
        fail(where, f'field "port" must be an integer 1..65535, got {quote(port)}')
    timeout = raw.get("connect_timeout", 10)
    if type(timeout) not in (int, float) or not math.isfinite(timeout) or timeout <= 0:
        fail(
            where, f'field "connect_timeout" must be a number of seconds > 0, got {quote(timeout)}'
        )
    host_key = _host_key(_require(raw, "host_key", where), where)
    raw_accounts = raw.get("accounts")
    if not isinstance(raw_accounts, list) or not raw_accounts:
        fail(where, f'field "accounts" is missing or empty: add a [[hosts.{alias}.accounts]]')
    accounts: list[Account] = []
    for i, raw_account in enumerate(raw_accounts):
        account = _parse_account(raw_account, alias, f"{where}.accounts[{i}]")
        if any(a.user == account.user for a in accounts):
            fail(f"{where}.accounts[{i}]", f'duplicate "user" {quote(account.user)} on this host')
        accounts.append(account)
    return Host(
        alias,
        address,
        port,
        host_key,
        float(timeout),
        tuple(accounts),
        source,
        host_key_fingerprint(host_key),
    )


def parse_policy_text(text: str, source: str) -> dict[str, Host]:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PolicyError(f"{source}: invalid TOML: {exc}") from None
    _check_fields(data, ("hosts",), source)
    raw_hosts = data.get("hosts", {})
    if not isinstance(raw_hosts, dict):
        fail(source, 'field "hosts" must be a table: [hosts.<alias>]')
    hosts: dict[str, Host] = {}
    for alias, raw in raw_hosts.items():
        if not _NAME_RE.fullmatch(alias):
            fail(f"{source}: hosts.{quote(alias)}", f"host alias must match {NAME_PATTERN}")
        if any(a.lower() == alias.lower() for a in hosts):
            fail(f"{source}: hosts.{alias}", "alias differs from another only by case")
        hosts[alias] = _parse_host(alias, raw, source)
    return hosts


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
    """An account as its entry digest covers it: a field added later only where it differs
    from its default, so an account that never set it keeps its digest (and its session
    approvals) across an upgrade."""
    return (
        _key_account_doc(a)
        | ({"files": a.files.doc()} if a.files is not None else {})
        | ({} if a.waiting_line else {"waiting_line": False})
        | ({"pty": True} if a.pty else {})
        | ({"grants": True} if a.grants else {})
        | ({"presence": a.presence.doc()} if a.presence is not None else {})
    )


def _key_account_doc(a: Account) -> dict[str, Any]:
    return {
        "user": a.user,
        "credential": a.credential,
        "approval": a.approval.value,
        "allow": None if a.allow is None else [r.text for r in a.allow],
        "deny": [r.text for r in a.deny],
        "preapproved": [r.text for r in a.preapproved],
        "shell": a.shell.value,
        "login_shell": a.login_shell,
    } | (
        {}
        if a.auth is Auth.KEY  # unchanged for key accounts: their digests stay what they were
        else {"auth": a.auth.value, "source_address": list(a.source_address), "ttl": a.cert_ttl}
    )


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


def build_policy(files: Iterable[tuple[str, str, str]]) -> Policy:
    """One policy from its files, given as (file name, source path, text) in load order.

    An alias may be defined once across all files; the digest covers every file name
    and every field, so any edit anywhere is a new policy.
    """
    hosts: dict[str, Host] = {}
    names: list[str] = []
    sources: list[str] = []
    for name, source, text in files:
        for alias, host in parse_policy_text(text, source).items():
            prev = next((h for h in hosts.values() if h.alias.lower() == alias.lower()), None)
            if prev is not None:
                fail(f"{source}: hosts.{alias}", f"host alias already defined in {prev.source}")
            hosts[alias] = host
        names.append(name)
        sources.append(source)
    digest = _sha256_json(
        {
            "v": 1,
            "kind": "bastion.policy",
            "files": names,
            "hosts": {
                h.alias: {
                    **_host_doc(h),
                    "source": h.source.rsplit("/", 1)[-1],
                    "accounts": [_account_doc(a) for a in h.accounts],
                }
                for h in hosts.values()
            },
        }
    )
    return Policy(MappingProxyType(hosts), digest, tuple(sources))


def _plain_only(who: str, reading: Reading) -> str:
    """Why shell source is refused on a `shell = "deny"` account, and what to send."""
    said = (
        f"{who} runs plain commands only (words, 'quoted' or \"quoted\", separated by "
        f"spaces), and this one uses shell syntax: {reading.summary()}. "
    )
    first = reading.constructs[0].text if reading.constructs else ""
    if code_builtin(first) is not None:  # the reader lists the first word's builtin first
        return said + (
            f"{first!r} makes a command shell source however plain its words are. Send "
            "the program it would run, with its arguments, as its own command"
        )
    return said + "Send one program and its arguments, without ; | & $ ` < > or newlines"


def check_command(account: Account, command: str) -> CommandCheck:
    """What the account's rules say of this command, read as the target's shell reads it.

    Deny wins, over the raw string (one glob) and over the argv (word patterns):
    a guardrail, not a boundary. Shell source never matches `allow`; the
    account's `shell` mode says what happens to it. A present allow list is
    exhaustive, and its rules match argv words, never text across them.
    """
    reading = read_command(command)
    who = account.label
    for rule in account.deny:
        if rule.matches_text(command) or (reading.argv is not None and rule.matches(reading.argv)):
            reason = f"command matches deny rule {quote(rule.text)} for {who}"
            return CommandCheck(False, rule.text, reason, reading)
    if reading.argv is None:
        if account.shell is ShellMode.DENY:
            return CommandCheck(False, None, _plain_only(who, reading), reading)
        what = "needs a command card" if account.shell is ShellMode.CARD else "is allowed"
        return CommandCheck(
            True, None, f"shell source ({reading.summary()}); for {who} it {what}", reading
        )
    if account.allow is None:
        return CommandCheck(
            True, None, f"no deny rule matches and {who} has no allow list", reading
        )
    for rule in account.allow:
        if rule.matches(reading.argv):
            reason = f"command matches allow rule {quote(rule.text)} for {who}"
            return CommandCheck(True, rule.text, reason, reading)
    if not account.allow:
        return CommandCheck(False, None, f"{who} allows no commands (allow = [])", reading)
    why, missed = no_match(account.allow, reading.argv)
    return CommandCheck(
        False, None, f"command matches no allow rule for {who} {why}", reading, missed
    )


def preapproval(account: Account, check: CommandCheck) -> str | None:
    """The preapproved rule this command matches, if any. Needs an allowed check
    (so a preapproval never outranks deny or allow) and an argv: shell source
    is never preapproved."""
    argv = check.reading.argv
    if not check.allowed or argv is None:
        return None
    return next((r.text for r in account.preapproved if r.matches(argv)), None)


def needs_command_card(account: Account, check: CommandCheck) -> bool:
    """Per-command accounts card every command not preapproved; an account whose
    shell mode is "card" cards every command that is shell source."""
    if account.approval is ApprovalMode.PER_COMMAND:
        return preapproval(account, check) is None
    return check.reading.argv is None and account.shell is ShellMode.CARD


def is_preapproved(account: Account, command: str) -> bool:
    return preapproval(account, check_command(account, command)) is not None
