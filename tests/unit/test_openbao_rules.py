"""The pure parts of the OpenBao backend: what a sealed login may be, how a certificate
that came back is read and judged, and what a role must allow. (A real `bao server -dev`
exercises them end to end in tests/integration/test_openbao_*.py.)"""

from __future__ import annotations

from dataclasses import replace

import asyncssh
import pytest

from bastion.ca import vault_ca
from bastion.ca.openbao import (
    LoginError,
    cert_fields,
    certificate_problem,
    parse_login,
    parse_serial,
    role_command,
    role_problems,
)
from bastion.core.certs import cert_spec

NOW = 1_700_000_000
SPEC = cert_spec("req_1", "deploy", b"systemctl status nginx", ("10.0.0.2/32",), 60, NOW)
AUTHORITY = asyncssh.generate_private_key("ssh-ed25519")


def signed(**changes: object) -> tuple[asyncssh.SSHCertificate, asyncssh.SSHKey]:
    """A certificate as a role might sign it: bastion's spec unless changed."""
    key = vault_ca.fresh_key()
    fields = {
        "principals": [SPEC.principal],
        "serial": 5,
        "valid_after": SPEC.valid_after,
        "valid_before": SPEC.valid_before,
        "force_command": SPEC.force_command,
        "source_address": list(SPEC.source_address),
        "permit_x11_forwarding": False,
        "permit_agent_forwarding": False,
        "permit_port_forwarding": False,
        "permit_pty": False,
        "permit_user_rc": False,
    } | changes
    key_id = str(fields.pop("key_id", SPEC.key_id))
    return AUTHORITY.generate_user_certificate(key, key_id, **fields), key  # type: ignore[arg-type]


def test_exactly_what_was_asked_passes_and_its_fields_read_back() -> None:
    cert, key = signed()
    assert certificate_problem(cert, key, SPEC, NOW) is None
    got = cert_fields(cert.public_data)
    assert (got.serial, got.key_id, got.principals) == (5, "req_1", ("deploy",))
    assert set(got.critical) == {"force-command", "source-address"} and not got.extensions


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"permit_pty": True}, "extensions ['permit-pty']"),
        ({"permit_port_forwarding": True}, "extensions ['permit-port-forwarding']"),
        ({"force_command": None}, "no force-command"),
        ({"force_command": "id"}, "another force-command"),
        ({"source_address": ["0.0.0.0/0"]}, "source-address"),
        ({"principals": ["deploy", "root"]}, "principals"),
        ({"key_id": "req_other"}, "key id 'req_other'"),
        ({"valid_before": SPEC.valid_before + 3600}, "past"),
        ({"valid_after": NOW - 120, "valid_before": NOW - 60}, "already expired"),
    ],
)
def test_a_certificate_that_says_anything_else_is_refused(
    changes: dict[str, object], named: str
) -> None:
    cert, key = signed(**changes)
    problem = certificate_problem(cert, key, SPEC, NOW)
    assert problem is not None and named in problem
    assert "systemctl" not in problem  # the command is never in a message


def test_a_certificate_for_another_key_is_refused() -> None:
    cert, _ = signed()
    problem = certificate_problem(cert, vault_ca.fresh_key(), SPEC, NOW)
    assert problem is not None and "another key" in problem


def test_a_later_spec_window_is_judged_against_its_own_request() -> None:
    cert, key = signed()
    later = replace(SPEC, valid_before=SPEC.valid_before - 600)
    assert "past" in (certificate_problem(cert, key, later, NOW) or "")


def test_logins_are_a_token_or_an_approle_and_nothing_else() -> None:
    assert parse_login(b'{"token": "s.abc"}').token == "s.abc"
    approle = parse_login(b'{"role_id": "r", "secret_id": "s"}')
    assert approle.approle and approle.role_id == "r"
    assert "s.abc" not in repr(parse_login(b'{"token": "s.abc"}'))  # never in a log line
    for bad in (b"", b"[]", b'{"token": ""}', b'{"token": "a", "role_id": "r"}', b'{"x": 1}'):
        with pytest.raises(LoginError):
            parse_login(bad)


def test_serials_are_hex_with_or_without_separators() -> None:
    assert parse_serial("aa37bcdea4edcdf9") == 0xAA37BCDEA4EDCDF9
    assert parse_serial("0a:0b") == parse_serial("0a-0b") == 0x0A0B
    with pytest.raises(ValueError):
        parse_serial(None)


FIT = {
    "key_type": "ca",
    "allow_user_certificates": True,
    "allow_host_certificates": False,
    "allow_user_key_ids": True,
    "allowed_critical_options": "force-command,source-address",
    "allowed_extensions": "",
    "default_extensions": {},
    "allowed_users": "deploy,backup",
}


def test_a_fit_role_has_no_problem_and_each_misfit_names_its_fix() -> None:
    assert role_problems(FIT, ["deploy"], "ssh", "bastion") == []
    for change, named in (
        ({"allowed_critical_options": ""}, "empty allows any"),
        ({"allow_user_key_ids": False}, "request id"),
        ({"default_extensions": {"permit-pty": ""}}, "default_extensions"),
        ({"allowed_extensions": "permit-pty"}, "allowed_extensions"),
        ({"allowed_users": "backup"}, "lacks ['deploy']"),
        ({"allow_host_certificates": True}, "allow_host_certificates"),
    ):
        (problem,) = role_problems(FIT | change, ["deploy"], "ssh", "bastion")
        assert named in problem, problem
        assert problem.endswith(role_command("ssh", "bastion", {"deploy", "backup"}))
