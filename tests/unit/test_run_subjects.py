"""A registered run as cards and the approval book see it: the walk refuses a
front that would make a terminal's shell the subject; a run's ended approval is
explained by the run, never by its executable; and what the card says of a run
(sandboxed or not, the label as the starter's claim, what it was given)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bastion.cli.cardview import render_card
from bastion.core.display import describe_run
from bastion.core.gate import EndReason
from bastion.core.subject import (
    RUN_LABEL_CLAIM,
    NoSubject,
    Observed,
    Run,
    Subject,
    SubjectKind,
    subject_index,
)
from bastion.gateway.approvals import ApprovalBook, _match_key


def seen(name: str, wrapper: bool = False, host: bool = False, front: bool = False) -> Observed:
    return Observed(
        name=name, ssh=name == "ssh", wrapper=wrapper or front, terminal_host=host, front=front
    )


PROXY, SSH, SHELL = seen("python3"), seen("ssh"), seen("bash", wrapper=True)
FRONT, AGENT, TMUX = seen("python3", front=True), seen("node"), seen("tmux", host=True)


@pytest.mark.parametrize(
    "chain",
    [[PROXY, SSH, FRONT, SHELL, TMUX], [PROXY, SSH, FRONT, TMUX], [PROXY, SSH, SHELL, FRONT, TMUX]],
    ids=["front-shell-tmux", "front-tmux", "shell-front-tmux"],
)
def test_a_front_skipped_to_a_terminals_shell_is_refused(chain: list[Observed]) -> None:
    found = subject_index(chain)
    assert isinstance(found, NoSubject) and "registered front" in found.reason
    # The positive control: the same chain without the front's registration is a shell.
    plain = [seen(p.name, wrapper=p.wrapper and not p.front) if p.front else p for p in chain]
    assert not isinstance(subject_index(plain), NoSubject)


def test_a_front_below_its_mcp_client_still_makes_the_client_the_subject() -> None:
    assert subject_index([PROXY, SSH, FRONT, AGENT, SHELL, TMUX]) == (3, SubjectKind.PROCESS)


def subject(exe: str = "/usr/bin/python3", run: Run | None = None, **kw: object) -> Subject:
    kind = SubjectKind.RUN if run is not None else SubjectKind.PROCESS
    base = Subject(4242, 1000.0, exe, "ab" * 32, 1000, "n1", run, kind, "img1")
    return replace(base, **kw)  # type: ignore[arg-type]


RUN = Run("deploy", ("--ro /srv",), "boot-1:4242:777", 999.0, 1000)


def test_a_runs_match_key_names_the_run_never_the_executable() -> None:
    a = subject("/usr/bin/python3", RUN)
    b = subject("/usr/bin/node", RUN, nonce="n2", image="img2")  # same run, another lifetime
    assert _match_key(a, None, "web1", "u") == _match_key(b, None, "web1", "u")
    other_run = replace(RUN, lasting="boot-1:5000:888")
    assert _match_key(subject(run=other_run), None, "web1", "u") != _match_key(a, None, "web1", "u")
    # Not a run: the executable, as before (and never the same as a run's).
    assert _match_key(subject("/usr/bin/python3"), None, "web1", "u") != _match_key(
        a, None, "web1", "u"
    )
    assert _match_key(subject("/usr/bin/python3"), None, "web1", "u") == _match_key(
        subject("/usr/bin/python3", nonce="n9"), None, "web1", "u"
    )


def test_gateway_restarted_is_said_to_the_same_run_and_not_to_the_same_executable() -> None:
    """The first lifetime's live key, handed to the next: the run, back with a new
    nonce, hears `gateway_restarted`; another run of the same program does not."""
    first = ApprovalBook("boot_a")
    live = subject(run=RUN)
    first._sessions[(live.key, "web1", "u")] = type(  # a live session, as _open_session keeps
        "L", (), {"subject": live, "conversation": None, "session": _Grant("web1", "u")}
    )()
    keys = first.live_match_keys()
    second = ApprovalBook("boot_b")
    second.previous_lifetime(keys)
    back = subject(run=RUN, nonce="n2", image="img2")
    assert second.session_for(back, "web1", "u", None) == (None, EndReason.GATEWAY_RESTARTED)
    stranger = subject(run=replace(RUN, lasting="boot-1:6000:1"), nonce="n3")
    assert second.session_for(stranger, "web1", "u", None) == (None, None)


class _Grant:
    def __init__(self, host: str, user: str) -> None:
        self.host, self.user = host, user


def test_what_a_card_says_of_a_run() -> None:
    sandboxed = subject(run=RUN, sandboxed=True).as_json()
    assert describe_run(sandboxed, "15:02:11") == (
        f'sandboxed run "deploy" ({RUN_LABEL_CLAIM}), started 15:02:11, given: --ro /srv'
    )
    bare = subject(run=replace(RUN, given=()), sandboxed=True).as_json()
    assert describe_run(bare, "15:02:11").endswith("given: nothing beyond the defaults")
    plain = subject(run=replace(RUN, label="x", given=None)).as_json()
    assert describe_run(plain, "15:02:11") == (
        f'run "x" ({RUN_LABEL_CLAIM}), started 15:02:11 -- not sandboxed'
    )
    claimed = subject(run=RUN).as_json()  # said it was sandboxed; the kernel says not
    assert describe_run(claimed, "t").endswith("-- not sandboxed (it registered as sandboxed)")
    assert describe_run(subject().as_json(), "t") is None


def test_a_runs_label_and_given_words_are_escaped() -> None:
    hostile = subject(run=replace(RUN, label="\x1b[2Jx", given=("\u202e--ro /",)), sandboxed=True)
    text = describe_run(hostile.as_json(), "t")
    assert text is not None and "\x1b" not in text and "\u202e" not in text


def test_the_subjects_json_carries_the_runs_facts() -> None:
    doc = subject(run=RUN, sandboxed=True).as_json()
    assert doc["run"] == "deploy" and doc["sandboxed"] is True
    assert doc["run_info"] == {
        "label": "deploy",
        "label_source": RUN_LABEL_CLAIM,
        "given": ["--ro /srv"],
        "lasting": "boot-1:4242:777",
        "registered_at": 999.0,
        "uid": 1000,
    }
    assert subject().as_json()["run_info"] is None


def test_the_rendered_card_has_the_run_line() -> None:
    card = {
        "id": "sc_1",
        "kind": "session",
        "user": "u",
        "host": "web1",
        "address": "127.0.0.1",
        "port": 22,
        "host_key_fingerprint": "SHA256:x",
        "credential": "k",
        "request_id": "r",
        "vault_epoch": 1,
        "subject": subject(run=RUN, sandboxed=True).as_json(),
    }
    text = render_card(card)
    assert '  run:      sandboxed run "deploy"' in text and "given: --ro /srv" in text
    card["subject"] = subject(run=replace(RUN, given=None)).as_json()
    assert "-- not sandboxed" in render_card(card)
