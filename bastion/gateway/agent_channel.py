"""The exec channel an agent's exec runs on, and what it answers besides exec.

An agent speaks SSH to the gateway, and an SSH client may send a session
channel many requests besides the one `exec` the gateway serves. Each is
answered here without touching the command's relay; see `AgentChannel`. The
session process on it (`SubsystemProcess`) hands every exec and subsystem request to
the gateway's own factory, so no asyncssh default ever serves one.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import replace

import asyncssh
from asyncssh.packet import SSHPacket

from bastion.core.refusals import Fact, refusal
from bastion.core.terminal import Terminal, terminal_problem
from bastion.gateway.window import deliver_held


def forwarding_refused(what: str) -> asyncssh.ChannelOpenError:
    """A forwarded connection or tunnel an agent's client opened (-W, -L, -w), refused
    with words naming bastion: OpenSSH prints a refused channel's reason, and asyncssh's
    own ("Connection refused") reads as if the target had refused."""
    said = refusal(Fact.FORWARDING, what=what)
    return asyncssh.ChannelOpenError(asyncssh.OPEN_ADMINISTRATIVELY_PROHIBITED, said.message)


class AgentChannel(asyncssh.SSHServerChannel):  # type: ignore[type-arg]
    """The exec channel an agent gets: the exec command's exact bytes, and every
    other request answered without touching the command.

    asyncssh refuses a non-UTF-8 exec request outright, which the agent sees
    only as "exec request failed". Keeping the bytes lets the gate refuse it
    with an agent-facing error instead, and lets the digest cover exactly what was sent.

    asyncssh hands `signal`, `break` and `window-change` to the process's stdin
    reader as exceptions (SignalReceived, BreakReceived, TerminalSizeChanged):
    the relay reading it stopped, the command never got its EOF, and it stayed
    in flight after the agent left. They are refused here (FAILURE, when a reply
    is wanted) and never reach the reader: the gateway signals a command only on
    the operator's `bastion kill`; a `window-change` is carried to the target only
    where the command runs with a terminal (`resize`). `env`
    once the command has started is refused too (its environment was read when
    it started). asyncssh refuses what it does not know on a server channel
    (`xon-xoff`, `exit-status` and `exit-signal` from a client,
    `eow@openssh.com`, any other name), and X11 and agent requests are refused by
    the connection's options. A PTY request is noted as the `Terminal` it asks
    for, and the gate decides on the exec it comes with (`_process_pty_req_request`).
    Its window opens only for bytes passed on (`window.deliver_held`): an agent that
    streams stdin faster than the target takes it is held back, not buffered.
    """

    _deliver_data = deliver_held
    exact_command: bytes | None = None
    terminal: Terminal | None = None
    # Carries a window-change to the command's terminal on the target, once it runs.
    resize: Callable[[tuple[int, int, int, int]], bool] | None = None

    def _process_pty_req_request(self, packet: SSHPacket) -> bool:
        """A terminal asked for: noted, and said yes to; the target makes it only if the
        gate lets the exec through (the account's `pty`). Said no, OpenSSH's `ssh -tt`
        closes the channel when the answer comes back -- but it has sent its exec
        already, which then ran while the agent was told it failed. Said yes, the exec
        that follows reaches the gate, which runs it with this terminal or refuses it
        with an error the agent reads. A second one, or one after the exec, is refused:
        the first is what the gate decides on."""
        term_type = packet.get_string()
        columns, rows, width, height = (packet.get_uint32() for _ in range(4))
        modes = packet.get_string()
        packet.check_end()
        if self.terminal is not None or self.exact_command is not None:
            return False
        self.terminal = Terminal(term_type, columns, rows, width, height, modes)
        return True

    def _process_exec_request(self, packet: SSHPacket) -> bool:
        command = packet.get_string()
        packet.check_end()
        self.exact_command = command
        return self._start_session(command=command.decode("utf-8", "surrogateescape"))

    def _process_signal_request(self, packet: SSHPacket) -> bool:
        packet.get_string()
        packet.check_end()
        return False

    def _process_break_request(self, packet: SSHPacket) -> bool:
        packet.get_uint32()
        packet.check_end()
        return False

    def _process_window_change_request(self, packet: SSHPacket) -> bool:
        """Carried to the target where the command runs with a terminal (and the new
        size is one `core/terminal` would make); refused otherwise."""
        columns, rows, width, height = (packet.get_uint32() for _ in range(4))
        packet.check_end()
        if self.terminal is None or self.resize is None:
            return False
        resized = replace(self.terminal, columns=columns, rows=rows, width=width, height=height)
        if terminal_problem(resized) is not None:
            return False
        return self.resize(resized.size)

    def _process_env_request(self, packet: SSHPacket) -> bool:
        if self.exact_command is None:
            return bool(super()._process_env_request(packet))
        packet.get_string()
        packet.get_string()
        packet.check_end()
        return False


class SubsystemProcess(asyncssh.SSHServerProcess):  # type: ignore[type-arg]
    """The agent's session: every subsystem request reaches the gateway's own process
    factory (`agent_ssh._serve`), which serves `sftp` here and refuses the rest with
    the agent-facing error; asyncssh's own sftp server (the gateway's files) never runs."""

    def subsystem_requested(self, subsystem: str) -> bool:
        return True

    def session_started(self) -> None:
        chan = self._chan
        stdin = asyncssh.SSHReader[bytes](self, chan)  # type: ignore[arg-type]
        stdout = asyncssh.SSHWriter[bytes](self, chan)  # type: ignore[arg-type]
        stderr = asyncssh.SSHWriter[bytes](self, chan, asyncssh.EXTENDED_DATA_STDERR)  # type: ignore[arg-type]
        handler = self._start_process(stdin, stdout, stderr)  # type: ignore[arg-type]
        if inspect.isawaitable(handler):
            assert self._conn is not None
            self._conn.create_task(handler, stdin.logger)
