"""A hostile agent: everything one agent can throw at the agent socket, at once.

Run it inside `bastion run` (so it is one registered run, one subject):
    python hostile_agent.py SOCKET USER SECONDS MARKER_DIR
It first runs one `true` on web1 through the agent socket (the test approves
that session) and prints {"ready": true}; then, for SECONDS, as fast as it can
and all at once:
- stuck: exec `cat; touch MARKER` on web1 (approved), send `signal`, `break`,
  `window-change` mid-command, and leave;
- cards: exec on web2 (never approved) from many connections, so its cards
  pile up to whatever cap there is;
- idle: open connections (header, then nothing) up to and past any cap;
- register: register itself as a run again and again, and fork children that
  each register as a run of their own;
- query: `request` by random id, by action key, `hosts`.
Then it prints one JSON line of counts. Raw sockets and asyncssh only: no ssh
client, no helper from the package under test (tests never import each other).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import asyncssh

PROTOCOL = b"BASTION/1 "
counts: dict[str, int] = {}


def count(what: str) -> None:
    counts[what] = counts.get(what, 0) + 1


def header(fields: dict[str, str]) -> bytes:
    return PROTOCOL + json.dumps(fields).encode() + b"\n"


async def door(path: str, fields: dict[str, str]) -> bytes:
    """One header, one reply line (a registration or a query)."""
    reader, writer = await asyncio.open_unix_connection(path)
    try:
        writer.write(header(fields))
        await writer.drain()
        return await asyncio.wait_for(reader.readline(), 30)
    finally:
        writer.close()


async def ssh_to(path: str, user: str, host: str) -> asyncssh.SSHClientConnection:
    """An SSH connection over the agent socket, as the proxy would hand it to ssh."""
    sock = socket.socket(socket.AF_UNIX)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, path)
    await loop.sock_sendall(sock, header({"host": host, "port": "22", "user": user}))
    reply = b""
    while not reply.endswith(b"\n"):
        byte = await asyncio.wait_for(loop.sock_recv(sock, 1), 30)
        if not byte:
            break
        reply += byte
    if not reply.startswith(b"OK"):
        sock.close()
        raise ConnectionRefusedError(reply.decode(errors="replace").strip())
    return await asyncssh.connect(
        sock=sock,
        username=user,
        known_hosts=None,
        config=None,
        client_keys=None,
        agent_path=None,
        login_timeout=30,
    )


async def stuck(path: str, user: str, markers: Path, until: float) -> None:
    while time.monotonic() < until:
        try:
            conn = await ssh_to(path, user, "web1")
        except (OSError, asyncssh.Error, TimeoutError):
            count("stuck_refused")
            await asyncio.sleep(0.05)
            continue
        try:
            marker = markers / f"stuck-{secrets.token_hex(4)}"
            proc = await conn.create_process(f"cat; touch {marker}", encoding=None)
            proc.stdin.write(b"x")
            proc.send_signal("TERM")
            proc.send_break(100)
            proc.change_terminal_size(80, 24)
            await asyncio.sleep(0.05)
            count("stuck")
        except (OSError, asyncssh.Error):
            count("stuck_failed")
        finally:
            conn.abort()  # the agent leaves mid-command


async def cards(path: str, user: str, until: float) -> None:
    while time.monotonic() < until:
        try:
            conn = await ssh_to(path, user, "web2")
        except (OSError, asyncssh.Error, TimeoutError):
            count("cards_refused")
            await asyncio.sleep(0.05)
            continue
        try:
            left = max(until - time.monotonic(), 0.1)
            result = await asyncio.wait_for(conn.run("true"), left)
            count(f"cards_exit_{result.exit_status}")
        except (OSError, asyncssh.Error, TimeoutError):
            count("cards_failed")
        finally:
            conn.abort()


async def idle(path: str, until: float) -> None:
    held: list[socket.socket] = []
    loop = asyncio.get_running_loop()
    try:
        while time.monotonic() < until:
            sock = socket.socket(socket.AF_UNIX)
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, path)
                await loop.sock_sendall(sock, header({"host": "web1", "port": "22", "user": "x"}))
                first = await asyncio.wait_for(loop.sock_recv(sock, 2), 30)
            except (OSError, TimeoutError):
                sock.close()
                count("idle_failed")
                continue
            if first == b"OK":
                held.append(sock)
                count("idle_held")
            else:
                sock.close()
                count("idle_refused")
            if len(held) > 400:
                for old in held[:100]:
                    old.close()
                del held[:100]
    finally:
        for sock in held:
            sock.close()


def registrant(path: str, hold: float) -> None:
    """In a forked child: register this child as a run of its own, then linger."""
    with contextlib.suppress(OSError):
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(30)
        s.connect(path)
        s.sendall(header({"register": "run", "label": "nested"}))
        s.recv(200)
        s.close()
    time.sleep(hold)


def forks(path: str, until: float) -> None:
    """Children that each register as a run (a thread: fork wants a quiet caller)."""
    children: list[int] = []
    while time.monotonic() < until:
        pid = os.fork()
        if pid == 0:
            try:
                registrant(path, 5.0)
            finally:
                os._exit(0)
        children.append(pid)
        count("forked")
        children = [c for c in children if os.waitpid(c, os.WNOHANG) == (0, 0)]
        while len(children) > 200 and time.monotonic() < until:
            time.sleep(0.01)
            children = [c for c in children if os.waitpid(c, os.WNOHANG) == (0, 0)]
    for c in children:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(c, 0)


async def register(path: str, until: float) -> None:
    while time.monotonic() < until:
        try:
            reply = await door(path, {"register": "run", "label": "hostile"})
            count("register_ok" if reply.startswith(b"OK") else "register_refused")
        except (OSError, TimeoutError):
            count("register_failed")


async def query(path: str, until: float) -> None:
    questions = [
        lambda: {"query": "request", "request_id": "req_" + secrets.token_hex(8)},
        lambda: {"query": "request", "action_key": "deploy-42"},
        lambda: {"query": "hosts"},
    ]
    i = 0
    while time.monotonic() < until:
        try:
            await door(path, questions[i % len(questions)]())
            count("query")
        except (OSError, TimeoutError):
            count("query_failed")
        i += 1


async def main(path: str, user: str, seconds: float, markers: Path) -> dict[str, Any]:
    conn = await ssh_to(path, user, "web1")
    first = await conn.run("true")
    conn.close()
    print(json.dumps({"ready": first.exit_status == 0}), flush=True)
    sys.stdin.readline()  # the test says go
    until = time.monotonic() + seconds
    forker = threading.Thread(target=forks, args=(path, until), daemon=True)
    forker.start()
    await asyncio.gather(
        *(stuck(path, user, markers, until) for _ in range(4)),
        *(cards(path, user, until) for _ in range(40)),
        *(idle(path, until) for _ in range(2)),
        register(path, until),
        *(query(path, until) for _ in range(2)),
    )
    await asyncio.to_thread(forker.join, 30)
    return counts


if __name__ == "__main__":
    socket_path, ssh_user, duration, marker_dir = sys.argv[1:5]
    done = asyncio.run(main(socket_path, ssh_user, float(duration), Path(marker_dir)))
    print(json.dumps(done), flush=True)
