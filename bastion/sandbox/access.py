"""What a run can read and write: the doors, the hidden, and the layout they are read from.

`per_run` turns these into bwrap's arguments; this module only decides. A **door** is a
path where a run's writes reach the disk (its project, each `--rw`); `door_refusal`
says why a path cannot be one. What a run must not read is one table, `HIDDEN`, with
the reason for each row; `--expose` gives one back. `Given` is what a run was given
beyond the defaults, named on its registration, its cards and `bastion status`.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from bastion.sandbox import layer as layer_mod


@dataclass(frozen=True)
class Hidden:
    """One row of what a run must not read: `where` is `~/PATH` (in the user's home),
    an absolute path, or `$NAME` (a path the layout reads from the environment)."""

    where: str
    why: str


_BROWSER = "a browser profile: its cookies (the console's among them) and saved passwords"


_CLOUD = "a cloud CLI's credentials"
# What a run must not read, one reason a row (docs/sandbox.md shows the table; tests
# try rows from inside a run). `--expose PATH` gives a row (or a path inside one) back.


HIDDEN: tuple[Hidden, ...] = (
    Hidden("$BASTION_HOME", "bastion's home: the vault, journal, policies, host key and "
           "operator socket (the agent socket's directory comes back, read-only)"),
    Hidden("$XDG_RUNTIME_DIR", "the session's deputies: its bus and keyring, systemd --user, "
           "the ssh-agent and Wayland sockets"),
    Hidden("$SSH_AUTH_SOCK", "your ssh-agent: it signs with your keys"),
    Hidden("$TMUX", "your tmux server: send-keys types into your panes"),
    Hidden("$TMUX_TMPDIR", "your tmux servers' sockets"),
    Hidden("$SCREENDIR", "your screen sessions' sockets"),
    Hidden("~/.screen", "your screen sessions' sockets"),
    Hidden("~/.ssh", "your ssh private keys (the directory's other files -- config, "
           "known_hosts, *.pub -- come back, read-only)"),
    Hidden("~/.gnupg", "your OpenPGP private keys and gpg-agent"),
    Hidden("~/.pki", "the NSS database: client certificates and their keys"),
    Hidden("~/.config/chromium", _BROWSER),
    Hidden("~/.config/google-chrome", _BROWSER),
    Hidden("~/.config/google-chrome-beta", _BROWSER),
    Hidden("~/.config/google-chrome-unstable", _BROWSER),
    Hidden("~/.config/BraveSoftware", _BROWSER),
    Hidden("~/.config/microsoft-edge", _BROWSER),
    Hidden("~/.config/microsoft-edge-beta", _BROWSER),
    Hidden("~/.config/microsoft-edge-dev", _BROWSER),
    Hidden("~/.config/vivaldi", _BROWSER),
    Hidden("~/.config/opera", _BROWSER),
    Hidden("~/.mozilla", _BROWSER),
    Hidden("~/.librewolf", _BROWSER),
    Hidden("~/snap/firefox", _BROWSER),
    Hidden("~/snap/chromium", _BROWSER),
    Hidden("~/.var/app/org.mozilla.firefox", _BROWSER),
    Hidden("~/.var/app/org.chromium.Chromium", _BROWSER),
    Hidden("~/.var/app/com.google.Chrome", _BROWSER),
    Hidden("~/.var/app/com.brave.Browser", _BROWSER),
    Hidden("~/.var/app/com.microsoft.Edge", _BROWSER),
    Hidden("~/.password-store", "pass's password store"),
    Hidden("~/.local/share/keyrings", "the GNOME keyring's files"),
    Hidden("~/.local/share/kwalletd", "KWallet's files"),
    Hidden("~/.config/Bitwarden", "Bitwarden's vault"),
    Hidden("~/.config/Bitwarden CLI", "Bitwarden's vault"),
    Hidden("~/.config/1Password", "1Password's vault"),
    Hidden("~/.aws", _CLOUD),
    Hidden("~/.config/gcloud", _CLOUD),
    Hidden("~/.azure", _CLOUD),
    Hidden("~/.oci", _CLOUD),
    Hidden("~/.config/doctl", _CLOUD),
    Hidden("~/.config/hcloud", _CLOUD),
    Hidden("~/.config/openstack", _CLOUD),
    Hidden("~/.terraform.d/credentials.tfrc.json", "Terraform's API tokens"),
    Hidden("~/.vault-token", "a Vault or OpenBao token"),
    Hidden("~/.docker", "container registries' credentials (docker)"),
    Hidden("~/.config/containers/auth.json", "container registries' credentials (podman)"),
    Hidden("~/.kube", "kubernetes clusters' credentials"),
    Hidden("~/.git-credentials", "git's stored credentials"),
    Hidden("~/.config/git/credentials", "git's stored credentials"),
    Hidden("~/.config/gh", "GitHub CLI's token"),
    Hidden("~/.config/glab-cli", "GitLab CLI's token"),
    Hidden("~/.netrc", "logins for ftp, curl, git and pip"),
    Hidden("~/.npmrc", "npm's registry tokens"),
    Hidden("~/.pypirc", "PyPI upload tokens"),
    Hidden("~/.cargo/credentials", "crates.io tokens"),
    Hidden("~/.cargo/credentials.toml", "crates.io tokens"),
    Hidden("~/.gem/credentials", "RubyGems tokens"),
    Hidden("$KEPT_HOMES", "the homes other runs kept (`--keep-home`)"),
    # Deputies of the whole machine: they act for whoever may reach them (for root, the
    # system bus and systemd run anything), and no agent needs them to do its work.
    Hidden("/run/dbus/system_bus_socket", "the system bus"),
    Hidden("/run/systemd/private", "systemd's private socket"),
    Hidden("/run/systemd/io.system.ManagedOOM", "systemd-oomd's socket"),
    Hidden("/var/spool/cron", "cron's spool: a job runs outside the run"),
    Hidden("/var/spool/at", "at's spool: a job runs outside the run"),
    Hidden("/var/spool/atjobs", "at's spool: a job runs outside the run"),
    Hidden("/run/screen", "screen sessions' sockets"),
    Hidden("/run/docker.sock", "docker: whoever reaches it is root"),
    Hidden("/run/containerd", "containerd: whoever reaches it is root"),
    Hidden("/run/podman", "podman's service: whoever reaches it is root"),
    Hidden("/run/libvirt", "libvirt: whoever reaches it is root"),
    Hidden("/run/snapd.socket", "snapd: whoever reaches it is root"),
    Hidden("/run/snapd-snap.socket", "snapd: whoever reaches it is root"),
)  # fmt: skip


SYSTEM_DEPUTIES = tuple(h.where for h in HIDDEN if h.where.startswith("/"))
# What the operator runs later, so no door (the project, a `--rw`) may hold it: the
# shell's start-up files, what a session starts by itself, bastion itself. The overlay
# keeps every one of them from the disk; a door would give them back.


PERSISTENT = (
    ".bashrc",
    ".bash_profile",
    ".bash_login",
    ".bash_logout",
    ".bash_aliases",
    ".profile",
    ".zshrc",
    ".zshenv",
    ".zprofile",
    ".zlogin",
    ".kshrc",
    ".mkshrc",
    ".inputrc",
    ".tmux.conf",
    ".screenrc",
    ".gitconfig",
    ".ssh",
    ".config",
    ".local",
)
# What git runs code from in a repository (hooks, fsmonitor, filters, aliases,
# core.sshCommand ...): read-only in every door unless `--rw-git`.


GIT_CODE = ("config", "config.worktree", "hooks", "info", "modules", "worktrees")


PRIVATE_KEY_MARKS = (b"PRIVATE KEY", b"SSH2 ENCRYPTED PRIVATE KEY", b"PuTTY-User-Key-File")


@dataclass(frozen=True)
class Given:
    """What a run was given beyond the defaults: its registration, its cards and
    `bastion status` name each."""

    hide: tuple[Path, ...] = ()
    ro: tuple[Path, ...] = ()
    private_home: bool = False
    rw: tuple[Path, ...] = ()
    expose: tuple[Path, ...] = ()
    rw_git: bool = False
    share_net: bool = False
    keep_home: bool = False

    def words(self) -> list[str]:
        out = [f"--rw {p}" for p in self.rw] + [f"--expose {p}" for p in self.expose]
        out += [f"--hide {p}" for p in self.hide] + [f"--ro {p}" for p in self.ro]
        flags = (
            ("--private-home", self.private_home),
            ("--keep-home", self.keep_home),
            ("--rw-git", self.rw_git),
            ("--share-net", self.share_net),
        )
        return out + [word for word, on in flags if on]


@dataclass(frozen=True)
class Layout:
    """Where things are for the user whose agent runs: read once, from the outside."""

    bastion_home: Path
    agent_dir: Path  # the agent socket's directory: bound back, read-only
    home: Path  # the user's HOME
    runtime_dir: Path | None  # $XDG_RUNTIME_DIR (or /run/user/UID)
    cwd: Path
    extra_hidden: tuple[Path, ...] = field(default=())  # SSH_AUTH_SOCK, TMUX_TMPDIR, ...
    read_only: tuple[Path, ...] = field(default=())  # bastion itself (see `installation`)
    project: Path | None = None  # the door: see `project_of`
    overlay: bool = True  # the home is an overlay (False: an isolated agent's /tmp home)
    kept: Path | None = None  # `--keep-home`: the label's upper layer (layer.kept_home)


def layout_of(bastion_home: Path, agent_socket: Path, env: Mapping[str, str]) -> Layout:
    """The layout for this process's user, from its environment (the project is set
    by `with_project`, once what the run was given is known)."""
    home = Path(env.get("HOME") or os.path.expanduser("~"))
    runtime = env.get("XDG_RUNTIME_DIR") or f"/run/user/{os.getuid()}"
    extra = []
    for name in ("SSH_AUTH_SOCK", "TMUX_TMPDIR", "SCREENDIR"):
        if env.get(name):
            extra.append(Path(env[name]))
    if env.get("TMUX"):  # "socket,pid,session": a server started with -S lives anywhere
        extra.append(Path(env["TMUX"].split(",")[0]))
    return Layout(
        bastion_home=bastion_home.absolute(),
        agent_dir=agent_socket.absolute().parent,
        home=home,
        runtime_dir=Path(runtime),
        cwd=Path.cwd(),
        extra_hidden=tuple(extra),
        read_only=installation(),
    )


def installation() -> tuple[Path, ...]:
    """bastion as the operator runs it: its package (for a checkout installed in
    place, the checkout), the Python environment it runs in and its `bastion`
    command. A run that could rewrite them would rewrite the next `bastion approve`:
    no door may hold them, and they are bound read-only after `/tmp` is made the
    run's own, so they stay there for a run wherever they live (under /tmp too)."""
    import sys

    import bastion

    package = Path(bastion.__file__).resolve().parent
    checkout = package.parent
    if (checkout / "pyproject.toml").is_file() and (checkout / ".git").exists():
        package = checkout
    found = [package, Path(sys.prefix).resolve()]
    command = shutil.which("bastion")
    if command:
        found.append(Path(command).resolve())
        found.append(Path(command).absolute())  # a pipx-style link, and what it links to
    return tuple(dict.fromkeys(found))


def hidden_paths(layout: Layout, env: Mapping[str, str] | None = None) -> list[tuple[Path, str]]:
    """HIDDEN's rows as this user's paths (a `$NAME` the environment does not set, or a
    path that does not exist, hides nothing: a name made in the run lands in its own
    overlay or is refused by the read-only system)."""
    named = {
        "$BASTION_HOME": [layout.bastion_home],
        "$XDG_RUNTIME_DIR": [layout.runtime_dir] if layout.runtime_dir else [],
        "$KEPT_HOMES": [layer_mod.kept_root(os.geteuid())],
    }
    extra = list(layout.extra_hidden)
    out: list[tuple[Path, str]] = []
    for row in HIDDEN:
        if row.where.startswith("~/"):
            paths = [layout.home / row.where[2:]]
        elif row.where.startswith("/"):
            paths = [Path(row.where)]
        elif row.where in named:
            paths = named[row.where]
        else:  # SSH_AUTH_SOCK, TMUX, TMUX_TMPDIR, SCREENDIR: read into extra_hidden
            paths, extra = extra[:1], extra[1:]
            paths = paths if env is None or env.get(row.where[1:]) or paths else []
        out += [(p, row.why) for p in paths]
    out += [(p, "named by the environment") for p in extra]
    return out


def is_private_key(path: Path) -> bool:
    """A file in ~/.ssh that holds a private key (unreadable counts as one: closed)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return True
    return any(mark in head for mark in PRIVATE_KEY_MARKS)


def project_of(cwd: Path) -> Path:
    """The project a run works on: the git work tree the working directory is in (so
    that `git commit` from a subdirectory reaches the repository), else the directory."""
    for d in (cwd, *cwd.parents):
        if (d / ".git").exists():
            return d
    return cwd


def door_refusal(door: Path, layout: Layout) -> str | None:
    """Why `door` cannot be given to a run read-write (None: it can). A door is the disk
    itself, so it may not be or hold what a run must not change: the bastion home,
    bastion's installation, the home, a start-up file; nor lie in what is hidden."""
    real = Path(os.path.realpath(door))
    home = Path(os.path.realpath(layout.home))
    if real == Path("/") or home.is_relative_to(real):
        return f"{door} holds your home directory"
    keep = [Path(os.path.realpath(layout.bastion_home))]
    keep += [Path(os.path.realpath(p)) for p in layout.read_only]
    keep += [home / p for p in PERSISTENT]
    for p in keep:
        if p.is_relative_to(real) or real.is_relative_to(p):
            what = "bastion's installation" if p in layout.read_only else "what you run later"
            if p == keep[0]:
                what = "the bastion home"
            return f"{door} {'holds' if p.is_relative_to(real) else 'is in'} {p} ({what})"
    for p, why in hidden_paths(layout):
        hp = Path(os.path.realpath(p))
        if real.is_relative_to(hp):
            return f"{door} is in {p}, which a run must not read ({why})"
    return None


def check_given(given: Given, layout: Layout | None = None) -> None:
    """Refuse paths that do not exist (a typo must widen or narrow nothing), a `--rw`
    that would give a run what it must not change, an `--expose` of what is not hidden."""
    for p in (*given.hide, *given.ro, *given.rw, *given.expose):
        if not p.is_absolute():
            raise ValueError(f"{p}: give an absolute path")
        if not os.path.lexists(p):
            raise ValueError(f"{p} does not exist")
    if layout is None:
        return
    for p in given.rw:
        why = door_refusal(p, layout)
        if why is not None:
            raise ValueError(f"--rw {p}: {why}; give a directory of the project instead")
    rows = [Path(os.path.realpath(h)) for h, _ in hidden_paths(layout)]
    for p in given.expose:
        real = Path(os.path.realpath(p))
        if not any(real.is_relative_to(h) or h.is_relative_to(real) for h in rows):
            raise ValueError(f"--expose {p}: nothing there is hidden from a run")


NOTHING_GIVEN = Given()  # a run given nothing beyond the defaults

# Names in a repository's git directory that would move git's configuration elsewhere if
# a run created them (`commondir` names the directory whose `config` git then reads);
# they cannot be bound read-only before they exist, so `git_after_run` deals with them.
GIT_REDIRECTS = ("commondir",)


def git_before_run(door: Path) -> dict[str, bool]:
    """What `git_after_run` compares with: whether the door has a git directory, and
    which of GIT_REDIRECTS it holds."""
    dot = door / ".git"
    found = {".git": dot.is_dir() and not dot.is_symlink()}
    for name in GIT_REDIRECTS:
        found[name] = os.path.lexists(dot / name)
    return found


def git_after_run(door: Path, before: dict[str, bool], run_id: str) -> list[str]:
    """After the run: a redirect it created in the door's git directory is moved aside
    (the repository as the operator left it), and a git directory it made where there was
    none is named (its config and hooks are the run's). One sentence each, for the
    operator."""
    dot = door / ".git"
    said: list[str] = []
    if not before.get(".git") and dot.is_dir() and not dot.is_symlink():
        said.append(
            f"the run made a git repository at {dot}: its config and hooks are the run's "
            "(git runs code from them); read them before you run git there"
        )
        return said
    for name in GIT_REDIRECTS:
        p = dot / name
        if not before.get(name) and os.path.lexists(p):
            aside = p.with_name(f"{name}.made-by-{run_id}")
            try:
                os.rename(p, aside)
                said.append(f"the run made {p} (it would move git's config): moved to {aside}")
            except OSError as exc:
                said.append(f"the run made {p} (it would move git's config); remove it ({exc})")
    return said
