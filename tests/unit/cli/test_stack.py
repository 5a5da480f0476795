"""`cli.stack`: the tools say in one line what they need where the Reverb stack is missing,
and answer `--help` without loading TensorFlow where it is installed (also run under Python
3.12, which has no Reverb)."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

from replay_service.cli.stack import require_reverb_installed

pytestmark = pytest.mark.local

REPO = Path(__file__).resolve().parents[3]
HAS_REVERB = all(find_spec(m) is not None for m in ("reverb", "tensorflow", "tf_agents"))
TOOLS = ("replay-server", "replay-populate", "replay-demo")
QUIETING = ("TF_CPP_MIN_LOG_LEVEL", "GRPC_VERBOSITY")


def test_the_installed_check_names_the_missing_module_or_passes() -> None:
    if HAS_REVERB:
        assert require_reverb_installed("replay-server") is None
        return
    with pytest.raises(SystemExit) as exited:
        require_reverb_installed("replay-server")
    message = str(exited.value.code)
    assert message.startswith("replay-server needs dm-reverb 0.13, TensorFlow 2.14")
    assert "No module named" in message and "backend='local'" in message


@pytest.mark.parametrize("tool", TOOLS)
def test_each_installed_tool_answers_help_at_once_or_names_what_it_needs(tool: str) -> None:
    script = Path(sys.executable).parent / tool
    assert script.is_file(), f"{tool} is not installed next to {sys.executable}"
    # The console script as users run it, then which libraries the same entry point loaded.
    result = subprocess.run(
        [str(script), "--help"], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    entry = {"replay-server": "run_server", "replay-populate": "run_populate"}.get(tool, "run_demo")
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import sys; sys.argv = [{tool!r}, '--help']\n"
            "from replay_service import cli\n"
            f"try:\n    cli.{entry}()\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('tensorflow', 'reverb') if m in sys.modules))",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    if not HAS_REVERB:
        assert result.returncode == 1, result.stderr
        assert result.stderr.strip().startswith(f"{tool} needs dm-reverb 0.13"), result.stderr
        assert "Traceback" not in result.stderr
        return
    assert result.returncode == 0, result.stderr
    assert "--" in result.stdout  # the usage and its flags
    if tool == "replay-server":  # the others import TensorFlow and TF-Agents as they load
        assert probe.stdout.strip().splitlines()[-1] == "[]", probe.stdout + probe.stderr


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
