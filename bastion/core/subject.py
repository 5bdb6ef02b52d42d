"""Who asks: the records a process is approved as.

Authority is bound to one live process, never to anything a client says
about itself. These records are what `identity/resolver.py` reads from the kernel and
/proc; everything that grants or checks authority (the gate, the approval
book, the journal) sees only these immutable values. Which process in the
chain is the subject is decided here too (`subject_index`), over what the
resolver observed of each one.

Paths and command lines come from the kernel as bytes, and Linux allows any
byte but NUL in them. Python holds a byte that is not UTF-8 as a lone
surrogate (surrogateescape), which no UTF-8 encoder accepts and no JSON
reader other than Python's gives back; so the JSON of these records shows
such a byte as `\\xNN` text, and adds the exact bytes in base64 beside it
(`exe_base64`, `cmdline_base64`) only when there is one.
"""

from __future__ import annotations

import base64
import enum
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ProcessKey:
    """One process instance in one gateway lifetime, whatever it runs now: the
    nonce tells two sightings of one (pid, start time) in two lifetimes apart."""

    pid: int
    start_time: float
    nonce: str


@dataclass(frozen=True)
class SubjectKey:
    """One exec of one process instance: what approvals bind to. `exe` is the
    executable's sha256, or its path where it could not be read."""

    pid: int
    start_time: float
    nonce: str
    image: str  # the gateway's name for the exec (images.Images)
    exe: str

    @property
    def process(self) -> ProcessKey:
        """The process instance this exec is in: what outlives an exec, and what a
        grant of an earlier exec is found by (to end it, `process_changed`)."""
        return ProcessKey(self.pid, self.start_time, self.nonce)


def as_bytes(text: str) -> bytes:
    """The bytes the kernel gave for `text` (read with surrogateescape)."""
    return text.encode("utf-8", "surrogateescape")


def shown_path(text: str) -> str:
    """`text` with each byte that was not UTF-8 written as `\\xNN`: valid Unicode,
    shown the way `core/display` escapes it, but not reversible on its own."""
    if text.isascii():
        return text
    return "".join(
        f"\\x{ord(ch) - 0xDC00:02x}" if 0xDC80 <= ord(ch) <= 0xDCFF else ch for ch in text
    )


def exact_base64(text: str) -> str | None:
    """The exact bytes of `text` in base64 when they are not UTF-8, else None."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return base64.b64encode(as_bytes(text)).decode()
    return None


def path_json(name: str, path: str) -> dict[str, object]:
    """`{name: shown}`, plus `{name}_base64` when the path is not UTF-8."""
    doc: dict[str, object] = {name: shown_path(path)}
    if (exact := exact_base64(path)) is not None:
        doc[f"{name}_base64"] = exact
    return doc


@dataclass(frozen=True)
class ProcessInfo:
    """One process in the chain, as read from /proc at one moment."""

    pid: int
    ppid: int
    start_time: float
    uid: int
    exe: str
    exe_sha256: str | None
    name: str
    cmdline: tuple[str, ...]

    def as_json(self) -> dict[str, object]:
        doc: dict[str, object] = {
            "pid": self.pid,
            **path_json("exe", self.exe),
            "exe_sha256": self.exe_sha256,
            "uid": self.uid,
            "start_time": self.start_time,
            "cmdline": [shown_path(arg) for arg in self.cmdline],
        }
        if any(exact_base64(arg) is not None for arg in self.cmdline):
            doc["cmdline_base64"] = [base64.b64encode(as_bytes(a)).decode() for a in self.cmdline]
        return doc


class SubjectKind(enum.Enum):
    """Why this process is the one approved: the card says it to the operator."""

    RUN = "registered run"  # `bastion run`: its whole process tree is one subject
    PROCESS = "agent process"  # the first program above ssh that is not a shell or wrapper
    TERMINAL_SHELL = "shell of a terminal session"  # the walk stopped below a terminal host


class ExecWatch(enum.Enum):
    """How the gateway sees that this process exec'd (docs/architecture.md, "Who is
    asking"); the card says it, so an operator knows what an approval will cover."""

    THREAD = "a thread an exec would end"  # one of its threads first seen is alive
    MEMORY = "its address space and layout"  # the memory first seen is in use and alike
    NOTHING = "nothing: every request asks"  # neither can be read: no approval outlives a request


RUN_LABEL_CLAIM = "label given by the process that started it"


@dataclass(frozen=True)
class Run:
    """A registered run, as it registered: what the card says of it besides the
    process. The label and `given` are what the starting process said (its claim,
    shown as such); `lasting` names the run process for the whole kernel boot
    (`procs.Lasting`), so a gateway restart finds it again and an ended approval's
    reason is keyed by it."""

    label: str
    given: tuple[str, ...] | None  # what its sandbox was given beyond the defaults; None: none
    lasting: str  # boot:pid:start ticks of the run process
    registered_at: float
    uid: int  # the run process's

    def as_json(self) -> dict[str, object]:
        return {
            "label": self.label,
            "label_source": RUN_LABEL_CLAIM,
            "given": list(self.given) if self.given is not None else None,
            "lasting": self.lasting,
            "registered_at": self.registered_at,
            "uid": self.uid,
        }


@dataclass(frozen=True)
class Subject:
    """The process a person approves: identity of one live process in one
    gateway lifetime. The nonce makes two sightings of the same
    (pid, start_time) in two gateway lifetimes two different subjects; the
    image makes two execs of one process two different subjects."""

    pid: int
    start_time: float
    exe: str
    exe_sha256: str | None
    uid: int
    nonce: str
    run: Run | None = None  # the registered run this subject is, if any
    kind: SubjectKind = SubjectKind.PROCESS
    image: str = ""  # the gateway's name for the exec this process is in (images.Images)
    exec_watch: ExecWatch | None = None  # how that exec was last shown to be current
    # The connecting process is in another PID or user namespace than the gateway:
    # a kernel fact read at identification (a sandboxed run's processes are).
    sandboxed: bool = False

    @property
    def process_key(self) -> ProcessKey:
        """This process instance, whatever it runs now (watching, cards)."""
        return ProcessKey(self.pid, self.start_time, self.nonce)

    @property
    def key(self) -> SubjectKey:
        """What approvals bind to: the process instance, the exec it is in, and
        what that exec runs. exec() keeps the pid and start time -- and, for the
        same interpreter, the executable -- it must not keep the approval."""
        return SubjectKey(
            self.pid, self.start_time, self.nonce, self.image, self.exe_sha256 or self.exe
        )

    def as_json(self) -> dict[str, object]:
        return {
            "pid": self.pid,
            "start_time": self.start_time,
            **path_json("exe", self.exe),
            "exe_sha256": self.exe_sha256,
            "exe_deleted": self.exe.endswith(" (deleted)"),
            "uid": self.uid,
            "run": self.run.label if self.run is not None else None,
            "run_info": self.run.as_json() if self.run is not None else None,
            "sandboxed": self.sandboxed,
            "kind": self.kind.value,
            "image": self.image,
            "exec_watch": self.exec_watch.value if self.exec_watch else None,
        }


@dataclass(frozen=True)
class Peer:
    """The connecting process, its chain up to the subject, and the subject."""

    pid: int
    uid: int
    gid: int
    chain: tuple[ProcessInfo, ...]  # peer first, subject last
    subject: Subject


@dataclass(frozen=True)
class Observed:
    """What the resolver saw of one process in the chain, all `subject_index` needs.
    Whether a program is a wrapper or a terminal host is judged by the executable
    the kernel resolved (configured lists, registered fronts, /proc), so the
    resolver judges it; where the subject stands, given that, is decided here."""

    name: str  # basename of the executable the kernel resolved ("" when unreadable)
    ssh: bool  # the ssh client
    wrapper: bool  # a shell or wrapper that acts for its parent
    terminal_host: bool  # hosts terminal sessions (tmux, sshd, a terminal, init)
    front: bool = False  # a wrapper because it registered as a front (`bastion mcp`)


@dataclass(frozen=True)
class NoSubject:
    """No process in the chain may be approved; `reason` tells the agent why."""

    reason: str


def subject_index(chain: Sequence[Observed]) -> tuple[int, SubjectKind] | NoSubject:
    """Where the subject stands in the chain (peer first): above `ssh`, past shells
    and wrappers, but never inside a terminal host (tmux, sshd, a terminal, init):
    there the shell just below it is the subject. Approving a terminal host would
    approve every session inside it.

    A registered front skipped on the way to a terminal's shell refuses: a front
    acts for the MCP client that started it, and a front started from a terminal
    has none -- the shell is the operator's, and making it the subject would get
    that pane refused at the operator socket."""
    start = next((i + 1 for i, p in enumerate(chain) if p.ssh), 0)
    front = False
    for i in range(start, len(chain)):
        if chain[i].terminal_host:
            if front:
                return NoSubject(
                    "a registered front (`bastion mcp`) above ssh was started from a "
                    "terminal's shell, not by an MCP client: there is no agent to approve; "
                    "start `bastion mcp` from the MCP client (or run ssh without it)"
                )
            if i == start:
                return NoSubject(
                    f"ssh was started directly by {chain[i].name or 'pid 1'}, a "
                    "terminal host: there is no agent process to approve; run ssh from "
                    "the agent (or a shell) instead"
                )
            return i - 1, SubjectKind.TERMINAL_SHELL
        if not chain[i].wrapper:
            return i, SubjectKind.PROCESS
        front = front or chain[i].front
    return NoSubject("no process above the ssh client could be identified")
