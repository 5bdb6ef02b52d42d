"""Strong isolation: agents run as their own user, who can reach the agent socket and nothing else.

`bastion isolate setup` (as root) creates that user and a socket directory,
and records both in `$BASTION_HOME/isolation.json` (`Isolation`); `bastion
daemon` reads the record and listens there; `bastion run --isolated` starts
agents as that user. This module is what those commands share:

- `Isolation`, `load`, `save`: the record.
- `probe`: what the agent user can actually open, list and connect to, tried
  *as that user* in a forked child (root only). Setup, `isolate check` and
  `run --isolated` trust this.
- `permission_checks`: the same questions answered from file modes, without
  privileges (for `bastion status` and a non-root `isolate check`).
- `guarantees`: the plain sentences that say which promises hold, given the
  mode and the checks. Pure.
- `command_refusal`, `reachable_plan`: what `run --isolated` checks and shapes
  before it registers: a CMD the agent user can start, a sandbox its bwrap can make.

A check is True when things are as they must be: the agent is kept out of
`home`, `vault`, `policies`, `journal`, `host_key`, `operator_socket` and
`gateway_memory`; it can use `socket_dir` (and `agent_socket` once the
gateway listens); the socket directory is `sealed` (it cannot change what is
in it).
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import pwd
import re
import secrets
import socket
import stat
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bastion import sandbox
from bastion.core.errors import BastionError
from bastion.home import Home

DEFAULT_USER = "bastion-agent"
SYSTEM_PYTHON = "/usr/bin/python3"
KEEP_OUT = ("home", "vault", "policies", "journal", "host_key", "operator_socket", "gateway_memory")
DOOR = ("socket_dir", "agent_socket", "sealed")


class IsolationError(BastionError):
    """Isolation is not set up, or cannot be: the message says what to do."""


def default_socket_dir(operator_uid: int) -> Path:
    return Path(f"/run/bastion-{operator_uid}")


@dataclass(frozen=True)
class Isolation:
    """What `isolate setup` made: the agent user and group, and the directory
    (operator-owned, group = the agent group, 2750) holding the agent socket,
    a copy of the proxy (with its wire) and the agents' ssh config."""

    user: str
    uid: int
    group: str
    gid: int
    operator_uid: int
    socket_dir: Path
    python: str = SYSTEM_PYTHON

    @property
    def agent_socket(self) -> Path:
        return self.socket_dir / "agent.sock"

    @property
    def ssh_config(self) -> Path:
        return self.socket_dir / "ssh_config"

    @property
    def proxy(self) -> Path:
        return self.socket_dir / "proxy.py"

    @property
    def wire(self) -> Path:
        """The proxy's wire (`agent/wire.py`), which the copy of the proxy imports."""
        return self.socket_dir / "wire.py"

    def as_json(self) -> dict[str, Any]:
        return {
            "user": self.user,
            "uid": self.uid,
            "group": self.group,
            "gid": self.gid,
            "operator_uid": self.operator_uid,
            "socket_dir": str(self.socket_dir),
            "agent_socket": str(self.agent_socket),
            "ssh_config": str(self.ssh_config),
            "proxy": str(self.proxy),
            "wire": str(self.wire),
            "python": self.python,
        }


def load(home: Home) -> Isolation | None:
    """The record, or None when isolation was never set up."""
    try:
        doc = json.loads(home.isolation.read_text())
        return Isolation(
            user=str(doc["user"]),
            uid=int(doc["uid"]),
            group=str(doc["group"]),
            gid=int(doc["gid"]),
            operator_uid=int(doc["operator_uid"]),
            socket_dir=Path(doc["socket_dir"]),
            python=str(doc.get("python", SYSTEM_PYTHON)),
        )
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise IsolationError(
            f"{home.isolation} is unreadable ({exc}); run `bastion isolate setup` again"
        ) from None


def save(home: Home, iso: Isolation) -> None:
    data = (json.dumps(iso.as_json(), indent=2) + "\n").encode()
    write_file(home.isolation, data, 0o600, iso.operator_uid, -1)


def write_file(path: Path, data: bytes, mode: int, uid: int, gid: int) -> None:
    """Replace `path` atomically, owned by uid:gid (-1 keeps), never following
    a symlink someone planted at `path` or at the temporary name."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if (uid, gid) != (-1, -1):
                os.fchown(f.fileno(), uid, gid)
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# -- setting it up (root) -------------------------------------------------------------------


def ensure_user(name: str) -> tuple[pwd.struct_passwd, bool]:
    """The agent user (a system user with its own group, no home, no login
    shell), created if missing; and whether it was created now."""
    import shutil
    import subprocess

    with contextlib.suppress(KeyError):
        return pwd.getpwnam(name), False
    useradd = shutil.which("useradd") or "/usr/sbin/useradd"
    with contextlib.suppress(KeyError):
        grp.getgrnam(name)  # joining it could give agents what that group may do
        raise IsolationError(f"a group named {name} exists without its user; choose another --user")
    argv = [useradd, "--system", "--user-group", "--no-create-home", "--home-dir", "/nonexistent"]
    argv += ["--shell", "/usr/sbin/nologin", "--comment", "bastion agents", name]
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except OSError as exc:
        raise IsolationError(f"cannot run useradd ({exc.strerror}); install `passwd`") from None
    try:
        return pwd.getpwnam(name), True
    except KeyError:
        raise IsolationError(f"useradd {name} failed: {r.stderr.strip()}") from None


def prepare_socket_dir(path: Path, operator_uid: int, gid: int) -> None:
    """The agents' only door: operator-owned, group = the agent group, mode
    2750. The setgid bit gives the socket the gateway binds there the agent
    group, so a gateway that is not root (nor in that group) can still hand it
    to the group."""
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise IsolationError(f"{path} exists and is not a directory; choose another --socket-dir")
    if st.st_uid not in (0, operator_uid):
        raise IsolationError(
            f"{path} already exists and belongs to uid {st.st_uid}; remove it or choose "
            "another --socket-dir"
        )
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.fchown(fd, operator_uid, gid)
        os.fchmod(fd, 0o2750)
    finally:
        os.close(fd)


def as_user(uid: int, gid: int, fn: Callable[..., Any], *args: Any) -> Any:
    """Run `fn(*args)` as uid:gid (groups: gid only) in a forked child and
    return its JSON-able result. Needs root unless uid is our own."""
    if uid == os.geteuid():
        return fn(*args)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        status = 0
        try:
            os.close(r)
            os.chdir("/")
            os.setgroups([gid])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
            out = {"ok": fn(*args)}
        except BaseException as exc:
            out = {"error": f"{type(exc).__name__}: {exc}"}
        try:
            with os.fdopen(w, "wb") as f:
                f.write(json.dumps(out).encode())
        except BaseException:
            status = 1
        os._exit(status)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    try:
        doc = json.loads(data)
    except ValueError:
        raise IsolationError(f"the check as uid {uid} died without an answer") from None
    if "error" in doc:
        raise IsolationError(f"the check as uid {uid} failed: {doc['error']}")
    return doc["ok"]


# -- what the agent user can do --------------------------------------------------------------


def attempt(kind: str, path: str) -> str:
    """One thing tried as whoever runs this: ok, denied, missing or an error."""
    try:
        if kind == "list":
            os.listdir(path)
        elif kind == "read":
            os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC))
        elif kind == "reach":
            os.stat(path)
        elif kind == "search":  # may we pass through this directory?
            os.stat(os.path.join(path, "."))
        elif kind == "connect":
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.settimeout(2)
                s.connect(path)
            finally:
                s.close()
        elif kind in ("write", "exec"):
            os.stat(path)  # denied or missing, as the path goes
            return "ok" if os.access(path, os.W_OK if kind == "write" else os.X_OK) else "denied"
        else:
            raise ValueError(kind)
    except PermissionError:
        return "denied"
    except FileNotFoundError:
        return "missing"
    except ConnectionRefusedError:
        return "ok"  # the socket was reached; nobody listens on it
    except OSError as exc:
        return f"error ({exc.strerror})"
    return "ok"


def _attempts(plan: list[tuple[str, str, str, str]]) -> list[str]:
    return [attempt(kind, path) for _, kind, path, _ in plan]


def _ancestors(path: Path) -> list[str]:
    return [str(p) for p in reversed(path.parents)] + [str(path)]


def _files(directory: Path) -> list[Path]:
    with contextlib.suppress(OSError):
        return sorted(p for p in directory.rglob("*"))
    return []


def plan(home: Home, iso: Isolation, gateway_pid: int | None) -> list[tuple[str, str, str, str]]:
    """(check, kind, path, what it must give): every attempt that answers a check."""
    out: list[tuple[str, str, str, str]] = [("home", "list", str(home.root), "denied")]
    out.append(("vault", "read", str(home.vault), "denied"))
    for key, directory in (("policies", home.policies), ("journal", home.journal)):
        out += [(key, "list", str(directory), "denied"), (key, "write", str(directory), "denied")]
        for f in _files(directory):
            out += [(key, "read", str(f), "denied"), (key, "write", str(f), "denied")]
    out.append(("host_key", "read", str(home.host_key), "denied"))
    op = home.operator_socket
    out.append(("operator_socket", "connect" if op.exists() else "reach", str(op), "denied"))
    if gateway_pid is not None:
        out.append(("gateway_memory", "read", f"/proc/{gateway_pid}/mem", "denied"))
    out += [("socket_dir", "search", p, "ok") for p in _ancestors(iso.socket_dir)]
    out += [("socket_dir", "read", str(p), "ok") for p in (iso.ssh_config, iso.proxy, iso.wire)]
    out.append(("socket_dir", "exec", iso.python, "ok"))
    if iso.agent_socket.exists():
        out.append(("agent_socket", "write", str(iso.agent_socket), "ok"))
    for p in (iso.socket_dir, iso.ssh_config, iso.proxy, iso.wire):
        out.append(("sealed", "write", str(p), "denied"))
    return out


@dataclass(frozen=True)
class Check:
    key: str
    ok: bool
    detail: str  # the first attempt that went wrong, else the first one made


def probe(home: Home, iso: Isolation, gateway_pid: int | None = None) -> list[Check]:
    """Try, as the agent user (uid, and the agent group only), everything the
    checks ask. Root only."""
    steps = plan(home, iso, gateway_pid)
    results = as_user(iso.uid, iso.gid, _attempts, steps)
    checks: dict[str, Check] = {}
    for (key, kind, path, want), got in zip(steps, results, strict=True):
        if key not in checks or (checks[key].ok and got != want):
            checks[key] = Check(key, got == want, f"{kind} {path}: {got}")
    return [checks[k] for k in (*KEEP_OUT, *DOOR) if k in checks]


# -- what `run --isolated` can start, and where its bwrap can mount ---------------------------

# The programs that run their first argument as a script: `INTERPRETER FILE` needs FILE
# readable by the agent user, or it starts and fails (126, 127) with no card to show.
INTERPRETERS = re.compile(
    r"(ba|da|z|k|mk|c|tc|fi)?sh|python[0-9.]*|pypy[0-9.]*|perl[0-9.]*|ruby[0-9.]*|"
    r"node(js)?|bun|deno|php[0-9.]*|lua[0-9.]*|tclsh[0-9.]*|Rscript|expect|awk|gawk"
)
RUN_TMP = Path("/tmp")  # the run's own (a tmpfs): what the host keeps there is not inside


def command_refusal(iso: Isolation, command: Sequence[str], path: str) -> str | None:
    """Why the agent user could not start `command` in its run, as a sentence (None: it
    can). CMD[0] must be a program it may run: a name is looked up on its PATH (`path`),
    a path must be absolute (the agent starts in a home of its own); and when CMD is
    `INTERPRETER FILE` with FILE an existing file, FILE must be one it may read. Each
    path is tried as the agent user (uid, and its group only: root only), and the
    sentence names the path and what stops it (the directory it cannot pass through,
    or the file's mode). A path in the host's /tmp is refused as such: the run's /tmp
    is its own."""
    first = command[0]
    script = None
    if len(command) > 1 and INTERPRETERS.fullmatch(os.path.basename(first)):
        arg = command[1]
        if not arg.startswith("-") and os.path.isfile(arg):
            script = arg
    for k, given in enumerate((first, script)):
        if given is None or (k == 0 and "/" not in given):
            continue  # a name: looked up on the agent's PATH
        if not os.path.isabs(given):
            return (
                f"{given} is a relative path, and the agent starts in a home of its own: "
                f"give {os.path.abspath(given)}"
            )
        real = Path(os.path.realpath(given))
        if real == RUN_TMP or real.is_relative_to(RUN_TMP):
            return (
                f"{given} is in {RUN_TMP}, and the run's {RUN_TMP} is its own: the agent would "
                f"not find it; put it where {iso.user} can read it, outside {RUN_TMP}"
            )
    why = as_user(iso.uid, iso.gid, _start_refusal, first, script, path)
    return None if why is None else f"{iso.user} {why}"


def _start_refusal(first: str, script: str | None, path: str) -> str | None:
    """As the agent user: what keeps it from running `first` (and reading `script`)."""
    program = first
    if "/" not in first:
        found = [os.path.join(d, first) for d in path.split(":") if os.path.isabs(d)]
        ready = [p for p in found if os.path.isfile(p) and os.access(p, os.X_OK)]
        if not ready:
            return f"finds no program {first} on its PATH ({path}): give the program's path"
        program = ready[0]
    why = _stopped(program, os.X_OK)
    if why is None and script is not None:
        why = _stopped(script, os.R_OK)
    return why


def _stopped(path: str, want: int) -> str | None:
    """As the agent user: what keeps it from running (os.X_OK) or reading (os.R_OK) path."""
    for d in reversed(Path(path).parents):
        if not os.access(d, os.X_OK):
            return f"cannot reach {path}: it cannot pass through {d} ({_mode_of(d)})"
    if not os.path.exists(path):
        return f"cannot reach {path}: it does not exist"
    if want == os.X_OK and not os.path.isfile(path):
        return f"cannot run {path}: it is not a file"
    if not os.access(path, want):
        verb = "run" if want == os.X_OK else "read"
        return f"cannot {verb} {path} ({_mode_of(Path(path))})"
    with contextlib.suppress(OSError), open(path, "rb") as f:  # a script is read too
        if want == os.X_OK and f.read(2) == b"#!" and not os.access(path, os.R_OK):
            return f"cannot read the script {path} ({_mode_of(Path(path))})"
    return None


def _mode_of(path: Path) -> str:
    try:
        st = os.stat(path)
    except OSError as exc:
        return exc.strerror or "no answer"
    who = []
    for lookup, ident in ((pwd.getpwuid, st.st_uid), (grp.getgrgid, st.st_gid)):
        try:
            who.append(lookup(ident)[0])
        except KeyError:
            who.append(str(ident))
    return f"{stat.filemode(st.st_mode)} {who[0]}:{who[1]}"


# bwrap's options and how many arguments each takes (bubblewrap 0.8 to 0.11):
# `reachable_plan` reads an argv through them, and leaves one with any other as it is.
BWRAP_ARITY = {
    **dict.fromkeys(
        (
            "--unshare-all", "--share-net", "--unshare-user", "--unshare-user-try",
            "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
            "--unshare-cgroup", "--unshare-cgroup-try", "--disable-userns",
            "--assert-userns-disabled", "--clearenv", "--new-session", "--die-with-parent",
            "--as-pid-1", "--level-prefix",
        ),
        0,
    ),
    **dict.fromkeys(
        (
            "--args", "--argv0", "--userns", "--userns2", "--pidns", "--uid", "--gid",
            "--hostname", "--chdir", "--unsetenv", "--lock-file", "--sync-fd", "--remount-ro",
            "--exec-label", "--file-label", "--proc", "--dev", "--tmpfs", "--mqueue", "--dir",
            "--seccomp", "--add-seccomp-fd", "--block-fd", "--userns-block-fd", "--info-fd",
            "--json-status-fd", "--cap-add", "--cap-drop", "--perms", "--size",
            "--overlay-src", "--tmp-overlay", "--ro-overlay",
        ),
        1,
    ),
    **dict.fromkeys(
        (
            "--setenv", "--bind", "--bind-try", "--dev-bind", "--dev-bind-try", "--ro-bind",
            "--ro-bind-try", "--file", "--bind-data", "--ro-bind-data", "--symlink", "--chmod",
            "--bind-fd", "--ro-bind-fd",
        ),
        2,
    ),
    "--overlay": 3,
}  # fmt: skip
BWRAP_MODIFIERS = ("--perms", "--size")  # they apply to the option that follows


def reachable_plan(argv: Sequence[str], iso: Isolation) -> list[str]:
    """bwrap's argv less each hide (`--tmpfs D`, `--ro-bind /dev/null D`) whose D the
    agent user cannot reach on the host: bwrap runs as that user, so it cannot make the
    mount point there ("Can't mkdir parents", as for a bastion home under a 0700 home
    directory), and it needs none: a path the agent user cannot reach outside, it cannot
    reach inside either (the same directories and modes; the run has no capability
    over them). Only a hide with no earlier option at a path above D is left out, so
    that the host's view is the one that counts there; an argv with an option this
    does not know is left as it is."""
    ops: list[tuple[int, int]] = []  # (start, end) of each option with its arguments
    i = 1
    while i < len(argv) and argv[i] != "--":
        n = BWRAP_ARITY.get(argv[i])
        if n is None or i + n >= len(argv):
            return list(argv)
        ops.append((i, i + 1 + n))
        i += 1 + n
    hides: list[int] = []  # indexes into ops
    above: list[str] = []  # every path an earlier option names (but /)
    for k, (a, b) in enumerate(ops):
        words = list(argv[a:b])
        dest = words[-1]
        hide = words[0] == "--tmpfs" or words[:2] == ["--ro-bind", "/dev/null"]
        if hide and not any(Path(dest).is_relative_to(p) for p in above):
            hides.append(k)
        above += [w for w in words[1:] if w.startswith("/") and w != "/"]
    if not hides:
        return list(argv)
    dests = [argv[ops[k][1] - 1] for k in hides]
    got = as_user(iso.uid, iso.gid, _attempts, [("", "reach", d, "") for d in dests])
    drop = {k for k, g in zip(hides, got, strict=True) if g == "denied"}
    for k in list(drop):  # and the --perms or --size before it
        j = k - 1
        while j >= 0 and argv[ops[j][0]] in BWRAP_MODIFIERS:
            drop.add(j)
            j -= 1
    kept = [w for k, (a, b) in enumerate(ops) if k not in drop for w in argv[a:b]]
    return [argv[0], *kept, *argv[i:]]


# -- the same, from file modes (no privileges needed) ----------------------------------------


def _perm(path: str, uid: int, gids: set[int], want: int) -> bool | None:
    """May uid (with gids, not root) do `want` (4 r, 2 w, 1 x) on path, by
    the mode bits along the way? None: a POSIX ACL is in play, no answer."""
    real = os.path.realpath(path)
    steps = [(d, 1) for d in _ancestors(Path(real))[:-1]] + [(real, want)]
    for p, bits in steps:
        try:
            st = os.stat(p)
            if any(a.startswith("system.posix_acl") for a in os.listxattr(p)):
                return None
        except OSError:
            return False if p != real else None
        if st.st_uid == uid:
            have = st.st_mode >> 6
        elif st.st_gid in gids:
            have = st.st_mode >> 3
        else:
            have = st.st_mode
        if have & bits != bits:
            return False
    return True


def permission_checks(
    home: Home, iso: Isolation, gateway_pid: int | None = None
) -> dict[str, bool]:
    """The checks of `probe`, judged from file modes: what a gateway that is
    not root can say in `status`. Unknown (an ACL, an unreadable path) is not held."""
    if iso.uid == 0:
        return {}
    gids = {iso.gid}
    out: dict[str, bool] = {}
    for key, kind, path, want in plan(home, iso, gateway_pid):
        if kind == "read" and path.startswith("/proc/"):
            ok = _proc_uid(path) not in (None, iso.uid)
        elif kind == "search":
            ok = _perm(path, iso.uid, gids, 1) is (want == "ok")
        elif kind in ("list", "read"):
            ok = _perm(path, iso.uid, gids, 4) is (want == "ok")
        elif kind == "exec":
            ok = _perm(path, iso.uid, gids, 1) is (want == "ok")
        else:  # write, connect (needs w on the socket), reach (x on its directory)
            bits, p = (1, os.path.dirname(path)) if kind == "reach" else (2, path)
            ok = _perm(p, iso.uid, gids, bits) is (want == "ok")
        out[key] = out.get(key, True) and ok
    return out


def _proc_uid(path: str) -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path(path).with_name("status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[2])  # effective
    return None


# -- what holds, in plain sentences ----------------------------------------------------------

_MEMORY = "agents cannot read the gateway's memory, where the unlocked keys live"
_STRONG = (
    (
        "agents cannot connect to the operator socket: they cannot answer cards, lock, "
        "unlock or revoke",
        ("operator_socket",),
    ),
    (
        "agents cannot read or copy the home: vault.json, the journal, the gateway's host key",
        ("home", "vault", "journal", "host_key"),
    ),
    ("agents cannot read or edit the policies", ("policies",)),
    (_MEMORY, ("gateway_memory",)),
    (
        "agents can reach the agent socket, the proxy and their ssh config, and cannot change them",
        ("socket_dir", "agent_socket", "sealed"),
    ),
)
_ADVISORY_UID = (
    "agents run as another uid than the gateway's (advisory mode: they may run as the "
    "operator's own uid)"
)
_SEALED = " (the gateway is not dumpable: no ptrace, no /proc/PID/mem, even for its own uid)"
_ADVISORY = (
    "a process of the operator's uid outside every `bastion run` tree cannot reach the operator "
    "socket (advisory mode does not stop it: it could answer cards, approve itself, lock, unlock)",
    "agents outside a sandbox (`--no-sandbox`, or not under `bastion run`) cannot copy "
    "vault.json, the journal or the gateway's host key (advisory mode does not stop it; the "
    "passphrase still protects what is inside the vault and the journal)",
    "agents outside a sandbox cannot edit the policies (advisory mode does not stop it)",
)
_UNCHECKED = {"gateway_memory": "the gateway is not running"}
_ALWAYS = (
    "a process inside a `bastion run` tree cannot answer for the operator, even as the "
    "operator's uid (the operator socket refuses it), nor can a process in another PID or "
    "user namespace than the gateway's, registered or not",
    "nothing an agent starts below `bastion run` outlives the run, double forks and setsid "
    "included (a sandboxed run not even a SIGKILL of `bastion run`; `--no-sandbox` does)",
)
_SANDBOX = (
    "a default `bastion run` gets a sandbox of its own here: it cannot see, signal or trace "
    "a process outside it, nor reach the bastion home, the operator socket, your tmux and "
    "screen sockets, $XDG_RUNTIME_DIR (session bus, systemd --user, ssh-agent) or your "
    "private keys, and it has no controlling terminal of yours"
)
_SCOPES = (
    "a sandboxed run cannot connect to an abstract unix socket made outside it (an X11 "
    "display) nor signal outside it (Landlock scopes, kernel ABI {abi})"
)


def sandbox_rows(machine: sandbox.Machine) -> list[tuple[str, bool]]:
    """What this machine's sandbox gives a run, as `guarantees` sentences."""
    rows = [
        (
            _SANDBOX
            + (f" (NOT HERE: {machine.unavailable})" if machine.unavailable is not None else ""),
            machine.unavailable is None,
        )
    ]
    scoped = machine.landlock >= sandbox.LANDLOCK_SCOPES_ABI
    text = _SCOPES.format(abi=machine.landlock)
    rows.append((text + ("" if scoped else ": too old for scopes; 6 is needed"), scoped))
    return rows


def guarantees(
    mode: str,
    agent_uid: int | None,
    checks: Mapping[str, bool],
    machine: sandbox.Machine | None = None,
) -> list[tuple[str, bool]]:
    """Which guarantees hold: (sentence, held) in a fixed order. `mode` is the
    gateway's `strong` or `advisory`; `checks` as `probe` or
    `permission_checks` give them (a check that is missing was not made, and
    its guarantee is not claimed); `machine`: what the sandbox can do here (its rows
    are left out when not given)."""
    out: list[tuple[str, bool]] = []
    if mode == "strong":
        who = f"uid {agent_uid}" if agent_uid is not None else "a uid set up by hand"
        out.append((f"agents run as another uid than the gateway's ({who})", True))
        for text, keys in _STRONG:
            missing = [k for k in keys if k not in checks]
            if keys == ("socket_dir", "agent_socket", "sealed") and "agent_socket" in missing:
                missing.remove("agent_socket")  # no socket yet: the gateway is not running
            held = not missing and all(checks[k] for k in keys if k in checks)
            why = "; ".join(sorted({_UNCHECKED.get(k, "no answer") for k in missing}))
            why = why if checks else "no isolation.json to check against"
            out.append((text + (f" (not checked: {why})" if missing else ""), held))
    else:
        sealed = checks.get("gateway_memory") is True
        out.append((_ADVISORY_UID, False))
        out += [(text, False) for text in _ADVISORY]
        out.append((_MEMORY + (_SEALED if sealed else " (advisory mode does not stop it)"), sealed))
    out += [(text, True) for text in _ALWAYS]
    if machine is not None:
        out += sandbox_rows(machine)
    return out


def status_guarantees(home: Home, mode: str, gateway_pid: int | None = None) -> list[list[Any]]:
    """For `bastion status` (the gateway passes its own mode and pid): the
    sentences of `guarantees`, judged from file modes (no privileges needed),
    as JSON-able [sentence, held] pairs. Never raises."""
    try:
        iso = load(home)
        checks = permission_checks(home, iso, gateway_pid) if iso is not None else {}
    except (IsolationError, OSError):
        iso, checks = None, {}
    if mode != "strong" and gateway_pid is not None:
        checks = {"gateway_memory": memory_sealed(gateway_pid)}
    rows = guarantees(mode, iso.uid if iso else None, checks, sandbox.machine(cached=True))
    return [[text, held] for text, held in rows]


def memory_sealed(pid: int) -> bool:
    """Is this process (not root) non-dumpable, so that no process of its own
    uid may ptrace it or read /proc/PID/mem? Linux then gives /proc/PID to root."""
    uid = _proc_uid(f"/proc/{pid}/mem")
    try:
        return uid not in (None, 0) and os.stat(f"/proc/{pid}").st_uid == 0
    except OSError:
        return False
