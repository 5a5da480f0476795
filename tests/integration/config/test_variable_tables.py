"""TF-Agents variable-container tables beside the replay tables (TF-Agents' distributed pattern).

`replay-server` with configs/tf_agents_sac.toml hosts both tables of TF-Agents'
`sac_reverb_server.py`: TF-Agents' own `ReverbVariableContainer`, `ReverbAddTrajectoryObserver`
and `ReverbReplayBuffer` talk to it, and the variables survive a checkpoint and restore.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import reverb
import tensorflow as tf
from tf_agents.agents.ddpg import critic_network
from tf_agents.agents.sac import sac_agent, tanh_normal_projection_network
from tf_agents.experimental.distributed import reverb_variable_container
from tf_agents.networks import actor_distribution_network
from tf_agents.replay_buffers import reverb_replay_buffer, reverb_utils
from tf_agents.specs import tensor_spec
from tf_agents.trajectories import time_step as ts
from tf_agents.trajectories import trajectory

from conftest import CONFIGS, REPO
from replay_service.backends.reverb.server import CheckpointedServer
from replay_service.config.files import load_config
from replay_service.config.options import TableConfig, VariableTableConfig
from replay_service.errors import ConfigError, SpecMismatchError
from replay_service.monitoring.report import format_status, server_status
from replay_service.monitoring.stats import server_stats
from replay_service.specs.nests import describe_spec, spec_from_description, variable_container_spec
from replay_service.starter.envs import load_env
from replay_service.storage.metadata import StoreMetadata
from replay_service.storage.store import CheckpointStore

SAC_CONFIG = os.path.join(CONFIGS, "tf_agents_sac.toml")
EXPERIENCE = reverb_replay_buffer.DEFAULT_TABLE  # "experience"
VARIABLES = reverb_variable_container.DEFAULT_TABLE  # "variables"


def pendulum_sac_agent() -> sac_agent.SacAgent:
    """A SAC agent built as TF-Agents' sac_train.py builds it, for Pendulum-v1's specs."""
    observation = tensor_spec.BoundedTensorSpec([3], tf.float32, -8.0, 8.0, "observation")
    action = tensor_spec.BoundedTensorSpec([1], tf.float32, -2.0, 2.0, "action")
    critic_net = critic_network.CriticNetwork(
        (observation, action),
        observation_fc_layer_params=None,
        action_fc_layer_params=None,
        joint_fc_layer_params=(256, 256),
        kernel_initializer="glorot_uniform",
        last_kernel_initializer="glorot_uniform",
    )
    actor_net = actor_distribution_network.ActorDistributionNetwork(
        observation,
        action,
        fc_layer_params=(256, 256),
        continuous_projection_net=tanh_normal_projection_network.TanhNormalProjectionNetwork,
    )
    return sac_agent.SacAgent(
        ts.time_step_spec(observation),
        action,
        actor_network=actor_net,
        critic_network=critic_net,
        actor_optimizer=tf.keras.optimizers.Adam(),
        critic_optimizer=tf.keras.optimizers.Adam(),
        alpha_optimizer=tf.keras.optimizers.Adam(),
        train_step_counter=tf.Variable(0, dtype=tf.int64),
    )


def container_variables(agent: sac_agent.SacAgent) -> dict:
    """What sac_train.py and sac_collect.py push and update."""
    return {
        reverb_variable_container.POLICY_KEY: agent.collect_policy.variables(),
        reverb_variable_container.TRAIN_STEP_KEY: agent.train_step_counter,
    }


def assert_variables_equal(a: dict, b: dict) -> None:
    for x, y in zip(tf.nest.flatten(a), tf.nest.flatten(b), strict=True):
        np.testing.assert_array_equal(x.numpy(), y.numpy())


def small_variables(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "policy_variables": (
            tf.Variable(rng.normal(size=(4, 3)).astype(np.float32)),
            tf.Variable(rng.normal(size=(3,)).astype(np.float32)),
        ),
        "train_step": tf.Variable(seed, dtype=tf.int64),
    }


def write_toml(tmp_path, text: str) -> str:
    path = tmp_path / "vars.toml"
    path.write_text(text + '[data_spec]\nenv = "CartPole-v0"\n')
    return str(path)


# ------------------------------------------------------------------------------ configuration


def test_sac_config_matches_tf_agents_sac_train_variables_and_collect_spec():
    config = load_config(SAC_CONFIG)
    assert config.table.name == EXPERIENCE
    assert [v.name for v in config.variable_tables] == [VARIABLES]
    agent = pendulum_sac_agent()
    expected = variable_container_spec(container_variables(agent))
    spec = config.variable_tables[0].spec
    assert describe_spec(spec) == describe_spec(expected)
    tf.nest.assert_same_structure(spec, expected)
    assert describe_spec(config.data_spec.build(load_env)) == describe_spec(agent.collect_data_spec)


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        (
            '[[variable_tables]]\nspec.w = { dtype = "float32" }\n',
            "variable_tables[0].spec.w must be { dtype = ..., shape = [...] }, got {'dtype'",
        ),
        (
            '[[variable_tables]]\nspec.w = { dtype = "floaty", shape = [2] }\n',
            "variable_tables[0].spec.w.dtype must be a TensorFlow dtype name, got 'floaty'",
        ),
        (
            '[[variable_tables]]\nspec.w = { dtype = "float32", shape = [-1] }\n',
            "variable_tables[0].spec.w.shape must be a list of integers in 0..2147483647, got [-1]",
        ),
        (
            "[[variable_tables]]\nspec.w = []\n",
            "variable_tables[0].spec.w must be { dtype = ..., shape = [...] }, a table or an array "
            "of them, got []",
        ),
        (
            '[[variable_tables]]\nspec.w = [{ dtype = "int64", shape = [] }, 3]\n',
            "variable_tables[0].spec.w[1] must be",
        ),
        ('[[variable_tables]]\nname = "variables"\n', "variable_tables[0] needs a spec"),
        (
            '[[variable_tables]]\nsampler = "fifo"\nspec.w = { dtype = "int64", shape = [] }\n',
            "unknown key variable_tables[0].'sampler'",
        ),
        (
            '[[variable_tables]]\nname = "a b"\nspec.w = { dtype = "int64", shape = [] }\n',
            "table name must be a non-empty string of [A-Za-z0-9_.-], got 'a b'",
        ),
        ("variable_tables = 3\n", "variable_tables must be an array of tables"),
    ],
)
def test_bad_variable_tables_name_the_key_and_value(tmp_path, toml, message):
    path = write_toml(tmp_path, toml)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert message in str(info.value)
    assert path in str(info.value)


def test_a_variable_table_name_must_not_clash_with_another_table(tmp_path):
    leaf = 'spec.w = { dtype = "int64", shape = [] }\n'
    clash = f'[table]\nname = "experience"\n[[variable_tables]]\nname = "experience"\n{leaf}'
    with pytest.raises(ConfigError, match="'experience' is already the name of a replay table"):
        load_config(write_toml(tmp_path, clash))
    twice = f"[[variable_tables]]\n{leaf}[[variable_tables]]\n{leaf}"
    with pytest.raises(ConfigError, match="'variables' is already the name of a variable table"):
        load_config(write_toml(tmp_path, twice))


def test_variable_table_config_from_python():
    variables = small_variables(0)
    config = VariableTableConfig(spec=variable_container_spec(variables))
    assert config.name == VARIABLES
    assert config.spec["policy_variables"][0] == tf.TensorSpec([4, 3], tf.float32)
    with pytest.raises(
        ConfigError, match="table 'variables': spec: .*'policy_variables/0' is not a TensorSpec"
    ):
        VariableTableConfig(spec=variables)  # variables, not their specs
    with pytest.raises(SpecMismatchError, match="variable 'b/0' has no shape and dtype: str"):
        variable_container_spec({"a": variables["train_step"], "b": ["x"]})
    with pytest.raises(ConfigError, match="is already the name of a replay table"):
        CheckpointedServer(
            [TableConfig(name=VARIABLES)],
            small_data_spec(),
            CheckpointStore("unused"),
            variable_tables=[config],
        )


def small_data_spec():
    return spec_from_description(
        [
            {"path": "observation", "dtype": "float32", "shape": [2]},
            {"path": "action", "dtype": "int64", "shape": []},
        ]
    )


# ------------------------------------------------------------------------ checkpoint metadata


def test_store_metadata_records_variable_specs_and_reads_old_files():
    variable = VariableTableConfig(spec=variable_container_spec(small_variables(0)))
    table = TableConfig(name=EXPERIENCE)
    metadata = StoreMetadata.for_tables(table, small_data_spec(), (), [variable])
    data = json.loads(json.dumps(metadata.to_json()))
    assert data["variable_tables"][0]["name"] == VARIABLES
    assert {"path": "train_step", "dtype": "int64", "shape": []} in data["variable_tables"][0][
        "spec"
    ]
    assert StoreMetadata.from_json(data, "x") == metadata
    del data["variable_tables"]  # written before variable tables existed
    old = StoreMetadata.from_json(data, "x")
    assert old.variable_tables == ()
    assert old.differences(StoreMetadata.for_tables(table, small_data_spec())) == []


# --------------------------------------------------------- CheckpointedServer: checkpoint, restore


def test_checkpoint_and_restore_bring_the_variables_back(tmp_path):
    variables = small_variables(1)
    variable_table = VariableTableConfig(spec=variable_container_spec(variables))
    tables = [TableConfig(name=EXPERIENCE, capacity=100)]
    store = CheckpointStore(tmp_path / "ckpt")
    server = CheckpointedServer.create(
        tables, small_data_spec(), store, variable_tables=[variable_table]
    )
    try:
        container = reverb_variable_container.ReverbVariableContainer(
            f"localhost:{server.port}", table_names=[VARIABLES]
        )
        container.push(variables)
        checkpoint = server.checkpoint()
    finally:
        server.stop()
    assert checkpoint.num_items == 1
    assert [t.name for t in store.read_metadata().variable_tables] == [VARIABLES]

    restored = CheckpointedServer.restore(
        tables, small_data_spec(), store, variable_tables=[variable_table]
    )
    try:
        info = restored.client.server_info(timeout=10)[VARIABLES]
        assert (info.max_size, info.current_size, info.max_times_sampled) == (1, 1, 0)
        container = reverb_variable_container.ReverbVariableContainer(
            f"localhost:{restored.port}", table_names=[VARIABLES]
        )
        pulled = small_variables(2)
        container.update(pulled)
        assert_variables_equal(pulled, variables)
    finally:
        restored.stop()

    other = {**variables, "policy_variables": (tf.Variable(np.zeros((5, 3), np.float32)),) * 2}
    with pytest.raises(SpecMismatchError) as info:
        CheckpointedServer.restore(
            tables,
            small_data_spec(),
            store,
            variable_tables=[VariableTableConfig(spec=variable_container_spec(other))],
        )
    message = str(info.value)
    assert "variable table 'variables' spec field 'policy_variables/0': expected float32[5, 3]" in (
        message
    )
    assert "found float32[4, 3]" in message
    with pytest.raises(SpecMismatchError, match=r"variable_tables: requested \[\], stored"):
        CheckpointedServer.restore(tables, small_data_spec(), store)


# ------------------------------------------------------ replay-server with TF-Agents' own clients


def sac_trajectories(episodes: int, length: int, seed: int) -> list[list[trajectory.Trajectory]]:
    """Pendulum-like steps whose observation starts with (episode, step), to find them again."""
    rng = np.random.default_rng(seed)
    result = []
    for e in range(episodes):
        steps = []
        for t in range(length):
            step_type = ts.StepType.FIRST if t == 0 else ts.StepType.MID
            next_type = ts.StepType.MID if t < length - 2 else ts.StepType.LAST
            if t == length - 1:
                step_type, next_type = ts.StepType.LAST, ts.StepType.FIRST
            steps.append(
                trajectory.Trajectory(
                    step_type=np.asarray(step_type, np.int32),
                    observation=np.asarray([e, t, rng.normal()], np.float32),
                    action=rng.uniform(-2, 2, size=(1,)).astype(np.float32),
                    policy_info=(),
                    next_step_type=np.asarray(next_type, np.int32),
                    reward=np.asarray(rng.normal(), np.float32),
                    discount=np.asarray(1.0 if t < length - 1 else 0.0, np.float32),
                )
            )
        result.append(steps)
    return result


@pytest.mark.heavy
def test_tf_agents_distributed_clients_against_replay_server(start_server, tmp_path):
    server, address = start_server("--checkpoint_interval_s=0", config=SAC_CONFIG)

    # The learner pushes its policy variables; a collector updates its own from the server.
    learner, collector = pendulum_sac_agent(), pendulum_sac_agent()
    learner.train_step_counter.assign(42)
    pushed, pulled = container_variables(learner), container_variables(collector)
    assert not np.array_equal(pushed["policy_variables"][0], pulled["policy_variables"][0])
    container = reverb_variable_container.ReverbVariableContainer(address, table_names=[VARIABLES])
    container.push(pushed)
    container.update(pulled)
    assert_variables_equal(pulled, pushed)

    # The collector writes 2-step windows as sac_collect.py does; the learner samples them.
    episodes = sac_trajectories(episodes=4, length=6, seed=0)
    observer = reverb_utils.ReverbAddTrajectoryObserver(
        reverb.Client(address), EXPERIENCE, sequence_length=2, stride_length=1
    )
    for episode in episodes:
        for step in episode:
            observer(step)
    observer.close()
    infos = reverb.Client(address).server_info(timeout=10)
    assert infos[EXPERIENCE].current_size == 4 * 5
    replay = reverb_replay_buffer.ReverbReplayBuffer(
        learner.collect_data_spec, table_name=EXPERIENCE, sequence_length=2, server_address=address
    )
    dataset = replay.as_dataset(sample_batch_size=8, num_steps=2)
    for batch, _ in dataset.take(3):
        assert batch.observation.shape == (8, 2, 3)
        for i in range(8):
            window = tf.nest.map_structure(lambda x, i=i: x[i].numpy(), batch)
            e, t = int(window.observation[0, 0]), int(window.observation[0, 1])
            for k in range(2):
                written = episodes[e][t + k]
                got = tf.nest.map_structure(lambda x, k=k: x[k], window)
                tf.nest.map_structure(np.testing.assert_array_equal, got, written)

    # Status and stats list both tables.
    assert {t.name for t in server_status(address, 10.0)} == {EXPERIENCE, VARIABLES}
    assert "table variables: 1/1 items" in format_status(
        address, server_status(address, 10.0), None
    )
    stats = server_stats(address, 10.0, span_s=0.1)
    assert stats.table(VARIABLES).size == 1 and stats.table(EXPERIENCE).size == 20
    status = subprocess.run(
        [
            sys.executable,
            "-m",
            "replay_service.cli.serve",
            "status",
            f"--address={address}",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert status.returncode == 0, status.stderr

    # SIGTERM checkpoints both tables; a restart restores the variables and the experience.
    code, output = server.finish(signal.SIGTERM)
    assert code == 0, output
    restarted, address = start_server("--restore", config=SAC_CONFIG)
    again = container_variables(pendulum_sac_agent())
    reverb_variable_container.ReverbVariableContainer(address, table_names=[VARIABLES]).update(
        again
    )
    assert_variables_equal(again, pushed)
    assert int(again["train_step"].numpy()) == 42
    assert reverb.Client(address).server_info(timeout=10)[EXPERIENCE].current_size == 20
    code, output = restarted.finish(signal.SIGTERM)
    assert code == 0, output
