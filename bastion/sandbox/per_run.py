"""One sandbox per agent run: what `bastion run` puts around CMD, and whether it can.

The sandbox is made by bubblewrap (`bwrap`, Debian's `bubblewrap` package: the
tool flatpak and the agent programs themselves use, kept up to date by the
distribution) and two kernel features it leaves to its caller:

- **namespaces** (bwrap): a user namespace (no privilege needed, and no
  capability kept in it: `--cap-drop ALL`, so not even a run started by root
  can undo a mount), a PID namespace (the run sees only its own processes, so
  it cannot list, signal or ptrace anything outside; when `bastion run` dies,
  `--die-with-parent` kills the namespace's first process and the kernel the
  rest), a mount namespace (what is hidden below) and an IPC namespace; and a
  new session (`--new-session`), so the operator's terminal is nobody's
  controlling terminal inside and TIOCSTI cannot push keystrokes into it.
- **Landlock** scopes (kernel ABI >= 6): no connection to an abstract unix
  socket made outside the sandbox (an X11 display, a session bus on an
  abstract address) and no signal to a process outside it; plus
  `no_new_privs`, so no setuid or setgid program (crontab, at) gains anything.
  Both are applied to `bwrap` itself, before its exec (`enter_scopes`), and
  every process of the run inherits them.

Inside, the agent sees the user's files and the network as before, except
what `plan` hides: $BASTION_HOME (vault, journal, policies, host key, the
operator socket) with only the agent socket's directory bound back,
read-only; $XDG_RUNTIME_DIR (D-Bus session bus, systemd --user, ssh-agent,
Wayland); ~/.gnupg; the private keys in ~/.ssh (its other files stay, read
only); tmux and screen sockets; the cron and at spools; the system bus and
systemd's private socket; and /tmp, which is the run's own. Variables that
name what is hidden (SSH_AUTH_SOCK, TMUX, DISPLAY, ...) are left out of the
environment; SSH_AUTH_SOCK then names the run's throwaway agent, one key that
identifies nothing (`run_agent.py`), for clients that want a key to connect.

Where the sandbox cannot be made, `preflight` says why and what fixes it
(`Unavailable`): `bastion run` then starts nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import stat
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bastion.core.errors import BastionError

BWRAP = "bwrap"
NAMESPACES = ("--unshare-user", "--unshare-pid", "--unshare-ipc")
# Variables that point at what the sandbox hides, or at a deputy outside it.
DROPPED_ENV = frozenset(
    {
        "SSH_AUTH_SOCK",
        "SSH_AGENT_PID",
        "GPG_AGENT_INFO",
        "TMUX",
        "TMUX_PANE",
        "STY",
        "WINDOW",
        "DBUS_SESSION_BUS_ADDRESS",
        "DISPLAY",
        "WAYLAND_DISPLAY",
        "XAUTHORITY",
        "GNOME_KEYRING_CONTROL",
    }
)
# Deputies of the whole machine: they act for whoever may reach them (for root, the
# system bus and systemd run anything), and no agent needs them to do its work.
SYSTEM_DEPUTIES = (
    "/run/dbus/system_bus_socket",
    "/run/systemd/private",
    "/run/systemd/io.system.ManagedOOM",
    "/var/spool/cron",
    "/var/spool/at",
    "/var/spool/atjobs",
    "/run/screen",
    # Container and VM managers: whoever reaches them (a member of the docker group) is root.
    "/run/docker.sock",
    "/run/containerd",
    "/run/podman",
    "/run/libvirt",
    "/run/snapd.socket",
    "/run/snapd-snap.socket",
)
# What the operator will run later, so a run must not change it: the shell's start-up
# files, what a session starts by itself, and (see `installation`) bastion itself.
PERSISTENT = (
    ".bashrc",
    ".bash_profile",
    ".bash_login",
    ".bash_logout",
    ".profile",
    ".zshrc",
    ".zshenv",
    ".zprofile",
    ".zlogin",
    ".kshrc",
    ".mkshrc",
    ".inputrc",
    ".tmux.conf",
    ".screenrc",
    ".config/fish",
    ".config/tmux",
    ".config/systemd",
    ".config/autostart",
    ".config/environment.d",
    ".local/share/systemd",
    ".config/bastion",
)
# A run started by root owns what root owns: the system's own files stay read-only.
ROOT_READ_ONLY = ("/etc", "/usr", "/boot", "/opt", "/var/lib", "/var/spool")
NAMESPACE_WORDS = {"user": "user", "pid": "PID", "mnt": "mount", "ipc": "IPC"}
PRIVATE_KEY_MARKS = (b"PRIVATE KEY", b"SSH2 ENCRYPTED PRIVATE KEY", b"PuTTY-User-Key-File")

# Landlock (linux/landlock.h); the syscall numbers are the same on every architecture.
SYS_LANDLOCK_CREATE_RULESET = 444
SYS_LANDLOCK_RESTRICT_SELF = 446
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET = 1
LANDLOCK_SCOPE_SIGNAL = 2
LANDLOCK_SCOPES_ABI = 6
PR_SET_NO_NEW_PRIVS = 38


class Unavailable(BastionError):
    """The sandbox cannot be made here: `reason` says why, `fix` what to do."""

    def __init__(self, reason: str, fix: str) -> None:
        super().__init__(f"{reason}; {fix}")
        self.reason = reason
        self.fix = fix


@dataclass(frozen=True)
class Given:
    """What a run was given beyond the defaults: the run's card shows each."""

    hide: tuple[Path, ...] = ()
    ro: tuple[Path, ...] = ()
    private_home: bool = False

    def words(self) -> list[str]:
        out = [f"--hide {p}" for p in self.hide] + [f"--ro {p}" for p in self.ro]
        return out + (["--private-home"] if self.private_home else [])


@dataclass(frozen=True)
class Layout:
    """Where things are for the user whose agent runs: read once, from the outside."""

    bastion_home: Path
    agent_dir: Path  # the agent socket's directory: bound back, read-only
    home: Path  # the user's HOME
    runtime_dir: Path | None  # $XDG_RUNTIME_DIR (or /run/user/UID)
    cwd: Path
    extra_hidden: tuple[Path, ...] = field(default=())  # SSH_AUTH_SOCK, TMUX_TMPDIR, ...
    read_only: tuple[Path, ...] = field(default=())  # rc files, autostart, bastion itself


def layout_of(bastion_home: Path, agent_socket: Path, env: Mapping[str, str]) -> Layout:
    """The layout for this process's user, from its environment."""
    home = Path(env.get("HOME") or os.path.expanduser("~"))
    runtime = env.get("XDG_RUNTIME_DIR") or f"/run/user/{os.getuid()}"
    extra = []
    for name in ("SSH_AUTH_SOCK", "TMUX_TMPDIR", "SCREENDIR"):
        if env.get(name):
            extra.append(Path(env[name]))
    if env.get("TMUX"):  # "socket,pid,session": a server started with -S lives anywhere
        extra.append(Path(env["TMUX"].split(",")[0]))
    extra.append(home / ".screen")
    return Layout(
        bastion_home=bastion_home.absolute(),
        agent_dir=agent_socket.absolute().parent,
        home=home,
        runtime_dir=Path(runtime),
        cwd=Path.cwd(),
        extra_hidden=tuple(extra),
        read_only=(*(home / p for p in PERSISTENT), *installation()),
    )


def installation() -> tuple[Path, ...]:
    """bastion as the operator runs it: its package (for a checkout installed in
    place, the checkout), the Python environment it runs in and its `bastion`
    command. A run that could rewrite them would rewrite the next `bastion approve`;
    bound read-only after `/tmp` is hidden, they stay there for a run wherever they
    live (a checkout under /tmp included)."""
    import sys

    import bastion

    package = Path(bastion.__file__).resolve().parent
    checkout = package.parent
    if (checkout / "pyproject.toml").is_file() and (checkout / ".git").exists():
        package = checkout
    found = [package, Path(sys.prefix).resolve()]
    command = shutil.which("bastion")
    if command:
        found.append(Path(command).resolve())
    return tuple(found)


def _exists(p: Path) -> bool:
    return os.path.lexists(p)


def _hide(p: Path) -> list[str]:
    """Arguments that hide p: an empty tmpfs over a directory, /dev/null over anything else."""
    real = Path(os.path.realpath(p))
    try:
        st = os.stat(real)
    except OSError:
        return []
    if stat.S_ISDIR(st.st_mode):
        return ["--tmpfs", str(real)]
    return ["--ro-bind", "/dev/null", str(real)]


def is_private_key(path: Path) -> bool:
    """A file in ~/.ssh that holds a private key (unreadable counts as one: closed)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return True
    return any(mark in head for mark in PRIVATE_KEY_MARKS)


def _ssh_dir(home: Path) -> list[str]:
    """~/.ssh without its private keys: an empty tmpfs, with every other regular file
    (config, known_hosts, *.pub) bound back read-only. Sockets in it (the operator's
    own ControlMaster connections) and files added later stay out."""
    d = Path(os.path.realpath(home / ".ssh"))
    if not d.is_dir():
        return []
    out = ["--tmpfs", str(d)]
    with contextlib.suppress(OSError):
        for entry in sorted(os.scandir(d), key=lambda e: e.name):
            if entry.is_file(follow_symlinks=False) and not is_private_key(Path(entry.path)):
                out += ["--ro-bind", entry.path, entry.path]
    return out


def namespaces(root: bool) -> tuple[str, ...]:
    """The run's namespaces: a user namespace unless bwrap runs as root (see `plan`)."""
    return NAMESPACES[1:] if root else NAMESPACES


def plan(
    layout: Layout,
    given: Given = Given(),
    *,
    chdir: Path | None = None,
    make_dir: bool = False,
    root: bool = False,
    agent_auth: tuple[Path, Path] | None = None,
) -> list[str]:
    """bwrap's arguments up to (and including) the `--` before CMD. `make_dir`: create
    `chdir` inside the sandbox (a private HOME under the run's own /tmp); `root`: bwrap
    runs as root; `agent_auth`: the run's throwaway ssh agent's directory, and where the
    run sees it (`run_agent.py`), bound read-only like the agent socket's."""
    argv = [*namespaces(root), "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    if root:
        # ssh as root sets root's own groups to run KnownHostsCommand, and a user
        # namespace denies setgroups: root's run has no user namespace and keeps
        # CAP_SETGID alone (no CAP_SETUID: it cannot become another user; no
        # CAP_SYS_ADMIN: no mount of the sandbox can be undone).
        argv += ["--cap-add", "CAP_SETGID"]
    argv += ["--bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    for p in [*(ROOT_READ_ONLY if root else ()), *layout.read_only]:
        if os.path.isdir(p) or os.path.isfile(p):
            argv += ["--ro-bind", str(p), str(p)]
    hidden: list[Path] = [layout.bastion_home]
    if layout.runtime_dir is not None:
        hidden.append(layout.runtime_dir)
    hidden += [layout.home / ".gnupg", *layout.extra_hidden]
    hidden += [Path(p) for p in SYSTEM_DEPUTIES]
    for p in hidden:
        if _exists(p):
            argv += _hide(p)
    argv += _ssh_dir(layout.home)
    if given.private_home:
        argv += ["--tmpfs", str(layout.home)]
        if layout.cwd != layout.home and layout.cwd.is_relative_to(layout.home):
            argv += ["--bind", str(layout.cwd), str(layout.cwd)]  # the project it works on
    for p in given.hide:
        argv += _hide(p)
    # The one door to bastion, bound after everything that hides: its directory (not the
    # socket), so a restarted gateway's new socket is seen inside; read-only, so no run can
    # replace it for the others.
    argv += ["--ro-bind", str(layout.agent_dir), str(layout.agent_dir)]
    if agent_auth is not None:
        argv += ["--ro-bind", str(agent_auth[0]), str(agent_auth[1])]
    for p in given.ro:
        argv += ["--ro-bind", str(p), str(p)]
    if make_dir and chdir is not None:
        argv += ["--dir", str(chdir)]
    argv += ["--chdir", str(chdir or layout.cwd)]
    return [*argv, "--"]


def check_door(layout: Layout) -> None:
    """The agent socket's directory is bound into the run as it is, so it must hold
    nothing else of bastion: not the home itself (nor a directory above it), and,
    inside the home, only `run/` (the operator socket lives in `operator/`)."""
    home, door = layout.bastion_home, layout.agent_dir
    if home.is_relative_to(door) or (door.is_relative_to(home) and door != home / "run"):
        raise Unavailable(
            f"the agent socket's directory {door} would give the run the bastion home "
            f"{home} (its vault, journal and operator socket)",
            f"keep the agent socket alone in a directory of its own: the default "
            f"{home / 'run' / 'agent.sock'}, or `bastion daemon --agent-socket` in a "
            "directory outside the home",
        )


def environment(env: Mapping[str, str]) -> dict[str, str]:
    """The run's environment: the caller's, less what names a hidden deputy."""
    return {k: v for k, v in env.items() if k not in DROPPED_ENV}


def check_given(given: Given) -> None:
    """Refuse paths that do not exist (a typo must not widen or narrow nothing)."""
    for p in (*given.hide, *given.ro):
        if not p.is_absolute():
            raise ValueError(f"{p}: give an absolute path")
        if not _exists(p):
            raise ValueError(f"{p} does not exist")


# -- can it be made here? --------------------------------------------------------------------


def _sysctl(name: str) -> str | None:
    with contextlib.suppress(OSError):
        return Path("/proc/sys", *name.split(".")).read_text().strip()
    return None


def find_bwrap(path: str | None = None) -> str:
    found = shutil.which(BWRAP, path=path)
    if found is None:
        raise Unavailable(
            "bubblewrap (bwrap) is not installed",
            "install it (Debian/Ubuntu: sudo apt install bubblewrap; Fedora: sudo dnf install "
            "bubblewrap), or run the agent unsandboxed with `bastion run --no-sandbox`",
        )
    return found


def namespaces_off() -> Unavailable | None:
    """What the kernel's settings say about unprivileged user namespaces."""
    if _sysctl("kernel.unprivileged_userns_clone") == "0":
        return Unavailable(
            "unprivileged user namespaces are turned off (kernel.unprivileged_userns_clone = 0)",
            "turn them on: sudo sysctl -w kernel.unprivileged_userns_clone=1 (and in "
            "/etc/sysctl.d/ to keep it)",
        )
    for kind in ("user", "pid", "mnt", "ipc"):
        name = f"user.max_{kind}_namespaces"
        if _sysctl(name) == "0":
            return Unavailable(
                f"{NAMESPACE_WORDS[kind]} namespaces are turned off ({name} = 0)",
                f"turn them on: sudo sysctl -w {name}=15000 (and in /etc/sysctl.d/ to keep it)",
            )
    if _sysctl("kernel.apparmor_restrict_unprivileged_userns") == "1":
        return Unavailable(
            "AppArmor restricts unprivileged user namespaces "
            "(kernel.apparmor_restrict_unprivileged_userns = 1)",
            "allow bwrap an AppArmor profile with `userns` (Ubuntu 24.04 ships one in "
            "/etc/apparmor.d/bwrap-userns-restrict), or sudo sysctl -w "
            "kernel.apparmor_restrict_unprivileged_userns=0",
        )
    return None


def preflight(bwrap: str, user: tuple[int, int] | None = None) -> None:
    """Make one empty sandbox with the run's namespaces (about 3 ms), or say why not.
    `user`: (uid, gid) to try it as (`run --isolated`, as root)."""
    root = (user[0] if user else os.geteuid()) == 0
    argv = [bwrap, *namespaces(root), "--ro-bind", "/", "/", "--proc", "/proc", "--", "/bin/true"]
    try:
        r = subprocess.run(
            argv,
            capture_output=True,
            timeout=30,
            user=user[0] if user else None,
            group=user[1] if user else None,
            extra_groups=[user[1]] if user else None,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise Unavailable(f"{bwrap} cannot be started ({exc})", "reinstall bubblewrap") from None
    if r.returncode == 0:
        return
    said = r.stderr.decode("utf-8", "replace").strip().splitlines()
    told = namespaces_off()
    if told is not None:
        raise told
    raise Unavailable(
        f"bubblewrap could not make the sandbox ({said[-1] if said else f'exit {r.returncode}'})",
        "check that unprivileged user namespaces are allowed (sysctl user.max_user_namespaces, "
        "kernel.unprivileged_userns_clone, AppArmor's userns restriction) or run the agent "
        "unsandboxed with `bastion run --no-sandbox`",
    )


def landlock_abi() -> int:
    """The kernel's Landlock ABI version (0: none, or disabled at boot)."""
    libc = ctypes.CDLL(None, use_errno=True)
    version = libc.syscall(
        SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), LANDLOCK_CREATE_RULESET_VERSION
    )
    return max(int(version), 0)


class _RulesetAttr(ctypes.Structure):
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


def enter_scopes(abi: int) -> None:
    """In the child that becomes bwrap, before its exec: no_new_privs, then (ABI >= 6)
    a Landlock domain that scopes abstract unix sockets and signals to the sandbox.
    Raises OSError when the kernel refuses: the run must not start half-sandboxed."""
    libc = ctypes.CDLL(None, use_errno=True)
    zero = ctypes.c_ulong(0)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, ctypes.c_ulong(1), zero, zero, zero) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if abi < LANDLOCK_SCOPES_ABI:
        return
    attr = _RulesetAttr(0, 0, LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET | LANDLOCK_SCOPE_SIGNAL)
    fd = libc.syscall(
        SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)), 0
    )
    if fd < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset")
    try:
        if libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, fd, 0) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self")
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Sandbox:
    """A sandbox ready to start CMD in: bwrap's argv, its environment, the Landlock ABI."""

    argv: tuple[str, ...]
    env: dict[str, str]
    landlock: int

    def command(self, cmd: Sequence[str]) -> list[str]:
        return [*self.argv, *cmd]

    def preexec(self) -> None:
        enter_scopes(self.landlock)


def prepare(
    layout: Layout,
    env: Mapping[str, str],
    given: Given = Given(),
    *,
    chdir: Path | None = None,
    make_dir: bool = False,
    user: tuple[int, int] | None = None,
    bwrap_path: str | None = None,
    agent_auth: tuple[Path, Path] | None = None,
) -> Sandbox:
    """Check that the sandbox can be made, and plan it (raises Unavailable, ValueError).
    `bwrap_path`: the PATH to find bwrap on (default: this process's); `agent_auth`:
    the run's throwaway ssh agent (its directory, its path inside), offered to the run
    as SSH_AUTH_SOCK."""
    check_given(given)
    check_door(layout)
    bwrap = find_bwrap(bwrap_path)
    preflight(bwrap, user)
    root = (user[0] if user else os.geteuid()) == 0
    argv = (
        bwrap,
        *plan(layout, given, chdir=chdir, make_dir=make_dir, root=root, agent_auth=agent_auth),
    )
    run_env = environment(env)
    if agent_auth is not None:
        run_env["SSH_AUTH_SOCK"] = str(agent_auth[1] / "agent.sock")
    return Sandbox(argv, run_env, landlock_abi())


@dataclass(frozen=True)
class Machine:
    """Whether this machine can sandbox a run as this user, for `status` and `doctor`."""

    unavailable: Unavailable | None  # None: a default `bastion run` gets its sandbox
    landlock: int  # the kernel's Landlock ABI (scopes from 6)


MACHINE_TTL = 60.0  # seconds `machine(cached=True)` keeps its answer
_machine: tuple[float, Machine] | None = None


def machine(bwrap_path: str | None = None, *, cached: bool = False) -> Machine:
    """Try it (one empty sandbox, about 3 ms); never raises. `cached`: an answer up to
    MACHINE_TTL old will do (the gateway's `status`, which every `bastion approve`
    asks every few seconds, so the gateway does not start a bwrap each time)."""
    global _machine
    now = time.monotonic()
    if cached and bwrap_path is None and _machine is not None and now - _machine[0] < MACHINE_TTL:
        return _machine[1]
    found = _try(bwrap_path)
    if bwrap_path is None:
        _machine = (now, found)
    return found


def _try(bwrap_path: str | None) -> Machine:
    try:
        preflight(find_bwrap(bwrap_path))
        told = None
    except Unavailable as exc:
        told = exc
    try:
        abi = landlock_abi()
    except OSError:
        abi = 0
    return Machine(told, abi)
