"""The subject walk over a process chain (no processes needed: chains are records)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bastion.core.subject import ExecWatch, Observed, ProcessInfo, SubjectKind
from bastion.identity import DEFAULT_TERMINAL_HOSTS, IdentityError, Resolver, name_matcher


def proc(pid: int, exe: str, name: str | None = None) -> ProcessInfo:
    base = exe.rsplit("/", 1)[-1] if exe else "?"
    return ProcessInfo(pid, pid - 1, float(pid), 1000, exe, None, name or base, ())


PROXY, SSH = proc(900, "/usr/bin/python3.11"), proc(800, "/usr/bin/ssh")
BASH, TMUX = proc(700, "/usr/bin/bash"), proc(600, "/usr/bin/tmux")
AGENT, INIT = proc(650, "/usr/bin/node"), proc(1, "/sbin/init")


@pytest.mark.parametrize(
    "chain,index,kind",
    [
        ([PROXY, SSH, AGENT, BASH, TMUX, INIT], 2, SubjectKind.PROCESS),
        ([PROXY, SSH, BASH, AGENT, TMUX, INIT], 3, SubjectKind.PROCESS),
        ([PROXY, SSH, BASH, TMUX, INIT], 2, SubjectKind.TERMINAL_SHELL),  # the pane's shell
        ([PROXY, SSH, BASH, proc(500, "/usr/sbin/sshd"), INIT], 2, SubjectKind.TERMINAL_SHELL),
        ([PROXY, SSH, BASH, proc(5, "/usr/bin/env"), INIT], 3, SubjectKind.TERMINAL_SHELL),
        ([PROXY, SSH, proc(700, "/usr/bin/python3", name="bash"), INIT], 2, SubjectKind.PROCESS),
        ([PROXY, SSH, proc(700, "", name="bash"), BASH, INIT], 2, SubjectKind.PROCESS),
    ],
    ids=[
        "agent above ssh",
        "agent above a shell",
        "shell in tmux",
        "shell in an ssh login",
        "wrappers up to init",
        "renamed bash is not a wrapper",
        "an unreadable exe is not a wrapper",
    ],
)
def test_the_subject_is_above_ssh_past_wrappers_and_below_terminal_hosts(
    chain: list[ProcessInfo], index: int, kind: SubjectKind
) -> None:
    assert Resolver().subject_index(chain) == (index, kind)


@pytest.mark.parametrize("host", [TMUX, INIT, proc(42, "/usr/bin/sudo")])
def test_ssh_started_by_a_terminal_host_has_no_subject(host: ProcessInfo) -> None:
    with pytest.raises(IdentityError, match="terminal host"):
        Resolver().subject_index([PROXY, SSH, host, INIT])


def test_the_lists_are_configurable() -> None:
    resolver = Resolver(wrappers=frozenset({"node"}), terminal_hosts=frozenset({"bash"}))
    assert resolver.subject_index([PROXY, SSH, AGENT, BASH, INIT]) == (
        2,
        SubjectKind.TERMINAL_SHELL,
    )


def test_the_resolver_observes_and_core_decides() -> None:
    """What `Resolver.observe` says of each process is all `core.subject.subject_index`
    is given: judged by the executable the kernel resolved, never the process name."""
    r = Resolver()
    assert r.observe(SSH) == Observed(name="ssh", ssh=True, wrapper=False, terminal_host=False)
    assert r.observe(BASH) == Observed(name="bash", ssh=False, wrapper=True, terminal_host=False)
    assert r.observe(TMUX) == Observed(name="tmux", ssh=False, wrapper=False, terminal_host=True)
    assert r.observe(proc(1, "")).terminal_host  # pid 1, whatever its executable
    renamed = proc(700, "/usr/bin/python3", name="ssh")
    assert r.observe(renamed) == Observed("python3", ssh=False, wrapper=False, terminal_host=False)
    assert r.observe(proc(700, "", name="bash")) == Observed("", False, False, False)


class Images:
    """The exec each process is in, as the test says (identity.Images reads /proc)."""

    def __init__(self) -> None:
        self.now: dict[tuple[int, float], str] = {}

    def current(self, pid: int, start_time: float) -> tuple[str, ExecWatch]:
        return self.now.get((pid, start_time), f"unseen-{pid}"), ExecWatch.MEMORY

    def forget(self, pid: int, start_time: float) -> None:
        self.now.pop((pid, start_time), None)


def test_a_registered_front_acts_for_its_parent_while_it_is_in_the_exec_it_registered() -> None:
    """`bastion mcp` registers itself: the MCP client above it is the subject. The same
    pid and start time in another exec -- even of the same executable -- is itself again."""
    front = proc(750, "/usr/bin/python3.11")
    client = proc(650, "/usr/bin/node")
    resolver = Resolver()
    resolver.images = images = Images()  # type: ignore[assignment]
    chain = [PROXY, SSH, front, client, BASH, TMUX, INIT]
    assert resolver.subject_index(chain) == (2, SubjectKind.PROCESS)  # not registered
    images.now[(front.pid, front.start_time)] = "first-exec"
    resolver.fronts[(front.pid, front.start_time)] = "first-exec"
    assert resolver.subject_index(chain) == (3, SubjectKind.PROCESS)
    images.now[(front.pid, front.start_time)] = "second-exec"  # it exec'd, python3.11 again
    assert resolver.subject_index(chain) == (2, SubjectKind.PROCESS)
    images.now[(front.pid, front.start_time)] = "first-exec"
    other = ProcessInfo(750, 749, 7.0, 1000, front.exe, None, "python3.11", ())  # pid reused
    assert resolver.subject_index([PROXY, SSH, other, client, INIT]) == (2, SubjectKind.PROCESS)
    resolver.forget(front.pid, front.start_time)
    assert resolver.subject_index(chain) == (2, SubjectKind.PROCESS)


@pytest.mark.parametrize(
    "exe",
    [
        "/usr/bin/vim.basic",  # Debian's vim, through its alternatives
        "/usr/bin/vim.gtk3",
        "/usr/bin/nvim",
        "/usr/bin/emacs-gtk",
        "/usr/local/bin/emacs-29.1",  # built from source
        "/usr/bin/dvtm",
        "/usr/share/code/code",  # VS Code's pty host is its electron binary
        "/usr/bin/kgx",  # GNOME Console
        "/usr/lib/openssh/sshd-session",  # OpenSSH >= 9.8
    ],
)
def test_editors_and_consoles_that_host_terminals_are_terminal_hosts(exe: str) -> None:
    """Each of these runs many windows, each with its own shell: approving one
    window must not approve the others."""
    shell = proc(700, "/usr/bin/bash")
    assert Resolver().subject_index([PROXY, SSH, shell, proc(600, exe), INIT]) == (
        2,
        SubjectKind.TERMINAL_SHELL,
    )


@pytest.mark.parametrize("exe", ["/usr/bin/emacsclient", "/usr/bin/node", "/usr/bin/vimtutor"])
def test_a_glob_matches_whole_names_only(exe: str) -> None:
    assert name_matcher(DEFAULT_TERMINAL_HOSTS).match(exe.rsplit("/", 1)[-1]) is None
    assert Resolver().subject_index([PROXY, SSH, proc(600, exe), INIT]) == (2, SubjectKind.PROCESS)


def test_terminal_hosts_given_at_start_may_be_globs() -> None:
    resolver = Resolver(terminal_hosts=DEFAULT_TERMINAL_HOSTS | {"my-term-*"})
    chain = [PROXY, SSH, BASH, proc(600, "/opt/my-term-2/my-term-2.1"), INIT]
    assert resolver.subject_index(chain) == (2, SubjectKind.TERMINAL_SHELL)


def test_a_start_time_survives_a_wall_clock_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A real bench run saw the VM's clock stepped by 12 s: psutil's create_time (the
    wall clock minus the uptime, read afresh) moved for every process, and 32 approved
    agents were asked again. The start time is now the process's start in ticks since
    boot on one boot-time reading, so a step in /proc/stat's btime changes nothing."""
    import os

    from bastion.identity import resolver as identity

    before = identity._start_time(os.getpid())
    stat = Path("/proc/stat").read_text()
    btime = next(int(line.split()[1]) for line in stat.splitlines() if line.startswith("btime"))
    real_read_text = Path.read_text

    def stepped(self: Path, *args: object, **kwargs: object) -> str:
        if str(self) == "/proc/stat":
            return stat.replace(f"btime {btime}", f"btime {btime + 12}")
        return real_read_text(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "read_text", stepped)
    assert Path("/proc/stat").read_text() != stat  # the step is visible
    assert identity._start_time(os.getpid()) == before
    assert identity.alive(os.getpid(), before)
    assert identity._start_time(2**22 + 7) is None  # no such process
