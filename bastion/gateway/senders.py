"""Who can send through an agent connection: observed from /proc, for the gate.

paramiko and fabric run each command on a channel of one connection. A later channel is
the connecting process's own only where the gateway positively sees that nothing else
can send through the connection; anything unseen refuses as a ControlMaster's channel
does (`gate.not_shareable` decides; an OpenSSH master stays under the run's rule,
`mux.py`).
"""

from __future__ import annotations

import contextlib
import os

from bastion.core.subject import Peer
from bastion.identity import alive, serves_control_socket, ssh_client_of

_TCP_LISTEN = "0A"  # /proc/net/tcp's st of a listening socket


def own_connection(peer: Peer) -> bool | None:
    """Can nothing but the client that opened this agent connection send through it?
    Asked of a later exec channel (paramiko and fabric run each command on a channel of
    one connection). Never for OpenSSH (False: its later channels are a ControlMaster's,
    under the run's rule). For another client (no ssh in the chain): True when the
    connecting process and the one it relays for (`bastion proxy` and its parent, as
    paramiko's ProxyCommand runs it) are both alive, still parent and child, and listen
    on no unix or TCP socket; False when one is seen to listen or is gone; None when
    one could not be read (another uid, a gateway that is not root).

    An observation of /proc, nothing more: the gate decides (`gate.not_shareable`)."""
    if ssh_client_of(peer) is not None:
        # OpenSSH opens a later session channel only as a ControlMaster (a ControlPersist
        # master may already have left the ssh that connected): today's rule, `mux.py`.
        return False
    first = peer.chain[0]
    if not alive(first.pid, first.start_time):
        return False
    # Its parent: in the chain, or (the connecting process is the subject, outside a
    # run) read now, while the connecting process is still its child.
    parent = peer.chain[1].pid if len(peer.chain) > 1 else first.ppid
    if parent <= 1 or _parent_of(first.pid) != parent:
        return False  # reparented: whoever relayed for it is gone
    seen = [_listens(first.pid, holds_our_connection=True), _listens(parent)]
    if True in seen:
        return False
    return None if None in seen else True


def _listens(pid: int, holds_our_connection: bool = False) -> bool | None:
    """Does this process listen on a unix or TCP socket (None: unreadable)? The socket
    tables are read only for a process holding a socket besides the connection."""
    try:
        inodes = {
            target[len("socket:[") : -1]
            for fd in os.listdir(f"/proc/{pid}/fd")
            if (target := _readlink(f"/proc/{pid}/fd/{fd}")).startswith("socket:[")
        }
    except OSError:
        return None
    if len(inodes) <= (1 if holds_our_connection else 0):
        return False
    unix = serves_control_socket(pid, holds_our_connection)
    if unix is not False:
        return unix
    # The process's own network namespace's tables (a run's may be its own).
    for table in (f"/proc/{pid}/net/tcp", f"/proc/{pid}/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as rows:
            next(rows)  # sl local_address rem_address st ... inode
            for row in rows:
                fields = row.split()
                if len(fields) > 9 and fields[3] == _TCP_LISTEN and fields[9] in inodes:
                    return True
    return False


def _parent_of(pid: int) -> int | None:
    """The parent pid of a live process, now (None: gone or unreadable)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""
