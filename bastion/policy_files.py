"""Policy files on disk: the loader, its safety checks, and the reloading store.

A policy file someone else could have written is not the operator's intent, so the
loader refuses it (and makes the whole policy unavailable). Parsing itself is pure and
lives in `core/policy.py`; this module only reads.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path
from typing import Any

from bastion.core.policy import Policy, PolicyError, build_policy, fail
from bastion.data import EXAMPLE_POLICY

# ctime too: unlike mtime it cannot be set back with utime(), so no edit can hide.
_STAMP_FIELDS = ("st_dev", "st_ino", "st_mtime_ns", "st_ctime_ns", "st_size", "st_mode", "st_uid")


def _check_stat(st: os.stat_result, what: str, label: str) -> None:
    euid = os.geteuid()
    if st.st_uid not in (euid, 0):
        fail(what, f"refusing {label} owned by uid {st.st_uid} (must be uid {euid} or root)")
    if st.st_mode & 0o022:
        fail(
            what,
            f"refusing {label} writable by group or others "
            f"(mode {stat.S_IMODE(st.st_mode):o}); fix with: chmod go-w {what}",
        )


def _read_policy_file(path: Path, source: str) -> str:
    """The file's text; `source` names it in every refusal."""
    try:
        if path.is_symlink():
            target = path.resolve(strict=True)
            _check_stat(os.stat(target.parent), str(target.parent), "directory of policy file")
        # O_NONBLOCK: a FIFO named *.toml must not hang the gateway; fstat checks what we read.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with open(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                fail(source, "policy file is not a regular file")
            _check_stat(st, source, "policy file")
            data = f.read()
    except OSError as exc:
        raise PolicyError(f"{source}: cannot read policy file: {exc.strerror or exc}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PolicyError(f"{source}: not UTF-8 text: {exc}") from None


def load_policy_dir(directory: Path, shown: Path | None = None) -> Policy:
    """The policy of every *.toml in `directory`; `shown` is the directory's name in
    what people read (the gateway reads its home through a descriptor, home.Held)."""
    directory = Path(directory)
    label = Path(shown) if shown is not None else directory
    try:
        dir_stat = os.stat(directory)
        if not stat.S_ISDIR(dir_stat.st_mode):
            fail(str(label), "policy path is not a directory")
        _check_stat(dir_stat, str(label), "policy directory")
        names = sorted(n for n in os.listdir(directory) if n.endswith(".toml"))
    except FileNotFoundError:
        fail(
            str(label),
            f"policy directory does not exist; create it with: "
            f"mkdir -p -m 700 {label} and add *.toml files "
            f"(see {EXAMPLE_POLICY})",
        )
    except OSError as exc:
        fail(str(label), f"cannot read policy directory: {exc.strerror or exc}")
    return build_policy(
        (name, str(label / name), _read_policy_file(directory / name, str(label / name)))
        for name in names
    )


class PolicyStore:
    """Re-reads the policy when any file changes (checked before each request, no restart).

    The hot path is one listdir plus a few stat() calls. A snapshot taken while a file's mtime
    is younger than RACY_NS is not trusted: a same-size rewrite within one timestamp tick
    would otherwise keep a stale (possibly wider) policy in force.
    """

    RACY_NS = 2_000_000_000

    def __init__(self, directory: Path, shown: Path | None = None) -> None:
        self.directory = Path(directory)
        self.shown = Path(shown) if shown is not None else self.directory
        self._stamp: tuple[Any, ...] | None = None
        self._result: Policy | PolicyError = PolicyError(f"{self.shown}: not loaded yet")

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
            self._result = load_policy_dir(self.directory, self.shown)
        except PolicyError as exc:
            self._result = exc
        self._stamp = None if racy else stamp
        return self._result
