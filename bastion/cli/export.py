"""`bastion audit export`: the journal as a stream for log collectors.

One decrypted, structured event per line, `core.events.export_event` of one
journal record: its seq, boot, type and time, its plaintext metadata (request
id, code, exit status, a card's answer, digests...) and its decrypted fields
(host, user, subject, card...). Command text (`command`, `argv`) is null unless
`--with-commands`. Nothing else is left out, because nothing secret is in the
journal: no key, no passphrase, no command output is ever recorded.

* Through the running, unlocked gateway by default: it decrypts with the
  vault's journal identity (`gateway/export.py`), and the key never leaves it.
  `--passphrase-stdin` / `--keyring`: offline, from the files, with the
  identity read from the vault by passphrase.
* `--since SEQ` prints only records with seq > SEQ: a collector that saved the
  last seq it got resumes there.
* `--follow` keeps going. Through the gateway, when the stream ends (a restart,
  a lock, a lost connection) it waits for the gateway to be back and unlocked,
  up to `--retry-for` seconds, and asks again after the last seq it printed;
  offline it keeps reading the files, which every new lifetime appends to.
  Either way each record is printed once, in seq order.
* `--format jsonl`: one JSON object per line (ASCII). `--format rfc5424`: one
  RFC 5424 syslog line per event, `<PRI>1 TIMESTAMP HOSTNAME bastion BOOT TYPE
  - JSON`: facility authpriv; severity warning for the events `warning_types`
  names (a denial, an unknown or failed outcome...), notice for the rest;
  TIMESTAMP the event's time in UTC; PROCID the gateway lifetime (its boot id
  changes exactly when the gateway restarts); MSGID the event type;
  STRUCTURED-DATA nil (bastion has no IANA enterprise number to name an SD-ID
  with); MSG the same JSON object as the jsonl line (ASCII: no BOM needed).

Every line is flushed as it is written. SIGINT ends the command quietly (exit
130); a closed stdout (`| head`) ends it quietly with exit 0.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import select
import socket
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from bastion.cli.common import fail, home_of, passphrase_option, read_passphrase
from bastion.core.errors import BastionError
from bastion.ops import opsock

if TYPE_CHECKING:
    from bastion.journal import Record

FACILITY = 10  # authpriv: security/authorization messages
SEVERITY_WARNING, SEVERITY_NOTICE = 4, 5
RETRY_FOR = 300.0  # default seconds a follower waits for the gateway to come back
RETRY_PAUSE = (0.2, 2.0)  # first and longest pause between attempts
READ_TIMEOUT = 35.0  # a live stream sends a ping every 10 s; silence this long means lost
POLL = 0.5  # seconds between reads of the files when following offline
MAX_LINE = 1 << 24
OFFLINE_HINT = "or export offline with --passphrase-stdin or --keyring"


class ReaderGone(BastionError):
    """Whoever read stdout closed it."""


class Away(BastionError):
    """The gateway is not there or not usable yet (stopped, restarting, locked)."""


class ExportAborted(BastionError):
    """The export stops for good: the gateway said no (or sent what is not a JSON
    object), and asking again will not change that. `Away` is the kind that may."""


# -- formats --------------------------------------------------------------------------------


def jsonl(event: dict[str, Any]) -> str:
    return json.dumps(event, ensure_ascii=True, separators=(",", ":"))


def _token(value: object, limit: int) -> str:
    """An RFC 5424 header field: printable ASCII without spaces, at most `limit`."""
    text = "".join(c if "!" <= c <= "~" else "_" for c in str(value or ""))[:limit]
    return text or "-"


def _timestamp(t: object) -> str:
    if isinstance(t, bool) or not isinstance(t, int | float):
        return "-"
    try:
        when = datetime.fromtimestamp(t, UTC)
    except (ValueError, OverflowError, OSError):
        return "-"
    return when.isoformat(timespec="microseconds").replace("+00:00", "Z")


@functools.cache
def warning_types() -> frozenset[str]:
    """The events a syslog line calls a warning: something refused, cut off or broken."""
    from bastion.core.events import EventType as E

    return frozenset(
        e.value
        for e in (
            E.DENIED,
            E.UNKNOWN,
            E.SIGNALLED,
            E.REMOTE_REJECTED,
            E.NOT_STARTED,
            E.POLICY_FAILED,
            E.HOME_MOVED,
            E.TORN_TAIL,
            E.OPERATOR_KILL,
            E.OPERATOR_TERMINATE,
        )
    )


def rfc5424(event: dict[str, Any], hostname: str) -> str:
    """`<PRI>1 TIMESTAMP HOSTNAME APP-NAME PROCID MSGID SD MSG` (see the module's docstring)."""
    warning = event.get("type") in warning_types()
    return " ".join(
        [
            f"<{FACILITY * 8 + (SEVERITY_WARNING if warning else SEVERITY_NOTICE)}>1",
            _timestamp(event.get("time")),
            _token(hostname, 255),
            "bastion",
            _token(event.get("boot"), 128),
            _token(event.get("type"), 32),
            "-",
            jsonl(event),
        ]
    )


def formatter(name: str) -> Callable[[dict[str, Any]], str]:
    if name == "rfc5424":
        hostname = socket.gethostname()
        return lambda event: rfc5424(event, hostname)
    return jsonl


# -- printing each record once ----------------------------------------------------------------


class Output:
    """Prints each event once, in seq order, and remembers the last seq printed:
    what a reconnection asks again after, so an overlap prints nothing twice."""

    def __init__(
        self,
        since: int,
        format_line: Callable[[dict[str, Any]], str],
        write: Callable[[str], None],
        say: Callable[[str], None],
    ) -> None:
        self.last = since
        self.printed = 0
        self._format = format_line
        self._write = write
        self._say = say

    def event(self, event: dict[str, Any]) -> None:
        seq = event.get("seq")
        if isinstance(seq, bool) or not isinstance(seq, int) or seq <= self.last:
            return  # printed already (an overlap after a reconnection), or not a record
        if seq != self.last + 1:
            self._say(
                f"warning: seq {self.last + 1}..{seq - 1} are not in the journal "
                "(damaged? see `bastion audit verify`)"
            )
        self._write(self._format(event) + "\n")
        self.last = seq
        self.printed += 1


def stdout_writer() -> Callable[[str], None]:
    out = sys.stdout.buffer

    def write(line: str) -> None:
        try:
            out.write(line.encode("ascii", "backslashreplace"))
            out.flush()
        except BrokenPipeError:
            raise ReaderGone from None

    return write


def stdout_closed() -> bool:
    """Has the reader of a pipe on stdout gone? (Checked while idle, as `tail -f` does.)"""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), 0)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))
    except (OSError, ValueError):
        return False


def say(text: str) -> None:
    click.echo(f"bastion: {text}", err=True)


# -- through the gateway ------------------------------------------------------------------------


def gateway_stream(
    path: Path, since: int, follow: bool, with_commands: bool
) -> Iterator[dict[str, Any]]:
    """One connection to the gateway's export stream: its lines, as they come.
    Away when it cannot be reached or goes silent; the iterator ends at EOF."""
    try:
        sock = opsock.connect(path, READ_TIMEOUT)
    except opsock.GatewayNotRunning as exc:
        raise Away(str(exc)) from None
    except OSError as exc:
        raise Away(f"cannot reach the gateway at {path}: {exc}") from None
    request = {"op": "export", "since": since, "follow": follow, "with_commands": with_commands}
    with sock, sock.makefile("rwb") as f:
        try:
            f.write(json.dumps(request).encode() + b"\n")
            f.flush()
            while line := f.readline(MAX_LINE):
                try:
                    doc = opsock.loads_line(line)
                except ValueError:
                    raise ExportAborted("the gateway sent a line that is not JSON") from None
                if not isinstance(doc, dict):
                    raise ExportAborted("the gateway sent a line that is not a JSON object")
                yield doc
        except TimeoutError:
            raise Away(f"no word from the gateway for {READ_TIMEOUT:g}s") from None
        except OSError as exc:
            raise Away(f"lost the gateway ({exc})") from None


def from_gateway(
    connect: Callable[[int], Iterator[dict[str, Any]]],
    out: Output,
    follow: bool,
    retry_for: float,
    say: Callable[[str], None] = say,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    idle: Callable[[], bool] = lambda: False,
) -> None:
    """Print the gateway's stream. `connect(since)` opens one; with `follow`, a
    stream that ends is opened again after the last seq printed, for as long as
    the gateway comes back (and is unlocked) within `retry_for` seconds of
    leaving. Raises ExportAborted when there is no point asking again; returns at the
    end of the records (without follow) or when `idle()` says stdout is gone."""
    away_since: float | None = None
    pause = RETRY_PAUSE[0]
    while True:
        try:
            with contextlib.closing(connect(out.last)) as stream:  # closed before a pause
                for doc in stream:
                    kind = doc.get("event")
                    if doc.get("ok") is False:
                        error = str(doc.get("error") or "the gateway refused the export")
                        raise (Away if doc.get("retryable") else ExportAborted)(error)
                    if kind == "record" and isinstance(doc.get("record"), dict):
                        out.event(doc["record"])
                    elif kind == "hello":
                        if away_since is not None:
                            say(
                                f"reconnected to gateway {_token(doc.get('boot_id'), 64)}; "
                                f"resuming after seq {out.last}"
                            )
                        away_since, pause = None, RETRY_PAUSE[0]
                    elif kind == "end" or (kind == "ping" and idle()):
                        return  # all printed (without follow), or nobody reads stdout any more
            raise Away("the gateway ended the stream (stopped or restarted)")
        except Away as exc:
            if not follow:
                raise
            now = clock()
            if away_since is None:
                away_since = now
                say(
                    f"{exc}; waiting up to {retry_for:g}s for it to be back and unlocked, "
                    f"to resume after seq {out.last}"
                )
            elif now - away_since >= retry_for:
                raise ExportAborted(
                    f"the gateway was not back and unlocked within {retry_for:g}s ({exc}); "
                    f"seq {out.last} was the last printed: resume with --since {out.last}"
                ) from None
            if idle():
                return
            sleep(pause)
            pause = min(pause * 2, RETRY_PAUSE[1])


# -- offline, from the files ------------------------------------------------------------------


class Tail:
    """The records appended to a journal directory since the last read: complete
    lines only (one being written is read next time), every segment in order,
    new segments as they appear."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.offsets: dict[Path, int] = {}

    def read(self) -> list[Record]:
        from bastion import journal

        found: list[Record] = []
        for path in journal.segments(self.directory):
            start = self.offsets.get(path, 0)
            try:
                with open(path, "rb") as f:
                    if os.fstat(f.fileno()).st_size < start:
                        start = 0  # rewritten under us: read it again (seq filters repeats)
                    f.seek(start)
                    data = f.read()
            except FileNotFoundError:
                continue
            end = data.rfind(b"\n") + 1
            for raw in data[:end].split(b"\n")[:-1]:
                record = journal.parse_record(raw)
                if record is not None:
                    found.append(record)
            self.offsets[path] = start + end
        return found


def file_records(
    directory: Path,
    follow: bool,
    sleep: Callable[[float], None] = time.sleep,
    idle: Callable[[], bool] = lambda: False,
) -> Iterator[Record]:
    """The journal's records in file order; with `follow`, then every record
    appended later, forever (until `idle()` says stdout is gone)."""
    from bastion import journal

    if not follow:
        yield from journal.records(directory)
        return
    tail = Tail(directory)
    while True:
        found = tail.read()
        yield from found
        if not found:
            if idle():
                return
            sleep(POLL)


def from_files(records: Iterable[Record], identity: Any, out: Output, with_commands: bool) -> None:
    """Decrypt and print every record after `out.last` (BOOT records are read
    whatever their seq: they carry what later records are decrypted with)."""
    from bastion import journal
    from bastion.core.events import EventType, export_event

    boot = EventType.BOOT.value
    wanted = (r for r in records if r.seq > out.last or r.type == boot)
    for record, event in journal.decrypt(wanted, identity):
        if record.seq > out.last:
            out.event(export_event(record, event, with_commands))


# -- the command --------------------------------------------------------------------------------


@click.command("export")
@click.option("--follow", "-f", is_flag=True, help="Keep going: print new records as they come.")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["jsonl", "rfc5424"]),
    default="jsonl",
    show_default=True,
    help="One JSON object per line, or one RFC 5424 syslog line (JSON as MSG).",
)
@click.option(
    "--since",
    type=click.IntRange(min=0),
    default=0,
    metavar="SEQ",
    help="Only records with seq > SEQ (resume after the last seq you got).",
)
@click.option("--with-commands", is_flag=True, help="Include command text (it may hold secrets).")
@passphrase_option("Read the journal files without a gateway.")
@click.option(
    "--keyring", "use_keyring", is_flag=True, help="Read the vault passphrase from the OS keyring."
)
@click.option(
    "--retry-for",
    type=click.FloatRange(min=0),
    default=RETRY_FOR,
    show_default=True,
    metavar="SECONDS",
    help="With --follow through the gateway: how long to wait for it to be back and unlocked.",
)
@click.pass_context
def export(
    ctx: click.Context,
    follow: bool,
    fmt: str,
    since: int,
    with_commands: bool,
    passphrase_stdin: bool,
    use_keyring: bool,
    retry_for: float,
) -> None:
    """One decrypted, structured event per line, for log collectors.

    Every journal record after --since: request, decision, card and its answer,
    outcome, exit status, code, subject, digests. Never a key, a passphrase or
    command output; command text only with --with-commands. Through the
    running, unlocked gateway, or offline with --passphrase-stdin/--keyring.
    With --follow, a gateway restart costs neither a gap nor a duplicate.
    """
    home = home_of(ctx)
    out = Output(since, formatter(fmt), stdout_writer(), say)
    idle = stdout_closed if follow else (lambda: False)
    try:
        if passphrase_stdin or use_keyring:
            identity = _offline_identity(home, passphrase_stdin, use_keyring)
            records = file_records(home.journal, follow, idle=idle)
            from_files(records, identity, out, with_commands)
        else:
            from_gateway(
                lambda last: gateway_stream(home.operator_socket, last, follow, with_commands),
                out,
                follow,
                retry_for,
                idle=idle,
            )
    except Away as exc:  # only without --follow
        if out.printed:
            fail(f"{exc}; the export stopped after seq {out.last}: resume with --since {out.last}")
        fail(str(exc) if "--passphrase-stdin" in str(exc) else f"{exc}, {OFFLINE_HINT}")
    except ExportAborted as exc:
        fail(str(exc))
    except ReaderGone:
        _quiet_stdout()
        sys.exit(0)
    except KeyboardInterrupt:
        sys.exit(130)


def _offline_identity(home: Any, passphrase_stdin: bool, use_keyring: bool) -> Any:
    from bastion import journal
    from bastion.vault import Vault, VaultError

    if not home.journal.is_dir():
        fail(f"no journal at {home.journal}; is {home.root} a bastion home (`bastion init`)?")
    passphrase = read_passphrase(passphrase_stdin, use_keyring, home)
    try:
        return Vault.open(home.vault).read_private_key(passphrase, journal.IDENTITY_LABEL).pyca_key
    except VaultError as exc:
        fail(str(exc))


def _quiet_stdout() -> None:
    """stdout's reader left: nothing more can reach it, not even Python's final flush."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
