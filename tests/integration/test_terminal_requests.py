"""`ssh -t`/`-tt` get an honest answer (issue 21): on an account without `pty` the
request is refused with bastion's error and nothing runs; with `pty = true` it runs
with the terminal the client asked for, and the card and journal say so.

Before, the gateway said no to the pty request; OpenSSH's `ssh -tt` then closes the
channel, but it has already sent its exec, which the gateway ran: the agent read
"PTY allocation request failed" (exit 255) while the command had run on the target
(7 times in 10). Here the command touches a marker on the target 20 times and the
marker never appears; the control, the same command without -tt, runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from tests.harness import (
    Bastion,
    SshdInfo,
    approved_agent,
    make_bastion,
    policy_toml,
    unchecked_proxy,
)


def journal(b: Bastion) -> list[dict[str, Any]]:
    return [json.loads(x) for x in b.cli("audit", "export").stdout.splitlines()]


def test_a_command_asking_for_a_terminal_never_runs(bastion: Bastion, tmp_path: Path) -> None:
    agent = approved_agent(bastion)  # an approved session: the refusal is the terminal's
    marker = tmp_path / "ran-with-a-terminal"
    for _ in range(20):
        r = agent.run(f"tty; touch {marker}", ssh_args=("-tt",))
        assert r.rc == 77 and r.code == "UNSUPPORTED_REQUEST", r.stderr
        assert r.error is not None and r.error["retryable"] is False
        message = r.error["message"]
        assert "runs commands without one" in message and "`pty = true`" in message
        assert "pipelining" in message and "RequestTTY=no" in message
        assert not marker.exists(), "the command ran although the agent was refused"
    # The control: the same command without -tt runs (and says it has no terminal).
    r = agent.run(f"tty; touch {marker}")
    assert marker.exists(), r.stderr
    assert b"not a tty" in r.stdout
    # Each refusal is on record as denied, and its request as one that asked for a terminal.
    lines = journal(bastion)
    denied = [x for x in lines if x.get("type") == "denied" and "terminal" in json.dumps(x)]
    assert len(denied) == 20, [x.get("type") for x in lines][-30:]
    asked = [x for x in lines if x.get("type") == "request_received" and "terminal" in x]
    assert len(asked) == 20 and all(x["terminal"] is True for x in asked)


def test_a_pty_account_runs_the_command_with_a_terminal(
    tmp_path: Path, sshd: SshdInfo, client_key: tuple[Path, str]
) -> None:
    b = make_bastion(tmp_path, sshd, client_key[0], policy_toml(sshd, pty=True))
    try:
        agent = approved_agent(b)
        marker = tmp_path / "ran-with-a-terminal"
        r = agent.run(f"tty; touch {marker}", ssh_args=("-tt",))
        assert r.rc == 0, r.stderr
        assert b"/dev/pts/" in r.stdout and marker.exists(), (r.stdout, r.stderr)
        # The exit status comes back, and stdout and stderr arrive merged (one terminal).
        r = agent.run("tty; echo to-stderr >&2; exit 3", ssh_args=("-tt",))
        assert r.rc == 3, r.stderr
        assert b"/dev/pts/" in r.stdout and b"to-stderr" in r.stdout, (r.stdout, r.stderr)
        assert "to-stderr" not in r.stderr
        # The size asked for is the size made (ssh -tt with no local terminal: 0x0 is
        # what it sends, and what the target's terminal reports).
        r = agent.run("stty size", ssh_args=("-tt",))
        assert r.rc == 0 and r.stdout.split() == [b"0", b"0"], (r.stdout, r.stderr)
        # Without -t the same account runs without one, as before.
        r = agent.run("tty")
        assert b"not a tty" in r.stdout
        asked = [x for x in journal(b) if x.get("type") == "request_received" and "terminal" in x]
        assert len(asked) == 3
    finally:
        b.close()


def test_a_per_command_card_says_with_a_terminal(
    tmp_path: Path, sshd: SshdInfo, client_key: tuple[Path, str]
) -> None:
    b = make_bastion(
        tmp_path, sshd, client_key[0], policy_toml(sshd, pty=True, approval="per-command")
    )
    try:
        agent = b.agent()
        rid = agent.start("tty", ssh_args=("-tt",))
        b.approve_next()  # the session card
        card = b.next_card()
        assert card["kind"] == "command" and card["terminal"] is True, card
        shown = b.cli("pending").stdout
        assert "with a terminal" in shown, shown
        b.answer(card, True)
        r = agent.wait(rid)
        assert r.rc == 0 and b"/dev/pts/" in r.stdout, (r.stdout, r.stderr)
        # The same command without a terminal is another card: no "with a terminal".
        rid = agent.start("tty")
        card = b.next_card()
        assert card["terminal"] is False and "with a terminal" not in b.cli("pending").stdout
        b.answer(card, True)
        assert b"not a tty" in agent.wait(rid).stdout
    finally:
        b.close()


# -- what bastion does not serve: each refused at once, with bastion's words --------------

NOT_SERVED = [
    (("-N",), None, "-N (a connection without a command)"),
    (("-f",), "true", "-f (a connection in the background)"),
    (("-L", "18080:localhost:80"), "true", "-L (local port forwarding)"),
    (("-R", "18081:localhost:22"), "true", "-R (remote port forwarding)"),
    (("-D", "18082"), "true", "-D (dynamic port forwarding)"),
    (("-W", "localhost:22"), None, "-W (stdio forwarding)"),
    (("-o", "SessionType=none"), None, "-o SessionType"),
    (("-o", "ForkAfterAuthentication=yes"), "true", "-o ForkAfterAuthentication"),
]


def test_what_bastion_does_not_serve_is_refused_before_anything_connects(
    bastion: Bastion, tmp_path: Path
) -> None:
    """Before, `-N` hung, `-f` exited 0 and printed the refusal from the background, and
    `-L` read like the target refused. Now each ends at once (bounded: the helper's
    timeout would give rc None) with bastion's error naming what it serves; ssh itself
    exits 255, as for any ProxyCommand that ends before SSH, never 0."""
    agent = approved_agent(bastion)
    before = len(journal(bastion))
    for options, command, words in NOT_SERVED:
        argv = ["ssh", "-F", str(bastion.config), *options, "web1"]
        r = agent.wait(agent.start([], argv=argv + ([command] if command else [])), 60)
        assert r.rc == 255, (options, r.rc, r.stderr)
        assert r.code == "UNSUPPORTED_REQUEST" and r.error is not None, (options, r.stderr)
        assert r.error["retryable"] is False
        assert words in r.error["message"], (options, r.error["message"])
        assert "one command per ssh call" in r.error["message"]
    # Nothing reached the gateway: no request was journaled.
    assert len(journal(bastion)) == before
    # The control: the same ssh without those options runs its command.
    assert agent.run("true").rc == 0


def test_the_gateway_refuses_a_forwarded_connection_in_its_own_words(
    bastion: Bastion, tmp_path: Path
) -> None:
    """A client whose ProxyCommand is not started by ssh itself (here through a shell
    that does not exec it) is not checked by the proxy: the gateway refuses the
    forwarded connection it opens, with words naming bastion, where asyncssh's default
    said "Connection refused" as if from the target."""
    agent = approved_agent(bastion)
    argv = [
        "ssh",
        "-F",
        str(bastion.config),
        *unchecked_proxy(bastion),
        "-W",
        "localhost:22",
        "web1",
    ]
    r = agent.wait(agent.start([], argv=argv), 60)
    assert r.rc == 255, r.stderr
    assert "administratively prohibited: bastion forwards nothing" in r.stderr, r.stderr
    assert "a connection to localhost port 22" in r.stderr
    # The control: the same wrapped proxy carries a command.
    r = agent.wait(agent.start([], argv=[*argv[:5], "web1", "true"]), 60)
    assert r.rc == 0, r.stderr


# ssh on a terminal of its own, 30 rows by 100 columns; once the command has shown its
# size, the terminal grows to 50x120 (the kernel sends ssh SIGWINCH: a window-change),
# and a line lets the command go on.
ON_A_TERMINAL = """
import fcntl, os, pty, struct, sys, termios
pid, fd = pty.fork()
if pid == 0:
    fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    os.execvp(sys.argv[1], sys.argv[1:])
out = b""
while True:
    try:
        data = os.read(fd, 4096)
    except OSError:
        break
    if not data:
        break
    if b"30 100" in data + out[-10:] and b"30 100" not in out:
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 120, 0, 0))
        os.write(fd, b"go\\n")
    out += data
sys.stdout.buffer.write(out)
sys.exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


def test_the_terminal_is_the_size_the_agent_has_and_follows_it(
    tmp_path: Path, sshd: SshdInfo, client_key: tuple[Path, str]
) -> None:
    """The size the agent's terminal has is the size the target's is made, and a
    window-change is carried to it; without a terminal, nothing would be resized."""
    b = make_bastion(tmp_path, sshd, client_key[0], policy_toml(sshd, pty=True))
    try:
        agent = b.agent()
        script = tmp_path / "on_a_terminal.py"
        script.write_text(ON_A_TERMINAL)
        remote = (
            'stty size; read x; for i in $(seq 100); do [ "$(stty size)" != "30 100" ] && '
            "break; sleep 0.1; done; stty size; exit 4"
        )
        argv = [sys.executable, str(script), "ssh", "-F", str(b.config), "-t", "web1", remote]
        rid = agent.start([], argv=argv)
        b.approve_next()  # the script's ssh is a process of its own: its own session card
        r = agent.wait(rid, 60)
        assert r.rc == 4, (r.stdout, r.stderr)
        assert b"30 100" in r.stdout and b"50 120" in r.stdout, r.stdout
    finally:
        b.close()
