"""An ssh connection an agent can share is refused (issue 9, acceptance 3).

With ControlMaster, ControlPersist or `ssh -f`, the ssh client that opened a
connection to bastion -- identified and approved as one process -- serves
other processes through a control socket. bastion refuses such a connection's
commands, whatever comes first through it: nothing runs (marker files absent),
and the agent is told to run ssh without connection sharing.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.harness import Bastion


def ssh(b: Bastion, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ssh", "-F", str(b.config), *args], capture_output=True, text=True, timeout=timeout
    )


def close_master(b: Bastion, control: Path) -> None:
    ssh(b, "-o", f"ControlPath={control}", "-O", "exit", "web1")


def test_a_persistent_master_runs_its_own_command_and_no_one_elses(
    bastion: Bastion, tmp_path: Path
) -> None:
    control, first, rider = tmp_path / "cm", tmp_path / "first", tmp_path / "rider"
    agent = bastion.agent()
    persist = [
        "-o", "ControlMaster=yes", "-o", f"ControlPath={control}", "-o", "ControlPersist=60",
    ]  # fmt: skip
    try:
        rid = agent.start(f"touch {first}", ssh_args=tuple(persist))
        bastion.approve_next()  # the agent's own first command, as the agent
        assert agent.wait(rid).rc == 0 and first.exists()
        other = bastion.agent()  # an unrelated process, through the same control socket
        ridden = other.run(f"touch {rider}", ssh_args=("-o", f"ControlPath={control}"))
        assert ridden.rc != 0
        again = agent.run(f"touch {rider}", ssh_args=("-o", f"ControlPath={control}"))
        assert again.rc != 0  # the agent itself gets one command per connection too
        assert bastion.op("pending") == []  # nobody was even asked
    finally:
        close_master(bastion, control)
    assert not rider.exists()


def test_a_background_master_with_no_command_serves_no_one(
    bastion: Bastion, tmp_path: Path
) -> None:
    control, rider = tmp_path / "cm", tmp_path / "rider"
    agent = bastion.agent()
    try:
        master = agent.run(
            [],
            argv=["ssh", "-F", str(bastion.config), "-M", "-S", str(control), "-N", "-f", "web1"],
        )
        assert master.rc == 0 and control.exists()
        other = bastion.agent()
        ridden = other.run(f"touch {rider}", ssh_args=("-S", str(control)))
        assert ridden.code == "UNSUPPORTED_REQUEST", ridden.stderr
        assert "ControlMaster" in ridden.error["message"]  # type: ignore[index]
        assert bastion.op("pending") == []
    finally:
        close_master(bastion, control)
    assert not rider.exists()


def test_plain_ssh_still_runs(bastion: Bastion) -> None:
    agent = bastion.agent()
    rid = agent.start("echo one")
    bastion.approve_next()
    assert agent.wait(rid).stdout == b"one\n"
