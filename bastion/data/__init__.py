"""Files bastion ships inside its package, so that a wheel or `pipx install` has them
as a checkout does: the example policy (`bastion init` and the policy errors name it)
and the sshd_config template (`bastion demo`'s loopback sshd, the test fixtures and the
container image render it). These are the one copy: `policies/example.toml` and
`fixtures/sshd/sshd_config.template` in a checkout are links to them.
"""

from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).resolve().parent
EXAMPLE_POLICY = DATA / "example.toml"
SSHD_TEMPLATE = DATA / "sshd_config.template"
