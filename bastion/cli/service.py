"""`bastion service install [--user]`: a systemd unit that runs this home's gateway.

The unit (rendered by `ops/service_unit.py`) runs the same `bastion daemon` an
operator would, under the interpreter running this command, with `--home`
made explicit. A system unit runs the gateway as the home's owner (`User=`);
a `--user` unit must be installed by that owner. The command writes the file
(never over a different one without `--force`) and prints the `systemctl`
line that enables it; it does not call systemctl itself, so nothing starts
behind the operator's back. Options after `--` go to `bastion daemon`.
"""

from __future__ import annotations

import os
import pwd
import sys
from pathlib import Path, PurePosixPath

import click

from bastion.cli.common import fail, home_of
from bastion.home import Home, default_home
from bastion.ops import opsock
from bastion.ops.service_unit import (
    Mode,
    UnitError,
    UnitInputs,
    enable_commands,
    render,
    unit_path,
)


@click.group()
def service() -> None:
    """Run the gateway under systemd."""


def _run_as(home: Home, mode: Mode) -> str | None:
    """Who the gateway runs as: the home's owner (its files are that user's alone)."""
    try:
        owner = os.stat(home.root).st_uid
    except OSError as exc:
        fail(f"cannot read {home.root}: {exc.strerror}")
    if mode is Mode.USER:
        if owner != os.getuid():
            fail(
                f"{home.root} belongs to uid {owner}: install the --user unit as that user, "
                f"or a system unit with `sudo bastion --home {home.root} service install`"
            )
        return None
    if owner == 0:
        return None
    try:
        return pwd.getpwuid(owner).pw_name
    except KeyError:
        fail(f"{home.root} belongs to uid {owner}, which has no user name for User=")


def _daemon_args(ctx: click.Context, args: tuple[str, ...]) -> tuple[str, ...]:
    """Options for `bastion daemon`, checked now by its own parser: a typo fails here,
    not at the next boot."""
    main = ctx.find_root().command
    daemon = main.get_command(ctx, "daemon") if isinstance(main, click.Group) else None
    if daemon is None:  # pragma: no cover - the daemon command always exists
        fail("no `daemon` command to run")
    try:
        parsed = daemon.make_context("daemon", list(args), parent=ctx)
    except click.ClickException as exc:
        fail(f"not an option of `bastion daemon`: {exc.format_message()}")
    for name, value in parsed.params.items():
        if isinstance(value, Path) and not value.is_absolute():
            fail(
                f"--{name.replace('_', '-')} {value}: give an absolute path "
                "(systemd starts the gateway in another directory)"
            )
    return args


def _write(path: Path, text: str, force: bool) -> str:
    """Write the unit (0644, atomically); what happened, in a word."""
    try:
        old = path.read_text()
    except FileNotFoundError:
        old = None
    except OSError as exc:
        fail(f"cannot read {path}: {exc.strerror}")
    if old == text:
        return "unchanged"
    if old is not None and not force:
        fail(
            f"{path} exists and differs from this unit; compare with `--stdout`, "
            "then replace it with --force"
        )
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except PermissionError:
        tmp.unlink(missing_ok=True)
        fail(
            f"no permission to write {path}: run it as root (sudo), or install "
            "a unit for your own manager with --user"
        )
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        fail(f"cannot write {path}: {exc.strerror}")
    return "replaced" if old is not None else "wrote"


@service.command()
@click.option("--user", "user_mode", is_flag=True, help="A unit for your own systemd (--user).")
@click.option("--stdout", "to_stdout", is_flag=True, help="Print the unit instead of writing it.")
@click.option(
    "--output",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Write the unit here instead of the manager's directory.",
)
@click.option("--force", is_flag=True, help="Replace an existing unit that differs.")
@click.argument("daemon_args", nargs=-1, type=click.UNPROCESSED, metavar="[-- DAEMON_OPTIONS]")
@click.pass_context
def install(
    ctx: click.Context,
    user_mode: bool,
    to_stdout: bool,
    output: Path | None,
    force: bool,
    daemon_args: tuple[str, ...],
) -> None:
    """Write a systemd unit for this home's gateway and print how to enable it.

    System unit: /etc/systemd/system/bastion.service, run as the home's owner.
    With --user: $XDG_CONFIG_HOME/systemd/user/bastion.service. The gateway
    starts locked; `bastion unlock` after each start."""
    if to_stdout and output is not None:
        fail("--stdout and --output exclude each other; choose one")
    home = home_of(ctx)
    if not home.exists():
        fail(f"{home.root} is not initialised; run `bastion init` first")
    mode = Mode.USER if user_mode else Mode.SYSTEM
    if not sys.executable or not os.path.isabs(sys.executable):
        fail("cannot tell which python runs bastion (sys.executable is unset)")
    inputs = UnitInputs(
        python=PurePosixPath(sys.executable),
        home=PurePosixPath(home.root),
        mode=mode,
        run_as=_run_as(home, mode),
        daemon_args=_daemon_args(ctx, daemon_args),
    )
    try:
        text = render(inputs)
    except UnitError as exc:
        fail(str(exc))
    if to_stdout:
        click.echo(text, nl=False)
        return
    standard = unit_path(mode, os.environ, Path.home())
    path = output or standard
    done = _write(path, text, force)
    click.echo("\n".join([f"{done} {path}", *_next_steps(home, mode, path, standard)]))


def _next_steps(home: Home, mode: Mode, path: Path, standard: Path) -> list[str]:
    """What the operator does now: the systemctl line, the unlock that every start
    needs, where the logs go -- and what would stop the unit from starting."""
    flag = " --user" if mode is Mode.USER else ""
    unlock = (
        "bastion unlock" if home.root == default_home() else f"bastion --home {home.root} unlock"
    )
    lines = []
    if path.absolute() != standard:
        lines.append(f"(not where systemd looks: copy it to {standard})")
    lines += [
        "enable and start it:",
        f"  {enable_commands(mode)}",
        f"then unlock: the gateway starts locked, after every start: {unlock}",
        f"logs: journalctl{flag} -u bastion",
    ]
    if mode is Mode.USER:
        lines.append(f"to keep it running while you are logged out: loginctl enable-linger {_me()}")
    if _gateway_running(home):
        lines.append(
            "note: a gateway runs for this home now; stop it first, or the unit's will refuse "
            "to start (`bastion: a gateway is already running`)"
        )
    return lines


def _me() -> str:
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())


def _gateway_running(home: Home) -> bool:
    try:
        opsock.call(home.operator_socket, "status", timeout=2)
    except opsock.OperatorError:
        return False
    return True
