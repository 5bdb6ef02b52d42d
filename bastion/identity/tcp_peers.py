"""Who is at the other end of a loopback TCP connection: the kernel's answer, read
the way `ss -p` reads it.

A unix socket names its peer (SO_PEERCRED); a TCP socket does not. Two reads do:

1. the peer's own socket, by the connection's 4-tuple: its local address is our
   remote one and the other way round. The kernel's exact lookup (NETLINK_SOCK_DIAG,
   inet_diag without a dump: one socket, unprivileged, in the gateway's network
   namespace) gives its inode and the uid that made it; where that family is not
   served, /proc/net/tcp or tcp6 is read instead (every socket: dearer);
2. the process that holds that inode: /proc/PID/fd of each process, the likely
   ones first (`first`: the peers seen last), stopping at the first that holds it.

A peer in another network namespace (a sandbox's own loopback, a container) has
no socket with that 4-tuple here: not found. A process whose /proc/PID/fd cannot
be read (another uid, for a gateway that is not root) is not seen. Not found and
not seen are answers too, and the caller refuses on them.

The first holder found is the peer. A socket is held by another process than the
one that made it only when one hands it on (SCM_RIGHTS to a process willing to take
it, or `pidfd_getfd` with ptrace rights over the maker), so a run's socket is held
outside the run only with the help of a process outside it.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import struct
from collections.abc import Iterable
from dataclasses import dataclass

from bastion.identity import netns

NETLINK_SOCK_DIAG = 4
TCP_LISTEN = 10
NOCOOKIE = 0xFFFFFFFF
_REQ_HEAD = struct.Struct("=BBBBI")  # family, protocol, ext, pad, states
_PORTS = struct.Struct("!HH")  # sport, dport: network order
_TAIL = struct.Struct("=III")  # if, cookie[2]
_MSG_HEAD = struct.Struct("=BBBB")  # family, state, timer, retrans
_MSG_TAIL = struct.Struct("=IIIII")  # expires, rqueue, wqueue, uid, inode
_SOCKID = 4 + 16 + 16 + 12  # inet_diag_sockid
_SOCKET_LINK = "socket:["


@dataclass(frozen=True)
class PeerSocket:
    """The socket at the other end of a connection, as the kernel describes it."""

    inode: int
    uid: int  # the uid that made it (its fsuid then)


def _packed(family: int, address: str) -> bytes:
    raw = ipaddress.ip_address(address).packed
    return raw + b"\0" * (16 - len(raw)) if family == socket.AF_INET else raw


def _ends(sock: socket.socket) -> tuple[int, tuple[str, int], tuple[str, int]]:
    """(family, our end, the peer's end) of a connected TCP socket."""
    ours, theirs = sock.getsockname(), sock.getpeername()
    return sock.family, (ours[0], ours[1]), (theirs[0], theirs[1])


class PeerSockets:
    """Exact lookups of peer sockets over one netlink socket (open for the gateway's
    life; a lookup is one request and one answer, about 20 us)."""

    def __init__(self) -> None:
        self._nl: socket.socket | None = None
        self._diag = True  # inet_diag answered (or was not tried yet)

    def close(self) -> None:
        if self._nl is not None:
            self._nl.close()
            self._nl = None

    def peer_of(self, sock: socket.socket) -> PeerSocket | str:
        """The socket at the other end of `sock`, or why there is none here (words)."""
        family, ours, theirs = _ends(sock)
        if self._diag:
            try:
                found = self._ask(family, theirs, ours)
            except OSError as exc:
                if exc.errno not in (errno.EPROTONOSUPPORT, errno.EINVAL, errno.EOPNOTSUPP):
                    raise
                self._diag = False  # no inet_diag in this kernel: read the tables
            else:
                if found is not None:
                    return found
                # Not found: a peer elsewhere, or inet_diag not served (ENOENT too).
                # Our own end must be there; if it is not, the kernel does not answer.
                if self._ask(family, ours, theirs) is not None:
                    return _elsewhere(theirs)
                self._diag = False
        found = _from_tables(family, theirs, ours)
        return _elsewhere(theirs) if found is None else found

    def _ask(
        self, family: int, local: tuple[str, int], remote: tuple[str, int]
    ) -> PeerSocket | None:
        """The socket whose own address is `local` and whose peer is `remote`."""
        if self._nl is None:
            self._nl = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG)
        req = (
            _REQ_HEAD.pack(family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF)
            + _PORTS.pack(local[1], remote[1])
            + _packed(family, local[0])
            + _packed(family, remote[0])
            + _TAIL.pack(0, NOCOOKIE, NOCOOKIE)
        )
        body = netns.sock_diag(self._nl, req)
        if body is None:
            return None
        if len(body) < _MSG_HEAD.size + _SOCKID + _MSG_TAIL.size:
            raise OSError("sock_diag: an unexpected answer")
        _, state, _, _ = _MSG_HEAD.unpack_from(body, 0)
        sport, dport = _PORTS.unpack_from(body, _MSG_HEAD.size)
        src = body[_MSG_HEAD.size + 4 : _MSG_HEAD.size + 20]
        dst = body[_MSG_HEAD.size + 20 : _MSG_HEAD.size + 36]
        *_, uid, inode = _MSG_TAIL.unpack_from(body, _MSG_HEAD.size + _SOCKID)
        # The lookup falls back to a listener on the address; only the very socket counts.
        same = (
            state != TCP_LISTEN
            and (sport, dport) == (local[1], remote[1])
            and src == _packed(family, local[0])
            and dst == _packed(family, remote[0])
        )
        return PeerSocket(inode, uid) if same and inode else None


def _elsewhere(theirs: tuple[str, int]) -> str:
    return (
        f"no socket in the gateway's network namespace is the other end of "
        f"{theirs[0]}:{theirs[1]} (a peer in another network namespace, or gone)"
    )


def _hex_address(family: int, address: str, port: int) -> str:
    """An address as /proc/net/tcp{,6} spells it: each 32-bit word in host order."""
    raw = ipaddress.ip_address(address).packed
    words = struct.unpack(f"={len(raw) // 4}I", raw)
    return "".join(f"{w:08X}" for w in words) + f":{port:04X}"


def _from_tables(family: int, local: tuple[str, int], remote: tuple[str, int]) -> PeerSocket | None:
    """/proc/net/tcp (or tcp6): every socket of the namespace, read for one."""
    path = "/proc/net/tcp" if family == socket.AF_INET else "/proc/net/tcp6"
    want = (_hex_address(family, *local), _hex_address(family, *remote))
    with open(path, encoding="ascii") as f:
        next(f, None)
        for line in f:
            fields = line.split()
            if len(fields) >= 10 and (fields[1], fields[2]) == want:
                inode = int(fields[9])
                return PeerSocket(inode, int(fields[7])) if inode else None
    return None


def holder(inode: int, first: Iterable[int] = ()) -> tuple[int | None, int]:
    """The first process found holding the socket `inode` (`first`'s pids are read
    before every other), or None; and how many descriptors were read to find it."""
    link = f"{_SOCKET_LINK}{inode}]"
    read = 0
    tried: set[int] = set()
    for pid in _candidates(first):
        if pid in tried:
            continue
        tried.add(pid)
        try:
            fd_dir = os.open(f"/proc/{pid}/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            continue  # gone, a kernel thread's, or not ours to read: not seen
        try:
            for name in os.listdir(fd_dir):
                read += 1
                try:
                    if os.readlink(name, dir_fd=fd_dir) == link:
                        return pid, read
                except OSError:
                    continue  # closed meanwhile
        except OSError:
            continue
        finally:
            os.close(fd_dir)
    return None, read


def _candidates(first: Iterable[int]) -> Iterable[int]:
    yield from first
    # The newest processes first: a connection usually comes from a recent one.
    yield from sorted((int(p) for p in os.listdir("/proc") if p.isdigit()), reverse=True)
