"""Who asks, decided in core: the subject walk over what the resolver observed,
and the keys approvals are bound to (no processes needed: these are records)."""

from __future__ import annotations

import pytest

from bastion.core.subject import (
    NoSubject,
    Observed,
    ProcessKey,
    Subject,
    SubjectKey,
    SubjectKind,
    subject_index,
)


def seen(name: str, wrapper: bool = False, host: bool = False) -> Observed:
    return Observed(name=name, ssh=name == "ssh", wrapper=wrapper, terminal_host=host)


PROXY, SSH = seen("python3.11"), seen("ssh")
SHELL, ENV = seen("bash", wrapper=True), seen("env", wrapper=True)
AGENT, TMUX, INIT = seen("node"), seen("tmux", host=True), seen("init", host=True)


@pytest.mark.parametrize(
    "chain,found",
    [
        ([PROXY, SSH, AGENT, SHELL, TMUX, INIT], (2, SubjectKind.PROCESS)),
        ([PROXY, SSH, SHELL, ENV, AGENT, TMUX, INIT], (4, SubjectKind.PROCESS)),
        ([PROXY, SSH, SHELL, TMUX, INIT], (2, SubjectKind.TERMINAL_SHELL)),
        ([PROXY, SSH, SHELL, ENV, INIT], (3, SubjectKind.TERMINAL_SHELL)),
        ([PROXY, SSH, seen("ssh"), SHELL, INIT], (2, SubjectKind.PROCESS)),
        ([AGENT, SHELL, INIT], (0, SubjectKind.PROCESS)),
        ([SHELL, TMUX], (0, SubjectKind.TERMINAL_SHELL)),
    ],
    ids=[
        "the first program above ssh",
        "past shells and wrappers",
        "the pane's shell below a terminal host",
        "the last wrapper below init",
        "only the first ssh starts the walk",
        "no ssh: the walk starts at the peer",
        "no ssh, a shell in tmux",
    ],
)
def test_the_subject_is_above_ssh_past_wrappers_and_below_terminal_hosts(
    chain: list[Observed], found: tuple[int, SubjectKind]
) -> None:
    assert subject_index(chain) == found


@pytest.mark.parametrize("host", [TMUX, INIT, seen("", host=True)])
def test_ssh_started_by_a_terminal_host_is_refused_with_its_name(host: Observed) -> None:
    found = subject_index([PROXY, SSH, host, INIT])
    assert isinstance(found, NoSubject)
    assert found.reason == (
        f"ssh was started directly by {host.name or 'pid 1'}, a terminal host: there is no "
        "agent process to approve; run ssh from the agent (or a shell) instead"
    )


@pytest.mark.parametrize(
    "chain",
    [[], [PROXY, SSH], [PROXY, SSH, SHELL, ENV], [SHELL]],
    ids=["empty", "nothing above ssh", "only wrappers above ssh", "only a wrapper"],
)
def test_a_chain_that_ends_before_a_subject_is_refused(chain: list[Observed]) -> None:
    assert subject_index(chain) == NoSubject("no process above the ssh client could be identified")


def test_a_terminal_host_wins_over_being_a_wrapper() -> None:
    both = Observed(name="tmux", ssh=False, wrapper=True, terminal_host=True)
    assert subject_index([PROXY, SSH, SHELL, both]) == (2, SubjectKind.TERMINAL_SHELL)
    assert isinstance(subject_index([PROXY, SSH, both]), NoSubject)


def subject(**over: object) -> Subject:
    base: dict[str, object] = {
        "pid": 42,
        "start_time": 7.5,
        "exe": "/usr/bin/node",
        "exe_sha256": "ab" * 32,
        "uid": 1000,
        "nonce": "n1",
        "image": "img1",
    }
    return Subject(**{**base, **over})  # type: ignore[arg-type]


def test_a_subject_key_names_the_process_and_the_exec_it_is_in() -> None:
    key = subject().key
    assert key == SubjectKey(42, 7.5, "n1", "img1", "ab" * 32)
    assert key.process == ProcessKey(42, 7.5, "n1") == subject().process_key
    assert subject(exe_sha256=None).key.exe == "/usr/bin/node"  # unreadable: the path


@pytest.mark.parametrize(
    "change", [{"image": "img2"}, {"exe_sha256": "cd" * 32}, {"exe": "/x", "exe_sha256": None}]
)
def test_another_exec_is_another_key_of_the_same_process(change: dict[str, object]) -> None:
    before, after = subject(), subject(**change)
    assert after.key != before.key and hash(after.key) != hash(before.key)
    assert after.key.process == before.key.process


@pytest.mark.parametrize("change", [{"pid": 43}, {"start_time": 8.0}, {"nonce": "n2"}])
def test_another_process_instance_is_another_process_key(change: dict[str, object]) -> None:
    assert subject(**change).key.process != subject().key.process


def test_keys_are_records_not_tuples() -> None:
    """A slice (`key[:3]`) or a tuple built by hand can no longer stand for a key."""
    key = subject().key
    assert key != (42, 7.5, "n1", "img1", "ab" * 32)
    assert key.process != (42, 7.5, "n1")
    with pytest.raises(TypeError):
        key[:3]  # type: ignore[index]
    assert {key: 1}[subject().key] == 1  # hashable, equal by value
