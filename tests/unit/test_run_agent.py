"""The throwaway agent `bastion run` offers: lists one key, signs with it, nothing else."""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from bastion.sandbox import run_agent
from bastion.sandbox.run_agent import ThrowawayAgent


def frame(kind: int, body: bytes = b"") -> bytes:
    return struct.pack(">IB", len(body) + 1, kind) + body


def string(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def ask(path: str, message: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(path)
        s.sendall(message)
        (n,) = struct.unpack(">I", s.recv(4, socket.MSG_WAITALL))
        return s.recv(n, socket.MSG_WAITALL)


@pytest.fixture
def agent() -> Iterator[ThrowawayAgent]:
    a = ThrowawayAgent()
    yield a
    a.close()


def test_it_lists_one_key_and_signs_with_it(agent: ThrowawayAgent) -> None:
    path = str(agent.socket_path)
    listed = ask(path, frame(run_agent.REQUEST_IDENTITIES))
    assert listed[0] == run_agent.IDENTITIES_ANSWER
    assert listed[1:5] == struct.pack(">I", 1)
    assert listed[5:].startswith(string(agent.blob))
    signed = ask(
        path, frame(run_agent.SIGN_REQUEST, string(agent.blob) + string(b"data") + bytes(4))
    )
    assert signed[0] == run_agent.SIGN_RESPONSE
    sig = signed[5:]
    assert sig.startswith(string(b"ssh-ed25519"))
    raw = agent.blob[len(string(b"ssh-ed25519")) + 4 :]
    Ed25519PublicKey.from_public_bytes(raw).verify(sig[4 + 11 + 4 :], b"data")


@pytest.mark.parametrize(
    "message",
    [
        frame(17, string(b"ssh-ed25519") + b"x" * 64),  # add an identity
        frame(18, string(b"anything")),  # remove one
        frame(19),  # remove all
        frame(22, string(b"passphrase")),  # lock
        frame(23, string(b"passphrase")),  # unlock
        frame(27, string(b"session-bind@openssh.com")),  # an extension
        frame(13, string(b"another key") + string(b"data") + bytes(4)),  # sign with another
        frame(13, b"\x00\x00"),  # a sign request cut short
        frame(11, b"extra"),  # a list request with a body
    ],
)
def test_it_fails_everything_else(agent: ThrowawayAgent, message: bytes) -> None:
    assert ask(str(agent.socket_path), message) == bytes([run_agent.FAILURE])
    # ... and still answers afterwards (nothing was added, removed or locked).
    listed = ask(str(agent.socket_path), frame(run_agent.REQUEST_IDENTITIES))
    assert listed[:5] == bytes([run_agent.IDENTITIES_ANSWER]) + struct.pack(">I", 1)


def test_an_oversized_message_ends_the_connection(agent: ThrowawayAgent) -> None:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(str(agent.socket_path))
        s.sendall(struct.pack(">I", run_agent.MAX_MESSAGE + 1))
        assert s.recv(1) == b""


def test_each_agent_has_a_key_of_its_own_and_leaves_nothing_behind() -> None:
    one, two = ThrowawayAgent(), ThrowawayAgent()
    try:
        assert one.blob != two.blob
        assert oct(one.directory.stat().st_mode & 0o777) == "0o700"
        assert one.inside.parent == run_agent.INSIDE
    finally:
        one.close()
        two.close()
    assert not one.directory.exists() and not two.directory.exists()
