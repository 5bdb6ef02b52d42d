"""paramiko and fabric through bastion with their default arguments (issue 21).

Inside `bastion run` the user's keys and agent are hidden; the run offers a throwaway
agent (SSH_AUTH_SOCK), so paramiko's `SSHClient.connect` has a key to try and the
gateway, which asks for no authentication, lets it in. Host-key checking stays on
(RejectPolicy) against the known_hosts file `bastion ssh-config --known-hosts` wrote.
Each `exec_command` on the one connection is a request of its own (its own journal
row, the same subject). On the base tree the client gave up before it reached the
gateway ("No authentication methods available"), and a second exec_command was
refused with ControlMaster words.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.harness import WAITING_LINE, Agent, Bastion, master_pid, ssh_agent

# One paramiko client, as an agent writes it: the ProxyCommand of the ssh config bastion
# printed, no key, no password, the defaults -- and the host key checked against the
# file bastion wrote. With LISTEN set it first listens on that unix socket, or on TCP
# (LISTEN=tcp), as a process that relays for others would. Prints what each command gave back.
PARAMIKO = """
import json, os, socket, sys
import paramiko
config, known, host, *commands = sys.argv[1:]
if os.environ.get("LISTEN"):
    tcp = os.environ["LISTEN"] == "tcp"
    server = socket.socket(socket.AF_INET if tcp else socket.AF_UNIX)
    server.bind(("127.0.0.1", 0) if tcp else os.environ["LISTEN"])
    server.listen()
entry = paramiko.SSHConfig.from_path(config).lookup(host)
client = paramiko.SSHClient()
client.load_host_keys(known)
client.set_missing_host_key_policy(paramiko.RejectPolicy())
try:
    proxy = paramiko.ProxyCommand(entry["proxycommand"])
    client.connect(host, username=entry.get("user"), sock=proxy)
except Exception as exc:
    print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
    sys.exit(0)
out = []
for command in commands:
    stdin, stdout, stderr = client.exec_command(command)
    data, err = stdout.read(), stderr.read()
    out.append({"rc": stdout.channel.recv_exit_status(), "out": data.hex(), "err": err.decode()})
client.close()
print(json.dumps({"results": out, "agent": os.environ.get("SSH_AUTH_SOCK")}))
"""

# fabric's Connection reads the ssh config itself (ProxyCommand, User); its host-key
# policy is made strict, with the file bastion wrote. LOCAL and REMOTE: a `put`, or "-".
FABRIC = """
import json, sys
import paramiko
from fabric import Config, Connection
config, known, host, local, remote = sys.argv[1:]
c = Connection(host, config=Config(runtime_ssh_path=config))
c.client.load_host_keys(known)
c.client.set_missing_host_key_policy(paramiko.RejectPolicy())
out = []
for command in ("printf fab-1", "printf fab-2; printf ' err' >&2"):
    r = c.run(command, hide=True, warn=True)
    out.append({"rc": r.exited, "out": r.stdout, "err": r.stderr})
if local != "-":
    c.put(local, remote)
c.close()
print(json.dumps(out))
"""


def start(agent: Agent, tmp_path: Path, text: str, *args: str, **env: str) -> int:
    """Start a client script in the agent's process tree (inside its run)."""
    path = tmp_path / f"client-{abs(hash(text))}.py"
    path.write_text(text)
    return agent.start([], argv=[sys.executable, str(path), *args], env=env or None)


def answer(agent: Agent, rid: int) -> Any:
    result = agent.wait(rid)
    assert result.rc == 0, result.stderr
    return json.loads(result.stdout)


def from_target(err: str) -> str:
    """A command's stderr less the gateway's waiting line (`core/waiting`): written when
    its card was raised, before anything from the target."""
    return "".join(
        line for line in err.splitlines(keepends=True) if not line.startswith(WAITING_LINE)
    )


def results(got: dict[str, Any]) -> list[tuple[int, bytes, str]]:
    assert "error" not in got, got
    return [(r["rc"], bytes.fromhex(r["out"]), from_target(r["err"])) for r in got["results"]]


def test_paramiko_with_default_arguments_runs_two_commands_on_one_connection(
    bastion: Bastion, in_run: Any, client_files: Any, journal_rows: Any, tmp_path: Path
) -> None:
    """Exact bytes (binary included), each command's exit status and stderr, a marker
    on the target from the second command, one approval for the run, and a journal row
    per command with the run as their one subject."""
    marker = tmp_path / "paramiko-marker"
    first = "printf 'one\\000\\377two'; printf e1 >&2; exit 3"
    second = f"touch {marker}; echo second"
    files = (str(client_files.config), str(client_files.known_hosts))
    rid = start(in_run.agent, tmp_path, PARAMIKO, *files, "web1", first, second)
    card = bastion.approve_next()
    assert card["subject"]["kind"] == "registered run", card
    got = answer(in_run.agent, rid)
    assert got["agent"] and got["agent"].startswith("/tmp/"), got  # the run's own agent
    assert results(got) == [(3, b"one\0\xfftwo", "e1"), (0, b"second\n", "")]
    assert marker.exists()
    assert bastion.op("pending") == []  # one session card for the run, none per channel
    rows = [r for r in journal_rows() if r["command"] in (first, second)]
    assert [(r["command"], r["outcome"]) for r in rows] == [
        (first, "completed"),
        (second, "completed"),
    ]
    assert len({r["request_id"] for r in rows}) == 2
    assert len({r["subject"]["pid"] for r in rows}) == 1


def test_paramiko_refuses_a_gateway_key_that_is_not_the_one_bastion_wrote(
    bastion: Bastion, in_run: Any, client_files: Any, tmp_path: Path
) -> None:
    """Host-key checking is really on: the same client with a known_hosts file naming
    another key stops before any command (positive control: the test above)."""
    key = tmp_path / "other"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    kind, blob = key.with_suffix(".pub").read_text().split()[:2]
    other = tmp_path / "other_known_hosts"
    other.write_text(f"web1,bastion-gateway {kind} {blob}\n")
    marker = tmp_path / "must-not-exist"
    rid = start(
        in_run.agent, tmp_path, PARAMIKO, str(client_files.config), str(other), "web1",
        f"touch {marker}",
    )  # fmt: skip
    got = answer(in_run.agent, rid)
    assert "BadHostKeyException" in got.get("error", ""), got
    assert not marker.exists()


@pytest.mark.parametrize("kind", ["unix", "tcp"])
def test_a_later_channel_of_a_client_that_listens_is_refused(
    bastion: Bastion, in_run: Any, client_files: Any, tmp_path: Path, kind: str
) -> None:
    """A client that listens on a socket could be relaying others' commands: its first
    command runs, a later channel on the connection is refused with the ControlMaster
    words and runs nothing. The same script without the listener runs both (the
    positive control, first)."""
    files = (str(client_files.config), str(client_files.known_hosts))
    ok = tmp_path / "ok"
    rid = start(in_run.agent, tmp_path, PARAMIKO, *files, "web1", "echo 1", f"touch {ok}")
    bastion.approve_next()
    assert results(answer(in_run.agent, rid)) == [(0, b"1\n", ""), (0, b"", "")]
    assert ok.exists()

    marker = tmp_path / "relayed"
    # In the run's own /tmp: the rest of the system is read-only in a run.
    listen = f"/tmp/relay-{os.getpid()}.sock" if kind == "unix" else "tcp"
    rid = start(
        in_run.agent, tmp_path, PARAMIKO, *files, "web1", "echo 1", f"touch {marker}",
        LISTEN=listen,
    )  # fmt: skip
    (first, (rc, out, err)) = results(answer(in_run.agent, rid))
    assert first == (0, b"1\n", "")
    assert (rc, out) == (77, b""), err
    error = json.loads(err)["error"]
    assert error["code"] == "UNSUPPORTED_REQUEST" and "Nothing was sent" in error["message"]
    assert not marker.exists()


def test_a_controlmaster_outside_a_run_still_carries_no_second_command(
    bastion: Bastion, in_run: Any, client_files: Any, tmp_path: Path
) -> None:
    """Another process's command through an OpenSSH ControlMaster of a plain agent is
    refused as before: the ControlMaster rule is about other processes. Positive control:
    two commands from one paramiko process, in a run, both run."""
    files = (str(client_files.config), str(client_files.known_hosts))
    rid = start(in_run.agent, tmp_path, PARAMIKO, *files, "web1", "echo a", "echo b")
    bastion.approve_next()
    assert results(answer(in_run.agent, rid)) == [(0, b"a\n", ""), (0, b"b\n", "")]

    agent = bastion.agent()
    rid = agent.start("true")
    bastion.approve_next()
    assert agent.wait(rid).rc == 0
    marker = tmp_path / "ridden"
    cp = Path("/var/tmp/bt") / f"cm-{tmp_path.name[-12:]}"
    master = ["-M", "-S", str(cp), "-o", "ControlPersist=60", "-N", "-f"]
    try:
        assert agent.run([], argv=["ssh", "-F", str(bastion.config), *master, "web1"]).rc == 0
        assert master_pid(cp) is not None
        r = agent.run(f"touch {marker}", ssh_args=("-S", str(cp)))
        assert (r.rc, r.code) == (77, "UNSUPPORTED_REQUEST"), r.stderr
    finally:
        subprocess.run(["ssh", "-F", "/dev/null", "-S", str(cp), "-O", "exit", "web1"],
                       capture_output=True, timeout=30)  # fmt: skip
    assert not marker.exists()


def test_fabric_runs_twice_on_one_connection(
    bastion: Bastion, in_run: Any, client_files: Any, journal_rows: Any, tmp_path: Path
) -> None:
    files = (str(client_files.config), str(client_files.known_hosts))
    rid = start(in_run.agent, tmp_path, FABRIC, *files, "web1", "-", "-")
    bastion.approve_next()
    one, two = answer(in_run.agent, rid)
    assert (one["rc"], one["out"], from_target(one["err"])) == (0, "fab-1", "")
    assert (two["rc"], two["out"], from_target(two["err"])) == (0, "fab-2", " err")
    rows = [r for r in journal_rows() if "fab-" in (r["command"] or "")]
    assert [r["outcome"] for r in rows] == ["completed", "completed"], rows


def test_fabric_put_writes_the_exact_bytes(
    bastion: Bastion, in_run: Any, client_files: Any, tmp_path: Path
) -> None:
    local = tmp_path / "local.bin"
    local.write_bytes(bytes(range(256)) * 64)
    remote = tmp_path / "remote.bin"
    files = (str(client_files.config), str(client_files.known_hosts))
    rid = start(in_run.agent, tmp_path, FABRIC, *files, "web1", str(local), str(remote))
    bastion.approve_next()
    answer(in_run.agent, rid)
    assert remote.read_bytes() == local.read_bytes()  # sftp on a later channel of fabric's


def test_paramiko_outside_a_run_uses_the_users_agent(
    bastion: Bastion, client_files: Any, tmp_path: Path
) -> None:
    """Without `bastion run` nothing is hidden: paramiko tries the user's own agent's key
    (the gateway asks for none and the key identifies nothing), and its two commands on
    one connection both run."""
    files = (str(client_files.config), str(client_files.known_hosts))
    with ssh_agent(tmp_path) as sock:
        agent = bastion.agent(SSH_AUTH_SOCK=str(sock))
        rid = start(agent, tmp_path, PARAMIKO, *files, "web1", "echo a", "echo b")
        bastion.approve_next()
        got = answer(agent, rid)
    assert got["agent"] == str(sock)
    assert results(got) == [(0, b"a\n", ""), (0, b"b\n", "")]
    assert bastion.op("pending") == []


AUTH = """
import json, sys
import paramiko
config, known, host = sys.argv[1:]
entry = paramiko.SSHConfig.from_path(config).lookup(host)
out = {}
for method in ("none", "password", "publickey"):
    t = paramiko.Transport(paramiko.ProxyCommand(entry["proxycommand"]))
    t.start_client(timeout=30)
    key = t.get_remote_server_key()
    known_keys = paramiko.HostKeys(known).lookup(host) or {}
    assert known_keys.get(key.get_name()) == key, "not the gateway's key"
    user = entry["user"]
    if method == "none":
        t.auth_none(user)
    elif method == "password":
        t.auth_password(user, "any word")
    else:
        t.auth_publickey(user, paramiko.RSAKey.generate(2048))  # a key nobody knows
    out[method] = t.is_authenticated()
    t.close()
print(json.dumps(out))
"""


def test_the_gateway_lets_in_whatever_method_a_library_tries_first(
    bastion: Bastion, client_files: Any, tmp_path: Path
) -> None:
    """`none`, a password, a key nobody knows: each is let in (identity comes from the
    socket peer; what the client presents identifies nothing). Nothing runs: no card."""
    agent = bastion.agent()
    files = (str(client_files.config), str(client_files.known_hosts))
    got = answer(agent, start(agent, tmp_path, AUTH, *files, "web1"))
    assert got == {"none": True, "password": True, "publickey": True}
    assert bastion.op("pending") == []
