"""README.md's code blocks, for tests that run them as written (with small sizes)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_block(heading: str, language: str = "python", index: int = 0) -> str:
    """The `index`-th ```language block of README's section `heading`.

    The section runs up to the next heading of the same or a higher level; lines starting with
    '#' inside code blocks are not headings.

    Args:
      heading: The whole heading line, e.g. "### Ray".
      language: The fence's language tag.
      index: Which block of the section (0: the first).

    Returns:
      The block's text, without its fences.

    Raises:
      AssertionError: If the heading or the block is missing (README changed).
    """
    level = len(heading.split(" ", 1)[0])
    blocks: list[str] = []
    inside_section = False
    fence: str | None = None  # the language of the block being read
    lines: list[str] = []
    for line in README.read_text().splitlines(keepends=True):
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
    assert inside_section, f"README has no heading {heading!r}"
    assert len(blocks) > index, f"README's {heading!r} has no {language} block {index}"
    return blocks[index]


def shrink(code: str, replacements: dict[str, str]) -> str:
    """Applies each replacement, which must match exactly once (README changed otherwise)."""
    for old, new in replacements.items():
        assert code.count(old) == 1, f"{old!r} is not in the block exactly once"
        code = code.replace(old, new)
    return code


def shell_commands(block: str) -> list[list[str]]:
    """The commands of a bash block: continuation lines joined, comments dropped, each split
    into its words as the shell would (no pipes or variables in README's blocks)."""
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if words:
            commands.append(words)
    return commands
