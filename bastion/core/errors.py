"""The root of every exception bastion raises on purpose.

Catching `BastionError` catches every refusal and failure bastion itself
decided, and nothing that is a bug (a `TypeError`, an `AssertionError`) or the
system's own (an `OSError` that no bastion code wrapped). The tree of its
subclasses is drawn in the docstring of `BastionError`, and
`tests/unit/test_errors.py` keeps the drawing true.

Import-free on purpose: the standard-library-only operator wire (`opsock`) and
the devtools subclass it without pulling in anything else.
"""

from __future__ import annotations


class BastionError(Exception):
    """Something bastion refused or could not do, told in words a person can act on.

    Every exception class the package defines descends from this one. Each entry
    is `module.Class` under `bastion`; `[ValueError]` names a second base that
    callers catch it by. `Refusal` is the one that carries an agent-facing code
    (chosen in `core/`) to the agent, the journal and the MCP door.

        BastionError
        ├── core.contract.Refusal -- nothing was sent: a verdict, or an ending before the exec
        ├── core.certs.CertError [ValueError] -- a certificate cannot say exactly what was approved
        ├── core.command.RuleError [ValueError] -- a rule that is not a list of words
        ├── core.policy.PolicyError -- the policy cannot be trusted as written
        ├── core.files.FilesError [ValueError] -- a `files` table that is not path globs
        ├── core.grants.GrantError -- a bounded grant that cannot be made as the operator asked
        ├── core.presence.PresenceError [ValueError] -- a browser's answer not of WebAuthn's shape
        ├── config.ConfigError -- bastion.toml cannot be used as written
        ├── identity.resolver.IdentityError -- the peer could not be identified
        ├── journal.chain.JournalError -- the journal cannot be used as asked
        ├── vault.file_format.VaultError -- a vault failure a person can act on
        │   ├── vault.file_format.WrongPassphrase
        │   ├── vault.file_format.VaultLocked
        │   └── vault.file_format.KeyFilePassphraseNeeded
        ├── sandbox.isolation.IsolationError -- isolation is not set up, or cannot be
        ├── sandbox.per_run.Unavailable -- the sandbox cannot be made here: the reason and the fix
        ├── sandbox.layer.LayerError [OSError] -- the run's overlay or network could not be made
        ├── sandbox.memory.NotClosed -- the memory could not be closed to its uid
        ├── ops.actions.OpsError -- an operator action that cannot be done as asked
        ├── ops.opsock.OperatorError -- an operator request failed
        │   ├── ops.opsock.GatewayNotRunning
        │   └── ops.opsock.WrongServer -- not the recorded gateway answers: nothing was sent
        ├── ops.service_unit.UnitError [ValueError] -- an input the systemd unit cannot express
        ├── journal.courier.Undelivered -- a witness delivery failed part way
        ├── agent.client.AgentError -- the agent-side client could not get a usable answer
        │   ├── agent.client.Unsupported -- the model's input, refused before asking
        │   ├── agent.client.Busy -- the gateway did not answer in time
        │   └── agent.client.Declined -- the gateway said no
        ├── agent.sftp_wire.WireClosed -- the sftp channel ended before the answer came
        ├── agent.sftp_wire.Status -- an SFTP status other than OK: the target's, or a refusal
        ├── cli.export.ReaderGone -- whoever read the export closed it
        ├── cli.export.Away -- the gateway is not there yet; asking again may work
        ├── cli.export.ExportAborted -- the export stops; asking again will not help
        ├── gateway.admission.NoSlot -- no in-flight slot freed up within the wait
        ├── gateway.agent_ssh.TooManyConnections -- a tenant, or all agents, hold their share
        ├── gateway.approvals.CardError -- an operator answer that cannot be applied
        ├── gateway.signers.SignersError -- an enrolment or removal that cannot be done
        ├── gateway.console.ConsoleError -- a console request refused, with its HTTP status
        ├── gateway.export.StreamStopped -- the gateway ends an export stream
        ├── ca.openbao.LoginError [ValueError] -- a sealed login of neither shape
        ├── gateway.outbound._ChannelRefused -- the target refused a channel on a shared connection
        ├── gateway.tenants.RunRefused [ValueError] -- a run that would nest, or one too many
        ├── devtools.openbao.OpenBaoError [RuntimeError]
        ├── devtools.rsyslog.RsyslogError [RuntimeError]
        └── devtools.sshd_setup.SshdError [RuntimeError]
    """
