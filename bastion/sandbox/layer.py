"""The layer under bubblewrap: the run's own home overlay and its own network.

bubblewrap 0.8 (Debian 12's) has no `--overlay` (0.9 added it), so the run's home
overlay is mounted here, in the child that becomes bwrap, before its exec: the
child enters a user namespace of its own (none for root, who has the right
already), a mount namespace, and (unless `--share-net`) a network namespace, then

1. mounts an overlay on `$HOME` whose lower layer is the real home and whose upper
   layer is the run's own: a tmpfs made in this mount namespace (gone with the run,
   nothing on the host's disk), or, for `--keep-home`, a directory outside the home
   kept per label (`kept_home`). Unprivileged overlayfs needs Linux 5.11 (user
   namespaces, `userxattr`); a kernel that refuses it refuses the run (`probe`).
2. binds the real directories the run was given inside the home (the project, each
   `--rw`) back over the overlay, through descriptors opened before the overlay
   covered them: the one place a write reaches the disk.
3. brings the new network namespace's loopback up; `Network` then gives it a route
   out through slirp4netns with the host's loopback not mapped.

bwrap then builds the sandbox on that view (`per_run.plan`: `--ro-bind / /`, the
overlay bound back writable), in a user namespace nested in this one: every mount
made here belongs to a more privileged namespace than the run's, so the run can
neither unmount nor move it. Why this over `fuse-overlayfs` (a daemon per run to
trust and to keep alive) or a read-only home with writable state directories (every
tool's state directory named by hand): the kernel's overlay is one mount, costs no
process, and every path, existing at start or not, lands in the upper layer.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import socket
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

from bastion.core.errors import BastionError

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
PR_SET_DUMPABLE = 4
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
SLIRP4NETNS = "slirp4netns"
SLIRP_DNS = "10.0.2.3"  # slirp4netns's resolver, forwarding to the host's
NETWORK_READY = 10.0  # seconds slirp4netns has to configure the run's network


class LayerError(BastionError, OSError):
    """The layer could not be made: which step, and the kernel's reason."""


@dataclass(frozen=True)
class Layer:
    """What the child mounts before it becomes bwrap (see the module's docstring).

    `home`: the overlay's mount point and lower layer (None: no overlay, as for
    `--private-home` or an isolated agent); `real`: directories inside `home` bound
    back over the overlay as they are on the disk (the project, each `--rw`, the agent
    socket's directory: a unix socket in an overlay's lower layer cannot be reached);
    `kept`: the upper layer's directory for `--keep-home`
    (holding `upper/` and `work/`), None for a tmpfs; `own_net`: a network namespace of
    the run's own; `root`: the caller is root (no user namespace needed)."""

    home: Path | None
    real: tuple[Path, ...] = ()
    kept: Path | None = None
    own_net: bool = True
    root: bool = False

    def enter(self) -> None:
        """In the child, before bwrap's exec. Raises LayerError: nothing may start."""
        libc = ctypes.CDLL(None, use_errno=True)

        def check(result: int, step: str) -> None:
            if result != 0:
                errno = ctypes.get_errno()
                raise LayerError(errno, f"{step}: {os.strerror(errno)}")

        uid, gid = os.geteuid(), os.getegid()
        # After a change of uid (an isolated agent's bwrap) the process is not dumpable,
        # and its /proc/self files are root's: it could not write its own maps.
        check(libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")
        flags = CLONE_NEWNS | (CLONE_NEWNET if self.own_net else 0)
        if not self.root:
            flags |= CLONE_NEWUSER
        check(libc.unshare(flags), "unshare")
        if not self.root:
            # The user is root in this namespace (slirp4netns, joining it, becomes root
            # there), and bwrap's own namespace maps the user back (`--uid`, `--gid`).
            _write("/proc/self/setgroups", "deny")
            _write("/proc/self/uid_map", f"0 {uid} 1")
            _write("/proc/self/gid_map", f"0 {gid} 1")
            uid = gid = 0
        check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
        if self.own_net:
            _loopback_up()
        if self.home is None:
            return
        home = os.fsencode(self.home)
        # Descriptors to what stays real, opened in this namespace before the overlay
        # hides it (a bind from another namespace's mount is refused).
        real = [(d, os.open(d, os.O_PATH | os.O_CLOEXEC)) for d in self.real]  # dir or file
        lower = os.open(self.home, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        if self.kept is None:
            # The upper layer: a tmpfs on the home itself, reached through a descriptor
            # once the overlay covers it; the lower layer through the one opened above.
            check(libc.mount(b"tmpfs", home, b"tmpfs", 0, b"mode=0700"), "mount the upper tmpfs")
            scratch = os.open(self.home, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            base = f"/proc/self/fd/{scratch}"
            os.mkdir(f"{base}/upper", 0o700)
            os.mkdir(f"{base}/work", 0o700)
        else:
            base = str(self.kept)
        options = f"lowerdir=/proc/self/fd/{lower},upperdir={base}/upper,workdir={base}/work"
        if not self.root or not _initial_user_namespace():
            options += ",userxattr"  # trusted.* xattrs are the initial namespace's root's
        check(libc.mount(b"overlay", home, b"overlay", 0, options.encode()), "mount the overlay")
        os.chown(self.home, uid, gid)  # the upper root is made by the mount
        for path, fd in real:
            source = f"/proc/self/fd/{fd}".encode()
            target = os.fsencode(path)
            check(libc.mount(source, target, None, MS_BIND | MS_REC, None), f"bind {path}")


def _initial_user_namespace() -> bool:
    """Whether this process is in the machine's first user namespace (whose map is the
    whole range), where root may use overlayfs's trusted xattrs."""
    try:
        with open("/proc/self/uid_map") as f:
            return f.read().split() == ["0", "0", "4294967295"]
    except OSError:
        return False


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _loopback_up() -> None:
    """`ip link set lo up` in the new network namespace (bwrap's --unshare-net does the
    same; here the namespace is the layer's, so that slirp4netns can join it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        import fcntl

        req = struct.pack("16sh", b"lo", 0)
        got = fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, req)
        flags = struct.unpack("16sh", got[:18])[1] | IFF_UP
        fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack("16sh", b"lo", flags))


def probe(layer: Layer, user: tuple[int, int] | None = None) -> str | None:
    """Make the layer once in a throwaway child (a few ms): None, or why it cannot be
    made here, so that `bastion run` refuses before it registers anything. `user`:
    (uid, gid) the child becomes first, as an isolated agent's bwrap does."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(r)
        code = 0
        try:
            if user is not None:
                os.setgroups([user[1]])
                os.setgid(user[1])
                os.setuid(user[0])
            layer.enter()
        except Exception as exc:  # every reason goes back to the parent
            os.write(w, str(exc).encode()[:4000])
            code = 1
        os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        said = f.read().decode("utf-8", "replace")
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) == 0:
        return None
    return said or f"exit {os.waitstatus_to_exitcode(status)}"


def mounts_below(home: Path) -> list[Path]:
    """The mount points strictly below `home` (a FUSE or sshfs mount, a container's
    storage): an overlay made in a user namespace cannot cover them, as the kernel locks
    every mount it copies into a less privileged namespace."""
    root = os.path.realpath(home)
    found: list[Path] = []
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                point = line.split()[4].encode().decode("unicode_escape")
                if point != root and point.startswith(root.rstrip("/") + "/"):
                    found.append(Path(point))
    except (OSError, IndexError, UnicodeDecodeError):
        return found
    return sorted(set(found))


def kept_home(uid: int, label: str) -> Path:
    """Where `--keep-home` keeps a label's upper layer: outside the home (an overlay's
    upper layer may not lie in its lower), in /var/tmp (kept across reboots), in a 0700
    directory of the user's, hidden from every run (`per_run.HIDDEN`)."""
    return kept_root(uid) / "homes" / label


def kept_root(uid: int) -> Path:
    return Path("/var/tmp") / f"bastion-{uid}"


def make_kept(path: Path) -> None:
    """The kept home's directories, each the user's and 0700; refuse one that is not."""
    root = path.parent.parent
    for d in (root, path.parent, path, path / "upper", path / "work"):
        with contextlib.suppress(FileExistsError):
            os.mkdir(d, 0o700)
        st = os.lstat(d)
        if st.st_uid != os.geteuid() or not os.path.isdir(d) or os.path.islink(d):
            raise LayerError(1, f"{d} is not a directory of yours: remove it")
        if st.st_mode & 0o077:
            os.chmod(d, 0o700)


# -- the run's network -------------------------------------------------------------------


def loopback_resolver() -> bytes | None:
    """A resolv.conf for the run when the host's names a loopback resolver (systemd-
    resolved's 127.0.0.53, a local dnsmasq), which the run's own loopback does not
    have: slirp4netns's resolver instead. None: the host's works as it is."""
    try:
        text = Path("/etc/resolv.conf").read_text()
    except OSError:
        return None
    words = [ln.split() for ln in text.splitlines()]
    servers = [w[1] for w in words if len(w) > 1 and w[0] == "nameserver"]
    if not any(s.startswith("127.") or s == "::1" for s in servers):
        return None
    kept = [ln for ln in text.splitlines() if ln.split()[:1] in (["search"], ["options"])]
    return ("\n".join([f"nameserver {SLIRP_DNS}", *kept]) + "\n").encode()


def find_slirp() -> str | None:
    return shutil.which(SLIRP4NETNS)


class Network:
    """The run's way out: slirp4netns joined to the layer's network namespace (the
    namespace of `pid`, bwrap's first process), with `--disable-host-loopback` (the
    host's 127.0.0.1 is not mapped: the console, an OpenBao, a database or a dev
    server on the operator's loopback cannot be reached), its own sandbox and seccomp
    filter, ending when this object's descriptor closes (`close`, or the death of
    `bastion run`: `--exit-fd`)."""

    def __init__(self, slirp: str, pid: int, root: bool) -> None:
        ready_r, ready_w = os.pipe()
        self._exit_r, self._exit_w = os.pipe()
        argv = [slirp, "--configure", "--mtu=65520", "--disable-host-loopback"]
        argv += ["--enable-sandbox", "--enable-seccomp"]
        argv += ["--ready-fd", str(ready_w), "--exit-fd", str(self._exit_r)]
        if not root:
            argv.append(f"--userns-path=/proc/{pid}/ns/user")
        argv += [str(pid), "tap0"]
        try:
            self.proc = subprocess.Popen(
                argv,
                pass_fds=(ready_w, self._exit_r),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
        finally:
            os.close(ready_w)
            os.close(self._exit_r)
        try:
            ready = _read_within(ready_r, NETWORK_READY)
        finally:
            os.close(ready_r)
        if ready != b"1" or self.proc.poll() is not None:
            said = self._stop()
            raise LayerError(1, f"slirp4netns could not give the run its network ({said})")

    def _stop(self) -> str:
        with contextlib.suppress(OSError):
            os.close(self._exit_w)
        try:
            _, err = self.proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        lines = (err or b"").decode("utf-8", "replace").strip().splitlines()
        return "; ".join(lines[-3:]) if lines else f"exit {self.proc.returncode}"

    def close(self) -> int:
        """The run has ended: slirp4netns has nothing left to carry or flush. It is sent
        SIGKILL and not waited for (tearing its tap device down takes the kernel some
        20 ms, which a run's end need not wait): its pid is returned, for the caller not
        to wait on either."""
        with contextlib.suppress(OSError):
            os.close(self._exit_w)
        if self.proc.poll() is None:
            self.proc.kill()
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        return self.proc.pid


def _read_within(fd: int, timeout: float) -> bytes:
    import select

    readable, _, _ = select.select([fd], [], [], timeout)
    return os.read(fd, 1) if readable else b""
