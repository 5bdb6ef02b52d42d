"""Who the subject is (issue 9): decided from executables, never from names a
process sets itself, and never a terminal host such as tmux -- nor dvtm or a vim
`:terminal` (issue 18), which host windows just as tmux hosts panes."""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import shutil
import struct
import subprocess
import sys
import termios
import threading
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.harness import Agent, Bastion, wait_for


def test_a_process_renamed_bash_is_not_a_wrapper(bastion: Bastion) -> None:
    agent = bastion.agent()
    agent.rename("bash")
    assert Path(f"/proc/{agent.pid}/comm").read_text().strip() == "bash"
    rid = agent.start("true")
    card = bastion.next_card()
    # Had the name counted, the walk would have gone on to the agent's parent.
    assert card["subject"]["pid"] == agent.pid
    assert card["subject"]["kind"] == "agent process"
    bastion.answer(card, False)
    assert agent.wait(rid).code == "SESSION_DENIED"


class Tmux:
    """A private tmux server (its own socket) whose panes run bash."""

    def __init__(self, cwd: Path) -> None:
        self.socket = f"bastion-test-{secrets.token_hex(4)}"
        self.cwd = cwd
        self.tmux("new-session", "-d", "-s", "t", "-x", "200", "-y", "50", "bash", "--norc")

    def tmux(self, *args: str) -> str:
        r = subprocess.run(
            ["tmux", "-L", self.socket, *args],
            capture_output=True,
            text=True,
            timeout=30,
            cwd=self.cwd,
            env={**os.environ, "TMUX": ""},
        )
        assert r.returncode == 0, r.stderr
        return r.stdout

    def new_pane(self) -> str:
        return self.tmux(
            "split-window", "-t", "t", "-P", "-F", "#{pane_id}", "bash", "--norc"
        ).strip()

    def first_pane(self) -> str:
        return self.tmux("list-panes", "-t", "t", "-F", "#{pane_id}").split()[0]

    def type(self, pane: str, line: str) -> None:
        self.tmux("send-keys", "-t", pane, "-l", line)
        self.tmux("send-keys", "-t", pane, "Enter")

    def pane_pid(self, pane: str) -> int:
        return int(self.tmux("display-message", "-p", "-t", pane, "#{pane_pid}"))

    def kill(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, timeout=30)


@pytest.fixture
def tmux(tmp_path: Path) -> Iterator[Tmux]:
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed: apt-get install -y tmux")
    t = Tmux(tmp_path)
    try:
        yield t
    finally:
        t.kill()


def test_an_agent_in_a_tmux_pane_is_its_own_subject_and_the_operator_approves_from_another(
    bastion: Bastion, tmux: Tmux, tmp_path: Path
) -> None:
    cli = f"{sys.executable} -m bastion.cli --home {bastion.home.root}"
    agent_pane, operator_pane = tmux.first_pane(), tmux.new_pane()
    out = tmp_path / "agent-out"
    tmux.type(
        agent_pane,
        # stderr apart: the gateway's waiting line is there while the card waits
        f"ssh -F {bastion.config} web1 'echo from-the-pane' > {out} 2> {out}.err; "
        f"echo $? > {out}.rc",
    )
    card = bastion.next_card()
    assert card["subject"]["pid"] == tmux.pane_pid(agent_pane)  # the pane's shell, not tmux
    assert card["subject"]["kind"] == "shell of a terminal session"
    assert "tmux" not in os.path.basename(card["subject"]["exe"])

    # The operator, in another pane of the same tmux, is not inside the agent's tree.
    decided = tmp_path / "decided"
    tmux.type(
        operator_pane, f"{cli} decide {card['id']} approve > {decided} 2>&1; echo $? >> {decided}"
    )

    # Both shells write when they are done, in either order: wait for both.
    def decide_done() -> bool:
        lines = decided.read_text().splitlines() if decided.exists() else []
        return bool(lines) and lines[-1].isdigit()

    wait_for(lambda: Path(f"{out}.rc").exists() and decide_done(), timeout=30)
    assert decided.read_text().splitlines()[-1] == "0", decided.read_text()
    assert out.read_text() == "from-the-pane\n" and Path(f"{out}.rc").read_text() == "0\n"

    # The approval covers that pane's shell only: the operator's pane gets its own card.
    second = tmp_path / "second-out"
    tmux.type(
        operator_pane,
        f"ssh -F {bastion.config} web1 'echo second' > {second} 2>&1; echo $? > {second}.rc",
    )
    other = bastion.next_card()
    assert other["subject"]["pid"] == tmux.pane_pid(operator_pane) != card["subject"]["pid"]
    bastion.answer(other, False)
    wait_for(lambda: Path(f"{second}.rc").exists(), timeout=30)
    assert Path(f"{second}.rc").read_text() == "77\n"


def test_ssh_run_by_tmux_itself_is_refused_with_the_reason_and_no_card(
    bastion: Bastion, tmux: Tmux, tmp_path: Path
) -> None:
    """The walk's refusal, decided in core/subject, reaches the agent as before."""
    out = tmp_path / "out"
    tmux.tmux("new-window", "-d", f"exec ssh -F {bastion.config} web1 'echo never' > {out} 2>&1")

    def refused() -> bool:
        return out.exists() and "Nothing was sent" in out.read_text()

    wait_for(refused, timeout=30)  # ssh, exec'd by tmux's shell, told why
    error = json.loads(out.read_text().splitlines()[0])["error"]
    assert error == {
        "code": "INTERNAL",
        "message": "The bastion gateway refused the connection: ssh was started directly "
        "by tmux, a terminal host: there is no agent process to approve; run ssh from the "
        "agent (or a shell) instead. Nothing was sent to the target.",
        "request_id": None,
        "retryable": False,
    }
    assert bastion.op("pending") == []


class Screen:
    """A program on a pty of 50x200 (dvtm and vim lay windows out on its size), its
    output drained in a thread so it never blocks on a full terminal."""

    def __init__(self, argv: list[str]) -> None:
        master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
        env = {**os.environ, "TERM": "xterm"}
        self.proc = subprocess.Popen(
            argv, stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True
        )
        os.close(slave)
        self.master = master
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        try:
            while os.read(self.master, 65536):
                pass
        except OSError:  # the program exited and the pty closed
            pass

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        os.close(self.master)


class Window:
    """What one window runs: a shell that says its pid, waits to be told, then runs
    one ssh command that leaves a marker on the target."""

    def __init__(self, root: Path, n: int, config: Path) -> None:
        self.pid_file, self.go = root / f"window{n}.pid", root / f"window{n}.go"
        self.marker, self.rc = root / f"window{n}.ran", root / f"window{n}.rc"
        os.mkfifo(self.go)
        self.script = root / f"window{n}.sh"
        self.script.write_text(
            f"echo $$ > {self.pid_file}\n"
            f"read go < {self.go}\n"
            f"ssh -F {config} web1 'touch {self.marker}' > /dev/null 2>&1\n"
            f"echo $? > {self.rc}\n"
        )

    @property
    def pid(self) -> int:
        wait_for(lambda: self.pid_file.exists() and self.pid_file.read_text().strip(), 30)
        return int(self.pid_file.read_text())

    def shell_under(self, host: int) -> int:
        """The window's own process: the one the host started, above our script (dvtm
        starts `$SHELL -c COMMAND`, vim runs the command itself)."""
        p = psutil.Process(self.pid)
        while p.ppid() != host:
            p = p.parent()
            assert p is not None and p.pid > 1, f"window {self.pid} is not under {host}"
        return p.pid

    def release(self) -> None:
        """Tell the window's shell to run its ssh (it waits on a fifo)."""
        self.pid  # noqa: B018 -- it has started, so it opens the fifo next
        fds: list[int] = []

        def opened() -> bool:
            try:
                fds.append(os.open(self.go, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:  # ENXIO: its shell has not opened it yet
                return False
            return True

        wait_for(opened, 30)
        os.write(fds[0], b"go\n")
        os.close(fds[0])

    def result(self) -> int:
        wait_for(lambda: self.rc.exists() and self.rc.read_text().strip(), 60)
        return int(self.rc.read_text())


def host_argv(host: str, windows: list[Window]) -> list[str]:
    """`host` with one window per script: dvtm takes commands, vim `:terminal`s."""
    if host == "dvtm":
        return ["dvtm", *(f"sh {w.script}" for w in windows)]
    opens = [arg for w in windows for arg in ("-c", f"terminal sh {w.script}")]
    return ["vim", "-N", "-u", "NONE", "-i", "NONE", "-n", *opens]


@pytest.mark.parametrize("host", ["dvtm", "vim"])
def test_two_windows_of_a_terminal_host_are_two_subjects(
    bastion: Bastion, tmp_path: Path, host: str
) -> None:
    """Two windows of one real dvtm, or two `:terminal`s of one real vim
    (/usr/bin/vim.basic on Debian), each run ssh: two cards, and approving one
    window's shell covers nothing in the other."""
    if shutil.which(host) is None:
        pytest.skip(f"{host} is not installed: apt-get install -y {host}")
    windows = [Window(tmp_path, n, bastion.config) for n in (1, 2)]
    screen = Screen(host_argv(host, windows))
    try:
        first, second = windows
        first.release()
        card = bastion.next_card()
        assert card["subject"]["pid"] == first.shell_under(screen.proc.pid), card["subject"]
        assert card["subject"]["kind"] == "shell of a terminal session"
        bastion.answer(card, True)
        assert first.result() == 0 and first.marker.exists()

        second.release()
        other = bastion.next_card()
        assert other["subject"]["pid"] == second.shell_under(screen.proc.pid)
        assert other["subject"]["pid"] != card["subject"]["pid"]
        bastion.answer(other, False)
        assert second.result() == 77 and not second.marker.exists()
    finally:
        screen.close()


def test_the_same_two_shells_under_a_plain_program_are_one_subject(
    bastion: Bastion, tmp_path: Path
) -> None:
    """The control: the same two window scripts started by an ordinary program (the
    agent helper) are that program's: one card covers both."""
    first, second = windows = [Window(tmp_path, n, bastion.config) for n in (1, 2)]
    parent = Agent(bastion.config)
    bastion.agents.append(parent)
    rids = [parent.start([], argv=["sh", str(w.script)]) for w in windows]
    first.release()
    card = bastion.next_card()
    assert card["subject"]["pid"] == parent.pid and card["subject"]["kind"] == "agent process"
    bastion.answer(card, True)
    assert first.result() == 0 and first.marker.exists()
    second.release()
    assert second.result() == 0 and second.marker.exists()  # no card: the same subject
    assert bastion.op("pending") == []
    assert [parent.wait(rid).rc for rid in rids] == [0, 0]
