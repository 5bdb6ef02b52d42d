"""The agent-facing contract table: every code distinct, complete, with its exit status."""

from __future__ import annotations

import ast
import json
from pathlib import Path

from bastion.agent import wire
from bastion.agent.client import GATEWAY_EXITS
from bastion.core.contract import CONTRACT, Code, Exit, Failure
from bastion.core.refusals import AGENT_SIDE, TURNED, agent_error


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


# -- who may choose a code ------------------------------------------------------------------

PACKAGE = Path(__file__).resolve().parents[2] / "bastion"
CODE_VALUES = {c.value for c in Code}
# Modules outside core/ that may name a code, and why: as few as can be.
MAY_NAME_CODES: dict[str, str] = {
    # Standard library only and run by path with -I -S: it cannot import the table,
    # so its two endings are written out and held to it below.
    "bastion/agent/wire.py": "the proxy's wire cannot import bastion",
    "bastion/agent/proxy.py": "its one ending when wire.py is not beside it",
}


def codes_named(path: Path, root: Path = PACKAGE.parent) -> list[str]:
    """Where a module names a contract code: `Code.X` (or `contract.Code.X`), or a
    code's value as a string of its own."""
    rel = path.relative_to(root).as_posix()
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in Code.__members__:
            owner = node.value
            name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", None)
            if name == "Code":
                found.append(f"{rel}:{node.lineno}: Code.{node.attr}")
        elif isinstance(node, ast.Constant) and node.value in CODE_VALUES:
            found.append(f"{rel}:{node.lineno}: {node.value!r}")
    return found


def test_codes_are_chosen_only_in_the_core() -> None:
    """An edge observes and calls the core (core/refusals.py, the gate); it never picks
    the code an agent is told on its own judgement. Lists every offending file:line."""
    offending = [
        where
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.relative_to(PACKAGE).parts[0] != "core"
        and path.relative_to(PACKAGE.parent).as_posix() not in MAY_NAME_CODES
        for where in codes_named(path)
    ]
    assert offending == [], "\n".join(offending)


def test_the_grep_sees_every_spelling(tmp_path: Path) -> None:
    probe = tmp_path / "bastion" / "edge.py"
    probe.parent.mkdir()
    probe.write_text(
        "from x import Code, contract\n"
        "a = Code.INTERNAL\n"
        "b = contract.Code.UNREACHABLE\n"
        'c = "GATEWAY_BUSY"\n'
        'd = ("INTERNALS", "STATUS_UNKNOWN means", Other.INTERNAL)\n'
    )
    assert codes_named(probe, tmp_path) == [
        "bastion/edge.py:2: Code.INTERNAL",
        "bastion/edge.py:3: Code.UNREACHABLE",
        "bastion/edge.py:4: 'GATEWAY_BUSY'",
    ]


# -- the agent side's numbers are the table's ------------------------------------------------


def test_the_agent_sides_numbers_are_the_contracts() -> None:
    """proxy.py may import nothing of bastion's; agent.client and agent.mcp_front import the
    table. Either way the codes, statuses and flags an agent reads are these."""
    for code, status, retryable in (wire.INTERNAL, wire.GATEWAY_BUSY, wire.UNSUPPORTED_REQUEST):
        assert CONTRACT[Code(code)] == (status, retryable), code
    # Every code the agent socket may put on an `ERR` line, the proxy can end with.
    for code in TURNED.values():
        assert wire.ENDINGS[code.value] == (code.value, *CONTRACT[code]), code
    assert GATEWAY_EXITS == {int(e) for e in Exit} == {int(s) for s, _ in CONTRACT.values()}
    for observed, code in AGENT_SIDE.items():
        assert agent_error(observed, "m")["retryable"] is code.retryable, observed
