"""Shell completion (issue 12, acceptance 5): `bastion completion SHELL` loads in
bash, zsh and fish, and a real bash completes what the running gateway has
now -- a card id at a TAB in an interactive shell, session ids, key labels,
requests -- and offers nothing, silently, when the gateway is down or hung.

The completion function is invoked the way bash invokes it (COMP_WORDS,
COMP_CWORD, then the function `complete -F` registered), or by pressing TAB
in an interactive bash on a real pty.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import click
import pytest
from click.shell_completion import BashComplete

from bastion.cli.completion import complete_account, complete_host
from tests.harness import (
    USER,
    Bastion,
    Terminal,
    approved_agent,
    cli_argv,
    policy_toml,
    wait_for,
)

BIN = Path(sys.executable).parent  # where the `bastion` entry point is installed
SHELLS = ("bash", "zsh", "fish")

# After sourcing the script, a shell names the function it will call for `bastion`.
LOADED = {
    "bash": ("bash", "--norc", "--noprofile", "-c", 'source "$1" && complete -p bastion', "-"),
    "zsh": (
        "zsh",
        "-f",
        "-c",
        'autoload -U compinit && compinit -u -D && source "$1" && print -r -- $_comps[bastion]',
        "-",
    ),
    "fish": ("fish", "--no-config", "-c", "source $argv[1]; and complete --do-complete 'bastion '"),
}


def shell_env() -> dict[str, str]:
    """The operator's environment, with this checkout's `bastion` first on PATH."""
    if not (BIN / "bastion").exists():
        pytest.skip(f"no `bastion` entry point in {BIN} (pip install -e .)")
    return {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}


def script_file(tmp_path: Path, shell: str) -> Path:
    r = subprocess.run(
        cli_argv(tmp_path / "no-home", "completion", shell),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and r.stderr == "", r.stderr
    path = tmp_path / f"bastion.{shell}"
    path.write_text(r.stdout)
    return path


def bash_complete(home: Path, *words: str, timeout: float = 60) -> tuple[list[str], str]:
    """What bash offers for `bastion --home HOME WORDS... <TAB>` (the last word is
    the one being completed), and what the completion printed on stderr."""
    line = ["bastion", "--home", str(home), *words]
    program = (
        "source <(bastion completion bash) || exit 9\n"
        f"COMP_WORDS=({shlex.join(line)}); COMP_CWORD={len(line) - 1}\n"
        "_bastion_completion bastion\n"
        'printf "%s\\n" "${COMPREPLY[@]}"\n'
    )
    r = subprocess.run(
        ["bash", "--norc", "--noprofile", "-c", program],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=shell_env(),
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 0, r.stderr
    return [w for w in r.stdout.splitlines() if w], r.stderr


@pytest.mark.parametrize("shell", SHELLS)
def test_the_script_parses_and_loads(tmp_path: Path, shell: str) -> None:
    if shutil.which(shell) is None:
        pytest.skip(f"{shell} is not installed (apt-get install {shell})")
    path = script_file(tmp_path, shell)
    text = path.read_text()
    assert "_BASTION_COMPLETE=" in text and f"{shell}_complete" in text, text
    syntax = subprocess.run([shell, "-n", str(path)], capture_output=True, text=True, timeout=60)
    assert syntax.returncode == 0 and syntax.stderr == "", syntax.stderr
    loaded = subprocess.run(
        [*LOADED[shell], str(path)], capture_output=True, text=True, timeout=60, env=shell_env()
    )
    assert loaded.returncode == 0, loaded.stderr
    if shell == "fish":  # fish ran the completion itself: the subcommands come back
        offered = {line.split("\t")[0] for line in loaded.stdout.splitlines()}
        assert {"approve", "decide", "completion", "key"} <= offered, loaded.stdout
    else:
        assert "_bastion_completion" in loaded.stdout, loaded.stdout


def test_tab_in_a_real_bash_completes_the_live_card_id(bastion: Bastion) -> None:
    agent = bastion.agent()
    rid = agent.start("echo never-runs")
    card = bastion.next_card()
    env = shell_env()
    term = Terminal(
        [
            "env",
            f"PATH={env['PATH']}",
            "TERM=dumb",
            "PS1=op$ ",
            "INPUTRC=/dev/null",
            "bash",
            "--norc",
            "--noprofile",
            "-i",
        ]
    )
    try:
        term.type("source <(bastion completion bash); echo loaded-$?\n")
        term.expect("loaded-0")
        term.type(f"bastion --home {bastion.home.root} decide {card['id'][:3]}\t")
        line = term.expect(card["id"])  # bash inserted the only candidate
        assert f"decide {card['id']}" in line, line
        term.type(" deny\n")  # the completed line runs as typed
        term.expect(f"{card['id']}: denied")
        term.type("exit\n")
        assert term.proc.wait(20) == 0
    finally:
        if term.proc.poll() is None:  # an interactive bash ignores SIGTERM, not SIGHUP
            term.proc.send_signal(signal.SIGHUP)
        term.close()
    assert agent.wait(rid).code == "SESSION_DENIED"


def test_sessions_keys_and_requests_come_from_the_running_gateway(bastion: Bastion) -> None:
    home = bastion.home.root
    agent = approved_agent(bastion)
    (session,) = bastion.op("sessions")
    offered, err = bash_complete(home, "revoke", "")
    assert offered == [session["id"]] and err == ""

    labels, _ = bash_complete(home, "key", "public", "")
    assert {"deploy-key", "bastion-journal"} <= set(labels), labels
    own, _ = bash_complete(home, "key", "remove", "")
    assert "deploy-key" in own and "bastion-journal" not in own, own  # bastion's own is not theirs
    assert bash_complete(home, "key", "public", "dep")[0] == ["deploy-key"]

    # A command in flight: `kill` offers its request id, and that id is the one to kill.
    assert bash_complete(home, "kill", "")[0] == []
    rid = agent.start("sleep 30")
    in_flight: list[str] = []

    def running() -> bool:
        in_flight[:] = bash_complete(home, "kill", "")[0]
        return bool(in_flight)

    wait_for(running, timeout=30)
    (request_id,) = in_flight
    assert request_id.startswith("req_"), request_id
    assert request_id in bash_complete(home, "request", "")[0]
    assert bastion.cli("kill", request_id).stdout.startswith(f"{request_id}: ended")
    agent.wait(rid, timeout=30)
    wait_for(lambda: bash_complete(home, "kill", "")[0] == [], timeout=30)


def test_a_gateway_down_or_hung_offers_nothing_and_prints_nothing(bastion: Bastion) -> None:
    home = bastion.home.root
    approved_agent(bastion)
    bastion.stop_daemon()
    for words in (("decide", ""), ("revoke", ""), ("kill", "")):
        offered, err = bash_complete(home, *words)
        assert (offered, err) == ([], ""), words
    # What needs no gateway and no passphrase still comes from the files.
    assert "deploy-key" in bash_complete(home, "key", "public", "")[0]
    assert bash_complete(home, "request", "req_")[0], "no request id from the journal"

    # Something listens on the operator socket and never answers (a hung gateway):
    # the TAB comes back, empty and silent, within the completion's short timeout.
    bastion.home.operator_socket.unlink(missing_ok=True)
    hung = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        hung.bind(str(bastion.home.operator_socket))
        hung.listen(8)
        started = time.monotonic()
        offered, err = bash_complete(home, "decide", "")
        assert (offered, err) == ([], "")
        assert time.monotonic() - started < 20
        assert bash_complete(home, "key", "public", "")[0] == []  # the gateway's to answer
    finally:
        hung.close()
        bastion.home.operator_socket.unlink(missing_ok=True)


def test_host_aliases_and_their_accounts_with_and_without_the_gateway(
    bastion: Bastion, tmp_path: Path
) -> None:
    """The completers for HOST and USER, through click's own completion on a command
    declared as `check-command HOST USER [--policies DIR]` is."""

    @click.group()
    @click.option("--home", type=click.Path(path_type=Path))
    def root(home: Path | None) -> None: ...

    @root.command()
    @click.argument("host", shell_complete=complete_host)
    @click.argument("user", shell_complete=complete_account)
    @click.option("--policies", type=click.Path(path_type=Path))
    def check(host: str, user: str, policies: Path | None) -> None: ...

    comp = BashComplete(root, {}, "bastion", "_BASTION_COMPLETE")

    def offered(*words: str, incomplete: str = "") -> list[str]:
        line = ["--home", str(bastion.home.root), "check", *words]
        return [i.value for i in comp.get_completions(line, incomplete)]

    bastion.write_policy(policy_toml(bastion.sshd, alias="db2"), "second.toml")
    wait_for(lambda: bastion.op("status")["policy"]["hosts"] == ["db2", "web1"])
    assert offered() == ["db2", "web1"]
    assert offered(incomplete="w") == ["web1"]
    assert offered("web1") == [USER]
    assert offered("nope") == []

    other = tmp_path / "other-policies"
    other.mkdir(mode=0o700)
    (other / "p.toml").write_text(policy_toml(bastion.sshd, alias="db3", user="svc"))
    (other / "p.toml").chmod(0o600)
    assert offered("--policies", str(other)) == ["db3"]  # the command's own --policies
    assert offered("--policies", str(other), "db3") == ["svc"]

    bastion.stop_daemon()
    assert offered() == ["db2", "web1"]  # from the policy files
    assert offered("db2") == [USER]
    bastion.write_policy("this is not toml", "second.toml")
    assert offered() == []  # a broken policy offers nothing, and raises nothing
