"""Imports run only down between the package's roles: the layer map of docs/architecture.md,
checked on the source. A failure names the importing file, its line and the imported module."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "replay_service"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("cli",),
    ("distributed", "integrations"),
    ("starter",),
    ("manager",),
    ("monitoring",),
    ("backends",),
    ("sample",),
    ("collect", "storage"),
    ("config",),
    ("specs",),
    ("errors", "bounded"),
)
"""The package's rooms, top floor first. A room imports only rooms on lower floors (and itself);
rooms on one floor do not import each other. The package root (`__init__.py`) sits above them
all: it names the public API, each name imported on first use."""

SIBLINGS = ("backends.local", "backends.reverb")
"""Subpackages of one room that do not import each other: each backend stands alone."""

FLOOR = {room: number for number, rooms in enumerate(LAYERS) for room in rooms}
FILES = sorted(p for p in PACKAGE.rglob("*.py") if p.parent != PACKAGE or p.stem != "__init__")


def module_name(path: Path) -> str:
    """The dotted module name of a file of the package."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_imports(path: Path) -> Iterator[tuple[int, str]]:
    """The package modules a file imports, at any depth, as (line, module); imports under
    `if TYPE_CHECKING:` are left out (they never run)."""
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(child) for child in ast.walk(node))
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "replay_service" or node.module.startswith("replay_service."):
                for alias in node.names:  # `from package import module` imports the module
                    named = f"{node.module}.{alias.name}"
                    yield node.lineno, named if named in MODULES else node.module
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("replay_service."):
                    yield node.lineno, alias.name


MODULES = {module_name(path) for path in PACKAGE.rglob("*.py")}


def room_of(module: str) -> str:
    """`replay_service.backends.local.table` -> `backends`."""
    return module.split(".")[1]


def sibling_of(module: str) -> str | None:
    """The sibling subpackage a module lies in, if any."""
    rest = module.removeprefix("replay_service.")
    return next((s for s in SIBLINGS if rest == s or rest.startswith(s + ".")), None)


def test_every_room_is_on_the_map() -> None:
    rooms = {room_of(module_name(path)) for path in FILES}
    assert rooms == set(FLOOR), f"rooms not on the map: {sorted(rooms - set(FLOOR))}"


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_imports_run_only_down(path: Path) -> None:
    source = module_name(path)
    room, sibling = room_of(source), sibling_of(source)
    wrong = []
    for line, target in sorted(set(package_imports(path))):
        if target.count(".") == 1 and target.split(".")[1] not in FLOOR:
            wrong.append(f"{path.name}:{line} imports {target} from the package root")
            continue
        to_room = room_of(target)
        if to_room == room:
            other = sibling_of(target)
            if sibling and other and other != sibling:
                wrong.append(f"{path.name}:{line} imports {target} ({sibling} -> {other})")
        elif FLOOR[to_room] <= FLOOR[room]:
            wrong.append(f"{path.name}:{line} imports {target} ({room} -> {to_room}: not down)")
    assert not wrong, "\n".join(wrong)


def test_no_module_imports_itself_back() -> None:
    graph = {
        name: {t for _, t in package_imports(p) if t != name}  # `python -m`'s own copy aside
        for p in FILES
        for name in [module_name(p)]
    }
    cycles = []

    def visit(node: str, trail: list[str]) -> None:
        for target in sorted(graph.get(node, ())):
            if target in trail:
                cycles.append(" -> ".join([*trail[trail.index(target) :], target]))
            elif target in graph and target not in done:
                visit(target, [*trail, target])
        done.add(node)

    done: set[str] = set()
    for module in sorted(graph):
        if module not in done:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(sorted(set(cycles)))


def test_the_architecture_page_shows_this_map() -> None:
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    block = text.split("### Floors", 1)[1].split("```text", 1)[1].split("```", 1)[0]
    shown = []
    for line in block.splitlines():
        parts = line.split()
        if parts and parts[0].isdigit():
            rooms = [p for p in parts[1:3] if p.endswith(("/", ".py")) or "/{" in p]
            shown.append(tuple(r.split("/")[0].removesuffix(".py") for r in rooms))
    assert shown == list(LAYERS), f"docs/architecture.md shows {shown}, the test checks {LAYERS}"
