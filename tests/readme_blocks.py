"""Code blocks of README.md and docs/*.md, for tests that run them as written (small sizes)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
README = REPO_ROOT / "README.md"
DOCS = REPO_ROOT / "docs"


def doc_block(path: Path, heading: str, language: str = "python", index: int = 0) -> str:
    """The `index`-th ```language block of the section `heading` of the markdown file `path`.

    The section runs up to the next heading of the same or a higher level; lines starting with
    '#' inside code blocks are not headings.

    Args:
      path: The markdown file, e.g. `DOCS / "operations.md"`.
      heading: The whole heading line, e.g. "## Ray".
      language: The fence's language tag.
      index: Which block of the section (0: the first).

    Returns:
      The block's text, without its fences.

    Raises:
      AssertionError: If the heading or the block is missing (the file changed).
    """
    level = len(heading.split(" ", 1)[0])
    blocks: list[str] = []
    inside_section = False
    fence: str | None = None  # the language of the block being read
    lines: list[str] = []
    for line in path.read_text().splitlines(keepends=True):
        if fence is None and line.startswith("```"):
            fence, lines = line[3:].strip(), []
        elif fence is not None and line.startswith("```"):
            if inside_section and fence == language:
                blocks.append("".join(lines))
            fence = None
        elif fence is not None:
            lines.append(line)
        elif line.rstrip("\n") == heading:
            inside_section = True
        elif inside_section and re.match(rf"#{{1,{level}}} ", line):
            break
    assert inside_section, f"{path.name} has no heading {heading!r}"
    assert len(blocks) > index, f"{path.name}'s {heading!r} has no {language} block {index}"
    return blocks[index]


def readme_block(heading: str, language: str = "python", index: int = 0) -> str:
    """The `index`-th ```language block of README.md's section `heading` (see `doc_block`)."""
    return doc_block(README, heading, language, index)


def shrink(code: str, replacements: dict[str, str]) -> str:
    """Applies each replacement, which must match exactly once (the text changed otherwise)."""
    for old, new in replacements.items():
        assert code.count(old) == 1, f"{old!r} is not in the block exactly once"
        code = code.replace(old, new)
    return code


def shell_commands(block: str) -> list[list[str]]:
    """The commands of a bash block: continuation lines joined, comments dropped, each split
    into its words as the shell would (no pipes or variables in the documents' blocks)."""
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if words:
            commands.append(words)
    return commands
