"""The strict command reader, word rules, and what a person is shown.

The reader must turn a command into an argv only when every POSIX shell
would run exactly that argv; everything else is shell source, with each
construct named at its byte offset. The bypass corpus (tests/data) is the
attacker's side: no entry may match the rule written for its innocent twin.
Admitting rules never let a glob cover an option; deny rules do.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest

from bastion.core.command import (
    MAX_CONSTRUCTS,
    RuleError,
    RuleKind,
    Unspelled,
    WordRule,
    no_match,
    parse_rule,
    read_command,
)
from bastion.core.display import escape_command_marked, escape_text

CORPUS: list[dict[str, Any]] = tomllib.loads(
    (Path(__file__).resolve().parents[1] / "data" / "bypass_corpus.toml").read_text()
)["entry"]
MARKER = "/tmp/bastion-marker"


def attack(entry: dict[str, Any]) -> str:
    return str(entry["attack"]).replace("{marker}", MARKER)


def test_the_corpus_is_big_enough_and_names_are_unique() -> None:
    assert len(CORPUS) >= 60
    assert len({e["name"] for e in CORPUS}) == len(CORPUS)


@pytest.mark.parametrize("entry", CORPUS, ids=[e["name"] for e in CORPUS])
def test_no_bypass_matches_the_rule_of_its_innocent_twin(entry: dict[str, Any]) -> None:
    rule = parse_rule(entry["rule"], RuleKind.ADMIT)  # as allow or preapproved
    innocent = read_command(entry["innocent"])
    assert innocent.argv is not None and rule.matches(innocent.argv)  # the rule is real
    reading = read_command(attack(entry))
    if reading.argv is None:
        assert reading.constructs, "shell source must say why"
    else:  # read as argv: then it is another program, or more words than the rule allows
        assert not rule.matches(reading.argv), reading.argv


@pytest.mark.parametrize(
    "command,argv",
    [
        ("systemctl status nginx", ["systemctl", "status", "nginx"]),
        ("  df   -h  ", ["df", "-h"]),
        ("echo\thello", ["echo", "hello"]),
        (
            "journalctl -u app --since '1 hour ago'",
            ["journalctl", "-u", "app", "--since", "1 hour ago"],
        ),
        ('printf "%s,%d" a-b c:d e@f', ["printf", "%s,%d", "a-b", "c:d", "e@f"]),
        ("r''m -rf /tmp/x", ["rm", "-rf", "/tmp/x"]),  # one word, as the shell joins it
        ("echo '' x", ["echo", "", "x"]),
        ("echo 'a;b|c&d>e<f(g)h*i?j[k]l{m}n~o#p'", ["echo", "a;b|c&d>e<f(g)h*i?j[k]l{m}n~o#p"]),
        ("ls --color=never a=b", ["ls", "--color=never", "a=b"]),
        ("git log -n 5 --format=%H", ["git", "log", "-n", "5", "--format=%H"]),
        ("ls '='x \"=\"y", ["ls", "=x", "=y"]),  # a quoted = is no expansion, in zsh either
        ("ls '~'root", ["ls", "~root"]),  # nor a quoted ~
        ("ls a''=b", ["ls", "a=b"]),  # = expands at the start of a word only
    ],
)
def test_plain_commands_read_as_the_argv_every_posix_shell_runs(
    command: str, argv: list[str]
) -> None:
    reading = read_command(command)
    assert reading.argv == tuple(argv) and reading.constructs == ()


@pytest.mark.parametrize(
    "command,offset,text",
    [
        ("ls; id", 2, ";"),
        ("ls\nid", 2, "\n"),
        ("ls $HOME", 3, "$"),
        ('echo "$(id)"', 6, "$"),
        ("echo 'a\\b'", 7, "\\"),
        ("echo 'a!b'", 7, "!"),
        ("echo 'open", 5, "'"),
        ("a=b ls", 1, "="),
        ("=ls", 0, "="),
        ("''=ls", 2, "="),  # zsh judges the word after quote removal: /usr/bin/ls
        ('""=ls', 2, "="),
        ("''\"\"=ls", 4, "="),
        ("ls ''=ls", 5, "="),  # in any word, not only the program's
        ("A''=b ls", 3, "="),  # not an assignment in sh, but it is read as shell source
        ("'A'=b ls", 3, "="),
        ("'ex'ec id", 0, "exec"),  # builtins are found after quote removal
        ('""eval id', 0, "eval"),
        ("'-' touch x", 0, "-"),  # zsh's precommand modifier, quoted or not
        ("''- touch x", 0, "-"),
        ("'noglob' touch x", 0, "noglob"),
        ("eval id", 0, "eval"),
        ("  exec id", 2, "exec"),
        ("ls ^x", 3, "^"),
        ("ls *", 3, "*"),
        ("ls ~", 3, "~"),
        ("ls #x", 3, "#"),
        ("ls \x00", 3, "\x00"),
        ("ls \x7f", 3, "\x7f"),
        ("é; ls", 0, "é"),
        ("echo é;x", 5, "é"),  # the offset is in bytes: é is two
        ("echo é;x", 7, ";"),
    ],
)
def test_shell_source_names_each_construct_at_its_byte_offset(
    command: str, offset: int, text: str
) -> None:
    reading = read_command(command)
    assert reading.argv is None
    assert any((c.offset, c.text) == (offset, text) for c in reading.constructs), reading
    assert text.strip() in reading.summary() or repr(text) in reading.summary()


def test_a_flood_of_constructs_is_counted_not_listed() -> None:
    reading = read_command("ls" + ";" * 100)
    assert len(reading.constructs) == MAX_CONSTRUCTS and reading.more == 100 - MAX_CONSTRUCTS
    assert "and 68 more" in reading.summary()


def admit(text: str) -> WordRule:
    return parse_rule(text, RuleKind.ADMIT)


def test_rules_are_words_with_a_final_ellipsis() -> None:
    rule = admit("journalctl -u * ...")
    assert rule.matches(("journalctl", "-u", "app"))
    assert rule.matches(("journalctl", "-u", "app", "_PID=1", "1 hour ago"))
    assert not rule.matches(("journalctl", "-u"))
    exact = admit("systemctl status *")
    assert exact.matches(("systemctl", "status", "a/b c"))  # * within one word, any chars
    assert not exact.matches(("systemctl", "status", "a", "b"))
    assert admit("df -h").matches(("df", "-h")) and not admit("df -h").matches(("df",))
    assert admit("echo 'a b'").words == ("echo", "a b")
    assert admit("rm ...").matches(("rm",))


@pytest.mark.parametrize(
    "text,fragment",
    [
        ("systemctl status *; *", "';' at byte 18"),
        ("echo $(x)", "'$' at byte 5"),
        ("ls | grep x", "'|'"),
        ("...", "names no command"),
        ("   ", "names no command"),
        ("ls ... -l", "may only be the last word"),
    ],
)
def test_a_rule_with_shell_syntax_explains_the_new_form(text: str, fragment: str) -> None:
    with pytest.raises(RuleError) as info:
        parse_rule(text, RuleKind.ADMIT)
    assert fragment in str(info.value)


def test_deny_rules_also_match_the_raw_string() -> None:
    rule = parse_rule("*rm -rf*", RuleKind.DENY)
    assert rule.matches_text("echo x; rm -rf /")
    assert not rule.matches_text("rm -r -f /")  # a guardrail, not a boundary


# -- options: what admitting rules never cover, and deny rules always do ---------------------


@pytest.mark.parametrize(
    "rule,argv",
    [
        ("git * ...", "git -c core.sshCommand=touch\tx fetch origin"),
        ("tar * ...", "tar cf /dev/null /etc --checkpoint=1 --checkpoint-action=exec=id"),
        ("find /var/log ...", "find /var/log -fprintf /root/.bashrc x"),
        ("find /var/log ...", "find /var/log -exec id ;"),
        ("systemctl status *", "systemctl status --host=attacker"),
        ("ssh * ...", "ssh -oProxyCommand=id x"),
        ("ls [a-z-]*", "ls -la"),  # a glob that could match: it is not an option pattern
        ("ls ?", "ls -"),  # "-" is an option word too
        ("ls *", "ls --"),  # and so is "--": it must be spelled
        ("* --version", "-x --version"),
    ],
)
def test_an_admitting_rule_never_lets_a_glob_cover_an_option(rule: str, argv: str) -> None:
    words = tuple(argv.split(" "))
    assert not admit(rule).matches(words)
    assert parse_rule(rule, RuleKind.DENY).matches(words)  # option-blind, as deny matches


@pytest.mark.parametrize(
    "rule,argv",
    [
        ("journalctl -u * --since *", "journalctl -u app --since today"),  # spelled
        ("git log -* ...", "git log --oneline main"),  # an option pattern
        ("git log --format=* ...", "git log --format=%H"),
        ("ls -- *", "ls -- x"),
        ("ls *", "ls a-b"),  # a dash inside a word is no option
        ("ls *", "ls "),  # nor is the empty word
        ("find /var/log -name * ...", "find /var/log -name *.log"),
    ],
)
def test_an_option_is_admitted_where_the_rule_spells_it(rule: str, argv: str) -> None:
    assert admit(rule).matches(tuple(argv.split(" ")))


def test_a_deny_rule_still_catches_options() -> None:
    rule = parse_rule("rm * ...", RuleKind.DENY)
    assert rule.matches(("rm", "-rf", "/")) and rule.matches(("rm", "-f", "--", "-x"))
    assert not admit("rm * ...").matches(("rm", "-rf", "/"))
    assert rule.unspelled(("rm", "-rf", "/")) == ()  # a deny rule misses nothing


def test_the_options_that_alone_kept_a_rule_from_matching_are_named() -> None:
    rule = admit("journalctl -u * ...")
    argv = ("journalctl", "-u", "app", "--since", "today", "-f")
    assert rule.unspelled(argv) == (
        Unspelled("journalctl -u * ...", 3, "--since", "..."),
        Unspelled("journalctl -u * ...", 5, "-f", "..."),
    )
    assert admit("systemctl status *").unspelled(("systemctl", "status", "--host=x")) == (
        Unspelled("systemctl status *", 2, "--host=x", "*"),
    )
    assert rule.unspelled(("journalctl", "-u", "app")) == ()  # it matches
    assert rule.unspelled(("journalctl", "--since", "x")) == ()  # "-u" is no glob's to cover
    assert admit("ls *").unspelled(("ls", "-l", "x")) == ()  # a word too many anyway
    why, missed = no_match((rule, admit("uptime")), argv)
    assert [m.word for m in missed] == ["--since", "-f"]
    assert "'--since' (word 4) is an option" in why and "option pattern such as -*" in why
    assert "ask the operator" in why  # what a model can do about it
    why, missed = no_match((admit("uptime"),), ("ls",))
    assert missed == () and why.endswith('allowed: "uptime"')


@pytest.mark.parametrize(
    "raw",
    [
        "\x1b[2K\r  command:  uptime\x1b[8m",  # the reported card-lying conversation ref
        "a\u202eb\u2066c\u2069d",  # bidi override and isolates
        "a\u200bb\u200cc\u200dd\u200ee\u200ff\ufeffg",  # zero-width and invisible marks
        "a\u2028b\u2029c\x85d\x00e\x7f",  # line/paragraph separators, C1, NUL, DEL
    ],
)
def test_shown_text_cannot_drive_or_fool_a_terminal(raw: str) -> None:
    shown = escape_text(raw)
    assert all(ch.isprintable() and ch.isascii() for ch in shown), shown
    assert escape_text(shown) == shown  # applying it again changes nothing


def test_shown_text_keeps_what_is_harmless() -> None:
    assert escape_text("/opt/café/agent bin") == "/opt/café/agent bin"


def test_the_command_is_shown_escaped_with_its_constructs_marked() -> None:
    command = "echo é;\x1b[31m x".encode()
    shown, marks = escape_command_marked(command, [7, 8])
    assert shown == "echo \\u00e9;\\x1b[31m x"
    assert [shown[a:b] for a, b in marks] == [";", "\\x1b"]


def test_a_command_that_begins_with_a_dash_is_the_shells_own_option() -> None:
    """sshd runs `$SHELL -c COMMAND`: a command string that begins with `-` is read by
    the shell as one of its own options (`bash -c -x`), not as a program to run, so no
    argv can be claimed for it. After a blank it is a command name again."""
    reading = read_command("-oProxyCommand=touch x")
    assert reading.argv is None
    assert (reading.constructs[0].offset, reading.constructs[0].text) == (0, "-")
    assert read_command(" -V").argv == ("-V",)
