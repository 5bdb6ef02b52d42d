"""Who asks: the records a process is approved as.

Authority is bound to one live process, never to anything a client says
about itself. These records are what `identity.py` reads from the kernel and
/proc; everything that grants or checks authority (the gate, the approval
book, the journal) sees only these immutable values.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

# (pid, start time, launch nonce, exe sha256): one process running one executable.
SubjectKey = tuple[int, float, str, str]
# (pid, start time, launch nonce): one process instance, whatever it runs now.
ProcessKey = tuple[int, float, str]


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
        return {
            "pid": self.pid,
            "exe": self.exe,
            "exe_sha256": self.exe_sha256,
            "uid": self.uid,
            "start_time": self.start_time,
            "cmdline": list(self.cmdline),
        }


class SubjectKind(enum.Enum):
    """Why this process is the one approved: the card says it to the operator."""

    RUN = "registered run"  # `bastion run`: its whole process tree is one subject
    PROCESS = "agent process"  # the first program above ssh that is not a shell or wrapper
    SESSION_SHELL = "shell of a terminal session"  # the walk stopped below a session host


@dataclass(frozen=True)
class Subject:
    """The process a person approves: identity of one live process in one
    gateway lifetime. The nonce makes two sightings of the same
    (pid, start_time) in two gateway lifetimes two different subjects."""

    pid: int
    start_time: float
    exe: str
    exe_sha256: str | None
    uid: int
    nonce: str
    run: str | None = None  # label of the registered run this subject is, if any
    kind: SubjectKind = SubjectKind.PROCESS

    @property
    def process_key(self) -> ProcessKey:
        """This process instance, whatever it runs now (watching, cards)."""
        return (self.pid, self.start_time, self.nonce)

    @property
    def key(self) -> SubjectKey:
        """What approvals bind to: the process instance *and* its executable.
        exec() keeps the pid and start time; it must not keep the approval."""
        return (self.pid, self.start_time, self.nonce, self.exe_sha256 or self.exe)

    def as_json(self) -> dict[str, object]:
        return {
            "pid": self.pid,
            "start_time": self.start_time,
            "exe": self.exe,
            "exe_sha256": self.exe_sha256,
            "exe_deleted": self.exe.endswith(" (deleted)"),
            "uid": self.uid,
            "run": self.run,
            "kind": self.kind.value,
        }


@dataclass(frozen=True)
class Peer:
    """The connecting process, its chain up to the subject, and the subject."""

    pid: int
    uid: int
    gid: int
    chain: tuple[ProcessInfo, ...]  # peer first, subject last
    subject: Subject
