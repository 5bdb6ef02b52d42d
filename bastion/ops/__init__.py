"""The ops room: what an operator does, with or without a running gateway.

- `actions`: operator actions with one implementation each, whether the gateway runs
  them or the CLI does on the files; this face names its public names.
- `opsock`: the operator socket's wire, client side (standard library only).
- `doctor`: `bastion doctor`'s checks, one verdict each.
- `service_unit`: the systemd unit that runs the gateway, rendered from one record.
"""

from __future__ import annotations

import importlib
from typing import Any

# Every operator command imports `bastion.ops.opsock`, and a package's face runs first:
# an eager face would load the journal, the CA and cryptography (~240 ms) before the
# wire's first byte. So the face names `actions`' public names and loads it on first use.
_ACTIONS = frozenset(
    {
        "KEY_OPS",
        "OpsError",
        "VIEWS",
        "audit_view",
        "check_key_args",
        "identity_pin",
        "key_op",
        "needs_unlock",
        "openbao_login",
        "unlocked",
        "user_label",
    }
)


def __getattr__(name: str) -> Any:
    if name in _ACTIONS:
        return getattr(importlib.import_module("bastion.ops.actions"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_ACTIONS)
