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
folded) before any rule is looked at. Then the walk (`walk`, below) resolves it as the
target's kernel will, one lstat or readlink at a time asked of the edge, and the path
it finds (`FileOp.resolved`) must be allowed too: it is the path the operation is sent
for. A path whose end the walk cannot tell exactly is refused, never judged lexically.

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
from collections.abc import Generator
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
    LINK = "link"  # making a symlink or a hard link: always refused (`NO_LINKS`)


MUTATIONS = frozenset(
    {
        FileKind.WRITE,
        FileKind.REMOVE,
        FileKind.RENAME,
        FileKind.MKDIR,
        FileKind.RMDIR,
        FileKind.SETSTAT,
        FileKind.LINK,
    }
)

# Why a link is never made: the files rules judge paths, and a link would make one path
# lead to another after they judged it (or be a second name for a file outside them).
NO_LINKS = (
    "bastion does not create symlinks or hard links: a link would make a path lead "
    "somewhere the files rules did not judge. Copy the file instead (put it again under "
    "the new name)."
)


class FilesError(BastionError, ValueError):
    """A `files` table cannot be trusted as written; the message names the field."""


@dataclass(frozen=True)
class FileOp:
    """One file operation as the agent asked it; `digest` is what a grant is bound to.

    `size` and `sha256` are those of the exact bytes of a write that was buffered
    whole (a per-command account's), or of what went through, once a streamed one
    closed; for a setstat, `size` is the length the file is cut or grown to. `mode`,
    `owner` and `times` are what a setstat (or an open's, a mkdir's mode) sets, each
    None when it leaves it as it is. `follow`: whether the last name is followed
    (`stat`, `setstat`) or acted on itself (`lstat`, `readlink`, `lsetstat`).
    `resolved` is where the walk on the target found the path (and `to`) to lead
    (`walk`): observed after the gate's first word, checked by `check_file` like the
    path, and not part of the digest (the card shows what was asked, and a card's
    path must be where it leads: `gate.file_resolved`); `home` likewise (what `~/`
    rules are matched against)."""

    kind: FileKind
    path: str
    to: str | None = None  # a rename's new path
    size: int | None = None
    sha256: str | None = None
    mode: int | None = None
    resolved: tuple[str, ...] = ()
    home: str | None = None  # the account's home as the target reported it, if seen
    whole: bool = True  # a write replaces the file (truncates it first); False: in place
    owner: tuple[int, int] | None = None  # a setstat's (uid, gid)
    times: tuple[int, int] | None = None  # a setstat's (atime, mtime), seconds
    follow: bool = True

    @property
    def digest(self) -> str:
        doc: dict[str, object] = {
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
        # Named only when set, so every digest made before they existed stays the same.
        if self.owner is not None:
            doc["owner"] = list(self.owner)
        if self.times is not None:
            doc["times"] = list(self.times)
        if not self.follow:
            doc["follow"] = False
        blob = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(blob.encode()).hexdigest()

    @property
    def mutates(self) -> bool:
        return self.kind in MUTATIONS

    @property
    def paths(self) -> tuple[str, ...]:
        """The paths it names: its path, and a rename's new one."""
        return (self.path,) if self.to is None else (self.path, self.to)

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
        } | _changes_json(self)

    def summary(self) -> str:
        """One line for the gateway's log and the operator's notices."""
        what = f"{self.kind.value} {self.path!r}"
        if self.to is not None:
            what += f" -> {self.to!r}"
        if self.size is not None:
            what += f", {self.size} bytes"
        if self.sha256 is not None:
            what += f", sha256 {self.sha256[:16]}"
        if self.mode is not None and self.kind is FileKind.SETSTAT:
            what += f", mode {self.mode & 0o7777:04o}"
        if self.owner is not None:
            what += f", owner {self.owner[0]}:{self.owner[1]}"
        if self.times is not None:
            what += f", times {self.times[0]} {self.times[1]}"
        return what


def _changes_json(op: FileOp) -> dict[str, object]:
    """A setstat's owner and times, and a name acted on itself, where they are set."""
    out: dict[str, object] = {}
    if op.owner is not None:
        out["owner"] = f"{op.owner[0]}:{op.owner[1]}"
    if op.times is not None:
        out["times"] = {"atime": op.times[0], "mtime": op.times[1]}
    if not op.follow:
        out["follow"] = False
    return out


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


def json_text(text: str) -> str:
    """A path as a message quotes it: JSON escapes control bytes (the display escapes
    the rest where a person reads it)."""
    return json.dumps(text, ensure_ascii=True)


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


# -- where a path leads on the target: the bounded walk --------------------------------
#
# The target's own `realpath` cannot be the judge: OpenSSH's sftp-server gives up after
# 33 symlinks and answers "no such file", while the kernel's open() follows 40, so a chain
# of 34..40 links inside an allowed tree read as "does not exist" and the bytes landed
# where its last link pointed. Nor can a link be refused at open: SFTP v3 has no
# O_NOFOLLOW. So the gateway resolves every path itself, one component at a time, with
# `lstat` and `readlink` on the target (`walk`), and the operation is then sent for the
# path the walk found -- which has no symlink in it, so the target's kernel follows none
# unless one is made after the walk. Bastion's own file operations on one target
# account are carried one at a time from their walk to the target's answer
# (`gateway/sftp_broker.py`), so none of them can make one in between.

MAX_LINKS = 32  # symlinks one walk follows; fewer than the kernel's 40 and sftp-server's 33


class Node(enum.Enum):
    """What the target says one path is, without following it (an `lstat`)."""

    DIRECTORY = "directory"
    LINK = "symlink"
    OTHER = "other"  # a file, a device, a socket: nothing can be below it
    MISSING = "missing"  # no such file, or something above it is not a directory
    UNKNOWN = "unknown"  # the target would not say (permission denied, another error)


@dataclass(frozen=True)
class Lstat:
    """The walk asks what each of these paths is, in order; the edge answers one `Node`
    each. They may be sent at once: an answer past the first link is never read."""

    paths: tuple[str, ...]


@dataclass(frozen=True)
class Readlink:
    """The walk asks for a symlink's text; the edge answers it, or None if unreadable."""

    path: str


@dataclass(frozen=True)
class Resolution:
    """Where one path of a file operation leads: `path`, the one to act on (no symlink
    in it, as the target answered the walk), or None and `why` when that cannot be told
    exactly; `links`, how many symlinks the walk followed to get there."""

    path: str | None
    why: str = ""
    links: int = 0


def follows_last(op: FileOp) -> bool:
    """Whether the operation acts on what its path's last name leads to (open, list,
    stat, setstat) or on that name itself (remove, rename, mkdir, rmdir, lstat,
    readlink, lsetstat): the kernel's own rule for each call."""
    return op.follow and op.kind not in NAME_ITSELF


NAME_ITSELF = frozenset(
    {FileKind.REMOVE, FileKind.RENAME, FileKind.MKDIR, FileKind.RMDIR, FileKind.LINK}
)

# One walk's questions and answers; a generator the edge drives (`gateway/sftp_broker.py`).
Walk = Generator[Lstat | Readlink, "tuple[Node, ...] | str | None", Resolution]


def walk(path: str, follow: bool) -> Walk:
    """Resolve an absolute, folded path as the target's kernel will, asking the edge what
    each component is. Symlinks are followed (at most `MAX_LINKS`) and their texts
    spliced in, `..` taken after a link as the kernel takes it; the last name is followed
    only when `follow`. A path whose final target cannot be told exactly is a
    `Resolution` without a path: too many links (a chain or a loop), a link whose text
    cannot be read, a component the target would not describe, a symlink that leads to
    nothing (a write through it would create a file the walk never saw). A missing name
    the agent spelled is no such case: nothing below it exists, and the target answers
    so."""
    done = ""  # the resolved prefix: directories only, no link in it ("" is the root)
    todo = [(c, False) for c in path.split("/") if c]  # (name, whether a link's text gave it)
    links = 0
    while todo:
        name = todo[0][0]
        if name in (".", ".."):
            done = done.rsplit("/", 1)[0] if name == ".." else done
            todo.pop(0)
            continue
        batch = []
        for n, _ in todo:
            if n in (".", ".."):
                break
            batch.append(n)
        if not follow and len(batch) == len(todo):
            batch.pop()  # the last name is acted on itself: nothing to ask of it
            if not batch:
                done = f"{done}/{name}"
                todo.pop(0)
                continue
        prefixes, at = [], done
        for n in batch:
            at = f"{at}/{n}"
            if len(at) > MAX_PATH:
                return Resolution(None, f"it leads to a path longer than {MAX_PATH} bytes", links)
            prefixes.append(at)
        answers = yield Lstat(tuple(prefixes))
        if not isinstance(answers, tuple) or len(answers) != len(prefixes):
            return Resolution(None, "the target's answers did not match its questions", links)
        for here, node in zip(prefixes, answers, strict=True):
            _, linked = todo.pop(0)
            if node is Node.DIRECTORY:
                done = here
                continue
            if node is Node.LINK:
                links += 1
                if links > MAX_LINKS:
                    why = f"it goes through more than {MAX_LINKS} symlinks (a chain or a loop)"
                    return Resolution(None, why, links)
                text = yield Readlink(here)
                if not isinstance(text, str) or not text or "\0" in text:
                    return Resolution(None, f"the symlink {json.dumps(here)} could not be read")
                if text.startswith("/"):
                    done = ""
                todo[0:0] = [(c, True) for c in text.split("/") if c]
                break
            if node is Node.UNKNOWN:
                why = f"the target would not say what {json.dumps(here)} is"
                return Resolution(None, why, links)
            if node is Node.OTHER and not todo:
                return Resolution(here, links=links)  # the file itself
            # MISSING, or OTHER with names below it: nothing more exists down this path.
            if linked or any(from_link for _, from_link in todo):
                gone = "does not exist" if node is Node.MISSING else "is not a directory"
                why = f"a symlink on the way leads to {json.dumps(here)}, which {gone}"
                return Resolution(None, why, links)
            return Resolution("/".join([here, *(n for n, _ in todo)]), links=links)
    return Resolution(done or "/", links=links)
