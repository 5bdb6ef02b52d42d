"""The refusals an edge observes come after a locked vault, end to end (issue 19).

A shell request, a command through an ssh ControlMaster, and a master's second
session used to be refused before the gate looked at the vault; now the gate
decides them in its contract order, so a locked vault answers first
(`VAULT_LOCKED`), and once it is unlocked each is refused as before.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness import Bastion, Result, approved_agent
from tests.integration.test_control_master import assert_refused, control_path, master_pid

pytestmark = pytest.mark.skipif(not Path("/usr/bin/ssh").exists(), reason="no /usr/bin/ssh")


def assert_locked(result: Result) -> None:
    assert result.rc == 77, result.stderr
    assert result.code == "VAULT_LOCKED", result.stderr
    assert result.error is not None and result.error["retryable"] is False


def test_a_locked_vault_answers_a_shell_and_a_masters_commands_first(
    bastion: Bastion, tmp_path: Path
) -> None:
    a = approved_agent(bastion)
    b = bastion.agent()
    marker = tmp_path / "marker"
    bastion.cli("lock")
    assert_locked(a.run([], ssh_args=("-o", "RequestTTY=no")))  # a shell
    with control_path() as sock:
        master = ("-o", "ControlMaster=yes", "-o", f"ControlPath={sock}", "-o", "ControlPersist=60")
        started = a.run([], argv=["ssh", "-F", str(bastion.config), *master, "-N", "-f", "web1"])
        assert started.rc == 0, started.stderr
        assert master_pid(sock) is not None
        # The master's first session (a shared connection), then a later one (SHARED).
        assert_locked(a.run(f"touch {marker}", ssh_args=("-o", f"ControlPath={sock}")))
        assert_locked(b.run(f"touch {marker}", ssh_args=("-S", str(sock))))
        assert bastion.op("pending") == []
        bastion.unlock()
        shell = a.run([], ssh_args=("-o", "RequestTTY=no"))
        assert shell.rc == 77 and shell.code == "UNSUPPORTED_REQUEST", shell.stderr
        assert "one command" in shell.error["message"]  # type: ignore[index]
        assert_refused(b.run(f"touch {marker}", ssh_args=("-S", str(sock))))
        assert bastion.op("pending") == []
    assert not marker.exists()
