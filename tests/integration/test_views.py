"""The views answer who, what, when (issue 22, acceptance 4), through a real gateway and
real ssh commands to two hosts: `audit activity` shows each request's time and run label
(or process) and filters by host, run, time, outcome and command text; `sessions` and
`audit sessions` name the run, who approved it, and when and why it ended; `pending`
says when each card expires."""

from __future__ import annotations

import fcntl
import json
import os
import re
import struct
import subprocess
import termios
import time
from collections.abc import Iterator

import pytest

from bastion.cli.rows import cells
from tests.harness import Agent, Bastion, cli_argv, policy_toml, run_agent, wait_for

TIME = r"\d\d:\d\d:\d\d"  # a request of today shows its time only
LABEL = "deploy-bot"


def two_hosts(b: Bastion) -> None:
    b.write_policy(policy_toml(b.sshd) + "\n" + policy_toml(b.sshd, alias="web2"))


def ran(b: Bastion, agent: Agent, command: str, host: str, card: bool) -> None:
    rid = agent.start(command, host=host)
    if card:
        b.approve_next()
    result = agent.wait(rid)
    assert result.rc == 0, result.stderr


@pytest.fixture
def history(bastion: Bastion) -> Iterator[tuple[Agent, Agent]]:
    """A run labelled LABEL asked for web1 and web2, a plain agent for web1 (and one
    command of it failed)."""
    two_hosts(bastion)
    run = run_agent(bastion, "--no-sandbox", "--label", LABEL)
    ran(bastion, run, "echo one", "web1", card=True)
    ran(bastion, run, "echo two", "web2", card=True)
    plain = bastion.agent()
    ran(bastion, plain, "echo three", "web1", card=True)
    assert plain.run("exit 3").rc == 3
    yield run, plain


def activity(b: Bastion, *args: str) -> list[str]:
    out = b.cli("audit", "activity", "--width", "0", *args).stdout
    return [] if out.strip() == "(no requests)" else out.splitlines()


def test_activity_shows_time_and_run_label_on_each_row_and_only_the_host_asked_for(
    bastion: Bastion, history: tuple[Agent, Agent]
) -> None:
    _, plain = history
    lines = activity(bastion, "--host", "web1", "--since", "10m")
    assert len(lines) == 3, lines  # echo one (the run), echo three and exit 3 (the plain agent)
    for line in lines:
        assert re.match(rf"{TIME}  ", line), line
        assert "@web1  " in line and "@web2" not in line, line
    assert re.match(rf'{TIME}  run "{LABEL}" +\S+@web1 +completed exit 0  echo one$', lines[0])
    assert re.match(rf"{TIME}  pid {plain.pid} python\S* +\S+@web1 .* echo three$", lines[1])
    assert "completed exit 3  exit 3" in lines[2], lines[2]
    # the positive control: web2's request is in the journal, shown without --host
    every = activity(bastion, "--since", "10m")
    assert any("@web2 " in x and "echo two" in x for x in every), every
    assert len(activity(bastion, "--host", "web1", "--host", "web2")) == 4
    assert len(activity(bastion, "--host", "WEB1,web2")) == 4


def test_activity_filters_by_run_time_outcome_and_command_text(
    bastion: Bastion, history: tuple[Agent, Agent]
) -> None:
    ran_lines = activity(bastion, "--run", LABEL)
    assert [x.rsplit("  ", 1)[1] for x in ran_lines] == ["echo one", "echo two"], ran_lines
    assert activity(bastion, "--until", "10m") == []  # every request is newer
    ten_minutes_ago = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - 600))
    assert len(activity(bastion, "--since", ten_minutes_ago)) == 4
    assert len(activity(bastion, "--until", time.strftime("%Y-%m-%dT%H:%M:%S"))) == 4
    (failed,) = activity(bastion, "--outcome", "failed")
    assert failed.endswith("exit 3"), failed
    assert len(activity(bastion, "--outcome", "completed")) == 4
    (two,) = activity(bastion, "--grep", "o tw")
    assert "@web2 " in two
    assert activity(bastion, "--grep", "ECHO") == []  # case-sensitive


def test_activity_json_keeps_every_field_and_the_text_fits_the_width(
    bastion: Bastion, history: tuple[Agent, Agent]
) -> None:
    run, plain = history
    rows = json.loads(bastion.cli("audit", "activity", "--json", "--host", "web2").stdout)
    (row,) = rows
    assert row["run"] == LABEL and row["subject"]["pid"] == run.pid
    assert row["received_at"] <= row["ended_at"] <= time.time()
    assert row["command"] == "echo two" and row["command_sha256"] and row["request_id"]
    assert plain.run("echo " + "x" * 300).rc == 0  # its session covers web1
    narrow = bastion.cli("audit", "activity", "--width", "80").stdout.splitlines()
    assert narrow and all(cells(x) < 80 for x in narrow), narrow
    assert narrow[-1].endswith("xxx…"), narrow[-1]


def on_a_terminal(b: Bastion, columns: int, *args: str) -> list[str]:
    """What the CLI prints on a terminal `columns` wide (a pty: it measures the width
    itself), its lines as the terminal got them."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    env = {**os.environ, "COLUMNS": "", "LINES": ""}  # the pty's own size, not the test's
    with subprocess.Popen(cli_argv(b.home.root, *args), stdout=slave, env=env) as proc:
        os.close(slave)
        chunks = []
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the other end closed
                break
            if not chunk:
                break
            chunks.append(chunk)
        assert proc.wait(60) == 0
    os.close(master)
    return b"".join(chunks).decode().replace("\r\n", "\n").splitlines()


def test_on_an_80_column_terminal_every_row_fits_and_keeps_time_and_label(
    bastion: Bastion, history: tuple[Agent, Agent]
) -> None:
    _, plain = history
    assert plain.run("echo " + "z" * 200).rc == 0
    lines = on_a_terminal(bastion, 80, "audit", "activity", "--host", "web1", "--since", "10m")
    assert len(lines) == 4 and all(cells(x) < 80 for x in lines), lines
    assert re.match(rf'{TIME}  run "{LABEL}"  ', lines[0]), lines
    assert lines[-1].endswith("zzz…"), lines
    wide = on_a_terminal(bastion, 200, "audit", "activity", "--host", "web1")  # the control
    assert "z" * 120 in wide[-1] and cells(wide[-1]) < 200, wide


@pytest.mark.parametrize("bad", ["yesterday", "10", "25:00"])
def test_an_unreadable_time_is_a_usage_error(bastion: Bastion, bad: str) -> None:
    r = bastion.cli("audit", "activity", "--since", bad, check=False)
    assert r.returncode == 2, r
    assert "Invalid value for '--since'" in r.stderr and "a duration meaning" in r.stderr
    assert "Traceback" not in r.stderr
    assert bastion.cli("audit", "activity", "--since", "1d").returncode == 0  # the control


def test_sessions_show_the_run_label_and_who_approved_and_the_journal_why_they_ended(
    bastion: Bastion,
) -> None:
    run = run_agent(bastion, "--no-sandbox", "--label", LABEL)
    ran(bastion, run, "true", "web1", card=True)  # approved by this process, over the socket
    (live,) = json.loads(bastion.cli("sessions", "--json").stdout)
    assert live["approved_by"] == {"uid": os.getuid(), "pid": os.getpid()}
    (line,) = bastion.cli("sessions", "--width", "0").stdout.splitlines()
    assert line.startswith(f'{live["id"]}  run "{LABEL}" '), line
    started = time.strftime("%H:%M:%S", time.localtime(live["approved_at"]))
    assert line.endswith(f"  since {started}  by uid {os.getuid()}"), line

    bastion.cli("revoke", live["id"])
    wait_for(lambda: bastion.op("sessions") == [], 30)
    (ended,) = bastion.cli("audit", "sessions", "--width", "0").stdout.splitlines()
    assert ended.startswith(f'{live["id"]}  run "{LABEL}" '), ended
    assert re.search(
        rf"  {started}-{TIME} revoked  by uid {os.getuid()}$",
        ended,
    ), ended
    (journaled,) = json.loads(bastion.cli("audit", "sessions", "--json").stdout)
    assert journaled["run"] == LABEL and journaled["approved_by"] == live["approved_by"]


def test_who_approved_is_what_the_kernel_says_not_what_the_request_says(
    bastion: Bastion,
) -> None:
    """The operator socket records its peer (SO_PEERCRED) with the answer; an `operator`
    argument in the request is replaced, never believed."""
    agent = bastion.agent()
    rid = agent.start("true")
    card = bastion.next_card()
    forged = {"uid": 4242, "pid": 1}
    bastion.op("answer", card=card["id"], approve=True, operator=forged)
    assert agent.wait(rid).rc == 0
    (live,) = bastion.op("sessions")
    assert live["approved_by"] == {"uid": os.getuid(), "pid": os.getpid()}  # the control
    (journaled,) = json.loads(bastion.cli("audit", "sessions", "--json").stdout)
    assert journaled["approved_by"] == live["approved_by"] != forged


def test_pending_shows_when_each_card_expires(bastion: Bastion) -> None:
    agent = bastion.agent()
    rid = agent.start("true")
    card = bastion.next_card()
    shown = bastion.cli("pending").stdout
    m = re.search(rf"\n  expires:  in (\d+) s \(({TIME})\)\n", shown)
    assert m, shown
    assert 0 < int(m[1]) <= 20  # the harness's --approval-timeout
    assert m[2] == time.strftime("%H:%M:%S", time.localtime(card["expires_at"]))
    bastion.answer(card, True)
    assert agent.wait(rid).rc == 0
