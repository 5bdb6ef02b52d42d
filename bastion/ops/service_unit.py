"""The systemd unit that runs the gateway, rendered from one record; no I/O.

`bastion service install` writes it (see cli/service.py). What the unit
promises: the same `bastion daemon` an operator would start by hand, with an
explicit `--home`; `Type=notify`, so systemd counts the gateway as started only
once both sockets listen (`gateway/sdnotify.py` sends `READY=1`); a watchdog fed from the
gateway's event loop, so a wedged loop is restarted; `Restart=on-failure`. The
gateway starts locked after every (re)start: the passphrase never goes into
the unit, and only `bastion unlock` opens the vault.

Hardening is limited to what the gateway can live with. It reads /proc of the
agent's ancestors (other uids too: sshd, tmux, login), binds its sockets in the
home's run directory (or the socket directory `isolate setup` made under /run),
writes the journal in the home and a witness file wherever bastion.toml says,
makes outbound TCP connections, and takes 512 MiB for Argon2id at each unlock.
Options that need a mount namespace are only set for the system manager: in a
per-user manager they imply `PrivateUsers=`, which would show every other uid
as `nobody` (an isolated agent's peer uid, the terminal hosts in /proc) and
make the agent socket's `chown` to the agents' group fail. `LEFT_OUT` says
what is not used and why; the unit repeats it in comments.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path, PurePosixPath

from bastion.core.errors import BastionError

UNIT_NAME = "bastion.service"
SYSTEM_UNIT_DIR = Path("/etc/systemd/system")
WATCHDOG_SEC = 30
TEMPORARY_DIRS = (PurePosixPath("/tmp"), PurePosixPath("/var/tmp"))


class Mode(Enum):
    """Which service manager runs the gateway: the operator's own (`--user`) or the system's."""

    USER = "user"
    SYSTEM = "system"


@dataclass(frozen=True)
class Option:
    """One hardening directive, and why the gateway can live with it."""

    directive: str
    value: str
    why: str
    system_only: bool = False  # needs a namespace (see the module docstring)


# Every option here was tried with the real gateway under a real systemd manager (started,
# unlocked with Argon2id at full strength, an agent's command relayed to a real sshd,
# restarted by the watchdog): tests/integration/test_service_unit.py.
HARDENING: tuple[Option, ...] = (
    Option("NoNewPrivileges", "yes", "the gateway never needs to gain a privilege"),
    Option("UMask", "0077", "whatever the gateway creates is the operator's alone"),
    Option(
        "MemoryDenyWriteExecute",
        "yes",
        "no JIT, no ffi callbacks: CPython, cryptography, argon2-cffi and psutil map no W+X memory",
    ),
    Option("LockPersonality", "yes", "no execution domain changes"),
    Option("RestrictRealtime", "yes", "no realtime scheduling"),
    Option("RestrictSUIDSGID", "yes", "the gateway creates no set-uid or set-gid file"),
    Option("RestrictNamespaces", "yes", "the gateway creates no namespace"),
    Option(
        "RestrictAddressFamilies",
        "AF_UNIX AF_INET AF_INET6",
        "its sockets, a syslog witness, and TCP to the targets",
    ),
    Option("SystemCallArchitectures", "native", "no foreign system call ABI"),
    Option("SystemCallFilter", "@system-service", "what a network service needs"),
    Option("SystemCallErrorNumber", "EPERM", "a refused call fails instead of killing"),
    Option(
        "PrivateTmp", "yes", "a /tmp of its own (bastion keeps nothing there)", system_only=True
    ),
    Option("ProtectSystem", "full", "/usr, /boot and /etc read-only", system_only=True),
    Option("PrivateDevices", "yes", "no physical devices", system_only=True),
    Option("ProtectKernelTunables", "yes", "/proc/sys and /sys read-only", system_only=True),
    Option("ProtectKernelModules", "yes", "no module loading", system_only=True),
    Option("ProtectKernelLogs", "yes", "no kernel log", system_only=True),
    Option("ProtectControlGroups", "yes", "the cgroup tree read-only", system_only=True),
    Option("ProtectHostname", "yes", "no hostname changes", system_only=True),
)

LEFT_OUT: tuple[tuple[str, str], ...] = (
    (
        "ProtectSystem=strict, ProtectHome=",
        "the home, a witness file (bastion.toml) and the agents' socket directory under /run "
        "must stay writable, and agents' executables under /home readable (the gateway hashes "
        "them); add them with `systemctl edit` and ReadWritePaths= if your paths are fixed",
    ),
    (
        "ProtectProc=invisible, ProcSubset=pid",
        "the identity walk reads /proc of the agent's ancestors of other uids (sshd, tmux), and "
        "psutil reads /proc/stat",
    ),
    (
        "PrivateUsers= (and, in a --user unit, every option that implies it)",
        "other uids would read as nobody: an isolated agent's peer uid, the terminal hosts",
    ),
    ("PrivateNetwork=, IPAddressDeny=", "the gateway connects to the targets"),
    ("MemoryMax=, MemoryHigh=", "Argon2id takes 512 MiB at each unlock"),
    ("DynamicUser=", "the home and the vault belong to the operator"),
    (
        "CapabilityBoundingSet=",
        "as anyone but root the gateway holds no capability; as root it reads every "
        "process's /proc (CAP_SYS_PTRACE) and gives the agents' socket their group",
    ),
)


@dataclass(frozen=True)
class UnitInputs:
    """Everything the unit depends on. `python` is the interpreter bastion runs under
    now, unresolved (a venv's python is a symlink whose place selects the venv)."""

    python: PurePosixPath
    home: PurePosixPath
    mode: Mode
    run_as: str | None = None  # User= for the system manager (the home's owner); None: root
    daemon_args: tuple[str, ...] = ()
    watchdog_sec: int = WATCHDOG_SEC


class UnitError(BastionError, ValueError):
    """An input the unit cannot express."""


_PLAIN = re.compile(r"[A-Za-z0-9_@+=:,./-]+")


def quote(word: str) -> str:
    """One command-line word as systemd reads it back (systemd.syntax(7)): `%` and `$`
    doubled (specifiers and variables), anything beyond plain characters in double
    quotes with `\\` and `"` escaped. A control character (a newline ends the line)
    cannot be written and is refused."""
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in word):
        raise UnitError(f"{word!r} contains a control character; a unit file cannot carry it")
    escaped = word.replace("%", "%%").replace("$", "$$")
    if _PLAIN.fullmatch(word):
        return escaped
    return '"' + escaped.replace("\\", "\\\\").replace('"', '\\"') + '"'


def exec_argv(inputs: UnitInputs) -> tuple[str, ...]:
    """The daemon, as `bastion daemon` starts it, with the home made explicit. `-P`: the
    working directory is not put on the module path (a `bastion/` there would shadow)."""
    return (
        str(inputs.python),
        "-P",
        "-m",
        "bastion.cli",
        "--home",
        str(inputs.home),
        "daemon",
        *inputs.daemon_args,
    )


def _under_tmp(path: PurePosixPath) -> bool:
    return any(path == d or d in path.parents for d in TEMPORARY_DIRS)


def options(inputs: UnitInputs) -> tuple[list[Option], list[tuple[str, str]]]:
    """The hardening this unit gets, and what is left out of it with the reason."""
    chosen: list[Option] = []
    left = list(LEFT_OUT)
    for opt in HARDENING:
        if opt.system_only and inputs.mode is Mode.USER:
            continue
        if opt.directive == "PrivateTmp" and (_under_tmp(inputs.home) or _under_tmp(inputs.python)):
            left.append(("PrivateTmp=", "the home or the interpreter lives under /tmp or /var/tmp"))
            continue
        chosen.append(opt)
    if inputs.mode is Mode.USER:
        names = ", ".join(o.directive for o in HARDENING if o.system_only)
        left.append((names, "need namespaces, for which a per-user manager adds PrivateUsers="))
    return chosen, left


def _check(inputs: UnitInputs) -> None:
    for path, what in ((inputs.python, "interpreter"), (inputs.home, "home")):
        if not path.is_absolute():
            raise UnitError(f"the {what} {path} is not an absolute path")
    quote(str(inputs.home))  # the description carries it too: no control characters
    if inputs.watchdog_sec <= 0:
        raise UnitError("the watchdog interval must be positive")


def _comment(text: str) -> list[str]:
    return textwrap.wrap(
        text, 96, initial_indent="#   ", subsequent_indent="#       ", break_on_hyphens=False
    )


def render(inputs: UnitInputs) -> str:
    """The unit file's text."""
    _check(inputs)
    user = inputs.mode is Mode.USER
    chosen, left = options(inputs)
    home = str(inputs.home).replace("%", "%%")  # specifiers are expanded in Description= too
    lines = [
        "# Written by `bastion service install`. The gateway starts locked: run `bastion unlock`",
        "# after each start; the vault passphrase is never part of this unit.",
        "[Unit]",
        f"Description=bastion SSH gateway for AI agents ({home})",
    ]
    if not user:
        # Stopped before the network goes down: commands in flight end with their outcome.
        lines.append("After=network.target")
    lines += [
        "",
        "[Service]",
        "Type=notify",
        "NotifyAccess=main",
        "ExecStart=" + " ".join(quote(w) for w in exec_argv(inputs)),
        f"WatchdogSec={inputs.watchdog_sec}s",
        "Restart=on-failure",
        "RestartSec=2s",
    ]
    if not user and inputs.run_as is not None:
        lines.append(f"User={quote(inputs.run_as)}")
    lines += ["", "# Hardening the gateway lives with, and why each holds:"]
    for opt in chosen:
        lines += [f"{opt.directive}={opt.value}", *_comment(opt.why)]
    lines += ["", "# Left out, and why:"]
    for name, why in left:
        lines += _comment(f"{name}: {why}")
    lines += [
        "",
        "[Install]",
        f"WantedBy={'default.target' if user else 'multi-user.target'}",
    ]
    return "\n".join(lines) + "\n"


def unit_path(mode: Mode, env: Mapping[str, str], user_home: Path) -> Path:
    """Where a manager looks for the unit: the operator's config directory for
    `--user` ($XDG_CONFIG_HOME, default ~/.config), /etc/systemd/system otherwise."""
    if mode is Mode.SYSTEM:
        return SYSTEM_UNIT_DIR / UNIT_NAME
    config = env.get("XDG_CONFIG_HOME") or ""
    base = Path(config) if config.startswith("/") else user_home / ".config"
    return base / "systemd" / "user" / UNIT_NAME


def enable_commands(mode: Mode) -> str:
    """The one line that loads, enables and starts the unit."""
    flag = " --user" if mode is Mode.USER else ""
    return f"systemctl{flag} daemon-reload && systemctl{flag} enable --now bastion"
