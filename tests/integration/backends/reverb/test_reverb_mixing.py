"""`backends.reverb.mixing`: a tf.data mix of tables draws each item's table by weight, checks
its arguments, and names the mixed tables when one runs dry; on a real Reverb server."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import reverb
import tensorflow as tf
import tree

from replay_service.backends.reverb.layout_writers import window_writer
from replay_service.backends.reverb.mixing import mixed_dataset
from replay_service.backends.reverb.tables import make_table
from replay_service.config.options import TableConfig
from replay_service.errors import ConfigError
from replay_service.specs.arrays import ArraySpec, trajectory_spec
from replay_service.specs.layout_registry import resolve_layout

SPEC = trajectory_spec(
    ArraySpec((2,), np.float32, "observation"), ArraySpec((), np.int64, "action")
)
NESTED = resolve_layout("nested", SPEC)
TABLES = (
    TableConfig(name="ones", capacity=100, sequence_length=2),
    TableConfig(name="twos", capacity=100, sequence_length=2),
    TableConfig(name="empty", capacity=100, sequence_length=2),
    TableConfig(name="long", capacity=100, sequence_length=3),
)


@pytest.fixture(scope="module")
def address() -> Iterator[str]:
    server = reverb.Server([make_table(t, SPEC) for t in TABLES], port=None)
    client = reverb.Client(f"localhost:{server.port}")
    for name, value in (("ones", 1), ("twos", 2)):
        writer = window_writer(client, [(name, 2, 1, 1.0, False)], NESTED, 5000)
        for _ in range(6):  # every step of table `name` holds `value`
            writer.append(tree.map_structure(lambda s, v=value: np.full(s.shape, v, s.dtype), SPEC))
        writer.end_episode(timeout_ms=5000)
    yield f"localhost:{server.port}"
    server.stop()


def _mix(address: str, weights: dict, batch_size: int = 8, **kwargs: object) -> tf.data.Dataset:
    return mixed_dataset(
        address,
        TABLES,
        weights,
        SPEC,
        batch_size,
        sample_timeout=kwargs.pop("sample_timeout", 5.0),
        layout=NESTED,
        **kwargs,
    )


@pytest.mark.parametrize(
    ("weights", "batch_size", "seed", "message"),
    [
        ({"ones": 1.0}, 0, None, "batch_size"),
        ({"ones": 1.0}, 4, 1.5, "seed must be an integer or None, got 1.5"),
        ({"ones": 1.0}, 4, True, "seed must be an integer or None, got True"),
        ({}, 4, None, "weights must be a non-empty mapping"),
        ({"ones": -1.0}, 4, None, "weight of table 'ones' must be a finite number >= 0, got -1.0"),
        ({"ones": 0.0}, 4, None, "positive, finite sum"),
        ({"ones": 1.0, "long": 1.0}, 4, None, "one sequence_length"),
        ({"nope": 1.0}, 4, None, "nope"),
    ],
)
def test_bad_arguments_are_refused_naming_the_value(
    address: str, weights: dict, batch_size: int, seed: object, message: str
) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        _mix(address, weights, batch_size, seed=seed)


@pytest.mark.heavy
def test_each_item_comes_from_a_table_drawn_by_weight(address: str) -> None:
    steps = []
    for data, info in _mix(address, {"ones": 1.0, "twos": 3.0}, batch_size=50, seed=7).take(4):
        assert data.observation.shape == (50, 2, 2)
        assert info.key.shape == (50, 2)
        steps.append(data.step_type.numpy())
    steps = np.concatenate(steps)
    # Whole items of one table each: both steps hold the table's value.
    np.testing.assert_array_equal(steps[:, 0], steps[:, 1])
    assert set(steps[:, 0].tolist()) == {1, 2}
    share_of_twos = float(np.mean(steps[:, 0] == 2))
    assert 0.6 < share_of_twos < 0.9  # 0.75 expected, 200 draws


@pytest.mark.heavy
def test_a_table_of_weight_zero_is_never_drawn(address: str) -> None:
    data, _ = next(iter(_mix(address, {"ones": 0.0, "twos": 1.0}, batch_size=20)))
    assert set(data.step_type.numpy().ravel().tolist()) == {2}


@pytest.mark.heavy
def test_an_empty_table_ends_the_mix_with_an_error_naming_the_tables(address: str) -> None:
    dataset = _mix(address, {"ones": 1.0, "empty": 1.0}, batch_size=4, sample_timeout=0.3)
    with pytest.raises(
        tf.errors.InvalidArgumentError,
        match=r"mixed tables \[..?ones..?, ..?empty..?\] within 0.3 s",
    ):
        for _ in dataset.take(10):
            pass
