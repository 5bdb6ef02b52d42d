"""`ssh -tt` gets an honest answer: bastion runs no command with a terminal, so a
request that asks for one is refused with bastion's error, and nothing runs.

Before, the gateway said no to the pty request; OpenSSH's `ssh -tt` then closes the
channel, but it has already sent its exec, which the gateway ran: the agent read
"PTY allocation request failed" (exit 255) while the command had run on the target
(issue 21: 7 times in 10). Here the command touches a marker on the target 20 times
and the marker never appears; the control, the same command without -tt, runs."""

from __future__ import annotations

import json
from pathlib import Path

from tests.harness import Bastion, approved_agent


def test_a_command_asking_for_a_terminal_never_runs(bastion: Bastion, tmp_path: Path) -> None:
    agent = approved_agent(bastion)  # an approved session: the refusal is the terminal's
    marker = tmp_path / "ran-with-a-terminal"
    for _ in range(20):
        r = agent.run(f"tty; touch {marker}", ssh_args=("-tt",))
        assert r.rc == 77 and r.code == "UNSUPPORTED_REQUEST", r.stderr
        assert r.error is not None and r.error["retryable"] is False
        assert "RequestTTY=no" in r.error["message"] and "not run" in r.error["message"]
        assert not marker.exists(), "the command ran although the agent was refused"
    # The control: the same command without -tt runs (and says it has no terminal).
    r = agent.run(f"tty; touch {marker}")
    assert marker.exists(), r.stderr
    assert b"not a tty" in r.stdout
    # Each refusal is on record as denied.
    lines = [json.loads(x) for x in bastion.cli("audit", "export").stdout.splitlines()]
    denied = [x for x in lines if x.get("type") == "denied" and "terminal" in json.dumps(x)]
    assert len(denied) == 20, [x.get("type") for x in lines][-30:]
