"""manager.observer(pad_end_of_episodes=..., tile_end_of_episodes=...) writes, item for item
and in order, what TF-Agents' own ReverbAddTrajectoryObserver writes with the same options."""

from __future__ import annotations

import numpy as np
import pytest
import tree
from tf_agents.replay_buffers import reverb_utils

from replay_service.collect.episode_padding import EpisodePadding, boundary_zeros
from replay_service.errors import ConfigError
from replay_service.specs.nests import normalize_spec, numpy_dtype
from replay_service.storage.importing import read_export

FIRST, MID, LAST = 0, 1, 2
# Steps per episode, the boundary step included: shorter and longer than the windows.
EPISODE_LENGTHS = (2, 3, 4, 5, 6, 9, 13)
TRAILING_STEPS = 3  # an unfinished episode, ended by reset(write_cached_steps=True)


def _steps(data_spec) -> list:
    """Hand-written steps of several episodes; every real step's values are distinct."""
    spec = normalize_spec(data_spec)

    def step(value: float, step_type: int, next_step_type: int):
        made = tree.map_structure(
            lambda s: np.full(s.shape, value, numpy_dtype(s)).astype(numpy_dtype(s)), spec
        )
        made = made._replace(
            action=np.full(spec.action.shape, int(value) % 2, numpy_dtype(spec.action)),
            discount=np.full(spec.discount.shape, 1.0, numpy_dtype(spec.discount)),
        )
        return made._replace(
            step_type=np.full(spec.step_type.shape, step_type, numpy_dtype(spec.step_type)),
            next_step_type=np.full(
                spec.next_step_type.shape, next_step_type, numpy_dtype(spec.next_step_type)
            ),
        )

    steps, value = [], 1.0
    for length in EPISODE_LENGTHS:
        for index in range(length):
            if index == length - 1:
                kinds = (LAST, FIRST)
            else:
                kinds = (FIRST if index == 0 else MID, LAST if index == length - 2 else MID)
            steps.append(step(value, *kinds))
            value += 1.0
    for index in range(TRAILING_STEPS):
        steps.append(step(value, FIRST if index == 0 else MID, MID))
        value += 1.0
    return steps


def _ordered_items(manager, tmp_path, name: str) -> list[list[np.ndarray]]:
    """Every item of the primary table, oldest first (through an export)."""
    manager.export(tmp_path / name)
    items = read_export(manager.table_config, manager.stored_spec, tmp_path / name)
    return [[field[i] for field in items.data] for i in range(items.num_items)]


CASES = [
    # TF-Agents' own padded cases (reverb_utils_test), then untiled padding of short episodes.
    (4, 1, True),
    (4, 2, True),
    (4, 3, True),
    (4, 4, True),
    (4, 4, False),
    (2, 1, True),
    (3, 1, False),
    (3, 2, False),
    (5, 2, False),
]


@pytest.mark.parametrize(("sequence_length", "stride_length", "tile"), CASES)
@pytest.mark.parametrize("where", ["reverb", "packed", "local"])
def test_padded_items_equal_tf_agents_observer_item_for_item(
    make_manager, data_spec, tmp_path, sequence_length, stride_length, tile, where
):
    steps = _steps(data_spec)
    options = {"sequence_length": sequence_length, "stride_length": stride_length}
    if where == "local":
        options["backend"] = "local"
    if where == "packed":
        options["layout"] = "packed"
    ours = make_manager(checkpoint_dir=str(tmp_path / "ours"), **options)
    ours.create_replay_buffer()
    observer = ours.observer(pad_end_of_episodes=True, tile_end_of_episodes=tile)
    theirs = make_manager(checkpoint_dir=str(tmp_path / "theirs"), sequence_length=sequence_length)
    theirs.create_replay_buffer()
    reference = reverb_utils.ReverbAddTrajectoryObserver(
        theirs.py_client,
        theirs.table_name,
        sequence_length,
        stride_length=stride_length,
        pad_end_of_episodes=True,
        tile_end_of_episodes=tile,
    )
    for step in steps:
        observer(step)
        reference(step)
    observer.reset(write_cached_steps=True)
    reference.reset(write_cached_steps=True)
    observer.flush()
    reference.flush()
    reference.close()

    expected = _ordered_items(theirs, tmp_path, "theirs-export")
    got = _ordered_items(ours, tmp_path, "ours-export")
    assert len(got) == len(expected) > 0
    for index, (item, want) in enumerate(zip(got, expected, strict=True)):
        for field, (a, b) in enumerate(zip(item, want, strict=True)):
            np.testing.assert_array_equal(a, b, err_msg=f"item {index}, field {field}")
    # Padding steps (zero observations: real ones are >= 1) end some of the items.
    observations = np.stack([item[1] for item in got])  # [items, sequence_length, 4]
    assert (observations == 0).all(axis=-1).any()


def test_observer_without_padding_is_the_handed_out_one(make_manager, data_spec, tmp_path):
    """The default observer() writes what TF-Agents' unpadded observer writes."""
    steps = _steps(data_spec)
    ours = make_manager(checkpoint_dir=str(tmp_path / "ours"), sequence_length=3)
    ours.create_replay_buffer()
    observer = ours.observer()
    theirs = make_manager(checkpoint_dir=str(tmp_path / "theirs"), sequence_length=3)
    theirs.create_replay_buffer()
    reference = reverb_utils.ReverbAddTrajectoryObserver(theirs.py_client, theirs.table_name, 3)
    for step in steps:
        observer(step)
        reference(step)
    observer.flush()
    reference.flush()
    got = _ordered_items(ours, tmp_path, "ours-export")
    expected = _ordered_items(theirs, tmp_path, "theirs-export")
    assert len(got) == len(expected) > 0
    for item, want in zip(got, expected, strict=True):
        for a, b in zip(item, want, strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"pad_end_of_episodes": "yes"}, "'yes'"),
        ({"pad_end_of_episodes": True, "tile_end_of_episodes": 1}, "tile_end_of_episodes"),
        ({"tile_end_of_episodes": True}, "needs pad_end_of_episodes=True"),
    ],
)
def test_bad_padding_flags_are_refused(make_manager, kwargs, named):
    manager = make_manager(sequence_length=3)
    manager.create_replay_buffer()
    with pytest.raises(ConfigError, match=named):
        manager.observer(**kwargs)


def test_tf_agents_padding_on_a_masked_table_is_refused(make_manager):
    manager = make_manager(sequence_length=3, pad_end_of_episode=True)
    manager.create_replay_buffer()
    with pytest.raises(ConfigError, match="pad_end_of_episode=True"):
        manager.observer(pad_end_of_episodes=True)


# ------------------------------------------------------------------ EpisodePadding on its own


def test_padding_counts_of_each_mode(data_spec):
    plain = EpisodePadding.build(data_spec, 4, True, False, masked_table=False)
    tiled = EpisodePadding.build(data_spec, 4, True, True, masked_table=False)
    assert [plain.count(n) for n in (0, 1, 3, 4, 9)] == [0, 3, 1, 0, 0]
    assert [tiled.count(n) for n in (0, 1, 3, 4, 9)] == [0, 3, 3, 3, 3]
    assert EpisodePadding.build(data_spec, 4, False, False, masked_table=True) is None
    assert EpisodePadding.build(data_spec, 4, np.False_, False, masked_table=False) is None


def test_the_padding_step_is_zeros_with_last_then_first_step_types(data_spec):
    step = boundary_zeros(data_spec)
    spec = normalize_spec(data_spec)
    assert int(step.step_type) == 2 and int(step.next_step_type) == 0  # LAST -> FIRST
    assert float(step.discount) == 0.0 and float(step.reward) == 0.0
    for leaf, leaf_spec in zip(tree.flatten(step), tree.flatten(spec), strict=True):
        assert leaf.shape == tuple(leaf_spec.shape) and leaf.dtype == numpy_dtype(leaf_spec)
    assert not step.observation.any()
