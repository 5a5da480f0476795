"""PyTorch sampling from a real Reverb server filled by real TF-Agents collection."""

from __future__ import annotations

import itertools
import threading
import time

import numpy as np
import pytest
import tensorflow as tf
import torch
import tree
from tf_agents.trajectories import policy_step
from tf_agents.trajectories import time_step as ts
from tf_agents.trajectories import trajectory as trajectory_lib
from torch.utils.data import DataLoader, get_worker_info

from conftest import FAST_TIMEOUTS, collect
from replay_service import (
    BufferStateError,
    ConfigError,
    ManagerClosedError,
    SamplingConfig,
    Timeouts,
)
from replay_service.backends.reverb.torch_source import SampleSource
from replay_service.sample.batches import (
    TorchSampleInfo,
    TransitionBatch,
    draws_per_call,
    nest_packer,
    step_of,
    to_transitions,
    transition_packer,
)
from replay_service.sample.torch_dataset import TorchReplayDataset
from replay_service.specs import packed
from replay_service.specs.arrays import ArraySpec
from replay_service.specs.nests import normalize_spec
from replay_service.specs.windows import Masked

TERMINATED_EPISODE = 1.0
TRUNCATED_EPISODE = 2.0
EPISODE_TRANSITIONS = 3


def _torch_dtype(spec):
    return torch.from_numpy(np.zeros([], spec.dtype.as_numpy_dtype)).dtype


@pytest.mark.heavy
def test_nested_batches_have_the_spec_shapes_dtypes_and_device(make_manager, env, policy):
    manager = make_manager()
    _, observer = manager.create_replay_buffer()
    collect(env, policy, observer, 60)
    spec = normalize_spec(manager.data_spec)
    with manager.torch_batches(16, with_info=True) as stream:
        batch, info = next(stream)
    assert isinstance(batch, trajectory_lib.Trajectory)
    assert batch.policy_info == ()
    for field, leaf_spec in zip(tf.nest.flatten(batch), tf.nest.flatten(spec), strict=True):
        assert isinstance(field, torch.Tensor)
        assert tuple(field.shape) == (16, 2, *leaf_spec.shape)
        assert field.dtype == _torch_dtype(leaf_spec)
        assert field.device == torch.device("cpu")
    assert isinstance(info, TorchSampleInfo)
    assert info.key.dtype == torch.uint64 and info.key.shape == (16,)
    assert info.priority.dtype == torch.float64
    assert torch.all(info.table_size == manager.num_frames())


@pytest.mark.heavy
def test_transition_batches(make_manager, env, policy):
    manager = make_manager()
    _, observer = manager.create_replay_buffer()
    collect(env, policy, observer, 60)
    with manager.torch_batches(32, transitions=True, prefetch=0) as stream:
        batch = next(stream)
    assert isinstance(batch, TransitionBatch)
    assert batch.states.shape == batch.next_states.shape == (32, 4)
    assert batch.states.dtype == torch.float32
    assert batch.actions.shape == (32,) and batch.actions.dtype == torch.int64
    assert batch.rewards.shape == (32,) and batch.rewards.dtype == torch.float32
    assert batch.dones.dtype == batch.truncated.dtype == torch.bool
    assert not torch.any(batch.dones & batch.truncated)
    assert batch.hiddens is None
    # CartPole's random episodes end by termination well before the 200-step limit.
    with manager.torch_batches(256, transitions=True) as stream:
        many = next(stream)
    assert torch.any(many.dones) and not torch.any(many.truncated)


def _hand_made_episode(kind: float):
    """Trajectories of one episode whose observations are [kind, t, 0, 0]."""

    def obs(t):
        return np.array([kind, t, 0, 0], np.float32)

    action = np.int64(1)
    last = ts.termination if kind == TERMINATED_EPISODE else ts.truncation
    steps = [ts.restart(obs(0))]
    steps += [ts.transition(obs(t), np.float32(t)) for t in range(1, EPISODE_TRANSITIONS)]
    steps += [last(obs(EPISODE_TRANSITIONS), np.float32(EPISODE_TRANSITIONS))]
    steps += [ts.restart(obs(0))]
    return [
        trajectory_lib.from_transition(current, policy_step.PolicyStep(action, (), ()), following)
        for current, following in itertools.pairwise(steps)
    ]


def _as_numpy(trajectory):
    return tf.nest.map_structure(np.asarray, trajectory)


def test_dones_and_truncated_on_hand_made_episodes(make_manager):
    manager = make_manager()
    _, observer = manager.create_replay_buffer()
    for kind in (TERMINATED_EPISODE, TRUNCATED_EPISODE):
        for step in _hand_made_episode(kind):
            observer(_as_numpy(step))
    observer.flush()
    assert manager.num_frames() == 2 * EPISODE_TRANSITIONS
    with manager.torch_batches(256, transitions=True) as stream:
        batch = next(stream)
    kind, t = batch.states[:, 0], batch.states[:, 1]
    ends = t == EPISODE_TRANSITIONS - 1
    assert torch.equal(batch.dones, ends & (kind == TERMINATED_EPISODE))
    assert torch.equal(batch.truncated, ends & (kind == TRUNCATED_EPISODE))
    assert torch.equal(batch.next_states[:, 1], t + 1)
    assert torch.equal(batch.next_states[:, 0], kind)
    assert torch.equal(batch.rewards, t + 1)
    assert set(kind.tolist()) == {TERMINATED_EPISODE, TRUNCATED_EPISODE}


def test_to_transitions_refuses_longer_windows():
    step = torch.zeros([2, 3], dtype=torch.int32)
    trajectory = trajectory_lib.Trajectory(step, step, step, (), step, step, step)
    with pytest.raises(ConfigError, match="windows of 2 steps, got 3"):
        to_transitions(trajectory)


class TaggedDataset(TorchReplayDataset):
    """Yields `(worker id, batch)` so the test can see which worker produced each batch."""

    def __iter__(self):
        worker = get_worker_info()
        for batch in super().__iter__():
            yield worker.id, batch


@pytest.mark.heavy
def test_dataloader_workers_each_sample_on_their_own_connection(make_manager, env, policy):
    manager = make_manager()
    _, observer = manager.create_replay_buffer()
    collect(env, policy, observer, 60)
    source = manager.torch_dataset(8, transitions=True).source
    loader = TaggedDataset(source, 8, transitions=True).data_loader(num_workers=2)
    workers = set()
    for index, (worker, batch) in enumerate(loader):
        workers.add(int(worker))
        assert batch.states.shape == (8, 4) and batch.dones.shape == (8,)
        if index == 5:
            break
    assert workers == {0, 1}


def test_forked_dataloader_workers_fail_instead_of_hanging(make_manager, env, policy):
    manager = make_manager()
    _, observer = manager.create_replay_buffer()
    collect(env, policy, observer, 20)
    dataset = manager.torch_dataset(4)
    loader = DataLoader(dataset, batch_size=None, num_workers=1, multiprocessing_context="fork")
    with pytest.raises(BufferStateError, match="forkserver"):
        next(iter(loader))
    with pytest.raises(ConfigError, match="fork"):
        dataset.data_loader(num_workers=1, multiprocessing_context="fork")


@pytest.mark.heavy
def test_a_short_pytorch_training_loop_learns(make_manager, env, policy):
    torch.manual_seed(0)
    manager = make_manager()
    _, observer = manager.create_replay_buffer()
    collect(env, policy, observer, 300)
    q_net = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    target_net = torch.nn.Sequential(
        torch.nn.Linear(4, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2)
    )
    target_net.load_state_dict(q_net.state_dict())
    optimizer = torch.optim.Adam(q_net.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in q_net.parameters()]

    def loss_of(batch):
        q = q_net(batch.states).gather(1, batch.actions[:, None]).squeeze(1)
        with torch.no_grad():
            best_next = target_net(batch.next_states).max(dim=1).values
        target = batch.rewards + 0.9 * (~batch.dones).float() * best_next
        return torch.nn.functional.mse_loss(q, target)

    with manager.torch_batches(64, transitions=True) as stream:
        probe = next(stream)
        initial = loss_of(probe).item()
        for _, batch in zip(range(40), stream, strict=False):
            loss = loss_of(batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            assert torch.isfinite(loss)
    assert loss_of(probe).item() < initial
    assert any(not torch.equal(a, b) for a, b in zip(before, q_net.parameters(), strict=True))


@pytest.mark.heavy
def test_sampling_an_empty_buffer_fails_within_the_timeout(make_manager):
    manager = make_manager(timeouts=Timeouts(sample=0.5))
    manager.create_replay_buffer()
    for prefetch in (0, 2):
        start = time.monotonic()
        with manager.torch_batches(4, prefetch=prefetch) as stream:
            with pytest.raises(BufferStateError, match="no item could be sampled from table"):
                next(stream)
        assert time.monotonic() - start < 30
    with pytest.raises(BufferStateError, match="the buffer is empty"):
        next(iter(manager.torch_dataset(4)))


@pytest.mark.heavy
def test_close_stops_the_prefetch_thread(make_manager, env, policy):
    manager = make_manager()
    _, observer = manager.create_replay_buffer()
    collect(env, policy, observer, 20)
    stream = manager.torch_batches(4, prefetch=3)
    next(stream)

    def prefetchers():
        return [t for t in threading.enumerate() if t.name.startswith("replay_service:torch")]

    assert prefetchers()
    stream.close()
    assert not prefetchers()
    with pytest.raises(ManagerClosedError, match="closed"):
        next(stream)


@pytest.mark.parametrize(
    ("sampling", "together"),
    [
        (SamplingConfig(), True),
        (SamplingConfig(sampler="prioritized"), False),
        (SamplingConfig(max_times_sampled=1000), False),
        (SamplingConfig(samples_per_insert=1.0, error_buffer=500.0), False),
    ],
    ids=["uniform", "prioritized", "max_times_sampled", "samples_per_insert"],
)
@pytest.mark.heavy
def test_small_batches_are_fetched_together_only_from_independent_draws(
    make_manager, env, policy, sampling, together
):
    """A Reverb torch stream fetches `draws_per_call` small batches at once (each then a slice
    of the fetched block) only where no sample changes or holds back the next."""
    manager = make_manager(sampling=sampling)
    _, observer = manager.create_replay_buffer()
    collect(env, policy, observer, 40)
    handle = manager.table_handle()
    assert handle.table.sampling.independent_draws == together
    item_bytes = packed.step_layout(handle.signature).step_bytes * handle.sequence_length
    draws = draws_per_call(4, item_bytes) if together else 1
    assert draws > 1 or not together
    with manager.torch_batches(4, prefetch=0) as stream:
        for _ in range(3):
            batch = next(stream)
            for leaf in tree.flatten(batch):
                assert leaf.shape[0] == 4
                assert leaf.untyped_storage().nbytes() == leaf.nbytes * draws


@pytest.mark.heavy
@pytest.mark.parametrize("prefetch", [0, 3])
def test_closing_the_manager_fails_streams_before_batches_sampled_ahead(
    make_manager, env, policy, prefetch
):
    manager = make_manager()
    _, observer = manager.create_replay_buffer()
    collect(env, policy, observer, 40)
    stream = manager.torch_batches(4, prefetch=prefetch)
    for _ in range(3):
        next(stream)  # the pipeline (and the thread, if any) now holds batches sampled ahead
    manager.close()
    with pytest.raises(ManagerClosedError, match="manager of this dataset was closed"):
        next(stream)
    with pytest.raises(ManagerClosedError):
        next(stream)
    stream.close()


@pytest.mark.parametrize(
    "structure",
    [
        trajectory_lib.Trajectory(1, {"b": 2, "a": (3, [4, 5])}, 6, (), 7, 8, 9),
        Masked(trajectory_lib.Trajectory(1, 2, 3, (), 5, 6, 7), 8),
        {"x": 1, "a": [2, {"z": 3, "c": 4}]},
        (1,),
        [],
        1,
    ],
    ids=["trajectory", "masked", "dict", "tuple", "empty", "leaf"],
)
def test_nest_packer_rebuilds_what_tree_does(structure):
    flat = [torch.tensor(i) for i in range(len(tree.flatten(structure)))]
    packed = nest_packer(structure)(flat)
    expected = tree.unflatten_as(structure, flat)
    assert type(packed) is type(expected)
    tree.assert_same_structure(packed, expected)
    assert all(a is b for a, b in zip(tree.flatten(packed), tree.flatten(expected), strict=True))


def test_remote_manager_samples_into_torch(make_manager, env, policy):
    owner = make_manager()
    _, observer = owner.create_replay_buffer()
    collect(env, policy, observer, 30)
    remote = make_manager(server_address=owner.server_address, checkpoint_dir=None)
    remote.load_replay_buffer()
    assert SampleSource.from_handle(remote.table_handle()).independent  # a uniform server
    with remote.torch_batches(4) as stream:
        assert next(stream).observation.shape == (4, 2, 4)


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(sampler="prioritized"),
        SamplingConfig(samples_per_insert=1.0, min_size_to_sample=2, error_buffer=100.0),
        SamplingConfig(max_times_sampled=5),
    ],
    ids=["prioritized", "samples_per_insert", "max_times_sampled"],
)
def test_a_remote_client_fetches_as_the_servers_table_samples_not_its_own_config(
    make_manager, env, policy, sampling
):
    """The documented remote client passes no `sampling=`: its default config says independent
    draws, but the server's table decides; fetching 64 batches of 4 at once would hold back
    priority updates and ask a rate-limited table for 256 samples before the first batch."""
    owner = make_manager(sampling=sampling)
    _, observer = owner.create_replay_buffer()
    collect(env, policy, observer, 40)
    remote = make_manager(server_address=owner.server_address, checkpoint_dir=None)
    remote.load_replay_buffer()
    assert remote.table_handle().table.sampling.independent_draws  # the client's own default
    assert not SampleSource.from_handle(remote.table_handle()).independent
    assert not SampleSource.from_handle(owner.table_handle()).independent
    with remote.torch_batches(4, prefetch=0) as stream:
        batch = next(stream)
        for leaf in tree.flatten(batch):
            assert leaf.shape[0] == 4
            assert leaf.untyped_storage().nbytes() == leaf.nbytes  # one batch per call


def test_bad_options_are_refused(make_manager):
    manager = make_manager()
    with pytest.raises(BufferStateError, match="create_replay_buffer"):
        manager.torch_batches(4)
    manager.create_replay_buffer()
    with pytest.raises(ConfigError, match="batch_size must be a positive integer, got 0"):
        manager.torch_batches(0)
    with pytest.raises(ConfigError, match="prefetch must be an integer >= 0, got -1"):
        manager.torch_batches(4, prefetch=-1)
    with pytest.raises(ConfigError, match="'nonsense'"):
        manager.torch_batches(4, device="nonsense")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            manager.torch_batches(4, device="cuda")
        with pytest.warns(UserWarning, match="not pinned"):
            manager.torch_batches(4, pin_memory=True).close()
    three = make_manager(sequence_length=3, checkpoint_dir=str(manager.checkpoint_dir) + "3")
    three.create_replay_buffer()
    with pytest.raises(ConfigError, match="sequence_length=3"):
        three.torch_dataset(4, transitions=True)


def test_timeouts_are_those_of_the_manager(make_manager):
    manager = make_manager()
    manager.create_replay_buffer()
    assert manager.timeouts == FAST_TIMEOUTS
    assert manager.torch_dataset(4).source.sample_timeout == FAST_TIMEOUTS.sample


def _random_batch(structure, steps=2, batch=64, seed=0):
    """Flat random tensors `[batch, steps, 3]` for every leaf of `structure`; step types LAST
    and discounts 0 in about a third of the items each."""
    rng = np.random.default_rng(seed)
    flat = []
    for _ in tree.flatten(structure):
        flat.append(torch.from_numpy(rng.integers(0, 3, (batch, steps, 3)).astype(np.float32)))
    fields = tree.unflatten_as(structure, list(range(len(flat))))
    if isinstance(structure, trajectory_lib.Trajectory):
        for name in ("step_type", "next_step_type", "discount", "reward"):
            index = getattr(fields, name)
            if isinstance(index, int):
                values = rng.integers(0, 3, (batch, steps))
                flat[index] = torch.from_numpy(
                    values.astype(np.int32 if "step" in name else np.float32)
                )
    return flat


@pytest.mark.parametrize(
    "structure",
    [
        trajectory_lib.Trajectory(1, 2, 3, (), 5, 6, 7),
        trajectory_lib.Trajectory(1, {"b": 2, "a": (3, [4])}, {"x": 5}, (8, {"h": 9}), 10, 11, 12),
        trajectory_lib.Trajectory(1, 2, 3, (), 5, (6, 7), 8),
        Masked(trajectory_lib.Trajectory(1, 2, 3, (), 5, 6, 7), 8),
    ],
    ids=["flat", "nests and hidden state", "nested reward", "masked"],
)
def test_transition_packer_equals_to_transitions_of_the_nest(structure):
    flat = _random_batch(structure)
    pack = transition_packer(structure)
    try:
        expected = to_transitions(nest_packer(structure)(flat))
    except (AttributeError, TypeError) as e:  # nests to_transitions cannot read
        with pytest.raises(type(e)):
            pack(flat)
        return
    got = pack(flat)
    assert got.dones.any() and got.truncated.any()  # the batch exercises both flags
    _assert_same_transitions(got, expected)
    # The same batch as packed rows: `prepare_rows` reads the same transitions from them, every
    # tensor a contiguous copy of its own (trajectories of plain scalar fields; other nests
    # are unpacked first).
    scalars = isinstance(structure, trajectory_lib.Trajectory) and not tree.is_nested(
        structure.reward
    )
    assert (pack.prepare_rows is not None) == scalars
    if pack.prepare_rows is None:
        return
    arrays = [t.numpy() for t in flat]
    layout = packed.layout_of(
        tree.unflatten_as(structure, [ArraySpec(a.shape[2:], a.dtype, "x") for a in arrays])
    )
    rows = layout.pack_items(arrays)
    prepared = pack.prepare_rows(layout, rows)
    for t in prepared:
        assert t.is_contiguous() and not np.shares_memory(t.numpy(), rows)
    _assert_same_transitions(pack.build(prepared), expected)
    with pytest.raises(ConfigError, match="windows of 2 steps, got 3"):
        pack.prepare_rows(layout, np.concatenate([rows, rows[:, :1]], axis=1))


def _assert_same_transitions(got, expected):
    for field in ("states", "actions", "rewards", "next_states", "dones", "truncated", "hiddens"):
        a, b = getattr(got, field), getattr(expected, field)
        if b is None:
            assert a is None, field
            continue
        tree.assert_same_structure(a, b)
        for x, y in zip(tree.flatten(a), tree.flatten(b), strict=True):
            assert x.dtype == y.dtype and torch.equal(x, y), field


def test_transition_packer_refuses_longer_windows():
    structure = trajectory_lib.Trajectory(1, 2, 3, (), 5, 6, 7)
    with pytest.raises(ConfigError, match="windows of 2 steps, got 3"):
        transition_packer(structure)(_random_batch(structure, steps=3))


def test_small_steps_are_contiguous_copies_and_large_steps_views():
    small = torch.arange(64 * 2 * 4, dtype=torch.float32).reshape(64, 2, 4)
    large = torch.zeros([3, 2, 84, 84, 4], dtype=torch.uint8)
    for index in (0, 1):
        step = step_of(small, index)
        assert step.is_contiguous() and torch.equal(step, small[:, index])
        assert step.data_ptr() != small[:, index].data_ptr()  # a copy
        assert step_of(large, index).data_ptr() == large[:, index].data_ptr()  # a view


@pytest.mark.parametrize(
    "tensor",
    [
        torch.ones([5, 2, 3], requires_grad=True),
        torch.ones([5, 2, 3], dtype=torch.bfloat16),
        torch.ones([5, 2, 3], dtype=torch.complex64).conj(),
        torch.arange(30, dtype=torch.float32).reshape(2, 5, 3).permute(1, 0, 2),
    ],
    ids=["autograd", "bfloat16", "conjugate", "time-major"],
)
def test_step_of_tensors_without_a_numpy_view(tensor):
    step = step_of(tensor, 1)
    assert step.is_contiguous() and step.dtype == tensor.dtype
    assert torch.equal(step.detach().resolve_conj(), tensor[:, 1].detach().resolve_conj())
