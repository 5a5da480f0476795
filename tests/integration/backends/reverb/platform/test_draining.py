"""`backends.reverb.platform.draining`: every item of a checkpoint's table read once, decoded, in
the checkpoint's order, with its priority and sample count; on a real Reverb checkpoint."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import reverb
import tensorflow as tf

from replay_service.backends.reverb.platform.draining import _positions, read_checkpoint_items
from replay_service.errors import CheckpointError
from replay_service.storage.files import DONE_FILE

SIGNATURE = {
    "obs": tf.TensorSpec([2, 3], tf.float32),
    "act": tf.TensorSpec([2], tf.int64),
}
NUM_ITEMS = 5
SAMPLED = 4


def _table(name: str) -> reverb.Table:
    return reverb.Table(
        name=name,
        sampler=reverb.selectors.Uniform(),
        remover=reverb.selectors.Fifo(),
        max_size=100,
        rate_limiter=reverb.rate_limiters.MinSize(1),
        signature=SIGNATURE,
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A checkpoint of `t` (items 0..4, priority i + 1, sampled `SAMPLED` times) and `other`."""
    root = tmp_path_factory.mktemp("draining")
    server = reverb.Server(
        [_table("t"), _table("other")],
        port=None,
        checkpointer=reverb.checkpointers.DefaultCheckpointer(str(root)),
    )
    client = server.localhost_client()
    with client.trajectory_writer(num_keep_alive_refs=2) as writer:
        for i in range(NUM_ITEMS):
            for step in range(2):
                writer.append(
                    {
                        "obs": np.full([3], 10 * i + step, np.float32),
                        "act": np.int64(10 * i + step),
                    }
                )
            writer.create_item(
                "t", i + 1.0, {"obs": writer.history["obs"][-2:], "act": writer.history["act"][-2:]}
            )
            writer.end_episode()
        writer.flush()
    for _ in client.sample("t", num_samples=SAMPLED):
        pass
    path = client.checkpoint()
    yield path
    server.stop()


def test_items_come_back_once_in_their_order_with_priorities_and_counts(checkpoint: str) -> None:
    data, priorities, times_sampled = read_checkpoint_items(checkpoint, "t", SIGNATURE, 30.0)
    act, obs = data  # tf.nest order: sorted keys
    np.testing.assert_array_equal(act, [[10 * i, 10 * i + 1] for i in range(NUM_ITEMS)])
    assert obs.shape == (NUM_ITEMS, 2, 3) and obs.dtype == np.float32
    np.testing.assert_array_equal(obs[:, :, 0], act.astype(np.float32))
    np.testing.assert_array_equal(priorities, np.arange(1.0, NUM_ITEMS + 1))
    assert times_sampled.dtype == np.int32 and times_sampled.sum() == SAMPLED


def test_an_empty_table_reads_as_empty_arrays_of_the_signature(checkpoint: str) -> None:
    data, priorities, times_sampled = read_checkpoint_items(checkpoint, "other", SIGNATURE, 30.0)
    assert [a.shape for a in data] == [(0, 2), (0, 2, 3)]
    assert [a.dtype for a in data] == [np.int64, np.float32]
    assert len(priorities) == 0 and len(times_sampled) == 0


def test_a_missing_table_is_named_with_those_the_checkpoint_has(checkpoint: str) -> None:
    with pytest.raises(CheckpointError, match=r"no table 'nope'; it has \['other', 't'\]"):
        read_checkpoint_items(checkpoint, "nope", SIGNATURE, 30.0)


def test_an_incomplete_checkpoint_is_refused(checkpoint: str, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(checkpoint, copy)
    os.remove(copy / DONE_FILE)
    with pytest.raises(CheckpointError, match=r"not readable from this machine or incomplete"):
        read_checkpoint_items(str(copy), "t", SIGNATURE, 30.0)


def test_items_of_another_width_are_left_out_with_a_warning(checkpoint: str) -> None:
    narrower = {"act": SIGNATURE["act"]}
    with pytest.warns(UserWarning, match=r"holds 5 of 5 items with \[2\] columns where its "):
        data, priorities, _ = read_checkpoint_items(checkpoint, "t", narrower, 30.0)
    assert len(priorities) == 0 and data[0].shape == (0, 2)


def test_positions_reorders_the_sampled_keys_and_refuses_what_does_not_match() -> None:
    keys = np.array([7, 3, 9], np.uint64)
    sampled = np.array([9, 7, 3], np.uint64)
    np.testing.assert_array_equal(sampled[_positions(keys, sampled, "ck")], keys)
    with pytest.raises(CheckpointError, match=r"'ck': read 2 items \(2 distinct\) of 3"):
        _positions(keys, sampled[:2], "ck")
    with pytest.raises(CheckpointError, match=r"read 3 items \(2 distinct\) of 3"):
        _positions(keys, np.array([9, 9, 3], np.uint64), "ck")
    with pytest.raises(CheckpointError, match=r"do not match its item records"):
        _positions(keys, np.array([9, 7, 4], np.uint64), "ck")
