"""Whatever the reader reads as an argv, every POSIX shell runs as exactly that argv.

`core/command.read_command` claims that a plain command means the same argv
in sh, bash, dash, zsh, ksh, mksh and busybox sh. This asks each shell that is
installed: every command of the bypass corpus (innocent and attack) and a
set of quoting edge cases is run with `SHELL -c COMMAND`, with PATH holding
only a program, named like the claimed argv[0], that prints the argv it got.
A shell that expands a word the reader took literally (zsh's `''=touch`),
or runs another program (zsh's `'-' touch`), prints something else or
nothing. Commands whose program is a harmless builtin (echo, printf, ...)
never reach the printer and are left to the corpus runs through sshd.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from bastion.core.command import read_command

CORPUS: list[dict[str, Any]] = tomllib.loads(
    (Path(__file__).resolve().parents[1] / "data" / "bypass_corpus.toml").read_text()
)["entry"]
SHELLS = {
    "sh": ["sh", "-c"],
    "bash": ["bash", "-c"],
    "dash": ["dash", "-c"],
    "zsh": ["zsh", "-c"],
    "ksh": ["ksh", "-c"],
    "mksh": ["mksh", "-c"],
    "busybox": ["busybox", "sh", "-c"],
}
# Builtins that run nothing else and take their words as given: the printer never runs.
HARMLESS_BUILTINS = frozenset({"echo", "printf", "true", "false", "test", "[", "pwd", "kill"})
EDGES = [
    "pa a 'b c' \"d  e\" --x=1 '' 'f;g'",
    "  pa   -h  ",
    "pa\thello",
    "p''a x",
    '"pa" x',
    "p'a' x",
    "pa --color=never a=b",
    "pa ''=ls",
    'pa ""=ls',
    "pa ''\"\"=ls",
    "pa '='x \"=\"y",
    "pa a''=b x==y",
    "pa '~'root ''~root",
    "pa 'a''b' 'a'\"b\"",
    "pa '-' -- -",
    "'-' pa x",
    "''- pa x",
    "'noglob' pa x",
    "pa 'a;b|c&d>e<f(g)h*i?j[k]l{m}n~o#p' \"%s,%d\"",
    "pa 'it''s' \"x'y\" 'x\"y'",
]


def commands(marker: Path) -> list[str]:
    out = [*EDGES]
    for entry in CORPUS:
        out += [entry["innocent"], entry["attack"].replace("{marker}", str(marker))]
    return list(dict.fromkeys(out))


def printer(directory: Path, name: str) -> None:
    path = directory / name
    path.write_text(f"#!{sys.executable} -IS\nimport json, sys\nprint(json.dumps(sys.argv))\n")
    path.chmod(0o755)


@pytest.mark.parametrize("shell", sorted(SHELLS))
def test_the_argv_the_reader_claims_is_the_argv_each_shell_runs(shell: str, tmp_path: Path) -> None:
    argv0 = shutil.which(SHELLS[shell][0])
    if argv0 is None:
        pytest.skip(f"{shell} is not installed")
    runner = [argv0, *SHELLS[shell][1:]]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    marker = tmp_path / "marker"
    judged, disagree = 0, []
    for command in commands(marker):
        argv = read_command(command).argv
        if argv is None or argv[0] in HARMLESS_BUILTINS or "/" in argv[0] or not argv[0]:
            continue
        printer(bin_dir, argv[0])
        ran = subprocess.run(
            [*runner, command],
            env={"PATH": str(bin_dir), "HOME": str(tmp_path), "LC_ALL": "C"},
            cwd=tmp_path,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=30,
        )
        want = [str(bin_dir / argv[0]), *argv[1:]]
        try:
            got = json.loads(ran.stdout)
        except ValueError:
            got = (ran.stdout + ran.stderr).decode(errors="replace").strip()
        if got != want:
            disagree.append((command, list(argv), got))
        judged += 1
    assert judged >= 20  # the check is not vacuous
    assert disagree == [], f"{shell} runs another argv than the reader read: {disagree}"
    assert not marker.exists()
