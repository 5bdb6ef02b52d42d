"""Clients tier: third-party clients through a real gateway to the real sshd.

The tools agents reach for that are not the stock `ssh` (scp, sftp, paramiko, fabric,
ansible, rsync, git) run here as an agent runs them: their own client code,
the config `bastion ssh-config` prints, inside `bastion run` where that is how an agent
would start them. The rootdir conftest's `bastion` fixture (a gateway running and
unlocked, a policy for `web1` to the test sshd) is the base; this file adds what these
clients need besides: a config naming a known_hosts file bastion wrote, a client script
run inside one run, and the journal's rows.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.harness import Agent, Bastion, inside, run_agent


@dataclass(frozen=True)
class ClientFiles:
    """The agents' ssh config and the known_hosts file `bastion ssh-config` wrote."""

    config: Path
    known_hosts: Path


@pytest.fixture
def client_files(bastion: Bastion, tmp_path: Path) -> ClientFiles:
    """`bastion ssh-config --known-hosts FILE` for the test's gateway (the agents'
    config is replaced by it: the same file, naming FILE as its UserKnownHostsFile)."""
    known = tmp_path / "bastion_known_hosts"
    bastion.config.write_text(bastion.cli("ssh-config", "--known-hosts", str(known)).stdout)
    return ClientFiles(bastion.config, known)


@dataclass
class InRun:
    """One `bastion run` (its agent process, sandboxed by default) and what runs in it."""

    b: Bastion
    agent: Agent

    def script(self, path: Path, *args: str, timeout: float = 120) -> Any:
        """Run a Python client script inside the run (this interpreter: it has paramiko
        and fabric); it prints one JSON document, returned here."""
        result = inside(self.agent, sys.executable, str(path), *args, timeout=timeout)
        assert result.rc == 0, f"rc {result.rc}: {result.stderr}"
        return json.loads(result.stdout)


@pytest.fixture
def in_run(bastion: Bastion, client_files: ClientFiles) -> InRun:
    """A default (sandboxed) `bastion run` with the known_hosts-naming config."""
    return InRun(bastion, run_agent(bastion, "--label", "clients"))


@pytest.fixture
def journal_rows(bastion: Bastion) -> Any:
    """The journal's rows, one per request (`bastion audit activity --json`), as a call."""
    return lambda: json.loads(bastion.cli("audit", "activity", "--json").stdout)
