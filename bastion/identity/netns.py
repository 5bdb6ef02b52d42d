"""A socket in another process's network namespace, for the kernel's own tables.

A default `bastion run` has a network namespace of its own (`sandbox/layer.py`), and
the kernel answers questions about unix sockets (sock_diag, /proc/net/unix) for one
namespace at a time: the ControlMaster observation (`gateway/mux.py`) must ask in
the run's. A socket belongs to the namespace it was made in, so a child of the
gateway joins the run's namespace, makes the socket, passes it back over a socket
pair and exits: the gateway itself never leaves its own namespaces.

Joining a network namespace needs CAP_SYS_ADMIN over the user namespace that owns it.
The gateway's uid owns the layer's user namespace (it made it, through `bastion run`),
so the child joins that user namespace first (`NS_GET_USERNS` names it), as
slirp4netns does; root joins directly. An isolated run's namespaces belong to the
agent user: a gateway that is not root cannot join them, and the observation is
"not seen" (closed), as it already was for that run's /proc.

Sockets are kept per namespace (by its inode, while the namespace lives: the socket
holds it), at most `KEPT` of them.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import errno
import fcntl
import os
import socket
import struct
import threading
from collections import OrderedDict
from collections.abc import Iterator

NS_GET_USERNS = 0xB701  # _IO(0xb7, 0x1), linux/nsfs.h
NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 0x1
NLMSG_ERROR = 2
_NLMSG = struct.Struct("=IHHII")
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
KEPT = 64  # namespaces whose socket is kept


def net_inode(pid: int) -> int:
    """The inode of `pid`'s network namespace (OSError when it cannot be read)."""
    return os.stat(f"/proc/{pid}/ns/net").st_ino


_OWN = os.stat("/proc/self/ns/net").st_ino
_kept: OrderedDict[tuple[int, int, int], socket.socket] = OrderedDict()
_lock = threading.Lock()  # one question at a time on a kept socket


def own_namespace(pid: int) -> bool:
    return net_inode(pid) == _OWN


@contextlib.contextmanager
def socket_in(pid: int, family: int, kind: int, proto: int) -> Iterator[socket.socket]:
    """A socket in `pid`'s network namespace, for one question: made here for the
    gateway's own namespace (and closed after), kept for another's. OSError when it
    cannot be made (the namespace belongs to a user namespace this uid does not own,
    or the process is gone)."""
    ns = net_inode(pid)
    if ns == _OWN:
        with socket.socket(family, kind, proto) as sock:
            yield sock
        return
    key = (ns, family, proto)
    with _lock:
        sock = _kept.get(key)
        if sock is None or sock.fileno() < 0:
            sock = _kept[key] = _made_in(pid, family, kind, proto)
            while len(_kept) > KEPT:
                _, old = _kept.popitem(last=False)
                old.close()
        _kept.move_to_end(key)
        yield sock


def _made_in(pid: int, family: int, kind: int, proto: int) -> socket.socket:
    libc = ctypes.CDLL(None, use_errno=True)
    net = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    user = -1
    try:
        if os.geteuid() != 0:
            user = fcntl.ioctl(net, NS_GET_USERNS)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        child = os.fork()
        if child == 0:  # pragma: no cover - the child: syscalls, then _exit
            code = 1
            try:
                ours.close()
                if user >= 0 and libc.setns(user, CLONE_NEWUSER) != 0:
                    os._exit(2)
                if libc.setns(net, CLONE_NEWNET) != 0:
                    os._exit(3)
                made = socket.socket(family, kind, proto)
                fds = array.array("i", [made.fileno()])
                theirs.sendmsg([b"s"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
                code = 0
            finally:
                os._exit(code)
        theirs.close()
        try:
            ours.settimeout(10)
            _, anc, _, _ = ours.recvmsg(1, socket.CMSG_SPACE(4))
        finally:
            ours.close()
            _, status = os.waitpid(child, 0)
        for level, typ, data in anc:
            if level == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS and len(data) >= 4:
                fd = array.array("i", data[:4])[0]
                return socket.socket(family, kind, proto, fileno=fd)
        code = os.waitstatus_to_exitcode(status)
        step = {2: "join its user namespace", 3: "join its network namespace"}.get(code, "")
        raise OSError(f"cannot make a socket in process {pid}'s network namespace ({step})")
    finally:
        os.close(net)
        if user >= 0:
            with contextlib.suppress(OSError):
                os.close(user)


def sock_diag(nl: socket.socket, req: bytes) -> bytes | None:
    """One sock_diag request (`req`, the family's request struct) on the netlink socket
    `nl`: the answer's body, or None when the kernel has no such socket (ENOENT). OSError
    on any other answer. The one exchange the unix (`gateway/mux.py`) and the TCP
    (`tcp_peers.py`) lookups share."""
    head = _NLMSG.pack(_NLMSG.size + len(req), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, 1, 0)
    nl.sendall(head + req)
    data = nl.recv(1 << 16)
    if len(data) < _NLMSG.size:
        raise OSError("sock_diag: a short answer")
    length, kind, _, _, _ = _NLMSG.unpack_from(data, 0)
    if kind == NLMSG_ERROR:
        (err,) = struct.unpack_from("=i", data, _NLMSG.size)
        if -err == errno.ENOENT:
            return None
        raise OSError(-err, f"sock_diag: {os.strerror(-err)}")
    if kind != SOCK_DIAG_BY_FAMILY or length > len(data):
        raise OSError("sock_diag: an unexpected answer")
    return data[_NLMSG.size : length]
