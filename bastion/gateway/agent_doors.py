"""The agent socket's doors besides SSH: who is connecting, registrations
(`bastion run`, `bastion mcp`), and the two questions `bastion mcp` asks.

Each is answered in a worker thread (they read /proc or the journal) before
any SSH starts, and none of them decides anything: a registration only says
how the identity walk reads a process that registered *itself*, and the
answers carry nothing an agent could not learn by trying -- the hosts the
policy names with their rules (never an address, a port, a host key or a
credential), and the state of a request whose unguessable id it holds.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import socket
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from bastion import journal
from bastion.core import events
from bastion.core.contract import Code
from bastion.core.events import EventType
from bastion.core.policy import Policy, PolicyError
from bastion.core.subject import Peer, Subject
from bastion.gateway.agent_ssh import Doors
from bastion.gateway.recorder import Recorder
from bastion.identity import Resolver

log = logging.getLogger("bastion.gateway")

ACTIONS_REMEMBERED = 4096  # action key -> latest request id, for `bastion mcp`


class Lifetime(Protocol):
    """What the doors read of the lifetime that owns them (`lifetime.Gateway`)."""

    boot_id: str
    resolver: Resolver
    recorder: Recorder
    same_uid_agent_seen: bool

    def watch(self, subject: Subject) -> None: ...


class AgentDoors:
    def __init__(
        self,
        gw: Lifetime,
        loop: asyncio.AbstractEventLoop,
        policy: Callable[[], Policy | PolicyError],
        journal_dir: Path,
    ) -> None:
        self.gw = gw
        self._loop = loop
        self._policy = policy
        self._journal_dir = journal_dir
        # The latest request of each action key (hashed), so `bastion mcp` can name
        # the request it just ran: the agent's ssh hears a request id only on failure.
        self._actions: OrderedDict[str, str] = OrderedDict()
        gw.recorder.on_received.append(self._remember_action)

    def doors(self) -> Doors:
        return Doors(self.identify, self.register, self.query)

    def identify(self, sock: socket.socket) -> Peer:
        peer = self.gw.resolver.identify(sock)
        if peer.uid == os.getuid():
            self.gw.same_uid_agent_seen = True
        return peer

    def register(self, sock: socket.socket, header: dict[str, str]) -> str:
        """`bastion run`: the connecting process becomes one subject for its whole
        tree, for as long as it lives. `bastion mcp`: the connecting process acts
        for its parent, as a shell would."""
        resolver = self.gw.resolver
        if header["register"] == "front":
            info = resolver.register_front(sock)
            log.info("front registered: pid %d (%s)", info.pid, info.exe)
            return f"front_{resolver.nonce_for(info.pid, info.start_time)}"
        label = header.get("label", "")
        info = resolver.register_run(sock, label)
        subject = Subject(
            info.pid,
            info.start_time,
            info.exe,
            info.exe_sha256,
            info.uid,
            resolver.nonce_for(info.pid, info.start_time),
            label,
        )
        self._loop.call_soon_threadsafe(self.gw.watch, subject)
        self._loop.call_soon_threadsafe(
            lambda: self.gw.recorder.record(
                EventType.RUN_REGISTERED, {}, {"subject": subject.as_json()}
            )
        )
        log.info("run registered: pid %d %r (%s)", info.pid, label, info.exe)
        return f"run_{subject.nonce}"

    def query(self, header: dict[str, str]) -> dict[str, Any]:
        if header["query"] == "hosts":
            return hosts_view(self._policy())
        request_id = header.get("request_id") or self._by_action(header.get("action_key", ""))
        if not request_id:
            raise ValueError("no request with that id or action key")
        if header.get("only") == "id":
            return {"request_id": request_id}  # no journal read: asked after every command
        state = events.request_state(
            journal.records(self._journal_dir), request_id, self.gw.boot_id
        )
        if state is None:
            raise ValueError(f"no request {request_id} in the journal")
        return state

    def _remember_action(self, action: str | None, request_id: str) -> None:
        if action:
            self._actions[action] = request_id
            self._actions.move_to_end(action)
            while len(self._actions) > ACTIONS_REMEMBERED:
                self._actions.popitem(last=False)

    def _by_action(self, action_key: str) -> str | None:
        if not action_key:
            return None
        return self._actions.get(hashlib.sha256(action_key.encode()).hexdigest())


def hosts_view(policy: Policy | PolicyError) -> dict[str, Any]:
    """What an agent may use: each host alias, its accounts, how each is approved
    and what its rules allow. No address, port, host key or credential: the agent
    names hosts, bastion alone knows where they are and how to get in."""
    if isinstance(policy, PolicyError):
        error = {
            "code": Code.POLICY_UNAVAILABLE.value,
            "message": "The policy is unavailable; the operator must fix it (see `bastion "
            "status`). Every request is refused until then.",
            "request_id": None,
            "retryable": Code.POLICY_UNAVAILABLE.retryable,
        }
        return {"ok": False, "error": error}
    return {
        "hosts": [
            {
                "host": alias,
                "accounts": [
                    {
                        "user": a.user,
                        "approval": a.approval.value,
                        "allow": None if a.allow is None else [r.text for r in a.allow],
                        "preapproved": [r.text for r in a.preapproved],
                        "shell": a.shell.value,
                    }
                    for a in host.accounts
                ],
            }
            for alias, host in sorted(policy.hosts.items())
        ]
    }
