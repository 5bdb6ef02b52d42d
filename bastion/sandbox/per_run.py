"""One sandbox per agent run: what `bastion run` puts around CMD, and whether it can.

The model is turned around from "hide what matters": **a run writes only where it
was given**, and reads everything else of the user's but what `HIDDEN` lists.

- The system is read-only (`--ro-bind / /`), for every user, root included.
- `$HOME` is an overlay whose writes are the run's own (`layer.py`): gone with the
  run, or kept per label outside the home (`--keep-home`). A rename, a replace or a
  file that did not exist at start lands in the overlay, never on the disk, so
  nothing the operator runs later (start-up files, `~/.local/bin`, the Python user
  site, `~/.ssh/authorized_keys`, the bastion home's parents) can be planted.
- The **project** is the one real door: the working directory's git work tree (or
  the working directory), bound read-write as it is, with `.git/config`,
  `.git/hooks` and the other files git runs code from read-only unless `--rw-git`.
  `--rw PATH` gives one more door. A door may not hold what a run must not change
  (the bastion home, bastion's installation, the home itself or its start-up files):
  `door_refusal` says why.
- What a run must not read is hidden, one row per reason (`HIDDEN`): the bastion
  home (but the agent socket's directory, bound back read-only), browser profiles,
  password stores and keyrings, ssh private keys, `~/.gnupg`, the credential files
  of common CLIs, the deputies of the session and of the machine. `--expose PATH`
  gives one back, read-only.
- The network is the run's own (`layer.Network`: slirp4netns with the host's
  loopback not mapped): outbound works, the operator's loopback services (the
  console, an OpenBao, a database, a dev server) cannot be reached. `--share-net`
  opts out.

bubblewrap (`bwrap`, Debian's `bubblewrap` package: the tool flatpak uses, kept up
to date by the distribution) makes the namespaces: a user namespace with no
capability kept in it (`--cap-drop ALL`), a PID namespace (the run sees only its
own processes; when `bastion run` dies, `--die-with-parent` and the kernel end them
all), a mount namespace and an IPC namespace, and a new session (`--new-session`),
so the operator's terminal is nobody's controlling terminal inside and TIOCSTI
cannot push keystrokes into it. Landlock scopes (kernel ABI >= 6: no connection to
an abstract unix socket made outside the sandbox, no signal to a process outside it)
and `no_new_privs` are applied to bwrap itself before its exec (`enter_scopes`).
Variables that name what is hidden (SSH_AUTH_SOCK, TMUX, DISPLAY, ...) are left out
of the environment; SSH_AUTH_SOCK then names the run's throwaway agent
(`run_agent.py`), one key that identifies nothing, for clients that want a key.

Where the sandbox cannot be made, `preflight` says why and what fixes it
(`Unavailable`): `bastion run` then registers nothing and starts nothing.
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
from bastion.sandbox import layer as layer_mod
from bastion.sandbox.access import (
    GIT_CODE,
    GIT_REDIRECTS,
    HIDDEN,
    NOTHING_GIVEN,
    PERSISTENT,
    PRIVATE_KEY_MARKS,
    SYSTEM_DEPUTIES,
    Given,
    Hidden,
    Layout,
    check_given,
    door_refusal,
    git_after_run,
    git_before_run,
    hidden_paths,
    installation,
    is_private_key,
    layout_of,
    project_of,
)

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


NAMESPACE_WORDS = {"user": "user", "pid": "PID", "mnt": "mount", "ipc": "IPC"}

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


# -- the doors (`access` says which; these are bwrap's words for them) -------------------


def _git_code(door: Path) -> list[str]:
    """bwrap's binds that keep what git runs code from read-only in a door: its
    repository's config, hooks, info, modules and worktrees (hooks, info and modules
    created empty where missing, so that a run cannot create them), or a `.git` file's
    pointer. A `commondir` the run creates is `access.git_after_run`'s."""
    dot = door / ".git"
    if dot.is_file() and not dot.is_symlink():
        return ["--ro-bind", str(dot), str(dot)]
    if not dot.is_dir() or dot.is_symlink():
        return []
    # `.git` itself a mount point: it cannot be renamed away and rebuilt with a config of
    # the run's (the mounts inside would move with it).
    out: list[str] = ["--bind", str(dot), str(dot)]
    for name in GIT_CODE:
        p = dot / name
        if name in ("hooks", "info", "modules") and not p.exists():
            with contextlib.suppress(OSError):
                p.mkdir()
        if p.exists() and not p.is_symlink():
            out += ["--ro-bind", str(p), str(p)]
    return out


def doors(layout: Layout, given: Given) -> list[Path]:
    """Where the run's writes reach the disk: the project, then each `--rw`."""
    return [*([layout.project] if layout.project is not None else []), *given.rw]


def the_layer(layout: Layout, given: Given, *, root: bool) -> layer_mod.Layer:
    """What the child mounts before bwrap (`layer.Layer`): the home overlay (none for a
    private home or an isolated agent), the real paths inside the home bound back over it
    (the doors, the agent socket's directory), the network namespace."""
    own_net = not given.share_net
    if given.private_home or not layout.overlay:
        return layer_mod.Layer(None, own_net=own_net, root=root)
    home = Path(os.path.realpath(layout.home))
    real = [d for d in doors(layout, given) if Path(os.path.realpath(d)).is_relative_to(home)]
    agent_dir = Path(os.path.realpath(layout.agent_dir))
    if agent_dir.is_relative_to(home):
        real.append(agent_dir)
    return layer_mod.Layer(
        home,
        tuple(Path(os.path.realpath(p)) for p in real),
        kept=layout.kept,
        own_net=own_net,
        root=root,
    )


def plan(
    layout: Layout,
    given: Given = NOTHING_GIVEN,
    *,
    chdir: Path | None = None,
    make_dir: bool = False,
    root: bool = False,
    agent_auth: tuple[Path, Path] | None = None,
    resolver: int | None = None,
    ids: tuple[int, int] | None = None,
) -> list[str]:
    """bwrap's arguments up to (and including) the `--` before CMD, on the view the
    layer made (`the_layer`). `make_dir`: create `chdir` inside the sandbox (a private
    HOME under the run's own /tmp); `root`: bwrap runs as root; `agent_auth`: the run's
    throwaway ssh agent's directory, and where the run sees it (`run_agent.py`), bound
    read-only like the agent socket's; `resolver`: a descriptor holding the run's
    resolv.conf (`layer.loopback_resolver`); `ids`: the (uid, gid) the run has (default:
    this process's)."""
    argv = [*namespaces(root), "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    if not root:
        # The layer's namespace makes the user its root; the run's is the user again.
        uid, gid = ids if ids is not None else (os.geteuid(), os.getegid())
        argv += ["--uid", str(uid), "--gid", str(gid)]
    if root:
        # ssh as root sets root's own groups to run KnownHostsCommand, and a user
        # namespace denies setgroups: root's run has no user namespace and keeps
        # CAP_SETGID alone (no CAP_SETUID: it cannot become another user; no
        # CAP_SYS_ADMIN: no mount of the sandbox can be undone).
        argv += ["--cap-add", "CAP_SETGID"]
    # The system read-only; the home (the layer's overlay, with the doors inside it bound
    # back real) writable; /tmp the run's own.
    argv += ["--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    if given.private_home:
        argv += ["--tmpfs", str(layout.home)]
    elif layout.overlay:
        argv += ["--bind", str(layout.home), str(layout.home)]
    for door in doors(layout, given):
        argv += ["--bind", str(door), str(door)]
        if not given.rw_git:
            argv += _git_code(door)
    for p in layout.read_only:
        if os.path.isdir(p) or os.path.isfile(p):
            argv += ["--ro-bind", str(p), str(p)]
    exposed = [Path(os.path.realpath(p)) for p in given.expose]
    for p, _why in hidden_paths(layout):
        real = Path(os.path.realpath(p))
        if not _exists(p) or any(real.is_relative_to(e) for e in exposed):
            continue
        argv += _ssh_dir(layout.home) if p == layout.home / ".ssh" else _hide(p)
    for p in given.hide:
        argv += _hide(p)
    for p in given.expose:  # a path inside a hidden one comes back, read-only
        argv += ["--ro-bind", str(p), str(p)]
    if resolver is not None:
        argv += ["--ro-bind-data", str(resolver), os.path.realpath("/etc/resolv.conf")]
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
    """A sandbox ready to start CMD in: bwrap's argv, its environment, the Landlock ABI,
    the layer its child mounts first, and the run's network (`slirp`: None when the run
    shares the host's). `pass_fds` go to bwrap: the run's resolv.conf, and the read end
    of `hold`, on which bwrap waits before CMD until `started` has the network ready."""

    argv: tuple[str, ...]
    env: dict[str, str]
    landlock: int
    layer: layer_mod.Layer = field(default_factory=lambda: layer_mod.Layer(None, own_net=False))
    slirp: str | None = None
    pass_fds: tuple[int, ...] = ()
    hold: int | None = None

    def command(self, cmd: Sequence[str]) -> list[str]:
        return [*self.argv, *cmd]

    def preexec(self) -> None:
        self.layer.enter()
        enter_scopes(self.landlock)

    def started(self, pid: int) -> layer_mod.Network | None:
        """bwrap (`pid`) has started: give its namespace a network, then let CMD go.
        Raises LayerError (the caller ends the run: CMD has not started)."""
        net = None
        if self.slirp is not None:
            net = layer_mod.Network(self.slirp, pid, root=os.geteuid() == 0)
        if self.hold is not None:
            os.write(self.hold, b"1")
        self.close()
        return net

    def close(self) -> None:
        """The descriptors this object holds, once bwrap has them (or never will)."""
        for fd in (*self.pass_fds, *(() if self.hold is None else (self.hold,))):
            with contextlib.suppress(OSError):
                os.close(fd)


def prepare(
    layout: Layout,
    env: Mapping[str, str],
    given: Given = NOTHING_GIVEN,
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
    check_given(given, layout)
    check_door(layout)
    bwrap = find_bwrap(bwrap_path)
    preflight(bwrap, user)
    root = (user[0] if user else os.geteuid()) == 0
    slirp = None
    if not given.share_net:
        slirp = layer_mod.find_slirp()
        if slirp is None:
            raise Unavailable(
                "slirp4netns is not installed (a run's network is its own: the host's "
                "loopback services stay out of reach)",
                "install it (Debian/Ubuntu: sudo apt install slirp4netns), or give the run "
                "the host's network with `bastion run --share-net`",
            )
    layer = the_layer(layout, given, root=root)
    why = layer_mod.probe(layer, user)
    below = layer_mod.mounts_below(layer.home) if why is not None and layer.home else []
    if below:
        shown = ", ".join(str(m) for m in below[:3]) + (" ..." if len(below) > 3 else "")
        raise Unavailable(
            f"your home has mounts below it ({shown}), and an overlay made in a user "
            "namespace cannot cover a mount (the kernel locks them in it)",
            "unmount them while the run works, or give the run an empty home of its own "
            "with --private-home (the project stays)",
        )
    if why is not None:
        raise Unavailable(
            f"the run's own home and network could not be made ({why})",
            "this needs Linux 5.11 or later, with unprivileged user namespaces and "
            "overlayfs in them; a home that cannot be overlaid runs with --private-home "
            "(an empty home of the run's own), a network namespace refused with --share-net",
        )
    fds: list[int] = []
    resolver = layer_mod.loopback_resolver() if slirp is not None else None
    if resolver is not None:
        r, w = os.pipe()
        os.write(w, resolver)
        os.close(w)
        fds.append(r)
    hold = None
    extra: list[str] = []
    if slirp is not None:
        hold_r, hold = os.pipe()
        fds.append(hold_r)
        extra = ["--block-fd", str(hold_r)]
    planned = plan(
        layout,
        given,
        chdir=chdir,
        make_dir=make_dir,
        root=root,
        agent_auth=agent_auth,
        resolver=fds[0] if resolver is not None else None,
        ids=user,
    )
    argv = (bwrap, *planned[:-1], *extra, "--")
    run_env = environment(env)
    if agent_auth is not None:
        run_env["SSH_AUTH_SOCK"] = str(agent_auth[1] / "agent.sock")
    return Sandbox(argv, run_env, landlock_abi(), layer, slirp, tuple(fds), hold)


def _layer_here() -> Unavailable | None:
    """Can a run's layer be made here: slirp4netns, and a home overlay and a network
    namespace in a user namespace of the run's (tried on an empty directory)?"""
    import tempfile

    if layer_mod.find_slirp() is None:
        return Unavailable(
            "slirp4netns is not installed (a run's network is its own)",
            "install it (Debian/Ubuntu: sudo apt install slirp4netns), or give runs the "
            "host's network with `bastion run --share-net`",
        )
    with tempfile.TemporaryDirectory(prefix="bastion-layer-") as d:
        root = os.geteuid() == 0
        why = layer_mod.probe(layer_mod.Layer(Path(d), root=root))
    if why is None:
        return None
    return Unavailable(
        f"a run's home overlay or network namespace cannot be made here ({why})",
        "this needs Linux 5.11 or later with unprivileged overlayfs in user namespaces; "
        "`bastion run --private-home --share-net` goes without both",
    )


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
        told = _layer_here()
    except Unavailable as exc:
        told = exc
    try:
        abi = landlock_abi()
    except OSError:
        abi = 0
    return Machine(told, abi)


__all__ = [  # the access model's names, used here and named by the room's face
    "GIT_CODE",
    "GIT_REDIRECTS",
    "HIDDEN",
    "PERSISTENT",
    "PRIVATE_KEY_MARKS",
    "SYSTEM_DEPUTIES",
    "Given",
    "Hidden",
    "Layout",
    "check_given",
    "door_refusal",
    "git_after_run",
    "git_before_run",
    "hidden_paths",
    "installation",
    "is_private_key",
    "layout_of",
    "project_of",
]
