"""What every `bastion` subcommand shares: errors, output, the home, the gateway, secrets.

Output: every line a command prints for a person (`emit`'s text, `fail`'s
message) passes through `core.display.escape_text`, whatever it holds.

Secrets: a process that reads the vault passphrase, a key or a token first
closes its memory to the other processes of its uid (`close_memory`), as the
gateway does at start. Every way in goes through here: the `--passphrase-stdin`
option (`passphrase_option`) closes it while the command line is parsed, and
the readers (`read_passphrase`, `read_secret_line`, `ask_secret`) close it
before they read, for a command that reads a secret without that option.
"""

from __future__ import annotations

import ctypes
import getpass
import io
import json
import os
import signal
import sys
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import click

from bastion import opsock
from bastion.core.display import escape_text
from bastion.home import Home

KEYRING_SERVICE = "bastion"
HOST_KEY_ALIAS = "bastion-gateway"
PR_SET_PDEATHSIG, PR_SET_DUMPABLE = 1, 4
SI_KERNEL = 0x80  # siginfo's si_code of a signal the kernel sent (the terminal's ^C, ^\)
FORWARDED = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT})
F = TypeVar("F", bound=Callable[..., Any])


def shown(text: str) -> str:
    """Text for a person, line by line: each line escaped, tabs kept between fields."""
    return "\n".join(
        "\t".join(escape_text(field) for field in line.split("\t")) for line in text.split("\n")
    )


def fail(message: str, status: int = 1) -> NoReturn:
    click.echo(f"bastion: {shown(message)}", err=True)
    sys.exit(status)


def emit(data: Any, as_json: bool, human: Callable[[Any], str]) -> None:
    click.echo(json.dumps(data, indent=2) if as_json else shown(human(data)))


def home_of(ctx: click.Context) -> Home:
    return Home(ctx.obj["home"])


def op(ctx: click.Context, name: str, timeout: float = 30.0, **args: Any) -> Any:
    """One request to the running gateway; its refusal is this command's failure."""
    try:
        return opsock.call(home_of(ctx).operator_socket, name, timeout=timeout, **args)
    except opsock.OperatorError as exc:
        fail(str(exc))


# -- a process that holds a secret --------------------------------------------------------

_closed = False  # this process is the child close_memory made: its memory is closed


def close_memory() -> None:
    """Close this process's memory to every other process of its uid that lacks
    CAP_SYS_PTRACE, before a secret enters it; once per process.

    PR_SET_DUMPABLE 0 stops a ptrace attach and any new open of /proc/PID/mem
    (as the gateway does, and ssh-agent). It does not revoke a /proc/PID/mem a
    same-uid process opened earlier, in the ~0.1 s the interpreter takes to get
    here: so the command then goes on in a child forked after the prctl, whose
    memory is new and was never open to anyone, while this process waits for
    it and ends as it ends. A process already tracing this one (or the child,
    through PTRACE_O_TRACEFORK) would see everything, so either refuses."""
    global _closed
    if _closed:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        fail(
            f"cannot close this process's memory (PR_SET_DUMPABLE: "
            f"{os.strerror(ctypes.get_errno())}); no secret was read"
        )
    _refuse_a_tracer()
    sys.stdout.flush()
    sys.stderr.flush()
    watched = {signal.SIGCHLD, *FORWARDED}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, watched)
    parent = os.getpid()
    child = os.fork()
    if child:
        _stand_for(child, watched)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # never outlive the parent
    if os.getppid() != parent:
        os._exit(1)  # it was killed before the line above
    _closed = True
    _refuse_a_tracer()


def _refuse_a_tracer() -> None:
    with open("/proc/self/status") as f:
        tracer = next((line.split()[1] for line in f if line.startswith("TracerPid:")), "0")
    if tracer != "0":
        fail(
            f"process {tracer} is tracing this one (a debugger, strace, or another program "
            "of your uid): it could read any secret typed here, so none was read"
        )


def _stand_for(child: int, watched: set[signal.Signals]) -> NoReturn:
    """The parent's whole remaining life: hold nothing, pass on a signal sent to it
    by a process (the terminal's already reached the child, in the same process
    group), and end as the child ends -- its exit status, or its signal."""
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)  # only the child reads and writes the command's streams
    while True:
        info = signal.sigwaitinfo(watched)
        if info.si_signo != signal.SIGCHLD:
            if info.si_code != SI_KERNEL:
                os.kill(child, info.si_signo)
            continue
        done, status = os.waitpid(child, os.WNOHANG)
        if done:
            break
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {-code})
        os.kill(os.getpid(), -code)
        code = 128 - code
    os._exit(code)


def _close_on_parse(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    if not ctx.resilient_parsing:  # not for shell completion, which reads nothing secret
        close_memory()
    return value


def passphrase_option(help: str = "Read the vault passphrase from stdin.") -> Callable[[F], F]:
    """`--passphrase-stdin`, which every command that may read the vault passphrase
    takes. Taking it closes the process's memory (`close_memory`) while the command
    line is parsed, before the command reads anything, given or not."""
    return click.option("--passphrase-stdin", is_flag=True, help=help, callback=_close_on_parse)


def read_secret_line() -> bytes:
    """A secret on stdin's next line, without its line end."""
    close_memory()
    return sys.stdin.buffer.readline().rstrip(b"\r\n")


def ask_secret(prompt: str) -> bytes:
    """A secret typed at the terminal, not echoed."""
    close_memory()
    return getpass.getpass(prompt).encode()


def read_passphrase(
    from_stdin: bool, use_keyring: bool, home: Home, confirm: bool = False
) -> bytes:
    close_memory()
    if use_keyring:
        import keyring

        try:
            secret = keyring.get_password(KEYRING_SERVICE, str(home.root))
        except keyring.errors.KeyringError as exc:
            fail(f"the OS keyring is not usable here: {exc}")
        if secret is None:
            fail(
                f"no passphrase for {home.root} in the OS keyring (service '{KEYRING_SERVICE}'); "
                "store one with `bastion init --keyring` or `bastion unlock --store-keyring`"
            )
        return secret.encode()
    if from_stdin:
        return read_secret_line()
    if not sys.stdin.isatty():
        fail("no terminal to ask for the passphrase; use --passphrase-stdin or --keyring")
    first = ask_secret("Vault passphrase: ")
    if confirm and ask_secret("Again: ") != first:
        fail("the passphrases do not match; nothing was changed")
    return first


def save_to_keyring(home: Home, passphrase: bytes) -> None:
    import keyring
    import keyring.errors

    try:
        keyring.set_password(KEYRING_SERVICE, str(home.root), passphrase.decode())
    except keyring.errors.KeyringError as exc:
        fail(f"could not store the passphrase in the OS keyring: {exc}")


class LineStdin:
    """Stands in for stdin once a line of it has been read on another's behalf."""

    def __init__(self, line: bytes) -> None:
        self.buffer = io.BytesIO(line + b"\n")

    def isatty(self) -> bool:
        return False
