"""The agent-facing contract table: every code distinct, complete, with its exit status."""

from __future__ import annotations

import json

from bastion.core.contract import CONTRACT, Code, Exit, Failure


def test_every_code_is_distinct_and_in_the_table() -> None:
    assert len({c.value for c in Code}) == len(Code) == 16
    assert set(CONTRACT) == set(Code)


def test_exit_statuses_follow_design_section_4() -> None:
    # GATEWAY_BUSY (issue 11, docs/architecture.md): nothing was sent, retry later.
    not_reached = {
        Code.UNREACHABLE,
        Code.HOST_KEY_MISMATCH,
        Code.TARGET_AUTH_FAILED,
        Code.GATEWAY_BUSY,
    }
    for code in Code:
        if code in not_reached:
            assert code.exit_status == 69
        elif code is Code.STATUS_UNKNOWN:
            assert code.exit_status == 76
        elif code is Code.INTERNAL:
            assert code.exit_status == 70
        else:
            assert code.exit_status == Exit.DENIED == 77
    assert [c for c in Code if c.retryable] == [Code.UNREACHABLE, Code.GATEWAY_BUSY]


def test_failure_line_is_one_json_object_with_the_contract_keys() -> None:
    line = Failure(Code.POLICY_DENIED, "no", "req_1", "revoked").json_line()
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    doc = json.loads(line)
    assert doc == {
        "ok": False,
        "error": {
            "code": "POLICY_DENIED",
            "message": "no",
            "request_id": "req_1",
            "retryable": False,
            "reauth_reason": "revoked",
        },
    }
