"""What `cli/common.py` guarantees every command (issue 18): what it prints for a
person is escaped, and a secret is read only in a process closed to its own uid.

The second is kept by construction -- `--passphrase-stdin` exists only as
`common.passphrase_option`, and only `common`'s readers read a secret -- so these
tests check the construction; tests/integration/test_hardening.py checks the
processes themselves."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import click

from bastion.cli import common
from bastion.cli.main import main as cli_main
from tests.harness import subcommands

CLI = Path(common.__file__).parent
# Every way Python reads a secret from the operator: a prompt, the keyring, stdin.
SECRET_READ = re.compile(
    r"getpass\s*\(|get_password\s*\(|stdin(?:\.buffer)?\.read(?:line)?\s*\(|\binput\s*\("
)


def leaves(command: click.Command) -> Iterator[click.Command]:
    if isinstance(command, click.Group):
        for _, sub in subcommands(command):
            yield from leaves(sub)
    else:
        yield command


def test_only_common_reads_a_secret() -> None:
    for path in sorted(CLI.glob("*.py")):
        if path.name == "common.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            assert not SECRET_READ.search(line), f"{path.name}:{n}: {line.strip()}"


def test_every_passphrase_option_closes_the_process() -> None:
    declared = 0
    for command in leaves(cli_main):
        for param in command.params:
            if param.name == "passphrase_stdin":
                declared += 1
                assert param.callback is common._close_on_parse, command.name
    assert declared >= 12


def test_what_a_person_is_shown_is_escaped_line_by_line_with_tabs_kept() -> None:
    text = "k1\tssh-ed25519\tSHA256:x\nweb\u3164\x1b[2J\tend"
    assert common.shown(text) == "k1\tssh-ed25519\tSHA256:x\nweb\\u3164\\x1b[2J\tend"
