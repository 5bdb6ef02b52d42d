"""The proxy's handshake with the daemon, without ssh (pure socket tests)."""

from __future__ import annotations

import socket
import threading

from bastion.proxy import read_reply


def test_read_reply_leaves_the_ssh_banner_on_the_socket() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"OK\nSSH-2.0-bastion\r\n")
        assert read_reply(b) == b"OK\n"
        assert b.recv(100) == b"SSH-2.0-bastion\r\n"


def test_read_reply_stops_at_close() -> None:
    a, b = socket.socketpair()
    with b:
        t = threading.Thread(target=lambda: (a.sendall(b"ERR no"), a.close()))
        t.start()
        assert read_reply(b) == b"ERR no"
        t.join(5)
