"""A process's memory, closed to the other processes of its uid.

PR_SET_DUMPABLE 0 stops a ptrace attach and any new open of /proc/PID/mem by a
process of the same uid without CAP_SYS_PTRACE (as ssh-agent does). It does not
revoke a /proc/PID/mem that such a process opened earlier -- in the tenth of a
second the interpreter takes to get that far -- and that handle reads every page
the process will ever hold. So `close` goes on in a child forked after the
prctl, whose memory is new and was never open to anyone, while the first process
only waits for it and ends as it ends. A process already tracing this one (or,
through PTRACE_O_TRACEFORK, the child) would see everything: either refuses.

Used by the gateway at start (`gateway/lifetime.run_daemon`) and by every CLI
command before it reads a secret (`cli/common`).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable
from typing import NoReturn

from bastion.core.errors import BastionError

PR_SET_PDEATHSIG, PR_SET_DUMPABLE = 1, 4
SI_KERNEL = 0x80  # siginfo's si_code of a signal the kernel sent (the terminal's ^C, ^\)
FORWARDED = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT})

_closed = False  # this process is the child `close` made: its memory is closed


class NotClosed(BastionError):
    """The memory could not be closed; the message says why, and nothing secret was read."""


def close(before_waiting: Callable[[int], None] = lambda child: None) -> None:
    """Close this process's memory (once per process): returns in the child, which
    goes on; the first process calls `before_waiting(child_pid)` and then only waits.
    Raises NotClosed if the prctl fails or a tracer is attached."""
    global _closed
    if _closed:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise NotClosed(
            f"cannot close this process's memory (PR_SET_DUMPABLE: "
            f"{os.strerror(ctypes.get_errno())})"
        )
    _refuse_a_tracer()
    sys.stdout.flush()
    sys.stderr.flush()
    watched = {signal.SIGCHLD, *FORWARDED}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, watched)
    parent = os.getpid()
    go_r, go_w = os.pipe()  # the child goes on once the parent has done `before_waiting`
    child = os.fork()
    if child:
        os.close(go_r)
        before_waiting(child)
        os.close(go_w)
        _stand_for(child, watched)
    os.close(go_w)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # never outlive the parent
    os.read(go_r, 1)  # EOF once the parent is past `before_waiting` (or gone)
    os.close(go_r)
    if os.getppid() != parent:
        os._exit(1)  # it was killed before the lines above
    _closed = True
    _refuse_a_tracer()


def _refuse_a_tracer() -> None:
    with open("/proc/self/status") as f:
        tracer = next((line.split()[1] for line in f if line.startswith("TracerPid:")), "0")
    if tracer != "0":
        raise NotClosed(
            f"process {tracer} is tracing this one (a debugger, strace, or another program "
            "of your uid): it could read any secret this process holds"
        )


def _stand_for(child: int, watched: set[signal.Signals]) -> NoReturn:
    """The parent's whole remaining life: hold nothing, pass on a signal sent to it
    by a process (the terminal's already reached the child, in the same process
    group), and end as the child ends -- its exit status, or its signal."""
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)  # only the child reads and writes the streams
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
