"""`cli.stack`: the tools say in one line what they need where the Reverb stack is missing,
and answer `--help`, a bad flag and every refusal that needs no TensorFlow without loading it
where it is installed (also run under Python 3.12, which has no Reverb)."""

from __future__ import annotations

import ast
import dataclasses
import os
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

from replay_service.cli.stack import require_reverb_installed
from replay_service.storage.store import CheckpointStore
from storage_fakes import metadata

pytestmark = pytest.mark.local

REPO = Path(__file__).resolve().parents[3]
HAS_REVERB = all(find_spec(m) is not None for m in ("reverb", "tensorflow", "tf_agents"))
TOOLS = ("replay-server", "replay-populate", "replay-demo")
QUIETING = ("TF_CPP_MIN_LOG_LEVEL", "GRPC_VERBOSITY")
STACK = ("reverb", "tensorflow", "tf_agents")


def test_the_installed_check_names_the_missing_module_or_passes() -> None:
    if HAS_REVERB:
        assert require_reverb_installed("replay-server") is None
        return
    with pytest.raises(SystemExit) as exited:
        require_reverb_installed("replay-server")
    message = str(exited.value.code)
    assert message.startswith("replay-server needs dm-reverb 0.13, TensorFlow 2.14")
    assert "No module named" in message and "backend='local'" in message


@pytest.mark.heavy  # two processes per tool
@pytest.mark.parametrize("tool", TOOLS)
def test_each_installed_tool_answers_help_at_once_or_names_what_it_needs(tool: str) -> None:
    script = Path(sys.executable).parent / tool
    assert script.is_file(), f"{tool} is not installed next to {sys.executable}"
    # The console script as users run it, then which libraries the same entry point loaded.
    result = subprocess.run(
        [str(script), "--help"], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    if not HAS_REVERB:
        assert result.returncode == 1, result.stderr
        assert result.stderr.strip().startswith(f"{tool} needs dm-reverb 0.13"), result.stderr
        assert "Traceback" not in result.stderr
        return
    assert result.returncode == 0, result.stderr
    assert "--" in result.stdout  # the usage and its flags
    probe = run_entry_point(tool, ["--help"], REPO)
    assert probe.loaded == [], probe


@dataclasses.dataclass(frozen=True)
class Probe:
    """How a tool's entry point ended in a subprocess, and which of the stack it loaded."""

    code: object
    stderr: str
    loaded: list[str]


def run_entry_point(tool: str, args: list[str], cwd: Path) -> Probe:
    """Calls `tool`'s entry point (`replay_service.cli.run_*`) with `args` in a subprocess and
    reports its exit code, its stderr and which of TensorFlow, TF-Agents and Reverb it loaded."""
    entry = {"replay-server": "run_server", "replay-populate": "run_populate"}.get(tool, "run_demo")
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import sys; sys.argv = [{tool!r}, *{args!r}]\n"
            "from replay_service import cli\n"
            f"try:\n    cli.{entry}()\n    code = None\n"
            "except SystemExit as e:\n    code = e.code\n"
            f"print(repr(code), sorted(m for m in {STACK!r} if m in sys.modules))",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    code, _, loaded = result.stdout.strip().splitlines()[-1].rpartition(" [")
    loaded = "[" + loaded
    return Probe(ast.literal_eval(code), result.stderr, ast.literal_eval(loaded))


@pytest.mark.parametrize("module", ["replay_service.cli.populate", "replay_service.cli.demo"])
def test_importing_a_tool_module_loads_no_tensorflow(module: str) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import sys, {module}\nprint(sorted(m for m in {STACK!r} if m in sys.modules))",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout + result.stderr


# replay-populate's refusals that need no TensorFlow: (more arguments, what the line names).
POPULATE_REFUSALS = {
    "existing_buffer": ([], "already exists and is never modified silently"),
    "unknown_env": (
        ["--env=NoSuchEnv-v0"],
        "unknown environment id 'NoSuchEnv-v0': expected 'building' or a registered gym id",
    ),
    "capacity_too_small": (["--capacity=10"], "capacity 10 is too small"),
    "data_spec_without_copy_to": (["--data-spec=env:building"], "applies only with --copy-to"),
    "append_with_copy_to": (["--copy-to={root}/run", "--append"], "cannot be combined"),
}


@pytest.mark.skipif(not HAS_REVERB, reason="the entry point needs the Reverb stack installed")
@pytest.mark.parametrize("case", sorted(POPULATE_REFUSALS))
def test_populate_refuses_before_loading_tensorflow(case: str, tmp_path: Path) -> None:
    more, named = POPULATE_REFUSALS[case]
    args = ["--buffer-name=b", f"--output-dir={tmp_path / 'out'}"]
    args += [arg.format(root=tmp_path) for arg in more]
    if case == "existing_buffer":
        CheckpointStore(str(tmp_path / "out" / "b")).prepare_new(metadata())
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    probe = run_entry_point("replay-populate", args, tmp_path)
    assert probe.code == 2, probe
    assert probe.stderr.startswith("error: ") and probe.stderr.count("\n") == 1, probe
    assert named in probe.stderr, probe
    assert probe.loaded == [], probe
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


@pytest.mark.skipif(not HAS_REVERB, reason="the entry point needs the Reverb stack installed")
def test_demo_refuses_an_unknown_env_before_loading_tensorflow(tmp_path: Path) -> None:
    args = ["--env=NoSuchEnv-v0", f"--checkpoint_dir={tmp_path / 'out'}"]
    probe = run_entry_point("replay-demo", args, tmp_path)
    assert probe.code == 2, probe
    assert probe.stderr == (
        "replay-demo: error: --env='NoSuchEnv-v0' cannot be loaded: "
        "Environment `NoSuchEnv` doesn't exist.\n"
    )
    assert probe.loaded == [], probe
    assert list(tmp_path.iterdir()) == []


@pytest.mark.heavy  # each run imports TensorFlow
@pytest.mark.skipif(not HAS_REVERB, reason="needs the Reverb stack installed")
@pytest.mark.parametrize("tool", TOOLS)
def test_a_broken_install_is_one_line_naming_what_failed(tool: str, tmp_path: Path) -> None:
    """TF-Agents installed but failing to import (a wrong version beside it): one line, no
    traceback, whatever the tool imports first."""
    shim = tmp_path / "tf_agents"
    shim.mkdir()
    (shim / "__init__.py").write_text("raise ImportError('a broken TF-Agents')\n")
    script = Path(sys.executable).parent / tool
    args = {"replay-server": [], "replay-demo": ["--steps=5"]}.get(tool, ["--buffer-name=b"])
    result = subprocess.run(
        [
            str(script),
            *args,
            f"--{'output-dir' if tool == 'replay-populate' else 'checkpoint_dir'}"
            f"={tmp_path / 'out'}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={  # a user's shell: none of the logging settings the suite's process sets
            **{k: v for k, v in os.environ.items() if k not in QUIETING},
            "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)]),
        },
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"{tool} needs dm-reverb 0.13"), result.stderr
    assert "a broken TF-Agents" in result.stderr
    assert not (tmp_path / "out").exists()
