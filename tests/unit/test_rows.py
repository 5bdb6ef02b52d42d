"""The rows `audit activity`, `sessions` and `pending` print (bastion/cli/rows.py): what
each says, that none is wider than the width it was given, and the filters."""

from __future__ import annotations

import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bastion.cli import rows
from bastion.cli.rows import cells, cut, parse_when
from bastion.core.events import ActivityFilter

NOW = time.mktime((2026, 12, 1, 21, 50, 0, 0, 0, -1))  # local time, as the views show it


def subject(label: str | None = None, **over: Any) -> dict[str, Any]:
    run = None if label is None else {"label": label, "given": None}
    return {"pid": 4242, "exe": "/usr/bin/python3.11", "run": label, "run_info": run, **over}


def request(**over: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "request_id": "req_1",
        "host": "web1",
        "user": "deploy",
        "command": "systemctl restart app",
        "outcome": "completed",
        "code": None,
        "exit_status": 0,
        "subject": subject("deploy-bot"),
        "run": "deploy-bot",
        "received_at": NOW - 30,
        "certificate": None,
    }
    return row | over


def test_an_activity_row_says_when_who_where_how_it_ended_and_what() -> None:
    (line,) = rows.activity_rows([request()], None, NOW)
    assert line.startswith('21:49:30  run "deploy-bot" ')
    assert "  deploy@web1  " in line
    assert line.endswith("  completed exit 0  systemctl restart app")


def test_at_80_columns_long_labels_and_hosts_share_the_cut_with_the_command() -> None:
    row = request(subject=subject("a-very-long-run-label-" * 3), host="db-" * 15)
    line = rows.activity_row(row, 80, NOW)
    assert line == (
        '21:49:30  run "a-very-lo…  deploy@db-db-db…  completed exit 0  systemctl resta…'
    )
    usual = rows.activity_row(request(command="systemctl restart ap"), 80, NOW)
    assert usual == (  # a usual row fits whole, in 79 cells
        '21:49:30  run "deploy-bot"  deploy@web1  completed exit 0  systemctl restart ap'
    )


def test_rows_of_one_view_stand_in_aligned_columns() -> None:
    short = request(run=None, subject=subject("x"), command="id")
    lines = rows.activity_rows([request(), short], None, NOW)
    assert lines[0].index("deploy@web1") == lines[1].index("deploy@web1")
    assert lines[0].index("completed") == lines[1].index("completed")


def test_outside_a_run_the_row_names_the_process_and_another_day_its_date() -> None:
    row = request(subject=subject(), run=None, received_at=NOW - 86400)
    line = rows.activity_row(row, None, NOW)
    assert line.startswith("2026-11-30 21:50:00  pid 4242 python3.11 ")


def test_a_denial_shows_its_code_and_a_certificate_its_serial() -> None:
    denied = rows.activity_row(
        request(outcome="denied", code="COMMAND_NOT_ALLOWED", exit_status=None), None, NOW
    )
    assert "  denied COMMAND_NOT_ALLOWED  " in denied
    cert = rows.activity_row(request(certificate={"serial": 17}), None, NOW)
    assert "completed exit 0 cert serial 17" in cert


def test_the_command_is_escaped_byte_for_byte_and_cut_with_an_ellipsis() -> None:
    line = rows.activity_row(request(command="echo \x1b[2J\u202ehi\nrm -rf /"), None, NOW)
    assert "\x1b" not in line and "\u202e" not in line and "\n" not in line
    assert line.endswith("echo \\x1b[2J\\u202ehi\\nrm -rf /")
    short = rows.activity_row(request(command="x" * 300), 80, NOW)
    assert cells(short) == 79 and short.endswith("…")


def test_a_file_operation_shows_its_path() -> None:
    row = request(command=None, file={"op": "put", "path": "/etc/motd", "to": None})
    assert rows.activity_row(row, None, NOW).endswith("  put /etc/motd")


def test_the_grants_as_the_gateway_and_the_journal_give_them() -> None:
    """`sessions` rows carry `grants` (`BoundedGrant.as_json`: pattern, uses_left); an activity
    row the id of the grant its use came from (`dispatch_started`'s meta)."""
    made = {"id": "grt_9", "pattern": "echo restart *", "uses_left": 1, "expires_at": None}
    live = {"id": "ses_1", "user": "u", "host": "web1", "approved_at": NOW, "grants": [made]}
    assert rows.session_row(live, None, NOW).endswith("grant grt_9: echo restart *, 1 use left")
    line = rows.activity_row(request(grant="grt_9"), None, NOW)
    assert "[grant grt_9]" in line
    used = request(grant="grt_9", grant_pattern="echo restart *", grant_uses_left=0)
    assert "[grant grt_9: echo restart *, 0 uses left]" in rows.activity_row(used, None, NOW)


def test_a_grant_shows_its_pattern_and_the_uses_left() -> None:
    grant = {"id": "gr_1", "pattern": ["systemctl", "restart", "*"], "remaining": 1}
    line = rows.activity_row(request(grant=grant), None, NOW)
    assert "[grant gr_1: systemctl restart *, 1 use left]" in line
    session = {"id": "ses_1", "host": "web1", "user": "deploy", "subject": subject("L")}
    two = rows.session_row(session | {"grant": grant | {"remaining": 2}}, None, NOW)
    assert two.endswith("by: not recorded  grant gr_1: systemctl restart *, 2 uses left")


def test_a_live_session_says_since_when_and_who_approved_it() -> None:
    live = {
        "id": "ses_1",
        "host": "web1",
        "user": "deploy",
        "subject": subject("deploy-bot"),
        "approved_at": NOW - 60,
        "approved_by": {"uid": 0, "pid": 777},
    }
    line = rows.session_row(live, None, NOW)
    assert line.startswith('ses_1  run "deploy-bot" ')
    assert line.endswith("  since 21:49:00  by uid 0")


def test_an_ended_session_says_when_and_why() -> None:
    ended = {
        "session_id": "ses_2",
        "host": "web1",
        "user": "deploy",
        "subject": subject(),
        "approved_at": NOW - 600,
        "approved_by": None,  # a journal written before approvals named their operator
        "ended_at": NOW - 5,
        "end_reason": "process_changed",
    }
    line = rows.session_row(ended, None, NOW)
    assert line.endswith("  21:40:00-21:49:55 process_changed  by: not recorded")
    assert "  since 21:40:00  " in rows.session_row(ended | {"end_reason": None}, None, NOW)


def test_a_pending_card_says_when_it_expires() -> None:
    card = {
        "id": "cc_1",
        "kind": "command",
        "host": "web1",
        "user": "deploy",
        "subject": subject("deploy-bot"),
        "command": "uptime",
        "expires_at": NOW + 43,
    }
    (line,) = rows.pending_rows([card], None, NOW)
    assert "  expires in 43 s (21:50:43)  uptime" in line
    assert rows.expiry(NOW - 1, NOW) == "at 21:49:59, passed"


shown_text = st.text(
    st.characters(blacklist_categories=("Cs",)) | st.sampled_from("中日\x1b\n\u202e…"),
    max_size=120,
)


@settings(max_examples=300, deadline=None)
@given(
    width=st.integers(1, 250),
    command=shown_text,
    label=shown_text,
    host=shown_text,
    grant=st.none() | st.fixed_dictionaries({"id": shown_text, "pattern": shown_text}),
)
def test_no_row_is_wider_than_its_width(
    width: int, command: str, label: str, host: str, grant: dict[str, Any] | None
) -> None:
    row = request(command=command, host=host, subject=subject(label), grant=grant)
    session = row | {"id": "ses_1", "approved_at": NOW, "approved_by": {"uid": 0, "pid": 1}}
    card = row | {"id": "cc_1", "kind": "command", "expires_at": NOW + 9}
    for line in (
        rows.activity_row(row, width, NOW),
        rows.session_row(session, width, NOW),
        rows.pending_row(card, width, NOW),
    ):
        assert cells(line) <= max(1, width - 1), (width, line)
        assert "\n" not in line and "\x1b" not in line


@given(text=shown_text, width=st.integers(0, 50))
def test_cut_keeps_what_fits_and_marks_what_does_not(text: str, width: int) -> None:
    out = cut(text, width)
    assert cells(out) <= width
    assert out == text or out.endswith("…") or width == 0


# -- filters ---------------------------------------------------------------------------


def test_each_filter_keeps_only_its_rows() -> None:
    web1 = request(request_id="a")
    web2 = request(request_id="b", host="WEB2", run="other", received_at=NOW - 7200)
    failed = request(request_id="c", exit_status=3, command="false")
    denied = request(request_id="d", outcome="denied", code="X", exit_status=None)
    every = [web1, web2, failed, denied]

    def kept(**f: Any) -> list[str]:
        return [r["request_id"] for r in ActivityFilter(**f).select(every)]

    assert kept() == ["a", "b", "c", "d"]
    assert kept(hosts=frozenset({"web2"})) == ["b"]  # any case
    assert kept(run="other") == ["b"]
    assert kept(since=NOW - 600) == ["a", "c", "d"]
    assert kept(until=NOW - 600) == ["b"]
    assert kept(outcomes=frozenset({"failed"})) == ["c"]
    assert kept(outcomes=frozenset({"denied", "failed"})) == ["c", "d"]
    assert kept(outcomes=frozenset({"completed"})) == ["a", "b", "c"]
    assert kept(grep="false") == ["c"]
    assert kept(grep="RESTART") == []  # case-sensitive


def test_until_a_second_keeps_the_rows_shown_at_that_second() -> None:
    """The rows show whole seconds; a bound typed from them keeps what it was read from."""
    shown = request(request_id="a", received_at=NOW + 0.4)  # displayed at NOW's second
    later = request(request_id="b", received_at=NOW + 1.0)
    assert rows.activity_row(shown, None, NOW).startswith("21:50:00  ")
    assert [r["request_id"] for r in ActivityFilter(until=NOW).select([shown, later])] == ["a"]
    assert ActivityFilter(since=NOW + 0.5).select([shown]) == []  # since stays exact


@pytest.mark.parametrize(
    ("text", "ago"),
    [("30s", 30), ("10m", 600), ("2h", 7200), ("1d", 86400), ("1h30m", 5400)],
)
def test_a_duration_means_that_long_ago(text: str, ago: float) -> None:
    assert parse_when(text, NOW) == NOW - ago


def test_a_time_is_local_and_a_bare_time_is_today() -> None:
    assert parse_when("2026-12-01T21:00", NOW) == NOW - 3000
    assert parse_when("21:00", NOW) == NOW - 3000
    assert parse_when("9:30", NOW) == time.mktime((2026, 12, 1, 9, 30, 0, 0, 0, -1))
    assert parse_when("2026-12-01", NOW) == time.mktime((2026, 12, 1, 0, 0, 0, 0, 0, -1))


@pytest.mark.parametrize("bad", ["", "10", "ten minutes", "25:00", "10x", "2026-13-01"])
def test_anything_else_is_refused_with_what_is_accepted(bad: str) -> None:
    with pytest.raises(ValueError, match="a duration meaning that long ago"):
        parse_when(bad, NOW)
