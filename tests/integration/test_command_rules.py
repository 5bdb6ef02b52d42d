"""Command rules that mean what runs (issues 8 and 18), with the real ssh client and sshd.

Two host aliases point at the same sshd: `pc` is a per-command account with
no allow list (shell source goes to a card), `plain` a session account whose
allow list holds every rule of the bypass corpus. Every attack must raise a
command card on `pc` (and run nothing when the card is denied) and be refused
with POLICY_DENIED on `plain`; `bastion check-command` must say the same as
the live gateway each time.

Each of these runs twice: against the test sshd, where the login shell (bash)
reads the command, and against one whose ForceCommand hands the command,
untouched, to zsh (`exec zsh -c "$SSH_ORIGINAL_COMMAND"`), as a zsh login
shell would read it. The tests run as the invoking user, whose login shell
they cannot change; the ForceCommand makes zsh the shell that parses the
agent's bytes, which is what a zsh login shell does with `-c`.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bastion.data import EXAMPLE_POLICY
from bastion.devtools.sshd_fixture import Sshd, SshdInfo, find_template
from tests.harness import USER, Agent, Bastion, make_bastion, toml_value

CORPUS: list[dict[str, Any]] = tomllib.loads(
    (Path(__file__).resolve().parents[1] / "data" / "bypass_corpus.toml").read_text()
)["entry"]
RULES = sorted({e["rule"] for e in CORPUS})


def zsh_target(directory: Path, client_public: str) -> Sshd:
    """A test sshd on which zsh reads every command (see the module's docstring)."""
    zsh = shutil.which("zsh")
    if zsh is None:
        pytest.skip("zsh is not installed")
    template = directory / "sshd_config.template"
    force = f'ForceCommand exec {zsh} -c "$$SSH_ORIGINAL_COMMAND"'  # $$: Template's dollar
    template.write_text(find_template().read_text() + f"\n{force}\n")
    return Sshd(directory / "run", authorized_keys=[client_public], template=template)


@pytest.fixture(scope="module")
def zsh_sshd(
    tmp_path_factory: pytest.TempPathFactory, client_key: tuple[Path, str]
) -> Iterator[SshdInfo]:
    with zsh_target(tmp_path_factory.mktemp("zsh-sshd"), client_key[1]) as server:
        yield server.info


def two_accounts(
    sshd: SshdInfo, plain_rules: list[str], login_shell: str = "posix", **extra: str
) -> str:
    def host(alias: str, account: list[str]) -> list[str]:
        return [
            f"[hosts.{alias}]",
            f'address = "{sshd.address}"',
            f"port = {sshd.port}",
            f'host_key = "{sshd.host_key}"',
            f"[[hosts.{alias}.accounts]]",
            f'user = "{USER}"',
            'credential = "deploy-key"',
            f'login_shell = "{login_shell}"',
            *account,
            "",
        ]

    return "\n".join(
        [
            *host("pc", ['approval = "per-command"', *(f"{k} = {v}" for k, v in extra.items())]),
            *host("plain", ['approval = "session"', f"allow = {json.dumps(plain_rules)}"]),
        ]
    )


@pytest.fixture(scope="module", params=["login-shell", "zsh"])
def rules_bastion(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    sshd_server: Any,
    client_key: tuple[Path, str],
) -> Any:
    """A bastion whose two accounts reach a target where the login shell, or zsh, reads."""
    root = tmp_path_factory.mktemp("rules")
    if request.param == "zsh":
        target: SshdInfo = request.getfixturevalue("zsh_sshd")
    else:
        target = sshd_server.info
    policy = two_accounts(target, RULES, "zsh" if request.param == "zsh" else "posix")
    b = make_bastion(root, target, client_key[0], policy=policy)
    try:
        yield b
    finally:
        b.close()


def approved_agent(b: Bastion, host: str) -> Agent:
    """An agent whose session on `host` is approved (the first command rides it)."""
    agent = b.agent()
    rid = agent.start("echo hello", host=host)
    card = b.next_card()
    assert card["kind"] == "session"
    b.answer(card, True)
    if host == "pc":  # the command itself needs a command card there
        b.answer(b.next_card(), True)
    assert agent.wait(rid).rc == 0
    return agent


def test_every_bypass_raises_a_card_runs_nothing_and_check_command_agrees(
    rules_bastion: Bastion, tmp_path: Path
) -> None:
    b = rules_bastion
    pc, plain = approved_agent(b, "pc"), approved_agent(b, "plain")
    markers = []
    for i, entry in enumerate(CORPUS):
        marker = tmp_path / f"marker-{i}"
        markers.append(marker)
        attack = entry["attack"].replace("{marker}", str(marker))
        # A per-command account: a command card, which the operator denies.
        offline = b.check_command("pc", attack)
        assert offline["verdict"] == "command_card", (entry["name"], offline)
        rid = pc.start(attack, host="pc")
        card = b.next_card()
        assert card["kind"] == "command", entry["name"]
        assert card["command_sha256"] == hashlib.sha256(attack.encode()).hexdigest()
        if offline["argv"] is None:
            assert card["argv"] is None and card["shell_syntax"], entry["name"]
            assert [c["offset"] for c in card["shell_syntax"]] == [
                c["offset"] for c in offline["shell_syntax"]
            ]
        else:
            assert card["argv"] == offline["argv"], entry["name"]
        b.answer(card, False)
        denied = pc.wait(rid)
        assert (denied.rc, denied.code) == (77, "CALL_DENIED"), (entry["name"], denied.stderr)
        # An account with an allow list: refused at once, and check-command says why.
        offline = b.check_command("plain", attack)
        assert (offline["verdict"], offline["code"]) == ("denied", "POLICY_DENIED"), entry["name"]
        refused = plain.run(attack, host="plain")
        assert (refused.rc, refused.code) == (77, "POLICY_DENIED"), (entry["name"], refused.stderr)
        assert refused.error is not None and offline["reason"] in refused.error["message"]
    assert b.op("pending") == []
    assert [m.name for m in markers if m.exists()] == []  # nothing of any attack ran

    # The markers would have shown it: the same attack, approved, runs.
    attack = CORPUS[0]["attack"].replace("{marker}", str(markers[0]))
    rid = pc.start(attack, host="pc")
    b.answer(b.next_card(), True)
    assert pc.wait(rid).rc == 0 and markers[0].exists()


def test_plain_commands_flow_under_the_example_rules(
    tmp_path: Path, sshd: SshdInfo, client_key: tuple[Path, str]
) -> None:
    example = tomllib.loads(EXAMPLE_POLICY.read_text())
    web1 = next(a for a in example["hosts"]["web1"]["accounts"] if a["user"] == "deploy")
    extra = {k: json.dumps(web1[k]) for k in ("allow", "deny", "preapproved")}
    b = make_bastion(tmp_path, sshd, client_key[0], policy=two_accounts(sshd, ["true"], **extra))
    try:
        agent = approved_agent_for_preapproved(b)
        for command in (
            "systemctl status nginx",
            "journalctl -u app --since '1 hour ago'",
            "df -h",
        ):
            assert b.check_command("pc", command)["preapproved"] is not None
            r = agent.run(command, host="pc")
            assert r.error is None, (command, r.stderr)  # the target answered, whatever it said
            assert b.op("pending") == []  # and no command card was raised
        shell = agent.start("df -h | head -1", host="pc")
        refused = agent.wait(shell)
        assert refused.code == "POLICY_DENIED" and "'|' at byte 6" in refused.error["message"]  # type: ignore[index]
    finally:
        b.close()


def approved_agent_for_preapproved(b: Bastion) -> Agent:
    agent = b.agent()
    rid = agent.start("df -h", host="pc")
    b.answer(b.next_card(), True)  # the session card only: df -h is preapproved
    assert agent.wait(rid).error is None
    return agent


def test_what_the_card_shows_is_the_argv_that_runs(rules_bastion: Bastion, tmp_path: Path) -> None:
    printer = tmp_path / "print-argv"
    printer.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    printer.chmod(0o755)
    command = f"{printer} a 'b c' \"d  e\" --x=1 '' 'f;g'"
    b = rules_bastion
    agent = b.agent()
    rid = agent.start(command, host="pc")
    b.answer(b.next_card(), True)  # session
    card = b.next_card()
    assert card["argv"] == [str(printer), "a", "b c", "d  e", "--x=1", "", "f;g"]
    assert card["command"] == command  # printable ASCII, shown as is
    assert card["command_sha256"] == hashlib.sha256(command.encode()).hexdigest()
    b.answer(card, True)
    r = agent.wait(rid)
    assert r.rc == 0 and json.loads(r.stdout) == card["argv"][1:]


# -- zsh judges a word after quote removal (issue 18) ------------------------------------------


def test_a_word_that_zsh_expands_after_quote_removal_is_shown_as_shell_source(
    rules_bastion: Bastion, tmp_path: Path
) -> None:
    """zsh runs `P ''=ls` as `P /usr/bin/ls`: a card showing the argv [P, "=ls"] would lie."""
    printer = tmp_path / "print-argv"
    printer.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    printer.chmod(0o755)
    b = rules_bastion
    agent = b.agent()
    rid = agent.start(f"{printer} x", host="pc")
    b.answer(b.next_card(), True)  # session
    b.answer(b.next_card(), True)  # the command: a control, it runs
    assert json.loads(agent.wait(rid).stdout) == ["x"]
    command = f"{printer} ''=ls"
    offline = b.check_command("pc", command)
    rid = agent.start(command, host="pc")
    card = b.next_card()
    assert card["argv"] is None, card["argv"]
    equals = len(str(printer)) + 3
    assert [(c["offset"], c["text"]) for c in card["shell_syntax"]] == [(equals, "=")]
    assert offline["verdict"] == "command_card"
    assert [c["offset"] for c in offline["shell_syntax"]] == [equals]
    b.answer(card, False)
    assert agent.wait(rid).code == "CALL_DENIED"


def test_an_allow_rule_cannot_be_met_with_a_word_zsh_expands(
    tmp_path: Path, zsh_sshd: SshdInfo, client_key: tuple[Path, str]
) -> None:
    """`cp * DEST/` is meant for a file by name; zsh makes `''=zsh` /usr/bin/zsh."""
    dest, source = tmp_path / "dest", tmp_path / "notes.txt"
    dest.mkdir()
    source.write_text("notes\n")
    rules = [f"cp * {dest}/"]
    b = make_bastion(
        tmp_path / "b", zsh_sshd, client_key[0], policy=two_accounts(zsh_sshd, rules, "zsh")
    )
    try:
        agent = b.agent()
        rid = agent.start(f"cp {source} {dest}/", host="plain")  # the control: it runs
        b.answer(b.next_card(), True)
        assert agent.wait(rid).rc == 0 and (dest / "notes.txt").exists()
        attack = f"cp ''=zsh {dest}/"
        refused = agent.run(attack, host="plain")
        copied = sorted(p.name for p in dest.iterdir())
        assert (refused.rc, refused.code, copied) == (77, "POLICY_DENIED", ["notes.txt"])
        assert refused.error is not None and "'=' at byte 5" in refused.error["message"]
        offline = b.check_command("plain", attack)
        assert (offline["verdict"], offline["code"]) == ("denied", "POLICY_DENIED")
    finally:
        b.close()


# -- check-command agrees with the live gateway on every rule of the shipped example --------------


def example_accounts() -> list[tuple[str, dict[str, Any]]]:
    """Every account of policies/example.toml as its own host alias, logging in as
    the test user on the test sshd (its rules, approval and shell mode unchanged)."""
    doc = tomllib.loads(EXAMPLE_POLICY.read_text())
    out = []
    for host, spec in doc["hosts"].items():
        for account in spec["accounts"]:
            alias = f"{host}-{account['user']}".replace(".", "-")
            out.append((alias, account))
    return out


def example_policy(sshd: SshdInfo) -> str:
    lines: list[str] = []
    for alias, account in example_accounts():
        lines += [
            f"[hosts.{alias}]",
            f'address = "{sshd.address}"',
            f"port = {sshd.port}",
            f'host_key = "{sshd.host_key}"',
            f"[[hosts.{alias}.accounts]]",
            f'user = "{USER}"',
            'credential = "deploy-key"',
            *(
                f"{k} = {toml_value(v)}"
                for k, v in account.items()
                if k not in ("user", "credential")
            ),
            "",
        ]
    return "\n".join(lines)


def instance(rule: str) -> str:
    """A command the rule was written for: each glob filled in, `...` given one word."""
    words = []
    for word in rule.split():
        if word == "...":
            words.append("--more")
            continue
        filled = word.replace("*", "x").replace("?", "x")
        while "[" in filled:
            start, end = filled.index("["), filled.index("]")
            filled = filled[:start] + filled[start + 1] + filled[end + 1 :]
        words.append(filled)
    return " ".join(words)


EXAMPLE_CASES = [
    pytest.param(alias, field, rule, id=f"{alias} {field} {rule}")
    for alias, account in example_accounts()
    for field in ("allow", "preapproved", "deny")
    for rule in account.get(field, [])
]


@pytest.fixture(scope="module")
def example_bastion(
    tmp_path_factory: pytest.TempPathFactory, sshd_server: Any, client_key: tuple[Path, str]
) -> Any:
    root = tmp_path_factory.mktemp("example")
    b = make_bastion(root, sshd_server.info, client_key[0], policy=example_policy(sshd_server.info))
    b.example_agents = {}  # type: ignore[attr-defined]
    try:
        yield b
    finally:
        b.close()


def live_verdict(b: Bastion, alias: str, command: str) -> tuple[str, str | None]:
    """What the running gateway did with the command, in check-command's words."""
    agents: dict[str, Agent] = b.example_agents  # type: ignore[attr-defined]
    agent = agents.setdefault(alias, b.agent())
    rid = agent.start(command, host=alias)
    while True:
        cards = b.op("pending", wait=0.5)
        done = agent.finished(rid)
        if cards:
            card = cards[0]
            if card["kind"] == "session":
                b.answer(card, True)
                continue
            b.answer(card, False)
            agent.wait(rid)
            return "command_card", None
        if done:
            r = agent.wait(rid)
            if r.code in ("POLICY_DENIED", "UNKNOWN_HOST", "UNSUPPORTED_REQUEST"):
                return "denied", r.code
            assert r.code is None, r.stderr  # it ran: the target answered
            return "no_command_card", None


@pytest.mark.parametrize("alias,field,rule", EXAMPLE_CASES)
def test_check_command_says_what_the_gateway_does_for_every_example_rule(
    example_bastion: Bastion, alias: str, field: str, rule: str
) -> None:
    command = instance(rule)
    offline = example_bastion.check_command(alias, command)
    assert (offline["verdict"], offline["code"]) == live_verdict(example_bastion, alias, command)
    if field == "deny":
        assert offline["verdict"] == "denied"
    elif field == "preapproved":
        assert offline["verdict"] == "no_command_card" and offline["preapproved"] == rule
    else:
        assert offline["verdict"] != "denied"
