"""Docs that stay true: every section a docstring, comment or document cites exists.

A citation names a section by its heading, quoted: `docs/architecture.md,
"The gate"` (or `(architecture.md "The gate")`), `README, "Development"`,
a task page under docs/ as `docs/sandbox.md, "Isolation"` (or, inside docs/, as
its link: `[sandbox.md](sandbox.md), "Isolation"`), and inside a document
`see "The rooms"` for its own sections. A section is
cited by its whole heading or by its words before the first colon or comma
("The promises" for "The promises, and where each is kept"). Text is read with
its line breaks, indentation and comment marks folded away, so a citation
wrapped over two lines is still one.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
README = ROOT / "README.md"
CHANGELOG = ROOT / "CHANGELOG.md"
# The task pages the README links to, one per task (docs/architecture.md is the design).
PAGES = sorted(page for page in (ROOT / "docs").glob("*.md") if page != ARCHITECTURE)
README_MAX_LINES = 300

QUOTED = r"""(?:[,:]\s*|\s+)["“](?P<name>[^"”]+)["”]"""
BARE = r"""[,:]\s*(?P<bare>[^"“)]+)\)"""


def cited_as(name: str) -> re.Pattern[str]:
    """`NAME, "Section"`, `[x](NAME), "Section"` (a link) or `(NAME: Section)`."""
    return re.compile(rf"(?<![\w/.-]){name}\)?" + QUOTED + rf"|\({name}" + BARE)


CITES = {
    ARCHITECTURE: re.compile(r"architecture\.md" + QUOTED),
    README: cited_as(r"(?:\.\./)?README(?:\.md)?"),  # README, README.md, ../README.md
    **{page: cited_as(r"(?:docs/)?" + re.escape(page.name)) for page in PAGES},
}
# `docs/architecture.md, The gate`: a citation without quotes cannot be told
# from the sentence around it, so it is refused rather than guessed at.
UNQUOTED = re.compile(r"architecture\.md,\s+(?![\"“])(?P<rest>\S+(?: \S+){0,3})")
OWN = re.compile(r"""\bsee\s+["“](?P<name>[^"”]+)["”]""")
FOLD = re.compile(r"\s*\n\s*(?:#+\s)?\s*")


def sources() -> list[Path]:
    code = [path for top in ("bastion", "tests", "bench") for path in (ROOT / top).rglob("*.py")]
    this = Path(__file__).resolve()  # it writes citations to describe them
    docs = [README, ARCHITECTURE, CHANGELOG, *PAGES]
    return [path for path in sorted(code) if path != this] + docs


def folded(path: Path) -> str:
    return FOLD.sub(" ", path.read_text())


def headings(doc: Path) -> set[str]:
    """Each heading of a markdown file (code blocks skipped), and its short form."""
    names: set[str] = set()
    fenced = False
    for line in doc.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (match := re.match(r"#{1,6} (.+)", line)):
            heading = match[1].strip()
            names |= {heading, re.split(r"[:,]", heading, maxsplit=1)[0].strip()}
    return names


def citations(path: Path) -> list[tuple[Path, str]]:
    """(document, section) for every citation in `path`."""
    text = folded(path)
    found = [
        (doc, match["name"] or match.groupdict().get("bare") or "")
        for doc, pattern in CITES.items()
        for match in pattern.finditer(text)
    ]
    if path.suffix == ".md":
        found += [(path, match["name"]) for match in OWN.finditer(text)]
    return [(doc, name.strip()) for doc, name in found]


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_every_cited_section_exists() -> None:
    known = {doc: headings(doc) for doc in (ARCHITECTURE, README, CHANGELOG, *PAGES)}
    broken = [
        f"{shown(path)} cites {shown(doc)}, {name!r}"
        for path in sources()
        for doc, name in citations(path)
        if name not in known[doc]
    ]
    assert not broken, "no such section:\n" + "\n".join(broken)


def test_architecture_md_is_cited_with_the_section_quoted() -> None:
    bare = [
        f"{shown(path)}: docs/architecture.md, {match['rest']}"
        for path in sources()
        for match in UNQUOTED.finditer(folded(path))
    ]
    assert not bare, "quote the section's name:\n" + "\n".join(bare)


def test_the_citations_are_found_where_they_are() -> None:
    """Both checks would pass on nothing if the reader found no citation."""
    gate = citations(ROOT / "bastion" / "core" / "gate.py")
    assert (ARCHITECTURE, "The gate") in gate
    wrapped = citations(
        ROOT / "bastion" / "identity" / "resolver.py"
    )  # "Who is / asking" over two lines
    assert (ARCHITECTURE, "Who is asking") in wrapped
    audit, sandbox = ROOT / "docs" / "audit.md", ROOT / "docs" / "sandbox.md"
    assert (audit, "The witness") in citations(ROOT / "bastion" / "ops" / "doctor.py")
    approving = citations(ROOT / "docs" / "approving.md")  # a link, then the quoted section
    assert (sandbox, "The sandbox: one per run") in approving
    assert (README, "A first real setup") in approving
    assert (ARCHITECTURE, "The rooms") in citations(ARCHITECTURE)
    assert "The promises" in headings(ARCHITECTURE)


def test_the_history_lives_in_the_changelog() -> None:
    """architecture.md describes what is; what changed, issue by issue, is CHANGELOG.md."""
    history = [h for h in headings(ARCHITECTURE) if re.search(r"\(issue \d+\)", h)]
    assert not history, f"history headings in docs/architecture.md: {history}"
    issues = [int(n) for n in re.findall(r"^## Issue (\d+):", CHANGELOG.read_text(), re.M)]
    assert issues and issues == sorted(issues, reverse=True), "CHANGELOG.md: newest first"


def test_the_docs_carry_the_threat_model_status_prints() -> None:
    """One table, two places: `bastion status` prints `isolation.THREATS`, and
    docs/sandbox.md's "The sandbox" section shows the same rows, word for word."""
    from bastion.sandbox.threat_model import threat_table

    lines = (ROOT / "docs" / "sandbox.md").read_text().splitlines()
    table = threat_table()
    start = lines.index(table[0])
    assert lines[start : start + len(table)] == table


def test_the_docs_carry_what_a_run_can_read_write_and_reach() -> None:
    """One table, two places: `bastion status` prints `threat_model.ACCESS`, and
    docs/sandbox.md shows the same rows, word for word."""
    from bastion.sandbox.threat_model import access_table

    lines = (ROOT / "docs" / "sandbox.md").read_text().splitlines()
    table = access_table()
    start = lines.index(table[0])
    assert lines[start : start + len(table)] == table


def test_the_readme_is_short_and_links_every_page() -> None:
    """The README is what a newcomer reads first: what bastion is, the quick start,
    a first setup and the status; each task has its page under docs/, linked."""
    text = README.read_text()
    assert len(text.splitlines()) <= README_MAX_LINES, f"README.md: over {README_MAX_LINES} lines"
    assert PAGES, "no task pages under docs/"
    links = set(re.findall(r"\]\((docs/[^)#\s]+\.md)[)#]", text))
    unlinked = [shown(page) for page in [*PAGES, ARCHITECTURE] if shown(page) not in links]
    assert not unlinked, "README.md links none of:\n" + "\n".join(unlinked)
