"""ReverbReplayBuffer as Stable-Baselines3's replay_buffer_class."""

from __future__ import annotations

import pickle
import re
import tempfile
from collections.abc import Callable
from typing import Any

import gymnasium
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from stable_baselines3 import DQN, SAC, TD3
from stable_baselines3.common.buffers import ReplayBuffer
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.evaluation import evaluate_policy
from stable_baselines3.common.noise import NormalActionNoise
from stable_baselines3.common.off_policy_algorithm import OffPolicyAlgorithm

from conftest import FAST_TIMEOUTS, all_items
from replay_service.errors import ReplayServiceError
from replay_service.integrations.sb3 import ReverbReplayBuffer

N_ENVS = 2
STEPS = 80


def _discrete_actions(rng: np.random.Generator) -> np.ndarray:
    """Random CartPole actions: int `[n_envs]`, as SB3's DQN steps the env with."""
    return rng.integers(0, 2, size=N_ENVS)


def _box_actions(rng: np.random.Generator) -> np.ndarray:
    """Random Pendulum actions as float64 `[n_envs, 1]` (TD3's noisy actions are float64)."""
    return rng.uniform(-2.0, 2.0, size=(N_ENVS, 1))


def _collect(
    buffers: list[Any],
    seed: int = 0,
    env_id: str = "CartPole-v1",
    sample_actions: Callable[[np.random.Generator], np.ndarray] = _discrete_actions,
    max_episode_steps: int = 15,
) -> None:
    """Feeds the same VecEnv transitions to every buffer, as SB3's algorithms do."""
    env = make_vec_env(
        env_id, n_envs=N_ENVS, seed=seed, env_kwargs={"max_episode_steps": max_episode_steps}
    )
    rng = np.random.default_rng(seed)
    obs = env.reset()
    for _ in range(STEPS):
        actions = sample_actions(rng)
        new_obs, rewards, dones, infos = env.step(actions)
        next_obs = new_obs.copy()
        for i, done in enumerate(dones):
            if done and infos[i].get("terminal_observation") is not None:
                next_obs[i] = infos[i]["terminal_observation"]
        for buffer in buffers:
            buffer.add(obs, next_obs, actions.reshape(N_ENVS, -1), rewards, dones, infos)
        obs = new_obs
    env.close()


def _rows(obs, actions, rewards, next_obs, dones, timeouts) -> list[tuple[Any, ...]]:
    return sorted(
        (o.tobytes(), a.tobytes(), float(r), n.tobytes(), float(d), float(t))
        for o, a, r, n, d, t in zip(obs, actions, rewards, next_obs, dones, timeouts, strict=True)
    )


def _stored_rows(buffer: ReverbReplayBuffer) -> list[tuple[Any, ...]]:
    """Every transition of `buffer`'s table as a `_rows` row (`dones`: terminated or truncated)."""
    size = buffer.size()
    if buffer.manager.backend == "local":  # read back through the export
        with tempfile.TemporaryDirectory() as tmp:
            tensors = load_file(buffer.manager.export(tmp)[0])
        names = ("step_type", "observation", "action", "next_step_type", "reward", "discount")
        flat_items = list(zip(*(tensors[f"data/{name}"] for name in names), strict=True))
    else:
        items = all_items(buffer.manager.py_client, buffer.manager.table_name, size)
        flat_items = list(items.values())
    assert len(flat_items) == size
    stored = []
    for flat_item in flat_items:
        _, obs, action, next_step_type, reward, discount = flat_item
        ended = next_step_type[0] == 2
        terminated = float(ended and discount[0] == 0)
        timeout = float(ended and discount[0] != 0)
        stored.append(
            (
                obs[0].tobytes(),
                action[0].tobytes(),
                float(reward[0]),
                obs[1].tobytes(),
                max(terminated, timeout),
                timeout,
            )
        )
    return stored


def _assert_same_transitions(
    theirs: ReplayBuffer,
    ours: ReverbReplayBuffer,
    obs_dtype: type,
    action_dtype: type,
    expect_terminations: bool = True,
) -> None:
    """`ours` holds exactly SB3's transitions, less each env's newest one if it did not end."""
    n = theirs.pos
    flat = {
        name: getattr(theirs, name)[:n].swapaxes(0, 1).reshape(N_ENVS * n, -1)
        for name in ("observations", "actions", "next_observations")
    }
    scalars = {
        name: getattr(theirs, name)[:n].swapaxes(0, 1).reshape(-1)
        for name in ("rewards", "dones", "timeouts")
    }
    per_env_last_done = theirs.dones[n - 1]
    assert scalars["timeouts"].sum() > 0
    if expect_terminations:
        assert (scalars["dones"] > scalars["timeouts"]).any()
    expected = _rows(
        flat["observations"].astype(obs_dtype),
        flat["actions"].astype(action_dtype),
        scalars["rewards"],
        flat["next_observations"].astype(obs_dtype),
        scalars["dones"],
        scalars["timeouts"],
    )
    # Each env's newest transition waits for the next step unless it ended its episode.
    assert ours.size() == N_ENVS * n - int((per_env_last_done == 0).sum())
    stored = _stored_rows(ours)
    assert set(stored) <= set(expected)
    assert len(stored) == len(set(stored)) == ours.size()
    missing = set(expected) - set(stored)
    assert len(missing) == int((per_env_last_done == 0).sum())


@pytest.mark.heavy
@pytest.mark.parametrize("backend", ["auto", "local"])
def test_same_transitions_as_sb3s_own_replay_buffer(tmp_path: Any, backend: str) -> None:
    env = gymnasium.make("CartPole-v1")
    kwargs = dict(n_envs=N_ENVS, handle_timeout_termination=True)
    theirs = ReplayBuffer(1000, env.observation_space, env.action_space, "cpu", **kwargs)
    ours = ReverbReplayBuffer(
        1000, env.observation_space, env.action_space, "cpu", **kwargs,
        checkpoint_dir=tmp_path / "ckpt", timeouts=FAST_TIMEOUTS, backend=backend,
    )  # fmt: skip
    try:
        assert ours.manager.backend == ("local" if backend == "local" else "reverb")
        _collect([theirs, ours])
        _assert_same_transitions(theirs, ours, np.float32, np.int64)
        batch = ours.sample(64)
        assert batch.observations.shape == (64, 4) and batch.actions.shape == (64, 1)
        assert batch.dones.shape == batch.rewards.shape == (64, 1)
        assert batch.actions.dtype == torch.int64
    finally:
        ours.close()


@pytest.mark.heavy
def test_same_box_action_transitions_as_sb3s_own_replay_buffer(tmp_path: Any) -> None:
    env = gymnasium.make("Pendulum-v1")
    kwargs = dict(n_envs=N_ENVS, handle_timeout_termination=True)
    theirs = ReplayBuffer(1000, env.observation_space, env.action_space, "cpu", **kwargs)
    ours = ReverbReplayBuffer(
        1000, env.observation_space, env.action_space, "cpu", **kwargs,
        checkpoint_dir=tmp_path / "ckpt", timeouts=FAST_TIMEOUTS,
    )  # fmt: skip
    try:
        # Pendulum never terminates: every episode ends by its time limit.
        _collect(
            [theirs, ours], env_id="Pendulum-v1", sample_actions=_box_actions, max_episode_steps=25
        )
        assert theirs.actions.dtype == np.float32
        _assert_same_transitions(theirs, ours, np.float32, np.float32, expect_terminations=False)
        batch = ours.sample(64)
        assert batch.observations.shape == (64, 3) and batch.actions.shape == (64, 1)
        assert batch.observations.dtype == batch.actions.dtype == torch.float32
        assert batch.dones.shape == batch.rewards.shape == (64, 1)
        assert float(batch.dones.sum()) == 0.0  # time-limit ends are not terminations
        assert float(batch.actions.abs().max()) <= 2.0
    finally:
        ours.close()


@pytest.mark.heavy
def test_save_and_load_replay_buffer_go_through_the_export(tmp_path: Any) -> None:
    env = gymnasium.make("CartPole-v1")
    ours = ReverbReplayBuffer(
        1000, env.observation_space, env.action_space, "cpu", n_envs=N_ENVS,
        checkpoint_dir=tmp_path / "ckpt", timeouts=FAST_TIMEOUTS,
    )  # fmt: skip
    try:
        _collect([ours])
        size = ours.size()
        data = pickle.dumps(ours)
    finally:
        ours.close()
    assert b"sha256" in data and b"replay_service.checkpoint" not in data  # export bytes
    loaded = pickle.loads(data)
    try:
        assert loaded.size() == size
        assert loaded.sample(8).observations.shape == (8, 4)
    finally:
        loaded.close()


LEARN_STEPS = 240  # 120 steps per env, episodes of 50: two time-limit ends, one episode open


def _pendulum_model(algo: type[OffPolicyAlgorithm], checkpoint_dir: Any) -> OffPolicyAlgorithm:
    """A small SAC or TD3 on 2 Pendulum envs with 50-step episodes, over a ReverbReplayBuffer."""
    extra: dict[str, Any] = {}
    if algo is TD3:  # float64 noisy actions reach the buffer
        extra["action_noise"] = NormalActionNoise(np.zeros(1), 0.1 * np.ones(1))
    env = make_vec_env("Pendulum-v1", n_envs=N_ENVS, seed=0, env_kwargs={"max_episode_steps": 50})
    return algo(
        "MlpPolicy", env, buffer_size=1000, learning_starts=100, batch_size=32,
        train_freq=1, gradient_steps=1, policy_kwargs={"net_arch": [16, 16]}, seed=0,
        replay_buffer_class=ReverbReplayBuffer,
        replay_buffer_kwargs={"checkpoint_dir": str(checkpoint_dir), "timeouts": FAST_TIMEOUTS},
        **extra,
    )  # fmt: skip


@pytest.mark.heavy
@pytest.mark.parametrize("algo", [SAC, TD3], ids=["SAC", "TD3"])
def test_sac_and_td3_learn_and_round_trip_their_reverb_buffer(
    algo: type[OffPolicyAlgorithm], tmp_path: Any
) -> None:
    model = _pendulum_model(algo, tmp_path / "ckpt")
    fresh = None
    try:
        model.learn(total_timesteps=LEARN_STEPS)
        buffer = model.replay_buffer
        assert isinstance(buffer, ReverbReplayBuffer)
        assert model.num_timesteps == LEARN_STEPS
        # Each env's newest transition waits for the next step (its episode is still open).
        assert buffer.size() == LEARN_STEPS - N_ENVS
        rows = _stored_rows(buffer)
        assert sum(timeout for *_, timeout in rows) == 2 * N_ENVS
        assert sum(done for *_, done, _ in rows) == 2 * N_ENVS  # no terminations
        batch = buffer.sample(16)
        assert batch.actions.shape == (16, 1) and batch.actions.dtype == torch.float32
        assert float(batch.actions.abs().max()) <= 1.0  # SB3 stores actions scaled to [-1, 1]

        path = tmp_path / "buffer.pkl"
        model.save_replay_buffer(path)
        fresh = _pendulum_model(algo, tmp_path / "fresh_ckpt")
        unused = fresh.replay_buffer
        fresh.load_replay_buffer(path)
        unused.close()
        loaded = fresh.replay_buffer
        assert isinstance(loaded, ReverbReplayBuffer) and loaded is not unused
        assert loaded.checkpoint_dir != buffer.checkpoint_dir
        assert loaded.size() == buffer.size()
        assert sorted(_stored_rows(loaded)) == sorted(rows)
        fresh.learn(total_timesteps=20, reset_num_timesteps=False)  # samples the loaded buffer
        assert loaded.size() == buffer.size() + 20 - N_ENVS  # the new episodes are open
    finally:
        model.replay_buffer.close()
        if fresh is not None:
            fresh.replay_buffer.close()


class RandomPolicy:
    """A seeded uniformly random CartPole policy with SB3's `predict` signature."""

    def __init__(self) -> None:
        self._rng = np.random.default_rng(0)

    def predict(self, obs: Any, *args: Any, **kwargs: Any) -> tuple[np.ndarray, None]:
        return self._rng.integers(0, 2, size=(len(obs),)), None


@pytest.mark.slow  # about 90 s on 2 cores: 12k steps of DQN
@pytest.mark.timeout(300)
def test_dqn_learns_cartpole_with_the_reverb_buffer(tmp_path: Any) -> None:
    env = make_vec_env("CartPole-v1", n_envs=1, seed=0)
    model = DQN(
        "MlpPolicy", env, learning_rate=2.3e-3, batch_size=64, buffer_size=20_000,
        learning_starts=500, gamma=0.99, target_update_interval=10, train_freq=256,
        gradient_steps=128, exploration_fraction=0.16, exploration_final_eps=0.04,
        policy_kwargs={"net_arch": [256, 256]}, seed=0,
        replay_buffer_class=ReverbReplayBuffer,
        replay_buffer_kwargs={"checkpoint_dir": str(tmp_path / "ckpt"), "timeouts": FAST_TIMEOUTS},
    )  # fmt: skip
    eval_env = make_vec_env("CartPole-v1", n_envs=1, seed=1)
    random_return, _ = evaluate_policy(RandomPolicy(), eval_env, n_eval_episodes=10)
    try:
        model.learn(total_timesteps=12_000)
        trained_return, _ = evaluate_policy(model, eval_env, n_eval_episodes=10)
        path = tmp_path / "buffer.pkl"
        model.save_replay_buffer(path)
        model.load_replay_buffer(path)
        assert model.replay_buffer.size() > 10_000
    finally:
        model.replay_buffer.close()
    print(f"random policy return {random_return:.1f}, DQN return {trained_return:.1f}")
    assert trained_return > 3 * random_return


def _dqn_model(env_id: str, checkpoint_dir: Any) -> DQN:
    """A small DQN on `env_id` over a ReverbReplayBuffer (nothing learnt)."""
    return DQN(
        "MlpPolicy", make_vec_env(env_id, n_envs=N_ENVS, seed=0), buffer_size=1000,
        learning_starts=10, batch_size=8, policy_kwargs={"net_arch": [8]}, seed=0,
        replay_buffer_class=ReverbReplayBuffer,
        replay_buffer_kwargs={"checkpoint_dir": str(checkpoint_dir), "timeouts": FAST_TIMEOUTS},
    )  # fmt: skip


def _saved_cartpole_buffer(tmp_path: Any) -> tuple[Any, int]:
    """A CartPole ReverbReplayBuffer saved as `save_replay_buffer` does; its path and size."""
    env = gymnasium.make("CartPole-v1")
    buffer = ReverbReplayBuffer(
        1000, env.observation_space, env.action_space, "cpu", n_envs=N_ENVS,
        checkpoint_dir=tmp_path / "cartpole_ckpt", timeouts=FAST_TIMEOUTS,
    )  # fmt: skip
    try:
        _collect([buffer])
        size = buffer.size()
        path = tmp_path / "cartpole_buffer.pkl"
        path.write_bytes(pickle.dumps(buffer))
    finally:
        buffer.close()
    return path, size


@pytest.mark.heavy
def test_load_replay_buffer_of_an_empty_or_truncated_file_names_the_file(tmp_path: Any) -> None:
    saved, size = _saved_cartpole_buffer(tmp_path)
    data = saved.read_bytes()
    model = _dqn_model("CartPole-v1", tmp_path / "ckpt")
    own = model.replay_buffer
    try:
        for name, content in (
            ("empty.pkl", b""),
            ("truncated.pkl", data[: len(data) // 2]),
            ("cut_at_the_end.pkl", data[:-3]),
            ("garbage.pkl", b"not a pickle at all"),
        ):
            path = tmp_path / name
            path.write_bytes(content)
            with pytest.raises(ReplayServiceError, match=re.escape(str(path))):
                model.load_replay_buffer(path)
            assert model.replay_buffer is own  # the model keeps its buffer
        with open(tmp_path / "truncated.pkl", "rb") as f:  # an open file, as SB3 allows
            with pytest.raises(ReplayServiceError, match="truncated.pkl"):
                model.load_replay_buffer(f)
        model.load_replay_buffer(saved)  # the whole file loads
        assert model.replay_buffer is not own and model.replay_buffer.size() == size
        model.learn(total_timesteps=20)
    finally:
        own.close()
        model.replay_buffer.close()


@pytest.mark.heavy
@pytest.mark.parametrize("env_id", ["MountainCar-v0", "Acrobot-v1"])
def test_load_replay_buffer_of_other_spaces_names_both_spaces(env_id: str, tmp_path: Any) -> None:
    saved, _ = _saved_cartpole_buffer(tmp_path)
    model = _dqn_model(env_id, tmp_path / "ckpt")
    own = model.replay_buffer
    try:
        with pytest.raises(ReplayServiceError, match=re.escape(str(saved))) as raised:
            model.load_replay_buffer(saved)
        message = str(raised.value)
        cartpole = gymnasium.make("CartPole-v1")
        assert "observation space" in message
        assert repr(cartpole.observation_space) in message
        assert repr(model.observation_space) in message
        if env_id == "Acrobot-v1":  # Discrete(2) against Discrete(3)
            assert "action space" in message and "Discrete(3)" in message
        assert model.replay_buffer is own
        model.learn(total_timesteps=20)  # the model goes on with its own buffer
        assert own.size() > 0
    finally:
        own.close()


FRAME_BYTES = 84 * 84  # one grayscale Atari frame


class _TeeBuffer(ReverbReplayBuffer):
    """A ReverbReplayBuffer that also hands every `add` to SB3's own ReplayBuffer (`theirs`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.theirs = ReplayBuffer(
            self.buffer_size, self.observation_space, self.action_space, "cpu", n_envs=self.n_envs
        )

    def add(self, *args: Any) -> None:
        self.theirs.add(*args)
        super().add(*args)


def _sb3_rows(theirs: ReplayBuffer) -> set[tuple[Any, ...]]:
    """SB3's stored transitions as `_rows` rows."""
    n, envs = theirs.pos, theirs.n_envs

    def flat(name: str) -> np.ndarray:
        array = getattr(theirs, name)[:n].swapaxes(0, 1)
        return array.reshape(envs * n, *array.shape[2:])

    return set(
        _rows(
            flat("observations"),
            flat("actions").astype(np.int64),
            flat("rewards"),
            flat("next_observations"),
            flat("dones"),
            flat("timeouts"),
        )
    )


@pytest.mark.heavy
@pytest.mark.timeout(120)
def test_dqn_on_atari_with_vec_frame_stack_stores_each_frame_once(tmp_path: Any) -> None:
    ale_py = pytest.importorskip("ale_py")
    from stable_baselines3.common.env_util import make_atari_env
    from stable_baselines3.common.vec_env import VecFrameStack

    gymnasium.register_envs(ale_py)
    env = VecFrameStack(make_atari_env("BreakoutNoFrameskip-v4", n_envs=N_ENVS, seed=0), 4)
    model = DQN(
        "CnnPolicy", env, buffer_size=1000, learning_starts=380, batch_size=32, train_freq=4,
        exploration_initial_eps=1.0, exploration_final_eps=1.0,  # random play: no CNN forward
        seed=0, device="cpu", replay_buffer_class=_TeeBuffer,
        replay_buffer_kwargs={"frame_stack": 4, "checkpoint_dir": str(tmp_path / "ckpt")},
    )  # fmt: skip
    ours = model.replay_buffer
    try:
        assert ours.observation_space.shape == (4, 84, 84)  # VecTransposeImage: channels first
        assert ours.manager.backend == "local"
        model.learn(400)  # 200 steps per env (lost lives end episodes), 3 updates at the end
        theirs = ours.theirs
        assert theirs.dones[: theirs.pos].sum() >= 4  # terminal stacks and zero-padded starts
        table = ours.manager._backend.client.table(ours.manager.table_name)
        per_step = table.nbytes / table.step_capacity
        assert per_step <= 1.05 * FRAME_BYTES, per_step  # one frame per step, not a stack of 4
        # Every transition SB3 stores, stack for stack, less each env's open newest one.
        expected = _sb3_rows(theirs)
        stored = _stored_rows(ours)
        assert set(stored) <= expected
        assert len(expected - set(stored)) <= N_ENVS
        assert len(stored) == ours.size() >= N_ENVS * theirs.pos - N_ENVS
        # Sampled batches are SB3's transitions, as SB3's own sample returns them.
        batch = ours.sample(256)
        assert batch.observations.shape == (256, 4, 84, 84)
        assert batch.observations.dtype == batch.next_observations.dtype == torch.uint8  # SB3's
        sampled = _rows(
            batch.observations.numpy(),
            batch.actions.numpy(),
            batch.rewards.numpy().ravel(),
            batch.next_observations.numpy(),
            batch.dones.numpy().ravel(),
            batch.dones.numpy().ravel() * 0,  # Breakout's episodes end by termination here
        )
        assert set(sampled) <= expected
        assert any(r[4] for r in sampled)  # terminal transitions among them
        loaded = pickle.loads(pickle.dumps(ours))  # save_replay_buffer keeps the frame stack
        try:
            assert (loaded.frame_stack, loaded.size()) == (4, ours.size())
            assert set(_stored_rows(loaded)) == set(stored)
        finally:
            loaded.close()
    finally:
        ours.close()
        env.close()


def test_frame_axis_is_sb3s_stacking_axis_and_needs_a_frame_stack() -> None:
    from gymnasium import spaces

    from replay_service.errors import ConfigError
    from replay_service.integrations.sb3 import sb3_frame_axis

    image = spaces.Box(0, 255, (84, 84, 4), np.uint8)
    assert sb3_frame_axis(spaces.Box(0, 255, (4, 84, 84), np.uint8)) == 0  # CnnPolicy's
    assert sb3_frame_axis(image) == -1  # VecFrameStack's channels last
    assert sb3_frame_axis(spaces.Box(-1.0, 1.0, (16,), np.float32)) == -1
    with pytest.raises(ConfigError, match="frame_axis=-1 needs frame_stack"):
        ReverbReplayBuffer(10, image, spaces.Discrete(4), "cpu", frame_axis=-1, backend="local")
