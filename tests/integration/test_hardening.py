"""Same-uid mode, as hard as it can be (issue 9): an agent below `bastion run`
cannot escape its tree to answer for the operator, and the gateway's memory
is closed to processes of its own uid that hold no privilege."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bastion.devtools.sshd_fixture import SshdInfo
from tests.harness import Agent, Bastion, make_bastion, wait_for

PR_SET_DUMPABLE_READER = """
import ctypes, sys
pid = int(sys.argv[1])
try:
    open(f"/proc/{pid}/mem", "rb").close()
    mem = "readable"
except OSError as exc:
    mem = type(exc).__name__
libc = ctypes.CDLL(None, use_errno=True)
if libc.ptrace(16, pid, 0, 0) == 0:  # PTRACE_ATTACH
    trace = "attached"
    libc.ptrace(17, pid, 0, 0)  # PTRACE_DETACH
else:
    trace = "errno %d" % ctypes.get_errno()
print(mem, trace)
"""


def unprivileged(*argv: str) -> list[str]:
    """Run as the same uid with every capability gone: what a same-uid process has
    when it is not root (no CAP_SYS_PTRACE, no CAP_DAC_OVERRIDE)."""
    return ["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--no-new-privs", *argv]


def probe(pid: int) -> str:
    r = subprocess.run(
        unprivileged("/usr/bin/python3", "-c", PR_SET_DUMPABLE_READER, str(pid)),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_the_gateway_memory_is_closed_to_its_own_uid(
    tmp_path: Path, sshd: SshdInfo, client_key: tuple[Path, str]
) -> None:
    """The gateway and the prober run as the same uid with no capabilities -- a
    same-uid process that is not root. (Two processes of uid 0 with full
    capabilities could read each other whatever the gateway did.)"""
    b = make_bastion(tmp_path, sshd, client_key[0], start=False)
    with open(b.log, "ab") as log:
        daemon = subprocess.Popen(
            unprivileged(sys.executable, "-m", "bastion.cli", "--home", str(b.home.root), "daemon"),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for(lambda: b.home.operator_socket.exists(), timeout=30)
        gateway = b.op("status")["pid"]
        assert gateway == daemon.pid
        assert probe(gateway) == "PermissionError errno 1"  # EPERM: not dumpable
        # The same probe reads an ordinary process of the same uid and no privilege.
        with subprocess.Popen(unprivileged("sleep", "60")) as ordinary:
            try:
                assert probe(ordinary.pid) == "readable attached"
            finally:
                ordinary.kill()
    finally:
        daemon.terminate()
        daemon.wait(20)


def test_a_double_forked_child_under_bastion_run_cannot_approve_its_card(
    bastion: Bastion, tmp_path: Path
) -> None:
    cli = [sys.executable, "-m", "bastion.cli", "--home", str(bastion.home.root)]
    agent = Agent(bastion.config, launcher=(*cli, "run", "--label", "escaper", "--"))
    bastion.agents.append(agent)
    rid = agent.start("echo should-not-run")
    card = bastion.next_card()
    assert card["subject"]["pid"] == agent.pid and card["subject"]["kind"] == "registered run"
    out = tmp_path / "escape"
    escape = f"{' '.join(cli)} decide {card['id']} approve > {out} 2>&1; echo rc=$? >> {out}"
    # setsid -f: the child is re-parented away from the agent -- to the run, its subreaper.
    agent.run([], argv=["setsid", "-f", "sh", "-c", escape])
    wait_for(lambda: out.exists() and "rc=" in out.read_text(), timeout=30)
    text = out.read_text()
    assert "rc=1" in text and "inside an agent's process tree" in text, text
    assert [c["id"] for c in bastion.op("pending")] == [card["id"]]  # still waiting
    bastion.answer(card, False)
    assert agent.wait(rid).code == "SESSION_DENIED"


def test_lock_leaves_no_key_object_in_the_gateway(bastion: Bastion) -> None:
    """The claim the README makes: after lock, nothing in the gateway references a
    key (copies Python made and freed may still sit in memory nobody reused; only
    root or CAP_SYS_PTRACE could look, per the test above)."""
    agent = bastion.agent()
    rid = agent.start("echo hi")
    bastion.approve_next()
    assert agent.wait(rid).rc == 0
    held = bastion.op("status")["keys_held"]
    assert held["vault_keys"] >= 1 and held["connections"] >= 1  # the counters can tell
    bastion.cli("lock")
    assert bastion.op("status")["keys_held"] == {"vault_keys": 0, "connections": 0}
