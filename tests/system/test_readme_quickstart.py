"""README's "PyTorch quick start" runs as written (with smaller sizes and a temporary directory)."""

from __future__ import annotations

import math
import os
from typing import Any

from readme_blocks import README, readme_block, shrink
from replay_service import ReplayBufferManager
from replay_service.specs.nests import data_spec_for_spaces

STEPS = 50
NUM_ENVS = 4


def test_readme_pytorch_quick_start_runs(tmp_path: Any) -> None:
    checkpoint_dir = tmp_path / "replay"
    code = shrink(
        readme_block("## PyTorch quick start"),
        {
            '"runs/quickstart/replay"': repr(str(checkpoint_dir)),
            "range(1_000)": f"range({STEPS})",
            "range(2_000)": "range(5)",
            "num_envs=4": f"num_envs={NUM_ENVS}",
        },
    )
    namespace: dict[str, Any] = {}
    exec(compile(code, str(README), "exec"), namespace)

    assert math.isfinite(namespace["loss"].item())
    assert os.path.isdir(namespace["checkpoint"])
    envs = namespace["envs"]
    # What was collected is in the checkpoint: per env, its steps less the newest (still open).
    with ReplayBufferManager(
        data_spec_for_spaces(envs.single_observation_space, envs.single_action_space),
        capacity=100_000,
        checkpoint_dir=str(checkpoint_dir),
        sequence_length=2,
    ) as manager:
        manager.load_replay_buffer()
        assert manager.num_frames() == NUM_ENVS * (STEPS - 1)
        with manager.torch_batches(8, transitions=True) as batches:
            batch = next(batches)
        assert batch.states.shape == (8, 3) and batch.actions.shape == (8, 1)
