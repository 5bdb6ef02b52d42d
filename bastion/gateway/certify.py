"""A certificate account's login for one request: decided, signed, journaled.

The certificate is a capability: for `cert_ttl` seconds it lets whoever holds
its key run the approved command from the gateway's address. So it is made
only after the gate let the request through, for exactly the bytes decided
(`core/certs.py`), by whichever backend signs (`ca/issuer.py`), and it
is on disk in the journal -- serial, key id, CA -- before it can leave the
gateway. The key lives in memory for one connection, then is dropped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from bastion.ca.issuer import Issuer
from bastion.ca.vault_ca import Issued
from bastion.core.certs import Auth, CertError, cert_spec
from bastion.core.gate import Request
from bastion.core.policy import Account
from bastion.core.refusals import Fact, refusal
from bastion.gateway.recorder import Recorder
from bastion.journal import JournalError

log = logging.getLogger(__name__)
NO_ISSUER = "this gateway has no certificate issuer"


class Certifier:
    def __init__(
        self, issuer: Issuer, recorder: Recorder, clock: Callable[[], float] = time.time
    ) -> None:
        self.issuer = issuer
        self.recorder = recorder
        self.clock = clock

    def problem(self) -> str | None:
        """Why no certificate account can be served now (asked by the gate)."""
        return self.issuer.problem()

    def login(self, req: Request, account: Account) -> Callable[[], Awaitable[Issued]] | None:
        """For a certificate account, what the dispatcher calls when it is about to
        connect (late, so the validity window starts as close to the login as it
        can); None for a key account."""
        if account.auth is not Auth.CERTIFICATE:
            return None

        async def issue() -> Issued:
            return await self.issue(req.request_id, account, req.command)

        return issue

    async def issue(self, request_id: str, account: Account, command: bytes) -> Issued:
        try:
            spec = cert_spec(
                request_id,
                account.user,
                command,
                account.source_address,
                account.cert_ttl,
                self.clock(),
            )
        except CertError as exc:
            raise refusal(Fact.UNCERTIFIABLE, account=account.label, why=exc) from None
        issued = await self.issuer.issue(spec)
        meta = issued.journal_meta()
        try:
            self.recorder.certificate(
                request_id, meta, {"valid_before": issued.valid_before, "by": issued.backend}
            )
        except (OSError, JournalError) as exc:
            log.error("%s: could not journal its certificate: %s", request_id, exc)
            raise refusal(Fact.CERTIFICATE_NOT_JOURNALED) from None
        log.info(
            "%s: certificate serial %d for %s@%s signed by %s (%s)",
            request_id,
            issued.serial,
            account.user,
            account.host,
            issued.ca,
            issued.backend,
        )
        return issued
