"""The layout of $BASTION_HOME, named in one place.

Everything secret or authoritative lives here with owner-only permissions:
the vault, the gateway's own SSH host key, the policies, the journal. Only
the agent socket is meant to be reached by agents, and it has a directory of
its own (`run/`, nothing else in it): a sandboxed run gets that directory
bound in read-only, so a gateway restart's new socket is seen inside, while
the operator socket and the gateway's records (`operator/`) stay out.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


def default_home() -> Path:
    env = os.environ.get("BASTION_HOME")
    if env:
        return Path(env).expanduser().absolute()
    data = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local/share")
    return Path(data).absolute() / "bastion"


@dataclass(frozen=True)
class Home:
    root: Path

    @property
    def vault(self) -> Path:
        return self.root / "vault.json"

    @property
    def host_key(self) -> Path:
        """The gateway's own SSH host key, shown to agents' ssh clients. It
        lives outside the vault: a locked gateway must still be able to say
        'locked' over SSH."""
        return self.root / "gateway_host_key"

    @property
    def known_hosts(self) -> Path:
        """The one line agents' ssh trusts, used with HostKeyAlias."""
        return self.root / "known_hosts"

    @property
    def policies(self) -> Path:
        return self.root / "policies"

    @property
    def run(self) -> Path:
        return self.root / "run"

    @property
    def agent_socket(self) -> Path:
        return self.run / "agent.sock"

    @property
    def agent_known_hosts(self) -> Path:
        """A copy of `known_hosts` in the agents' directory (the gateway writes it at
        start): a sandboxed run, which cannot see the rest of the home, reads the pin
        here (`bastion mcp` inside a run)."""
        return self.run / "known_hosts"

    @property
    def operator_dir(self) -> Path:
        """The operator socket and the gateway's records of its lifetime: never
        bound into a sandbox (the agents' door is `run/`)."""
        return self.root / "operator"

    @property
    def operator_socket(self) -> Path:
        return self.operator_dir / "operator.sock"

    @property
    def lifetime(self) -> Path:
        """Hashed facts about the approvals alive in the current lifetime, so
        the next one can explain its cards (`gateway_restarted`). Never a grant."""
        return self.operator_dir / "lifetime.json"

    @property
    def config(self) -> Path:
        """The gateway's own settings (witness, export): see config.py."""
        return self.root / "bastion.toml"

    @property
    def witness_spool(self) -> Path:
        """Witness entries not yet delivered (a witness was down): sent in order later."""
        return self.root / "witness-spool"

    @property
    def journal(self) -> Path:
        return self.root / "journal"

    @property
    def isolation(self) -> Path:
        """Where `bastion isolate setup` records the agent user and its socket
        directory; `bastion daemon` and `bastion run --isolated` read it."""
        return self.root / "isolation.json"

    def exists(self) -> bool:
        return self.vault.exists()

    def make_dirs(self) -> None:
        for d in (self.root, self.policies, self.run, self.operator_dir):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(d, 0o700)
