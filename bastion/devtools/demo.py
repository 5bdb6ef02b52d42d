"""`bastion demo`: the whole path once, on throwaway parts.

A loopback sshd, a fresh home, a key generated inside the vault, a policy
that pins the sshd's host key, a gateway, and one agent -- a separate
process, because the operator (this process) must never be inside the
agent's process tree. The demo answers the approval card itself through the
operator socket and prints what each side saw.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bastion.devtools.sshd_fixture import Sshd, sshd_available
from bastion.home import Home
from bastion.ops import opsock

PASSPHRASE = "demo passphrase, thrown away"
AGENT = """
import subprocess, sys
cfg, commands = sys.argv[1], sys.argv[2:]
for cmd in commands:
    r = subprocess.run(["ssh", "-F", cfg, "demo", cmd], capture_output=True, timeout=60)
    print(repr((cmd, r.returncode, r.stdout.decode(), r.stderr.decode())), flush=True)
"""


def bastion(home: Home, *args: str, stdin: str | None = None) -> str:
    """Run the real CLI, as an operator would."""
    cmd = [sys.executable, "-m", "bastion.cli", "--home", str(home.root), *args]
    r = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise RuntimeError(f"bastion {' '.join(args)} failed: {r.stderr.strip()}")
    return r.stdout


def say(title: str, body: str = "") -> None:
    print(f"\n== {title}")
    if body:
        print("   " + body.rstrip().replace("\n", "\n   "))


@contextlib.contextmanager
def gateway(home: Home, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bastion.cli",
                "--home",
                str(home.root),
                "daemon",
                "--approval-timeout",
                "30",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                opsock.call(home.operator_socket, "status", timeout=2)
                break
            except opsock.OperatorError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the gateway did not start:\n" + log.read_text()) from None
                time.sleep(0.05)
        yield proc
    finally:
        proc.terminate()
        proc.wait(10)


def run_demo(keep: bool = False) -> int:
    reason = sshd_available()
    if reason:
        print(f"bastion demo: {reason}", file=sys.stderr)
        return 1
    root = Path(tempfile.mkdtemp(prefix="bastion-demo-"))
    try:
        return _demo(root)
    finally:
        if keep:
            print(f"\n(kept {root})")
        else:
            shutil.rmtree(root, ignore_errors=True)


def _demo(root: Path) -> int:
    home = Home(root / "home")
    bastion(home, "init", "--passphrase-stdin", stdin=PASSPHRASE + "\n")
    public = bastion(
        home, "key", "generate", "demo-key", "--passphrase-stdin", stdin=PASSPHRASE + "\n"
    ).strip()
    say("1. A key is generated inside the vault; only its public half leaves", public)
    with Sshd(root / "sshd", authorized_keys=[public]) as sshd:
        info = sshd.info
        policy = home.policies / "demo.toml"
        policy.write_text(
            f'[hosts.demo]\naddress = "{info.address}"\nport = {info.port}\n'
            f'host_key = "{info.host_key}"\n\n'
            f'[[hosts.demo.accounts]]\nuser = "{getpass.getuser()}"\n'
            'credential = "demo-key"\napproval = "session"\ndeny = ["*rm -rf*"]\n'
        )
        os.chmod(policy, 0o600)
        say("2. A policy pins the target's host key", policy.read_text())
        config = root / "agent_ssh_config"
        config.write_text(bastion(home, "ssh-config"))
        with gateway(home, root / "gateway.log"):
            bastion(home, "unlock", "--passphrase-stdin", stdin=PASSPHRASE + "\n")
            say("3. Gateway running and unlocked", bastion(home, "status"))
            agent = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    AGENT,
                    str(config),
                    "echo hello from $(hostname); id -un",
                    "rm -rf /tmp/nothing-here",
                ],
                stdout=subprocess.PIPE,
                text=True,
                # ssh runs the ProxyCommand with $SHELL; bash would read ~/.bashrc first
                # (docs/files-and-clients.md, "Slow commands"), and the demo's times are
                # the gateway's own.
                env={**os.environ, "SHELL": "/bin/sh"},
            )
            cards = opsock.call(home.operator_socket, "pending", wait=20)
            if not cards:
                raise RuntimeError("no approval card arrived")
            say("4. The operator sees a card for the agent process", _card(cards[0]))
            opsock.call(home.operator_socket, "answer", card=cards[0]["id"], approve=True)
            out, _ = agent.communicate(timeout=60)
            results = [_literal(line) for line in out.splitlines()]
            ok = results and results[0][1] == 0
            for cmd, status, stdout, stderr in results:
                say(
                    f"5. Agent ran: ssh -F agent_ssh_config demo {cmd!r}",
                    f"exit {status}\nstdout: {stdout.strip()}\nstderr: {stderr.strip()}",
                )
            bastion(home, "lock")
            locked = subprocess.run(
                [sys.executable, "-c", AGENT, str(config), "echo should not run"],
                capture_output=True,
                text=True,
                timeout=60,
            )
            cmd, status, _, stderr = _literal(locked.stdout.strip())
            say(
                "6. After `bastion lock`, the agent is refused at once, nothing queued",
                f"exit {status}\nstderr: {stderr.strip()}",
            )
            ok = ok and status == 77 and len(results) == 2 and results[1][1] == 77
        verify = subprocess.run(
            [sys.executable, "-m", "bastion.cli", "--home", str(home.root), "audit", "verify"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        say("7. The journal verifies offline: no passphrase, no gateway", verify.stdout)
        ok = ok and verify.returncode == 0
    say(
        "Done" if ok else "FAILED",
        "Everything above ran through the real ssh client and a "
        "real sshd; the agent never held a key."
        if ok
        else "see the output above",
    )
    return 0 if ok else 1


def _card(card: dict[str, Any]) -> str:
    s = card["subject"]
    return (
        f"{card['kind']} card {card['id']}: {card['user']}@{card['host']} "
        f"({card['address']}:{card['port']}, credential {card['credential']})\n"
        f"asked by pid {s['pid']} {s['exe']}\nexe sha256 {s['exe_sha256']}"
    )


def _literal(line: str) -> tuple[str, int, str, str]:
    import ast

    cmd, status, stdout, stderr = ast.literal_eval(line)
    return cmd, status, stdout, stderr


__all__ = ["json", "run_demo"]
