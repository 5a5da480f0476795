"""Populating starter buffers: the `populate` function and the `replay-populate` CLI, end to end.

Everything runs against real Reverb servers and real TF-Agents drivers. The CLI is run as a
subprocess from the repository root, as a user would run it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from tf_agents.drivers import py_driver
from tf_agents.policies import tf_policy
from tf_agents.policies.policy_saver import POLICY_SPECS_PBTXT
from tf_agents.specs import tensor_spec
from tf_agents.trajectories import policy_step
from tf_agents.trajectories import time_step as ts
from tf_agents.utils import common, nest_utils

from conftest import FAST_TIMEOUTS, all_items, tree_digest
from replay_service import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointStore,
    ConfigError,
    NoCheckpointError,
    ReplayBufferManager,
    ReplayServiceError,
    SpecMismatchError,
)
from replay_service.cli.populate import POPULATE_FLAGS, ProgressBar, normalize_flag_spelling
from replay_service.specs.nests import describe_spec
from replay_service.starter import (
    DEFAULT_CAPACITY,
    SUMMARY_PLOT_SUFFIX,
    PopulateConfig,
    format_summary,
    populate,
    starter_data_spec,
)
from replay_service.starter.envs import STEPS_PER_WEEK, BuildingEnv, decode_time, load_env
from replay_service.starter.policies import load_policy
from replay_service.storage.directory import CHECKPOINTS_DIR, LOCK_FILE, REVERB_DIR, STORE_FILE

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "scripts" / "populate_starter_buffer.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LAST = int(ts.StepType.LAST)


# ----------------------------------------------------------------------------------- helpers


def items_for(episode_lengths: list[int], sequence_length: int) -> int:
    """Items of episodes of T observed steps each: T - sequence_length + 1 (stride 1)."""
    return sum(max(0, t - sequence_length + 1) for t in episode_lengths)


def building_spec(policy: str = "schedule") -> Any:
    env = BuildingEnv(seed=0)
    return starter_data_spec(env, load_policy(policy, env.time_step_spec(), env.action_spec()))


def load_count(path: Path | str, data_spec: Any) -> int:
    """Items in the newest checkpoint of `path`, restored through `load_replay_buffer()`."""
    stored = CheckpointStore(path).read_metadata()
    with ReplayBufferManager(
        data_spec, stored.capacity, str(path), stored.sequence_length, timeouts=FAST_TIMEOUTS
    ) as manager:
        manager.load_replay_buffer()
        return manager.num_frames()


def make(tmp_path: Path, **kwargs: Any) -> PopulateConfig:
    kwargs.setdefault("buffer_name", "starter")
    kwargs.setdefault("output_dir", str(tmp_path / "buffers"))
    kwargs.setdefault("seed", 0)
    return PopulateConfig(**kwargs)


def fill(tmp_path: Path, **kwargs: Any) -> Any:
    return populate(make(tmp_path, **kwargs), timeouts=FAST_TIMEOUTS)


def assert_only_finished_entries(output_dir: Path, *names: str) -> None:
    """The output dir holds the named buffers and their plots, and nothing unfinished."""
    expected = {n for name in names for n in (name, name + SUMMARY_PLOT_SUFFIX)}
    assert set(os.listdir(output_dir)) == expected


class ConstantPolicy(tf_policy.TFPolicy):
    """A TF policy that always takes `action` and reports `info` (scalars) as its policy info."""

    def __init__(self, env: BuildingEnv, action: np.ndarray, info: dict[str, float]) -> None:
        super().__init__(
            tensor_spec.from_spec(env.time_step_spec()),
            tensor_spec.from_spec(env.action_spec()),
            info_spec={k: tf.TensorSpec((), tf.float32, k) for k in info},
            clip=False,
        )
        self._value = tf.constant(action)
        self._info = info

    def _variables(self) -> list[Any]:
        return []

    def _distribution(self, time_step: Any, policy_state: Any) -> Any:
        raise NotImplementedError("ConstantPolicy only acts")

    def _action(self, time_step: Any, policy_state: Any, seed: Any) -> policy_step.PolicyStep:
        outer = nest_utils.get_outer_shape(time_step, self._time_step_spec)
        info = {k: tf.fill(outer, tf.constant(v, tf.float32)) for k, v in self._info.items()}
        return policy_step.PolicyStep(common.replicate(self._value, outer), policy_state, info)


def export_constant_policy(export_dir: Path, action: np.ndarray, info: dict[str, float]) -> None:
    """Saves a `ConstantPolicy` in the layout `PolicySaver` writes (see test_policy_schedule.py)."""
    policy = ConstantPolicy(BuildingEnv(seed=0), action, info)
    batched = tensor_spec.add_outer_dims_nest(policy.time_step_spec, (None,))
    module = tf.Module()
    module.action = tf.function(
        lambda time_step, state: policy.action(time_step, state),
        input_signature=[batched, ()],
        autograph=False,
    )
    module.get_initial_state = tf.function(
        policy.get_initial_state, input_signature=[tf.TensorSpec((), tf.int32)], autograph=False
    )
    tf.saved_model.save(module, os.fspath(export_dir))
    specs = {"collect_data_spec": policy.collect_data_spec, "policy_state_spec": ()}
    tensor_spec.to_pbtxt_file(os.fspath(export_dir / POLICY_SPECS_PBTXT), specs)


# ------------------------------------------------------------------------------ end to end: CLI


@dataclasses.dataclass(frozen=True)
class CliRun:
    """One finished run of the populate script."""

    returncode: int
    stdout: str
    stderr: str
    root: Path
    before: dict[str, str]

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.startswith("error: ")]


CLI_SCENARIOS: dict[str, list[str]] = {
    "hyphens": ["--buffer-name", "week", "--steps-per-run", "30", "--num-runs", "2",
                "--output-dir", "{root}/out", "--seed", "3"],
    "underscores": ["--buffer_name=b", "--steps_per_run=30", "--num_runs=1",
                    "--output_dir={root}/out"],
    "exists": ["--buffer_name=b", "--steps_per_run=30", "--num_runs=1", "--output_dir={root}/out",
               "--seed=1"],
    "help": ["--help"],
    "copy": ["--buffer-name", "src", "--output-dir", "{root}/out",
             "--copy-to", "{root}/run/replay"],
    "bad_capacity": ["--buffer-name", "b", "--output-dir", "{root}/out", "--capacity", "0"],
    "bad_env": ["--buffer-name", "b", "--output-dir", "{root}/out", "--env", "Nope-v0"],
    "bad_name": ["--buffer-name", "../up", "--output-dir", "{root}/out", "--steps-per-run", "5"],
}  # fmt: skip
PREFILLED: dict[str, dict[str, Any]] = {
    "exists": {"buffer_name": "b", "steps_per_run": 30},
    "copy": {"buffer_name": "src", "steps_per_run": 25},
}


@pytest.fixture(scope="module")
def cli(tmp_path_factory: pytest.TempPathFactory) -> dict[str, CliRun]:
    """Runs every CLI scenario at once, from the repository root, as a user would.

    Each process spends seconds importing TensorFlow, so they run side by side. Scenarios in
    `PREFILLED` first get a buffer made in-process; `CliRun.before` is its tree digest.
    """
    # The script's directory comes first on sys.path: PYTHONPATH makes it import this checkout.
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": REPO}
    runs = {}
    with contextlib.ExitStack() as stack:
        started = {}
        for name, args in CLI_SCENARIOS.items():
            root = tmp_path_factory.mktemp(name)
            if name in PREFILLED:
                config = PopulateConfig(output_dir=str(root / "out"), seed=0, **PREFILLED[name])
                populate(config, timeouts=FAST_TIMEOUTS)
            out, err = (stack.enter_context(tempfile.TemporaryFile("w+")) for _ in range(2))
            command = [sys.executable, str(SCRIPT), *(a.format(root=root) for a in args)]
            process = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=err)
            started[name] = (process, out, err, root, tree_digest(root))
        for name, (process, out, err, root, before) in started.items():
            returncode = process.wait(timeout=300)
            texts = []
            for stream in (out, err):
                stream.seek(0)
                texts.append(stream.read())
            runs[name] = CliRun(returncode, texts[0], texts[1], root, before)
    return runs


def test_cli_populates_a_buffer_with_hyphenated_flags(cli):
    result = cli["hyphens"]
    out = result.root / "out"
    assert result.returncode == 0, result.stderr
    assert "starter buffer 'week' created" in result.stdout
    # One building episode continues across both runs: 60 observed steps, 2-step windows.
    assert "items     59 of capacity 50000" in result.stdout
    assert "steps     60 (1 env(s) x 2 run(s) x 30 steps)" in result.stdout
    assert "reward    mean" in result.stdout and "seed 3" in result.stdout
    assert "60/60 [" in result.stderr and "steps/s" in result.stderr  # the tqdm bar
    assert result.error_lines == []
    plot = out / ("week" + SUMMARY_PLOT_SUFFIX)
    assert str(plot) in result.stdout
    assert plot.read_bytes()[:8] == PNG_MAGIC
    assert_only_finished_entries(out, "week")
    assert sorted(os.listdir(out / "week")) == sorted(
        [STORE_FILE, CHECKPOINTS_DIR, REVERB_DIR, LOCK_FILE]
    )
    spec = building_spec()
    assert CheckpointStore(out / "week").read_metadata().data_spec == describe_spec(spec)
    assert load_count(out / "week", spec) == 59


def test_cli_accepts_underscored_flags(cli):
    result = cli["underscores"]
    assert result.returncode == 0, result.stderr
    assert "items     29 of capacity 50000" in result.stdout
    assert load_count(result.root / "out" / "b", building_spec()) == 29


def test_cli_refuses_to_touch_an_existing_buffer(cli):
    result = cli["exists"]
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    [line] = result.error_lines
    assert str(result.root / "out" / "b") in line
    assert "--overwrite" in line and "--append" in line
    assert tree_digest(result.root) == result.before
    assert result.stdout == ""


@pytest.mark.parametrize(
    ("scenario", "fragment"),
    [
        ("bad_capacity", "capacity must be a positive integer, got 0"),
        ("bad_env", "unknown environment id 'Nope-v0'"),
        ("bad_name", "buffer name '../up'"),
    ],
)
def test_cli_bad_input_is_one_error_line_and_exit_2(cli, scenario, fragment):
    result = cli[scenario]
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    [line] = result.error_lines
    assert fragment in line
    assert sorted(os.listdir(result.root)) == []


def test_cli_help_explains_every_flag_with_hyphens(cli):
    result = cli["help"]
    assert result.returncode == 0
    for flag in (
        "--buffer-name", "--capacity", "--steps-per-run", "--num-runs", "--env", "--policy",
        "--sequence-length", "--output-dir", "--seed", "--num-envs", "--[no]overwrite",
        "--[no]append", "--copy-to",
    ):  # fmt: skip
        assert flag in result.stdout, flag
    assert "--buffer_name" not in result.stdout.split("\nflags:\n", 1)[1]
    assert "is refused up front" in result.stdout
    assert "hyphens or underscores" in result.stdout


def test_cli_copy_to_makes_a_loadable_copy_and_leaves_the_source(cli):
    result = cli["copy"]
    assert result.returncode == 0, result.stderr
    assert "copied starter buffer 'src' (24 items)" in result.stdout
    target = result.root / "run" / "replay"
    digest = tree_digest(result.root)
    assert {k: v for k, v in digest.items() if k.startswith("out")} == result.before
    assert load_count(target, building_spec()) == 24


# --------------------------------------------------------------------- populate(): item counts


@pytest.mark.slow  # 800 steps of the building simulation: about a minute
def test_runs_continue_the_episode_and_cross_its_boundary_exactly(tmp_path):
    # 2 runs x 400 steps of a 672-step episode: the first episode ends in run 2 and its
    # boundary step is observed (673 steps), the second episode has 128 steps.
    result = fill(tmp_path, steps_per_run=400, num_runs=2, sequence_length=3)
    assert result.items == items_for([STEPS_PER_WEEK + 1, 800 - STEPS_PER_WEEK], 3) == 797
    assert (result.steps, result.episodes, result.episodes_finished) == (800, 2, 1)
    assert result.mode == "created" and result.items_before == 0
    assert load_count(result.path, building_spec()) == 797
    assert result.reward_min <= result.reward_mean <= result.reward_max <= 0.0


def test_each_env_has_its_own_observer_and_episodes(tmp_path):
    result = fill(tmp_path, steps_per_run=30, num_runs=2, num_envs=2)
    # Two separate 60-step episodes; one shared episode of 120 steps would give 119.
    assert result.items == 2 * items_for([60], 2) == 118
    assert result.steps == 120 and result.episodes == 2
    spec = building_spec()
    stored = CheckpointStore(result.path).read_metadata()
    with ReplayBufferManager(spec, stored.capacity, result.path, 2) as manager:
        manager.load_replay_buffer()
        items = all_items(manager.py_client, manager.table_name, 118)
    observation_index = [field["path"] for field in stored.data_spec].index("observation")
    for data in items.values():
        first, second = (decode_time(o)[0] for o in data[observation_index])
        # Consecutive steps of one environment: 15 minutes apart, never two envs side by side.
        assert (second - first) % 24 == pytest.approx(0.25)


def test_cartpole_with_a_random_policy(tmp_path):
    result = fill(
        tmp_path, env="CartPole-v0", policy="random", steps_per_run=150, sequence_length=3, seed=7
    )
    # Replay the same seeded env and policy to learn where its episodes ended.
    env = load_env("CartPole-v0", 7)
    policy = load_policy("random", env.time_step_spec(), env.action_spec(), 7)
    step_types: list[int] = []
    record = [lambda t: step_types.append(int(t.step_type))]
    driver = py_driver.PyDriver(env, policy, record, max_steps=1)
    time_step = env.reset()
    for _ in range(150):
        time_step, _ = driver.run(time_step)
    ends = np.flatnonzero(np.array(step_types) == LAST) + 1
    lengths = [len(e) for e in np.split(np.array(step_types), ends) if len(e)]
    assert len(lengths) > 2
    assert result.items == items_for(lengths, 3)
    assert result.reward_mean == 1.0
    cartpole_spec = starter_data_spec(env, policy)
    assert load_count(result.path, cartpole_spec) == result.items
    assert Path(result.plot_path).read_bytes()[:8] == PNG_MAGIC


def test_a_saved_policy_with_policy_info_is_stored_with_its_info(tmp_path):
    saved = tmp_path / "saved_policy"
    action = np.array([19.0, 25.0], np.float32)
    export_constant_policy(saved, action, {"value": 1.5})
    result = fill(tmp_path, policy=str(saved), steps_per_run=20)
    stored = CheckpointStore(result.path).read_metadata()
    assert "policy_info/value" in [f["path"] for f in stored.data_spec]
    assert result.items == 19
    env = BuildingEnv(seed=0)
    spec = starter_data_spec(env, load_policy(str(saved), env.time_step_spec(), env.action_spec()))
    with ReplayBufferManager(spec, DEFAULT_CAPACITY, result.path, 2) as manager:
        manager.load_replay_buffer()
        batch, _ = next(iter(manager.get_dataset(batch_size=4, num_steps=2)))
    np.testing.assert_array_equal(batch.policy_info["value"], np.full([4, 2], 1.5, np.float32))
    np.testing.assert_array_equal(batch.action[0, 0], action)


# ----------------------------------------------------------------- existing buffers: refuse, ...


def test_an_existing_buffer_is_refused_and_left_byte_identical(tmp_path):
    first = fill(tmp_path, steps_per_run=20)
    before = tree_digest(tmp_path)
    with pytest.raises(CheckpointExistsError) as raised:
        fill(tmp_path, steps_per_run=20, seed=1)
    message = str(raised.value)
    assert repr(first.path) in message and "--overwrite" in message and "--append" in message
    assert tree_digest(tmp_path) == before


def test_overwrite_replaces_the_buffer_and_its_plot(tmp_path):
    first = fill(tmp_path, steps_per_run=30, num_runs=2)
    old_plot = Path(first.plot_path).read_bytes()
    second = fill(tmp_path, steps_per_run=10, overwrite=True, env="building", policy="random")
    assert second.mode == "replaced" and second.path == first.path
    assert second.items == 9
    assert load_count(second.path, building_spec("random")) == 9
    assert Path(second.plot_path).read_bytes() != old_plot
    assert_only_finished_entries(tmp_path / "buffers", "starter")


def test_append_adds_a_new_episode_to_the_stored_items(tmp_path):
    first = fill(tmp_path, steps_per_run=30, capacity=500)
    assert first.items == 29
    appended = fill(tmp_path, steps_per_run=20, num_runs=2, append=True, seed=5)
    assert appended.mode == "appended"
    assert (appended.items_before, appended.items) == (29, 29 + items_for([40], 2))
    assert appended.capacity == 500 and appended.sequence_length == 2
    assert "items     68 of capacity 500, 39 added" in format_summary(appended)
    assert load_count(appended.path, building_spec()) == 68
    assert_only_finished_entries(tmp_path / "buffers", "starter")


def test_append_refusals_leave_the_buffer_unchanged(tmp_path):
    fill(tmp_path, steps_per_run=30, capacity=100)
    before = tree_digest(tmp_path)
    with pytest.raises(ConfigError, match="with capacity 200: the buffer has capacity 100"):
        fill(tmp_path, steps_per_run=10, append=True, capacity=200)
    with pytest.raises(ConfigError, match=r"29 items already stored \+ .* 80 items, 109 in all"):
        fill(tmp_path, steps_per_run=80, append=True)
    with pytest.raises(SpecMismatchError, match="'observation'") as raised:
        fill(tmp_path, steps_per_run=10, append=True, env="CartPole-v0", policy="random")
    assert "removed the unfinished buffer" in " ".join(raised.value.__notes__)
    assert tree_digest(tmp_path) == before
    with pytest.raises(NoCheckpointError, match="no starter buffer '.*other' to append to"):
        fill(tmp_path, buffer_name="other", append=True)


def test_an_interrupted_run_leaves_nothing_that_looks_complete(tmp_path):
    def interrupt_in_second_run(done: int, total: int) -> None:
        if done == 45:
            raise KeyboardInterrupt

    config = make(tmp_path, steps_per_run=30, num_runs=2)
    with pytest.raises(KeyboardInterrupt) as raised:
        populate(config, progress=interrupt_in_second_run, timeouts=FAST_TIMEOUTS)
    assert "removed the unfinished buffer" in raised.value.__notes__[0]
    assert os.listdir(tmp_path / "buffers") == []

    fill(tmp_path, steps_per_run=12)
    before = tree_digest(tmp_path)
    replace = make(tmp_path, steps_per_run=30, num_runs=2, overwrite=True)
    with pytest.raises(KeyboardInterrupt):
        populate(replace, progress=interrupt_in_second_run, timeouts=FAST_TIMEOUTS)
    assert tree_digest(tmp_path) == before


def test_a_failing_policy_fails_the_run_and_removes_the_partial_buffer(tmp_path):
    saved = tmp_path / "nan_policy"
    export_constant_policy(saved, np.array([np.nan, 24.0], np.float32), {})
    with pytest.raises(ReplayServiceError, match="run 1 of 2 .* two finite setpoints") as raised:
        fill(tmp_path, policy=str(saved), steps_per_run=10, num_runs=2)
    assert "nothing was kept" in raised.value.__notes__[0]
    assert os.listdir(tmp_path / "buffers") == []


# ------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"buffer_name": ""}, "buffer name must be a non-empty string, got ''"),
        ({"buffer_name": "a/b"}, "buffer name 'a/b' must be a single directory name"),
        ({"buffer_name": ".."}, "buffer name '..' must not start with '.'"),
        ({"buffer_name": ".hidden"}, "buffer name '.hidden' must not start with '.'"),
        ({"capacity": 0}, "capacity must be a positive integer, got 0"),
        ({"capacity": -3}, "capacity must be a positive integer, got -3"),
        ({"capacity": 2**31}, "capacity must be an integer in 1..2147483647"),
        ({"steps_per_run": 0}, "steps_per_run must be a positive integer, got 0"),
        ({"num_runs": -1}, "num_runs must be a positive integer, got -1"),
        ({"num_envs": 0}, "num_envs must be a positive integer, got 0"),
        ({"sequence_length": 0}, "sequence_length must be a positive integer, got 0"),
        ({"seed": -1}, "seed must be an integer in [0, 2147483648) or None, got -1"),
        ({"overwrite": True, "append": True}, "overwrite and append exclude each other"),
    ],
)
def test_bad_config_values_are_refused(tmp_path, kwargs, fragment):
    with pytest.raises(ConfigError) as raised:
        make(tmp_path, **kwargs)
    assert fragment in str(raised.value)


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"env": "Nope-v0"}, ConfigError, "unknown environment id 'Nope-v0'"),
        ({"policy": "greedy"}, ConfigError, "unknown policy 'greedy'"),
        (
            {"env": "CartPole-v0", "policy": "schedule"},
            ConfigError,
            "policy 'schedule' cannot be used with env 'CartPole-v0'",
        ),
        (
            {"capacity": 50, "steps_per_run": 30, "num_runs": 2},
            ConfigError,
            "capacity 50 is too small: 1 env(s) x 2 run(s) x 30 steps can write up to 60",
        ),
        (
            {"capacity": 100, "steps_per_run": 30, "num_runs": 2, "sequence_length": 1},
            ConfigError,
            "up to 120 items",
        ),
    ],
)
def test_bad_inputs_are_refused_before_anything_is_written(tmp_path, kwargs, error, fragment):
    with pytest.raises(error) as raised:
        fill(tmp_path, **kwargs)
    assert fragment in str(raised.value)
    assert not (tmp_path / "buffers").exists()


def test_an_output_dir_that_is_a_file_is_refused(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(CheckpointError, match=f"output dir '{blocker}' is not a directory"):
        fill(tmp_path, output_dir=str(blocker))
    with pytest.raises(CheckpointError, match=r"is not a directory \('.*a_file' is a file\)"):
        fill(tmp_path, output_dir=str(blocker / "below"))
    assert blocker.read_text() == "x"


def test_a_foreign_directory_under_the_buffer_name_is_never_replaced(tmp_path):
    foreign = tmp_path / "buffers" / "starter"
    foreign.mkdir(parents=True)
    (foreign / "notes.txt").write_text("mine")
    for flag in ({}, {"overwrite": True}):
        with pytest.raises(CheckpointError, match="not a replay_service checkpoint directory"):
            fill(tmp_path, steps_per_run=5, **flag)
    assert os.listdir(foreign) == ["notes.txt"]


def test_a_buffer_in_use_is_not_overwritten(tmp_path):
    first = fill(tmp_path, steps_per_run=10)
    with ReplayBufferManager(building_spec(), DEFAULT_CAPACITY, first.path, 2) as manager:
        manager.load_replay_buffer()
        with pytest.raises(CheckpointError, match="in use"):
            fill(tmp_path, steps_per_run=10, overwrite=True)
    assert load_count(first.path, building_spec()) == 9


# -------------------------------------------------------------------------- CLI helpers


def test_hyphenated_flag_names_are_rewritten_and_values_are_not():
    argv = [
        "prog", "--buffer-name", "--my-name", "--steps-per-run=5", "--num_runs", "2",
        "--no-overwrite", "--append", "--not-a-flag=x", "-copy-to=d", "--", "--env-x",
    ]  # fmt: skip
    assert normalize_flag_spelling(argv, POPULATE_FLAGS) == [
        "prog", "--buffer_name", "--my-name", "--steps_per_run=5", "--num_runs", "2",
        "--nooverwrite", "--append", "--not-a-flag=x", "-copy_to=d", "--", "--env-x",
    ]  # fmt: skip


def test_progress_bar_reports_steps_and_speed_without_a_terminal():
    stream = io.StringIO()
    with ProgressBar(stream) as bar:
        for done in range(1, 101):
            bar(done, 100)
    final = stream.getvalue().replace("\r", "\n").strip().splitlines()[-1]
    assert final.startswith("collecting: 100%")
    assert "100/100" in final and "steps/s" in final
