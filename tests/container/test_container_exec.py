"""Brokered exec against sshd in a container (fixtures/sshd/Dockerfile under podman).

The passthrough scenarios of tests/exec_scenarios.py (as integration/test_exec.py runs
them), against the image's sshd instead of a loopback one, plus proof that the commands
really ran inside the container.
"""

from __future__ import annotations

import secrets
import subprocess
from pathlib import Path

import pytest

from fixtures.sshd.podman import Container
from tests import exec_scenarios as scenarios
from tests.harness import Bastion, after_waiting

pytestmark = pytest.mark.container


@pytest.mark.parametrize("scenario", scenarios.ALL, ids=lambda s: s.__name__)
def test_exec_passes_through(
    scenario: scenarios.Scenario, bastion: Bastion, tmp_path: Path
) -> None:
    scenario(bastion, tmp_path)


def test_commands_run_inside_the_container(
    bastion: Bastion, container: Container, client_key: tuple[Path, str]
) -> None:
    token = secrets.token_hex(16)
    marker = "/root/bastion-container-marker"
    agent = bastion.agent()
    # pid 1 of the container's pid namespace is its sshd (start-sshd execs it); the
    # session tag is the image's fixture id, not a loopback fixture's.
    rid = agent.start(
        f"echo {token} > {marker} && cat /proc/1/comm && echo $BASTION_SSHD_FIXTURE && id -un"
    )
    card = bastion.approve_next()
    r = agent.wait(rid)
    assert (r.rc, r.stdout, after_waiting(r.stderr, card)) == (0, b"sshd\ncontainer\nroot\n", "")

    # The file exists in the container's filesystem, read back without ssh or bastion...
    seen = container.exec("cat", marker)
    assert seen.stdout == f"{token}\n".encode()
    # ...and not on this machine.
    host_marker = Path(marker)
    assert not host_marker.exists() or token not in host_marker.read_text(errors="replace")

    # The container's sshd logged the login with the deploy key the vault holds.
    fingerprint = subprocess.run(
        ["ssh-keygen", "-l", "-f", str(client_key[0])],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.split()[1]
    accepted = [line for line in container.logs().splitlines() if "Accepted publickey" in line]
    assert any(
        "for root from 127.0.0.1" in line and line.endswith(fingerprint) for line in accepted
    ), accepted
