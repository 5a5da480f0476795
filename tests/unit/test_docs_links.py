"""README.md and docs/ hold together: every relative link reaches a file (and its heading), the
README stays a front page, and the architecture page's package listing matches the tree."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from readme_blocks import DOCS, README, REPO_ROOT, doc_block

README_MAX_LINES = 420
"""The README is what a user reads first; everything longer belongs in docs/."""

DOCUMENTS = sorted([README, *DOCS.rglob("*.md")])
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
INLINE_CODE = re.compile(r"`[^`]*`")


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """The lines of `path` outside fenced code blocks, with their numbers, inline code removed.

    Args:
      path: A markdown file.

    Returns:
      (line number, text) pairs.
    """
    lines, fence = [], False
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.startswith("```"):
            fence = not fence
        elif not fence:
            lines.append((number, INLINE_CODE.sub("", line)))
    return lines


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of `path` (lowercase, punctuation dropped, spaces
    as hyphens; a repeated heading gets -1, -2, ...).

    Args:
      path: A markdown file.

    Returns:
      Every anchor of the file.
    """
    seen: dict[str, int] = {}
    for _, line in _heading_lines(path):
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        if count:
            seen[f"{slug}-{count}"] = 1
    return set(seen)


def _heading_lines(path: Path) -> list[tuple[int, str]]:
    """The heading lines of `path` (outside fenced code blocks), with their numbers."""
    lines, fence = [], False
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.startswith("```"):
            fence = not fence
        elif not fence and re.match(r"#{1,6} ", line):
            lines.append((number, line))
    return lines


def relative_links(path: Path) -> list[tuple[int, str]]:
    """The links of `path` that are not URLs: (line number, target)."""
    return [
        (number, target)
        for number, line in prose_lines(path)
        for target in LINK.findall(line)
        if not re.match(r"[a-z][a-z0-9+.-]*:", target)  # http:, https:, mailto:
    ]


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_relative_links_reach_a_file_and_heading(path: Path) -> None:
    broken = []
    for number, target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            broken.append(f"{path.name}:{number}: {target} ({linked} does not exist)")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{path.name}:{number}: {target} (no heading #{anchor} in {linked.name})")
    assert not broken, "\n".join(broken)


def test_every_document_is_linked_from_an_index() -> None:
    linked = {
        (index.parent / target.partition("#")[0]).resolve()
        for index in (README, DOCS / "README.md")
        for _, target in relative_links(index)
    }
    unlinked = [str(p.relative_to(REPO_ROOT)) for p in DOCUMENTS if p != README]
    unlinked = [name for name in unlinked if (REPO_ROOT / name).resolve() not in linked]
    assert not unlinked, f"linked from neither README.md nor docs/README.md: {unlinked}"


def test_readme_is_a_front_page() -> None:
    text = README.read_text()
    lines = len(text.splitlines())
    assert lines < README_MAX_LINES, f"README.md has {lines} lines; move sections into docs/"
    # The two commands that work from a fresh clone.
    assert "make demo" in text and "make test" in text


def test_architecture_listing_matches_the_package() -> None:
    listing = doc_block(DOCS / "architecture.md", "## The layer map", "text")
    lines = listing.splitlines()
    assert lines[0] == "replay_service/", lines[0]
    listed: list[Path] = []
    parents = [REPO_ROOT / "replay_service"]
    for line in lines[1:]:
        depth = (len(line) - len(line.lstrip(" "))) // 2
        name = line.split()[0]
        del parents[depth:]
        path = parents[-1] / name.rstrip("/")
        listed.append(path)
        if name.endswith("/"):
            parents.append(path)
    missing = [str(p.relative_to(REPO_ROOT)) for p in listed if not p.exists()]
    assert not missing, f"docs/architecture.md lists paths the package does not have: {missing}"
    package = REPO_ROOT / "replay_service"
    packages = {p.parent for p in package.rglob("__init__.py")} - {package}
    unlisted = sorted(str(p.relative_to(REPO_ROOT)) for p in packages - set(listed))
    assert not unlisted, f"docs/architecture.md does not list these packages: {unlisted}"
    modules = {p for p in package.rglob("*.py") if p.name != "__init__.py"}
    unlisted = sorted(str(p.relative_to(REPO_ROOT)) for p in modules - set(listed))
    assert not unlisted, f"docs/architecture.md does not list these modules: {unlisted}"
