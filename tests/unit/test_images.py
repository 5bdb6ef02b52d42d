"""Which exec a process is in (bastion/identity/images.py), the sha256 cache that must not go
stale, the JSON of a path that is not UTF-8, and the approval book ending every
grant of a process that exec'd. Real child processes where /proc is the point."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from bastion.core.cards import Card
from bastion.core.contract import Failure
from bastion.core.events import Result
from bastion.core.gate import Request
from bastion.core.subject import ExecWatch, ProcessInfo, Subject, exact_base64, shown_path
from bastion.gateway.service import AgentConn, Case, new_request_id
from bastion.identity import images as images_mod
from bastion.identity.images import CTIME_MARGIN_NS, ExeHasher, Images, layout
from tests.unit.fakes import (
    PASSPHRASE,
    FakeGateway,
    FakeJournal,
    FakeOutbound,
    FakePolicy,
    FakeProcessTree,
    FakeVault,
    idle,
    policy,
)

# -- the sha256 cache ------------------------------------------------------------------------


def hash_of(path: Path, hasher: ExeHasher) -> str | None:
    fd = os.open(path, os.O_RDONLY)
    try:
        return hasher.digest_fd(fd)
    finally:
        os.close(fd)


def rewrite_in_place(path: Path) -> None:
    """Same size, atime and mtime put back: only the ctime moves."""
    before = os.stat(path)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        before.st_ino,
        before.st_size,
        before.st_mtime_ns,
    )


def test_a_file_rewritten_with_the_same_size_and_mtime_is_hashed_anew(tmp_path: Path) -> None:
    program = tmp_path / "program"
    program.write_bytes(b"\x7fELF" + bytes(range(256)) * 64)
    later = os.stat(program).st_ctime_ns + 10 * CTIME_MARGIN_NS
    hasher = ExeHasher(clock=lambda: later)  # the file looks old: its hash is cached
    first = hash_of(program, hasher)
    assert first == hashlib.sha256(program.read_bytes()).hexdigest() and hasher._cache
    rewrite_in_place(program)
    assert hash_of(program, hasher) == hashlib.sha256(program.read_bytes()).hexdigest() != first


def test_a_hash_taken_in_the_tick_of_a_write_is_not_cached(tmp_path: Path) -> None:
    """A second write in the same timestamp tick would leave every key unchanged."""
    program = tmp_path / "program"
    program.write_bytes(b"fresh")
    soon = os.stat(program).st_ctime_ns + CTIME_MARGIN_NS // 2
    hasher = ExeHasher(clock=lambda: soon)
    assert hash_of(program, hasher) == hashlib.sha256(b"fresh").hexdigest()
    assert hasher._cache == {}


def test_a_file_written_while_it_is_hashed_is_hashed_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    program = tmp_path / "program"
    program.write_bytes(b"before")
    real = images_mod._sha256
    calls: list[int] = []

    def racing(fd: int) -> str:
        calls.append(fd)
        if len(calls) == 1:
            program.write_bytes(b"after!")  # same size, written during the first read
        return real(fd)

    monkeypatch.setattr(images_mod, "_sha256", racing)
    assert hash_of(program, ExeHasher()) == hashlib.sha256(b"after!").hexdigest()
    assert len(calls) == 2


# -- which exec a process is in ---------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import os, sys, threading
    if sys.argv[1] == "threads":
        threading.Thread(target=threading.Event().wait, daemon=True).start()
    print("ready", flush=True)
    line = sys.stdin.readline()
    if line.startswith("exec"):
        os.execv(sys.executable, [sys.executable, *sys.argv])
    """
)


class Child:
    """A python that waits; told "exec", it execs the same interpreter and script."""

    def __init__(self, tmp_path: Path, mode: str, launcher: tuple[str, ...] = ()) -> None:
        script = tmp_path / "child.py"
        script.write_text(CHILD)
        self.proc = subprocess.Popen(
            [*launcher, sys.executable, str(script), mode],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.ready()

    def ready(self) -> None:
        assert self.proc.stdout is not None and self.proc.stdout.readline() == "ready\n"

    @property
    def key(self) -> tuple[int, float]:
        return (self.proc.pid, 0.0)  # Images keys by (pid, start); the start is ours to pick

    def exec(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("exec\n")
        self.proc.stdin.flush()
        self.ready()

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def children(tmp_path: Path) -> Iterator[list[Child]]:
    made: list[Child] = []
    yield made
    for c in made:
        c.close()


def test_an_exec_of_the_same_interpreter_is_a_new_image(
    tmp_path: Path, children: list[Child]
) -> None:
    child = Child(tmp_path, "single")
    children.append(child)
    watcher = Images()
    name, watch = watcher.current(*child.key)
    assert watch is ExecWatch.MEMORY
    assert [watcher.current(*child.key) for _ in range(5)] == [(name, watch)] * 5
    child.exec()
    again, _ = watcher.current(*child.key)
    assert again != name
    assert watcher.current(*child.key)[0] == again  # and that one is kept


def test_with_randomisation_off_the_layout_repeats_but_the_address_space_is_gone(
    tmp_path: Path, children: list[Child]
) -> None:
    """Why the layout alone would not do: `setarch -R` makes a same-program exec
    land address for address where the last one did."""
    if shutil.which("setarch") is None:
        pytest.skip("setarch is not installed (util-linux)")
    child = Child(tmp_path, "single", launcher=("setarch", "-R"))
    children.append(child)
    watcher = Images()
    name, _ = watcher.current(*child.key)
    before = layout(child.proc.pid)
    child.exec()
    assert layout(child.proc.pid) == before
    assert watcher.current(*child.key)[0] != name


def test_a_thread_shows_that_no_exec_happened_where_memory_cannot_be_read(
    tmp_path: Path, children: list[Child], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another user's process and a gateway that is not root: no layout, no address
    space -- but its threads are listed for anyone, and an exec ends them."""
    monkeypatch.setattr(images_mod, "layout", lambda pid: None)
    threaded, single = Child(tmp_path, "threads"), Child(tmp_path, "single")
    children += [threaded, single]
    watcher = Images()
    name, watch = watcher.current(*threaded.key)
    assert watch is ExecWatch.THREAD
    assert watcher.current(*threaded.key) == (name, ExecWatch.THREAD)
    threaded.exec()
    assert watcher.current(*threaded.key)[0] != name

    # Nothing to go by: every sighting is a new image, so every request asks.
    seen = {watcher.current(*single.key) for _ in range(3)}
    assert len(seen) == 3 and {w for _, w in seen} == {ExecWatch.NOTHING}


LOOKER = textwrap.dedent(
    """
    import json, sys
    from bastion.images import Images
    watcher, pids = Images(), [int(p) for p in sys.argv[1:]]
    for _ in sys.stdin:
        seen = [watcher.current(pid, 0.0) for pid in pids]
        print(json.dumps([(name, watch.value) for name, watch in seen]), flush=True)
    """
)


def test_another_users_process_is_seen_by_its_threads_alone(
    tmp_path: Path, children: list[Child]
) -> None:
    """For real: the looker runs as nobody, the children as root. Their memory is not
    the looker's to read; their thread lists are."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv (util-linux) to look as another user")
    package = str(Path(images_mod.__file__).parents[1])
    looker = [
        *("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"),
        *("env", f"PYTHONPATH={package}", "/usr/bin/python3", "-c", LOOKER),
    ]
    probe = subprocess.run([*looker[:-1], "import bastion.images"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"nobody cannot import bastion from {package}")
    threaded, single = Child(tmp_path, "threads"), Child(tmp_path, "single")
    children += [threaded, single]
    proc = subprocess.Popen(
        [*looker, str(threaded.proc.pid), str(single.proc.pid)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    ask, answer = proc.stdin, proc.stdout
    assert ask is not None and answer is not None

    def look() -> list[tuple[str, str]]:
        ask.write("look\n")
        ask.flush()
        return [(name, watch) for name, watch in json.loads(answer.readline())]

    try:
        (t1, s1), (t2, s2) = look(), look()
        assert t1 == t2 and t1[1] == ExecWatch.THREAD.value
        assert s1[1] == s2[1] == ExecWatch.NOTHING.value and s1[0] != s2[0]
        threaded.exec()
        (t3, _) = look()
        assert t3[0] != t1[0]
    finally:
        proc.kill()
        proc.wait(10)


def test_a_forgotten_process_leaves_no_descriptor(tmp_path: Path, children: list[Child]) -> None:
    child = Child(tmp_path, "single")
    children.append(child)
    before = len(os.listdir("/proc/self/fd"))
    watcher = Images()
    watcher.current(*child.key)
    assert len(os.listdir("/proc/self/fd")) == before + 1  # its address space, held
    watcher.forget(*child.key)
    assert len(os.listdir("/proc/self/fd")) == before and watcher.known() == set()


# -- a path that is not UTF-8 ------------------------------------------------------------------


def test_a_path_that_is_not_utf8_is_shown_escaped_and_kept_exactly() -> None:
    raw = b"/opt/bin\xff\xfe/agent"
    exe = os.fsdecode(raw)
    assert shown_path(exe) == "/opt/bin\\xff\\xfe/agent"
    assert base64.b64decode(exact_base64(exe) or "") == raw
    assert exact_base64("/usr/bin/caf\u00e9") is None  # UTF-8 is kept as it is
    info = ProcessInfo(7, 1, 1.0, 1000, exe, None, "agent", (exe, "--flag"))
    doc = info.as_json()
    assert doc["exe"] == "/opt/bin\\xff\\xfe/agent" and doc["cmdline"][1] == "--flag"
    assert [base64.b64decode(a) for a in doc["cmdline_base64"]] == [raw, b"--flag"]
    subject = Subject(7, 1.0, exe, None, 1000, "n1")
    assert base64.b64decode(subject.as_json()["exe_base64"]) == raw
    assert "exe_base64" not in Subject(7, 1.0, "/usr/bin/node", None, 1000, "n1").as_json()


# -- the approval book -------------------------------------------------------------------------


class Book:
    """One unlocked lifetime over fakes, and requests whose subject is in a given exec."""

    def __init__(self) -> None:
        self.tree = FakeProcessTree()
        self.life = FakeGateway(
            FakeVault(), FakePolicy(policy()), FakeJournal(), self.tree, FakeOutbound(auto=True)
        )

    def ask(self, conn: AgentConn, image: str) -> asyncio.Task[Result | Failure]:
        """`uptime` (preapproved on both accounts) from `conn`, its process in `image`."""
        edges = replace(self.life.service.edges, refresh=lambda s: replace(s, image=image))
        self.life.service.edges = edges
        subject = edges.refresh(conn.peer.subject)
        req = Request(new_request_id(), conn.host, conn.user, b"uptime", subject.key)
        return asyncio.ensure_future(
            self.life.service.handle(Case(conn, req, None, req.request_id))
        )

    async def card(self) -> Card:
        await idle()
        pending = self.life.book.pending()
        assert pending, "no card was raised"
        return pending[-1]


async def test_an_exec_ends_every_grant_of_the_process_and_each_next_card_says_why() -> None:
    book = Book()
    await book.life.authority.unlock(PASSPHRASE)
    agent, bystander = book.tree.spawn(), book.tree.spawn()
    conns = {
        (a.pid, user): book.life.connect(a, user=user)
        for a in (agent, bystander)
        for user in ("deploy", "ops")
    }
    for conn in conns.values():  # four grants: two entries for each of two processes
        task = book.ask(conn, "first-exec")
        card = await book.card()
        assert card.reason is None
        book.life.authority.answer(card.id, True)
        assert isinstance(await task, Result)
    assert len(book.life.book.sessions()) == 4

    task = book.ask(conns[(agent.pid, "deploy")], "second-exec")  # it exec'd
    card = await book.card()
    assert card.reason is not None and card.reason.value == "process_changed"
    left = sorted((s.pid, g.user) for g, s in book.life.book.sessions())
    assert left == [(bystander.pid, "deploy"), (bystander.pid, "ops")]  # its ops grant too
    book.life.authority.answer(card.id, False)
    await task

    task = book.ask(conns[(agent.pid, "ops")], "second-exec")
    card = await book.card()
    assert card.reason is not None and card.reason.value == "process_changed"
    book.life.authority.answer(card.id, False)
    await task
