"""Word rules never let an option through unless they spell it (issue 18), over real ssh.

`*` and `...` in `allow` and `preapproved` match only words that do not begin
with `-`: `"find DIR ..."` must not admit `find DIR -fprintf MARKER x`, nor
`"tar * ..."` admit `--checkpoint-action=exec=...`. Each attack writes a
marker on the target if it runs. The controls: the same programs without the
option run, a rule that spells the option admits it (and the marker shows the
attack would have worked), and a deny rule's globs still catch options.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bastion.devtools.sshd_fixture import SshdInfo
from tests.harness import USER, Agent, Bastion, make_bastion


def host(sshd: SshdInfo, alias: str, **account: Any) -> str:
    lines = [
        f"[hosts.{alias}]",
        f'address = "{sshd.address}"',
        f"port = {sshd.port}",
        f'host_key = "{sshd.host_key}"',
        f"[[hosts.{alias}.accounts]]",
        f'user = "{USER}"',
        'credential = "deploy-key"',
        *(f"{k} = {json.dumps(v)}" for k, v in account.items()),
    ]
    return "\n".join(lines) + "\n"


@pytest.fixture
def world(tmp_path: Path, sshd: SshdInfo, client_key: tuple[Path, str]) -> Iterator[Any]:
    """`web1`: a session account with allow rules; `pc`: a per-command account whose
    preapproved rules leave options out; `guard`: no allow list, deny `rm * ...`."""
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "app.log").write_text("line\n")
    spelled = f"find {logs} -maxdepth 0 -fprintf * x"
    policy = "\n".join(
        [
            host(
                sshd,
                "web1",
                approval="session",
                allow=[f"find {logs} ...", f"find {logs} -name *", "tar * ...", spelled],
            ),
            host(sshd, "pc", approval="per-command", preapproved=[f"find {logs} ..."]),
            host(sshd, "guard", approval="session", deny=["rm * ..."]),
        ]
    )
    b = make_bastion(tmp_path / "b", sshd, client_key[0], policy=policy)
    try:
        yield b, logs, spelled
    finally:
        b.close()


def session(b: Bastion, alias: str, command: str) -> Agent:
    """An agent approved for `alias` by running `command` (a control that must succeed)."""
    agent = b.agent()
    rid = agent.start(command, host=alias)
    b.answer(b.next_card(), True)
    r = agent.wait(rid)
    assert r.rc == 0, r.stderr
    return agent


def test_find_and_tar_options_a_rule_did_not_spell_are_refused_and_run_nothing(
    world: Any, tmp_path: Path
) -> None:
    b, logs, spelled = world
    agent = session(b, "web1", f"find {logs} -name app.log")  # a spelled option: it runs
    marker = tmp_path / "marker"
    attacks = {
        f"find {logs} -fprintf {marker} x": ("-fprintf", f"find {logs} ...", "..."),
        f"find {logs} -exec touch {marker} ';'": ("-exec", f"find {logs} ...", "..."),
        f"tar cf /dev/null {logs} --checkpoint=1 '--checkpoint-action=exec=touch {marker}'": (
            "--checkpoint=1",
            "tar * ...",
            "...",
        ),
    }
    for attack, (word, rule, rule_word) in attacks.items():
        refused = agent.run(attack, host="web1")
        ran = (refused.rc, refused.code, marker.exists())
        assert ran == (77, "POLICY_DENIED", False), (attack, ran, refused.stderr)
        offline = b.check_command("web1", attack)
        assert (offline["verdict"], offline["code"]) == ("denied", "POLICY_DENIED"), attack
        first = offline["unspelled_options"][0]
        assert (first["field"], first["word"], first["rule"], first["rule_word"]) == (
            "allow",
            word,
            rule,
            rule_word,
        )
        message = refused.error["message"]  # type: ignore[index]
        assert offline["reason"] in message and f"{word!r}" in message
        assert "option pattern" in message
    # The controls: the programs run without the options, and a rule that spells one admits it.
    assert agent.run(f"tar cf /dev/null {logs}", host="web1").rc == 0
    admitted = f"find {logs} -maxdepth 0 -fprintf {marker} x"
    offline = b.check_command("web1", admitted)
    assert offline["rule"] == spelled and offline["verdict"] == "no_command_card"
    assert any("-fprintf" in w and spelled in w for w in offline["warnings"])
    assert agent.run(admitted, host="web1").rc == 0
    assert marker.exists()  # so the markers above would have shown a run


def test_a_preapproved_rule_does_not_spare_the_card_for_an_option_it_did_not_spell(
    world: Any, tmp_path: Path
) -> None:
    b, logs, _ = world
    agent = b.agent()
    rid = agent.start(f"find {logs}", host="pc")
    b.answer(b.next_card(), True)  # the session card only: preapproved
    assert agent.wait(rid).rc == 0 and b.op("pending") == []
    marker = tmp_path / "marker"
    attack = f"find {logs} -fprintf {marker} x"
    rid = agent.start(attack, host="pc")
    cards = b.op("pending", wait=20)
    done = agent.wait(rid) if not cards else None
    assert done is None and not marker.exists(), (done, marker.exists())  # no card: it ran
    card = cards[0]
    assert card["kind"] == "command" and card["argv"][2] == "-fprintf"
    b.answer(card, False)
    denied = agent.wait(rid)
    assert (denied.rc, denied.code) == (77, "CALL_DENIED")
    assert not marker.exists()
    offline = b.check_command("pc", attack)
    assert (offline["verdict"], offline["preapproved"]) == ("command_card", None)
    assert [(u["field"], u["word"]) for u in offline["unspelled_options"]] == [
        ("preapproved", "-fprintf")
    ]


def test_a_deny_rule_still_catches_options(world: Any, tmp_path: Path) -> None:
    b, _, _ = world
    victim = tmp_path / "victim"
    (victim / "sub").mkdir(parents=True)
    agent = session(b, "guard", f"ls -la {victim}")  # not rm: it runs
    for command in (f"rm -rf {victim}", f"rm -r -f -- {victim}"):
        offline = b.check_command("guard", command)
        assert (offline["verdict"], offline["rule"]) == ("denied", "rm * ..."), command
        refused = agent.run(command, host="guard")
        assert (refused.rc, refused.code) == (77, "POLICY_DENIED"), refused.stderr
        assert "deny rule" in refused.error["message"]  # type: ignore[index]
    assert (victim / "sub").is_dir()
