"""`starter.sources`: the environments and policies of a populate run, with their seeds and
errors, and the data specs named on the command line (`--data-spec`)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import tensorflow as tf
from tf_agents.specs import array_spec

from replay_service.errors import ConfigError
from replay_service.starter import sources
from replay_service.starter.envs import BuildingEnv
from replay_service.starter.policies import load_policy
from replay_service.starter.sources import (
    load_data_spec,
    make_envs_and_policies,
    starter_data_spec,
)

SPEC_MODULE = """
import sys
import tensorflow as tf
from replay_service.starter.sources import load_data_spec

SPEC = load_data_spec("env:building")

class Agents:
    @staticmethod
    def spec():
        return SPEC

def leaves():
    sys.exit(3)
"""


@pytest.fixture()
def spec_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A module in the current directory (not on `sys.path`), found by `load_data_spec`."""
    name = f"starter_spec_{tmp_path.name}"
    (tmp_path / f"{name}.py").write_text(SPEC_MODULE)
    (tmp_path / f"{name}_exits.py").write_text("import sys\nsys.exit('no agent')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    yield name
    for module in (name, f"{name}_exits"):
        sys.modules.pop(module, None)


def test_env_i_and_its_policy_get_seed_plus_i(monkeypatch):
    made = []

    def record_env(name, seed):
        made.append(("env", name, seed))
        return BuildingEnv(seed=seed)

    def record_policy(name, time_step_spec, action_spec, seed):
        made.append(("policy", name, seed))
        return load_policy(name, time_step_spec, action_spec, seed)

    monkeypatch.setattr(sources, "load_env", record_env)
    monkeypatch.setattr(sources, "load_policy", record_policy)
    envs, policies = make_envs_and_policies("building", "random", 3, seed=10)
    assert len(envs) == len(policies) == 3
    assert len({id(p) for p in policies}) == 3
    assert made == [
        *(("env", "building", s) for s in (10, 11, 12)),
        *(("policy", "random", s) for s in (10, 11, 12)),
    ]


def test_a_saved_policy_is_loaded_once_and_shared(monkeypatch, tmp_path):
    loads = []
    monkeypatch.setattr(sources, "load_policy", lambda name, *args: loads.append(name) or object())
    envs, policies = make_envs_and_policies("building", str(tmp_path), 2, seed=0)
    assert loads == [str(tmp_path)]
    assert policies[0] is policies[1] and len(envs) == 2


def test_env_and_policy_errors_are_config_errors_naming_them(monkeypatch, tmp_path):
    with pytest.raises(ConfigError, match=r"unknown environment id 'Nope-v0'"):
        make_envs_and_policies("Nope-v0", "random", 1, seed=0)
    with pytest.raises(ConfigError, match=r"^unknown policy 'greedy'"):
        make_envs_and_policies("building", "greedy", 1, seed=0)
    with pytest.raises(
        ConfigError,
        match=rf"policy '{tmp_path}' cannot be used with env 'building': .*is not a saved policy",
    ):
        make_envs_and_policies("building", str(tmp_path), 1, seed=0)

    def broken(name, seed):
        raise RuntimeError("simulator crashed")

    monkeypatch.setattr(sources, "load_env", broken)
    with pytest.raises(
        ConfigError, match="cannot create environment 'building': RuntimeError: simulator crashed"
    ):
        make_envs_and_policies("building", "schedule", 1, seed=0)


def test_the_starter_spec_takes_the_policys_info_spec():
    env = BuildingEnv(seed=0)
    policy = load_policy("schedule", env.time_step_spec(), env.action_spec())
    spec = starter_data_spec(env, policy)
    assert spec.policy_info == ()
    assert spec.observation.shape == env.observation_spec().shape

    with_info = types.SimpleNamespace(
        info_spec={"value": array_spec.ArraySpec((), "float32")},
        time_step_spec=policy.time_step_spec,
        action_spec=policy.action_spec,
        policy_state_spec=(),
    )
    spec = starter_data_spec(env, with_info)
    assert spec.policy_info == {"value": tf.TensorSpec((), tf.float32)}


def test_module_attributes_are_found_from_the_current_directory(spec_module):
    expected = load_data_spec("env:building")
    for value in (f"{spec_module}:SPEC", f"{spec_module}:Agents.spec"):
        assert tf.nest.flatten(load_data_spec(value)) == tf.nest.flatten(expected)


def test_sys_exit_in_the_users_code_is_a_config_error_naming_it(spec_module):
    with pytest.raises(
        ConfigError, match=r"--data-spec '.*:leaves': leaves\(\) called sys.exit\(3\)"
    ):
        load_data_spec(f"{spec_module}:leaves")
    with pytest.raises(
        ConfigError,
        match=rf"importing module '{spec_module}_exits' called sys.exit\('no agent'\)",
    ):
        load_data_spec(f"{spec_module}_exits:spec")


@pytest.mark.parametrize("value", [None, 3, "", "env", "module.only"])
def test_values_without_a_colon_are_refused_naming_both_forms(value):
    with pytest.raises(
        ConfigError, match=r"must be 'env:<env id>' .* or 'module:function'"
    ) as raised:
        load_data_spec(value)
    assert repr(value) in str(raised.value)


@pytest.mark.parametrize("value", ["mod:", ":spec", "mod:a..b", "1mod:spec", "mod:a b"])
def test_names_that_are_not_dotted_python_names_are_refused(value):
    with pytest.raises(ConfigError, match="with dotted Python names on both sides") as raised:
        load_data_spec(value)
    assert repr(value) in str(raised.value)
