"""sbsim's own starter buffers (bare Reverb roots, tables WITHOUT a signature) are adopted in one
step: `copy_buffer(..., data_spec=manager.data_spec)` or `replay-populate --copy-to --data-spec`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from sbsim_style import SBSIM_TABLE, SbsimStyleManager, populate_sbsim_buffer
from tf_agents.specs import tensor_spec
from tf_agents.trajectories import trajectory

from conftest import FAST_TIMEOUTS, REPO, all_items, tree_digest
from replay_service import (
    CheckpointError,
    CheckpointStore,
    ConfigError,
    NoCheckpointError,
    ReplayBufferManager,
    SpecMismatchError,
    copy_buffer,
)
from replay_service.backends.reverb.internals import bare_checkpoints, read_stored_tables
from replay_service.starter import load_data_spec

CAPACITY = 1000
STEPS_PER_RUN = 30
NUM_RUNS = 2
POPULATE = os.path.join(os.path.dirname(sys.executable), "replay-populate")
SPEC_MODULE = """
from tf_agents.environments import suite_gym
from tf_agents.policies import random_py_policy
from replay_service.specs.nests import collect_data_spec


def cartpole_spec():
    env = suite_gym.load("CartPole-v0")
    policy = random_py_policy.RandomPyPolicy(env.time_step_spec(), env.action_spec())
    return collect_data_spec(env, policy)


def broken():
    raise RuntimeError("no agent here")


def not_a_trajectory():
    return {"x": 1}
"""


@pytest.fixture()
def sbsim_root(tmp_path: Path, env: Any, policy: Any, data_spec: Any) -> Path:
    """An sbsim starter buffer: `starter_buffers/default`, written as sbsim writes it."""
    root = tmp_path / "starter_buffers" / "default"
    populate_sbsim_buffer(
        root,
        env,
        policy,
        data_spec,
        capacity=CAPACITY,
        steps_per_run=STEPS_PER_RUN,
        num_runs=NUM_RUNS,
    )
    (checkpoint,) = bare_checkpoints(str(root))
    (table,) = read_stored_tables(checkpoint)
    assert (table.name, table.signature) == (SBSIM_TABLE, None)  # sbsim's table has none
    return root


def _sbsim_items(root: Path, data_spec: Any) -> dict[int, list[np.ndarray]]:
    """Every item of the root, loaded back with sbsim's own `load_replay_buffer()` calls."""
    manager = SbsimStyleManager(data_spec, CAPACITY, str(root))
    replay_buffer, _ = manager.load_replay_buffer()
    try:
        count = int(replay_buffer.py_client.server_info()[SBSIM_TABLE].current_size)
        assert count > 0
        return all_items(replay_buffer.py_client, SBSIM_TABLE, count)
    finally:
        manager.close()


def _check_restores_every_item(
    target: Path, expected: dict[int, list[np.ndarray]], data_spec: Any
) -> None:
    stored = CheckpointStore(target).read_metadata()
    assert (stored.table_name, stored.capacity, stored.sequence_length) == (
        SBSIM_TABLE,
        CAPACITY,
        2,
    )
    with ReplayBufferManager(
        data_spec,
        stored.capacity,
        target,
        stored.sequence_length,
        table_name=stored.table_name,
        timeouts=FAST_TIMEOUTS,
    ) as manager:
        manager.load_replay_buffer()
        assert manager.num_frames() == len(expected)
        restored = all_items(manager.py_client, SBSIM_TABLE, len(expected))
        assert restored.keys() == expected.keys()
        for key, data in expected.items():
            assert len(restored[key]) == len(data)
            for got, want in zip(restored[key], data, strict=True):
                assert got.dtype == want.dtype
                np.testing.assert_array_equal(got, want)
        batch, _ = next(iter(manager.get_dataset(batch_size=8)))  # sampling works too
        assert batch.observation.shape == (8, 2, 4)


def _populate(*args: str, cwd: Path | str = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [POPULATE, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=180,
        env={k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"},
    )


def _printed_training_manager(stdout: str, data_spec: Any) -> ReplayBufferManager:
    """The manager of the "train from the copy: ..." line replay-populate printed, built by
    evaluating the line as printed (without its `.load_replay_buffer()`)."""
    (line,) = [x for x in stdout.splitlines() if x.startswith("train from the copy: ")]
    code = line[len("train from the copy: ") :]
    assert code.endswith(".load_replay_buffer()"), code
    return eval(code[: -len(".load_replay_buffer()")], {
        "ReplayBufferManager": ReplayBufferManager, "data_spec": data_spec,
    })  # fmt: skip


# ------------------------------------------------------------------------------ adoption


@pytest.mark.heavy
def test_python_adopts_an_sbsim_buffer_with_the_managers_data_spec(
    sbsim_root: Path, tmp_path: Path, env: Any, policy: Any, data_spec: Any
) -> None:
    before = tree_digest(sbsim_root)
    sbsim_manager = SbsimStyleManager(data_spec, CAPACITY, str(sbsim_root))
    target = copy_buffer(sbsim_root, tmp_path / "run" / "replay", data_spec=sbsim_manager.data_spec)
    assert tree_digest(sbsim_root) == before
    expected = _sbsim_items(sbsim_root, data_spec)
    assert tree_digest(sbsim_root) == before
    _check_restores_every_item(Path(target), expected, data_spec)
    assert tree_digest(sbsim_root) == before


@pytest.mark.heavy
# Each form of --data-spec is also loaded in-process (test_load_data_spec_forms_give_the_
# collect_spec); the command runs with the module form in `make test-slow`.
@pytest.mark.parametrize(
    "spec_arg",
    ["env:CartPole-v0", pytest.param("sbsim_spec:cartpole_spec", marks=pytest.mark.slow)],
)
def test_replay_populate_adopts_an_sbsim_buffer_with_data_spec(
    sbsim_root: Path, tmp_path: Path, data_spec: Any, spec_arg: str
) -> None:
    (tmp_path / "sbsim_spec.py").write_text(SPEC_MODULE)  # found in the current directory
    before = tree_digest(sbsim_root)
    target = tmp_path / "run" / "replay"
    result = _populate(
        "--buffer-name", "default", "--output-dir", str(sbsim_root.parent),
        "--copy-to", str(target), f"--data-spec={spec_arg}",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert f"ReplayBufferManager(data_spec, {CAPACITY}, {str(target)!r}, 2)" in result.stdout
    assert tree_digest(sbsim_root) == before
    _check_restores_every_item(target, _sbsim_items(sbsim_root, data_spec), data_spec)
    assert tree_digest(sbsim_root) == before


@pytest.mark.heavy
def test_the_printed_training_line_loads_a_table_not_named_uniform_table(
    tmp_path: Path, env: Any, policy: Any, data_spec: Any
) -> None:
    # TF-Agents' ReverbReplayBuffer names its table `experience`; the manager's default is
    # `uniform_table`, so the line replay-populate prints must name the table to load the copy.
    root = tmp_path / "starter_buffers" / "default"
    populate_sbsim_buffer(
        root, env, policy, data_spec, capacity=CAPACITY, steps_per_run=STEPS_PER_RUN,
        num_runs=1, table_name="experience",
    )  # fmt: skip
    target = tmp_path / "run" / "replay"
    result = _populate(
        "--buffer-name", "default", "--output-dir", str(root.parent), "--copy-to", str(target),
        "--data-spec=env:CartPole-v0", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    manager = _printed_training_manager(result.stdout, data_spec)
    try:
        manager.load_replay_buffer()
        assert manager.num_frames() == CheckpointStore(target).latest().num_items > 0
    finally:
        manager.close()


@pytest.mark.heavy
@pytest.mark.parametrize(
    "settings",
    # A table name is also in test_the_printed_training_line_loads_a_table_not_named_uniform_table.
    [
        {"pad_end_of_episode": True},
        {"layout": "packed"},
        pytest.param({"table_name": "experience"}, marks=pytest.mark.slow),
    ],
    ids=["padded", "packed", "named"],
)
def test_the_printed_training_line_loads_a_copy_of_other_stored_settings(
    tmp_path: Path, env: Any, policy: Any, data_spec: Any, settings: dict[str, Any]
) -> None:
    # A load refuses a manager whose settings differ from the stored ones (padding, layout,
    # table name), so the line replay-populate prints must name each one to load the copy.
    output = tmp_path / "out"
    source = output / "mine"  # where replay-populate --output-dir keeps buffer "mine"
    with ReplayBufferManager(
        data_spec, 100, source, 2, timeouts=FAST_TIMEOUTS, backend="reverb", **settings
    ) as manager:
        manager.create_replay_buffer()
        observer = manager.observer()
        time_step = env.reset()
        for _ in range(30):
            action = policy.action(time_step)
            next_step = env.step(action.action)
            observer(trajectory.from_transition(time_step, action, next_step))
            time_step = next_step
        manager.checkpoint()
        stored = manager.num_frames()
    target = tmp_path / "run" / "replay"
    result = _populate(
        "--buffer-name", "mine", "--output-dir", str(output), "--copy-to", str(target),
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    manager = _printed_training_manager(result.stdout, data_spec)
    try:
        manager.load_replay_buffer()
        assert manager.num_frames() == stored > 0
    finally:
        manager.close()


def test_without_a_data_spec_the_error_names_the_flag(sbsim_root: Path, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="has no signature.*--data-spec"):
        copy_buffer(sbsim_root, tmp_path / "copy")
    assert not (tmp_path / "copy").exists()


def test_loading_an_sbsim_buffer_directly_names_the_adopting_command(
    sbsim_root: Path, data_spec: Any
) -> None:
    before = tree_digest(sbsim_root)
    manager = ReplayBufferManager(data_spec, CAPACITY, sbsim_root, 2, timeouts=FAST_TIMEOUTS)
    try:
        with pytest.raises(CheckpointError) as raised:
            manager.load_replay_buffer()
    finally:
        manager.close()
    assert (
        f"replay-populate --buffer-name default --output-dir {sbsim_root.parent} --copy-to "
        "NEW_DIR --data-spec MODULE:FUNCTION" in str(raised.value)
    )
    assert tree_digest(sbsim_root) == before


# ---------------------------------------------------------------------------- wrong specs


def _wrong_dtype(spec: Any) -> Any:
    return spec._replace(observation=tf.TensorSpec([4], tf.float64, "observation"))


def _wrong_shape(spec: Any) -> Any:
    return spec._replace(observation=tf.TensorSpec([5], tf.float32, "observation"))


def _missing_field(spec: Any) -> Any:
    return spec._replace(action=())


def _extra_field(spec: Any) -> Any:
    return spec._replace(policy_info={"log_probability": tf.TensorSpec([], tf.float32)})


@pytest.mark.parametrize(
    ("make_wrong", "message"),
    [
        (_wrong_dtype, r"field 'observation': the data_spec says float64\[4\], the stored items "
                       r"hold float32\[4\]"),
        (_wrong_shape, r"field 'observation': the data_spec says float32\[5\], the stored items "
                       r"hold float32\[4\]"),
        (_missing_field, r"the stored items have a column int64\[\] \(column 3 of 6, after field "
                         r"'observation', before field 'next_step_type'\) for which the data_spec "
                         r"has no field"),
        (_extra_field, r"field 'policy_info/log_probability' \(float32\[\]\) is not in the "
                       r"stored items"),
    ],
    ids=["dtype", "shape", "missing", "extra"],
)  # fmt: skip
@pytest.mark.heavy
def test_a_wrong_data_spec_is_refused_at_adoption_naming_the_field(
    sbsim_root: Path, tmp_path: Path, data_spec: Any, make_wrong: Any, message: str
) -> None:
    before = tree_digest(sbsim_root)
    with pytest.raises(SpecMismatchError, match=message):
        copy_buffer(sbsim_root, tmp_path / "copy", data_spec=make_wrong(data_spec))
    assert not (tmp_path / "copy").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["starter_buffers"]  # no staging left
    assert tree_digest(sbsim_root) == before


def test_bounded_specs_with_their_dtypes_match(
    sbsim_root: Path, tmp_path: Path, data_spec: Any
) -> None:
    spec = tensor_spec.from_spec(data_spec)  # BoundedTensorSpecs, as an agent's spec has
    copy_buffer(sbsim_root, tmp_path / "copy", data_spec=spec)
    assert CheckpointStore(tmp_path / "copy").latest().num_items > 0


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("CartPole-v0", r"--data-spec 'CartPole-v0' must be 'env:<env id>'"),
        ("env:NoSuchEnv-v9", r"--data-spec 'env:NoSuchEnv-v9': unknown environment id"),
        ("no_such_module_xyz:spec", r"cannot import module 'no_such_module_xyz'"),
        ("sbsim_spec:nothing", r"module 'sbsim_spec' has no attribute 'nothing'"),
        ("sbsim_spec:broken", r"broken\(\) failed: RuntimeError: no agent here"),
        ("sbsim_spec:not_a_trajectory", r"--data-spec 'sbsim_spec:not_a_trajectory'"),
        ("a-b:c", r"dotted Python names"),
    ],
)
def test_load_data_spec_refuses_bad_values_naming_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str, message: str
) -> None:
    (tmp_path / "sbsim_spec.py").write_text(SPEC_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=message):
        load_data_spec(value)


def test_load_data_spec_forms_give_the_collect_spec(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data_spec: Any
) -> None:
    (tmp_path / "sbsim_spec.py").write_text(SPEC_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    for value in ("env:CartPole-v0", "sbsim_spec:cartpole_spec"):
        tf.nest.assert_same_structure(load_data_spec(value), data_spec)
        assert tf.nest.flatten(load_data_spec(value)) == [
            tf.TensorSpec(s.shape, s.dtype, s.name) for s in tf.nest.flatten(data_spec)
        ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--data-spec=CartPole-v0"], "--data-spec 'CartPole-v0' must be"),
        (["--data-spec=no_such_module_xyz:spec"], "cannot import module 'no_such_module_xyz'"),
        (["--data-spec=env:building"], "field 'observation': the data_spec says float32"),
    ],
    ids=["malformed", "unknown-module", "wrong-spec"],
)
@pytest.mark.heavy
def test_replay_populate_refuses_a_bad_data_spec_writing_nothing(
    sbsim_root: Path, tmp_path: Path, args: list[str], message: str
) -> None:
    before = tree_digest(sbsim_root)
    target = tmp_path / "run" / "replay"
    result = _populate(
        "--buffer-name", "default", "--output-dir", str(sbsim_root.parent),
        "--copy-to", str(target), *args,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert message in lines[0]
    assert not target.exists() and not target.parent.exists()
    assert tree_digest(sbsim_root) == before


@pytest.mark.heavy
def test_replay_populate_data_spec_needs_copy_to(tmp_path: Path) -> None:
    result = _populate(
        "--buffer-name", "x", "--output-dir", str(tmp_path / "out"), "--data-spec=env:building"
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.startswith("error: --data-spec 'env:building' applies only with --copy-to")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ incomplete checkpoints


def _add_incomplete(root: Path, complete: str) -> Path:
    """A newer checkpoint directory of a save that never wrote DONE (files partly there)."""
    newest = root / ("2999" + os.path.basename(complete)[4:])
    newest.mkdir()
    shutil.copy2(os.path.join(complete, "tables.tfrecord"), newest / "tables.tfrecord")
    return newest


def test_an_incomplete_newest_checkpoint_is_named_and_nothing_is_copied(
    sbsim_root: Path, tmp_path: Path, data_spec: Any
) -> None:
    (complete,) = bare_checkpoints(str(sbsim_root))
    newest = _add_incomplete(sbsim_root, complete)
    before = tree_digest(sbsim_root)
    with pytest.raises(CheckpointError) as raised:
        copy_buffer(sbsim_root, tmp_path / "copy", data_spec=data_spec)
    message = str(raised.value)
    assert f"{str(newest)!r}, is incomplete (no DONE file)" in message
    assert f"move {str(newest)!r} out of the root" in message
    assert f"previous complete checkpoint {complete!r}" in message
    assert not (tmp_path / "copy").exists()
    assert tree_digest(sbsim_root) == before

    newest.rename(tmp_path / "set-aside")  # the way out the error gives
    copy_buffer(sbsim_root, tmp_path / "copy", data_spec=data_spec)
    assert CheckpointStore(tmp_path / "copy").latest().num_items > 0


def test_a_root_with_only_an_incomplete_checkpoint_names_it(
    sbsim_root: Path, tmp_path: Path, data_spec: Any
) -> None:
    (complete,) = bare_checkpoints(str(sbsim_root))
    newest = _add_incomplete(sbsim_root, complete)
    shutil.rmtree(complete)  # this test's own files
    with pytest.raises(NoCheckpointError) as raised:
        copy_buffer(sbsim_root, tmp_path / "copy", data_spec=data_spec)
    message = str(raised.value)
    assert f"{str(newest)!r}, is incomplete (no DONE file)" in message
    assert "holds no complete checkpoint" in message
    assert "not a replay_service checkpoint directory" not in message
    assert not (tmp_path / "copy").exists()
