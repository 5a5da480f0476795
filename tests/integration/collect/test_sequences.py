"""Episode-intact sequences: windows with a stride that never cross episodes, padded at the end
of each episode with a mask, checked item by item against a plain-Python reference."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
import tree
from tf_agents.trajectories import trajectory as trajectory_lib

from conftest import CONFIGS, all_items
from replay_service import ConfigError, SpecMismatchError
from replay_service.specs.windows import Masked, padding_needed
from replay_service.starter.envs import load_env

FIRST, MID, LAST = 0, 1, 2
SEQUENCES_CONFIG = os.path.join(CONFIGS, "cartpole_sequences.toml")


def reference_windows(n: int, length: int, stride: int, pad: bool) -> list[list[int | None]]:
    """Step indices of each item of an episode of `n` steps; None marks padding.

    Written from the definition, independently of `padding_needed`: windows start at 0, stride,
    2 * stride, ...; without padding only full windows count; with padding, windows go on until
    one reaches the last step (if it starts inside the episode).
    """
    windows = []
    start = 0
    while True:
        if start + length <= n:
            windows.append(list(range(start, start + length)))
        elif pad and start <= n - 1:
            windows.append([t if t < n else None for t in range(start, start + length)])
            break
        else:
            break
        if start + length == n:
            break
        start += stride
    return windows


@pytest.mark.parametrize("length", [1, 2, 3, 5])
@pytest.mark.parametrize("stride", [1, 2, 3, 7])
def test_padding_needed_matches_the_reference(length, stride):
    for n in range(1, 30):
        windows = reference_windows(n, length, stride, pad=True)
        expected = windows[-1].count(None) if windows else 0
        assert padding_needed(n, length, stride) == expected, (n, length, stride)
    assert padding_needed(0, length, stride) == 0


def episode(data_spec: Any, episode_id: int, n: int, env_id: int = 0) -> list[Any]:
    """`n` trajectory steps whose observation is [env, episode, t, 0]; the last is the
    boundary step."""
    steps = []
    for t in range(n):
        step_type = LAST if t == n - 1 else (FIRST if t == 0 else MID)
        steps.append(
            trajectory_lib.Trajectory(
                step_type=np.int32(step_type),
                observation=np.array([env_id, episode_id, t, 0], np.float32),
                action=np.int64(t % 2),
                policy_info=(),
                next_step_type=np.int32(FIRST if t == n - 1 else MID),
                reward=np.float32(t),
                discount=np.float32(1.0),
            )
        )
    return steps


def stored_items(manager: Any, expected: int) -> list[tuple[list[Any], list[bool]]]:
    """Every item as ([(env, episode, t) or None per step], mask)."""
    paths = [path for path, _ in tree.flatten_with_path(manager.stored_spec)]
    obs_at = paths.index(("step", "observation"))
    mask_at = paths.index(("mask",))
    items = []
    for data in all_items(manager.py_client, manager.table_name, expected).values():
        mask = [bool(m) for m in data[mask_at]]
        steps = [
            tuple(int(v) for v in obs[:3]) if real else None
            for obs, real in zip(data[obs_at], mask, strict=True)
        ]
        for obs, real in zip(data[obs_at], mask, strict=True):
            if not real:
                assert not obs.any(), "padding must be zeros"
        items.append((steps, mask))
    return items


def expected_items(lengths: dict[tuple[int, int], int], length: int, stride: int) -> list[Any]:
    items = []
    for (env_id, episode_id), n in lengths.items():
        for window in reference_windows(n, length, stride, pad=True):
            steps = [None if t is None else (env_id, episode_id, t) for t in window]
            items.append((steps, [t is not None for t in window]))
    return items


def canonical(items: list[Any]) -> list[Any]:
    return sorted(items, key=repr)


@pytest.mark.parametrize(("length", "stride"), [(4, 2), (4, 4), (3, 1), (2, 5)])
def test_observer_pads_each_episode_end_and_never_crosses_episodes(
    make_manager, data_spec, length, stride
):
    manager = make_manager(
        sequence_length=length, stride_length=stride, pad_end_of_episode=True, capacity=500
    )
    _, observer = manager.create_replay_buffer()
    lengths = {(0, e): n for e, n in enumerate([1, 3, 5, 8, 2, 11])}
    for (_, episode_id), n in lengths.items():
        for step in episode(data_spec, episode_id, n):
            observer(step)
    observer.flush()
    expected = expected_items(lengths, length, stride)
    assert manager.num_frames() == len(expected)
    assert canonical(stored_items(manager, len(expected))) == canonical(expected)


def test_whole_episodes_are_one_item_each(make_manager, data_spec):
    manager = make_manager(
        sequence_length=12, stride_length=12, pad_end_of_episode=True, capacity=100
    )
    _, observer = manager.create_replay_buffer()
    lengths = [3, 12, 7]
    for episode_id, n in enumerate(lengths):
        for step in episode(data_spec, episode_id, n):
            observer(step)
    observer.flush()
    items = stored_items(manager, len(lengths))
    assert sorted(sum(mask) for _, mask in items) == sorted(lengths)
    for steps, mask in items:
        real = [s for s in steps if s is not None]
        assert len({s[1] for s in real}) == 1  # one episode per item
        assert mask == sorted(mask, reverse=True)  # padding only at the end


def test_vector_env_episodes_stay_separate_and_are_padded(make_manager, data_spec):
    length, stride = 3, 2
    manager = make_manager(
        sequence_length=length, stride_length=stride, pad_end_of_episode=True, capacity=500
    )
    manager.create_replay_buffer()
    writer = manager.transition_writer()
    # Env 0 ends an episode every 2 transitions, env 1 every 5: episodes interleave.
    ends = {0: 2, 1: 5}
    t = {0: 0, 1: 0}
    episode_of = {0: 0, 1: 0}
    lengths: dict[tuple[int, int], int] = {}
    for _ in range(13):
        states, next_states, dones, finals = [], [], [], []
        for env_id in (0, 1):
            states.append([env_id, episode_of[env_id], t[env_id], 0])
            done = t[env_id] + 1 == ends[env_id]
            following = [env_id, episode_of[env_id], t[env_id] + 1, 0]
            finals.append(following)
            if done:
                lengths[(env_id, episode_of[env_id])] = ends[env_id] + 1  # + boundary step
                episode_of[env_id] += 1
                t[env_id] = 0
                following = [env_id, episode_of[env_id], 0, 0]
            else:
                t[env_id] += 1
            next_states.append(following)
            dones.append(done)
        writer.add_multi(
            np.array(states, np.float32),
            np.zeros(2, np.int64),
            np.zeros(2, np.float32),
            np.array(next_states, np.float32),
            np.array(dones),
            np.zeros(2, bool),
            final_states=np.array(finals, np.float32),
        )
    writer.flush()
    expected = expected_items(lengths, length, stride)
    # Open episodes are not finished yet: only their full windows so far are written.
    for env_id in (0, 1):
        n = t[env_id]
        for window in reference_windows(n, length, stride, pad=False):
            expected.append(([(env_id, episode_of[env_id], s) for s in window], [True] * length))
    assert canonical(stored_items(manager, len(expected))) == canonical(expected)


@pytest.mark.heavy
def test_padded_batches_carry_the_mask_in_tf_and_torch(make_manager, data_spec):
    manager = make_manager(
        sequence_length=4, stride_length=4, pad_end_of_episode=True, capacity=100
    )
    _, observer = manager.create_replay_buffer()
    for step in episode(data_spec, 0, 6):
        observer(step)
    observer.flush()
    batch, _ = next(iter(manager.get_dataset(8)))
    assert isinstance(batch, Masked)
    assert batch.mask.dtype.name == "bool" and batch.mask.shape == (8, 4)
    assert batch.step.observation.shape == (8, 4, 4)
    masks = {tuple(m) for m in batch.mask.numpy().tolist()}
    assert masks <= {(True, True, True, True), (True, True, False, False)}

    torch_batch = next(iter(manager.torch_batches(8)))
    assert isinstance(torch_batch, Masked)
    assert str(torch_batch.mask.dtype) == "torch.bool"
    assert tuple(torch_batch.step.observation.shape) == (8, 4, 4)
    with pytest.raises(ConfigError, match="padded Masked"):
        manager.torch_batches(8, transitions=True)


def test_padding_is_checked_on_load(make_manager, data_spec, tmp_path):
    manager = make_manager(sequence_length=3, pad_end_of_episode=True)
    _, observer = manager.create_replay_buffer()
    for step in episode(data_spec, 0, 5):
        observer(step)
    manager.checkpoint()
    manager.close()
    with pytest.raises(SpecMismatchError, match="pad_end_of_episode: requested False, stored True"):
        make_manager(sequence_length=3).load_replay_buffer()
    restored = make_manager(sequence_length=3, pad_end_of_episode=True)
    restored.load_replay_buffer()
    assert restored.num_frames() == 3


def test_padded_buffer_exports_and_imports_exactly(make_manager, data_spec, tmp_path):
    manager = make_manager(
        sequence_length=4,
        stride_length=2,
        pad_end_of_episode=True,
        checkpoint_dir=str(tmp_path / "a"),
    )
    _, observer = manager.create_replay_buffer()
    lengths = {(0, e): n for e, n in enumerate([2, 7])}
    for (_, episode_id), n in lengths.items():
        for step in episode(data_spec, episode_id, n):
            observer(step)
    observer.flush()
    manager.export(str(tmp_path / "export"))

    copy = make_manager(
        sequence_length=4,
        stride_length=2,
        pad_end_of_episode=True,
        checkpoint_dir=str(tmp_path / "b"),
    )
    copy.import_buffer(str(tmp_path / "export"))
    expected = expected_items(lengths, 4, 2)
    assert canonical(stored_items(copy, len(expected))) == canonical(expected)
    unpadded = make_manager(sequence_length=4, checkpoint_dir=str(tmp_path / "c"))
    with pytest.raises(SpecMismatchError, match="mask"):
        unpadded.import_buffer(str(tmp_path / "export"))


def test_a_toml_table_can_be_padded(tmp_path):
    from replay_service.backends.reverb.tables import make_table
    from replay_service.config.files import load_config

    path = tmp_path / "padded.toml"
    path.write_text(
        "[table]\nsequence_length = 5\npad_end_of_episode = true\n"
        '[data_spec]\nenv = "CartPole-v0"\n'
    )
    config = load_config(path)
    assert config.table.pad_end_of_episode
    table = make_table(config.table, config.data_spec.build(load_env))
    assert table.info.signature.mask.shape == (5,)
    path.write_text("[table]\npad_end_of_episode = 1\n")
    with pytest.raises(ConfigError, match="pad_end_of_episode must be True or False, got 1"):
        load_config(path)


def test_padded_extra_tables_share_padding_and_length(make_manager, data_spec):
    from replay_service import TableConfig

    with pytest.raises(ConfigError, match="must all be padded or none"):
        make_manager(sequence_length=3, pad_end_of_episode=True, extra_tables=[TableConfig("b")])
    with pytest.raises(ConfigError, match="must share one sequence length"):
        make_manager(
            sequence_length=3,
            pad_end_of_episode=True,
            extra_tables=[TableConfig("b", sequence_length=4, pad_end_of_episode=True)],
        )
    extra = TableConfig("b", capacity=500, sequence_length=3, pad_end_of_episode=True)
    manager = make_manager(
        sequence_length=3, stride_length=2, pad_end_of_episode=True, extra_tables=[extra]
    )
    _, observer = manager.create_replay_buffer()
    lengths = {(0, e): n for e, n in enumerate([2, 6])}
    for (_, episode_id), n in lengths.items():
        for step in episode(data_spec, episode_id, n):
            observer(step)
    observer.flush()
    expected = expected_items(lengths, 3, 2)
    assert manager.num_frames(table="b") == len(expected) == manager.num_frames()
    assert canonical(stored_items(manager, len(expected))) == canonical(expected)


@pytest.mark.heavy
def test_the_sequences_config_serves_a_padded_table(make_manager, data_spec, start_server):
    _, address = start_server("--checkpoint_interval_s=0", config=SEQUENCES_CONFIG)
    kwargs = {"server_address": address, "sequence_length": 40, "capacity": 20000}
    with pytest.raises(SpecMismatchError, match="mask"):
        make_manager(table_name="sequence_table", **kwargs).create_replay_buffer()
    manager = make_manager(
        table_name="sequence_table", stride_length=20, pad_end_of_episode=True, **kwargs
    )
    _, observer = manager.create_replay_buffer()
    lengths = {(0, 0): 6, (0, 1): 45}
    for (_, episode_id), n in lengths.items():
        for step in episode(data_spec, episode_id, n):
            observer(step)
    observer.flush()
    expected = expected_items(lengths, 40, 20)
    assert canonical(stored_items(manager, len(expected))) == canonical(expected)
