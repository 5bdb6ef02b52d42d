"""File operations: what an agent's sftp client asks, and which paths an account may touch.

A file operation is a request like a command: the gate decides it (`gate.evaluate`,
step 5 calls `check_file` for it), a card shows it, a grant is bound to its digest
(`Binding.what`), and the journal records it -- path, size, sha256, mode and outcome,
never the bytes. Everything here is pure; `gateway/sftp.py` observes and carries out.

Paths. A rule is a glob over absolute paths: `**` crosses `/`, `*` and `?` do not,
`[...]` is a character class. A rule that starts with `~/` is relative to the account's
home as the target reports it (`realpath(".")` on the sftp channel, which every sftp
client asks first); until the gateway has seen it, such a rule matches nothing. An
agent's path is made absolute against that home and normalised lexically (`.` and `..`
folded) before any rule is looked at; the target's own resolution of the path (its
symlinks: `FileOp.resolved`) must be allowed too.

Write implies read: an account that may replace a file may read what it wrote, and
sftp clients stat and open for reading what they upload to. A mutation (write, remove,
rename, mkdir, rmdir, setstat) is checked against `write` only; a read, a listing or a
stat against `read` or `write`.

Defaults (no `files` in the account): no file access for an account with `allow`
rules, a per-command account, or a certificate account (its certificate's
force-command could not hold one file operation); a session account without `allow`
rules, which may already run `cat` and `tee` on any path, may read and write every
path (`/**`). Symlinks and hard links are never created through bastion.
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
from dataclasses import dataclass

from bastion.core.contract import Exit
from bastion.core.errors import BastionError

MAX_PATH = 4096  # PATH_MAX on Linux: a longer name is no path the target could open


class FileKind(enum.Enum):
    """What one file operation does, as the journal and a card name it."""

    READ = "read"  # open..close of a file for reading
    WRITE = "write"  # open..close of a file for writing (create, truncate or append)
    LIST = "list"  # one directory listing
    STAT = "stat"  # stat, lstat, readlink, statvfs of one path
    REALPATH = "realpath"  # resolving a name; reads no file, changes nothing
    REMOVE = "remove"
    RENAME = "rename"
    MKDIR = "mkdir"
    RMDIR = "rmdir"
    SETSTAT = "setstat"  # mode, owner, times or size of a path


MUTATIONS = frozenset(
    {
        FileKind.WRITE,
        FileKind.REMOVE,
        FileKind.RENAME,
        FileKind.MKDIR,
        FileKind.RMDIR,
        FileKind.SETSTAT,
    }
)


class FilesError(BastionError, ValueError):
    """A `files` table cannot be trusted as written; the message names the field."""


@dataclass(frozen=True)
class FileOp:
    """One file operation as the agent asked it; `digest` is what a grant is bound to.

    `size` and `sha256` are those of the exact bytes of a write that was buffered
    whole (a per-command account's), or of what went through, once a streamed one
    closed; `mode` the permission bits asked for. `resolved` is what the target said
    the path (and `to`) resolves to: observed after the gate's first word, checked by
    `check_file` like the path, and not part of the digest (the card shows what was
    asked; the target's resolution is looked at again right before it leaves); `home`
    likewise (what `~/` rules are matched against)."""

    kind: FileKind
    path: str
    to: str | None = None  # a rename's new path
    size: int | None = None
    sha256: str | None = None
    mode: int | None = None
    resolved: tuple[str, ...] = ()
    home: str | None = None  # the account's home as the target reported it, if seen
    whole: bool = True  # a write replaces the file (truncates it first); False: in place

    @property
    def digest(self) -> str:
        doc = {
            "v": 1,
            "kind": "bastion.file-op",
            "op": self.kind.value,
            "path": self.path,
            "to": self.to,
            "size": self.size,
            "sha256": self.sha256,
            "mode": self.mode,
            "whole": self.whole,
        }
        blob = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(blob.encode()).hexdigest()

    @property
    def mutates(self) -> bool:
        return self.kind in MUTATIONS

    def as_json(self) -> dict[str, object]:
        """What a card, the journal and the agent's `request` answers say of it: never
        content."""
        return {
            "op": self.kind.value,
            "path": self.path,
            "to": self.to,
            "size": self.size,
            "sha256": self.sha256,
            "mode": None if self.mode is None else f"{self.mode & 0o7777:04o}",
            "digest": self.digest,
        }

    def summary(self) -> str:
        """One line for the gateway's log and the operator's notices."""
        what = f"{self.kind.value} {self.path!r}"
        if self.to is not None:
            what += f" -> {self.to!r}"
        if self.size is not None:
            what += f", {self.size} bytes"
        if self.sha256 is not None:
            what += f", sha256 {self.sha256[:16]}"
        return what


@dataclass(frozen=True)
class PathRule:
    """One glob of a `files` list, compiled once."""

    text: str
    pattern: re.Pattern[str]

    def matches(self, path: str, home: str | None) -> bool:
        if self.text.startswith("~/"):
            if home is None:
                return False
            path = path if path.startswith(home.rstrip("/") + "/") else ""
            if not path:
                return False
            path = "~/" + path[len(home.rstrip("/")) + 1 :]
        return self.pattern.fullmatch(path) is not None


@dataclass(frozen=True)
class FileRules:
    """Which paths an account may read and which it may write (`files` in the policy)."""

    read: tuple[PathRule, ...]
    write: tuple[PathRule, ...]

    def doc(self) -> dict[str, list[str]]:
        return {"read": [r.text for r in self.read], "write": [r.text for r in self.write]}


EVERY_PATH = "/**"


@dataclass(frozen=True)
class FileCheck:
    allowed: bool
    rule: str | None
    reason: str


def _glob(text: str) -> re.Pattern[str]:
    """`**` any run of characters, `*` and `?` within one path segment, `[...]` a class;
    a rule ending in `/**` also matches the directory itself (so it can be listed)."""
    if text.endswith("/**") and len(text) > 3:
        return re.compile(_glob(text[:-3]).pattern + "(?:/.*)?")
    out, i = [], 0
    while i < len(text):
        c = text[i]
        if text.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            end = text.find("]", i + 2)
            if end < 0:
                raise FilesError(f"unclosed [ in {json.dumps(text)}")
            body = text[i + 1 : end]
            neg = body.startswith("!")
            body = body[1:] if neg else body
            out.append("[" + ("^" if neg else "") + body.replace("\\", "\\\\") + "]")
            i = end + 1
            continue
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out))


def parse_rule(value: object, field: str) -> PathRule:
    """One glob, or why it is refused: absolute (or `~/`), no `..` or `.` segment, no
    NUL or control character, a string."""
    where = f'field "files.{field}"'
    if not isinstance(value, str):
        raise FilesError(f"{where} must list strings, got {json.dumps(value, default=str)}")
    shown = json.dumps(value, ensure_ascii=True)
    if not value.startswith("/") and not value.startswith("~/"):
        raise FilesError(f"{where}: {shown} is not an absolute path (start it with / or ~/)")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise FilesError(f"{where}: {shown} contains a NUL or control character")
    if any(seg in (".", "..") for seg in value.split("/")):
        raise FilesError(f"{where}: {shown} has a . or .. segment; write the path it means")
    if len(value) > MAX_PATH:
        raise FilesError(f"{where}: {shown} is longer than {MAX_PATH} characters")
    return PathRule(value, _glob(value))


def parse_files(raw: object) -> FileRules:
    """The account's `files = { read = [...], write = [...] }`, or `FilesError`."""
    if not isinstance(raw, dict):
        raise FilesError('field "files" must be a table: files = { read = [...], write = [...] }')
    unknown = sorted(set(raw) - {"read", "write"})
    if unknown:
        raise FilesError(f'field "files" has unknown key {json.dumps(unknown[0])} (read, write)')
    lists: dict[str, tuple[PathRule, ...]] = {}
    for field in ("read", "write"):
        value = raw.get(field, [])
        if not isinstance(value, list):
            raise FilesError(f'field "files.{field}" must be a list of path globs')
        lists[field] = tuple(parse_rule(v, field) for v in value)
    return FileRules(lists["read"], lists["write"])


def default_files(has_allow: bool, per_command: bool, certificate: bool) -> FileRules | None:
    """No `files` in the account: see the module's docstring for why."""
    if has_allow or per_command or certificate:
        return None
    every = parse_rule(EVERY_PATH, "write")
    return FileRules((), (every,))


def problem(path: str) -> str | None:
    """Why an agent's path cannot be carried to the target exactly, or None."""
    if not path:
        return "an empty path"
    if "\0" in path:
        return "a path with a NUL byte"
    if len(path) > MAX_PATH:
        return f"a path longer than {MAX_PATH} bytes"
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return "a path that is not UTF-8 (bastion carries UTF-8 paths only)"
    return None


def op_problem(op: FileOp) -> str | None:
    """Why this operation's paths cannot be carried to the target exactly, or None. Only
    a realpath may name a relative path: it is how a client learns where home is; any
    other was made absolute against that home, so one still relative came before it."""
    for path in filter(None, (op.path, op.to)):
        bad = problem(path)
        if bad is None and op.kind is not FileKind.REALPATH and not path.startswith("/"):
            bad = (
                "a relative path before the target said where the home directory is "
                "(ask realpath('.') first, or give an absolute path)"
            )
        if bad is not None:
            return bad
    return None


def absolute(path: str, home: str | None) -> str | None:
    """The agent's path made absolute against the home the target reported, and folded
    lexically (`a/./b/../c` -> `a/c`); None when it is relative and no home is known."""
    if not path.startswith("/"):
        if home is None:
            return None
        path = home.rstrip("/") + "/" + path
    kept: list[str] = []
    for seg in path.split("/"):
        if seg in ("", "."):
            continue
        if seg == "..":
            if kept:
                kept.pop()
            continue
        kept.append(seg)
    return "/" + "/".join(kept)


def _first(rules: tuple[PathRule, ...], path: str, home: str | None) -> PathRule | None:
    return next((r for r in rules if r.matches(path, home)), None)


def check_file(rules: FileRules | None, who: str, op: FileOp) -> FileCheck:
    """What the account's `files` rules say of this operation: every path it names
    (and what the target resolved each to) must match a rule of the list it needs.
    The reason names the rule that decided, or says that none matched."""
    if rules is None:
        return FileCheck(
            False,
            None,
            f"{who} has no file access (no files = {{ read = [...], write = [...] }} "
            "in its policy entry)",
        )
    if op.kind is FileKind.REALPATH:
        return FileCheck(True, None, f"resolving a name reads no file, for {who}")
    needed = "write" if op.mutates else "read"
    lists = rules.write if op.mutates else rules.read + rules.write
    paths = [op.path] + ([op.to] if op.to is not None else []) + list(op.resolved)
    last: PathRule | None = None
    for path in paths:
        rule = _first(lists, path, op.home)
        if rule is None:
            known = ", ".join(dict.fromkeys(json.dumps(r.text) for r in lists)) or "none"
            seen = "" if path in (op.path, op.to) else " (where the target resolves it)"
            return FileCheck(
                False,
                None,
                f"{json.dumps(path)}{seen} matches no files.{needed} rule for {who} "
                f"(files.{needed}: {known})",
            )
        last = rule
    assert last is not None
    return FileCheck(
        True, last.text, f"{op.kind.value} matches files.{needed} rule {json.dumps(last.text)}"
    )


def needs_file_card(per_command: bool, op: FileOp) -> bool:
    """A per-command account approves every mutation on a card; reads of allowed paths
    need none (the rules already say the account may read them)."""
    return per_command and op.mutates


# SFTP's status codes (draft-ietf-secsh-filexfer-02) an agent's client is answered with.
FX_PERMISSION_DENIED = 3
FX_FAILURE = 4


def sftp_status(exit_status: int) -> int:
    """The status an sftp client gets for a request the gateway ended: a refusal that a
    person or the policy made (exit status 77) reads as permission denied, anything
    else as a failure; the words are on the channel's stderr as the JSON error line."""
    return FX_PERMISSION_DENIED if exit_status == int(Exit.DENIED) else FX_FAILURE
