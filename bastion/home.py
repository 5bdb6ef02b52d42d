"""The layout of $BASTION_HOME, named in one place.

Everything secret or authoritative lives here with owner-only permissions:
the vault, the gateway's own SSH host key, the policies, the journal. Only
the agent socket is meant to be reached by agents, and it has a directory of
its own (`run/`, nothing else in it): a sandboxed run gets that directory
bound in read-only, so a gateway restart's new socket is seen inside, while
the operator socket and the gateway's records (`operator/`) stay out.

The gateway does not trust the path: it opens the home once at start (`Held`) and
names every file through that descriptor, so a rename of the home or of a directory
above it, or a directory rebuilt at its path, changes nothing it reads or writes;
`Held.moved` says when the path no longer leads there.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

PROC_FD = "/proc/self/fd"  # the kernel resolves /proc/self/fd/N to the open file itself


def default_home() -> Path:
    env = os.environ.get("BASTION_HOME")
    if env:
        return Path(env).expanduser().absolute()
    data = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local/share")
    return Path(data).absolute() / "bastion"


def moved_sentence(
    what: str, path: Path, held: tuple[int, int], found: tuple[int, int] | str, now_at: str
) -> str | None:
    """None while `path` still leads to the directory the gateway holds (its st_dev and
    st_ino are `held`); else the one sentence `status` and `doctor` say. `found` is what
    stat(path) gave now: (st_dev, st_ino), or why it failed; `now_at` is where the held
    directory is now, as the kernel names it."""
    if found == held:
        return None
    there = (
        f"nothing is at {path} ({found})"
        if isinstance(found, str)
        else f"{path} is another directory"
    )
    return (
        f"the {what} moved: {there}, and the directory this gateway opened there at start "
        f"is now at {now_at}; the gateway goes on using that directory and reads nothing at "
        f"{path}: put the {what} back at {path}, then restart the gateway"
    )


@dataclass(frozen=True)
class Held:
    """A directory held open by descriptor since the gateway started (O_DIRECTORY,
    close-on-exec: valid in the gateway and its forks, never in a program it runs).
    `root` names it through /proc/self/fd, which the kernel resolves to the directory
    itself wherever it is now; a unix socket binds through it as well (short enough
    for sun_path)."""

    path: Path  # where it was opened: what people are shown
    fd: int
    dev: int
    ino: int

    @classmethod
    def open(cls, path: Path) -> Held:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        st = os.fstat(fd)
        return cls(Path(path), fd, st.st_dev, st.st_ino)

    @property
    def root(self) -> Path:
        return Path(PROC_FD, str(self.fd))

    def under(self, path: Path) -> Path | None:
        """`path` named through the held directory, when it lies under `self.path`."""
        try:
            return self.root / Path(path).relative_to(self.path)
        except ValueError:
            return None

    def shown(self, text: str) -> str:
        """`text` with the held directory's /proc name replaced by the path it was opened at."""
        shown = str(self.path)
        return re.sub(re.escape(str(self.root)) + r"(?!\d)", lambda _: shown, text)

    def now_at(self) -> str:
        """Where the held directory is now (`/proc/self/fd/N`'s link; "... (deleted)")."""
        try:
            return os.readlink(self.root)
        except OSError as exc:
            return f"unknown ({exc.strerror})"

    def moved(self, what: str = "home") -> str | None:
        """None while `path` still leads to the held directory, else the sentence."""
        try:
            st = os.stat(self.path)
            found: tuple[int, int] | str = (st.st_dev, st.st_ino)
        except OSError as exc:
            found = exc.strerror or type(exc).__name__
        return moved_sentence(what, self.path, (self.dev, self.ino), found, self.now_at())


@dataclass(frozen=True)
class Home:
    """The home's files, named under `root`: the path given, or (the gateway's, `hold`)
    the directory held open at start, through /proc/self/fd."""

    root: Path
    held: Held | None = None

    def hold(self) -> Home:
        """This home named through a descriptor opened now (OSError if it cannot be)."""
        held = Held.open(self.root)
        return Home(held.root, held)

    @property
    def path(self) -> Path:
        """The home's path as given: what people are shown."""
        return self.held.path if self.held is not None else self.root

    def shown(self, text: str) -> str:
        """`text` as a person should read it: the held home named by its path."""
        return self.held.shown(text) if self.held is not None else text

    def here(self) -> Home:
        """This home named by the path its held directory has now, for what judges paths
        (isolation's file modes: what another user may reach); itself when not held."""
        if self.held is None:
            return self
        now = self.held.now_at()
        deleted = now.endswith(" (deleted)")
        return Home(Path(now)) if now.startswith("/") and not deleted else Home(self.path)

    def moved(self) -> str | None:
        """The sentence saying the home's path no longer leads to the held directory."""
        return self.held.moved() if self.held is not None else None

    @property
    def vault(self) -> Path:
        return self.root / "vault.json"

    @property
    def host_key(self) -> Path:
        """The gateway's own SSH host key, shown to agents' ssh clients. It
        lives outside the vault: a locked gateway must still be able to say
        'locked' over SSH."""
        return self.root / "gateway_host_key"

    @property
    def known_hosts(self) -> Path:
        """The one line agents' ssh trusts, used with HostKeyAlias."""
        return self.root / "known_hosts"

    @property
    def policies(self) -> Path:
        return self.root / "policies"

    @property
    def run(self) -> Path:
        return self.root / "run"

    @property
    def agent_socket(self) -> Path:
        return self.run / "agent.sock"

    @property
    def agent_known_hosts(self) -> Path:
        """A copy of `known_hosts` in the agents' directory (the gateway writes it at
        start): a sandboxed run, which cannot see the rest of the home, reads the pin
        here (`bastion mcp` inside a run)."""
        return self.run / "known_hosts"

    @property
    def operator_dir(self) -> Path:
        """The operator socket and the gateway's records of its lifetime: never
        bound into a sandbox (the agents' door is `run/`)."""
        return self.root / "operator"

    @property
    def operator_socket(self) -> Path:
        return self.operator_dir / "operator.sock"

    @property
    def gateway_record(self) -> Path:
        """Who the running gateway is (pid, start, namespaces), written at its start beside
        the operator socket: the CLI checks the socket's server against it
        (`ops/opsock.check_server`) before it sends anything."""
        return self.operator_dir / "gateway.json"

    @property
    def lifetime(self) -> Path:
        """Hashed facts about the approvals alive in the current lifetime, so
        the next one can explain its cards (`gateway_restarted`). Never a grant."""
        return self.operator_dir / "lifetime.json"

    @property
    def config(self) -> Path:
        """The gateway's own settings (witness, export): see config.py."""
        return self.root / "bastion.toml"

    @property
    def witness_spool(self) -> Path:
        """Witness entries not yet delivered (a witness was down): sent in order later."""
        return self.root / "witness-spool"

    @property
    def journal(self) -> Path:
        return self.root / "journal"

    @property
    def isolation(self) -> Path:
        """Where `bastion isolate setup` records the agent user and its socket
        directory; `bastion daemon` and `bastion run --isolated` read it."""
        return self.root / "isolation.json"

    def exists(self) -> bool:
        return self.vault.exists()

    def make_dirs(self) -> None:
        for d in (self.root, self.policies, self.run, self.operator_dir):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(d, 0o700)
