"""Who is asking: peer credentials, the process chain, the subject.

Authority is bound to a live process, never to anything a client says about
itself. The kernel tells us the peer of the agent socket (SO_PEERCRED, pinned
with a pidfd where SO_PEERPIDFD exists); /proc tells us its ancestors. The
*subject* -- the process a person approves -- is the first ancestor above the
`ssh` client that is not a shell or a wrapper (docs/architecture.md, "Who is
asking"). This module observes; `core/subject.subject_index` decides where
the subject stands, from what it observed of each process.

Everything read here can race with the processes it describes, so every
ancestor's start time is read again after the walk: a pid that was reused
while we looked is caught, and the request is refused rather than
mis-attributed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import functools
import os
import re
import secrets
import select
import socket
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

import psutil

from bastion.core.errors import BastionError
from bastion.core.subject import (
    NoSubject,
    Observed,
    Peer,
    ProcessInfo,
    Run,
    Subject,
    SubjectKind,
    subject_index,
)
from bastion.identity.images import ExeHasher, Images, stat_fields

DEFAULT_WRAPPERS = frozenset(
    {"sh", "bash", "dash", "zsh", "fish", "ksh", "mksh", "env", "timeout", "nice", "nohup"}
)
# Processes the walk never climbs into: what hosts terminal sessions for people (and
# for many agents at once), so approving one would approve every session inside it.
# Matched against the basename of the executable the kernel resolved, so a name is the
# real binary's, not the command's: Debian's `vim` runs /usr/bin/vim.basic (its
# alternatives), `emacs` runs emacs-gtk, emacs-nox, ... or, built from source,
# emacs-29.1. Globs (`emacs-*`) are allowed, here and in `--terminal-host`.
DEFAULT_TERMINAL_HOSTS = frozenset(
    {
        *("tmux", "tmate", "screen", "zellij", "abduco", "dtach", "dvtm"),  # multiplexers
        *("sshd", "sshd-session", "dropbear", "mosh-server"),  # remote logins
        *("login", "su", "sudo", "doas", "agetty", "systemd", "init"),  # logins and init
        *("vim", "vim.*", "vi", "gvim", "vimx", "nvim"),  # editors with terminal windows
        *("emacs", "emacs-*", "zed", "zed-editor"),
        *("code", "code-insiders", "codium", "cursor", "windsurf"),  # VS Code: its pty host
        *("xterm", "gnome-terminal-server", "kgx", "ptyxis", "ptyxis-agent", "konsole"),
        *("alacritty", "kitty", "wezterm-gui", "wezterm-mux-server", "foot", "urxvt", "st"),
        *("tilix", "xfce4-terminal", "mate-terminal", "lxterminal", "qterminal", "ghostty"),
        *("terminology", "sakura", "yakuake", "roxterm", "rio", "contour"),  # emulators
    }
)
_GLOB = re.compile(r"[*?\[]")
_SO_ACCEPTCON = 0x10000  # /proc/net/unix Flags: a listening socket
_PRUNE_EVERY = 256  # identifications between sweeps of launch nonces of exited processes
# Not yet in Python's socket module; value from <asm-generic/socket.h>.
SO_PEERPIDFD = 77
_MAX_CHAIN = 64


def name_matcher(names: Iterable[str]) -> re.Pattern[str]:
    """One pattern for executable names, each exact or a glob (fnmatch)."""
    parts = [fnmatch.translate(n) if _GLOB.search(n) else re.escape(n) + r"\Z" for n in names]
    return re.compile("|".join(parts) or r"(?!)")


class IdentityError(BastionError):
    """The peer could not be identified; the request must not proceed."""


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process that connected, as the kernel saw it."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


def peer_pidfd(sock: socket.socket) -> int | None:
    """A pidfd for the peer, where the kernel offers one (Linux >= 6.5)."""
    try:
        fd = sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
    except OSError:
        return None
    return fd if fd >= 0 else None


def pidfd_exited(pidfd: int) -> bool:
    """A pidfd polls readable once its process has exited. poll(), not select(): a
    gateway holding a thousand connections and watches gets descriptors past 1023,
    which select() refuses (ValueError), and every identification would fail."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


class Resolver:
    """Turns a socket peer into a Subject; owns the launch nonces of this
    gateway lifetime."""

    def __init__(
        self,
        wrappers: frozenset[str] = DEFAULT_WRAPPERS,
        terminal_hosts: frozenset[str] = DEFAULT_TERMINAL_HOSTS,
        sandboxed: Callable[[int], bool] = lambda pid: False,
    ) -> None:
        """`sandboxed(pid)`: is that process in other namespaces than the gateway's
        (`procs.in_other_namespaces`; passed in, as procs reads through this module)."""
        self.wrappers = wrappers
        self._sandboxed = sandboxed
        self.terminal_hosts = terminal_hosts
        self._hosts = name_matcher(terminal_hosts)
        self.hasher = ExeHasher()
        self.images = Images()
        self._nonces: dict[tuple[int, float], str] = {}
        self._identified = 0
        self.runs: dict[tuple[int, float], Run] = {}  # registered runs: (pid, start) -> run
        # Registered fronts (`bastion mcp`): (pid, start) -> the exec image it was in then.
        self.fronts: dict[tuple[int, float], str] = {}

    def read_process(self, pid: int) -> ProcessInfo:
        # The start time first: a pid reused after this read shows a new start time
        # when the walk reads them all again, and the request is refused.
        start = _start_time(pid)
        if start is None:
            raise IdentityError(f"process {pid} vanished while being identified")
        try:
            p = psutil.Process(pid)
            with p.oneshot():
                ppid = p.ppid()
                uid = p.uids().real
                name = p.name()
                cmdline = tuple(p.cmdline())
            try:
                exe = os.readlink(f"/proc/{pid}/exe")
            except OSError:
                exe = ""
        except psutil.Error as exc:
            raise IdentityError(f"process {pid} vanished while being identified") from exc
        return ProcessInfo(
            pid=pid,
            ppid=ppid,
            start_time=start,
            uid=uid,
            exe=exe,
            exe_sha256=self.hasher.digest(pid) if exe else None,
            name=name,
            cmdline=cmdline,
        )

    def chain(self, pid: int) -> list[ProcessInfo]:
        """The peer and all its ancestors up to (not including) pid 0."""
        out: list[ProcessInfo] = []
        while pid > 0 and len(out) < _MAX_CHAIN:
            info = self.read_process(pid)
            out.append(info)
            pid = info.ppid
        return out

    def _is_wrapper(self, info: ProcessInfo) -> bool:
        """Judged by the executable the kernel resolved, never by the process name a
        process can set itself; an executable we cannot read is not a wrapper. A
        registered front counts while it is still in the exec it registered from."""
        if not info.exe:
            return False
        return _exe_name(info) in self.wrappers or self._is_front(info)

    def _is_front(self, info: ProcessInfo) -> bool:
        """A registered front, still in the exec it registered from."""
        front = self.fronts.get((info.pid, info.start_time))
        return front is not None and self.images.current(info.pid, info.start_time)[0] == front

    def _is_terminal_host(self, info: ProcessInfo) -> bool:
        return (
            info.pid == 1
            or info.pid == os.getpid()
            or (bool(info.exe) and self._hosts.match(_exe_name(info)) is not None)
        )

    def observe(self, info: ProcessInfo) -> Observed:
        """What the subject walk needs to know of one process in the chain."""
        name = _exe_name(info)
        return Observed(
            name=name,
            ssh=name == "ssh",
            wrapper=self._is_wrapper(info),
            terminal_host=self._is_terminal_host(info),
            front=bool(info.exe) and self._is_front(info),
        )

    def subject_index(self, chain: list[ProcessInfo]) -> tuple[int, SubjectKind]:
        """Where the subject stands in the chain (`core.subject.subject_index`
        decides, over what this resolver observes), or refuse."""
        found = subject_index([self.observe(p) for p in chain])
        if isinstance(found, NoSubject):
            raise IdentityError(found.reason)
        return found

    def nonce_for(self, pid: int, start_time: float) -> str:
        key = (pid, start_time)
        nonce = self._nonces.get(key)
        if nonce is None:
            nonce = secrets.token_hex(8)
            self._nonces[key] = nonce
        return nonce

    def forget(self, pid: int, start_time: float) -> None:
        self._nonces.pop((pid, start_time), None)
        self.runs.pop((pid, start_time), None)
        self.fronts.pop((pid, start_time), None)
        self.images.forget(pid, start_time)

    def identify(self, sock: socket.socket) -> Peer:
        """Read who is on the other end of `sock`, or refuse."""
        pid, uid, gid = peer_credentials(sock)
        if pid <= 0:
            raise IdentityError("the kernel did not report a peer process")
        pidfd = peer_pidfd(sock)
        try:
            full = self.chain(pid)
            if not full or full[0].uid != uid:
                raise IdentityError("the peer process changed while being identified")
            idx = self.run_index(full)
            kind = SubjectKind.RUN
            if idx is None:
                idx, kind = self.subject_index(full)
            chain = full[: idx + 1]
            # Re-read after the walk: a pid reused meanwhile shows a new start time.
            for info in chain:
                if _start_time(info.pid) != info.start_time:
                    raise IdentityError(f"process {info.pid} changed while being identified")
            if pidfd is not None and pidfd_exited(pidfd):
                raise IdentityError("the connecting process exited while being identified")
        finally:
            if pidfd is not None:
                os.close(pidfd)
        s = chain[-1]
        if s.pid == 1:
            raise IdentityError(
                "the ssh client has no parent process left to approve (orphaned under pid 1); "
                "run ssh from the agent process itself"
            )
        image, watch = self.images.current(s.pid, s.start_time)
        subject = Subject(
            pid=s.pid,
            start_time=s.start_time,
            exe=s.exe,
            exe_sha256=s.exe_sha256,
            uid=s.uid,
            nonce=self.nonce_for(s.pid, s.start_time),
            run=self.runs.get((s.pid, s.start_time)),
            kind=kind,
            image=image,
            exec_watch=watch,
            sandboxed=self._sandboxed(pid),
        )
        self._identified += 1
        if self._identified % _PRUNE_EVERY == 0:
            self.prune()
        return Peer(pid=pid, uid=uid, gid=gid, chain=tuple(chain), subject=subject)

    def prune(self) -> int:
        """Forget launch nonces and runs of processes that exited (not every exit is
        watched: a process that connected but never asked leaves a nonce behind)."""
        known = {*self._nonces, *self.fronts, *self.images.known()}
        gone = [key for key in known if _start_time(key[0]) != key[1]]
        for pid, start in gone:
            self.forget(pid, start)
        return len(gone)

    def refresh(self, subject: Subject) -> Subject:
        """The subject as it is now: same process, but the exec it is in now and the
        executable that runs. An exec after the connection was identified -- into
        the same interpreter too -- must not keep the approval."""
        if _start_time(subject.pid) != subject.start_time:
            return subject  # gone: the gate will say so (subject_alive)
        image, watch = self.images.current(subject.pid, subject.start_time)
        try:
            exe = os.readlink(f"/proc/{subject.pid}/exe")
        except OSError:
            exe = ""
        digest = self.hasher.digest(subject.pid) if exe else None
        now = (image, watch, exe, digest)
        if now == (subject.image, subject.exec_watch, subject.exe, subject.exe_sha256):
            return subject
        return dataclasses.replace(
            subject, image=image, exec_watch=watch, exe=exe, exe_sha256=digest
        )

    def run_index(self, chain: list[ProcessInfo]) -> int | None:
        """The nearest registered run above the peer: its whole tree is one subject."""
        for i, info in enumerate(chain):
            if (info.pid, info.start_time) in self.runs:
                return i
        return None

    def register_run(self, sock: socket.socket, run: Callable[[ProcessInfo], Run]) -> ProcessInfo:
        """Register the connecting process itself as a run (`run` makes its record
        from what was read). The kernel names the process; the client can only ask
        for itself."""
        info = self._registrant(sock)
        self.restore_run(info, run(info))
        return info

    def restore_run(self, info: ProcessInfo, run: Run) -> None:
        """`info` is the run `run`: registered now, or by an earlier gateway lifetime
        (`lifetime.Gateway` re-registers the runs still alive at its start)."""
        self.images.current(info.pid, info.start_time)  # the exec it registers from
        self.runs[(info.pid, info.start_time)] = run

    def register_front(self, sock: socket.socket) -> ProcessInfo:
        """Register the connecting process as a front (`bastion mcp`): like a shell,
        it acts for its parent, which becomes the subject of the commands it runs.
        That gives it nothing it did not have -- any child can exec a shell and be
        skipped the same way -- and it holds only while the process is in the exec
        it registered from (where that cannot be seen, it never holds)."""
        info = self._registrant(sock)
        if not info.exe:
            raise IdentityError("the registering process's executable cannot be read")
        self.fronts[(info.pid, info.start_time)] = self.images.current(info.pid, info.start_time)[0]
        return info

    def _registrant(self, sock: socket.socket) -> ProcessInfo:
        """The process on the other end of `sock`, still alive and the same uid."""
        pid, uid, _ = peer_credentials(sock)
        pidfd = peer_pidfd(sock)
        try:
            info = self.read_process(pid)
            if info.uid != uid or (pidfd is not None and pidfd_exited(pidfd)):
                raise IdentityError("the registering process changed while being identified")
        finally:
            if pidfd is not None:
                os.close(pidfd)
        return info


def _exe_name(info: ProcessInfo) -> str:
    """The basename of the executable the kernel resolved ("" when unreadable)."""
    return os.path.basename(info.exe.removesuffix(" (deleted)")) if info.exe else ""


_CLK_TCK = os.sysconf("SC_CLK_TCK")


@functools.cache
def _boot_time() -> float:
    """/proc/stat's btime, read once per process. The kernel computes it as the wall
    clock minus the uptime, so it moves whenever the wall clock is stepped (NTP, a VM
    resumed); a start time built on a fresh reading would make every live process look
    like another one, and every approval would be asked again."""
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    raise IdentityError("/proc/stat has no btime")


def _start_time(pid: int) -> float | None:
    """When `pid` started, as a wall-clock time that stays the same for the process's
    whole life: its start in clock ticks since boot (/proc/PID/stat, field 22), which no
    clock step changes, on this process's one boot-time reading."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return _boot_time() + int(stat_fields(data)[19]) / _CLK_TCK


def ssh_client_of(peer: Peer) -> ProcessInfo | None:
    """The `ssh` process in the peer's chain (the proxy's parent), if there is one."""
    return next((p for p in peer.chain if p.exe and _exe_name(p) == "ssh"), None)


def serves_control_socket(pid: int, holds_our_connection: bool = False) -> bool | None:
    """Does this process listen on a unix socket -- an ssh ControlMaster's control
    socket, through which other processes would ride its connection? None when
    its descriptors cannot be read (another uid, and the gateway is not root).

    `holds_our_connection`: the process is the ssh client of the connection being
    served, so one of its sockets is that connection; with no other socket it cannot
    be listening, and the table of every unix socket on the machine is not read."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[len("socket:[") : -1])
    except OSError:
        return None
    if len(inodes) <= (1 if holds_our_connection else 0):
        return False
    try:  # the table of the process's own network namespace (a run's may be its own)
        table = open(f"/proc/{pid}/net/unix")  # noqa: SIM115 - closed below
    except OSError:
        return None
    with table:
        next(table)  # Num RefCount Protocol Flags Type St Inode Path
        for line in table:
            fields = line.split()
            listening = int(fields[3], 16) & _SO_ACCEPTCON
            if len(fields) >= 7 and fields[6] in inodes and listening:
                return True
    return False


def children(pid: int) -> list[int]:
    """The direct children of a process (none if it is gone). From each thread's
    /proc/PID/task/TID/children (CONFIG_PROC_CHILDREN), not by reading the parent of
    every process on the machine, which is what psutil does and what cost a quarter
    of the gateway's time under load; psutil where the kernel lacks the file."""
    kids: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                kids += (int(k) for k in f.read().split())
    except FileNotFoundError:
        if os.path.exists(f"/proc/{pid}/task"):  # no children file in this kernel
            try:
                return [c.pid for c in psutil.Process(pid).children()]
            except psutil.Error:
                return []
        return []
    except OSError:
        return []
    return kids


def alive(pid: int, start_time: float) -> bool:
    """Is this exact process (not a reuse of its pid) still running?"""
    return _start_time(pid) == start_time


def descends_from(pid: int, ancestors: set[tuple[int, float]]) -> bool:
    """Does `pid` (or any ancestor of it) match one of (pid, start_time)?

    Used to refuse operator requests coming from an agent's own process tree.
    """
    with contextlib.suppress(psutil.Error):
        p: psutil.Process | None = psutil.Process(pid)
        while p is not None and p.pid > 0:
            if (p.pid, _start_time(p.pid)) in ancestors:
                return True
            p = p.parent()
    return False
