"""Builtins that run a word or a file as shell code are shell source (issue 32, item 3).

`trap 'touch A; touch B' EXIT` is three plain words, and bash runs the quoted one as
code at exit; before the fix the reader took it as an argv, so it ran on a
`shell = "deny"` account. `core/command.CODE_BUILTINS` is the table of such
builtins with the shells each runs code in. Here each shell that is installed
proves the table (every entry runs code, or is at least a builtin, where it says),
every builtin each shell lists is either in the table, a keyword the reader already
treats as shell source (`RESERVED`), or reviewed below as running nothing, and the
real ssh client against a real sshd shows the refusal, with a marker, beside a
control on an account where shell source runs.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from bastion.core.command import CODE_BUILTINS, RESERVED, RUNS_CODE, Runs, read_command
from bastion.devtools.sshd_fixture import SshdInfo
from tests.harness import Bastion, make_bastion
from tests.integration.test_option_rules import host

SHELLS = {
    "bash": ["bash", "-c"],
    "dash": ["dash", "-c"],
    "zsh": ["zsh", "-c"],
    "ksh": ["ksh", "-c"],
    "mksh": ["mksh", "-c"],
    "busybox sh": ["busybox", "sh", "-c"],
}
# Each entry's proof: a script (MARK, SCRIPT and DIR replaced) that makes MARK only if
# the builtin ran code. Per shell where the spelling differs; "*" for every shell.
RECIPES: dict[str, dict[str, str]] = {
    ".": {"*": ". SCRIPT"},
    "source": {"*": "source SCRIPT"},
    "eval": {"*": "eval 'touch MARK'"},
    "trap": {"*": "trap 'touch MARK' EXIT"},
    "alias": {
        "*": "alias x='touch MARK'\nx",
        "bash": "shopt -s expand_aliases\nalias x='touch MARK'\nx",
        "zsh": "alias x='touch MARK'\n. DIR/callx",  # zsh reads all of -c at once
    },
    "fc": {"bash": "set -o history\necho hi\nfc -e 'touch MARK;:'"},
    "emulate": {"zsh": "emulate sh -c 'touch MARK'"},
    "autoload": {"*": "FPATH=DIR\nautoload code\ncode"},
    "zregexparse": {"zsh": "zregexparse p v a /a/ '{touch MARK}'"},
    "mapfile": {"bash": "echo a | mapfile -C 'touch MARK' -c 1 x"},
    "readarray": {"bash": "echo a | readarray -C 'touch MARK' -c 1 x"},
    "compgen": {"bash": "compgen -C 'touch MARK' x"},
    "declare": {"bash": "declare -a 'x=(<(touch MARK))'"},
    "typeset": {"bash": "typeset -a 'x=(<(touch MARK))'"},
    "local": {"bash": "f() { local -a 'x=(<(touch MARK))'; }\nf"},
    "export": {"bash": "export -a 'x=(<(touch MARK))'"},
    "readonly": {"bash": "readonly -a 'x=(<(touch MARK))'"},
    "zstyle": {"zsh": "zstyle -e :x y 'touch MARK'\nzstyle -s :x y v"},
}
# Entries that run code now or later but have no `-c` proof here, and why: they are
# held to being a builtin (or an alias) of the shells they name.
UNPROVEN = {
    "fc": "history exists only in an interactive zsh, ksh or mksh",
    "hist": "history exists only in an interactive ksh",
    "r": "history exists only in an interactive shell",
    "zmodload": "a compiled module, not a script",
    "enable": "-f needs a compiled builtin",
}
# Builtins the shells list that run none of their words, nor a file, as shell code.
REVIEWED = {
    **dict.fromkeys(
        [
            ":",
            "[",
            "[[",
            "true",
            "false",
            "echo",
            "printf",
            "print",
            "test",
            "pwd",
            "type",
            "whence",
            "where",
            "which",
            "help",
            "times",
            "caller",
            "jobs",
            "dirs",
            "echotc",
            "echoti",
            "zformat",
            "zparseopts",
            "log",
            "ttyctl",
        ],
        "prints, tests or reports, and runs nothing",
    ),
    **dict.fromkeys(
        [
            "cd",
            "chdir",
            "pushd",
            "popd",
            "pushln",
            "umask",
            "ulimit",
            "limit",
            "unlimit",
            "kill",
            "wait",
            "bg",
            "fg",
            "disown",
            "suspend",
            "stop",
            "sleep",
            "exit",
            "bye",
            "logout",
            "return",
            "break",
            "continue",
            "shift",
        ],
        "acts as the program of that name does, or ends or moves the shell's flow",
    ),
    **dict.fromkeys(
        [
            "set",
            "setopt",
            "unsetopt",
            "shopt",
            "unset",
            "unalias",
            "unfunction",
            "unhash",
            "hash",
            "rehash",
            "disable",
            "getopts",
            "read",
            "getln",
            "vared",
            "let",
            "integer",
            "float",
            "private",
            "nameref",
            "compound",
            "enum",
            "global",
            "functions",
            "redirect",
            "compopt",
        ],
        "sets a variable, an option or a table entry: arithmetic and assignments over "
        "words with no $ or backquote run no command",
    ),
    **dict.fromkeys(
        ["history", "bindkey", "zcompile"],
        "records text that fc, r or an interactive line editor reads later as typed "
        "input, or compiles a file without running it",
    ),
    **dict.fromkeys(
        [
            "compadd",
            "comparguments",
            "compcall",
            "compdescribe",
            "compfiles",
            "compgroups",
            "compquote",
            "compset",
            "comptags",
            "comptry",
            "compvalues",
        ],
        "works only inside a completion widget, which only compctl, complete or zle set up",
    ),
    **dict.fromkeys(
        [
            "cat",
            "cp",
            "cut",
            "dirname",
            "basename",
            "getconf",
            "ln",
            "mktemp",
            "mv",
            "realpath",
            "rename",
            "mknod",
            "login",
            "nohup",
        ],
        "runs as the program of the same name, judged as its argv",
    ),
    **dict.fromkeys(
        ["run-help", "which-command"],
        "Debian's zsh aliases for man and whence",
    ),
}


def runner(shell: str) -> list[str] | None:
    argv0 = shutil.which(SHELLS[shell][0])
    return None if argv0 is None else [argv0, *SHELLS[shell][1:]]


def run_in(shell: str, script: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    argv = runner(shell)
    assert argv is not None
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp), "LC_ALL": "C"}
    return subprocess.run(
        [*argv, script],
        env=env,
        cwd=tmp,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=30,
    )


def knows(shell: str, name: str, tmp: Path) -> bool:
    """The shell has `name` as a builtin, or as one of its own aliases."""
    said = run_in(shell, f"command -V {name}", tmp).stdout
    return " builtin" in said or "an alias for" in said


def test_every_table_entry_runs_shell_code_in_the_shells_it_names(tmp_path: Path) -> None:
    proved, unproven, failed = 0, [], []
    for entry in CODE_BUILTINS:
        for shell in entry.shells:
            if runner(shell) is None:
                continue
            recipe = RECIPES.get(entry.name, {})
            script = recipe.get(shell, recipe.get("*"))
            where = tmp_path / f"{entry.name}-{shell}".replace(" ", "_").replace(".", "dot")
            where.mkdir()
            mark = where / "MARK"
            if script is None or entry.runs is Runs.EDITOR:
                assert knows(shell, entry.name, where), (entry.name, shell)
                unproven.append((entry.name, shell))
                continue
            (where / "code").write_text(f"touch {mark}\n")
            (where / "callx").write_text("x\n")
            text = script.replace("MARK", str(mark)).replace("SCRIPT", str(where / "code"))
            ran = run_in(shell, text.replace("DIR", str(where)), where)
            if not mark.exists():
                failed.append((entry.name, shell, ran.stdout, ran.stderr))
            proved += 1
    assert failed == [], "\n".join(map(repr, failed))
    assert proved >= 20  # not vacuous
    for name, _ in unproven:  # each gap has a reason, or is a line-editor entry
        assert name in UNPROVEN or RUNS_CODE[name].runs is Runs.EDITOR, name


def listed_builtins(shell: str, tmp: Path) -> set[str]:
    """The builtins (and predefined aliases) the shell says it has."""
    listing = {
        "bash": "compgen -b; compgen -a",
        "zsh": "print -l ${(k)builtins} ${(k)aliases}",
        "ksh": "builtin; alias | sed 's/=.*//'",
        "busybox sh": "help",
    }
    if shell in listing:
        out = run_in(shell, listing[shell], tmp).stdout
        names = {w for w in out.split() if "/" not in w}  # ksh's /opt/ast/bin/cat: the program
        if shell == "busybox sh":
            names = {w for w in names if not w.endswith(":") and w.strip("-")} - {"Built-in"}
        return names
    # dash and mksh list nothing: every name any shell has, asked one by one.
    candidates = set(REVIEWED) | set(RUNS_CODE) | set(RESERVED)
    for other in listing:
        if runner(other) is not None:
            candidates |= listed_builtins(other, tmp)
    return {n for n in candidates if n.isascii() and n.isprintable() and knows(shell, n, tmp)}


@pytest.mark.parametrize("shell", sorted(SHELLS))
def test_every_builtin_a_shell_has_is_in_the_table_or_reviewed(shell: str, tmp_path: Path) -> None:
    """A shell that grows a builtin that runs code fails here until it is classified."""
    if runner(shell) is None:
        pytest.skip(f"{shell} is not installed")
    names = listed_builtins(shell, tmp_path)
    assert len(names) >= 20, names  # the listing worked
    unclassified = sorted(names - set(RUNS_CODE) - set(RESERVED) - set(REVIEWED))
    assert unclassified == [], f"{shell}: classify these in core/command.py or REVIEWED"


def test_the_reader_reads_every_entry_as_shell_source_however_spelled() -> None:
    for entry in CODE_BUILTINS:
        for command in (f"{entry.name} x", f"'{entry.name}' x", f'  "{entry.name}" -x y'):
            reading = read_command(command)
            assert reading.argv is None, command
            assert reading.constructs[0].text == entry.name, command
            assert reading.constructs[0].what == entry.describe()
        assert read_command(f"echo {entry.name}").argv == ("echo", entry.name)


# -- over real ssh ---------------------------------------------------------------------


@pytest.fixture
def world(tmp_path: Path, sshd: SshdInfo, client_key: tuple[Path, str]) -> Iterator[Bastion]:
    """`plain`: a session account that runs plain commands only (`shell = "deny"`);
    `loose`: the same target, where shell source runs (the control)."""
    policy = host(sshd, "plain", approval="session", shell="deny") + host(
        sshd, "loose", approval="session", shell="allow"
    )
    b = make_bastion(tmp_path / "b", sshd, client_key[0], policy=policy)
    try:
        yield b
    finally:
        b.close()


def test_trap_and_dot_are_refused_where_only_plain_commands_run(
    world: Bastion, tmp_path: Path
) -> None:
    """Failed before the fix: `trap` and `.` read as argv, and both ran on `plain`."""
    b = world
    marks = [tmp_path / f"mark-{name}" for name in ("a", "b", "c")]
    script = tmp_path / "code.sh"
    script.write_text(f"touch {marks[2]}\n")
    attacks = {
        f"trap 'touch {marks[0]}; touch {marks[1]}' EXIT": "trap",
        f". {script}": ".",
        f"'source' {script}": "source",
    }
    agent = b.agent()
    rid = agent.start("true", host="plain")
    b.answer(b.next_card(), True)
    assert agent.wait(rid).rc == 0
    for attack, name in attacks.items():
        refused = agent.run(attack, host="plain")
        ran = (refused.rc, refused.code, [m.exists() for m in marks])
        assert ran == (77, "POLICY_DENIED", [False] * 3), (attack, ran, refused.stderr)
        message = refused.error["message"]  # type: ignore[index]
        assert RUNS_CODE[name].describe() in message, message
        assert "Send the program it would run" in message
        offline = b.check_command("plain", attack)
        assert (offline["verdict"], offline["code"]) == ("denied", "POLICY_DENIED")
        assert offline["reason"] == message
        assert offline["shell_syntax"][0]["what"] == RUNS_CODE[name].describe()
    # The control: where shell source runs, the same commands make the markers.
    loose = b.agent()
    rid = loose.start(next(iter(attacks)), host="loose")
    b.answer(b.next_card(), True)
    assert loose.wait(rid).rc == 0
    assert marks[0].exists() and marks[1].exists()
    assert loose.run(f". {script}", host="loose").rc == 0 and marks[2].exists()
