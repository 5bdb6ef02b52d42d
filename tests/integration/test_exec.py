"""Brokered exec through the stock ssh client and a real sshd (issue 2, acceptance 1-2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import exec_scenarios as scenarios
from tests.harness import Bastion


@pytest.mark.parametrize("scenario", scenarios.ALL, ids=lambda s: s.__name__)
def test_exec_passes_through(
    scenario: scenarios.Scenario, bastion: Bastion, tmp_path: Path
) -> None:
    scenario(bastion, tmp_path)
