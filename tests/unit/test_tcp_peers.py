"""Who holds the other end of a loopback TCP connection (`identity/tcp_peers`), against
real sockets: this process, a child that holds the connection, both loopbacks, the
/proc/net/tcp reading where sock_diag is not asked, a peer that left; and what one
lookup costs (printed). Then the descriptor budget and the operator socket's reserve
(`gateway/descriptors`)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from bastion.core.defaults import CONSOLE_CONNECTIONS, MAX_AGENT_CONNECTIONS, RESERVE_PER_SLOT
from bastion.gateway import descriptors
from bastion.identity import tcp_peers

LOOPBACKS = [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")]


def pair(family: int, address: str) -> tuple[socket.socket, socket.socket]:
    """(the client's end, the server's end) of one loopback connection."""
    with socket.socket(family) as listener:
        try:
            listener.bind((address, 0))
        except OSError:
            pytest.skip(f"no {address} here")
        listener.listen()
        client = socket.socket(family)
        client.connect(listener.getsockname()[:2])
        served, _ = listener.accept()
    return client, served


@pytest.fixture
def peers() -> Iterator[tcp_peers.PeerSockets]:
    p = tcp_peers.PeerSockets()
    yield p
    p.close()


@pytest.mark.parametrize(("family", "address"), LOOPBACKS)
def test_the_peer_of_a_connection_is_the_process_holding_the_other_end(
    peers: tcp_peers.PeerSockets, family: int, address: str
) -> None:
    client, served = pair(family, address)
    with client, served:
        found = peers.peer_of(served)
        assert isinstance(found, tcp_peers.PeerSocket), found
        assert found.inode == os.fstat(client.fileno()).st_ino
        assert found.inode != os.fstat(served.fileno()).st_ino  # not our own end
        assert found.uid == os.getuid()
        assert tcp_peers.holder(found.inode)[0] == os.getpid()
        # The same answer from /proc/net/tcp{,6}, where sock_diag is not asked.
        ends = served.getpeername()[:2], served.getsockname()[:2]
        assert tcp_peers._from_tables(family, *ends) == found


HOLD = """
import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
print("connected", flush=True)
sys.stdin.readline()
"""


def test_a_connection_made_by_another_process_is_that_processs(
    peers: tcp_peers.PeerSockets,
) -> None:
    """The control for the one above: the holder is the child that connected, not this
    process, and the lookup names it whichever pids it reads first."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        child = subprocess.Popen(
            [sys.executable, "-c", HOLD, str(listener.getsockname()[1])],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert child.stdout is not None and child.stdout.readline() == "connected\n"
            served, _ = listener.accept()
            with served:
                found = peers.peer_of(served)
                assert isinstance(found, tcp_peers.PeerSocket), found
                assert tcp_peers.holder(found.inode)[0] == child.pid
                assert tcp_peers.holder(found.inode, [os.getpid(), 1])[0] == child.pid
        finally:
            child.kill()
            child.wait()


def test_a_peer_that_left_is_not_found(peers: tcp_peers.PeerSockets) -> None:
    client, served = pair(socket.AF_INET, "127.0.0.1")
    with served:
        client.close()
        time.sleep(0.05)
        said = peers.peer_of(served)
        assert isinstance(said, str) and "no socket in the gateway's network namespace" in said


def test_what_a_lookup_costs(peers: tcp_peers.PeerSockets) -> None:
    """Printed for the record: the sock_diag lookup, the holder found first among the
    hints (a browser's network process, seen before), and found by reading every
    process's descriptors (the first connection of a new peer)."""
    client, served = pair(socket.AF_INET, "127.0.0.1")
    with client, served:
        found = peers.peer_of(served)
        assert isinstance(found, tcp_peers.PeerSocket)
        runs = 200
        began = time.perf_counter()
        for _ in range(runs):
            peers.peer_of(served)
        lookup = (time.perf_counter() - began) / runs
        began = time.perf_counter()
        for _ in range(runs):
            tcp_peers.holder(found.inode, [os.getpid()])
        hinted = (time.perf_counter() - began) / runs
        began = time.perf_counter()
        _, read = tcp_peers.holder(found.inode, [1])
        full = time.perf_counter() - began
        print(
            f"\nsock_diag lookup {lookup * 1e6:.0f} us; holder among the hints "
            f"{hinted * 1e6:.0f} us; holder by reading {read} descriptors of "
            f"{len([p for p in os.listdir('/proc') if p.isdigit()])} processes "
            f"{full * 1e3:.2f} ms ({full / max(read, 1) * 1e6:.1f} us a descriptor)"
        )
        assert lookup < 0.005 and hinted < 0.005


# -- descriptors -------------------------------------------------------------------------


def test_the_doors_share_what_the_limit_leaves_and_stop_well_before_it() -> None:
    for limit in (200, 400, 1024, 4096):
        b = descriptors.budget(limit)
        assert b.agent + b.console + 16 + 64 <= limit, b
    assert descriptors.budget(1 << 20).agent == MAX_AGENT_CONNECTIONS
    assert descriptors.budget(1 << 20).console == CONSOLE_CONNECTIONS
    assert descriptors.budget(40).agent == 8  # too small to share: a floor, and the reserve


def open_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_the_reserve_holds_its_descriptors_and_lends_one_slot_at_a_time() -> None:
    before = open_count()
    reserve = descriptors.Reserve(slots=2, per_slot=RESERVE_PER_SLOT)
    try:
        assert open_count() == before + 2 * RESERVE_PER_SLOT and reserve.whole() == 2
        first = reserve.lend()
        assert first is not None and open_count() == before + RESERVE_PER_SLOT
        assert reserve.pausing() > 0  # the other doors wait a moment
        second = reserve.lend()
        assert second is not None and reserve.lend() is None  # nothing left to lend
        reserve.give_back(first)
        reserve.give_back(second)
        assert open_count() == before + 2 * RESERVE_PER_SLOT and reserve.whole() == 2
        assert reserve.lendings == 2 and reserve.lent == 0 and reserve.pausing() == 0
    finally:
        reserve.close()
    assert open_count() == before
