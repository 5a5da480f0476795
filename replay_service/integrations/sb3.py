"""A Reverb-backed replay buffer for Stable-Baselines3's off-policy algorithms (extra `sb3`).

    from stable_baselines3 import DQN
    from replay_service.integrations.sb3 import ReverbReplayBuffer

    model = DQN("MlpPolicy", env, buffer_size=50_000, replay_buffer_class=ReverbReplayBuffer,
                replay_buffer_kwargs={"checkpoint_dir": "runs/exp1/replay"})
    model.learn(10_000)
    model.save_replay_buffer("buffer.pkl")       # the buffer's export files, not pickled arrays

Atari with `VecFrameStack`: `replay_buffer_kwargs={"frame_stack": 4}` stores each frame once
(the local backend's `frame_stack`, `backends.local.frames`) and rebuilds the stacks SB3's
own buffer would return, zero-padded episode starts and terminal stacks included; the
stacking axis is SB3's for the observation space (`sb3_frame_axis`).

It works with DQN, SAC, TD3 (and DDPG): Box or Discrete observation and action spaces, any
number of VecEnv environments. Each environment's transitions go through its own
`TransitionWriter` (episodes never mix); SB3 passes the real final observation of an ended
episode (`infos[i]["terminal_observation"]`) as `next_obs`, and `infos[i]["TimeLimit.truncated"]`
marks a time-limit end. Samples carry SB3's `dones`: terminated only with
`handle_timeout_termination=True` (the default), terminated or truncated otherwise.

`save_replay_buffer` pickles this object: its state is this project's export (the
`buffer_state.safetensors` and `buffer_metadata.json` bytes, see
`replay_service.storage.export`) plus the spaces and options, and `load_replay_buffer` imports
that export into a new buffer.

Importing this module wraps SB3's `OffPolicyAlgorithm.load_replay_buffer` for models whose
`replay_buffer_class` is `ReverbReplayBuffer`: an empty, truncated or foreign file raises
`CheckpointError` naming the file, and a buffer saved for other spaces (CartPole's into a
MountainCar model) raises `SpecMismatchError` naming both spaces; either way the model keeps its
buffer. Models with other buffer classes load as SB3 does.
"""

from __future__ import annotations

import functools
import io
import os
import pathlib
import pickle
import tempfile
import weakref
from typing import Any

import numpy as np
import torch
from gymnasium import spaces
from stable_baselines3.common.buffers import ReplayBuffer
from stable_baselines3.common.off_policy_algorithm import OffPolicyAlgorithm
from stable_baselines3.common.preprocessing import is_image_space, is_image_space_channels_first
from stable_baselines3.common.save_util import load_from_pkl
from stable_baselines3.common.type_aliases import ReplayBufferSamples

from replay_service.config.options import Timeouts
from replay_service.errors import CheckpointError, ConfigError, SpecMismatchError
from replay_service.manager import ReplayBufferManager
from replay_service.specs.nests import data_spec_for_spaces

_EXPORT_FILES = ("buffer_state.safetensors", "buffer_metadata.json")

__all__ = ["ReverbReplayBuffer", "data_spec_for_spaces", "sb3_frame_axis"]


def sb3_frame_axis(observation_space: spaces.Space) -> int:
    """The axis SB3's `VecFrameStack` stacks frames along, as the buffer sees the space.

    SB3 stacks an image's frames along its channel axis (last, unless the image is channels
    first) and any other observation along its last axis; a model then moves a channels-last
    image's channels first (`VecTransposeImage`), which is the space its buffer gets.

    Args:
      observation_space: The observation space the replay buffer is given.

    Returns:
      0 for a channels-first image, else -1.
    """
    if is_image_space(observation_space, check_channels=False) and is_image_space_channels_first(
        observation_space  # type: ignore[arg-type]
    ):
        return 0
    return -1


class ReverbReplayBuffer(ReplayBuffer):
    """SB3 `ReplayBuffer` whose transitions live in a replay_service table (see module docs).

    Args:
      buffer_size: Capacity in transitions (items of 2 steps).
      observation_space: The env's observation space (Box or Discrete).
      action_space: The env's action space (Box or Discrete).
      device: Where sampled tensors go.
      n_envs: Number of environments of the VecEnv.
      optimize_memory_usage: Must be False (each transition is stored once anyway).
      handle_timeout_termination: Sampled `dones` exclude time-limit ends (SB3's meaning).
      checkpoint_dir: The buffer's checkpoint directory; None: a new temporary directory.
      timeouts: replay_service timeouts; `sample` bounds the wait for a first item.
      backend: The buffer's backend (`ReplayBufferManager`'s `backend=`): "auto" (Reverb
        where it imports; local with `frame_stack`), "reverb", or "local" (the table in this
        process, no server: less work per `add` and `sample`).
      frame_stack: Observations are stacks of this many frames (`VecFrameStack(env, n)`'s
        `n`), each frame stored once (local backend); None: observations stored whole.
      frame_axis: The axis the frames are stacked along, 0 or -1; None: SB3's for the
        observation space (`sb3_frame_axis`: 0 for the channels-first images a CNN policy
        gets, -1 otherwise).

    Raises:
      ConfigError: If a space is unsupported, `optimize_memory_usage` is set, `backend` is
        unknown, or `frame_stack`/`frame_axis` do not fit the observation space or backend.
    """

    def __init__(
        self,
        buffer_size: int,
        observation_space: spaces.Space,
        action_space: spaces.Space,
        device: torch.device | str = "auto",
        n_envs: int = 1,
        optimize_memory_usage: bool = False,
        handle_timeout_termination: bool = True,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        timeouts: Timeouts | None = None,
        backend: str = "auto",
        frame_stack: int | None = None,
        frame_axis: int | None = None,
    ) -> None:
        if optimize_memory_usage:
            raise ConfigError("ReverbReplayBuffer does not take optimize_memory_usage=True")
        # The base class of SB3's ReplayBuffer: spaces, shapes, device; no arrays.
        super(ReplayBuffer, self).__init__(
            buffer_size, observation_space, action_space, device, n_envs=n_envs
        )
        self.optimize_memory_usage = False
        self.handle_timeout_termination = handle_timeout_termination
        self._timeouts = timeouts
        self._backend = backend
        if frame_stack is None and frame_axis is not None:
            raise ConfigError(
                f"frame_axis={frame_axis!r} needs frame_stack (VecFrameStack's n_stack)"
            )
        self.frame_stack = frame_stack
        self.frame_axis = frame_axis
        self._obs_rows = (self.n_envs, *self.obs_shape)
        self._action_rows = (self.n_envs, self.action_dim)
        self._open(checkpoint_dir)

    def _open(self, checkpoint_dir: str | os.PathLike[str] | None) -> None:
        self.checkpoint_dir = os.fspath(
            checkpoint_dir or tempfile.mkdtemp(prefix="replay_service_sb3_")
        )
        for name, space in (("observation", self.observation_space), ("action", self.action_space)):
            if not isinstance(space, spaces.Box | spaces.Discrete):
                raise ConfigError(
                    f"ReverbReplayBuffer supports Box and Discrete {name} spaces (as SB3's "
                    f"ReplayBuffer), got {space!r}"
                )
        self.data_spec = data_spec_for_spaces(self.observation_space, self.action_space)
        frames: dict[str, Any] = {}
        backend = self._backend
        if self.frame_stack is not None:
            axis = self.frame_axis
            frames = {
                "frame_stack": self.frame_stack,
                "frame_axis": sb3_frame_axis(self.observation_space) if axis is None else axis,
            }
            if backend == "auto":  # frames stored once are the local backend's
                backend = "local"
        self.manager = ReplayBufferManager(
            self.data_spec,
            self.buffer_size,
            self.checkpoint_dir,
            2,
            timeouts=self._timeouts,
            backend=backend,
            **frames,
        )
        # SB3's `load_replay_buffer` replaces the model's buffer without closing it: the
        # replaced buffer's server and directory lock go when it is garbage collected.
        weakref.finalize(self, self.manager.close)
        self._writers: list[Any] = []
        self._streams: dict[int, Any] = {}

    def _start(self, import_from: str | None = None) -> None:
        if import_from is not None:
            self.manager.import_buffer(import_from, overwrite=True)
        else:
            self.manager.create_replay_buffer(overwrite=True)
        self._writers = [self.manager.transition_writer() for _ in range(self.n_envs)]

    def add(
        self,
        obs: np.ndarray,
        next_obs: np.ndarray,
        action: np.ndarray,
        reward: np.ndarray,
        done: np.ndarray,
        infos: list[dict[str, Any]],
    ) -> None:
        """Stores one transition per environment (SB3's `ReplayBuffer.add` arguments).

        Raises:
          SpecMismatchError: If a value does not match the spaces (named by field).
        """
        if not self._writers:
            self._start()
        n = self.n_envs
        obs = self._rows(obs, self._obs_rows)
        next_obs = self._rows(next_obs, self._obs_rows)
        action = self._rows(action, self._action_rows)
        if type(reward) is not np.ndarray or reward.dtype != np.float32 or reward.shape != (n,):
            reward = np.asarray(reward, np.float32).reshape(n)
        done = self._rows(done, (n,))
        for i, writer in enumerate(self._writers):
            if done[i]:
                terminated = not infos[i].get("TimeLimit.truncated", False)
                writer.add(obs[i], action[i], reward[i], next_obs[i], terminated, not terminated)
            else:
                writer.add(obs[i], action[i], reward[i], next_obs[i], False, False)

    @staticmethod
    def _rows(value: Any, shape: tuple[int, ...]) -> np.ndarray:
        """`value` as an array of `shape` (itself when it is one already)."""
        if type(value) is np.ndarray and value.shape == shape:
            return value
        return np.asarray(value).reshape(shape)

    def size(self) -> int:
        """Transitions stored (items of the table; an env's newest one once the next arrives)."""
        if not self._writers:
            return 0
        for writer in self._writers:
            writer.flush()
        return self.manager.num_frames()

    def reset(self) -> None:
        """Empties the buffer."""
        if self._writers:
            self.manager.clear()

    def sample(self, batch_size: int, env: Any = None) -> ReplayBufferSamples:
        """Samples `batch_size` transitions uniformly (with replacement).

        Raises:
          BufferStateError: If nothing can be sampled within `timeouts.sample`.
        """
        if not self._writers:
            self._start()
        stream = self._streams.get(batch_size)
        if stream is None:
            stream = self._streams[batch_size] = self.manager.torch_batches(
                batch_size, transitions=True, device="cpu"
            )
        batch = next(stream)
        dones = batch.dones if self.handle_timeout_termination else batch.dones | batch.truncated
        if env is None:  # nothing to normalize: the batch's own (fresh) tensors, SB3's shapes
            device = self.device
            return ReplayBufferSamples(
                observations=batch.states.to(device),
                actions=batch.actions.reshape(batch_size, self.action_dim).to(device),
                next_observations=batch.next_states.to(device),
                dones=dones.reshape(-1, 1).to(device, torch.float32),
                rewards=batch.rewards.reshape(-1, 1).to(device, torch.float32),
            )
        observations = self._normalize_obs(batch.states.numpy(), env)
        next_observations = self._normalize_obs(batch.next_states.numpy(), env)
        rewards = self._normalize_reward(batch.rewards.numpy().reshape(-1, 1), env)
        return ReplayBufferSamples(
            observations=self.to_torch(observations),
            actions=self.to_torch(batch.actions.numpy().reshape(batch_size, self.action_dim)),
            next_observations=self.to_torch(next_observations),
            dones=self.to_torch(dones.numpy().astype(np.float32).reshape(-1, 1)),
            rewards=self.to_torch(rewards.astype(np.float32)),
        )

    def close(self) -> None:
        """Stops sampling and closes the buffer's server (no checkpoint is taken)."""
        for stream in self._streams.values():
            stream.close()
        self._streams = {}
        self.manager.close()

    # ------------------------------------------------------- save_replay_buffer / load

    def __getstate__(self) -> dict[str, Any]:
        """The buffer's export files (bytes) and options: what `save_replay_buffer` pickles."""
        files: dict[str, bytes] = {}
        if self._writers:
            for writer in self._writers:
                writer.flush()
            with tempfile.TemporaryDirectory(prefix="replay_service_sb3_export_") as tmp:
                self.manager.export(tmp, overwrite=True)
                for name in _EXPORT_FILES:
                    with open(os.path.join(tmp, name), "rb") as f:
                        files[name] = f.read()
        return {
            "buffer_size": self.buffer_size,
            "observation_space": self.observation_space,
            "action_space": self.action_space,
            "device": str(self.device),
            "n_envs": self.n_envs,
            "handle_timeout_termination": self.handle_timeout_termination,
            "timeouts": self._timeouts,
            "backend": self._backend,
            "frame_stack": self.frame_stack,
            "frame_axis": self.frame_axis,
            "export": files,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Imports the export of `__getstate__` into a new buffer in a temporary directory."""
        ReverbReplayBuffer.__init__(
            self,
            state["buffer_size"],
            state["observation_space"],
            state["action_space"],
            state["device"],
            n_envs=state["n_envs"],
            handle_timeout_termination=state["handle_timeout_termination"],
            timeouts=state["timeouts"],
            backend=state.get("backend", "auto"),
            frame_stack=state.get("frame_stack"),
            frame_axis=state.get("frame_axis"),
        )
        if state["export"]:
            with tempfile.TemporaryDirectory(prefix="replay_service_sb3_import_") as tmp:
                for name, data in state["export"].items():
                    with open(os.path.join(tmp, name), "wb") as f:
                        f.write(data)
                self._start(import_from=tmp)


# ----------------------------------------------------------- SB3's model.load_replay_buffer

# What unpickling an empty, truncated or foreign file raises (pickle's own errors, and those of
# objects rebuilt from a cut or garbled stream).
_UNPICKLING_ERRORS = (
    pickle.UnpicklingError,
    EOFError,
    ValueError,
    TypeError,
    AttributeError,
    ImportError,
    IndexError,
    KeyError,
)


def _file_name(path: str | pathlib.Path | io.BufferedIOBase) -> str:
    """The name of `path` for error messages (a file object's `name` where it has one)."""
    if isinstance(path, str | pathlib.Path):
        return os.fspath(path)
    return str(getattr(path, "name", repr(path)))


def _check_loaded_buffer(model: OffPolicyAlgorithm, buffer: Any, name: str) -> None:
    """Checks that an unpickled `buffer` can serve `model`.

    Args:
      model: The model whose `load_replay_buffer` read the file.
      buffer: The unpickled object.
      name: The file's name, for the errors.

    Raises:
      CheckpointError: If `buffer` is not an SB3 replay buffer.
      SpecMismatchError: If its observation or action space differs from the model's.
    """
    if not isinstance(buffer, ReplayBuffer):
        raise CheckpointError(
            f"{name} does not hold a replay buffer (save_replay_buffer writes one), "
            f"it holds a {type(buffer).__name__}"
        )
    differ = [
        f"{label} space: file {theirs!r}, model {ours!r}"
        for label, theirs, ours in (
            ("observation", buffer.observation_space, model.observation_space),
            ("action", buffer.action_space, model.action_space),
        )
        if theirs != ours
    ]
    if differ:
        raise SpecMismatchError(
            f"the replay buffer in {name} was saved for other spaces than this model's "
            f"({'; '.join(differ)}); load it into a model of the same environment"
        )


def _wrap_load_replay_buffer(sb3_load: Any) -> Any:
    """Wraps SB3's `OffPolicyAlgorithm.load_replay_buffer` for models with ReverbReplayBuffer."""

    @functools.wraps(sb3_load)
    def load_replay_buffer(
        self: OffPolicyAlgorithm,
        path: str | pathlib.Path | io.BufferedIOBase,
        truncate_last_traj: bool = True,
    ) -> None:
        """SB3's `load_replay_buffer`, checked when the model uses a ReverbReplayBuffer.

        Args:
          path: The file written by `save_replay_buffer` (or an open binary file).
          truncate_last_traj: SB3's argument (HerReplayBuffer only).

        Raises:
          CheckpointError: If the file is empty, truncated or holds no replay buffer.
          SpecMismatchError: If the buffer was saved for other spaces than the model's.
        """
        buffer_class = getattr(self, "replay_buffer_class", None)
        if not (isinstance(buffer_class, type) and issubclass(buffer_class, ReverbReplayBuffer)):
            return sb3_load(self, path, truncate_last_traj)
        name = _file_name(path)
        start = None if isinstance(path, str | pathlib.Path) else path.tell()
        try:
            buffer = load_from_pkl(path, self.verbose)
        except _UNPICKLING_ERRORS as exc:
            raise CheckpointError(
                f"cannot load the replay buffer in {name}: the file is empty, truncated or not "
                f"written by save_replay_buffer ({type(exc).__name__}: {exc})"
            ) from exc
        try:
            _check_loaded_buffer(self, buffer, name)
        except (CheckpointError, SpecMismatchError):
            if isinstance(buffer, ReverbReplayBuffer):
                buffer.close()
            raise
        if not isinstance(buffer, ReverbReplayBuffer):
            # One of SB3's own buffers with the model's spaces: SB3 loads it as it does.
            if start is not None:
                path.seek(start)  # type: ignore[union-attr]
            return sb3_load(self, path, truncate_last_traj)
        self.replay_buffer = buffer
        buffer.device = self.device
        return None

    load_replay_buffer.__replay_service_wrapped__ = True  # type: ignore[attr-defined]
    return load_replay_buffer


if not getattr(OffPolicyAlgorithm.load_replay_buffer, "__replay_service_wrapped__", False):
    OffPolicyAlgorithm.load_replay_buffer = _wrap_load_replay_buffer(  # type: ignore[method-assign]
        OffPolicyAlgorithm.load_replay_buffer
    )
