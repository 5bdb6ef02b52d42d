"""The pure halves of "the gateway and the CLI do not trust paths" (issue 44): the
home held by descriptor and the sentence when its path leads elsewhere (home.py), and
the CLI's judgement of who answers at the operator socket (ops/opsock.judge_server).
Each has a positive control; the live attacks are tests/integration/test_home_held.py."""

from __future__ import annotations

import json
import os
import socket
from dataclasses import replace
from pathlib import Path

import pytest

from bastion.gateway.lifetime import Settings, hold_home
from bastion.home import Held, Home, moved_sentence
from bastion.ops import opsock
from bastion.ops.opsock import Server, WrongServer, check_server, judge_server

# -- the home, held ---------------------------------------------------------------------------


def test_the_sentence_is_none_while_the_path_leads_to_the_held_directory() -> None:
    path = Path("/h/.local/share/bastion")
    assert moved_sentence("home", path, (1, 2), (1, 2), "/h/.local/share/bastion") is None
    other = moved_sentence("home", path, (1, 2), (1, 3), "/h/.local/share.x/bastion")
    assert other == (
        "the home moved: /h/.local/share/bastion is another directory, and the directory "
        "this gateway opened there at start is now at /h/.local/share.x/bastion; the gateway "
        "goes on using that directory and reads nothing at /h/.local/share/bastion: put the "
        "home back at /h/.local/share/bastion, then restart the gateway"
    )
    gone = moved_sentence("home", path, (1, 2), "No such file or directory", "/x (deleted)")
    assert gone is not None
    assert gone.startswith("the home moved: nothing is at /h/.local/share/bastion (No such file")


def test_a_held_directory_is_reached_whatever_happens_to_its_path(tmp_path: Path) -> None:
    home = tmp_path / "share" / "bastion"
    home.mkdir(parents=True)
    (home / "vault.json").write_text("real")
    held = Held.open(home)
    try:
        assert held.moved() is None  # control: nothing moved
        (tmp_path / "share").rename(tmp_path / "share.x")
        home.mkdir(parents=True)
        (home / "vault.json").write_text("the agent's")
        assert (held.root / "vault.json").read_text() == "real"
        (held.root / "new").write_text("x")
        assert (tmp_path / "share.x" / "bastion" / "new").exists()
        assert not (home / "new").exists()
        sentence = held.moved()
        assert sentence is not None and f"{home} is another directory" in sentence
        assert f"is now at {tmp_path / 'share.x' / 'bastion'};" in sentence
    finally:
        os.close(held.fd)


def test_a_held_home_names_its_files_through_the_descriptor_and_shows_its_path(
    tmp_path: Path,
) -> None:
    home = Home(tmp_path).hold()
    assert home.held is not None
    try:
        fd = home.held.fd
        assert home.root == Path(f"/proc/self/fd/{fd}") and home.path == tmp_path
        assert home.vault == Path(f"/proc/self/fd/{fd}/vault.json")
        assert home.shown(f"the vault {home.vault} is locked") == (
            f"the vault {tmp_path}/vault.json is locked"
        )
        assert home.shown(f"/proc/self/fd/{fd}7/x") == f"/proc/self/fd/{fd}7/x"  # another fd
        assert home.held.under(tmp_path / "policies") == home.policies
        assert home.held.under(Path("/etc/bastion")) is None
        assert Home(tmp_path).shown("text") == "text" and Home(tmp_path).moved() is None
    finally:
        os.close(home.held.fd)


def test_hold_home_holds_the_home_and_a_policy_directory_outside_it(tmp_path: Path) -> None:
    home, outside = tmp_path / "home", tmp_path / "etc-policies"
    home.mkdir()
    outside.mkdir()
    base = Settings(Home(home), home / "policies", home / "run" / "agent.sock")
    held = hold_home(base)
    assert held.home.held is not None
    fds = [held.home.held.fd]
    try:
        assert held.policies == held.home.policies and held.policies_held is None
        assert held.agent_socket == held.home.agent_socket
        away = hold_home(replace(base, policies=outside, agent_socket=Path("/run/x/agent.sock")))
        assert away.home.held is not None and away.policies_held is not None
        fds += [away.home.held.fd, away.policies_held.fd]
        assert away.policies == away.policies_held.root
        assert away.agent_socket == Path("/run/x/agent.sock")  # not under the home: as given
    finally:
        for fd in fds:
            os.close(fd)


# -- who answers at the operator socket ---------------------------------------------------------

NS = {ns: f"{ns}:[1]" for ns in opsock.NAMESPACES}
RECORD = {"pid": 100, "start_ticks": 5, "boot": "b", "uid": 1000, "namespaces": NS}
GATEWAY = Server(
    pid=100,
    uid=1000,
    start_ticks=5,
    boot="b",
    namespaces=dict(NS),
    own=dict(NS),
    depth=(1, 1),
    uid_map=("0 0 4294967295", "0 0 4294967295"),
    record=RECORD,
    run=None,
    trusted=frozenset({1000, 0}),
    open_dir=None,
)
SOCK = "/h/bastion/operator/operator.sock"


def judged(**changes: object) -> str | None:
    return judge_server(replace(GATEWAY, **changes), SOCK)  # type: ignore[arg-type]


def test_the_recorded_gateway_is_trusted() -> None:
    assert judged() is None
    assert judged(uid=0) is None  # a gateway run as root
    # Links a command without privileges cannot read (the gateway is not dumpable).
    unread = dict.fromkeys(opsock.NAMESPACES)
    assert judged(namespaces=unread) is None
    # systemd's PrivateTmp: a mount namespace of the gateway's own, as it recorded.
    own_mnt = {**NS, "mnt": "mnt:[9]"}
    assert judged(namespaces=own_mnt, record={**RECORD, "namespaces": own_mnt}) is None


def test_another_process_at_the_socket_is_named_with_what_was_expected() -> None:
    assert judged(pid=4242) == (
        f"the operator socket {SOCK} is answered by pid 4242, not by the gateway, which "
        "recorded pid 100 in /h/bastion/operator/gateway.json; nothing was sent: stop "
        "whatever listens there and restart the gateway"
    )
    reused = judged(start_ticks=6)
    assert reused is not None and "its pid was reused; nothing was sent" in reused
    assert "its pid was reused" in (judged(boot="other") or "")


@pytest.mark.parametrize("ns", opsock.NAMESPACES)
def test_a_server_in_another_namespace_is_refused(ns: str) -> None:
    said = judged(namespaces={**NS, ns: f"{ns}:[2]"})
    assert said == (
        f"the operator socket {SOCK} is answered by pid 100, which is in another {ns} "
        f"namespace than this command ({ns}:[2], not {ns}:[1]): a sandbox or a container, "
        "not the gateway; nothing was sent"
    )


def test_namespaces_unreadable_are_judged_by_what_anyone_may_read() -> None:
    unread = dict.fromkeys(opsock.NAMESPACES)
    nested = judged(namespaces=unread, depth=(2, 1))
    assert nested is not None and "another PID namespace than this command (2 PID" in nested
    mapped = judged(namespaces=unread, uid_map=("0 1000 1", "0 0 4294967295"))
    assert mapped is not None and "another user namespace than this command" in mapped


def test_a_server_in_a_run_of_another_uid_or_without_a_record_is_refused() -> None:
    run = judged(run="pid 77 ('claude')")
    assert run is not None and "descends from the registered `bastion run` pid 77" in run
    other = judged(uid=1001)
    assert other == (
        f"the operator socket {SOCK} is answered by pid 100 of uid 1001, not by the gateway "
        "(uid 0 or 1000); nothing was sent"
    )
    none = judged(record="/h/bastion/operator/gateway.json: No such file or directory")
    assert none is not None and "no record of the gateway's process" in none
    unseen = judged(pid=0)
    assert unseen is not None and "a process this command cannot see" in unseen
    opened = judged(open_dir="/h (owner uid 1000, mode 777)")
    assert opened is not None and opened.startswith("/h (owner uid 1000, mode 777) is above")


def serve(path: Path) -> socket.socket:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(8)
    return server


def test_check_server_reads_the_kernel_and_the_record(tmp_path: Path) -> None:
    """This process listens, and records itself as a gateway would: trusted. The record
    naming another pid: refused before anything is sent."""
    d = tmp_path / "operator"
    d.mkdir(mode=0o700)
    path = d / "operator.sock"
    with serve(path) as server:
        (d / opsock.RECORD_NAME).write_text(json.dumps(opsock.own_record()))
        with opsock.connect(path, 5):
            pass
        (d / opsock.RECORD_NAME).write_text(json.dumps({**opsock.own_record(), "pid": 1}))
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(str(path))
            with pytest.raises(WrongServer, match=f"answered by pid {os.getpid()}, not by"):
                check_server(client, path)
        with pytest.raises(WrongServer, match="recorded pid 1 in"):
            opsock.call(path, "status", timeout=5)
        server.settimeout(5)
        for _ in range(3):  # the trusted one, and the two refused: none sent anything
            conn, _ = server.accept()
            with conn:
                conn.settimeout(5)
                assert conn.recv(10) == b""


def test_a_socket_under_a_directory_others_may_write_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "open" / "operator"
    d.mkdir(parents=True)
    os.chmod(d.parent, 0o777)
    path = d / "operator.sock"
    with serve(path):
        (d / opsock.RECORD_NAME).write_text(json.dumps(opsock.own_record()))
        with pytest.raises(WrongServer, match=r"open \(owner uid \d+, mode 777\) is above"):
            opsock.connect(path, 5)
        os.chmod(d.parent, 0o1777)  # sticky, as /tmp: nobody may rename what is not theirs
        with opsock.connect(path, 5):
            pass


def test_the_cli_and_the_gateway_agree_where_the_record_is(tmp_path: Path) -> None:
    home = Home(tmp_path)
    assert home.gateway_record == home.operator_socket.with_name(opsock.RECORD_NAME)
    assert home.operator_dir / opsock.RUNS_NAME == home.operator_dir / "runs.json"
