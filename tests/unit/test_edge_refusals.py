"""core/refusals.py: the edges observe, the core chooses the code and the words.

The messages below are written out in full, as the edges wrote them before issue
19 moved the choice into the core: an agent (and every test that reads a message)
sees the same bytes.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import asyncssh
import pytest

from bastion.agent.client import AgentError, Busy, Declined, Unsupported
from bastion.core.contract import Code, Refusal
from bastion.core.events import CAUSE_LOST, Outcome, Result
from bastion.core.policy import PolicyError, parse_policy_text
from bastion.core.refusals import (
    AGENT_SIDE,
    SAID,
    Fact,
    Observed,
    agent_error,
    answer,
    lost,
    not_started,
    refusal,
    rejected,
    waited_out,
)
from bastion.gateway.agent_doors import hosts_view
from bastion.gateway.outbound import Dispatcher, Job
from bastion.vault import VaultError, VaultLocked

SIGN_FIX = (
    "An operator must make the target trust the CA (`bastion ca public` prints the "
    'sshd_config), list "deploy" as its principal, and check that the account\'s '
    "source_address is the address the target sees the gateway connect from."
)

# fact, the words the edge observed, and what the agent was told before the move
BEFORE: list[tuple[Fact, dict[str, Any], Code, str, str]] = [
    (
        Fact.KEY_LOCKED,
        {},
        Code.VAULT_LOCKED,
        "The credential vault was locked before the command could be sent. It was not "
        "queued or sent.",
        "VAULT_LOCKED",
    ),
    (
        Fact.KEY_UNAVAILABLE,
        {"credential": "k1", "user": "deploy", "host": "web1", "why": "no key k1"},
        Code.INTERNAL,
        'The policy names credential "k1" for deploy@web1, but the vault cannot provide it '
        "(no key k1). Nothing was sent; an operator must add the key (`bastion key import`) "
        "or fix the policy.",
        "INTERNAL",
    ),
    (
        Fact.HOST_KEY_CHANGED,
        {"host": "web1", "address": "10.0.0.5", "port": 22},
        Code.HOST_KEY_MISMATCH,
        'The host key of "web1" (10.0.0.5:22) does not match the key pinned in the policy. '
        "Do not retry: an operator must check the host and update the pin if the change is "
        "legitimate.",
        "HOST_KEY_MISMATCH",
    ),
    (
        Fact.KEY_REFUSED,
        {"host": "web1", "credential": "k1", "user": "deploy"},
        Code.TARGET_AUTH_FAILED,
        '"web1" refused the credential "k1" for user "deploy". An operator must install its '
        "public key on the target.",
        "TARGET_AUTH_FAILED",
    ),
    (
        Fact.CERTIFICATE_REFUSED,
        {"host": "web1", "key_id": "req_1", "serial": 7, "user": "deploy"},
        Code.TARGET_AUTH_FAILED,
        '"web1" refused the certificate (key id req_1, serial 7) for user "deploy". ' + SIGN_FIX,
        "TARGET_AUTH_FAILED",
    ),
    (
        Fact.NETWORK,
        {"host": "web1", "address": "10.0.0.5", "port": 22, "why": "Connection refused"},
        Code.UNREACHABLE,
        'Could not reach "web1" at 10.0.0.5:22 (Connection refused). Nothing ran; it is safe '
        "to retry later.",
        "UNREACHABLE",
    ),
    (
        Fact.SESSION_REFUSED,
        {"host": "web1", "why": "open failed"},
        Code.UNREACHABLE,
        '"web1" refused a new session (open failed); nothing ran. It is safe to retry later.',
        "session_refused",
    ),
    (
        Fact.WALK_CUT,
        {"host": "web1", "why": "connection lost"},
        Code.UNREACHABLE,
        'The connection to "web1" failed while the gateway read where the path leads '
        "(connection lost); the file operation was not sent. It is safe to retry later.",
        "walk_cut",
    ),
    (
        Fact.TERMINAL_REFUSED,
        {"host": "web1"},
        Code.UNSUPPORTED_REQUEST,
        '"web1" refused to make a terminal (sshd\'s PermitTTY, no-pty in authorized_keys, or '
        "a certificate without permit-pty); the command did not run. Run it without -t/-tt "
        "(or with -o RequestTTY=no); for ansible, turn pipelining on.",
        "terminal_refused",
    ),
    (
        Fact.FORWARDING,
        {"what": "a connection to localhost port 22"},
        Code.UNSUPPORTED_REQUEST,
        "bastion forwards nothing (asked: a connection to localhost port 22); it runs one "
        "command per ssh call: ssh HOST 'COMMAND'. Nothing was sent.",
        "UNSUPPORTED_REQUEST",
    ),
    (
        Fact.UNCERTIFIABLE,
        {"account": "deploy@web1", "why": "a NUL byte"},
        Code.UNSUPPORTED_REQUEST,
        "No certificate can carry this command for deploy@web1 (a NUL byte). Nothing was sent.",
        "UNSUPPORTED_REQUEST",
    ),
    (
        Fact.NO_CA,
        {"problem": "the vault holds no user CA"},
        Code.POLICY_UNAVAILABLE,
        "the vault holds no user CA",
        "POLICY_UNAVAILABLE",
    ),
    (
        Fact.CA_LOCKED,
        {},
        Code.VAULT_LOCKED,
        "The credential vault was locked before the command's certificate could be signed. "
        "It was not queued or sent.",
        "VAULT_LOCKED",
    ),
    (
        Fact.CA_FAILED,
        {"why": "bad key"},
        Code.INTERNAL,
        "The vault's CA could not sign the command's certificate (bad key). Nothing was sent.",
        "INTERNAL",
    ),
    (
        Fact.SIGNER_LOCKED,
        {},
        Code.VAULT_LOCKED,
        "The credential vault is locked, so the gateway cannot log in to OpenBao to sign the "
        "command's certificate. It was not queued or sent.",
        "VAULT_LOCKED",
    ),
    (
        Fact.SIGNER_FAILED,
        {"detail": "OpenBao at https://bao {braces} did not answer in time."},
        Code.INTERNAL,
        "OpenBao at https://bao {braces} did not answer in time.",
        "INTERNAL",
    ),
    (
        Fact.CERTIFICATE_NOT_JOURNALED,
        {},
        Code.INTERNAL,
        "The gateway could not record the command's certificate durably, so it did not use "
        "it. Nothing was sent.",
        "INTERNAL",
    ),
    (
        Fact.POLICY_UNREADABLE,
        {},
        Code.POLICY_UNAVAILABLE,
        "The policy is unavailable; the operator must fix it (see `bastion status`). Every "
        "request is refused until then.",
        "POLICY_UNAVAILABLE",
    ),
]


def test_every_fact_and_every_observation_has_one_row() -> None:
    assert set(SAID) == set(Fact) == {row[0] for row in BEFORE}
    assert set(AGENT_SIDE) == set(Observed)


@pytest.mark.parametrize(("fact", "words", "code", "message", "cause"), BEFORE)
def test_each_edge_refusal_says_what_it_said_before(
    fact: Fact, words: dict[str, Any], code: Code, message: str, cause: str
) -> None:
    said = refusal(fact, **words)
    assert isinstance(said, Refusal)
    assert (said.code, said.message, said.cause, said.reauth_reason) == (code, message, cause, None)


def test_a_refusal_after_the_dispatch_began_is_journaled_not_started() -> None:
    said = refusal(Fact.SESSION_REFUSED, host="web1", why="open failed")
    result = not_started(said)
    assert result.outcome is Outcome.NOT_STARTED and result.message == said.message
    assert result.meta("req_1") == {
        "request_id": "req_1",
        "code": "UNREACHABLE",
        "cause": "session_refused",
    }


def test_the_endings_after_the_exec_are_results_with_their_codes() -> None:
    assert rejected("web1") == Result(
        Outcome.REMOTE_REJECTED,
        code=Code.UNREACHABLE,
        message='"web1" refused to start the command; it did not run.',
        cause="exec_refused",
    )
    assert lost("web1", "the connection to the target was lost (reset)") == Result(
        Outcome.UNKNOWN,
        cause=CAUSE_LOST,
        code=Code.STATUS_UNKNOWN,
        message='The command was sent to "web1" but the connection to the target was lost '
        "(reset). It may or may not have run: inspect the target before retrying.",
    )


def test_a_policy_that_did_not_load_is_answered_as_before() -> None:
    assert hosts_view(PolicyError("p.toml: broken")) == {
        "ok": False,
        "error": {
            "code": "POLICY_UNAVAILABLE",
            "message": "The policy is unavailable; the operator must fix it (see `bastion "
            "status`). Every request is refused until then.",
            "request_id": None,
            "retryable": False,
        },
    }
    assert answer(Fact.POLICY_UNREADABLE) == hosts_view(PolicyError("x"))


def test_the_agent_side_says_what_it_observed_and_the_core_which_code() -> None:
    assert [AgentError("x").code, Unsupported("x").code, Busy("x").code, Declined("x").code] == [
        Code.INTERNAL,
        Code.UNSUPPORTED_REQUEST,
        Code.GATEWAY_BUSY,
        Code.INTERNAL,
    ]
    assert agent_error(Observed.STILL_HELD, "held", "req_1") == {
        "code": "STATUS_UNKNOWN",
        "message": "held",
        "request_id": "req_1",
        "retryable": False,
    }
    assert agent_error(Observed.GATEWAY_SLOW, "slow")["retryable"] is True
    # timeout_s ran out while the gateway waited: the journal's code, else APPROVAL_TIMEOUT
    assert waited_out("GATEWAY_BUSY") == "GATEWAY_BUSY"
    assert waited_out(None) == waited_out("") == "APPROVAL_TIMEOUT"


# -- the dispatcher raises what ended before the exec ----------------------------------------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _target(port: int, account: str = "") -> Any:
    host_key = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode().strip()
    text = f"""
[hosts.web1]
address = "127.0.0.1"
port = {port}
host_key = "{host_key}"
connect_timeout = 5

[[hosts.web1.accounts]]
user = "deploy"
credential = "k1"
{account}
"""
    host = parse_policy_text(text, "p.toml")["web1"]
    return host, host.accounts[0]


def _run(dispatcher: Dispatcher, host: Any, account: Any, **kwargs: Any) -> Result:
    def never(*_: object) -> None:
        raise AssertionError("nothing may reach the exec")

    job = Job(host, account, 1, b"true", None, never, never, **kwargs)  # type: ignore[arg-type]
    return asyncio.run(dispatcher.run(job))


def test_a_target_that_is_not_there_is_raised_as_a_refusal() -> None:
    host, account = _target(_closed_port())
    key = asyncssh.generate_private_key("ssh-ed25519")
    with pytest.raises(Refusal) as refused:
        _run(Dispatcher(lambda _: key), host, account)
    assert refused.value.code is Code.UNREACHABLE and refused.value.cause == "UNREACHABLE"
    assert refused.value.message.startswith('Could not reach "web1" at 127.0.0.1:')


@pytest.mark.parametrize(
    ("error", "code"),
    [(VaultLocked("locked"), Code.VAULT_LOCKED), (VaultError("no k1"), Code.INTERNAL)],
)
def test_a_key_the_vault_cannot_give_is_raised_as_a_refusal(error: Exception, code: Code) -> None:
    host, account = _target(_closed_port())

    def private_key(_: str) -> asyncssh.SSHKey:
        raise error

    with pytest.raises(Refusal) as refused:
        _run(Dispatcher(private_key), host, account)
    assert refused.value.code is code and refused.value.cause == code.value


def test_a_signers_refusal_passes_through_the_dispatcher_unchanged() -> None:
    host, account = _target(_closed_port(), 'auth = "certificate"\nsource_address = ["127.0.0.1"]')
    said = refusal(Fact.CA_LOCKED)

    async def certify() -> Any:
        raise said

    with pytest.raises(Refusal) as refused:
        _run(Dispatcher(lambda _: None), host, account, certify=certify)  # type: ignore[arg-type,return-value]
    assert refused.value is said


def test_a_connection_turned_away_for_a_full_share_is_busy_and_anything_else_internal() -> None:
    """The `ERR` line's code: a full gateway says retry (its words do too); a refusal
    of the header, the identity or a registration does not."""
    from bastion.core.contract import Code
    from bastion.core.refusals import TURNED, Turned

    assert set(TURNED) == set(Turned)
    assert TURNED[Turned.FULL] is Code.GATEWAY_BUSY and Code.GATEWAY_BUSY.retryable
    assert TURNED[Turned.REFUSED] is Code.INTERNAL and not Code.INTERNAL.retryable
