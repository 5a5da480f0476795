"""The command-line tools print only their own lines by default, and list their flags in --help."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from conftest import CARTPOLE_CONFIG, REPO
from replay_service.backends.reverb.connection import pick_free_port
from replay_service.cli import output as cli_output

# What the libraries print on their own when nothing quiets them.
NOISE = (
    "cuDNN",
    "cuFFT",
    "tensorflow/",
    "reverb/cc",
    "Gym has been unmaintained",
    "deprecat",
    "tcp_server_posix",
    "I1",
)
RUN_TIMEOUT_S = 120


def _env(**extra: str) -> dict[str, str]:
    """The environment of a user's shell: no TF_CPP_MIN_LOG_LEVEL, no verbose switch."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TF_CPP_MIN_LOG_LEVEL", "GRPC_VERBOSITY", cli_output.VERBOSE_ENV)
    }
    return {**env, **extra}


def _run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )


def _run_side_by_side(
    *runs: tuple[tuple[str, ...], dict[str, str]],
) -> list[subprocess.CompletedProcess[str]]:
    """`_run(*args, **env)` for each (args, env) of `runs`, all at once (each run spends seconds
    importing TensorFlow); returns their results in order."""
    with ThreadPoolExecutor(len(runs)) as pool:
        futures = [pool.submit(_run, *args, **env) for args, env in runs]
        return [future.result() for future in futures]


def _assert_quiet(output: str) -> None:
    noisy = [line for line in output.splitlines() if any(n in line for n in NOISE)]
    assert not noisy, "library log lines in the output:\n" + output


def test_demo_prints_only_its_five_lines(tmp_path: Any) -> None:
    result = _run("-m", "replay_service.cli.demo", "--steps=20", f"--checkpoint_dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    _assert_quiet(result.stdout + result.stderr)
    assert result.stderr == ""
    words = [line.split()[0] for line in result.stdout.splitlines()]
    assert words == ["collected", "sampled", "saved", "restored", "done"]


def test_server_prints_only_its_own_lines(tmp_path: Any) -> None:
    port = pick_free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "replay_service.cli.serve",
            f"--config={CARTPOLE_CONFIG}",
            f"--port={port}",
            f"--checkpoint_dir={tmp_path / 'ckpt'}",
        ],
        cwd=REPO,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("replay-server listening on port"):
                break
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = "".join(lines) + rest
    assert proc.returncode == 0, output
    _assert_quiet(output)
    own = [line for line in output.splitlines() if "replay-server" in line]
    assert len(own) == len(output.splitlines()) == 4, output
    assert own[1] == f"replay-server listening on port {port}"
    assert own[-1].startswith("replay-server stopped; final checkpoint")


def test_populate_prints_a_tqdm_bar_and_its_summary(tmp_path: Any) -> None:
    result = _run(
        "-m", "replay_service.cli.populate", "--buffer-name=b", f"--output-dir={tmp_path}",
        "--env=CartPole-v0", "--policy=random", "--capacity=100", "--steps-per-run=20",
        "--seed=0",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    _assert_quiet(result.stdout + result.stderr)
    assert result.stdout.startswith("starter buffer 'b' created")
    bar = result.stderr.replace("\r", "\n").strip().splitlines()
    assert bar and all(line.startswith("collecting:") for line in bar), result.stderr
    assert re.search(r"collecting: 100%.*20/20", bar[-1]), bar[-1]


def test_verbose_switch_brings_the_library_logs_back(tmp_path: Any) -> None:
    script = (
        "import sys; sys.argv[0] = 'replay-server'\n"
        # As the tools: the Reverb stack is loaded once the flags are parsed, then gym comes
        # in with TF-Agents' environments.
        "from replay_service.cli.stack import require_reverb_imports\n"
        "require_reverb_imports('replay-server')\n"
        "import reverb, tf_agents.environments\n"
        "reverb.Server([reverb.Table.queue('q', 10)]).stop()\n"
        "print('done')\n"
    )
    quiet, verbose = _run_side_by_side(
        (("-c", script), {}), (("-c", script), {cli_output.VERBOSE_ENV: "1"})
    )
    assert quiet.returncode == verbose.returncode == 0, quiet.stderr + verbose.stderr
    assert quiet.stdout == verbose.stdout == "done\n"
    _assert_quiet(quiet.stderr)
    assert "reverb/cc/platform/default/server.cc" in verbose.stderr
    assert "Gym has been unmaintained" in verbose.stderr


def test_server_help_lists_its_flags_as_console_script_and_module() -> None:
    script = (
        "import sys; sys.argv[0] = '/venv/bin/replay-server'\n"
        "from replay_service.cli.serve import run\n"
        "run()\n"
    )
    commands = (("-c", script, "--help"), ("-m", "replay_service.cli.serve", "--help"))
    results = _run_side_by_side(*((args, {}) for args in commands))
    for args, result in zip(commands, results, strict=True):
        assert result.returncode == 0, result.stderr  # the usage on stdout, as every tool
        for flag in ("--checkpoint_dir", "--[no]restore_if_exists", "--port", "--config"):
            assert flag in result.stdout, f"{flag} missing from {args[0]} --help:\n{result.stdout}"
        assert "Inspect a running server" in result.stdout  # the usage text
        _assert_quiet(result.stdout + result.stderr)


def test_only_the_tools_are_quieted_and_verbosity_is_read_from_the_command_line() -> None:
    assert cli_output.is_cli_process(["/venv/bin/replay-populate"], [])
    assert cli_output.is_cli_process(["x"], ["python", "-m", "replay_service.cli.serve"])
    assert not cli_output.is_cli_process(["train.py"], ["python", "train.py"])
    assert not cli_output.is_cli_process(["x"], ["python", "-m", "pytest"])
    assert cli_output.verbose_requested(["p", "--verbosity=0"], {})
    assert cli_output.verbose_requested(["p", "-v", "1"], {})
    assert not cli_output.verbose_requested(["p", "--verbosity=-1"], {})
    assert not cli_output.verbose_requested(["p", "--", "--verbosity=1"], {})
    # A value absl refuses asks for nothing: the tool's error stays its only line.
    assert not cli_output.verbose_requested(["p", "--verbosity=abc"], {})
    assert not cli_output.verbose_requested(["p", "-v", "abc"], {})
    assert not cli_output.verbose_requested(["p", "--verbosity"], {})
    assert cli_output.verbose_requested(["p", "--verbosity=0x1"], {})
    assert cli_output.verbose_requested(["p"], {cli_output.VERBOSE_ENV: "1"})
    assert not cli_output.verbose_requested(["p"], {cli_output.VERBOSE_ENV: "0"})
