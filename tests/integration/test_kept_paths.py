"""Module paths that moved stay importable with the public names they had."""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

import replay_service

PACKAGE = Path(replay_service.__file__).resolve().parent
# Names an old module exported (its `__all__`) without defining them.
REEXPORTED = {"replay_service.sb3": ("data_spec_for_spaces",)}
# The tools' modules: `python -m` keeps working; only `run` (and the demo's spec) is kept.
TOOLS = {"replay_service.serve": ("run",), "replay_service.demo": ("run", "collect_data_spec")}


def defined_public_names(module: str) -> set[str]:
    """Public names a module's own source defines at its top level (a package: its
    `__init__.py`, where the names it imports from its modules count as its own)."""
    path = PACKAGE.joinpath(*module.split(".")[1:])
    is_package = path.is_dir()
    path = path / "__init__.py" if is_package else path.with_suffix(".py")
    names = set()
    for node in ast.parse(path.read_text()).body:
        if is_package and isinstance(node, ast.ImportFrom):
            names.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {name for name in names if not name.startswith("_")}


@pytest.mark.parametrize("old", sorted(set(replay_service.KEPT_MODULE_PATHS) - set(TOOLS)))
def test_an_old_module_path_offers_its_public_names(old: str) -> None:
    new = replay_service.KEPT_MODULE_PATHS[old]
    expected = defined_public_names(new) | set(REEXPORTED.get(old, ()))
    kept, moved = importlib.import_module(old), importlib.import_module(new)
    missing = sorted(name for name in expected if not hasattr(kept, name))
    assert not missing, f"{old} lost {missing}"
    for name in expected - set(REEXPORTED.get(old, ())):
        assert getattr(kept, name) is getattr(moved, name), name


@pytest.mark.heavy
@pytest.mark.parametrize("old", sorted(TOOLS))
def test_an_old_tool_module_still_offers_run(old: str) -> None:
    # In a process of its own: a tool's module defines absl flags another tool defines too.
    names = ", ".join(TOOLS[old])
    code = f"import {old} as m\nfor n in ({names!r}).split(', '): assert callable(getattr(m, n)), n"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=240, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]


# A module split by job: the public names it defined, and the modules that define them now.
SPLIT = {
    "replay_service.backends.reverb.datasets": (
        (
            "DEFAULT_GRACE_S",
            "EMPTY_BUFFER_MESSAGE",
            "FOREIGN_ITEM_ERROR",
            "MANAGER_CLOSED_MESSAGE",
            "MAX_CHECK_INTERVAL_S",
            "MAX_PACE_S",
            "MIN_CHECK_INTERVAL_S",
            "MIN_PACE_S",
            "SERVER_LOST_MESSAGE",
            "Lifeline",
            "LivenessRules",
            "ReplayBuffer",
            "bound_sampling",
            "default_in_flight",
            "foreign_item_message",
            "guard_liveness",
            "liveness_bound",
            "mixed_dataset",
            "python_calls_stopped",
            "raise_when_exhausted",
            "read_pipeline",
            "replay_service_message",
            "sample_dataset",
            "sampling_timeout_message",
        ),
        (
            "replay_service.backends.reverb.liveness",
            "replay_service.backends.reverb.sampling_errors",
            "replay_service.backends.reverb.pipeline",
            "replay_service.backends.reverb.mixing",
            "replay_service.backends.reverb.tf_agents_buffer",
        ),
    ),
    # Split by job, it stays the home of the streams and re-exports what moved.
    "replay_service.sample.torch_streams": (
        (
            "DRAW_BYTES",
            "DRAW_ITEMS",
            "IN_FLIGHT_BATCHES",
            "LAST",
            "NUMPY_UNPACK_STEP_BYTES",
            "SAMPLING_WORKERS",
            "STEP_COPY_BYTES",
            "TRANSITION_SEQUENCE_LENGTH",
            "Packer",
            "SampleSource",
            "TorchSampleInfo",
            "TransitionBatch",
            "draws_per_call",
            "item_packer",
            "nest_packer",
            "split_batches",
            "step_of",
            "tensor_to_torch",
            "to_transitions",
            "transition_packer",
        ),
        ("replay_service.sample.batches", "replay_service.backends.reverb.torch_source"),
    ),
}


@pytest.mark.parametrize("old", sorted(SPLIT))
def test_a_split_module_path_offers_its_public_names_from_their_new_homes(old: str) -> None:
    names, homes = SPLIT[old]
    kept = importlib.import_module(old)
    defined: dict[str, str] = {}
    for home in homes:
        for name in defined_public_names(home):
            assert name not in defined, f"{name} is defined in {defined[name]} and {home}"
            defined[name] = home
    moved = sorted(set(names) - set(defined))
    assert not moved, f"no new home defines {moved}"
    missing = sorted(name for name in names if not hasattr(kept, name))
    assert not missing, f"{old} lost {missing}"
    for name in names:
        assert getattr(kept, name) is getattr(importlib.import_module(defined[name]), name), name


def test_populate_is_the_function_whatever_was_imported_first() -> None:
    importlib.import_module("replay_service.cli.populate")
    from replay_service import populate
    from replay_service.starter.build import populate as function

    assert populate is function and callable(populate)
    assert replay_service.populate is function


# Walks the package from the top in a fresh interpreter: each package is checked as soon as it
# is imported, before any of its modules is, since importing a module replaces the package's
# attribute of that name (the order in which `from replay_service import populate` gave the
# module to the installed replay-populate and the function to everyone else).
_NAME_CLASHES = """
import importlib, json, pkgutil, types

clashes = []


def check(package_name):
    package = importlib.import_module(package_name)
    modules = [(m.name, m.ispkg) for m in pkgutil.iter_modules(package.__path__)]
    for name, _ in modules:
        try:
            value = getattr(package, name)
        except AttributeError:
            continue
        if not isinstance(value, types.ModuleType):
            clashes.append(f"{package_name}.{name} is a module and a {type(value).__name__}")
    for name, is_package in modules:
        if is_package:
            check(f"{package_name}.{name}")


check("replay_service")
print("CLASHES " + json.dumps(clashes))
"""


@pytest.mark.heavy
def test_no_public_name_is_both_a_module_and_something_else() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _NAME_CLASHES],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        cwd=PACKAGE.parent,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("CLASHES ")]
    assert json.loads(line[len("CLASHES ") :]) == []
