"""The operator socket's wire, client side: one JSON request per line, one JSON answer.

Every CLI command that talks to the gateway goes through `call` (or `connect`).
The server side, with its guard on who may speak for the operator, is
`gateway/opserver.py`. Standard library only (and the import-free root exception,
`core/errors`), so the CLI starts fast.

The client does not trust the socket's path either: before a byte is sent, it asks
the kernel who is listening (`SO_PEERCRED`) and checks that process is the gateway
that recorded itself at start (`gateway.json` beside the socket, written by
`own_record`), of the operator's uid, in this command's namespaces, below no
registered run, under directories nobody else may write (`check_server`). A socket
rebuilt by an agent, or served from a sandbox, gets nothing: no passphrase, no answer.
"""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bastion.core.errors import BastionError

MAX_LINE = 1 << 20  # a request; the gateway refuses a longer one
# An answer: the gateway is the operator's own process, and its audit views grow with
# the journal (4,000 requests make `audit activity` about 4 MB).
MAX_REPLY = 1 << 30
MAX_DEPTH = 32  # arrays and objects inside each other, on either socket

_TOKEN = re.compile(rb'[][{}"]')
_REST_OF_STRING = re.compile(rb'(?:[^"\\]++|\\.)*+"', re.DOTALL)


class OperatorError(BastionError):
    """An operator request failed; the message is for a person to read."""


class GatewayNotRunning(OperatorError):
    pass


class WrongServer(OperatorError):
    """The operator socket is answered by a process that is not the recorded gateway;
    the message names it, and nothing was sent to it."""


def too_deep(data: bytes, limit: int = MAX_DEPTH) -> bool:
    """Does this JSON text nest more than `limit` arrays and objects? A cheap scan
    before parsing: `json.loads` recurses once per level, and a line of `[`s would
    exhaust the interpreter's stack. Brackets inside strings do not count."""
    if data.count(b"[") + data.count(b"{") <= limit:
        return False
    depth, pos = 0, 0
    while (token := _TOKEN.search(data, pos)) is not None:
        pos = token.end()
        if token.group() == b'"':  # skip the string; an unterminated one ends the text
            rest = _REST_OF_STRING.match(data, pos)
            if rest is None:
                return False
            pos = rest.end()
            continue
        depth += 1 if token.group() in b"[{" else -1
        if depth > limit:
            return True
    return False


def loads_line(data: bytes, limit: int = MAX_DEPTH) -> Any:
    """One JSON line of bounded depth (the caller bounds its length); `ValueError`
    for anything else, with a reason a person can read."""
    if too_deep(data, limit):
        raise ValueError(f"JSON nested more than {limit} levels deep")
    try:
        return json.loads(data)
    except RecursionError:  # the scan above makes this unreachable; kept as a backstop
        raise ValueError("JSON nested too deeply") from None


def connect(path: Path, timeout: float, verify: bool = True) -> socket.socket:
    """A connection to the running gateway's operator socket, or GatewayNotRunning
    saying which of the two usual reasons it is and what to do; WrongServer when
    another process answers there (`verify`: `check_server`, before anything is sent)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(path))
    except (FileNotFoundError, ConnectionRefusedError) as exc:
        sock.close()
        why = (
            f"no operator socket at {path}"
            if isinstance(exc, FileNotFoundError)
            else f"nothing answers at {path}, left by a gateway that did not stop cleanly"
        )
        raise GatewayNotRunning(
            f"the gateway is not running ({why}); start it with `bastion daemon`"
        ) from exc
    except OSError:
        sock.close()
        raise
    if verify:
        try:
            check_server(sock, path)
        except WrongServer:
            sock.close()
            raise
    return sock


def call(path: Path, op: str, timeout: float = 30.0, verify: bool = True, **args: Any) -> Any:
    """Send one request to a running gateway and return its result (`verify`: only
    once `check_server` found the recorded gateway at the other end)."""
    sock = connect(path, timeout, verify)
    with sock, sock.makefile("rwb") as f:
        f.write(json.dumps({"op": op, **args}).encode() + b"\n")
        f.flush()
        line = f.readline(MAX_REPLY)
    if not line:
        raise OperatorError("the gateway closed the connection without answering")
    if not line.endswith(b"\n"):
        raise OperatorError("the gateway's answer was cut off before its end")
    try:
        reply = loads_line(line)
    except ValueError as exc:
        raise OperatorError(f"the gateway answered something that is not JSON: {exc}") from None
    if not isinstance(reply, dict):
        raise OperatorError("the gateway answered something that is not a JSON object")
    if not reply.get("ok"):
        raise OperatorError(reply.get("error") or "the gateway refused the request")
    return reply.get("result")


# -- who answers ---------------------------------------------------------------------------

RECORD_NAME = "gateway.json"  # beside the socket (home.Home.gateway_record)
RUNS_NAME = "runs.json"  # beside it too: the live registered runs (gateway/lifetime.save_runs)
NAMESPACES = ("pid", "user", "mnt", "net")
BOOT_ID = "/proc/sys/kernel/random/boot_id"
_ANCESTORS = 64  # how far up the server's process tree a registered run is looked for


@dataclass(frozen=True)
class Server:
    """What this command saw of the process listening on the operator socket, and of
    itself, for `judge_server`. None: it could not be read."""

    pid: int  # SO_PEERCRED: the process that listened; 0 when it is not visible from here
    uid: int
    start_ticks: int | None
    boot: str | None  # this kernel boot
    namespaces: dict[str, str | None]  # /proc/PID/ns links (need ptrace-read access)
    own: dict[str, str | None]  # this command's
    depth: tuple[int | None, int | None]  # PID namespace levels (NSpid): the server's, ours
    uid_map: tuple[str | None, str | None]  # the server's, ours (world-readable, unlike ns)
    record: dict[str, Any] | str  # the gateway's record of itself, or why there is none
    run: str | None  # the registered run the server descends from, named
    trusted: frozenset[int]  # the uids that may serve the socket
    open_dir: str | None  # a directory above the socket that another uid may write


def own_record() -> dict[str, Any]:
    """What the gateway writes at start into `gateway.json` (and this client checks the
    socket's server against): its pid, start, kernel boot, uid and namespaces."""
    pid = os.getpid()
    return {
        "pid": pid,
        "start_ticks": _start_ticks(pid),
        "boot": _read(BOOT_ID),
        "uid": os.geteuid(),
        "namespaces": {ns: _link(f"/proc/self/ns/{ns}") for ns in NAMESPACES},
    }


def check_server(sock: socket.socket, path: Path) -> None:
    """WrongServer, saying who answers and what was expected, unless the process at the
    other end of `sock` is the gateway recorded beside `path`."""
    problem = judge_server(observe_server(sock, path), path)
    if problem is not None:
        raise WrongServer(problem)


def judge_server(s: Server, path: Path | str) -> str | None:
    """None when `s` is the recorded gateway, else one sentence: what answers, what was
    expected, and that nothing was sent. Pure. Namespace links a non-root command cannot
    read (the gateway is not dumpable) are judged by NSpid and uid_map, which anyone may
    read; another mount or network namespace than ours needs another user namespace for
    a process without privileges, which uid_map shows. The mount namespace may also be
    the one the gateway recorded as its own (systemd's PrivateTmp gives it one)."""
    nothing = "nothing was sent"
    record = Path(path).with_name(RECORD_NAME)
    if s.open_dir is not None:
        return (
            f"{s.open_dir} is above the operator socket {path} and another user may write "
            f"it, so anyone could have put that socket there; {nothing} (chmod go-w it, "
            "or chown it to the operator)"
        )
    if s.pid <= 0:
        return (
            f"the operator socket {path} is answered by a process this command cannot see "
            f"(another PID namespace), not by the gateway; {nothing}"
        )
    who = f"the operator socket {path} is answered by pid {s.pid}"
    if s.uid not in s.trusted:
        uids = " or ".join(str(u) for u in sorted(s.trusted))
        return f"{who} of uid {s.uid}, not by the gateway (uid {uids}); {nothing}"
    rec = s.record
    recorded = rec.get("namespaces") if isinstance(rec, dict) else None
    other = _other_namespace(s, recorded if isinstance(recorded, dict) else {})
    if other is not None:
        return f"{who}, which is in {other}: a sandbox or a container, not the gateway; {nothing}"
    if s.run is not None:
        run = f"the registered `bastion run` {s.run}"
        return f"{who}, which descends from {run}: an agent, not the gateway; {nothing}"
    if isinstance(rec, str):
        return (
            f"{who}, and no record of the gateway's process says who that should be "
            f"({rec}): a gateway older than this command, or no gateway; {nothing}; "
            "restart the gateway (`bastion daemon`)"
        )
    expected = rec.get("pid")
    if expected != s.pid:
        return (
            f"{who}, not by the gateway, which recorded pid {expected} in {record}; "
            f"{nothing}: stop whatever listens there and restart the gateway"
        )
    if rec.get("start_ticks") != s.start_ticks or rec.get("boot") != s.boot:
        return (
            f"{who}, the pid the gateway recorded in {record}, but another process: that "
            f"gateway is gone and its pid was reused; {nothing}; restart the gateway"
        )
    return None


def _other_namespace(s: Server, recorded: dict[str, Any]) -> str | None:
    """Which namespace of the server is not this command's, in words; None: all are."""
    for ns in NAMESPACES:
        theirs, ours = s.namespaces.get(ns), s.own.get(ns)
        if theirs is None or ours is None or theirs == ours:
            continue
        if ns == "mnt" and theirs == recorded.get("mnt"):
            continue
        return f"another {ns} namespace than this command ({theirs}, not {ours})"
    if s.namespaces.get("pid") is None and s.depth[0] != s.depth[1]:
        levels = f"{s.depth[0]} PID namespace levels, not {s.depth[1]}"
        return f"another PID namespace than this command ({levels})"
    if s.namespaces.get("user") is None and s.uid_map[0] != s.uid_map[1]:
        return "another user namespace than this command (its uid_map differs)"
    return None


def observe_server(sock: socket.socket, path: Path) -> Server:
    """Everything `judge_server` decides on, read now: the kernel's word on who listens
    (SO_PEERCRED), /proc, the gateway's record and runs beside the socket, and the modes
    of the directories above the socket."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", creds)
    where = Path(os.path.abspath(path))
    euid = os.geteuid()
    try:
        owner = os.stat(where.parent).st_uid
    except OSError:
        owner = euid
    # root, checking a home of another uid, trusts that home's owner; nobody else does.
    trusted = frozenset({euid, 0, *((owner,) if euid == 0 else ())})
    return Server(
        pid=pid,
        uid=uid,
        start_ticks=_start_ticks(pid) if pid > 0 else None,
        boot=_read(BOOT_ID),
        namespaces={ns: _link(f"/proc/{pid}/ns/{ns}") for ns in NAMESPACES},
        own={ns: _link(f"/proc/self/ns/{ns}") for ns in NAMESPACES},
        depth=(_nspid_depth(str(pid)), _nspid_depth("self")),
        uid_map=(_read(f"/proc/{pid}/uid_map"), _read("/proc/self/uid_map")),
        record=_record(where.with_name(RECORD_NAME)),
        run=_run_above(pid, where.with_name(RUNS_NAME)) if pid > 0 else None,
        trusted=trusted,
        open_dir=_open_dir(where.parent, trusted),
    )


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _link(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


def _stat_line(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name: [state, ppid, ...]."""
    text = _read(f"/proc/{pid}/stat")
    return text.rpartition(")")[2].split() if text else None


def _start_ticks(pid: int) -> int | None:
    fields = _stat_line(pid)
    try:
        return int(fields[19]) if fields else None
    except (IndexError, ValueError):
        return None


def _nspid_depth(pid: str) -> int | None:
    for line in (_read(f"/proc/{pid}/status") or "").splitlines():
        if line.startswith("NSpid:"):
            return len(line.split()) - 1
    return None


def _record(path: Path) -> dict[str, Any] | str:
    try:
        doc = json.loads(path.read_text())
    except OSError as exc:
        return f"{path}: {exc.strerror or exc}"
    except ValueError:
        return f"{path}: not JSON"
    return doc if isinstance(doc, dict) else f"{path}: not a JSON object"


def _run_above(pid: int, runs_file: Path) -> str | None:
    """The registered run (runs.json, this kernel boot) that `pid` is or descends from."""
    try:
        doc = json.loads(runs_file.read_text())
        boot = _read(BOOT_ID)
        runs = {
            (int(e["pid"]), int(e["start_ticks"])): str(e.get("label"))
            for e in doc["runs"]
            if isinstance(e, dict) and e.get("boot") == boot
        }
    except (OSError, ValueError, KeyError, TypeError):
        return None
    for _ in range(_ANCESTORS):
        fields = _stat_line(pid)
        if not fields or pid <= 1:
            return None
        try:
            ppid, ticks = int(fields[1]), int(fields[19])
        except (IndexError, ValueError):
            return None
        if (pid, ticks) in runs:
            return f"pid {pid} ({runs[(pid, ticks)]!r})"
        pid = ppid
    return None


def _open_dir(directory: Path, trusted: frozenset[int]) -> str | None:
    """The first directory from `directory` (the socket's) up to / that group or others
    may write without the sticky bit (/tmp's may stay), or -- the socket's directory and
    the home above it -- that a uid outside `trusted` owns; named with its owner and
    mode. None when there is none. (A directory further up owned by another user is
    that user's to rename; shared layouts put homes under such directories, so it is
    not refused.)"""
    for i, d in enumerate((directory, *directory.parents)):
        try:
            st = os.stat(d)
        except OSError:
            continue
        mode = stat.S_IMODE(st.st_mode)
        if (i < 2 and st.st_uid not in trusted) or (mode & 0o022 and not mode & stat.S_ISVTX):
            return f"{d} (owner uid {st.st_uid}, mode {mode:o})"
    return None
