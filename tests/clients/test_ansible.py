"""ansible-core through bastion with its default settings, inside one `bastion run`.

ansible's defaults: one ControlMaster per host (`-o ControlMaster=auto -o
ControlPersist=60s`), no pipelining, so every module runs under `ssh -tt` -- which
needs an account with `pty = true` -- and its files go over ansible's `smart`
transfer (sftp, then scp, then a piped `dd` over exec): the gateway serves sftp, so
its modules travel as file operations on the master's later channels, each on
record. Only `ssh_args` is set, to put `-F` (the config `bastion ssh-config`
prints) before ansible's own default options.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from tests.harness import (
    USER,
    Bastion,
    SshdInfo,
    make_bastion,
    policy_toml,
    run_agent,
    wait_for,
)

ANSIBLE_BIN = Path(sys.executable).parent  # ansible-core, installed beside this python
PLAYBOOK = """\
- hosts: web1
  gather_facts: false
  tasks:
    - name: a directory
      ansible.builtin.file:
        path: {root}/play
        state: directory
    - name: a file, copied
      ansible.builtin.copy:
        src: {source}
        dest: {root}/play/copied.txt
        mode: "0640"
    - name: a command that reads it back
      ansible.builtin.command: cat {root}/play/copied.txt
      register: read_back
      changed_when: false
      failed_when: read_back.stdout != "{content}"
"""


def ansible_files(b: Bastion, work: Path) -> dict[str, str]:
    """An inventory and ansible.cfg pointing ansible's ssh at bastion's config: the lines
    a user writes (the ansible recipe of docs/files-and-clients.md, "Agents and their
    tools"). Returns the environment."""
    (work / "inventory.ini").write_text(
        "[targets]\nweb1 ansible_python_interpreter=/usr/bin/python3\n"
    )
    (work / "ansible.cfg").write_text(
        "[defaults]\n"
        "inventory = inventory.ini\n"
        "[ssh_connection]\n"
        f"ssh_args = -F {b.config} -C -o ControlMaster=auto -o ControlPersist=60s\n"
        # control_path_dir stays ansible's default, ~/.ansible/cp: in a run the home is the
        # run's own overlay, so its masters are its own.
    )
    return {
        "ANSIBLE_CONFIG": str(work / "ansible.cfg"),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_FORCE_COLOR": "0",
    }


def journal(b: Bastion) -> list[dict[str, Any]]:
    return [json.loads(x) for x in b.cli("audit", "export", "--with-commands").stdout.splitlines()]


def test_ansible_with_its_defaults_through_one_run(
    tmp_path: Path, sshd: SshdInfo, client_key: tuple[Path, str]
) -> None:
    b = make_bastion(tmp_path, sshd, client_key[0], policy_toml(sshd, pty=True))
    try:
        work = tmp_path / "project"
        work.mkdir()
        env = ansible_files(b, work)
        agent = run_agent(b, "--label", "ansible", env=env, cwd=work)
        ansible = str(ANSIBLE_BIN / "ansible")

        def run(*argv: str) -> Any:
            rid = agent.start([], argv=list(argv))
            return agent.wait(rid, timeout=300)

        # The run's session card comes with its first request.
        rid = agent.start([], argv=[ansible, "web1", "-m", "ping"])
        wait_for(lambda: agent.finished(rid) or b.op("pending"), 90)
        assert not agent.finished(rid), agent.wait(rid)
        card = b.approve_next()
        assert card["kind"] == "session"
        r = agent.wait(rid, timeout=300)
        assert r.rc == 0 and b'"ping": "pong"' in r.stdout, (r.stdout, r.stderr)

        marker = tmp_path / "ran-by-ansible"
        r = run(ansible, "web1", "-m", "command", "-a", f"touch {marker}")
        assert r.rc == 0 and marker.exists(), (r.stdout, r.stderr)

        source = work / "source.txt"
        content = "bytes from the controller\n"
        source.write_text(content)
        dest = tmp_path / "copied-by-ansible.txt"
        r = run(ansible, "web1", "-m", "copy", "-a", f"src={source} dest={dest} mode=0600")
        assert r.rc == 0, (r.stdout, r.stderr)
        assert dest.read_text() == content and (dest.stat().st_mode & 0o777) == 0o600

        book = work / "play.yml"
        book.write_text(PLAYBOOK.format(root=tmp_path, source=source, content=content.strip()))
        r = run(str(ANSIBLE_BIN / "ansible-playbook"), str(book))
        assert r.rc == 0, (r.stdout, r.stderr)
        assert b"failed=0" in r.stdout, r.stdout
        assert (tmp_path / "play" / "copied.txt").read_text() == content

        # One session card for the whole run, and every command on record: each module
        # ran under -tt, with a terminal, and completed.
        rows = journal(b)
        received = {x["request_id"]: x for x in rows if x.get("type") == "request_received"}
        completed = {x["request_id"] for x in rows if x.get("type") == "completed"}
        for module in ("ping", "command", "copy", "file"):
            runs = [
                rid
                for rid, x in received.items()
                if f"AnsiballZ_{module}.py" in x["command"] and "python3" in x["command"]
            ]
            assert runs, (module, [x["command"][:80] for x in received.values()])
            assert all(received[rid].get("terminal") is True for rid in runs), module
            assert all(rid in completed for rid in runs), module
        assert all(x["user"] == USER and x["host"] == "web1" for x in received.values())
        # Its modules went over sftp, on its ControlMaster's later channels: each put a
        # file operation of its own, on record (path, no content) and completed.
        puts = [
            rid
            for rid, x in received.items()
            if (x.get("file") or {}).get("op") == "write" and "AnsiballZ_" in x["file"]["path"]
        ]
        assert puts and all(rid in completed for rid in puts), [
            x.get("file") for x in received.values()
        ]
        assert not b.op("pending")
    finally:
        b.close()


def test_ansible_on_an_account_without_pty_is_told_what_to_change(
    tmp_path: Path, sshd: SshdInfo, client_key: tuple[Path, str]
) -> None:
    """Its modules run under -tt: refused, nothing runs, and ansible shows bastion's
    words (the account's `pty = true`, or pipelining); with pipelining on, no terminal
    is asked for and the same module runs."""
    b = make_bastion(tmp_path, sshd, client_key[0])
    try:
        work = tmp_path / "project"
        work.mkdir()
        env = ansible_files(b, work)
        agent = run_agent(b, "--label", "ansible", env=env, cwd=work)
        marker = tmp_path / "ran-by-ansible"
        argv = [str(ANSIBLE_BIN / "ansible"), "web1", "-m", "command", "-a", f"touch {marker}"]
        rid = agent.start([], argv=argv)
        wait_for(lambda: agent.finished(rid) or b.op("pending"), 90)
        assert not agent.finished(rid), agent.wait(rid)
        b.approve_next()
        r = agent.wait(rid, timeout=300)
        assert r.rc != 0 and not marker.exists(), (r.stdout, r.stderr)
        said = (r.stdout + r.stderr.encode()).decode()
        assert "`pty = true`" in said and "pipelining" in said, said
        r = agent.wait(agent.start([], argv=argv, env={"ANSIBLE_PIPELINING": "1"}), 300)
        assert r.rc == 0 and marker.exists(), (r.stdout, r.stderr)
    finally:
        b.close()
