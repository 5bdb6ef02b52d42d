"""What one ControlMaster observation may cost the gateway's event loop is bounded: a
run too big to read is "not seen" (refused), never a slow check for everyone. The
real reader against real masters is tests/integration/test_mux_in_run.py."""

from __future__ import annotations

import socket

import pytest

from bastion.gateway import mux


@pytest.fixture
def connection(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway's end of a live connection, its peer inode 7."""
    live = mux.UnixSocket(inode=1, kind=socket.SOCK_STREAM, state=1, peer=7)
    monkeypatch.setattr(mux.Sockets, "get", lambda self, inode: live if inode == 1 else None)


def test_a_run_with_too_many_processes_is_not_seen(
    monkeypatch: pytest.MonkeyPatch, connection: None
) -> None:
    monkeypatch.setattr(mux, "run_tree", lambda pid: list(range(2, 2 + mux._MAX_TREE + 5)))
    read: list[int] = []
    monkeypatch.setattr(mux, "socket_inodes", lambda pid: read.append(pid) or set())
    view = mux.mux_clients(100, own_socket=1, proxy_pid=101)
    assert view.in_run is None and "more than 512 processes" in view.seen
    assert read == []  # nothing of the tree was read


def test_a_run_holding_too_many_sockets_is_not_seen(
    monkeypatch: pytest.MonkeyPatch, connection: None
) -> None:
    monkeypatch.setattr(mux, "run_tree", lambda pid: [100, 101, 102])
    monkeypatch.setattr(
        mux, "socket_inodes", lambda pid: set(range(pid * 100000, pid * 100000 + 20000))
    )
    view = mux.mux_clients(100, own_socket=1, proxy_pid=101)
    assert view.in_run is None and "more than 32768 sockets" in view.seen
