"""The sandbox's plan: what bwrap is told to hide, bind and drop, and when it refuses.

The attacks from inside a real sandbox are in tests/integration/test_sandbox_attacks.py;
these check the construction, fast, on a fake home laid out in tmp_path."""

from __future__ import annotations

from pathlib import Path

import pytest

import bastion
from bastion.sandbox import Given, Layout
from bastion.sandbox import per_run as sandbox


def _pairs(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def _binds(argv: list[str], flag: str) -> list[tuple[str, str]]:
    return [(argv[i + 1], argv[i + 2]) for i, a in enumerate(argv) if a == flag]


@pytest.fixture
def layout(tmp_path: Path) -> Layout:
    home = tmp_path / "user"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_ed25519").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nxx\n")
    (home / ".ssh" / "id_ed25519.pub").write_text("ssh-ed25519 AAAA me\n")
    (home / ".ssh" / "config").write_text("Host *\n")
    (home / ".ssh" / "work_key").write_text("-----BEGIN RSA PRIVATE KEY-----\n")
    (home / ".gnupg").mkdir()
    (home / "project").mkdir()
    bh = tmp_path / "bastion"
    (bh / "run").mkdir(parents=True)
    (bh / "operator").mkdir()
    runtime = tmp_path / "xdg"
    runtime.mkdir()
    return Layout(bh, bh / "run", home, runtime, home / "project")


def test_the_defaults_hide_the_deputies_and_keep_the_one_door(layout: Layout) -> None:
    argv = sandbox.plan(layout)
    assert argv[-1] == "--"
    for flag in ("--unshare-user", "--unshare-pid", "--unshare-ipc", "--die-with-parent"):
        assert flag in argv
    assert "--new-session" in argv and _pairs(argv, "--cap-drop") == ["ALL"]
    assert "--cap-add" not in argv  # a user's run keeps no capability
    tmpfs = _pairs(argv, "--tmpfs")
    for hidden in (layout.bastion_home, layout.runtime_dir, layout.home / ".gnupg"):
        assert str(hidden) in tmpfs
    assert "/tmp" in tmpfs
    # The agent socket's directory comes back read-only, after the home that hides it.
    door = ("--ro-bind", str(layout.agent_dir), str(layout.agent_dir))
    at = next(i for i in range(len(argv)) if tuple(argv[i : i + 3]) == door)
    assert at > argv.index(str(layout.bastion_home))
    assert _pairs(argv, "--chdir") == [str(layout.cwd)]


def test_private_keys_stay_out_of_ssh_and_the_rest_comes_back_read_only(layout: Layout) -> None:
    argv = sandbox.plan(layout)
    ssh = layout.home / ".ssh"
    assert str(ssh) in _pairs(argv, "--tmpfs")
    back = {src for src, _ in _binds(argv, "--ro-bind")}
    assert str(ssh / "config") in back and str(ssh / "id_ed25519.pub") in back
    assert str(ssh / "id_ed25519") not in back and str(ssh / "work_key") not in back


def test_an_unreadable_file_counts_as_a_key(tmp_path: Path) -> None:
    assert sandbox.is_private_key(tmp_path / "missing")
    (tmp_path / "k").write_bytes(b"PuTTY-User-Key-File-3: ssh-ed25519\n")
    assert sandbox.is_private_key(tmp_path / "k")


def test_what_a_run_is_given_comes_after_the_defaults_and_is_worded(
    layout: Layout, tmp_path: Path
) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("x")
    given = Given(hide=(secret, layout.home / "project"), ro=(layout.home / ".gnupg",))
    argv = sandbox.plan(layout, given)
    assert (("/dev/null", str(secret))) in _binds(argv, "--ro-bind")
    assert str(layout.home / "project") in _pairs(argv, "--tmpfs")
    # --ro re-exposes a hidden path read-only: it comes after the tmpfs that hid it.
    gnupg = str(layout.home / ".gnupg")
    assert max(i for i, a in enumerate(argv) if a == gnupg) > argv.index(gnupg)
    assert given.words() == [
        f"--hide {secret}",
        f"--hide {layout.home / 'project'}",
        f"--ro {gnupg}",
    ]


def test_a_private_home_keeps_the_project_it_works_on(layout: Layout) -> None:
    argv = sandbox.plan(layout, Given(private_home=True))
    assert str(layout.home) in _pairs(argv, "--tmpfs")
    assert (str(layout.cwd), str(layout.cwd)) in _binds(argv, "--bind")
    assert Given(private_home=True).words() == ["--private-home"]


def test_root_keeps_only_what_ssh_needs_and_no_user_namespace(layout: Layout) -> None:
    argv = sandbox.plan(layout, root=True)
    assert "--unshare-user" not in argv and "--unshare-pid" in argv
    assert _pairs(argv, "--cap-add") == ["CAP_SETGID"]  # never CAP_SETUID: no other user
    assert ("/etc", "/etc") in _binds(argv, "--ro-bind")
    assert ("/etc", "/etc") not in _binds(sandbox.plan(layout), "--ro-bind")


def test_what_the_operator_runs_later_is_read_only(tmp_path: Path, layout: Layout) -> None:
    """Shell start-up files, autostart and bastion's own installation: bound read-only
    before anything is hidden (so what hides inside them still hides)."""
    (layout.home / ".bashrc").write_text("")
    env = {"HOME": str(layout.home), "TMUX": "/srv/op.sock,123,0"}
    real = sandbox.layout_of(layout.bastion_home, layout.agent_dir / "agent.sock", env)
    assert layout.home / ".bashrc" in real.read_only
    package = Path(bastion.__file__).resolve().parent  # bastion's package, or its checkout
    assert package in real.read_only or package.parent in real.read_only
    assert Path("/srv/op.sock") in real.extra_hidden  # the socket $TMUX names
    argv = sandbox.plan(real)
    bashrc = str(layout.home / ".bashrc")
    assert (bashrc, bashrc) in _binds(argv, "--ro-bind")
    assert argv.index(bashrc) < argv.index(str(layout.bastion_home))


def test_the_environment_loses_what_names_a_deputy() -> None:
    env = {"PATH": "/bin", "SSH_AUTH_SOCK": "/tmp/a", "TMUX": "x", "DISPLAY": ":0", "HOME": "/h"}
    assert sandbox.environment(env) == {"PATH": "/bin", "HOME": "/h"}


def test_a_path_given_must_exist_and_be_absolute(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        sandbox.check_given(Given(hide=(tmp_path / "nope",)))
    with pytest.raises(ValueError, match="absolute"):
        sandbox.check_given(Given(ro=(Path("relative"),)))


def test_a_missing_bwrap_says_what_to_install(tmp_path: Path) -> None:
    with pytest.raises(sandbox.Unavailable) as err:
        sandbox.find_bwrap(str(tmp_path))
    assert "apt install bubblewrap" in err.value.fix and "--no-sandbox" in err.value.fix


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("kernel.unprivileged_userns_clone", "unprivileged user namespaces are turned off"),
        ("user.max_user_namespaces", "user namespaces are turned off"),
        ("user.max_pid_namespaces", "PID namespaces are turned off"),
        ("kernel.apparmor_restrict_unprivileged_userns", "AppArmor restricts"),
    ],
)
def test_each_kernel_switch_is_named_with_its_fix(
    monkeypatch: pytest.MonkeyPatch, name: str, words: str
) -> None:
    off = "1" if "apparmor" in name else "0"
    monkeypatch.setattr(sandbox, "_sysctl", lambda n: off if n == name else None)
    told = sandbox.namespaces_off()
    assert told is not None and words in told.reason and name in told.reason
    assert "sysctl" in told.fix


def test_the_kernel_here_scopes_abstract_sockets_and_signals() -> None:
    """This machine (and CI's) has Landlock ABI >= 6; elsewhere the run says it has none."""
    abi = sandbox.landlock_abi()
    if abi < sandbox.LANDLOCK_SCOPES_ABI:
        pytest.skip(f"Landlock ABI {abi}: no scopes on this kernel")
    assert abi >= 6


def test_a_run_given_more_than_its_card_can_show_is_refused_before_anything(
    tmp_path: Path,
) -> None:
    from click.testing import CliRunner

    from bastion.cli.main import main

    deep = tmp_path / ("d" * 200)
    deep.mkdir()
    argv = ["--home", str(tmp_path / "home"), "run", "--ro", str(deep), "--", "true"]
    r = CliRunner().invoke(main, argv)
    assert r.exit_code == 1 and "at most 194 characters" in r.output


def test_the_door_must_not_bind_the_home_into_the_run(layout: Layout, tmp_path: Path) -> None:
    """The agent socket's directory comes back into the run whole: the home itself, a
    directory above it, or `operator/` would hand the run the vault and the operator
    socket, so `bastion run` refuses before anything starts."""
    import dataclasses

    sandbox.check_door(layout)  # the default: run/, alone
    sandbox.check_door(dataclasses.replace(layout, agent_dir=tmp_path / "elsewhere"))
    for door in (layout.bastion_home, layout.bastion_home / "operator", layout.bastion_home.parent):
        with pytest.raises(sandbox.Unavailable) as err:
            sandbox.check_door(dataclasses.replace(layout, agent_dir=door))
        assert "directory of its own" in err.value.fix


def test_the_environment_keeps_where_the_home_is() -> None:
    """BASTION_HOME names a path the run cannot see; `bastion mcp` inside a run needs it
    to find its agent socket."""
    assert sandbox.environment({"BASTION_HOME": "/h/b"}) == {"BASTION_HOME": "/h/b"}


def test_status_tries_the_sandbox_at_most_once_a_minute(monkeypatch: pytest.MonkeyPatch) -> None:
    tried: list[None] = []
    monkeypatch.setattr(sandbox, "_machine", None)
    monkeypatch.setattr(
        sandbox, "_try", lambda path: tried.append(None) or sandbox.Machine(None, 7)
    )
    for _ in range(5):
        assert sandbox.machine(cached=True).landlock == 7
    assert len(tried) == 1
    sandbox.machine()  # doctor and isolate check ask afresh
    assert len(tried) == 2


def test_the_runs_throwaway_agent_is_bound_read_only_after_the_private_tmp(
    layout: Layout, tmp_path: Path
) -> None:
    """Its directory comes into the run's own /tmp (so after the tmpfs that makes it),
    read-only, and nowhere without it."""
    outside, inside = tmp_path / "agent-dir", Path("/tmp/.bastion-ssh-agent")
    argv = sandbox.plan(layout, agent_auth=(outside, inside))
    assert _binds(argv, "--ro-bind")[-1] == (str(outside), str(inside))
    tmp = next(i for i in range(len(argv)) if argv[i : i + 2] == ["--tmpfs", "/tmp"])
    assert argv.index(str(outside)) > tmp
    assert str(outside) not in sandbox.plan(layout)
