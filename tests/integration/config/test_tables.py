"""Several tables on one server: one observer feeds them all, checkpoints keep them all, and a
weighted mix samples them together. Real Reverb servers throughout."""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from conftest import CONFIGS, FAST_TIMEOUTS, REPO, all_items, collect
from replay_service import (
    CheckpointExistsError,
    ConfigError,
    ReplayBufferManager,
    SamplingConfig,
    SpecMismatchError,
    TableConfig,
)
from replay_service.backends.reverb.connection import pick_free_port as free_port
from replay_service.backends.reverb.server import serve_config
from replay_service.config.files import load_config
from replay_service.specs.nests import describe_spec
from replay_service.starter.envs import load_env
from replay_service.storage.directory import CHECKPOINT_META_FILE, STORE_FILE
from replay_service.storage.metadata import StoreMetadata

TWO_TABLES_CONFIG = os.path.join(CONFIGS, "uniform_and_prioritized.toml")
PRIMARY = "uniform_table"
EXTRA = "prioritized"
LAST = 2
# Frequencies must be within this many binomial standard deviations of the expected ones.
SIGMAS = 5.0


def _prioritized(capacity: int = 1000, sequence_length: int = 2, name: str = EXTRA) -> TableConfig:
    return TableConfig(
        name=name,
        capacity=capacity,
        sequence_length=sequence_length,
        sampling=SamplingConfig(sampler="prioritized", priority_exponent=1.0),
    )


def _windows(items: dict[int, list[np.ndarray]]) -> collections.Counter:
    """The multiset of item contents (keys left out)."""
    return collections.Counter(tuple(a.tobytes() for a in data) for data in items.values())


def _table_items(manager: ReplayBufferManager, table: str) -> dict[int, list[np.ndarray]]:
    return all_items(manager.py_client, table, manager.num_frames(table=table))


def _priorities(manager: ReplayBufferManager, table: str) -> dict[int, float]:
    """Item key -> priority, from enough samples to see every item of a small table."""
    found: dict[int, float] = {}
    for sample in manager.py_client.sample(table, num_samples=3000, emit_timesteps=False):
        found[int(sample.info.key)] = float(sample.info.priority)
    assert len(found) == manager.num_frames(table=table)
    return found


def _expected_items(step_types: list[int], sequence_length: int) -> int:
    steps = np.array(step_types)
    episodes = np.split(steps, np.flatnonzero(steps == LAST) + 1)
    return sum(max(0, len(e) - sequence_length + 1) for e in episodes if len(e))


# ------------------------------------------------------------------------------ writing


def test_one_observer_fills_both_tables_with_the_same_windows_under_distinct_keys(
    make_manager, env, policy
):
    manager = make_manager(extra_tables=[_prioritized()])
    assert [t.name for t in manager.tables] == [PRIMARY, EXTRA]
    _, observer = manager.create_replay_buffer()
    collect(env, policy, observer, 120)
    assert manager.num_frames() > 100
    assert manager.num_frames(table=EXTRA) == manager.num_frames()
    uniform = _table_items(manager, PRIMARY)
    prioritized = _table_items(manager, EXTRA)
    assert _windows(uniform) == _windows(prioritized)
    # Reverb gives every item its own key, also the same window inserted into two tables.
    assert not uniform.keys() & prioritized.keys()


def test_transition_writer_feeds_every_table(make_manager):
    manager = make_manager(extra_tables=[_prioritized(sequence_length=3)])
    manager.create_replay_buffer()
    writer = manager.transition_writer()
    state = np.zeros(4, np.float32)
    for t in range(5):  # one episode: 5 transitions + boundary = 6 steps
        writer.add(state + t, np.int64(t % 2), np.float32(t), state + t + 1, done=t == 4)
    writer.flush()
    assert manager.num_frames() == 6 - 2 + 1
    assert manager.num_frames(table=EXTRA) == 6 - 3 + 1


@pytest.mark.heavy
def test_each_table_has_its_own_sequence_length(make_manager, env, policy):
    manager = make_manager(extra_tables=[_prioritized(sequence_length=4, name="long")])
    _, observer = manager.create_replay_buffer()
    step_types: list[int] = []

    class Recorder:
        def __call__(self, trajectory):
            step_types.append(int(trajectory.step_type))
            observer(trajectory)

        flush = observer.flush

    collect(env, policy, Recorder(), 150)
    assert manager.num_frames() == _expected_items(step_types, 2)
    assert manager.num_frames(table="long") == _expected_items(step_types, 4)
    short = _table_items(manager, PRIMARY)
    long = _table_items(manager, "long")
    # Every 4-step window ends with a 2-step window of the same episode.
    endings = {tuple(a[-2:].tobytes() for a in data) for data in long.values()}
    assert endings <= set(_windows(short))
    trajectory, _ = next(iter(manager.get_dataset(8, table="long")))
    assert trajectory.observation.shape == [8, 4, 4]
    trajectory, _ = next(iter(manager.get_dataset(8, num_steps=2, table="long")))
    assert trajectory.observation.shape == [8, 2, 4]
    trajectory, _ = next(iter(manager.get_dataset(8)))
    assert trajectory.observation.shape == [8, 2, 4]
    with manager.torch_batches(8, table="long") as batches:
        assert tuple(next(iter(batches)).observation.shape) == (8, 4, 4)


# --------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([_prioritized(name=PRIMARY)], "duplicates ['uniform_table']"),
        ([_prioritized(), _prioritized()], "duplicates ['prioritized']"),
        ([{"name": "x"}], "extra_tables[0] must be a TableConfig, got dict"),
        ("prioritized", "must be a sequence of TableConfig, got 'prioritized'"),
    ],
)
def test_extra_tables_are_checked_up_front(make_manager, extra, message):
    with pytest.raises(ConfigError) as info:
        make_manager(extra_tables=extra)
    assert message in str(info.value)


def test_an_unknown_table_name_is_refused_listing_the_tables(make_manager):
    manager = make_manager(extra_tables=[_prioritized()])
    manager.create_replay_buffer()
    calls = [
        lambda: manager.num_frames(table="nope"),
        lambda: manager.get_dataset(4, table="nope"),
        lambda: manager.torch_batches(4, table="nope"),
        lambda: manager.torch_dataset(4, table="nope"),
        lambda: manager.update_priorities([1], [1.0], table="nope"),
    ]
    for call in calls:
        with pytest.raises(ConfigError, match=r"unknown table 'nope'.*\['uniform_table', 'prio"):
            call()


def test_export_and_import_refuse_a_buffer_of_several_tables(make_manager, tmp_path):
    manager = make_manager(extra_tables=[_prioritized()])
    manager.create_replay_buffer()
    with pytest.raises(ConfigError, match="export supports a buffer of one table"):
        manager.export(tmp_path / "exported")
    other = make_manager(extra_tables=[_prioritized()], checkpoint_dir=str(tmp_path / "other"))
    with pytest.raises(ConfigError, match="import supports a buffer of one table"):
        other.import_buffer(tmp_path / "exported")


# ------------------------------------------------------------------- checkpoints, clear


def test_checkpoint_restores_both_tables_and_refuses_changed_extra_tables(
    make_manager, env, policy
):
    manager = make_manager(extra_tables=[_prioritized()])
    _, observer = manager.create_replay_buffer()
    collect(env, policy, observer, 80)
    written = {t: _table_items(manager, t) for t in (PRIMARY, EXTRA)}
    path = manager.checkpoint()
    info = json.loads(Path(path, CHECKPOINT_META_FILE).read_text())
    assert info["store"]["extra_tables"] == [
        {"name": EXTRA, "sequence_length": 2, "capacity": 1000}
    ]
    assert info["num_items"] == sum(len(items) for items in written.values())
    manager.close()

    refusals = [
        ([_prioritized(capacity=500)], "extra table 'prioritized' capacity: requested 500"),
        ([_prioritized(sequence_length=3)], "extra table 'prioritized' sequence_length"),
        ([], "extra_tables: requested [], stored ['prioritized']"),
        ([_prioritized(), _prioritized(name="more")], "missing from the checkpoint: ['more']"),
    ]
    for extra, message in refusals:
        other = make_manager(extra_tables=extra)
        with pytest.raises(SpecMismatchError) as error:
            other.load_replay_buffer()
        assert message in str(error.value)
        other.close()

    restored = make_manager(extra_tables=[_prioritized()])
    restored.load_replay_buffer()
    for table, items in written.items():
        read = _table_items(restored, table)
        assert read.keys() == items.keys()
        assert _windows(read) == _windows(items)


def test_old_single_table_metadata_still_loads(make_manager, env, policy, tmp_path):
    manager = make_manager()
    _, observer = manager.create_replay_buffer()
    collect(env, policy, observer, 30)
    count = manager.num_frames()
    path = manager.checkpoint()
    manager.close()
    # Files written before extra tables existed have no "extra_tables" field.
    for file in (tmp_path / "ckpt" / STORE_FILE, Path(path, CHECKPOINT_META_FILE)):
        data = json.loads(file.read_text())
        del data.get("store", data)["extra_tables"]
        file.write_text(json.dumps(data))
    stored = StoreMetadata.from_json(
        json.loads((tmp_path / "ckpt" / STORE_FILE).read_text()), "old"
    )
    assert stored.extra_tables == ()

    with pytest.raises(SpecMismatchError, match=r"missing from the checkpoint: \['prioritized'\]"):
        make_manager(extra_tables=[_prioritized()]).load_replay_buffer()
    restored = make_manager()
    restored.load_replay_buffer()
    assert restored.num_frames() == count


def test_clear_empties_every_table(make_manager, env, policy):
    manager = make_manager(extra_tables=[_prioritized(sequence_length=3)])
    _, observer = manager.create_replay_buffer()
    collect(env, policy, observer, 50)
    assert manager.num_frames() > 0 and manager.num_frames(table=EXTRA) > 0
    manager.clear()
    assert manager.num_frames() == 0
    assert manager.num_frames(table=EXTRA) == 0
    collect(env, policy, observer, 20)  # the observer still writes to both
    assert manager.num_frames() > 0 and manager.num_frames(table=EXTRA) > 0
    manager.clear()
    manager.close()
    restored = make_manager(extra_tables=[_prioritized(sequence_length=3)])
    restored.load_replay_buffer()
    assert restored.num_frames() == 0
    assert restored.num_frames(table=EXTRA) == 0


def test_a_server_config_with_changed_extra_tables_is_refused_on_restore(tmp_path):
    config = load_config(
        TWO_TABLES_CONFIG, server__checkpoint_dir=str(tmp_path / "ckpt"), server__port=free_port()
    )
    server = serve_config(config, config.data_spec.build(load_env), restore=False)
    final = server.stop(final_checkpoint=True)
    assert final is not None
    assert [t.name for t in final.metadata.extra_tables] == ["prioritized_table"]
    smaller = dataclasses.replace(config.extra_tables[0], capacity=2000)
    changed = dataclasses.replace(config, extra_tables=(smaller,))
    with pytest.raises(SpecMismatchError, match="extra table 'prioritized_table' capacity"):
        serve_config(changed, changed.data_spec.build(load_env), restore=True)
    restored = serve_config(config, config.data_spec.build(load_env), restore=True)
    assert restored.restored_from is not None
    restored.stop(final_checkpoint=False)


# ------------------------------------------------------------------------ mixing


def _two_filled_tables(make_manager, env, policy, extra: TableConfig | None = None):
    manager = make_manager(extra_tables=[extra or _prioritized()])
    _, observer = manager.create_replay_buffer()
    collect(env, policy, observer, 100)
    return manager


@pytest.mark.heavy
def test_mixed_dataset_draws_each_table_in_proportion_to_its_weight(make_manager, env, policy):
    manager = _two_filled_tables(make_manager, env, policy)
    uniform_keys = set(_table_items(manager, PRIMARY))
    prioritized_keys = set(_table_items(manager, EXTRA))
    dataset = manager.mixed_dataset(200, {PRIMARY: 3.0, EXTRA: 1.0}, seed=7)
    drawn = []
    for trajectory, info in dataset.take(20):
        assert trajectory.observation.shape == [200, 2, 4]
        assert info.key.shape == [200, 2]
        drawn += [int(k) for k in info.key.numpy()[:, 0]]
    assert set(drawn) <= uniform_keys | prioritized_keys
    fraction = sum(k in uniform_keys for k in drawn) / len(drawn)
    sigma = math.sqrt(0.75 * 0.25 / len(drawn))
    assert abs(fraction - 0.75) <= SIGMAS * sigma, fraction

    only = manager.mixed_dataset(50, {PRIMARY: 0.0, EXTRA: np.float32(2.0)})
    _, info = next(iter(only))
    assert {int(k) for k in info.key.numpy()[:, 0]} <= prioritized_keys


@pytest.mark.heavy
def test_priorities_of_a_mixed_batch_update_only_the_named_table(make_manager, env, policy):
    manager = _two_filled_tables(make_manager, env, policy)
    prioritized_keys = set(_table_items(manager, EXTRA))
    _, info = next(iter(manager.mixed_dataset(64, {PRIMARY: 1.0, EXTRA: 1.0}, seed=1)))
    keys = info.key.numpy()[:, 0]
    assert any(int(k) in prioritized_keys for k in keys)
    assert any(int(k) not in prioritized_keys for k in keys)
    manager.update_priorities(keys, np.full(len(keys), 5.0), table=EXTRA)
    after = _priorities(manager, EXTRA)
    batch_keys = {int(k) for k in keys}
    for key, priority in after.items():
        assert priority == (5.0 if key in batch_keys else 1.0), (key, priority)
    assert set(_priorities(manager, PRIMARY).values()) == {1.0}


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ({}, "weights must be a non-empty mapping"),
        ([("uniform_table", 1.0)], "weights must be a non-empty mapping"),
        ({"nope": 1.0}, "unknown table 'nope'"),
        ({PRIMARY: float("nan")}, "weight of table 'uniform_table' must be a finite number >= 0"),
        ({PRIMARY: float("inf")}, "got inf"),
        ({PRIMARY: 1.0, EXTRA: -1.0}, "weight of table 'prioritized' must be a finite"),
        ({PRIMARY: "3"}, "got '3'"),
        ({PRIMARY: 0.0, EXTRA: 0}, "weights must have a positive, finite sum"),
    ],
)
def test_mixed_dataset_refuses_bad_weights(make_manager, weights, message):
    manager = make_manager(extra_tables=[_prioritized()])
    manager.create_replay_buffer()
    with pytest.raises(ConfigError) as info:
        manager.mixed_dataset(8, weights)
    assert message in str(info.value)


@pytest.mark.heavy
def test_mixed_dataset_refuses_tables_of_different_sequence_lengths(make_manager):
    manager = make_manager(extra_tables=[_prioritized(sequence_length=3)])
    manager.create_replay_buffer()
    with pytest.raises(ConfigError, match=r"one sequence_length.*'prioritized': 3"):
        manager.mixed_dataset(8, {PRIMARY: 1.0, EXTRA: 1.0})


@pytest.mark.heavy
def test_mixed_dataset_of_an_empty_table_fails_naming_the_tables(make_manager, env, policy):
    manager = make_manager(extra_tables=[_prioritized()])
    manager.create_replay_buffer()
    with pytest.raises(
        tf.errors.InvalidArgumentError, match=r"mixed tables .*uniform_table.*prioritized"
    ):
        next(iter(manager.mixed_dataset(8, {PRIMARY: 1.0, EXTRA: 1.0})))


# ------------------------------------------------------------------- server and TOML


@pytest.mark.heavy
def test_toml_extra_tables_serve_every_table_and_status_lists_them(
    start_server, tmp_path, env, policy, data_spec
):
    _, address = start_server("--checkpoint_interval_s=0", config=TWO_TABLES_CONFIG)
    extra = TableConfig(name="prioritized_table", capacity=100_000, sequence_length=2)
    with ReplayBufferManager(
        data_spec, 100_000, server_address=address, extra_tables=[extra], timeouts=FAST_TIMEOUTS
    ) as manager:
        _, observer = manager.load_replay_buffer()
        collect(env, policy, observer, 40)
        count = manager.num_frames()
        assert count > 0 and manager.num_frames(table="prioritized_table") == count
    wrong = TableConfig(name="prioritized_table", capacity=5, sequence_length=2)
    with (
        ReplayBufferManager(
            data_spec, 100_000, server_address=address, extra_tables=[wrong], timeouts=FAST_TIMEOUTS
        ) as manager,
        pytest.raises(SpecMismatchError, match="capacity: requested 5, found 100000"),
    ):
        manager.load_replay_buffer()
    missing = TableConfig(name="absent", capacity=100_000, sequence_length=2)
    with (
        ReplayBufferManager(
            data_spec,
            100_000,
            server_address=address,
            extra_tables=[missing],
            timeouts=FAST_TIMEOUTS,
        ) as manager,
        pytest.raises(SpecMismatchError, match="no table 'absent'"),
    ):
        manager.load_replay_buffer()

    result = subprocess.run(
        [sys.executable, "-m", "replay_service.cli.serve", "status", f"--address={address}"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"table uniform_table: {count}/100000 items" in result.stdout
    assert f"table prioritized_table: {count}/100000 items" in result.stdout
    assert "sampler prioritized(exponent=0.6)" in result.stdout

    with ReplayBufferManager(
        data_spec, 100_000, server_address=address, extra_tables=[extra], timeouts=FAST_TIMEOUTS
    ) as manager:
        with pytest.raises(CheckpointExistsError, match="table 'uniform_table'.*already holds"):
            manager.create_replay_buffer()
        manager.create_replay_buffer(overwrite=True)
        assert manager.num_frames() == manager.num_frames(table="prioritized_table") == 0


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ('[[extra_tables]]\nname = "p"\nsize = 3\n', "unknown key extra_tables[0].'size'"),
        ('[[extra_tables]]\nname = "uniform_table"\n', "duplicates ['uniform_table']"),
        ('[[extra_tables]]\nname = "p"\ncapacity = 0\n', "extra_tables[0]: capacity must be"),
        (
            '[[extra_tables]]\nname = "p"\n[extra_tables.sampling]\nsampler = "x"\n',
            "extra_tables[0]: sampler must be one of",
        ),
        ("extra_tables = 3\n", "extra_tables must be an array of tables"),
    ],
)
def test_bad_extra_tables_in_a_config_name_the_key(tmp_path, toml, message):
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert message in str(info.value) and str(path) in str(info.value)


def test_the_two_table_config_loads(data_spec):
    config = load_config(TWO_TABLES_CONFIG)
    assert [t.name for t in config.tables] == ["uniform_table", "prioritized_table"]
    assert config.extra_tables[0].sampling.sampler == "prioritized"
    assert describe_spec(config.data_spec.build(load_env)) == describe_spec(data_spec)
