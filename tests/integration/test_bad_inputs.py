"""A battery of bad inputs: each gives a clear error naming the problem and keeps stored data."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from tf_agents.specs import tensor_spec

from conftest import FAST_TIMEOUTS, REPO, collect
from replay_service import (
    CheckpointError,
    ConfigError,
    NoCheckpointError,
    SamplingConfig,
    ServerUnavailableError,
    SpecMismatchError,
    TableConfig,
    Timeouts,
)
from replay_service.collect.observer import TrajectoryObserver
from replay_service.config.files import load_config
from replay_service.config.options import INT32_MAX
from replay_service.starter.envs import load_env
from replay_service.storage.directory import CHECKPOINTS_DIR, CORRUPT_DIR
from replay_service.storage.store import CheckpointStore


@pytest.fixture()
def saved(make_manager, env, policy):
    """A checkpoint directory holding one checkpoint; returns (path, item count)."""
    manager = make_manager()
    _, observer = manager.create_replay_buffer()
    collect(env, policy, observer, 40)
    count = manager.num_frames()
    manager.checkpoint()
    manager.close()
    return manager.checkpoint_dir, count


def assert_intact(make_manager, path, count):
    manager = make_manager(checkpoint_dir=path)
    manager.load_replay_buffer()
    assert manager.num_frames() == count
    manager.close()


CONSTRUCTOR_CASES = [
    ({"capacity": 0}, ConfigError, "capacity must be a positive integer, got 0"),
    ({"capacity": -1}, ConfigError, "got -1"),
    ({"sequence_length": 0}, ConfigError, "sequence_length must be a positive integer, got 0"),
    ({"table_name": "../escape"}, ConfigError, "table name must be"),
    ({"table_name": ""}, ConfigError, "table name must be"),
    ({"table_name": ".."}, ConfigError, "table name must not be '..'"),
    ({"table_name": "."}, ConfigError, "table name must not be '.'"),
    ({"table_name": "é" * 128}, ConfigError, "255 bytes long (a file name's limit), got 256 bytes"),
    ({"stride_length": 0}, ConfigError, "stride_length must be an integer >= 1, got 0"),
    ({"keep_checkpoints": 0}, ConfigError, "keep_checkpoints must be an integer >= 1, got 0"),
    ({"data_spec": {"x": "not a spec"}}, SpecMismatchError, "'x' is not a TensorSpec"),
    ({"sampling": "uniform"}, ConfigError, "sampling must be a SamplingConfig"),
]


@pytest.mark.parametrize(("kwargs", "error", "message"), CONSTRUCTOR_CASES)
def test_constructor_arguments(make_manager, kwargs, error, message):
    with pytest.raises(error) as info:
        make_manager(**kwargs)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (lambda: SamplingConfig(sampler="bogus"), "sampler must be one of"),
        (lambda: SamplingConfig(remover="random"), "remover must be one of"),
        (lambda: SamplingConfig(priority_exponent=float("nan")), "priority_exponent"),
        (lambda: SamplingConfig(samples_per_insert=float("inf")), "samples_per_insert"),
        (lambda: SamplingConfig(samples_per_insert=-2.0), "samples_per_insert"),
        (lambda: SamplingConfig(samples_per_insert=4.0, error_buffer=2.0), "error_buffer"),
        (lambda: SamplingConfig(min_size_to_sample=0), "min_size_to_sample"),
        (lambda: TableConfig(capacity=10, sampling=SamplingConfig(min_size_to_sample=11)), "11"),
        (lambda: Timeouts(sample=-1), "timeouts.sample"),
        (lambda: Timeouts(connect=0), "timeouts.connect"),
    ],
)
def test_config_objects(factory, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        factory()


def test_port_out_of_range_and_in_use(make_manager, tmp_path):
    with pytest.raises(ConfigError, match="port must be an integer in 1..65535, got 70000"):
        make_manager(port=70000).create_replay_buffer()
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(Exception, match=f"port {port} is already in use"):
            make_manager(checkpoint_dir=str(tmp_path / "p"), port=port).create_replay_buffer()


@pytest.mark.heavy
def test_non_reverb_port_gives_server_unavailable(make_manager):
    with socket.socket() as plain:
        plain.bind(("127.0.0.1", 0))
        plain.listen()
        address = f"127.0.0.1:{plain.getsockname()[1]}"
        manager = make_manager(server_address=address, timeouts=Timeouts(connect=1.0))
        with pytest.raises(ServerUnavailableError, match=address):
            manager.load_replay_buffer()


def test_wrong_dtype_shape_and_structure_steps(make_manager, data_spec):
    manager = make_manager()
    manager.create_replay_buffer()
    good = tf.nest.map_structure(
        lambda t: t.numpy(), tensor_spec.sample_spec_nest(data_spec, outer_dims=())
    )
    cases = [
        (good._replace(observation=good.observation.astype(np.float64)), "float64"),
        (good._replace(action=np.zeros([2, 2], np.int64)), "'action'"),
        ({"observation": good.observation}, "structure"),
    ]
    for bad, message in cases:
        _, fresh = manager.get_replay_buffer_and_observer()
        with pytest.raises(SpecMismatchError, match=message):
            fresh(bad)
    assert manager.num_frames() == 0


def test_foreign_file_in_checkpoints_dir_is_ignored(make_manager, saved):
    path, count = saved
    with open(os.path.join(path, CHECKPOINTS_DIR, "zzzz-notes.txt"), "w") as f:
        f.write("not a checkpoint")
    os.makedirs(os.path.join(path, CHECKPOINTS_DIR, "ckpt-99999999"))  # no DONE: not complete
    assert_intact(make_manager, path, count)


def test_truncated_only_checkpoint_is_moved_aside_not_deleted(make_manager, saved):
    path, _ = saved
    newest = CheckpointStore(path).latest()
    tables = os.path.join(newest.path, "tables.tfrecord")
    with open(tables, "r+b") as f:
        f.truncate(os.path.getsize(tables) // 2)
    with pytest.raises(NoCheckpointError, match="no complete checkpoint that verifies and loads"):
        make_manager(checkpoint_dir=path).load_replay_buffer()
    assert len(os.listdir(os.path.join(path, CORRUPT_DIR))) == 1


def test_malformed_store_file(make_manager, saved):
    path, count = saved
    store_file = CheckpointStore(path).store_file
    with open(store_file) as f:
        original = f.read()
    with open(store_file, "w") as f:
        f.write("{not json")
    with pytest.raises(CheckpointError, match="replay_service.json"):
        make_manager(checkpoint_dir=path).load_replay_buffer()
    with open(store_file, "w") as f:
        f.write('{"format": "something-else"}')
    with pytest.raises(CheckpointError, match="something-else"):
        make_manager(checkpoint_dir=path).load_replay_buffer()
    with open(store_file, "w") as f:
        f.write(original)
    assert_intact(make_manager, path, count)


def test_get_dataset_arguments(make_manager):
    manager = make_manager()
    manager.create_replay_buffer()
    with pytest.raises(ConfigError, match="batch_size must be a positive integer, got 0"):
        manager.get_dataset(0)
    with pytest.raises(ConfigError, match="batch_size must be a positive integer, got -3"):
        manager.get_dataset(-3)


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ('[server]\ncheckpoint_dir = ""\n', "server.checkpoint_dir must be a path"),
        ("[server]\ncheckpoint_interval_s = -5\n", "checkpoint_interval_s must be a number >= 0"),
        ("[server]\nkeep_checkpoints = 0\n", "keep_checkpoints must be an integer >= 1, got 0"),
        ("[table]\nsequence_length = -2\n", "sequence_length must be a positive integer, got -2"),
        ('[table]\nname = "a/b"\n', "table name must be"),
        ('[table]\nname = ".."\n', "table name must not be '..'"),
        ('[[extra_tables]]\nname = "."\n', "table name must not be '.'"),
        ('[table]\nname = "%s"\n' % ("a" * 256), "at most 255 bytes long"),
        ("[bogus]\nx = 1\n", "unknown key 'bogus'"),
        (
            '[data_spec]\nenv = "building"\nfields.x = { dtype = "float32", shape = [1] }\n',
            "exactly one",
        ),
        ('[data_spec]\nenv = false\nfields.observation = { dtype = "floaty", shape = [1] }\n', ""),
        ('[data_spec]\nfields.observation = { dtype = "float32", shape = [-1] }\n', "shape"),
        ('table = "not a table"\n', "[table] must be a table"),
    ],
)
def test_config_file_values(tmp_path, toml, message):
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    with pytest.raises((ConfigError, TypeError)) as info:
        load_config(path).data_spec.build(load_env)
    assert message in str(info.value)


@pytest.mark.heavy
def test_server_cli_rejects_unknown_command_and_status_without_address():
    for args, message in ((["frobnicate"], "unknown command"), (["status"], "--address")):
        result = subprocess.run(
            [sys.executable, "-m", "replay_service.cli.serve", *args],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
        )
        assert result.returncode != 0
        assert message in result.stderr


@pytest.mark.heavy
def test_status_of_a_server_that_is_down():
    from replay_service.backends.reverb.connection import pick_free_port
    from replay_service.monitoring.report import server_status

    address = f"localhost:{pick_free_port()}"
    with pytest.raises(ServerUnavailableError, match=address):
        server_status(address, timeout=1.0)


@pytest.mark.heavy
def test_sampling_timeout_is_bounded(make_manager):
    manager = make_manager(timeouts=Timeouts(sample=0.3))
    manager.create_replay_buffer()
    with pytest.raises(tf.errors.InvalidArgumentError, match="within 0.3 s"):
        next(iter(manager.get_dataset(2)))


def test_fast_timeouts_fixture_is_sane():
    assert FAST_TIMEOUTS.sample < FAST_TIMEOUTS.write


@pytest.mark.parametrize("prefix", ["../escape_", "sub/dir_", "/abs_"])
def test_export_prefix_cannot_leave_the_directory(make_manager, tmp_path, prefix):
    manager = make_manager()
    manager.create_replay_buffer()
    with pytest.raises(ConfigError, match="prefix must be a plain file-name prefix"):
        manager.export(str(tmp_path / "export"), prefix=prefix)
    assert not (tmp_path / "escape_state.safetensors").exists()


TOO_LARGE = 2**31
IN_32_BITS = f"1..{INT32_MAX} (Reverb stores it in 32 bits), got"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"capacity": TOO_LARGE}, f"capacity must be an integer in {IN_32_BITS} {TOO_LARGE}"),
        ({"capacity": 2**63}, f"capacity must be an integer in {IN_32_BITS} {2**63}"),
        ({"sequence_length": TOO_LARGE}, f"sequence_length must be an integer in {IN_32_BITS}"),
        ({"stride_length": TOO_LARGE}, f"stride_length must be an integer in {IN_32_BITS}"),
        ({"keep_checkpoints": TOO_LARGE}, f"keep_checkpoints must be an integer in {IN_32_BITS}"),
        ({"port": TOO_LARGE}, f"port must be an integer in 1..65535, got {TOO_LARGE}"),
    ],
)
def test_integers_beyond_reverbs_range_are_refused_at_construction(make_manager, kwargs, message):
    with pytest.raises(ConfigError) as info:
        make_manager(**kwargs)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (lambda: SamplingConfig(min_size_to_sample=TOO_LARGE), "min_size_to_sample must be an"),
        (lambda: SamplingConfig(max_times_sampled=2**40), "max_times_sampled must be an"),
        (lambda: TableConfig(capacity=TOO_LARGE), f"capacity must be an integer in {IN_32_BITS}"),
        (lambda: Timeouts(sample=1e300), "timeouts.sample must be a positive, finite number"),
        (lambda: Timeouts(write=float("inf")), "timeouts.write must be a positive, finite"),
        (lambda: SamplingConfig(error_buffer=float("inf")), "error_buffer must be a finite"),
        (
            lambda: SamplingConfig(samples_per_insert=1.0, error_buffer=float("nan")),
            "error_buffer must be a finite",
        ),
    ],
)
def test_config_objects_refuse_out_of_range_and_non_finite_values(factory, message):
    with pytest.raises(ConfigError) as info:
        factory()
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stride_length": True}, "stride_length must be an integer >= 1, got True"),
        ({"keep_checkpoints": True}, "keep_checkpoints must be an integer >= 1, got True"),
        ({"port": True}, "port must be an integer in 1..65535, got True"),
    ],
)
def test_bools_are_not_integers_for_the_manager(make_manager, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        make_manager(**kwargs)


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (lambda: SamplingConfig(max_times_sampled=True), "max_times_sampled must be an integer"),
        (lambda: SamplingConfig(max_times_sampled=False), "got False"),
        (lambda: SamplingConfig(priority_exponent=True), "priority_exponent must be a finite"),
        (lambda: SamplingConfig(samples_per_insert=True), "samples_per_insert must be"),
        (lambda: SamplingConfig(error_buffer=True), "error_buffer must be"),
    ],
)
def test_bools_are_not_numbers_for_config_objects(factory, message):
    with pytest.raises(ConfigError, match=message):
        factory()


def test_bools_are_not_integers_for_observers_and_writers(make_manager, data_spec):
    manager = make_manager()
    manager.create_replay_buffer()
    client = manager.py_client
    with pytest.raises(ConfigError, match="sequence_length must be an integer >= 1, got True"):
        TrajectoryObserver(client, manager.table_name, True, data_spec)
    with pytest.raises(ConfigError, match="stride_length must be an integer >= 1, got False"):
        TrajectoryObserver(client, manager.table_name, 2, data_spec, stride_length=False)
    with pytest.raises(
        ConfigError, match=r"sequence_length must be an integer in 1\.\.\d+ \(Reverb"
    ):
        TrajectoryObserver(client, manager.table_name, TOO_LARGE, data_spec)
    with pytest.raises(ConfigError, match="priority must be a finite number >= 0, got True"):
        manager.transition_writer(priority=True)
    with pytest.raises(ConfigError, match="priority must be a finite number >= 0, got nan"):
        manager.transition_writer(priority=float("nan"))
    assert manager.num_frames() == 0


def test_bools_are_not_sizes_for_sampling(make_manager):
    manager = make_manager()
    manager.create_replay_buffer()
    with pytest.raises(ConfigError, match="batch_size must be a positive integer, got True"):
        manager.get_dataset(True)
    with pytest.raises(ConfigError, match="prefetch must be a positive integer, got False"):
        manager.get_dataset(4, prefetch=False)
    with pytest.raises(ConfigError, match="prefetch must be a positive integer, got True"):
        manager.mixed_dataset(4, {manager.table_name: 1.0}, prefetch=True)
    with pytest.raises(ConfigError, match="num_workers must be an integer >= 0, got True"):
        manager.torch_dataset(4).data_loader(num_workers=True)


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        (
            "[server]\nkeep_checkpoints = true\n",
            "keep_checkpoints must be an integer >= 1, got True",
        ),
        ("[table]\ncapacity = 2147483648\n", f"capacity must be an integer in {IN_32_BITS}"),
        ("[table.sampling]\nmax_times_sampled = true\n", "max_times_sampled must be an integer"),
        (
            "[table.sampling]\nmax_times_sampled = 4294967296\n",
            f"max_times_sampled must be an integer in 0..{INT32_MAX}",
        ),
        (
            '[data_spec]\nfields.observation = { dtype = "float32", shape = [true] }\n',
            "data_spec.fields.observation.shape must be a list of integers",
        ),
        (
            "[server]\ncheckpoint_interval_s = nan\n",
            "checkpoint_interval_s must be a number >= 0 and finite",
        ),
        (
            "[server]\ncheckpoint_interval_s = inf\n",
            "checkpoint_interval_s must be a number >= 0 and finite (0 disables periodic "
            "checkpoints), got inf",
        ),
        ("[table.sampling]\nerror_buffer = inf\n", "error_buffer must be a finite number"),
        ("[table.sampling]\nerror_buffer = nan\n", "error_buffer must be a finite number"),
    ],
)
def test_config_file_refuses_bools_huge_integers_and_non_finite_floats(tmp_path, toml, message):
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert message in str(info.value)
    assert str(path) in str(info.value)


def test_config_file_that_is_not_utf8_is_refused_in_one_line(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes('[table]\nname = "caf\xe9"\n'.encode("latin-1"))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "\n" not in message
    assert f"config file {str(path)!r} is not valid UTF-8" in message
    assert "offset 19" in message


def test_a_dict_data_spec_is_refused_before_any_server_starts(make_manager, tmp_path):
    spec = {"obs": tf.TensorSpec([4], tf.float32), "act": tf.TensorSpec([], tf.int64)}
    with pytest.raises(SpecMismatchError) as info:
        make_manager(data_spec=spec, checkpoint_dir=str(tmp_path / "dict"))
    message = str(info.value)
    assert "needs a TF-Agents Trajectory data spec" in message
    assert "got a dict with fields ['act', 'obs']" in message
    assert not (tmp_path / "dict").exists()


def test_add_multi_with_zero_envs_is_refused_and_writes_nothing(make_manager):
    manager = make_manager()
    manager.create_replay_buffer()
    writer = manager.transition_writer()
    empty = np.zeros([0, 4], np.float32)
    with pytest.raises(SpecMismatchError, match="add_multi needs at least one env.*batch of 0"):
        writer.add_multi(empty, np.zeros([0], np.int64), np.zeros([0], np.float32), empty, [])
    assert writer.num_envs is None  # the refused call did not fix the number of envs
    states = np.zeros([2, 4], np.float32)
    for step in range(3):
        writer.add_multi(
            states + step,
            np.zeros([2], np.int64),
            np.ones([2], np.float32),
            states + step + 1,
            np.array([False, step == 2]),
        )
    writer.flush()
    assert writer.num_envs == 2
    assert manager.num_frames() > 0
