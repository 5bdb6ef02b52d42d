"""Who rides an ssh ControlMaster: observed from the kernel, for the gate.

A ControlMaster sends, on the one connection bastion identified, the commands
of every process that connects to its control socket. Inside one registered
run that is fine -- the run is the subject either way -- so the gate lets a
run's shared connection carry a command when every process connected to the
master is a process of the run (`core/gate.not_shareable`). This module
observes that, and decides nothing:

- the master is whoever holds the ssh end of this connection: the peer of the
  socket the gateway accepted (bastion's ssh config passes the connected socket
  to ssh, ProxyUseFdpass), found among the run's processes by its inode;
- each unix stream socket the master holds, but the connection and its
  listening control socket, is a mux client's (or a descriptor a client passed
  it); the kernel names each one's peer (NETLINK_SOCK_DIAG, unix_diag with
  UDIAG_SHOW_PEER, one inode at a time: unprivileged, in the gateway's network
  namespace);
- every such peer must be held by a process of the run's tree (the registered
  pid and its descendants, read from /proc: a sandbox's bwrap and its pid 1,
  the run's subreaper, keep orphans in it).

Anything unreadable, a peer held nowhere in the run (a client outside it, or
one that already left), a master that is not an ssh client: not in the run.
What one observation reads is bounded (`_MAX_TREE` processes, `_MAX_FDS`
sockets, the master's own sockets looked up one by one), so a run cannot make
the check that runs on the gateway's event loop slow for everyone; past a
bound, the run's master is "not seen" and refused.
/proc/PID/fd of a process of another uid needs a root gateway: an --isolated
run's master, seen by a gateway that is not root, is unseen (None).
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
from collections.abc import Iterable
from dataclasses import dataclass

from bastion.core.subject import Peer
from bastion.identity import children, netns

NETLINK_SOCK_DIAG = 4
UDIAG_SHOW_PEER = 0x4
UNIX_DIAG_PEER = 2
TCP_LISTEN = 10
_REQ = struct.Struct("=BBHIIIII")  # unix_diag_req
_MSG = struct.Struct("=BBBBIII")  # unix_diag_msg
_ATTR = struct.Struct("=HH")
_STREAMS = {socket.SOCK_STREAM, socket.SOCK_SEQPACKET}
_MAX_TREE = 512  # processes of one run walked at most; beyond, not seen
_DIAG = (socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG)
_MAX_FDS = 32768  # descriptors of those read at most; beyond, not seen (the walk is bounded)


@dataclass(frozen=True)
class UnixSocket:
    """One AF_UNIX socket as the kernel describes it."""

    inode: int
    kind: int  # SOCK_STREAM, SOCK_DGRAM, SOCK_SEQPACKET
    state: int  # TCP_LISTEN for a listening socket
    peer: int  # the inode of the socket it is connected to; 0 when none (or gone)


@dataclass(frozen=True)
class MuxView:
    """What was seen of the processes connected to a run's ControlMaster."""

    in_run: bool | None  # all of the run (True), one is not (False), not seen (None)
    seen: str  # in words, for the agent and the log


class Sockets:
    """AF_UNIX sockets as the kernel describes them, asked one inode at a time
    (sock_diag's exact lookup, unprivileged) and kept for one observation: the cost is
    the master's few sockets, never every socket on the machine (a run could make
    a hundred thousand)."""

    def __init__(self, others: tuple[socket.socket, ...] = ()) -> None:
        """`others`: sock_diag sockets of the run's own network namespaces (kept by
        `netns`, not closed here): a unix socket lives in the namespace of the process
        that connected, so each is asked after the gateway's own."""
        self._nl = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG)
        self._others = others
        self._seen: dict[int, UnixSocket | None] = {}

    def __enter__(self) -> Sockets:
        return self

    def __exit__(self, *_: object) -> None:
        self._nl.close()

    def get(self, inode: int) -> UnixSocket | None:
        """The socket with this inode, or None when there is none (it was closed, or it
        lives in a network namespace this observation does not ask)."""
        if inode not in self._seen:
            found = None
            for nl in (self._nl, *self._others):
                found = self._ask(nl, inode)
                if found is not None:
                    break
            self._seen[inode] = found
        return self._seen[inode]

    @staticmethod
    def _ask(nl: socket.socket, inode: int) -> UnixSocket | None:
        cookie = 0xFFFFFFFF  # INET_DIAG_NOCOOKIE: any socket with this inode
        req = _REQ.pack(socket.AF_UNIX, 0, 0, 0xFFFFFFFF, inode, UDIAG_SHOW_PEER, cookie, cookie)
        body = netns.sock_diag(nl, req)
        return None if body is None else _parse(body)


def _parse(body: bytes) -> UnixSocket:
    _, kind, state, _, inode, _, _ = _MSG.unpack_from(body, 0)
    peer = 0
    off = _MSG.size
    while off + _ATTR.size <= len(body):
        length, attr = _ATTR.unpack_from(body, off)
        if length < _ATTR.size:
            break
        if attr == UNIX_DIAG_PEER:
            (peer,) = struct.unpack_from("=I", body, off + _ATTR.size)
        off += (length + 3) & ~3
    return UnixSocket(inode, kind, state, peer)


def socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets `pid` holds (/proc/PID/fd); OSError when unreadable
    (FileNotFoundError once it exited)."""
    found: set[int] = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                found.add(int(target[len("socket:[") : -1]))
    return found


def run_tree(pid: int) -> list[int]:
    """The run's process and all its descendants, as /proc shows them now."""
    out: list[int] = []
    todo = [pid]
    while todo and len(out) < _MAX_TREE:
        p = todo.pop()
        out.append(p)
        todo += children(p)
    return out


def _exe_name(pid: int) -> str:
    try:
        return os.path.basename(os.readlink(f"/proc/{pid}/exe").removesuffix(" (deleted)"))
    except OSError:
        return ""


def observe(peer: Peer, own_socket: int) -> MuxView:
    """`mux_clients` of the connection `peer` opened, whose subject is a registered run."""
    return mux_clients(peer.subject.pid, own_socket, peer.pid)


def mux_clients(run_pid: int, own_socket: int, proxy_pid: int) -> MuxView:
    """Is every process connected to the ControlMaster that holds this connection a
    process of the run `run_pid`? `own_socket`: the inode of the gateway's end of the
    connection; `proxy_pid`: the process that connected (`bastion proxy`, which may
    still hold the socket it handed to ssh for a moment)."""
    try:
        tree = run_tree(run_pid)  # walked once: the namespaces and the holders both read it
        with contextlib.ExitStack() as stack:
            others = tuple(
                stack.enter_context(netns.socket_in(pid, *_DIAG)) for pid in _other_namespaces(tree)
            )
            table = stack.enter_context(Sockets(others))
            return _mux_clients(table, tree, own_socket, proxy_pid)
    except OSError as exc:
        return MuxView(None, f"the kernel's unix sockets could not be read: {exc}")


def _other_namespaces(tree: list[int]) -> list[int]:
    """One process of each network namespace of the run's tree but the gateway's own
    (a sandboxed run has one of its own: `sandbox/layer.py`)."""
    seen: dict[int, int] = {}
    for pid in tree:
        with contextlib.suppress(OSError):
            ns = netns.net_inode(pid)
            if not netns.own_namespace(pid):
                seen.setdefault(ns, pid)
    return list(seen.values())


def _mux_clients(table: Sockets, tree: list[int], own_socket: int, proxy_pid: int) -> MuxView:
    ours = table.get(own_socket)
    if ours is None or ours.peer == 0:
        return MuxView(False, "the ssh client's end of this connection is gone")
    holders: dict[int, set[int]] = {}
    unreadable: list[int] = []
    if len(tree) >= _MAX_TREE:
        return MuxView(None, f"the run has more than {_MAX_TREE} processes")
    read = 0
    for pid in tree:
        try:
            inodes = socket_inodes(pid)
        except FileNotFoundError:
            continue
        except OSError:
            unreadable.append(pid)
            continue
        read += len(inodes)
        if read > _MAX_FDS:
            return MuxView(None, f"the run's processes hold more than {_MAX_FDS} sockets")
        for inode in inodes:
            holders.setdefault(inode, set()).add(pid)
    masters = holders.get(ours.peer, set()) - {proxy_pid}
    why_unseen = _unreadable(unreadable)
    if not masters:
        if why_unseen:
            return MuxView(None, why_unseen)
        return MuxView(False, "the ssh client holding this connection is not a process of the run")
    for master in sorted(masters):
        name = _exe_name(master)
        if name != "ssh":
            return MuxView(
                False,
                f"this connection is held by {name or 'an unreadable program'} (pid {master}), "
                "not by the ssh client itself (bastion's ssh config hands it to ssh: "
                "ProxyUseFdpass yes)",
            )
        problem = _outsider(master, ours.peer, table, holders)
        if problem is not None:
            return (
                MuxView(None, f"{problem}; {why_unseen}") if why_unseen else MuxView(False, problem)
            )
    n = sum(len(_clients(m, ours.peer, table, holders)) for m in masters)
    return MuxView(True, f"{n} connected to its master (pid {min(masters)}), all of the run")


def _clients(
    master: int, connection: int, table: Sockets, holders: dict[int, set[int]]
) -> list[UnixSocket]:
    """The master's connected unix stream sockets but the connection itself. A socket
    the master holds that no table knows (closed meanwhile, or in a network namespace
    that is neither the gateway's nor the run's: another run's) stands as one whose
    peer is unknown, so `_outsider` refuses it."""
    mine = sorted(i for i, pids in holders.items() if master in pids and i != connection)
    found = {i: table.get(i) for i in mine}
    if None in found.values():
        try:
            still = socket_inodes(master)
        except OSError:
            still = set(mine)
        found = {
            i: u or UnixSocket(i, socket.SOCK_STREAM, 0, 0)
            for i, u in found.items()
            if u is not None or i in still
        }
    return [
        u for u in found.values() if u is not None and u.kind in _STREAMS and u.state != TCP_LISTEN
    ]


def _outsider(
    master: int, connection: int, table: Sockets, holders: dict[int, set[int]]
) -> str | None:
    """What connects to `master` from outside the run, or None."""
    for client in _clients(master, connection, table, holders):
        if client.peer == 0:
            return f"a process connected to its master (pid {master}) has left or is unknown"
        if client.peer not in holders:
            return (
                f"a process outside the run (or of another run) is connected to its master "
                f"(pid {master})"
            )
    return None


def _unreadable(pids: Iterable[int]) -> str:
    pids = sorted(pids)
    if not pids:
        return ""
    uids = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            uids.add(os.stat(f"/proc/{pid}").st_uid)
    who = ", ".join(f"uid {u}" for u in sorted(uids)) or "another uid"
    return (
        f"the descriptors of {len(pids)} of the run's processes ({who}) cannot be read by "
        f"the gateway (uid {os.getuid()})"
    )
