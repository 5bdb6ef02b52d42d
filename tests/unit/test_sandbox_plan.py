"""The sandbox's plan: what bwrap is told to hide, bind and drop, and when it refuses.

The attacks from inside a real sandbox are in tests/integration/test_sandbox_attacks.py;
these check the construction, fast, on a fake home laid out in tmp_path."""

from __future__ import annotations

from pathlib import Path

import pytest

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
    project = home / "project"
    return Layout(bh, bh / "run", home, runtime, project, project=project)


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
    assert _binds(argv, "--bind") == [(str(layout.cwd), str(layout.cwd))]
    assert Given(private_home=True).words() == ["--private-home"]


def test_root_keeps_only_what_ssh_needs_and_no_user_namespace(layout: Layout) -> None:
    argv = sandbox.plan(layout, root=True)
    assert "--unshare-user" not in argv and "--unshare-pid" in argv
    assert _pairs(argv, "--cap-add") == ["CAP_SETGID"]  # never CAP_SETUID: no other user
    assert "--uid" not in argv


def test_the_system_is_read_only_and_the_home_is_the_layers_overlay(layout: Layout) -> None:
    """`--ro-bind / /` first, for every user; then the home (the overlay the layer
    mounted) and the project, writable; the user is mapped back from the layer's root."""
    import os

    argv = sandbox.plan(layout)
    assert _binds(argv, "--ro-bind")[0] == ("/", "/")
    binds = _binds(argv, "--bind")
    assert binds[:2] == [(str(layout.home),) * 2, (str(layout.project),) * 2]
    assert _pairs(argv, "--uid") == [str(os.geteuid())]
    layer = sandbox.the_layer(layout, Given(), root=False)
    assert layer.home == layout.home.resolve() and layer.own_net
    assert layout.project.resolve() in layer.real and layout.agent_dir.resolve() not in layer.real
    assert sandbox.the_layer(layout, Given(private_home=True), root=False).home is None
    assert not sandbox.the_layer(layout, Given(share_net=True), root=False).own_net


def test_what_git_runs_code_from_stays_read_only_in_the_project(layout: Layout) -> None:
    git = layout.project / ".git"
    git.mkdir()
    (git / "config").write_text("[core]\n")
    argv = sandbox.plan(layout)
    ro = {dest for _, dest in _binds(argv, "--ro-bind")}
    assert {str(git / "config"), str(git / "hooks"), str(git / "info")} <= ro
    assert (git / "hooks").is_dir()  # made empty, so that the run cannot make it
    argv = sandbox.plan(layout, Given(rw_git=True))
    assert str(git / "config") not in {dest for _, dest in _binds(argv, "--ro-bind")}
    assert Given(rw_git=True).words() == ["--rw-git"]


def test_a_door_may_not_hold_what_a_run_must_not_change(layout: Layout) -> None:
    """The disk itself is what a door gives: never the home, the bastion home or a
    directory above it, bastion's installation, a start-up file, or a hidden path."""
    import dataclasses

    assert sandbox.door_refusal(layout.project, layout) is None
    (layout.home / ".config" / "chromium").mkdir(parents=True)
    (layout.home / ".aws" / "sso").mkdir(parents=True)
    refused = {
        layout.home: "holds your home directory",
        layout.home.parent: "holds your home directory",
        layout.home / ".config": "what you run later",
        layout.home / ".config" / "chromium" / "Default": "what you run later",
        layout.home / ".aws" / "sso": "must not read",
    }
    for door, words in refused.items():
        why = sandbox.door_refusal(door, layout)
        assert why is not None and words in why, (door, why)
    inside = dataclasses.replace(layout, bastion_home=layout.home / "data" / "bastion")
    (layout.home / "data" / "bastion").mkdir(parents=True)
    assert "the bastion home" in (sandbox.door_refusal(layout.home / "data", inside) or "")
    venv = layout.project / ".venv"
    venv.mkdir()
    with_venv = dataclasses.replace(layout, read_only=(venv,))
    assert "bastion's installation" in (sandbox.door_refusal(layout.project, with_venv) or "")
    with pytest.raises(ValueError, match="--rw"):
        sandbox.check_given(Given(rw=(layout.home / ".config",)), layout)


def test_the_project_is_the_git_work_tree_the_run_starts_in(tmp_path: Path) -> None:
    (tmp_path / "repo" / ".git").mkdir(parents=True)
    (tmp_path / "repo" / "src" / "deep").mkdir(parents=True)
    assert sandbox.project_of(tmp_path / "repo" / "src" / "deep") == tmp_path / "repo"
    assert sandbox.project_of(tmp_path) == tmp_path


def test_what_a_run_must_not_read_is_one_table_with_a_reason_a_row(layout: Layout) -> None:
    profile = layout.home / ".config" / "chromium"
    profile.mkdir(parents=True)
    (layout.home / ".aws").mkdir()
    (layout.home / ".netrc").write_text("machine x login y password z\n")
    argv = sandbox.plan(layout)
    tmpfs = _pairs(argv, "--tmpfs")
    assert str(profile) in tmpfs and str(layout.home / ".aws") in tmpfs
    assert ("/dev/null", str(layout.home / ".netrc")) in _binds(argv, "--ro-bind")
    assert all(row.why for row in sandbox.HIDDEN)
    assert len({row.where for row in sandbox.HIDDEN}) == len(sandbox.HIDDEN)
    # --expose gives one back, read-only, and is named; a path nothing hides is refused.
    given = Given(expose=(layout.home / ".aws",))
    argv = sandbox.plan(layout, given)
    assert str(layout.home / ".aws") not in _pairs(argv, "--tmpfs")
    assert given.words() == [f"--expose {layout.home / '.aws'}"]
    sandbox.check_given(given, layout)
    with pytest.raises(ValueError, match="nothing there is hidden"):
        sandbox.check_given(Given(expose=(layout.project,)), layout)


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
    assert r.exit_code == 1 and "at most 190 characters" in r.output


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
