"""The gate as a pure function, over its whole state space."""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import replace

import pytest

from bastion.core.contract import Code, Refusal
from bastion.core.gate import (
    MAX_COMMAND_BYTES,
    AskCommand,
    AskSession,
    CommandGrant,
    Dispatch,
    EndReason,
    Request,
    SessionGrant,
    World,
    assess,
    evaluate,
    validate_command,
)
from bastion.core.policy import (
    Policy,
    PolicyError,
    entry_digest,
    host_key_fingerprint,
    parse_policy_text,
)

KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKwqVd3vMikqXGyJKL6mRiDHH8Ym3yLu2zkTPeUe2xx0"
POLICY_TEXT = f"""
[hosts.web1]
address = "10.0.0.5"
host_key = "{KEY}"

[[hosts.web1.accounts]]
user = "deploy"
credential = "deploy-key"
approval = "session"
deny = ["*rm -rf*"]
allow = ["echo *", "systemctl status *"]

[[hosts.web1.accounts]]
user = "ops"
credential = "ops-key"
approval = "per-command"
preapproved = ["uptime"]
"""
HOSTS = parse_policy_text(POLICY_TEXT, "test.toml")
POLICY = Policy(hosts=HOSTS, digest="d", files=("test.toml",))
SUBJECT = (100, 1.5, "nonce", "exe-sha256")
BOOT, EPOCH, NOW = "boot_a", 7, 1000.0


def request(command: bytes = b"echo hi", user: str = "deploy", host: str = "web1") -> Request:
    return Request("req_1", host, user, command, SUBJECT)


def grant(user: str = "deploy", **changes: object) -> SessionGrant:
    host = HOSTS["web1"]
    account = host.account(user)
    assert account is not None
    g = SessionGrant("ses_1", SUBJECT, "web1", user, BOOT, EPOCH, entry_digest(host, account), 0.0)
    return replace(g, **changes)  # type: ignore[arg-type]


def command_grant(command: bytes, **changes: object) -> CommandGrant:
    host = HOSTS["web1"]
    g = CommandGrant(
        "cmd_1",
        "ses_1",
        host.address,
        host.port,
        host_key_fingerprint(host.host_key),
        "ops",
        "ops-key",
        hashlib.sha256(command).hexdigest(),
        NOW + 60,
    )
    return replace(g, **changes)  # type: ignore[arg-type]


def world(**changes: object) -> World:
    w = World(
        locked=False,
        vault_epoch=EPOCH,
        boot_id=BOOT,
        policy=POLICY,
        subject_alive=True,
        session=None,
        ended=None,
        command_grant=None,
        now=NOW,
    )
    return replace(w, **changes)  # type: ignore[arg-type]


SESSIONS = {
    "none": (None, None),
    "live": ("live", None),
    **{f"ended_{r.value}": (None, r) for r in EndReason},
    "stale_boot": ("stale", EndReason.GATEWAY_RESTARTED),
    "stale_epoch": ("stale", EndReason.VAULT_STATE_CHANGED),
    "stale_policy": ("stale", EndReason.POLICY_CHANGED),
}
COMMANDS = [
    "session_account",
    "pc_none",
    "pc_approved",
    "pc_used",
    "pc_expired",
    "pc_other_command",
    "pc_other_session",
    "pc_preapproved",
]


def build(locked: bool, policy_ok: bool, session: str, command: str) -> tuple[Request, World]:
    user = "deploy" if command == "session_account" else "ops"
    cmd = b"uptime" if command == "pc_preapproved" else b"echo hi"
    kind, reason = SESSIONS[session]
    g: SessionGrant | None = None
    ended = reason if kind is None else None
    if kind == "live":
        g = grant(user)
    elif kind == "stale":
        field = {
            EndReason.GATEWAY_RESTARTED: {"boot_id": "boot_old"},
            EndReason.VAULT_STATE_CHANGED: {"vault_epoch": EPOCH - 2},
            EndReason.POLICY_CHANGED: {"entry_digest": "old"},
        }[reason]  # type: ignore[index]
        g = grant(user, **field)
    cg = {
        "pc_approved": command_grant(cmd),
        "pc_used": command_grant(cmd, used=True),
        "pc_expired": command_grant(cmd, expires_at=NOW - 1),
        "pc_other_command": command_grant(b"echo two"),
        "pc_other_session": command_grant(cmd, session_id="ses_other"),
    }.get(command)
    w = world(
        locked=locked,
        policy=POLICY if policy_ok else PolicyError("broken"),
        session=g,
        ended=ended,
        command_grant=cg,
    )
    return request(cmd, user), w


@pytest.mark.parametrize(
    "locked,policy_ok,session,command",
    list(itertools.product([True, False], [True, False], list(SESSIONS), COMMANDS)),
)
def test_state_space(locked: bool, policy_ok: bool, session: str, command: str) -> None:
    req, w = build(locked, policy_ok, session, command)
    verdict = evaluate(req, w)
    kind, reason = SESSIONS[session]
    if locked:
        assert isinstance(verdict, Refusal) and verdict.code is Code.VAULT_LOCKED
    elif not policy_ok:
        assert isinstance(verdict, Refusal) and verdict.code is Code.POLICY_UNAVAILABLE
    elif kind != "live":
        assert isinstance(verdict, AskSession) and verdict.reason is reason
    elif command in ("session_account", "pc_preapproved"):
        assert isinstance(verdict, Dispatch) and verdict.command_grant is None
    elif command == "pc_approved":
        assert isinstance(verdict, Dispatch) and verdict.command_grant == w.command_grant
    else:
        assert isinstance(verdict, AskCommand) and verdict.session == w.session


def test_policy_checks_come_before_approvals() -> None:
    w = world(session=grant())
    assert evaluate(request(host="db9"), w).code is Code.UNKNOWN_HOST  # type: ignore[union-attr]
    assert evaluate(request(user="root"), w).code is Code.POLICY_DENIED  # type: ignore[union-attr]
    denied = evaluate(request(b"echo x; rm -rf /"), w)
    assert isinstance(denied, Refusal) and denied.code is Code.POLICY_DENIED
    missed = evaluate(request(b"cat /etc/shadow"), w)
    assert isinstance(missed, Refusal) and "allow" in missed.message


def test_a_dead_subject_is_never_dispatched() -> None:
    verdict = evaluate(request(), world(session=grant(), subject_alive=False))
    assert isinstance(verdict, Refusal) and verdict.code is Code.SESSION_DENIED
    assert verdict.reauth_reason is EndReason.PROCESS_CHANGED


def test_command_grant_binds_host_address_port_and_key() -> None:
    cmd = b"echo hi"
    w = world(session=grant("ops"))
    for change in (
        {"address": "10.0.0.6"},
        {"port": 2222},
        {"host_key_fingerprint": "SHA256:x"},
        {"user": "deploy"},
        {"credential": "other"},
    ):
        v = evaluate(request(cmd, "ops"), replace(w, command_grant=command_grant(cmd, **change)))
        assert isinstance(v, AskCommand), change


@pytest.mark.parametrize(
    "command,fragment",
    [
        (b"", "empty"),
        (b"   ", "empty"),
        (b"echo a\0b", "NUL"),
        (b"echo \xff", "UTF-8"),
        (b"x" * (MAX_COMMAND_BYTES + 1), "limit"),
    ],
)
def test_malformed_commands_are_refused_before_policy(command: bytes, fragment: str) -> None:
    assert fragment in (validate_command(command) or "")
    verdict = evaluate(request(command), world(policy=PolicyError("broken")))
    assert isinstance(verdict, Refusal) and verdict.code is Code.UNSUPPORTED_REQUEST


def test_a_locked_vault_wins_over_everything() -> None:
    verdict = evaluate(request(b"echo \xff", host="db9"), world(locked=True))
    assert isinstance(verdict, Refusal) and verdict.code is Code.VAULT_LOCKED


def test_an_action_with_an_unknown_outcome_is_refused_before_any_card() -> None:
    verdict = evaluate(request(), world(action_unknown="req_9"))
    assert isinstance(verdict, Refusal) and verdict.code is Code.ACTION_OUTCOME_UNKNOWN
    assert "req_9" in verdict.message and "BASTION_ACK_UNKNOWN=1" in verdict.message
    locked = evaluate(request(), world(action_unknown="req_9", locked=True))
    assert isinstance(locked, Refusal) and locked.code is Code.VAULT_LOCKED


def test_shell_source_never_passes_an_allow_list() -> None:
    verdict = evaluate(request(b"echo hi; id"), world(session=grant()))
    assert isinstance(verdict, Refusal) and verdict.code is Code.POLICY_DENIED
    assert "';' at byte 7 (command separator)" in verdict.message


def test_shell_source_on_a_per_command_account_asks_a_card_that_says_so() -> None:
    w = world(session=grant("ops"))
    verdict = evaluate(request(b"uptime; id", "ops"), w)  # preapproved "uptime" does not apply
    assert isinstance(verdict, AskCommand)
    assert verdict.check.reading.argv is None
    assert [c.text for c in verdict.check.reading.constructs] == [";"]
    plain = evaluate(request(b"uptime", "ops"), w)
    assert isinstance(plain, Dispatch) and plain.command_grant is None


def test_assess_is_the_gates_policy_step() -> None:
    judged = assess(POLICY, "web1", "ops", b"uptime")
    assert (judged.deny, judged.command_card, judged.preapproved) == (None, False, "uptime")
    assert assess(POLICY, "web1", "ops", b"ls | head").command_card
    assert assess(POLICY, "nope", "ops", b"ls").deny.code is Code.UNKNOWN_HOST  # type: ignore[union-attr]
