"""The systemd unit `bastion service install` writes, rendered from its inputs (no I/O).

`systemd-analyze verify` and a real systemd manager read the same text in
tests/integration/test_service_unit.py; here, what the text must say.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

import pytest

from bastion.ops import service_unit
from bastion.ops.service_unit import Mode, UnitError, UnitInputs, quote, render

PY = PurePosixPath("/opt/bastion/venv/bin/python3")
HOME = PurePosixPath("/home/alice/.local/share/bastion")


def unquote_words(line: str) -> list[str]:
    """systemd's reading of a command line (systemd.syntax(7)), as far as `quote` writes
    it: words split on spaces, double quotes with backslash escapes, then `%%` and
    `$$` each read as one character."""
    words: list[str] = []
    i = 0
    while i < len(line):
        if line[i] == " ":
            i += 1
            continue
        word = ""
        if line[i] == '"':
            i += 1
            while line[i] != '"':
                if line[i] == "\\":
                    i += 1
                word += line[i]
                i += 1
            i += 1
        else:
            while i < len(line) and line[i] != " ":
                word += line[i]
                i += 1
        words.append(word.replace("%%", "%").replace("$$", "$"))
    return words


def directives(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            out.setdefault(key, []).append(value)
    return out


def test_the_system_unit_runs_the_same_daemon_with_an_explicit_home() -> None:
    text = render(UnitInputs(PY, HOME, Mode.SYSTEM, run_as="alice", daemon_args=("--a", "1")))
    d = directives(text)
    assert d["ExecStart"] == [
        f"{PY} -P -m bastion.cli --home /home/alice/.local/share/bastion daemon --a 1"
    ]
    assert d["Type"] == ["notify"] and d["NotifyAccess"] == ["main"]
    assert d["WatchdogSec"] == ["30s"] and d["Restart"] == ["on-failure"]
    assert d["User"] == ["alice"]
    assert d["WantedBy"] == ["multi-user.target"] and d["After"] == ["network.target"]
    for directive in ("NoNewPrivileges", "PrivateTmp", "MemoryDenyWriteExecute"):
        assert d[directive] == ["yes"], directive
    assert d["ProtectSystem"] == ["full"]
    assert "ProtectHome" not in d and "ProtectProc" not in d and "PrivateUsers" not in d
    assert all(len(values) == 1 for values in d.values()), d  # nothing said twice
    assert "bastion unlock" in text.splitlines()[0]  # it starts locked, and says so


def test_a_user_unit_sets_only_what_needs_no_namespace() -> None:
    """In a per-user manager a namespace option implies PrivateUsers=, which would show
    every other uid as nobody: those options are left out, and the unit says so."""
    text = render(UnitInputs(PY, HOME, Mode.USER, run_as="ignored-in-user-mode"))
    d = directives(text)
    assert d["WantedBy"] == ["default.target"]
    assert "User" not in d and "After" not in d
    assert d["NoNewPrivileges"] == ["yes"] and d["MemoryDenyWriteExecute"] == ["yes"]
    for opt in service_unit.HARDENING:
        assert (opt.directive in d) is not opt.system_only, opt.directive
    left = text.split("# Left out, and why:")[1]
    assert "ProtectSystem" in left and "PrivateUsers=" in left


def test_a_root_owned_home_runs_as_root_and_a_home_in_tmp_keeps_its_tmp() -> None:
    d = directives(render(UnitInputs(PY, HOME, Mode.SYSTEM, run_as=None)))
    assert "User" not in d
    tmp_home = render(UnitInputs(PY, PurePosixPath("/tmp/x/home"), Mode.SYSTEM))
    assert "PrivateTmp" not in directives(tmp_home)
    assert "PrivateTmp=: the home or the interpreter lives under /tmp or /var/tmp" in tmp_home
    tmp_python = render(UnitInputs(PurePosixPath("/var/tmp/venv/bin/python"), HOME, Mode.SYSTEM))
    assert "PrivateTmp" not in directives(tmp_python)
    assert directives(render(UnitInputs(PY, PurePosixPath("/tmpfoo/h"), Mode.SYSTEM)))[
        "PrivateTmp"
    ] == ["yes"]


@pytest.mark.parametrize(
    ("word", "written"),
    [
        ("/usr/bin/python3", "/usr/bin/python3"),
        ("--home", "--home"),
        ("/home/a b/bastion", '"/home/a b/bastion"'),
        ('/srv/say "hi"', '"/srv/say \\"hi\\""'),
        ("/srv/back\\slash", '"/srv/back\\\\slash"'),
        ("/srv/100%", '"/srv/100%%"'),
        ("/srv/$HOME", '"/srv/$$HOME"'),
        ("/srv/it's", '"/srv/it\'s"'),
        ("/srv/ünï", '"/srv/ünï"'),
    ],
)
def test_words_are_quoted_the_systemd_way(word: str, written: str) -> None:
    assert quote(word) == written
    assert unquote_words(written) == [word]


def test_paths_with_spaces_and_specials_survive_the_exec_line() -> None:
    python = PurePosixPath("/opt/my venv/bin/python3")
    home = PurePosixPath('/home/al ice/100% $real "home"\\')
    inputs = UnitInputs(python, home, Mode.SYSTEM, daemon_args=("--wrapper", "my tool"))
    (line,) = directives(render(inputs))["ExecStart"]
    assert line.startswith('"/opt/my venv/bin/python3" -P -m bastion.cli --home "/home/al ice/')
    assert unquote_words(line) == list(service_unit.exec_argv(inputs))
    (description,) = directives(render(inputs))["Description"]
    assert "100%% $real" in description  # specifiers are expanded in Description= too


@pytest.mark.parametrize(
    "inputs",
    [
        UnitInputs(PurePosixPath("python3"), HOME, Mode.SYSTEM),
        UnitInputs(PY, PurePosixPath("relative/home"), Mode.SYSTEM),
        UnitInputs(PY, PurePosixPath("/home/a\nExecStartPre=/bin/evil"), Mode.SYSTEM),
        UnitInputs(PY, HOME, Mode.SYSTEM, daemon_args=("--wrapper", "x\ty")),
        UnitInputs(PY, HOME, Mode.SYSTEM, watchdog_sec=0),
    ],
)
def test_what_a_unit_cannot_say_is_refused(inputs: UnitInputs) -> None:
    with pytest.raises(UnitError):
        render(inputs)


def test_where_each_manager_looks() -> None:
    home = Path("/home/alice")
    assert service_unit.unit_path(Mode.SYSTEM, {}, home) == Path(
        "/etc/systemd/system/bastion.service"
    )
    assert service_unit.unit_path(Mode.USER, {}, home) == Path(
        "/home/alice/.config/systemd/user/bastion.service"
    )
    assert service_unit.unit_path(Mode.USER, {"XDG_CONFIG_HOME": "/cfg"}, home) == Path(
        "/cfg/systemd/user/bastion.service"
    )
    # the XDG spec ignores a relative value
    assert service_unit.unit_path(Mode.USER, {"XDG_CONFIG_HOME": "cfg"}, home) == Path(
        "/home/alice/.config/systemd/user/bastion.service"
    )


def test_the_enable_line() -> None:
    assert service_unit.enable_commands(Mode.USER) == (
        "systemctl --user daemon-reload && systemctl --user enable --now bastion"
    )
    assert service_unit.enable_commands(Mode.SYSTEM) == (
        "systemctl daemon-reload && systemctl enable --now bastion"
    )
