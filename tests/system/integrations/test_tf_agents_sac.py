"""TF-Agents' distributed SAC example trains against `replay-server` alone and saves policies.

The scripts are TF-Agents' own (tests/tf_agents_sac, unmodified from v0.18.0); they never import
replay_service, so they run under `python -m replay_service.integrations.tf_compat`, which lets
their `PolicySavedModelTrigger` save policies in this environment.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import CONFIGS, REPO
from replay_service.backends.reverb.connection import pick_free_port

SAC_DIR = os.path.join(REPO, "tests", "system", "tf_agents_sac")
SAC_CONFIG = os.path.join(CONFIGS, "tf_agents_sac.toml")
TRAIN_STEPS = 300
INITIAL_COLLECT_STEPS = 500
SERVER_START_TIMEOUT_S = 120
JOB_TIMEOUT_S = 600


def _environ() -> dict[str, str]:
    """This worktree's code first on the path; the patch left at its default (on)."""
    environ = {
        k: v
        for k, v in os.environ.items()
        if k not in ("REPLAY_SERVICE_PATCH_INSPECT", "WRAPT_DISABLE_EXTENSIONS")
    }
    environ["PYTHONPATH"] = os.pathsep.join([REPO, environ.get("PYTHONPATH", "")])
    environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    return environ


def _sac_job(script: str, root_dir: Path, address: str, *bindings: str) -> list[str]:
    """The command line of one of the SAC scripts on Pendulum-v1 (gym), run with the patch."""
    gin = ["import tf_agents.environments.suite_gym", *bindings]
    return [
        sys.executable,
        "-m",
        "replay_service.integrations.tf_compat",
        os.path.join(SAC_DIR, script),
        f"--root_dir={root_dir}",
        "--env_name=Pendulum-v1",
        f"--replay_buffer_server_address={address}",
        f"--variable_container_server_address={address}",
        *(f"--gin_bindings={binding}" for binding in gin),
    ]


def _wait(proc: subprocess.Popen, timeout: float, log: Path, what: str) -> None:
    """Waits for `proc` to exit 0; kills it and fails with its log otherwise."""
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"{what} did not finish within {timeout} s:\n{log.read_text()[-6000:]}")
    assert code == 0, f"{what} exited with {code}:\n{log.read_text()[-6000:]}"


@pytest.mark.slow
@pytest.mark.timeout(3 * JOB_TIMEOUT_S)
def test_tf_agents_distributed_sac_trains_against_replay_server_and_saves_policies(
    tmp_path: Path,
) -> None:
    """sac_train.py and sac_collect.py, TF-Agents' own, run against `replay-server` alone.

    `.venv/bin/replay-server --config configs/tf_agents_sac.toml` (on a free port, checkpoints
    under tmp_path) serves both tables, in place of TF-Agents' `sac_reverb_server.py`. The
    trainer saves its policies at step 0 (`PolicySavedModelTrigger`, which failed with
    "__dict__ descriptor does not support '_DictWrapper' objects" without the patch), pushes
    its variables to the server and trains TRAIN_STEPS steps on what the collector writes; the
    collector waits for the saved collect policy, loads it, collects INITIAL_COLLECT_STEPS random
    steps and then with that policy, pulling the variables, until the trainer's step reaches
    TRAIN_STEPS (read from the server). Both exit 0; the saved policies load and act.
    """
    pytest.importorskip("reverb", reason="replay-server needs dm-reverb")
    from tf_agents.policies import py_tf_eager_policy
    from tf_agents.trajectories import time_step as ts

    port = pick_free_port()
    address = f"localhost:{port}"
    root_dir = tmp_path / "sac"
    server_log = tmp_path / "server.log"
    replay_server = os.path.join(os.path.dirname(sys.executable), "replay-server")
    with open(server_log, "w") as out:
        server = subprocess.Popen(
            [
                replay_server,
                f"--config={SAC_CONFIG}",
                f"--port={port}",
                f"--checkpoint_dir={tmp_path / 'replay'}",
                "--checkpoint_interval_s=0",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
            env=_environ(),
        )
    jobs: list[subprocess.Popen] = []
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while "replay-server listening on port" not in server_log.read_text():
            assert server.poll() is None, f"replay-server exited:\n{server_log.read_text()}"
            assert time.monotonic() < deadline, f"replay-server silent:\n{server_log.read_text()}"
            time.sleep(0.2)

        train_log, collect_log = tmp_path / "train.log", tmp_path / "collect.log"
        train_cmd = _sac_job(
            "sac_train.py",
            root_dir,
            address,
            "train.suite_load_fn=@suite_gym.load",
            f"train.num_iterations={TRAIN_STEPS}",
        )
        collect_cmd = _sac_job(
            "sac_collect.py",
            root_dir,
            address,
            "collect.suite_load_fn=@suite_gym.load",
            f"collect.initial_collect_steps={INITIAL_COLLECT_STEPS}",
            f"collect.max_train_steps={TRAIN_STEPS}",
        )
        for cmd, log in ((train_cmd, train_log), (collect_cmd, collect_log)):
            with open(log, "w") as out:
                jobs.append(
                    subprocess.Popen(
                        cmd, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path, env=_environ()
                    )
                )
        _wait(jobs[0], JOB_TIMEOUT_S, train_log, "sac_train.py")
        _wait(jobs[1], JOB_TIMEOUT_S, collect_log, "sac_collect.py")
        assert "Collecting with policy at step" in collect_log.read_text()

        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0, server_log.read_text()
    finally:
        for proc in (*jobs, server):
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    policies = root_dir / "policies"
    observation = np.array([1.0, 0.0, 0.5], np.float32)  # cos, sin, angular velocity
    for name in ("policy", "collect_policy", "greedy_policy"):
        assert (policies / name / "saved_model.pb").is_file(), sorted(os.listdir(policies))
        loaded = py_tf_eager_policy.SavedModelPyTFEagerPolicy(
            os.fspath(policies / name), load_specs_from_pbtxt=True
        )
        action = loaded.action(ts.restart(observation)).action
        assert action.shape == (1,) and -2.0 <= float(action[0]) <= 2.0, (name, action)
