"""Docs that stay true: every section a docstring, comment or document cites exists.

A citation names a section by its heading, quoted: `docs/architecture.md,
"The gate"` (or `(architecture.md "The gate")`), `README, "Slow commands"`,
and inside a document `see "The rooms"` for its own sections. A section is
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

QUOTED = r"""(?:[,:]\s*|\s+)["“](?P<name>[^"”]+)["”]"""
CITES = {
    ARCHITECTURE: re.compile(r"architecture\.md" + QUOTED),
    README: re.compile(r"\bREADME" + QUOTED + r"|\(README[,:]\s*(?P<bare>[^\"“)]+)\)"),
}
# `docs/architecture.md, The gate`: a citation without quotes cannot be told
# from the sentence around it, so it is refused rather than guessed at.
UNQUOTED = re.compile(r"architecture\.md,\s+(?![\"“])(?P<rest>\S+(?: \S+){0,3})")
OWN = re.compile(r"""\bsee\s+["“](?P<name>[^"”]+)["”]""")
FOLD = re.compile(r"\s*\n\s*(?:#+\s)?\s*")


def sources() -> list[Path]:
    code = sorted((ROOT / "bastion").rglob("*.py")) + sorted((ROOT / "tests").rglob("*.py"))
    this = Path(__file__).resolve()  # it writes citations to describe them
    return [path for path in code if path != this] + [README, ARCHITECTURE, CHANGELOG]


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
    known = {doc: headings(doc) for doc in (ARCHITECTURE, README, CHANGELOG)}
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
    assert (README, "The journal") in citations(ROOT / "bastion" / "ops" / "doctor.py")
    assert (ARCHITECTURE, "The rooms") in citations(ARCHITECTURE)
    assert "The promises" in headings(ARCHITECTURE)


def test_the_history_lives_in_the_changelog() -> None:
    """architecture.md describes what is; what changed, issue by issue, is CHANGELOG.md."""
    history = [h for h in headings(ARCHITECTURE) if re.search(r"\(issue \d+\)", h)]
    assert not history, f"history headings in docs/architecture.md: {history}"
    issues = [int(n) for n in re.findall(r"^## Issue (\d+):", CHANGELOG.read_text(), re.M)]
    assert issues and issues == sorted(issues, reverse=True), "CHANGELOG.md: newest first"


def test_the_readme_carries_the_threat_model_status_prints() -> None:
    """One table, two places: `bastion status` prints `isolation.THREATS`, and the
    README's "The sandbox" section shows the same rows, word for word."""
    from bastion.sandbox.threat_model import threat_table

    lines = README.read_text().splitlines()
    table = threat_table()
    start = lines.index(table[0])
    assert lines[start : start + len(table)] == table
