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
    "a run shares the files it was given (your user's, less what is hidden or read-only) "
    "with whatever else you run there: another run in the same project, a script of the "
    "project you run later"
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
        "plant what you run next (`~/.bashrc`, a systemd user unit, bastion itself)",
        "cannot: read-only in a run",
        "can",
        "",
    ),
    (
        "read and change your files (the project, `~`)",
        "can: everything your user can that is not hidden or read-only "
        "(`--ro`, `--hide`, `--private-home` narrow it)",
        "can",
        "only what the agent user may",
    ),
    (
        "reach the network",
        "can, as you",
        "can",
        "can, as the agent user",
    ),
)


def threat_table() -> list[str]:
    """THREATS as the Markdown table docs/sandbox.md carries (tests/unit/test_docs.py checks)."""
    lines = ["| " + " | ".join(THREAT_COLUMNS) + " |", "|---|---|---|---|"]
    return lines + [("| " + " | ".join(row) + " |").replace("|  |", "| |") for row in THREATS]


def threat_model() -> dict[str, Any]:
    """THREATS for `bastion status --json`: the columns, the rows, the remaining limit."""
    return {"columns": list(THREAT_COLUMNS), "rows": [list(r) for r in THREATS], "limit": LIMIT}


def threat_lines(model: Mapping[str, Any]) -> list[str]:
    """The table for a terminal: one line per row, each mode's answer after its name."""
    lines = ['what an agent can do (docs/sandbox.md, "The sandbox"):']
    for action, boxed, bare, strong in model.get("rows") or []:
        line = f"  {action}: sandboxed {boxed}; unsandboxed {bare}"
        lines.append(line + (f"; strong mode adds: {strong}" if strong else ""))
    if model.get("limit"):
        lines.append(f"  limit: {model['limit']}")
    return lines
