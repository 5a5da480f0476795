"""Where a starter buffer's steps come from: environments, policies and their data spec."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from tf_agents.environments import py_environment
from tf_agents.policies import py_policy
from tf_agents.specs import tensor_spec

from replay_service.errors import ConfigError, SpecMismatchError
from replay_service.specs.nests import check_collect_spec, collect_data_spec, trajectory_spec
from replay_service.starter.checks import env_errors
from replay_service.starter.envs import BUILDING_ENV_ID, load_env
from replay_service.starter.options import DATA_SPEC_ENV_PREFIX
from replay_service.starter.policies import POLICY_CHOICES, load_policy


def make_envs_and_policies(
    env_name: str, policy_name: str, num_envs: int, seed: int
) -> tuple[list[py_environment.PyEnvironment], list[py_policy.PyPolicy]]:
    """Creates `num_envs` environments and one policy for each.

    Environment i and its policy get seed `seed + i`. A saved policy is loaded once and shared.

    Args:
      env_name: "building" or a gym id.
      policy_name: "schedule", "random" or a saved policy directory.
      num_envs: How many environments.
      seed: Base seed.

    Returns:
      `(envs, policies)`, lists of equal length.

    Raises:
      ConfigError: If the environment id or the policy is unknown, or they do not fit together.
    """
    envs = [_load_env(env_name, seed + i) for i in range(num_envs)]
    if policy_name in POLICY_CHOICES:
        policies = [
            _load_policy(policy_name, env_name, env, seed + i) for i, env in enumerate(envs)
        ]
    else:
        policies = [_load_policy(policy_name, env_name, envs[0], seed)] * num_envs
    return envs, policies


def _load_env(name: str, seed: int) -> py_environment.PyEnvironment:
    with env_errors(name):
        return load_env(name, seed)


def _load_policy(
    name: str, env_name: str, env: py_environment.PyEnvironment, seed: int
) -> py_policy.PyPolicy:
    known = name in POLICY_CHOICES or os.path.isdir(name)
    try:
        return load_policy(name, env.time_step_spec(), env.action_spec(), seed)
    except ValueError as e:
        message = f"policy {name!r} cannot be used with env {env_name!r}: {e}" if known else str(e)
        raise ConfigError(message) from e
    except Exception as e:
        raise ConfigError(f"cannot load policy {name!r}: {type(e).__name__}: {e}") from e


def starter_data_spec(env: py_environment.PyEnvironment, policy: py_policy.PyPolicy) -> Any:
    """Returns the per-step `Trajectory` spec of what `env` and `policy` produce.

    The same as `replay_service.specs.nests.collect_data_spec`, with the policy's `info_spec` as
    `policy_info` (non-empty for some saved policies).

    Args:
      env: The environment.
      policy: The policy acting in it.

    Returns:
      A `Trajectory` of `tf.TensorSpec`s, what `agent.collect_data_spec` would give.
    """
    spec = collect_data_spec(env, policy)
    return spec._replace(policy_info=tensor_spec.from_spec(policy.info_spec))


def load_data_spec(value: str) -> Any:
    """Resolves a data spec named on the command line (`replay-populate --data-spec`).

    Two forms:

    - `env:<id>`: the per-step spec of a built-in environment (`building` or a gym id such as
      `CartPole-v0`) with an empty `policy_info`: what `replay-populate --env <id>` collects
      with the `schedule` and `random` policies, and what DQN, DDPG, TD3 and SAC agents'
      `collect_data_spec` is for that environment.
    - `module:function`: `function()` of an importable module (dotted names allowed on both
      sides; the current directory is searched after `sys.path`), returning the spec, e.g. a
      function that builds the agent and returns `agent.collect_data_spec`. An attribute that
      is not callable is taken as the spec itself.

    Args:
      value: The flag's value.

    Returns:
      The spec, a TF-Agents `Trajectory` of specs.

    Raises:
      ConfigError: If the value has neither form, the environment is unknown, the module or
        attribute cannot be imported, the function fails (or calls `sys.exit`), or what it
        returns is not a `Trajectory` of specs; the message names the value.
    """
    if not isinstance(value, str) or ":" not in value:
        raise ConfigError(
            f"--data-spec {value!r} must be '{DATA_SPEC_ENV_PREFIX}<env id>' (e.g. "
            f"'{DATA_SPEC_ENV_PREFIX}{BUILDING_ENV_ID}') or 'module:function' (an importable "
            "function returning the data spec, e.g. agent.collect_data_spec)"
        )
    if value.startswith(DATA_SPEC_ENV_PREFIX):
        name = value.removeprefix(DATA_SPEC_ENV_PREFIX)
        try:
            spec = trajectory_spec(_load_env(name, 0))
        except ConfigError as e:
            raise ConfigError(f"--data-spec {value!r}: {e}") from e
    else:
        spec = _import_data_spec(value)
    try:
        return check_collect_spec(spec, f"--data-spec {value!r}")
    except SpecMismatchError as e:
        named = str(e) if repr(value) in str(e) else f"--data-spec {value!r}: {e}"
        raise ConfigError(named) from e


def _import_data_spec(value: str) -> Any:
    """`load_data_spec` for `module:function` (see there)."""
    module_name, _, attribute = value.partition(":")
    parts = attribute.split(".")
    if not all(p.isidentifier() for p in (*module_name.split("."), *parts)):
        raise ConfigError(
            f"--data-spec {value!r} must be 'module:function' with dotted Python names on both "
            f"sides, or '{DATA_SPEC_ENV_PREFIX}<env id>'"
        )
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        found: Any = importlib.import_module(module_name)
    except SystemExit as e:
        raise ConfigError(
            f"--data-spec {value!r}: importing module {module_name!r} called sys.exit({e.code!r})"
        ) from None
    except Exception as e:
        raise ConfigError(
            f"--data-spec {value!r}: cannot import module {module_name!r}: {type(e).__name__}: {e}"
        ) from e
    for part in parts:
        if not hasattr(found, part):
            raise ConfigError(
                f"--data-spec {value!r}: module {module_name!r} has no attribute {attribute!r}"
            )
        found = getattr(found, part)
    if not callable(found):
        return found
    try:
        return found()
    except SystemExit as e:  # the user's code must not end the command with its own status
        raise ConfigError(
            f"--data-spec {value!r}: {attribute}() called sys.exit({e.code!r})"
        ) from None
    except Exception as e:
        raise ConfigError(
            f"--data-spec {value!r}: {attribute}() failed: {type(e).__name__}: {e}"
        ) from e
