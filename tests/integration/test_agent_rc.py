"""bastion's path does not pay the agent's rc (issue 23).

ssh runs the ProxyCommand as `$SHELL -c "exec ..."`, its stdin a socket (ProxyUseFdpass).
Debian's bash then reads ~/.bashrc first, as if sshd had started it, unless SHLVL says it
is nested: an agent that runs ssh with SHLVL unset or 0 paid its whole rc (here pyenv) on
every bastion call. Inside `bastion run` it does not. The rc here is a temp HOME's, which
appends a line to a marker file; a real HOME's rc files are never touched.

Positive controls: the same ssh from the same environment outside the run writes the
marker, and so does an interactive bash inside the run (the marker is writable and the rc
readable from there). On the base tree (521059d) the in-run ssh wrote the marker: both
tests failed there.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness import Agent, Bastion, cli_argv, inside

# As for an agent working inside an ssh login on a dev box.
SSH_CLIENT = "192.0.2.7 40022 22"


def _rc_home(tmp_path: Path) -> tuple[Path, Path]:
    """A HOME whose ~/.bashrc appends "PID SHLVL" to a marker file outside it."""
    home = tmp_path / "agent-home"
    home.mkdir()
    (tmp_path / "given").mkdir()
    marker = tmp_path / "given" / "rc-read"  # in what a run is given (`_agent`: --rw)
    (home / ".bashrc").write_text(f'echo "$$ ${{SHLVL-unset}}" >> {marker}\n')
    return home, marker


def _agent(
    b: Bastion, env: dict[str, str], shlvl: str | None, run_args: tuple[str, ...] | None
) -> Agent:
    """An agent helper with SHLVL unset (None) or as given, inside `bastion run RUN_ARGS --`
    (None: outside any run)."""
    level = ("env", "-u", "SHLVL") if shlvl is None else ("env", f"SHLVL={shlvl}")
    given = (
        () if run_args is None or "--no-sandbox" in run_args else ("--rw", str(b.root / "given"))
    )
    run = () if run_args is None else tuple(cli_argv(b.home.root, "run", *run_args, *given, "--"))
    agent = Agent(b.config, env, launcher=(*level, *run))
    b.agents.append(agent)
    return agent


def _ssh_true(b: Bastion, agent: Agent) -> None:
    rid = agent.start("true")
    b.approve_next()
    r = agent.wait(rid)
    assert r.rc == 0, r.stderr


@pytest.mark.parametrize(
    ("shlvl", "run_args"),
    [(None, ()), ("0", ()), (None, ("--no-sandbox",))],
    ids=["unset-sandboxed", "zero-sandboxed", "unset-no-sandbox"],
)
def test_ssh_inside_a_run_reads_no_bashrc(
    bastion: Bastion, tmp_path: Path, shlvl: str | None, run_args: tuple[str, ...]
) -> None:
    home, marker = _rc_home(tmp_path)
    env = {"HOME": str(home), "SHELL": "/bin/bash", "SSH_CLIENT": SSH_CLIENT}

    # Positive control: outside any run, the same ssh from the same environment reads it.
    outside = _agent(bastion, env, shlvl, None)
    _ssh_true(bastion, outside)
    assert marker.exists(), "bash read no ~/.bashrc for the ProxyCommand outside the run"
    marker.unlink()

    agent = _agent(bastion, env, shlvl, run_args)
    _ssh_true(bastion, agent)
    again = agent.run("true")
    assert again.rc == 0, again.stderr
    assert not marker.exists(), f"the ProxyCommand's bash read ~/.bashrc: {marker.read_text()}"

    # Positive control inside the run: its own interactive bash reads the same rc.
    assert inside(agent, "bash", "-i", "-c", "true").rc == 0
    assert marker.exists(), "the marker cannot be written from inside the run"


def test_a_run_keeps_a_shell_level_it_was_given(bastion: Bastion, tmp_path: Path) -> None:
    """Only an unset or 0 SHLVL changes; a shell-started agent sees its own as it was."""
    home, _ = _rc_home(tmp_path)
    env = {"HOME": str(home), "SHELL": "/bin/bash"}
    given = _agent(bastion, env, "4", ())
    assert inside(given, "sh", "-c", 'printf %s "$SHLVL"').stdout == b"4"
    unset = _agent(bastion, env, None, ())
    assert inside(unset, "sh", "-c", 'printf %s "$SHLVL"').stdout == b"1"
