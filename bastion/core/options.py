"""Options that make a program run another program, or act beyond the target.

A rule admits an option only by spelling it, or with a pattern that itself
begins with `-` (core/command.py). Spelling one of these is then the rule
author's explicit choice, and `bastion check-command` warns about it, so that
`"find /var/log -* ..."` or `"tar -I *"` is not written by accident. tar also
takes its first word as options without a dash (`tar xIf PROG a.tar` runs
PROG), which no glob rule can tell from a file name: a glob there is warned
about too. The list is short on purpose: the well-known ones, not a catalogue.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from dataclasses import dataclass
from types import MappingProxyType

from bastion.core.command import WordRule, is_option


@dataclass(frozen=True)
class Risk:
    """What a program's risky options do, the options, and dashless first words
    (old-style bundles) that carry them."""

    what: str
    options: tuple[str, ...]
    bundles: tuple[str, ...] = ()


def _risk(what: str, options: str, bundles: str = "") -> Risk:
    return Risk(what, tuple(options.split()), tuple(bundles.split()))


_SSH_O = "-o -oProxyCommand -oLocalCommand"  # -o takes its value attached too
_VIA_SSH = "run a program (-o ProxyCommand=..., -o LocalCommand=..., -S PROGRAM)"
RISKY = MappingProxyType(
    {
        "find": _risk(
            "run a program, write or delete files",
            "-exec -execdir -ok -okdir -fprint -fprint0 -fprintf -fls -delete",
        ),
        "git": _risk(
            "run a program (core.sshCommand, aliases, hooks)",
            "-c --config-env --exec-path --upload-pack --receive-pack",
        ),
        "tar": _risk(
            "run a program",
            "--to-command --checkpoint-action --use-compress-program -I -F --info-script "
            "--new-volume-script --rsh-command",
            "xIf cIf tIf xFf",
        ),
        "ssh": _risk("run a program (-o ProxyCommand=..., -o LocalCommand=...)", _SSH_O),
        "scp": _risk(_VIA_SSH, f"{_SSH_O} -S"),
        "sftp": _risk(_VIA_SSH, f"{_SSH_O} -S"),
        "rsync": _risk("run a program", "-e --rsh --rsync-path"),
        "systemctl": _risk("act on another host or container", "--host -H --machine -M"),
    }
)


def _spellings(option: str) -> tuple[str, ...]:
    """How the option can stand in one word: alone, with `=value`, or attached."""
    return (option, f"{option}=x", f"{option}x")


def _admits(rule: WordRule, option: str) -> bool:
    """Only a rule word that is itself an option matches an option (core/command.py)."""
    return any(
        is_option(w) and any(fnmatch.fnmatchcase(s, w) for s in _spellings(option))
        for w in rule.words[1:]
    )


def _leads(rule: WordRule, bundle: str) -> bool:
    """A dashless bundle is the program's first argument: does the rule admit it there?"""
    if len(rule.words) == 1:
        return rule.rest  # "..." covers every word that is not an option
    return fnmatch.fnmatchcase(bundle, rule.words[1])


def warnings(field: str, rules: Iterable[WordRule]) -> tuple[str, ...]:
    """One line per rule of `field` that admits a risky option of its program."""
    out: list[str] = []
    for rule in rules:
        program = rule.words[0].rsplit("/", 1)[-1]
        risk = RISKY.get(program)
        if risk is None:
            continue
        hits = [o for o in risk.options if _admits(rule, o)]
        hits += [
            f"old-style options without a dash ({b} PROGRAM)"
            for b in risk.bundles
            if _leads(rule, b)
        ][:1]
        if hits:
            out.append(
                f'{field} rule "{rule.text}" admits {", ".join(hits)}, with which '
                f"{program} can {risk.what}"
            )
    return tuple(out)
