"""What `run --isolated` checks before it registers: the hides its bwrap (running as the
agent user) leaves out because that user cannot reach them anyway, and the CMDs it refuses
without asking the agent user (a relative path, a script in the host's /tmp). What the
agent user itself can reach is tried as that user in tests/integration/test_isolate.py."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from bastion.sandbox import isolation

HIDDEN_HOME = "/home/op/.local/share/bastion"


def own() -> isolation.Isolation:
    """An isolation whose agent user is this process's (so `as_user` asks it directly)."""
    return isolation.Isolation(
        user="agent", uid=os.geteuid(), group="agent", gid=os.getegid(),
        operator_uid=os.geteuid(), socket_dir=Path("/run/bastion-door"),
    )  # fmt: skip


@pytest.fixture
def denied(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """The paths the agent user is denied (every other one it reaches)."""
    paths: set[str] = set()
    monkeypatch.setattr(isolation, "attempt", lambda _k, p: "denied" if p in paths else "ok")
    return paths


def test_a_hide_the_agent_user_cannot_reach_is_left_out(denied: set[str]) -> None:
    denied |= {HIDDEN_HOME, "/home/op/notes.txt"}
    argv = [
        "bwrap", "--unshare-user", "--die-with-parent", "--ro-bind", "/", "/",
        "--tmpfs", "/tmp", "--perms", "0700", "--tmpfs", HIDDEN_HOME,
        "--ro-bind", "/dev/null", "/home/op/notes.txt", "--tmpfs", "/run/user/1000",
        "--ro-bind", "/run/bastion-door", "/run/bastion-door", "--chdir", "/tmp/home",
        "--", "sh", "-c", "--tmpfs /home/op/.local/share/bastion",
    ]  # fmt: skip
    assert isolation.reachable_plan(argv, own()) == [
        "bwrap", "--unshare-user", "--die-with-parent", "--ro-bind", "/", "/",
        "--tmpfs", "/tmp", "--tmpfs", "/run/user/1000",
        "--ro-bind", "/run/bastion-door", "/run/bastion-door", "--chdir", "/tmp/home",
        "--", "sh", "-c", "--tmpfs /home/op/.local/share/bastion",
    ]  # fmt: skip


def test_a_hide_below_what_an_earlier_option_mounts_stays(denied: set[str]) -> None:
    """There the host's view is not the run's: the hide is left to bwrap as it is."""
    denied.add(HIDDEN_HOME)
    argv = ["bwrap", "--ro-bind", "/", "/", "--tmpfs", "/home/op", "--tmpfs", HIDDEN_HOME, "--"]
    assert isolation.reachable_plan(argv, own()) == argv


def test_an_argv_with_an_unknown_option_is_left_as_it_is(denied: set[str]) -> None:
    denied.add(HIDDEN_HOME)
    argv = ["bwrap", "--tmpfs", HIDDEN_HOME, "--some-new-option", "x", "--", "true"]
    assert isolation.reachable_plan(argv, own()) == argv


def test_a_relative_cmd_or_script_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "script.sh").write_text("true\n")
    why = isolation.command_refusal(own(), ["./agent"], "/usr/bin")
    assert why is not None and f"give {tmp_path / 'agent'}" in why
    why = isolation.command_refusal(own(), ["bash", "script.sh"], "/usr/bin:/bin")
    assert why is not None and "is a relative path, and the agent starts in a home" in why


def test_a_script_in_the_hosts_tmp_is_refused() -> None:
    with tempfile.NamedTemporaryFile(dir="/tmp", suffix=".sh") as script:
        why = isolation.command_refusal(own(), ["python3", script.name], "/usr/bin:/bin")
    assert why is not None and f"{script.name} is in /tmp, and the run's /tmp is its own" in why


def test_what_the_agent_user_can_start_is_not_refused() -> None:
    """The controls: a program on its PATH; an option, not a file, after the interpreter;
    a file argument of a program that is no interpreter."""
    with tempfile.NamedTemporaryFile(dir="/tmp") as f:
        for cmd in (["sh", "-c", "true"], ["touch", f.name], ["sh"]):
            assert isolation.command_refusal(own(), cmd, "/usr/bin:/bin") is None, cmd
