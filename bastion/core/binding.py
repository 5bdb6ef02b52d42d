"""What a "yes" is bound to: one record, shown on the card and held by the grant.

A person who approves a command approves it on one target -- the address,
port and host key the card shows -- as one account with one credential, for
exactly what the card shows it doing. The card carries that record, the
command grant carries the card's record unchanged, and the gate compares it
whole against the record of the request in front of it (`command_grant_holds`):
there is no field the card could show that the grant would not hold, and none
the check could forget.

A request is (channel, target, what). `what` is the sha256 of what the request
does on the target: the exact command bytes of an exec today; the digest of a
file operation is the same one field. An exec whose stdin was read before its
card (`core/gate.Stdin`) is bound to that too: `stdin`, the sha256 of the bytes the
target gets, so a yes for one script piped into `sh` runs no other.
"""

from __future__ import annotations

from dataclasses import dataclass

from bastion.core.policy import Account, Host


@dataclass(frozen=True)
class Binding:
    """Target, account and what: everything an approval of one request is bound to."""

    address: str
    port: int
    host_key_fingerprint: str
    user: str
    credential: str
    what: str | None  # sha256 of what the request does (its command); None on a session card
    stdin: str | None = None  # sha256 of the stdin read before the card; None: not read
    terminal: bool = False  # it runs with a terminal: a yes without one is not a yes with one

    @classmethod
    def of(
        cls,
        host: Host,
        account: Account,
        what: str | None,
        *,
        stdin: str | None = None,
        terminal: bool = False,
    ) -> Binding:
        """The binding of a request for `what` on this policy entry, as the policy
        says it now: built here only, so card, grant and check agree by construction."""
        return cls(
            address=host.address,
            port=host.port,
            host_key_fingerprint=host.fingerprint,
            user=account.user,
            credential=account.credential,
            what=what,
            stdin=stdin,
            terminal=terminal,
        )
