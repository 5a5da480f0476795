"""Bare Reverb checkpoint roots (sbsim starter buffers) are adopted by copy_buffer and --copy-to."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import reverb
from tf_agents.drivers import py_driver
from tf_agents.replay_buffers import reverb_utils
from tf_agents.specs import tensor_spec

from conftest import FAST_TIMEOUTS, REPO, all_items, tree_digest
from replay_service import (
    CheckpointError,
    CheckpointStore,
    ReplayBufferManager,
    SpecMismatchError,
    copy_buffer,
)
from replay_service.backends.reverb.internals import ColumnType
from replay_service.starter.adoption import diff_columns

TABLE = "uniform_table"
CAPACITY = 1000
STEPS = 60


def build_sbsim_root(root: Path, env: Any, policy: Any, data_spec: Any, steps: int) -> int:
    """Writes a bare Reverb checkpoint root the way sbsim's starter buffers are made.

    A uniform table `uniform_table` whose signature is the collect spec with an unknown
    leading dimension, Reverb's `DefaultCheckpointer`, TF-Agents'
    `ReverbAddTrajectoryObserver` writing 2-step windows, and `client.checkpoint()`.

    Returns:
      The number of items written.
    """
    signature = tensor_spec.add_outer_dim(tensor_spec.from_spec(data_spec))
    table = reverb.Table(
        name=TABLE,
        max_size=CAPACITY,
        sampler=reverb.selectors.Uniform(),
        remover=reverb.selectors.Fifo(),
        rate_limiter=reverb.rate_limiters.MinSize(1),
        signature=signature,
    )
    checkpointer = reverb.checkpointers.DefaultCheckpointer(path=str(root))
    server = reverb.Server([table], port=None, checkpointer=checkpointer)
    try:
        client = reverb.Client(f"localhost:{server.port}")
        observer = reverb_utils.ReverbAddTrajectoryObserver(
            client, TABLE, sequence_length=2, stride_length=1
        )
        py_driver.PyDriver(env, policy, [observer], max_steps=steps).run(env.reset())
        observer.close()
        client.checkpoint()
        return int(client.server_info()[TABLE].current_size)
    finally:
        server.stop()


@pytest.fixture()
def sbsim_root(tmp_path: Path, env: Any, policy: Any, data_spec: Any) -> tuple[Path, int]:
    root = tmp_path / "starter_buffers" / "default"
    return root, build_sbsim_root(root, env, policy, data_spec, STEPS)


def _source_items(root: Path, expected: int) -> dict[int, list[np.ndarray]]:
    """Every item of the bare root's newest checkpoint, loaded the way sbsim loads it."""
    checkpointer = reverb.checkpointers.DefaultCheckpointer(path=str(root))
    placeholder = reverb.Table.queue(TABLE, CAPACITY)  # Reverb restores the stored table
    server = reverb.Server([placeholder], port=None, checkpointer=checkpointer)
    try:
        return all_items(reverb.Client(f"localhost:{server.port}"), TABLE, expected)
    finally:
        server.stop()


@pytest.mark.heavy
def test_bare_root_is_copied_and_every_item_restores_identically(
    sbsim_root: tuple[Path, int], tmp_path: Path, data_spec: Any
) -> None:
    root, written = sbsim_root
    assert written == STEPS - 1
    before = tree_digest(root)
    target = copy_buffer(root, tmp_path / "run" / "replay", data_spec=data_spec)
    assert tree_digest(root) == before  # the source is only read

    stored = CheckpointStore(target).read_metadata()
    assert (stored.table_name, stored.capacity, stored.sequence_length) == (TABLE, CAPACITY, 2)
    assert CheckpointStore(target).latest().num_items == written
    expected = _source_items(root, written)
    assert tree_digest(root) == before
    with ReplayBufferManager(
        data_spec, stored.capacity, target, stored.sequence_length, timeouts=FAST_TIMEOUTS
    ) as manager:
        manager.load_replay_buffer()
        assert manager.num_frames() == written
        restored = all_items(manager.py_client, TABLE, written)
        assert restored.keys() == expected.keys()
        for key, data in expected.items():
            assert len(restored[key]) == len(data)
            for got, want in zip(restored[key], data, strict=True):
                np.testing.assert_array_equal(got, want)
        batch, _ = next(iter(manager.get_dataset(batch_size=8)))  # the tf read path works
        assert batch.observation.shape == (8, 2, 4)
        manager.transition_writer()  # collecting on into the copy is possible
        path = manager.save_checkpoint()
        assert os.path.dirname(path) == os.path.join(target, "checkpoints")
    assert tree_digest(root) == before


def test_a_bare_root_copy_gets_explicit_modes_under_umask_000(
    sbsim_root: tuple[Path, int], tmp_path: Path, data_spec: Any
) -> None:
    root, _ = sbsim_root
    old = os.umask(0)
    try:
        target = copy_buffer(root, tmp_path / "replay", data_spec=data_spec)
    finally:
        os.umask(old)
    modes = {}
    for directory, dirs, files in os.walk(target):
        for name in dirs + files:
            path = os.path.join(directory, name)
            modes[os.path.relpath(path, target)] = stat.S_IMODE(os.lstat(path).st_mode)
    assert {"replay_service.json", "checkpoints", ".reverb"} <= modes.keys()
    wrong = {
        path: oct(mode)
        for path, mode in modes.items()
        if mode != (0o750 if os.path.isdir(os.path.join(target, path)) else 0o640)
    }
    assert wrong == {}
    assert stat.S_IMODE(os.lstat(target).st_mode) == 0o750


def test_copy_without_data_spec_takes_the_stored_signature(
    sbsim_root: tuple[Path, int], tmp_path: Path, data_spec: Any
) -> None:
    root, written = sbsim_root
    target = copy_buffer(root, tmp_path / "copy")
    with ReplayBufferManager(data_spec, CAPACITY, target, 2, timeouts=FAST_TIMEOUTS) as manager:
        manager.load_replay_buffer()  # the spec derived from the signature matches the agent's
        assert manager.num_frames() == written


def test_a_different_data_spec_is_refused_naming_the_field(
    sbsim_root: tuple[Path, int], tmp_path: Path, data_spec: Any
) -> None:
    root, _ = sbsim_root
    before = tree_digest(root)
    wrong = data_spec._replace(
        observation=tensor_spec.TensorSpec([5], data_spec.observation.dtype, "observation")
    )
    with pytest.raises(SpecMismatchError, match=r"'observation': expected float32\[5\]"):
        copy_buffer(root, tmp_path / "copy", data_spec=wrong)
    assert not (tmp_path / "copy").exists()
    assert tree_digest(root) == before


def test_load_replay_buffer_on_a_bare_root_names_the_command_that_adopts_it(
    sbsim_root: tuple[Path, int], data_spec: Any
) -> None:
    root, _ = sbsim_root
    before = tree_digest(root)
    manager = ReplayBufferManager(data_spec, CAPACITY, root, 2, timeouts=FAST_TIMEOUTS)
    try:
        with pytest.raises(CheckpointError) as raised:
            manager.load_replay_buffer()
    finally:
        manager.close()
    message = str(raised.value)
    assert "bare Reverb checkpoint root" in message
    assert f"replay-populate --buffer-name default --output-dir {root.parent} --copy-to" in message
    assert "copy_buffer(" in message
    assert tree_digest(root) == before


@pytest.mark.heavy
def test_replay_populate_copy_to_adopts_a_bare_root(
    sbsim_root: tuple[Path, int], tmp_path: Path
) -> None:
    root, written = sbsim_root
    before = tree_digest(root)
    target = tmp_path / "run" / "replay"
    result = subprocess.run(
        [
            sys.executable, "-m", "replay_service.cli.populate", "--buffer-name", "default",
            "--output-dir", str(root.parent), "--copy-to", str(target),
        ],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env={k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert f"({written} items)" in result.stdout
    assert f"ReplayBufferManager(data_spec, {CAPACITY}, {str(target)!r}, 2)" in result.stdout
    assert result.stderr == ""
    assert CheckpointStore(target).latest().num_items == written
    assert tree_digest(root) == before


# ------------------------------------------------------------ diff_columns, without a checkpoint


def _field(path: str, dtype: str, shape: list) -> dict:
    return {"path": path, "dtype": dtype, "shape": shape}


FIELDS = [
    _field("step_type", "int32", []),
    _field("observation", "float32", [4]),
    _field("action", "int64", []),
]


def test_diff_columns_of_matching_and_empty_tables_is_empty():
    columns = [ColumnType("int32", ()), ColumnType("float32", (4,)), ColumnType("int64", ())]
    assert diff_columns(FIELDS, columns) == []
    assert diff_columns(FIELDS, []) == []  # a table without items matches any spec
    unknown = [_field("x", "float32", [None, 3])]  # a spec's unknown dimension matches any
    assert diff_columns(unknown, [ColumnType("float32", (7, 3))]) == []
    assert diff_columns(unknown, [ColumnType("float32", (7,))]) != []


def test_diff_columns_names_every_field_that_differs():
    columns = [ColumnType("int64", ()), ColumnType("float32", (5,)), ColumnType("int64", ())]
    assert diff_columns(FIELDS, columns) == [
        "field 'step_type': the data_spec says int32[], the stored items hold int64[]",
        "field 'observation': the data_spec says float32[4], the stored items hold float32[5]",
    ]


def test_diff_columns_of_counts_that_differ_by_more_than_one_describes_both():
    (message,) = diff_columns(FIELDS, [ColumnType("float32", (4,))])
    assert message.startswith("the data_spec has 3 fields (step_type: int32[], observation: ")
    assert message.endswith("the stored items have 1 columns (float32[4])")
    # One field more, but the rest do not pair up either: no single field is blamed.
    (message,) = diff_columns(FIELDS, [ColumnType("int8", ()), ColumnType("int8", ())])
    assert message.startswith("the data_spec has 3 fields")
