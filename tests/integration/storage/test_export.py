"""Exact export to safetensors and import into a new buffer, against real Reverb servers."""

from __future__ import annotations

import filecmp
import hashlib
import json
import os
import pathlib

import numpy as np
import pytest
import tensorflow as tf
from safetensors.numpy import load_file

from conftest import all_items, collect
from replay_service import (
    BufferStateError,
    CheckpointError,
    CheckpointExistsError,
    ConfigError,
    SamplingConfig,
    SpecMismatchError,
)
from replay_service.storage.export import FORMAT

HIGH_PRIORITY = 2.5
STEP = np.array([1, 0, 0, 0], np.float32)


def _write_indexed(manager, count: int, priority: float = 1.0) -> None:
    """Writes one episode of `count` transitions whose states are [i, 0, 0, 0]."""
    writer = manager.transition_writer(priority=priority)
    for i in range(count):
        state = np.array([i, 0, 0, 0], np.float32)
        writer.add(state, i % 2, 1.0, state + STEP, i == count - 1)
    writer.flush()


def _canonical(items) -> list[tuple[bytes, ...]]:
    return sorted(tuple(np.asarray(x).tobytes() for x in data) for data in items)


def _exported_items(state_path: str, paths: list[str]) -> list[list[np.ndarray]]:
    tensors = load_file(state_path)
    columns = [tensors[f"data/{p}"] for p in paths]
    return [[c[i] for c in columns] for i in range(columns[0].shape[0])]


def _paths(manager) -> list[str]:
    from replay_service.specs.nests import flatten_with_paths, table_signature

    return [p for p, _ in flatten_with_paths(table_signature(manager.data_spec, 2))]


def test_export_import_export_is_byte_identical_and_exact(make_manager, env, policy, tmp_path):
    prioritized = SamplingConfig(sampler="prioritized")
    source = make_manager(sampling=prioritized)
    _, observer = source.create_replay_buffer()
    collect(env, policy, observer, 40)
    observed = source.num_frames()
    _write_indexed(source, 5, priority=HIGH_PRIORITY)
    state_path, metadata_path = source.export(tmp_path / "first")

    target = make_manager(sampling=prioritized, checkpoint_dir=str(tmp_path / "target"))
    target.import_buffer(tmp_path / "first")
    assert target.num_frames() == source.num_frames() == observed + 5
    again = target.export(tmp_path / "second")
    assert filecmp.cmp(state_path, again[0], shallow=False)
    assert filecmp.cmp(metadata_path, again[1], shallow=False)

    tensors = load_file(state_path)
    # Oldest first: the observer's items, then the writer's, with their priorities.
    np.testing.assert_array_equal(tensors["priorities"][:observed], 1.0)
    np.testing.assert_array_equal(tensors["priorities"][observed:], HIGH_PRIORITY)
    np.testing.assert_array_equal(tensors["data/observation"][observed:, 0, 0], np.arange(5))
    assert tensors["data/step_type"][0, 0] == 0
    np.testing.assert_array_equal(tensors["times_sampled"], 0)
    metadata = json.loads(pathlib.Path(metadata_path).read_text(encoding="utf-8"))
    assert metadata["format"] == FORMAT and metadata["num_items"] == observed + 5
    assert metadata["sequence_length"] == 2 and metadata["capacity"] == 1000
    assert {"replay_service", "dm-reverb", "tf-agents"} <= set(metadata["versions"])

    paths = _paths(source)
    exported = _canonical(_exported_items(state_path, paths))
    in_source = all_items(source.py_client, source.table_name, source.num_frames()).values()
    in_target = all_items(target.py_client, target.table_name, target.num_frames()).values()
    assert exported == _canonical(in_source) == _canonical(in_target)


def test_export_leaves_the_live_table_alone_and_records_times_sampled(make_manager, tmp_path):
    once = make_manager(sampling=SamplingConfig(max_times_sampled=1))
    once.create_replay_buffer()
    _write_indexed(once, 30)
    state_path, _ = once.export(tmp_path / "once")
    # Sampling the live table to read it would have removed every item.
    assert once.num_frames() == 30
    assert load_file(state_path)["priorities"].shape == (30,)

    sampled = make_manager(checkpoint_dir=str(tmp_path / "sampled"))
    sampled.create_replay_buffer()
    _write_indexed(sampled, 30)
    list(sampled.py_client.sample(sampled.table_name, num_samples=7))
    state_path, _ = sampled.export(tmp_path / "sampled_export")
    assert int(load_file(state_path)["times_sampled"].sum()) == 7


def test_import_into_a_larger_capacity(make_manager, tmp_path):
    source = make_manager()
    source.create_replay_buffer()
    _write_indexed(source, 40)
    source.export(tmp_path / "export")
    bigger = make_manager(capacity=5000, checkpoint_dir=str(tmp_path / "bigger"))
    bigger.import_buffer(tmp_path / "export")
    assert bigger.num_frames() == 40
    assert bigger.py_client.server_info()[bigger.table_name].max_size == 5000


def test_import_into_a_smaller_capacity_needs_drop_oldest(make_manager, tmp_path):
    source = make_manager()
    source.create_replay_buffer()
    _write_indexed(source, 40)
    source.export(tmp_path / "export")
    smaller = make_manager(capacity=25, checkpoint_dir=str(tmp_path / "smaller"))
    with pytest.raises(ConfigError, match="holds 40 items but the manager's capacity is 25"):
        smaller.import_buffer(tmp_path / "export")
    smaller.import_buffer(tmp_path / "export", drop_oldest=True)
    assert smaller.num_frames() == 25
    items = all_items(smaller.py_client, smaller.table_name, 25).values()
    index = _paths(smaller).index("observation")
    assert sorted(int(data[index][0, 0]) for data in items) == list(range(15, 40))


def test_export_refuses_a_non_empty_directory(make_manager, tmp_path):
    manager = make_manager()
    manager.create_replay_buffer()
    _write_indexed(manager, 3)
    target = tmp_path / "export"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointExistsError, match=r"not empty.*notes\.txt.*overwrite=True"):
        manager.export(target)
    manager.export(target, overwrite=True)
    manager.export(target, prefix="other_", overwrite=True)
    assert sorted(os.listdir(target)) == [
        "buffer_metadata.json",
        "buffer_state.safetensors",
        "notes.txt",
        "other_metadata.json",
        "other_state.safetensors",
    ]


def test_import_refuses_corrupt_truncated_and_mismatched_exports(make_manager, data_spec, tmp_path):
    source = make_manager()
    source.create_replay_buffer()
    _write_indexed(source, 10)
    state_path, metadata_path = source.export(tmp_path / "export")
    good_state = pathlib.Path(state_path).read_bytes()

    def importer(**kwargs):
        kwargs.setdefault("checkpoint_dir", str(tmp_path / "import"))
        return make_manager(**kwargs)

    with open(state_path, "wb") as f:
        f.write(good_state[: len(good_state) // 2])
    with pytest.raises(CheckpointError, match=f"{state_path!r} is corrupt or truncated"):
        importer().import_buffer(tmp_path / "export")
    with open(state_path, "wb") as f:
        f.write(b"\x00garbage" * 10)
    with pytest.raises(CheckpointError, match="buffer_state.safetensors"):
        importer().import_buffer(tmp_path / "export")
    with open(state_path, "wb") as f:
        f.write(good_state)

    metadata = pathlib.Path(metadata_path).read_text(encoding="utf-8")
    with open(metadata_path, "w", encoding="utf-8") as f:
        f.write(metadata[:40])
    with pytest.raises(CheckpointError, match="buffer_metadata.json"):
        importer().import_buffer(tmp_path / "export")
    with open(metadata_path, "w", encoding="utf-8") as f:
        f.write(metadata)
    with pytest.raises(CheckpointError, match="does not exist"):
        importer().import_buffer(tmp_path / "export", prefix="missing_")

    wrong = data_spec._replace(observation=tf.TensorSpec([5], tf.float32, "observation"))
    with pytest.raises(SpecMismatchError) as info:
        importer(data_spec=wrong, sequence_length=3).import_buffer(tmp_path / "export")
    assert "'observation'" in str(info.value) and "float32[5]" in str(info.value)
    assert "sequence_length: manager 3, export 2" in str(info.value)

    # The refusals created nothing: the same directory still takes the import.
    manager = importer()
    manager.import_buffer(tmp_path / "export")
    assert manager.num_frames() == 10
    with pytest.raises(BufferStateError, match="already has a buffer"):
        manager.import_buffer(tmp_path / "export")


def test_an_empty_buffer_round_trips(make_manager, tmp_path):
    source = make_manager()
    source.create_replay_buffer()
    state_path, _ = source.export(tmp_path / "export")
    assert load_file(state_path)["data/observation"].shape == (0, 2, 4)
    target = make_manager(checkpoint_dir=str(tmp_path / "target"))
    target.import_buffer(tmp_path / "export")
    assert target.num_frames() == 0


def test_one_flipped_data_byte_is_refused_by_its_checksum(make_manager, tmp_path):
    source = make_manager()
    source.create_replay_buffer()
    _write_indexed(source, 10)
    state_path, metadata_path = source.export(tmp_path / "export")
    metadata = json.loads(pathlib.Path(metadata_path).read_text(encoding="utf-8"))
    good = pathlib.Path(state_path).read_bytes()
    recorded = metadata["sha256"]["state.safetensors"]
    assert recorded == hashlib.sha256(good).hexdigest()

    # Flip one byte of the observations: still a valid safetensors file, with other data.
    tensors = load_file(state_path)
    header = int.from_bytes(good[:8], "little")
    flipped = bytearray(good)
    flipped[len(good) - 1] ^= 0x01  # the last data byte (of some tensor's payload)
    assert len(good) - 1 >= 8 + header
    pathlib.Path(state_path).write_bytes(bytes(flipped))
    changed = load_file(state_path)
    assert any(not np.array_equal(tensors[k], changed[k]) for k in tensors)
    actual = hashlib.sha256(bytes(flipped)).hexdigest()

    target = make_manager(checkpoint_dir=str(tmp_path / "target"))
    with pytest.raises(CheckpointError) as info:
        target.import_buffer(tmp_path / "export")
    message = str(info.value)
    assert repr(state_path) in message and recorded in message and actual in message
    assert not (tmp_path / "target").exists()  # nothing was imported or created

    pathlib.Path(state_path).write_bytes(good)
    target.import_buffer(tmp_path / "export")
    assert target.num_frames() == 10


def test_an_export_without_checksum_imports_with_a_warning(make_manager, tmp_path):
    source = make_manager()
    source.create_replay_buffer()
    _write_indexed(source, 6)
    _, metadata_path = source.export(tmp_path / "export")
    metadata = json.loads(pathlib.Path(metadata_path).read_text(encoding="utf-8"))
    del metadata["sha256"]  # as written before digests were recorded
    pathlib.Path(metadata_path).write_text(json.dumps(metadata), encoding="utf-8")

    target = make_manager(checkpoint_dir=str(tmp_path / "target"))
    with pytest.warns(UserWarning, match="imported unverified"):
        target.import_buffer(tmp_path / "export")
    assert target.num_frames() == 6

    metadata["sha256"] = {"state.safetensors": "not a digest"}
    pathlib.Path(metadata_path).write_text(json.dumps(metadata), encoding="utf-8")
    with pytest.raises(CheckpointError, match="malformed sha256"):
        make_manager(checkpoint_dir=str(tmp_path / "other")).import_buffer(tmp_path / "export")
