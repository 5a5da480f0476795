"""Fill a buffer from a gymnasium environment with any policy before training starts.

Velora's `buffer.warm(agent, n_samples, num_envs)`, without TF-Agents:
`manager.warm_up(env, num_steps, policy=None)` steps a gymnasium env, or a gymnasium vector env
(`gymnasium.vector.SyncVectorEnv`, `AsyncVectorEnv`), with `policy(observation) -> action`
(by default the env's `action_space.sample()`: random actions) and writes every transition.

Episodes end as gymnasium says: `terminated` is stored as a terminal transition (discount 0),
`truncated` as a truncation whose final observation is kept for bootstrapping. A single env is
reset by hand when its episode ends and written by a `TransitionWriter`; a vector env resets
itself and is written by a `GymVectorWriter`, which reads its auto-reset mode (NEXT_STEP reset
steps are never stored; SAME_STEP final observations are taken from `infos`). The episodes
still running when `num_steps` is reached end with that step, written as truncated (the
warm-up's step budget is a time limit), so every transition collected is stored.

Only gymnasium's API is stepped (gymnasium, or gym >= 0.26): `reset(seed=...) -> (observation,
info)` and `step(action) -> (observation, reward, terminated, truncated, info)`. An env of the
old gym API (< 0.26: `reset() -> observation`, `step() -> (observation, reward, done, info)`)
is refused with a `ConfigError` at its first `reset` or `step`, before anything is written: its
`done` does not say whether the episode terminated (stored with discount 0) or was cut by a time
limit (bootstrapped from), and guessing would store wrong targets. Wrap it for gymnasium with
shimmy (`gymnasium.make("GymV21Environment-v0", env=env)` after `import shimmy`), as
Stable-Baselines3 does.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from replay_service.config.options import require_int, require_seed
from replay_service.errors import ConfigError, SpecMismatchError

if TYPE_CHECKING:
    from replay_service.collect.gym_vector import GymVectorWriter
    from replay_service.collect.transitions import TransitionWriter
    from replay_service.collect.view import CollectView

_log = logging.getLogger(__name__)

LOG_EVERY_S = 10.0
"""Without tqdm: seconds between two progress log lines (and one at the end)."""

GYMNASIUM_API = (
    "warm_up steps gymnasium's API (gymnasium, or gym >= 0.26): reset(seed=...) -> "
    "(observation, info) and step(action) -> (observation, reward, terminated, truncated, info)"
)
OLD_GYM_HINT = (
    "This looks like the old gym API (gym < 0.26: reset() -> observation, step() -> "
    "(observation, reward, done, info)), whose done does not say whether an episode "
    "terminated or was truncated, which the buffer stores differently. Wrap the env for "
    "gymnasium with shimmy (pip install 'shimmy[gym-v21]'; import shimmy; env = "
    "gymnasium.make('GymV21Environment-v0', env=env)), or make it with gymnasium"
)


def is_vector_env(env: Any) -> bool:
    """Whether `env` is a gymnasium vector env (it has `num_envs` and single-env spaces)."""
    return isinstance(getattr(env, "num_envs", None), int) and hasattr(env, "single_action_space")


def extra_names(data_spec: Any) -> tuple[str, ...]:
    """The names of the extra per-step fields of a data spec (its `policy_info` dict's keys,
    as `from_spaces(extras=...)` declares them); () for none."""
    info = getattr(data_spec, "policy_info", ())
    return tuple(info) if isinstance(info, dict) and info else ()


def check_options(
    env: Any, num_steps: Any, policy: Any, seed: Any, progress: Any, extras: Sequence[str]
) -> None:
    """Refuses bad `warm_up` arguments before anything is reset or written.

    Args:
      env: The environment.
      num_steps: Transitions to write.
      policy: The policy, or None for random actions.
      seed: The seed, or None.
      progress: Whether to show progress.
      extras: The data spec's extra per-step fields (a random policy has none to give).

    Raises:
      ConfigError: Naming the argument and its value.
    """
    for method in ("reset", "step"):
        if not callable(getattr(env, method, None)):
            raise ConfigError(
                f"env must be a gymnasium env or vector env (with reset() and step()), got {env!r}"
            )
    old_gym = _old_gym_version(env)
    if old_gym is not None:
        raise ConfigError(
            f"{GYMNASIUM_API}, but env {env!r} is a gym {old_gym} env. {OLD_GYM_HINT}"
        )
    require_int("num_steps", num_steps, 1, what="a positive integer")
    if policy is not None and not callable(policy):
        raise ConfigError(
            f"policy must be a callable policy(observation) -> action, got {policy!r}"
        )
    if policy is None:
        if getattr(env, "action_space", None) is None:
            raise ConfigError(f"env {env!r} has no action_space to draw random actions from")
        if extras:
            raise ConfigError(
                f"the data spec declares the extras {list(extras)}, which random actions do not "
                "give: pass a policy(observation) -> (action, {name: value}) to warm_up"
            )
    require_seed("seed", seed)
    if not isinstance(progress, bool):
        raise ConfigError(f"progress must be True or False, got {progress!r}")


def warm_up(
    env: Any,
    writer: TransitionWriter | GymVectorWriter,
    num_steps: int,
    policy: Callable[[Any], Any] | None = None,
    *,
    seed: int | None = None,
    progress: bool = True,
    extras: Sequence[str] = (),
) -> int:
    """Steps `env` with `policy` and writes at least `num_steps` transitions (see module docs).

    Args:
      env: A gymnasium env, or a gymnasium vector env.
      writer: A `TransitionWriter` (single env) or a `GymVectorWriter` for `env`; closed at
        the end (its items flushed).
      num_steps: Transitions to write; a vector env writes whole steps of all its
        environments, so up to `num_envs - 1` more (NEXT_STEP reset steps are not counted).
      policy: `policy(observation) -> action` (batched for a vector env); with `extras`,
        `policy(observation) -> (action, {name: value})`. None: `env.action_space.sample()`.
      seed: Seeds `env.reset(seed=seed)` and the random policy's action space; None: not
        seeded.
      progress: Show a tqdm progress bar (a log line every `LOG_EVERY_S` seconds without tqdm).
      extras: The data spec's extra per-step fields, which the policy returns.

    Returns:
      The number of transitions written.

    Raises:
      ConfigError: If an argument is invalid (see `check_options`), or the env's `reset` or
        `step` does not return gymnasium's values (the old gym API: see module docs), naming
        what it returned; nothing of that step is written.
      SpecMismatchError: If the policy does not return `(action, extras dict)` where extras are
        declared, or a value does not fit the data spec (named by the writer).
      WriteTimeoutError: If the server does not confirm items within the write timeout.
    """
    check_options(env, num_steps, policy, seed, progress, extras)
    vector = is_vector_env(env)
    if policy is None:
        space = env.action_space
        if seed is not None:
            space.seed(seed)
        policy = lambda _: space.sample()  # noqa: E731
    written = 0
    bar = _Progress(num_steps, progress)
    try:
        observation = _reset(env, seed=seed)
        if vector:
            writer.reset(observation)  # type: ignore[call-arg]
        while written < num_steps:
            action, extra_values = _act(policy, observation, extras)
            next_observation, reward, terminated, truncated, info = _step(env, action, written)
            if vector:
                last = written + env.num_envs >= num_steps
                count = writer.add(  # type: ignore[call-arg]
                    action,
                    next_observation,
                    reward,
                    terminated,
                    truncated,
                    info,
                    end_episodes=last,
                    **extra_values,
                )
                observation = next_observation
                if last and written + count < num_steps:
                    # NEXT_STEP reset steps wrote less than expected: new episodes go on.
                    observation = _reset(env)
                    writer.reset(observation)  # type: ignore[call-arg]
            else:
                count = 1
                ended = bool(terminated) or bool(truncated)
                writer.add(
                    observation,
                    action,
                    reward,
                    next_observation,
                    bool(terminated),
                    bool(truncated) or written + 1 >= num_steps,
                    **extra_values,
                )
                observation = _reset(env) if ended else next_observation
            written += count
            bar.update(written)
    finally:
        bar.close(written)
        writer.close()
    return written


def _old_gym_version(env: Any) -> str | None:
    """The version of the installed gym package when `env` is one of its envs (or vector
    envs) and it is older than 0.26 (the old API); else None. Envs of other packages are
    checked by what their `reset` and `step` return."""
    gym = sys.modules.get("gym")  # imported by whoever made the env; never imported here
    base = getattr(gym, "Env", None)
    if gym is None or not isinstance(base, type) or not isinstance(env, base):
        return None
    version = str(getattr(gym, "__version__", ""))
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return None
    return version if (major, minor) < (0, 26) else None


def _reset(env: Any, **kwargs: Any) -> Any:
    """`env.reset(**kwargs)`'s observation, once the result is gymnasium's `(observation,
    info)`.

    Raises:
      ConfigError: If the env does not take `seed` or returns something else (the old gym
        API's bare observation), naming what it returned; nothing was written.
    """
    try:
        result = env.reset(**kwargs)
    except TypeError as e:
        if "seed" not in str(e):
            raise
        raise ConfigError(
            f"{GYMNASIUM_API}, but env.reset(seed=...) of {env!r} refused the seed: {e}. "
            f"{OLD_GYM_HINT}; nothing was written"
        ) from e
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict)):
        raise ConfigError(
            f"{GYMNASIUM_API}, but env.reset() of {env!r} returned {_describe(result)}, not "
            f"(observation, info). {OLD_GYM_HINT}; nothing was written"
        )
    return result[0]


def _step(env: Any, action: Any, written: int) -> tuple[Any, Any, Any, Any, Any]:
    """`env.step(action)`, once the result is gymnasium's five values.

    Raises:
      ConfigError: If it is anything else (the old gym API's `(observation, reward, done,
        info)`), naming what it returned and how many transitions were written before.
    """
    result = env.step(action)
    if isinstance(result, tuple) and len(result) == 5:
        return result
    old = isinstance(result, tuple) and len(result) == 4
    raise ConfigError(
        f"{GYMNASIUM_API}, but env.step() of {env!r} returned {_describe(result)}"
        + (f". {OLD_GYM_HINT}" if old else "")
        + "; nothing of that step was written"
        + (f" (the {written} transitions before it stay written)" if written else "")
    )


def _describe(value: Any) -> str:
    """A value as an error names it: its type, and its length for a tuple (short repr)."""
    text = repr(value)
    text = text if len(text) <= 120 else text[:117] + "..."
    if isinstance(value, tuple):
        return f"a {len(value)}-tuple {text}"
    return f"{type(value).__name__} {text}"


def _act(
    policy: Callable[[Any], Any], observation: Any, extras: Sequence[str]
) -> tuple[Any, dict[str, Any]]:
    """The policy's action (as numpy when it returns torch) and extra fields."""
    output = policy(observation)
    values: dict[str, Any] = {}
    if extras:
        if not (isinstance(output, tuple) and len(output) == 2 and isinstance(output[1], dict)):
            raise SpecMismatchError(
                f"the data spec declares the extras {list(extras)}: the policy must return "
                f"(action, {{name: value}}), got {type(output).__name__} {output!r}"
            )
        output, values = output
    return _numpy(output), values


def _numpy(action: Any) -> Any:
    """A torch action (or nest of them, as dict or tuple) as numpy, which envs take."""
    if hasattr(action, "detach") and hasattr(action, "cpu"):
        return action.detach().cpu().numpy()
    if isinstance(action, dict):
        return {key: _numpy(value) for key, value in action.items()}
    if isinstance(action, tuple):
        return tuple(_numpy(value) for value in action)
    return action


class _Progress:
    """A tqdm bar of the transitions written, or log lines where tqdm is not installed."""

    def __init__(self, total: int, enabled: bool) -> None:
        self._total = total
        self._enabled = enabled
        self._bar: Any = None
        self._last_log = time.monotonic()
        if not enabled:
            return
        try:
            from tqdm.auto import tqdm
        except ImportError:
            _log.info("warm-up: writing %d transitions", total)
            return
        self._bar = tqdm(total=total, desc="warm-up", unit="steps")

    def update(self, written: int) -> None:
        """Reports `written` transitions so far."""
        if self._bar is not None:
            self._bar.update(min(written, self._total) - self._bar.n)
        elif self._enabled and time.monotonic() - self._last_log >= LOG_EVERY_S:
            self._last_log = time.monotonic()
            _log.info("warm-up: %d/%d transitions written", written, self._total)

    def close(self, written: int) -> None:
        """Ends the bar, or logs the final count."""
        if self._bar is not None:
            self._bar.close()
        elif self._enabled:
            _log.info("warm-up: %d/%d transitions written", written, self._total)


def fill(
    view: CollectView,
    env: Any,
    num_steps: int,
    policy: Callable[[Any], Any] | None,
    seed: int | None,
    progress: bool,
) -> int:
    """Checks the options, then `warm_up`s the buffer with a new writer of it: a
    `gym_vector.gym_vector_writer` for a vector env, else a `TransitionWriter`.

    Args:
      view: The buffer.
      env: A gymnasium env or vector env whose spaces match the data spec.
      num_steps: Transitions to write.
      policy: As `warm_up`'s; None: random actions.
      seed: As `warm_up`'s.
      progress: As `warm_up`'s.

    Returns:
      The number of transitions written.

    Raises:
      ConfigError: If an option is invalid (`check_options`, before `view.require_client`).
      BufferStateError: If the buffer was not created or loaded.
      SpecMismatchError, WriteTimeoutError: As `warm_up`.
    """
    from replay_service.collect.gym_vector import gym_vector_writer
    from replay_service.collect.view import transition_writer

    extras = extra_names(view.data_spec)
    check_options(env, num_steps, policy, seed, progress, extras)
    view.require_client()
    writer: Any = gym_vector_writer(view, env) if is_vector_env(env) else transition_writer(view)
    return warm_up(env, writer, num_steps, policy, seed=seed, progress=progress, extras=extras)
