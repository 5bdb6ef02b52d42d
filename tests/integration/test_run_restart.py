"""A run is known by the kernel and by `runs.json`, not by one gateway's memory:
a process in other namespaces is refused at the operator socket though no
gateway registered it; a run that outlived a gateway SIGKILL is still the run
(its subject, its tenant, refused at the operator socket) once the gateway is
back; and a `{"register": "front"}` cannot make an operator's tmux pane the
subject. Each with its positive control: the same action from outside works."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import Agent, Bastion, cli_argv, wait_for


def _run_launcher(bastion: Bastion, label: str, sandboxed: bool = False) -> tuple[str, ...]:
    """`bastion run`, by default without its sandbox: this is about the gateway knowing
    the run, which an unsandboxed run tests without bubblewrap."""
    cli = (sys.executable, "-m", "bastion.cli", "--home", str(bastion.home.root))
    extra = () if sandboxed else ("--no-sandbox",)
    return (*cli, "run", *extra, "--label", label, "--")


@pytest.mark.skipif(shutil.which("unshare") is None, reason="util-linux unshare missing")
def test_a_process_in_other_namespaces_cannot_speak_for_the_operator(bastion: Bastion) -> None:
    """No run, no card, nothing the gateway remembers: only the kernel's namespaces. The
    CLI there refuses on its own (it cannot see who answers: `opsock.check_server`), and
    a client that skips that check is refused by the gateway."""
    outside = bastion.cli("pending", check=False)
    assert outside.returncode == 0, outside.stderr  # the positive control

    def inside(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["unshare", "--user", "--pid", "--fork", "--mount-proc", *argv],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": os.getcwd()},
        )

    cli = inside(*cli_argv(bastion.home.root, "pending"))
    assert cli.returncode != 0
    assert "answered by a process this command cannot see" in cli.stderr, cli.stderr
    raw = f"from bastion.ops import opsock; opsock.call({str(bastion.home.operator_socket)!r}, "
    raw += "'pending', verify=False)"
    unchecked = inside(sys.executable, "-c", raw)
    assert unchecked.returncode != 0
    assert "inside a sandboxed run" in unchecked.stderr, unchecked.stderr


@pytest.mark.parametrize("sandboxed", [True, False], ids=["sandboxed", "unsandboxed"])
def test_a_run_is_still_the_run_after_the_gateway_is_killed(
    bastion: Bastion, sandboxed: bool
) -> None:
    """SIGKILL of the gateway, restart, unlock: the still-running run cannot answer its
    new card (sandboxed, it does not even see the operator socket; unsandboxed, the
    restored run's tree is refused), and the card knows the run."""
    agent = Agent(bastion.config, launcher=_run_launcher(bastion, "survivor", sandboxed))
    bastion.agents.append(agent)
    rid = agent.start("true")
    card = bastion.next_card()
    assert card["subject"]["kind"] == "registered run" and card["subject"]["pid"] == agent.pid
    bastion.answer(card, True)
    assert agent.wait(rid).rc == 0
    runs = json.loads((bastion.home.operator_dir / "runs.json").read_text())["runs"]
    assert [(r["pid"], r["label"]) for r in runs] == [(agent.pid, "survivor")]

    bastion.kill_daemon()
    bastion.start_daemon()
    bastion.unlock()

    rid = agent.start("true")
    card = bastion.next_card()
    subject = card["subject"]
    assert (subject["kind"], subject["pid"], subject["run"]) == (
        "registered run",
        agent.pid,
        "survivor",
    )
    assert card["reason"] == "gateway_restarted"  # its approval ended with the lifetime
    assert subject["sandboxed"] is sandboxed  # the kernel's word, after the restart too
    assert "survivor" in bastion.cli("pending").stdout
    # From inside the run, the operator's commands are refused (a child of the run).
    inside = agent.run([], argv=cli_argv(bastion.home.root, "decide", card["id"], "approve"))
    said = "no operator socket" if sandboxed else "refused"
    assert inside.rc != 0 and said in inside.stderr, inside.stderr
    assert [c["id"] for c in bastion.op("pending")] == [card["id"]]  # still unanswered
    bastion.answer(card, False)
    assert agent.wait(rid).rc != 0
    assert bastion.op("status")  # the gateway is well

    agent.close()  # the run exits: its entry goes
    wait_for(
        lambda: json.loads((bastion.home.operator_dir / "runs.json").read_text())["runs"] == [],
        30,
    )


def test_a_run_that_ended_while_the_gateway_was_down_is_not_restored(bastion: Bastion) -> None:
    agent = Agent(bastion.config, launcher=_run_launcher(bastion, "gone"))
    bastion.agents.append(agent)
    wait_for(lambda: (bastion.home.operator_dir / "runs.json").exists(), 30)
    wait_for(lambda: json.loads((bastion.home.operator_dir / "runs.json").read_text())["runs"], 30)
    bastion.kill_daemon()
    agent.close()
    bastion.start_daemon()
    assert json.loads((bastion.home.operator_dir / "runs.json").read_text())["runs"] == []


FRONT = """
import subprocess, sys
from pathlib import Path
from bastion.agent.client import register_front
register_front(Path(sys.argv[1]))
r = subprocess.run(["ssh", "-F", sys.argv[2], "web1", "true"], capture_output=True, text=True)
Path(sys.argv[3]).write_text(json.dumps({"rc": r.returncode, "stderr": r.stderr}))
"""


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux missing")
def test_a_front_registered_in_an_operator_pane_does_not_make_the_pane_the_subject(
    bastion: Bastion, tmp_path: Path
) -> None:
    """A process in a tmux pane registers as a front and runs ssh: with no MCP client
    above it there is no agent; refused, so the pane's shell stays the operator's."""
    script = tmp_path / "front.py"
    script.write_text("import json\n" + FRONT)
    out = tmp_path / "front.out"
    tsock = tmp_path / "tmux.sock"
    pane = (
        f"cd {os.getcwd()} && SHELL=/bin/sh PYTHONPATH={os.getcwd()} {sys.executable} {script} "
        f"{bastion.home.agent_socket} {bastion.config} {out}; sleep 60"
    )
    subprocess.run(
        ["tmux", "-S", str(tsock), "-f", "/dev/null", "new-session", "-d", "bash", "-c", pane],
        check=True,
        timeout=30,
    )
    try:
        wait_for(out.exists, 60)
        result = json.loads(out.read_text())
        assert result["rc"] != 0
        assert "registered front" in result["stderr"], result["stderr"]
        assert bastion.op("pending") == []
        # The pane itself is still the operator's: the socket answers it.
        ok = tmp_path / "pane.out"
        cmd = " ".join(cli_argv(bastion.home.root, "pending")) + f" > {ok} 2>&1; echo $? >> {ok}"
        subprocess.run(
            ["tmux", "-S", str(tsock), "new-window", "-d", "bash", "-c", cmd],
            check=True,
            timeout=30,
        )
        wait_for(lambda: ok.exists() and ok.read_text().strip().endswith("0"), 60)
    finally:
        subprocess.run(["tmux", "-S", str(tsock), "kill-server"], check=False, timeout=30)
