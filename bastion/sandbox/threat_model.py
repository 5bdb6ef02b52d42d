"""The threat model in one table: what an agent can do in each mode.

docs/sandbox.md shows it (tests/unit/test_docs.py checks it is the same, word
for word), `bastion status` prints it and gives it in `--json`. The rows are
facts the tests check from inside a run (tests/integration/test_sandbox_*.py,
test_isolate.py); `LIMIT` is what no mode stops.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

LIMIT = (
    "a run shares what it was given (the project, each `--rw`) with whatever else you run "
    "there: another run in the same project, a script or a dependency of the project you "
    "run later, a nested repository's git config"
)

# What a default run can read, write and reach, one row per place (docs/sandbox.md shows
# it, `bastion status` prints it; tests/integration/test_run_writes.py tries each row).
ACCESS_COLUMNS = ("place", "a default run", "given with")
ACCESS: tuple[tuple[str, str, str], ...] = (
    (
        "the system (`/usr`, `/etc`, `/var`, `/opt`, ...)",
        "reads; writes nothing (read-only, for root too)",
        "`--rw PATH`",
    ),
    (
        "your home",
        "reads it but what is hidden; writes into an overlay of its own, gone at exit "
        "(a rename, a replace or a new file never reaches the disk)",
        "`--keep-home` (kept per `--label`), `--private-home` (an empty one)",
    ),
    (
        "the project: the working directory's git work tree (or the directory)",
        "reads and writes, on the disk: the one door",
        "start the run there; `--rw PATH` for one more",
    ),
    (
        "the project's `.git/config`, `hooks`, `info`, `modules`, `worktrees`",
        "reads; writes nothing (git runs code from them)",
        "`--rw-git`",
    ),
    ("`/tmp`", "its own, gone at exit", ""),
    (
        "the bastion home",
        "hidden, but the agent socket's directory, read-only",
        "",
    ),
    (
        "browser profiles, password stores and keyrings, ssh private keys, `~/.gnupg`, "
        "cloud, container, kubernetes, git and registry credentials",
        "hidden",
        "`--expose PATH` (read-only)",
    ),
    (
        "your session's and the machine's deputies (`$XDG_RUNTIME_DIR`, ssh-agent, tmux, "
        "screen, the buses, cron, at, docker)",
        "hidden",
        "",
    ),
    (
        "the network",
        "its own: outbound works; the host's loopback (the console, OpenBao, a database, a "
        "dev server) cannot be reached",
        "`--share-net`",
    ),
)

THREAT_COLUMNS = (
    "an agent that tries to ...",
    "in a sandboxed run (default)",
    "unsandboxed (`--no-sandbox`, or outside any run)",
    "strong mode (`--isolated`) adds",
)
THREATS: tuple[tuple[str, str, str, str], ...] = (
    (
        "answer its own card (operator socket)",
        "cannot: hidden, and refused by namespace",
        "cannot from inside a run; a process of your uid outside every run can, but not "
        'a card of a `presence = "required"` account: only a signer\'s signature approves it',
        "a uid of its own: refused by permissions too",
    ),
    (
        "type into your tmux or screen, `new-window`, `stuff`",
        "cannot: sockets hidden, `/tmp` private",
        "can",
        "",
    ),
    (
        "push keys into your terminal (TIOCSTI)",
        "cannot: a session of its own",
        "can",
        "",
    ),
    (
        "use your session bus, keyring, `systemd-run --user`, ssh-agent, X11, `at`/`crontab`",
        "cannot",
        "can",
        "",
    ),
    (
        "read the vault, journal, policies, host key",
        "cannot: hidden",
        "can copy them (the passphrase still protects the vault and journal)",
        "cannot, by file modes",
    ),
    (
        "read your private keys (`~/.ssh/id_*`, `~/.gnupg`)",
        "cannot",
        "can",
        "cannot, by file modes",
    ),
    (
        "list, signal, ptrace your processes (`bastion unlock`, your shell)",
        "cannot: PID namespace, Landlock",
        "can (not the gateway: it is not dumpable)",
        "",
    ),
    (
        "see, signal, ptrace another run, write its `/tmp` or private HOME",
        "cannot",
        "can",
        "",
    ),
    (
        "ride another run's ControlMaster or approval",
        "cannot",
        "cannot (each process or run is its own subject; a ControlMaster outside a run is refused)",
        "",
    ),
    (
        "outlive its run (SIGKILL of `bastion run`)",
        "cannot",
        "can",
        "",
    ),
    (
        "answer for you after a gateway restart",
        "cannot",
        "cannot from inside a run",
        "",
    ),
    (
        "plant what you run next (`~/.bashrc`, `~/.local/bin`, `~/.ssh/authorized_keys`, "
        "a systemd user unit, the project's git hooks, bastion itself), existing or not",
        "cannot: the home is an overlay, the system and git's files read-only",
        "can",
        "",
    ),
    (
        "rename the bastion home's parents, or replace its files",
        "cannot: the writes stay in the run's overlay",
        "can",
        "cannot, by file modes",
    ),
    (
        "read and change your files",
        "reads what is not hidden; changes only the project and each `--rw`",
        "can",
        "only what the agent user may",
    ),
    (
        "reach your loopback services (the console, OpenBao, a database, a dev server)",
        "cannot: its network is its own (`--share-net` opts out)",
        "can",
        "",
    ),
    (
        "reach the network",
        "can, outbound, through its own network stack",
        "can",
        "can, as the agent user",
    ),
)


def threat_table() -> list[str]:
    """THREATS as the Markdown table docs/sandbox.md carries (tests/unit/test_docs.py checks)."""
    lines = ["| " + " | ".join(THREAT_COLUMNS) + " |", "|---|---|---|---|"]
    return lines + [("| " + " | ".join(row) + " |").replace("|  |", "| |") for row in THREATS]


def access_table() -> list[str]:
    """ACCESS as the Markdown table docs/sandbox.md carries (tests/unit/test_docs.py checks)."""
    lines = ["| " + " | ".join(ACCESS_COLUMNS) + " |", "|---|---|---|"]
    return lines + [("| " + " | ".join(row) + " |").replace("|  |", "| |") for row in ACCESS]


def threat_model() -> dict[str, Any]:
    """THREATS for `bastion status --json`: the columns, the rows, the remaining limit, and
    what a default run can read, write and reach (ACCESS)."""
    return {
        "columns": list(THREAT_COLUMNS),
        "rows": [list(r) for r in THREATS],
        "limit": LIMIT,
        "access": {"columns": list(ACCESS_COLUMNS), "rows": [list(r) for r in ACCESS]},
    }


def threat_lines(model: Mapping[str, Any]) -> list[str]:
    """The table for a terminal: one line per row, each mode's answer after its name."""
    lines = ['what an agent can do (docs/sandbox.md, "The sandbox"):']
    for action, boxed, bare, strong in model.get("rows") or []:
        line = f"  {action}: sandboxed {boxed}; unsandboxed {bare}"
        lines.append(line + (f"; strong mode adds: {strong}" if strong else ""))
    if model.get("limit"):
        lines.append(f"  limit: {model['limit']}")
    access = model.get("access") or {}
    if access.get("rows"):
        lines.append("what a default run can read, write and reach:")
        for place, default, given in access["rows"]:
            lines.append(f"  {place}: {default}" + (f" (more: {given})" if given else ""))
    return lines
