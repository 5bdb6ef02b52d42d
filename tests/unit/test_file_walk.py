"""The bounded walk (`core/files.walk`) against the kernel itself: on a real file tree of
directories, files and symlinks, the path the walk finds is the one the kernel's own
open() reaches, or the walk refuses; and the gate's decision over what it found
(`gate.file_resolved`)."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from bastion.core.contract import Code
from bastion.core.files import (
    MAX_LINKS,
    FileKind,
    FileOp,
    Lstat,
    Node,
    Resolution,
    follows_last,
    parse_files,
    walk,
)
from bastion.core.gate import file_resolved
from bastion.core.policy import Account, ApprovalMode


def on_disk(path: str, follow: bool = True) -> Resolution:
    """Drive the walk with this machine's own lstat and readlink: what an OpenSSH
    sftp-server would answer for the same tree."""
    steps = walk(path, follow)
    ask = next(steps)
    try:
        while True:
            if isinstance(ask, Lstat):
                ask = steps.send(tuple(node(p) for p in ask.paths))
            else:
                try:
                    ask = steps.send(os.readlink(ask.path))
                except OSError:
                    ask = steps.send(None)
    except StopIteration as end:
        return end.value


def node(path: str) -> Node:
    """As OpenSSH's sftp-server answers an lstat: ENOENT, ENOTDIR and ELOOP read as
    "no such file", other errors as what they are."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return Node.MISSING
    except OSError as exc:
        return Node.MISSING if exc.errno == errno.ELOOP else Node.UNKNOWN
    if stat.S_ISDIR(mode):
        return Node.DIRECTORY
    return Node.LINK if stat.S_ISLNK(mode) else Node.OTHER


def chain(area: Path, n: int, dest: Path, name: str = "l") -> Path:
    """n symlinks in `area`, each to the one before, the first to `dest`."""
    prev = dest
    for i in range(n):
        link = area / f"{name}{i}"
        link.symlink_to(prev)
        prev = link
    return prev


def test_a_chain_the_kernel_follows_past_sftp_servers_realpath_is_refused(tmp_path: Path) -> None:
    """The review's finding: 34..40 links, which open() follows and OpenSSH's realpath
    does not (it says "no such file"); the walk neither guesses nor falls back."""
    (tmp_path / "out").mkdir()
    victim = tmp_path / "out" / "victim"
    victim.write_text("x")
    for n in (34, 40):
        top = chain(tmp_path, n, victim, f"c{n}_")
        assert os.path.realpath(top) == str(victim)  # the kernel gets there
        found = on_disk(str(top))
        assert found.path is None and f"more than {MAX_LINKS} symlinks" in found.why
    short = chain(tmp_path, 5, victim, "s")
    assert on_disk(str(short)) == Resolution(str(victim), links=5)  # the control


def test_a_loop_a_dangling_link_and_an_unreadable_component_are_refused(tmp_path: Path) -> None:
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    assert on_disk(str(tmp_path / "a" / "x")).path is None
    (tmp_path / "dang").symlink_to(tmp_path / "nowhere" / "new")
    dangling = on_disk(str(tmp_path / "dang"))
    assert dangling.path is None and "does not exist" in dangling.why
    # ...but a name the agent spelled that does not exist yet is a file to create
    (tmp_path / "d").mkdir()
    assert on_disk(str(tmp_path / "d" / "new")) == Resolution(str(tmp_path / "d" / "new"))
    assert on_disk(str(tmp_path / "d" / "no" / "new")).path == str(tmp_path / "d/no/new")


def test_the_last_name_is_acted_on_itself_where_the_call_does_not_follow_it(
    tmp_path: Path,
) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "dirlink").symlink_to(tmp_path / "real")
    (tmp_path / "real" / "f").write_text("x")
    (tmp_path / "real" / "flink").symlink_to("/etc/passwd")
    path = str(tmp_path / "dirlink" / "flink")
    assert on_disk(path, follow=False) == Resolution(str(tmp_path / "real" / "flink"), links=1)
    assert on_disk(path, follow=True).path == os.path.realpath("/etc/passwd")
    for kind in (FileKind.REMOVE, FileKind.RENAME, FileKind.MKDIR, FileKind.RMDIR):
        assert not follows_last(FileOp(kind, path))
    for kind in (FileKind.READ, FileKind.WRITE, FileKind.LIST, FileKind.SETSTAT):
        assert follows_last(FileOp(kind, path))
    assert not follows_last(FileOp(FileKind.STAT, path, follow=False))


def test_dot_dot_after_a_link_is_taken_as_the_kernel_takes_it(tmp_path: Path) -> None:
    (tmp_path / "a" / "deep").mkdir(parents=True)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "up").symlink_to("../a/deep")
    (tmp_path / "a" / "t").write_text("x")
    # b/up -> a/deep; "../t" is spliced after it, so deep/.. is a, then t
    (tmp_path / "b" / "rel").symlink_to("up/../t")
    assert on_disk(str(tmp_path / "b" / "rel")).path == str(tmp_path / "a" / "t")
    assert os.path.realpath(tmp_path / "b" / "rel") == str(tmp_path / "a" / "t")


def test_the_walk_asks_each_batch_of_components_at_once() -> None:
    """One round trip for a path with no link in it: every prefix in one Lstat."""
    steps = walk("/srv/app/logs/x", True)
    ask = next(steps)
    assert ask == Lstat(("/srv", "/srv/app", "/srv/app/logs", "/srv/app/logs/x"))
    with pytest.raises(StopIteration) as end:
        steps.send((Node.DIRECTORY, Node.DIRECTORY, Node.DIRECTORY, Node.OTHER))
    assert end.value.value == Resolution("/srv/app/logs/x")


def test_answers_that_do_not_fit_the_questions_are_refused() -> None:
    steps = walk("/a/b", True)
    next(steps)
    with pytest.raises(StopIteration) as end:
        steps.send((Node.DIRECTORY,))
    assert end.value.value.path is None


# -- against the kernel, over random trees ------------------------------------------------

NAMES = st.sampled_from(["a", "b", "c"])
TARGETS = st.lists(st.sampled_from(["a", "b", "c", "..", ".", "x", "/ROOT"]), max_size=4)


@st.composite
def trees(draw: st.DrawFn) -> list[tuple[str, str, str]]:
    """Entries to make, in order: (kind, relative path, link text)."""
    out = []
    for _ in range(draw(st.integers(1, 16))):
        where = "/".join(draw(st.lists(NAMES, min_size=1, max_size=2)))
        kind = draw(st.sampled_from(["dir", "link", "link", "file"]))
        text = "/".join(draw(TARGETS)) or "."
        out.append((kind, where, text))
    return out


def build(root: Path, entries: list[tuple[str, str, str]]) -> None:
    for kind, where, text in entries:
        p = root / where
        try:
            if kind == "dir":
                p.mkdir(parents=True)
            elif kind == "file":
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_text("f")
            else:
                p.parent.mkdir(parents=True, exist_ok=True)
                p.symlink_to(text.replace("/ROOT", str(root)))
        except OSError:
            continue  # exists already, or a parent is a file or a link: skip it


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(entries=trees(), asked=st.lists(NAMES, min_size=1, max_size=4))
def test_what_the_walk_finds_is_where_open_lands(
    tmp_path_factory: pytest.TempPathFactory, entries: list[tuple[str, str, str]], asked: list[str]
) -> None:
    """Whatever the tree: a path the walk finds is where the kernel's open(O_CREAT)
    reads or creates, and a path it does not find, open either fails or would land
    somewhere the walk would have had to guess."""
    root = tmp_path_factory.mktemp("walk")
    build(root, entries)
    path = str(root / "/".join(asked))
    found = on_disk(path)
    event("refused" if found.path is None else f"found, links={min(found.links, 3)}")
    if found.path is None:
        return  # refused: never judged, never sent
    assert "/.." not in found.path and "/./" not in found.path
    prefix = os.path.dirname(found.path)
    assert os.path.realpath(prefix) == prefix  # no symlink anywhere on the way
    before = sorted(str(p) for p in root.rglob("*"))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o600)
    except OSError as exc:
        # the kernel refused where the walk found no such name: nothing was made
        assert exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.ELOOP), exc
        assert sorted(str(p) for p in root.rglob("*")) == before
        return
    try:
        landed = os.path.realpath(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)
    assert landed == found.path


# -- the gate over what the walk found ------------------------------------------------------


def account(approval: ApprovalMode) -> Account:
    files = parse_files({"read": ["/srv/**"], "write": ["/srv/rw/**"]})
    return Account("u", "k", approval, None, (), (), host="web1", files=files)


def test_an_unresolved_path_is_refused_in_words_that_say_what_to_do() -> None:
    op = FileOp(FileKind.WRITE, "/srv/rw/l35")
    refused = file_resolved(account(ApprovalMode.SESSION), op, (Resolution(None, "a loop"),))
    assert refused is not None and refused.code is Code.POLICY_DENIED
    assert "cannot tell exactly where" in refused.message and "a loop" in refused.message


def test_where_a_path_leads_is_judged_as_the_path_is() -> None:
    op = FileOp(FileKind.WRITE, "/srv/rw/link")
    session = account(ApprovalMode.SESSION)
    assert file_resolved(session, op, (Resolution("/srv/rw/real", links=1),)) is None
    out = file_resolved(session, op, (Resolution("/home/u/.bashrc", links=1),))
    assert out is not None and "where the target resolves it" in out.message


def test_a_file_card_must_show_the_path_the_operation_acts_on() -> None:
    """A per-command write through a symlink: its card showed the link, so it is refused
    even where the link leads to an allowed path, and the message names that path."""
    op = FileOp(FileKind.WRITE, "/srv/rw/link", size=1, sha256="0" * 64)
    per_command = account(ApprovalMode.PER_COMMAND)
    moved = file_resolved(per_command, op, (Resolution("/srv/rw/real", links=1),))
    assert moved is not None and moved.code is Code.POLICY_DENIED
    assert '"/srv/rw/real" itself' in moved.message
    assert file_resolved(per_command, op, (Resolution("/srv/rw/link"),)) is None
    # a read needs no card, so it may go where its link leads (both paths allowed)
    read = FileOp(FileKind.READ, "/srv/rw/link")
    assert file_resolved(per_command, read, (Resolution("/srv/rw/real", links=1),)) is None
    rename = FileOp(FileKind.RENAME, "/srv/rw/a", to="/srv/rw/b")
    found = (Resolution("/srv/rw/a"), Resolution("/srv/rw/b"))
    assert file_resolved(per_command, rename, found) is None


def test_setstat_digests_cover_every_change_and_old_digests_stay() -> None:
    plain = FileOp(FileKind.SETSTAT, "/srv/rw/f", mode=0o644)
    assert plain.digest == FileOp(FileKind.SETSTAT, "/srv/rw/f", mode=0o644, follow=True).digest
    digests = {
        plain.digest,
        FileOp(FileKind.SETSTAT, "/srv/rw/f", mode=0o644, owner=(0, 0)).digest,
        FileOp(FileKind.SETSTAT, "/srv/rw/f", mode=0o644, times=(1, 2)).digest,
        FileOp(FileKind.SETSTAT, "/srv/rw/f", mode=0o644, size=0).digest,
        FileOp(FileKind.SETSTAT, "/srv/rw/f", mode=0o644, follow=False).digest,
    }
    assert len(digests) == 5
    shown = FileOp(FileKind.SETSTAT, "/f", owner=(1, 2), times=(3, 4), follow=False).as_json()
    assert shown["owner"] == "1:2" and shown["times"] == {"atime": 3, "mtime": 4}
