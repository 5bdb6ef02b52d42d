"""Agents as another user (strong isolation), and the pinned gateway key."""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from bastion.agent import proxy, wire
from bastion.devtools.sshd_fixture import SshdInfo
from tests.harness import Bastion, make_bastion

AGENT_USER = "bastion-test-agent"
SYSTEM_PYTHON = "/usr/bin/python3"


def test_the_config_pins_the_gateway_key(bastion: Bastion, tmp_path: Path) -> None:
    other = tmp_path / "other"
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True, timeout=30
    )
    pinned = bastion.home.known_hosts.read_text().split()[2]
    forged = other.with_suffix(".pub").read_text().split()[1]
    config = tmp_path / "forged_config"
    config.write_text(bastion.config.read_text().replace(pinned, forged))
    r = subprocess.run(
        ["ssh", "-F", str(config), "web1", "true"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 255 and "Host key verification failed" in r.stderr


def _as(user: pwd.struct_passwd) -> list[str]:
    """Run the system python as `user` (same process: setpriv execs it)."""
    return [
        "setpriv",
        f"--reuid={user.pw_uid}",
        f"--regid={user.pw_gid}",
        "--init-groups",
        SYSTEM_PYTHON,
    ]


@pytest.fixture
def agent_user() -> Iterator[pwd.struct_passwd]:
    tools = shutil.which("useradd") and shutil.which("setpriv")
    if os.geteuid() != 0 or not tools or not os.path.exists(SYSTEM_PYTHON):
        pytest.skip(
            "needs root, useradd, setpriv and /usr/bin/python3 to run an agent as another user"
        )
    try:
        pwd.getpwnam(AGENT_USER)
    except KeyError:
        subprocess.run(
            [
                "useradd",
                "--system",
                "--user-group",
                "--no-create-home",
                "--shell",
                "/usr/sbin/nologin",
                AGENT_USER,
            ],
            check=True,
            timeout=30,
        )
    yield pwd.getpwnam(AGENT_USER)


def test_an_agent_running_as_another_user(
    tmp_path: Path, sshd: SshdInfo, client_key: tuple[Path, str], agent_user: pwd.struct_passwd
) -> None:
    # What a system-wide install gives agents: a socket directory and the proxy
    # script they can reach, nothing of the bastion home.
    shared = Path(tempfile.mkdtemp(prefix="bastion-shared-"))
    shared.chmod(0o755)
    try:
        script = shared / "proxy.py"
        for module in (proxy, wire):  # the proxy imports the wire beside it
            copy = shared / Path(module.__file__).name
            shutil.copy(module.__file__, copy)
            copy.chmod(0o644)
        sock = shared / "agent.sock"
        b = make_bastion(tmp_path, sshd, client_key[0], start=False)
        group = grp.getgrgid(agent_user.pw_gid).gr_name
        b.start_daemon("--agent-socket", str(sock), "--agent-group", group)
        b.unlock()
        config = shared / "agent_ssh_config"
        config.write_text(
            b.cli(
                "ssh-config",
                "--agent-socket",
                str(sock),
                "--python",
                SYSTEM_PYTHON,
                "--proxy",
                str(script),
            ).stdout
        )
        config.chmod(0o644)
        try:
            assert json.loads(b.cli("status", "--json").stdout)["isolation"] == "strong"
            agent = subprocess.Popen(
                [
                    *_as(agent_user),
                    "-c",
                    "import subprocess, sys; r = subprocess.run(['ssh', '-F', sys.argv[1], "
                    "'web1', 'echo via-strong'], capture_output=True, text=True); "
                    "print(r.returncode, r.stdout.strip(), r.stderr.strip()[-300:])",
                    str(config),
                ],
                stdout=subprocess.PIPE,
                text=True,
                cwd="/",
            )
            card = b.next_card()
            assert (
                card["subject"]["uid"] == agent_user.pw_uid and card["subject"]["pid"] == agent.pid
            )
            b.answer(card, True)
            out, _ = agent.communicate(timeout=60)
            assert out.startswith("0 via-strong"), out
            # The other user reaches the agent socket, and nothing else of the home.
            probe = subprocess.run(
                [
                    *_as(agent_user),
                    "-c",
                    "import socket, sys; s = socket.socket(socket.AF_UNIX)\n"
                    "try:\n s.connect(sys.argv[1]); print('connected')\n"
                    "except OSError as e:\n print(type(e).__name__)",
                    str(b.home.operator_socket),
                ],
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert probe.stdout.strip() == "PermissionError"
        finally:
            b.close()
    finally:
        shutil.rmtree(shared, ignore_errors=True)
