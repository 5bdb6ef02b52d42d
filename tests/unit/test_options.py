"""Warnings for rules that spell an option known to run a program (core/options.py)."""

from __future__ import annotations

import pytest

from bastion.core.command import RuleKind, parse_rule
from bastion.core.options import RISKY, warnings


def warned(*rules: str) -> tuple[str, ...]:
    return warnings("allow", [parse_rule(r, RuleKind.ADMIT) for r in rules])


@pytest.mark.parametrize(
    "rule,option",
    [
        ("find /var/log -* ...", "-exec"),  # an option pattern admits every option
        ("find /var/log -fprintf * *", "-fprintf"),
        ("/usr/bin/find /var/log -delete", "-delete"),  # the program by its path
        ("git -c * log", "-c"),
        ("git --config-env=* log", "--config-env"),
        ("tar -I * -xf *", "-I"),
        ("tar --checkpoint-action=* cf * *", "--checkpoint-action"),
        ("tar * ...", "xIf"),  # old-style options need no dash
        ("tar ...", "xIf"),
        ("ssh -o * web1 uptime", "-o"),
        ("ssh -oProxyCommand=* web1", "-o"),
        ("scp -S * * *", "-S"),
        ("rsync -e * * *", "-e"),
        ("systemctl --host=* status *", "--host"),
        ("systemctl -H * status *", "-H"),
    ],
)
def test_a_rule_that_admits_an_option_that_runs_a_program_is_warned_about(
    rule: str, option: str
) -> None:
    (line,) = warned(rule)
    assert line.startswith(f'allow rule "{rule}" admits ') and option in line


@pytest.mark.parametrize(
    "rule",
    [
        "find /var/log -name *",
        "find /var/log ...",  # ... never covers an option
        "git log ...",
        "git log --format=* ...",
        "tar tf *",  # spelled letters: no I, no F
        "systemctl status *",
        "journalctl -u * --since *",
        "ssh web1 uptime",
        "mytool -c *",  # an unknown program: no warning
    ],
)
def test_a_rule_that_spells_no_such_option_is_not_warned_about(rule: str) -> None:
    assert warned(rule) == ()


def test_the_warnings_name_the_field_and_say_what_the_option_does() -> None:
    (line,) = warnings("preapproved", [parse_rule("git -c * ...", RuleKind.ADMIT)])
    assert line == (
        'preapproved rule "git -c * ..." admits -c, with which git can run a program '
        "(core.sshCommand, aliases, hooks)"
    )
    assert set(RISKY) >= {"find", "git", "tar", "ssh", "systemctl"}
