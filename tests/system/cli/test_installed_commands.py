"""Every installed command works the way users run it: as the venv's `bin/` script.

Each `[project.scripts]` entry of pyproject.toml is run as a subprocess of the console script
pip installed next to this interpreter (not `python -m`): `--help`, a small real run, and bad
inputs (exit 2, one line on stderr, nothing written). A new script without cases here fails
`test_every_console_script_has_cases`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from conftest import pick_free_port

pytest.importorskip("reverb", reason="the installed commands need dm-reverb")

REPO = Path(__file__).resolve().parents[3]
BIN = Path(sys.executable).parent
SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
TIMEOUT_S = 240
# A user's shell: none of the logging settings the suite's own process sets. The scripts
# import this checkout (as the editable install does), whichever one the venv was installed from.
USER_ENV = {
    k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "GRPC_VERBOSITY")
}
USER_ENV["PYTHONPATH"] = os.pathsep.join(
    [str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
)
# What a bad value of each tool must name.
BAD_INPUTS: dict[str, list[tuple[list[str], str]]] = {
    "replay-demo": [
        (["--steps=0"], "--steps=0"),
        (["--env=NoSuchEnv-v0"], "NoSuchEnv-v0"),
        (["--nosuchflag"], "nosuchflag"),
        (["extra-argument"], "extra-argument"),
    ],
    "replay-server": [
        (["--capacity=5"], "capacity"),
        (["--port=-3"], "-3"),
        (["--config=/nonexistent/replay.toml"], "/nonexistent/replay.toml"),
        (["frobnicate"], "frobnicate"),
        (["status"], "--address"),
        (["--verbosity=abc"], "abc"),
        (["--metrics_port=70000"], "70000"),
        (["--summary_interval_s=0"], "--summary_interval_s"),
        (["--tensorboard_dir=/proc/version/tb"], "/proc/version"),
    ],
    "replay-populate": [
        (["--buffer-name=b", "--capacity=0"], "capacity"),
        (["--buffer-name=b", "--env=NoSuchEnv-v0"], "NoSuchEnv-v0"),
        (["--buffer-name=b", "--nosuchflag"], "nosuchflag"),
        (["--capacity=10"], "--buffer-name"),
        (["--buffer-name=b", "--verbosity", "abc"], "abc"),
        (["--buffer-name=b", "--capacity=99999999999"], "99999999999"),
    ],
}


def _command(script: str) -> Path:
    path = BIN / script
    assert path.is_file() and os.access(path, os.X_OK), (
        f"{script} is not installed in {BIN}; reinstall with pip install -e ."
    )
    return path


def _run(script: str, *args: str, cwd: Path, timeout: float = TIMEOUT_S) -> Any:
    return subprocess.run(
        [str(_command(script)), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout,
        env=USER_ENV,
    )


def _bad_input_command(script: str, args: list[str], cwd: Path) -> list[str]:
    """The arguments of a bad-input case, with an output directory (and port) under `cwd`."""
    out = cwd / "out"
    where = {
        "replay-demo": [f"--checkpoint_dir={out}"],
        "replay-server": [f"--checkpoint_dir={out}", f"--port={pick_free_port()}"],
        "replay-populate": [f"--output-dir={out}", "--steps-per-run=5"],
    }[script]
    if script == "replay-server" and args and args[0] == "--port=-3":
        where = where[:1]
    return [script, *args, *where]


def _data_spec_command(source: str, cwd: Path) -> list[str]:
    """A replay-populate run whose --data-spec module (written into `cwd`) is `source`."""
    (cwd / "exiting_spec.py").write_text(source)
    return [
        "replay-populate", "--buffer-name=b", f"--output-dir={cwd / 'out'}",
        f"--copy-to={cwd / 'run'}", "--data-spec=exiting_spec:spec",
    ]  # fmt: skip


# How each test run by `ran` builds its command (script, arguments) in its working directory.
_COMMANDS = {
    "test_help_prints_usage_with_the_tools_flags_and_exits_0": (
        lambda p, cwd: [p["script"], p["flag"]]
    ),
    "test_a_bad_input_is_one_line_exit_2_and_writes_nothing": (
        lambda p, cwd: _bad_input_command(p["script"], p["args"], cwd)
    ),
    "test_a_data_spec_that_exits_is_one_error_line": (
        lambda p, cwd: _data_spec_command(p["source"], cwd)
    ),
}
SIDE_BY_SIDE = 3


@pytest.fixture(scope="module")
def ran(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Any, Path]]:
    """Runs the command of every selected help, bad-input and data-spec case of this module,
    `SIDE_BY_SIDE` at a time (each spends seconds importing TensorFlow), each in an empty
    working directory of its own.

    Returns:
      Test node id -> (the finished run, its working directory).
    """
    cases = {}
    for item in request.session.items:
        name = getattr(item, "originalname", item.name)
        if item.module is request.module and name in _COMMANDS:
            cwd = tmp_path_factory.mktemp(name[5:25])
            cases[item.nodeid] = (_COMMANDS[name](item.callspec.params, cwd), cwd)
    with ThreadPoolExecutor(SIDE_BY_SIDE) as pool:
        futures = {
            nodeid: pool.submit(_run, command[0], *command[1:], cwd=cwd)
            for nodeid, (command, cwd) in cases.items()
        }
        return {nodeid: (futures[nodeid].result(), cases[nodeid][1]) for nodeid in futures}


def _no_traceback(result: Any) -> None:
    assert "Traceback" not in result.stdout + result.stderr, result.stdout + result.stderr


def test_every_console_script_has_cases() -> None:
    assert set(SCRIPTS) == set(BAD_INPUTS) == set(MAIN_FLAGS), (
        "add --help, run and bad-input cases for new scripts"
    )
    for target in SCRIPTS.values():
        module, function = target.split(":")
        assert module == "replay_service.cli" and function.startswith("run_"), target


# The main flags each tool's usage must list.
MAIN_FLAGS = {
    "replay-demo": ["--steps", "--checkpoint_dir", "--env"],
    "replay-server": ["--checkpoint_dir", "--port", "--config"],
    "replay-populate": ["--buffer-name", "--capacity", "--env"],
}


@pytest.mark.parametrize("flag", ["--help", "-h", "--helpfull"])
@pytest.mark.parametrize("script", sorted(BAD_INPUTS))
def test_help_prints_usage_with_the_tools_flags_and_exits_0(
    script: str, flag: str, ran: dict[str, tuple[Any, Path]], request: pytest.FixtureRequest
) -> None:
    result, tmp_path = ran[request.node.nodeid]
    _no_traceback(result)
    # Every command alike: the usage on stdout, exit status 0 (absl's own --help exits 1).
    assert result.returncode == 0, (result.returncode, result.stderr)
    for name in MAIN_FLAGS[script]:
        assert name in result.stdout, (name, result.stdout)
    assert "error" not in result.stderr.lower(), result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("script", "args", "named"),
    [
        # Two cases a tool in `make test` (each run imports TensorFlow), the rest in test-slow.
        pytest.param(script, args, named, marks=[pytest.mark.slow] if index >= 2 else [])
        for script, cases in BAD_INPUTS.items()
        for index, (args, named) in enumerate(cases)
    ],
)
def test_a_bad_input_is_one_line_exit_2_and_writes_nothing(
    script: str,
    args: list[str],
    named: str,
    ran: dict[str, tuple[Any, Path]],
    request: pytest.FixtureRequest,
) -> None:
    result, tmp_path = ran[request.node.nodeid]
    out = tmp_path / "out"
    _no_traceback(result)
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(("error:", f"{script}: error:")), lines[0]
    assert named in lines[0], lines[0]
    assert not out.exists(), sorted(str(p) for p in out.rglob("*"))
    assert [p.name for p in tmp_path.iterdir()] == [], list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("source", "named"),
    [
        ("def spec():\n    raise SystemExit(5)\n", "spec() called sys.exit(5)"),
        ("import sys\nsys.exit('bye')\n", "called sys.exit('bye')"),
    ],
)
def test_a_data_spec_that_exits_is_one_error_line(
    source: str, named: str, ran: dict[str, tuple[Any, Path]], request: pytest.FixtureRequest
) -> None:
    result, tmp_path = ran[request.node.nodeid]
    _no_traceback(result)
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert "exiting_spec:spec" in lines[0] and named in lines[0], lines[0]
    assert not (tmp_path / "out").exists() and not (tmp_path / "run").exists()


def test_replay_demo_collects_checkpoints_and_restores(tmp_path: Path) -> None:
    checkpoints = tmp_path / "demo"
    result = _run("replay-demo", "--steps=30", f"--checkpoint_dir={checkpoints}", cwd=tmp_path)
    _no_traceback(result)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    collected = next(line for line in lines if line.startswith("collected"))
    items = int(collected.split("->")[1].split()[0])
    assert items > 0, collected
    assert f"restored   {items} items into a new manager (same count)" in result.stdout
    assert any(checkpoints.joinpath("checkpoints").iterdir())


def test_replay_populate_fills_a_buffer_and_copies_it(tmp_path: Path) -> None:
    created = _run(
        "replay-populate", "--buffer-name=b", f"--output-dir={tmp_path / 'starters'}",
        "--env=CartPole-v0", "--policy=random", "--capacity=100", "--steps-per-run=20",
        "--seed=0", cwd=tmp_path,
    )  # fmt: skip
    _no_traceback(created)
    assert created.returncode == 0, created.stderr
    assert created.stdout.startswith("starter buffer 'b' created"), created.stdout
    copied = _run(
        "replay-populate", "--buffer-name=b", f"--output-dir={tmp_path / 'starters'}",
        f"--copy-to={tmp_path / 'run'}", cwd=tmp_path,
    )  # fmt: skip
    _no_traceback(copied)
    assert copied.returncode == 0, copied.stderr
    assert "copied starter buffer 'b' (19 items)" in copied.stdout, copied.stdout
    assert (tmp_path / "run" / "checkpoints").is_dir()


def test_replay_server_serves_reports_status_and_checkpoints_on_sigterm(tmp_path: Path) -> None:
    port = pick_free_port()
    server = subprocess.Popen(
        [str(_command("replay-server")), f"--port={port}", f"--checkpoint_dir={tmp_path / 'c'}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
        env=USER_ENV,
    )
    try:
        assert server.stdout is not None
        seen = []
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            line = server.stdout.readline()
            if not line:
                break
            seen.append(line)
            if line.startswith("replay-server listening on port"):
                break
        assert seen and seen[-1].strip() == f"replay-server listening on port {port}", seen
        status = _run("replay-server", "status", f"--address=localhost:{port}", cwd=tmp_path)
        _no_traceback(status)
        assert status.returncode == 0, status.stderr
        assert "uniform_table" in status.stdout or "items" in status.stdout, status.stdout
        server.send_signal(signal.SIGTERM)
        rest, _ = server.communicate(timeout=TIMEOUT_S)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    assert server.returncode == 0, "".join(seen) + rest
    assert "replay-server stopped; final checkpoint" in rest, rest
    assert any((tmp_path / "c" / "checkpoints").iterdir())
