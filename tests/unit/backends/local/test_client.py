"""`client.LocalClient`: the Reverb client calls collectors make, on local tables, and the
windows its `LocalWindowWriter` cuts."""

from __future__ import annotations

import numpy as np
import pytest

from replay_service import ConfigError, SpecMismatchError, TableConfig
from replay_service.backends.local.client import LOCAL_ADDRESS, LocalClient
from replay_service.backends.local.table import LocalTable
from replay_service.collect.writing import checked_step_type

pytestmark = pytest.mark.local

FIELDS = [{"path": "x", "dtype": "float32", "shape": [2]}]


def client_of(length: int = 3, capacity: int = 100) -> tuple[LocalClient, LocalTable]:
    table = LocalTable(TableConfig("t", capacity, length), FIELDS)
    return LocalClient({"t": table}), table


def steps_of(table: LocalTable) -> list[list[float]]:
    """The first value of every step of every item, oldest item first."""
    data, _, _ = table.items()
    return data[0][:, :, 0].tolist()


def test_an_unpadded_writer_inserts_a_window_every_stride_once_it_is_long_enough():
    client, table = client_of(length=3)
    writer = client.window_writer([("t", 3, 2, 1.0, False)])
    for step in range(7):
        writer.append([np.full(2, step, np.float32)])
    assert steps_of(table) == [[0, 1, 2], [2, 3, 4], [4, 5, 6]]


def test_a_padded_writer_starts_windows_at_multiples_of_the_stride():
    client, table = client_of(length=3)
    writer = client.window_writer([("t", 3, 3, 1.0, True)])
    for step in range(7):
        writer.append([np.full(2, step, np.float32)])
    assert steps_of(table) == [[0, 1, 2], [3, 4, 5]]


def test_end_episode_starts_new_windows():
    client, table = client_of(length=2)
    writer = client.window_writer([("t", 2, 1, 1.0, False)])
    writer.append([np.zeros(2, np.float32)])
    writer.end_episode()
    writer.append([np.ones(2, np.float32)])
    assert table.size == 0
    writer.append([np.full(2, 2, np.float32)])
    assert steps_of(table) == [[1, 2]]


def test_a_step_of_the_wrong_shape_or_field_count_is_refused_naming_the_field():
    client, table = client_of()
    writer = client.window_writer([("t", 3, 1, 1.0, False)])
    with pytest.raises(SpecMismatchError, match=r"field 'x': expected shape \[2\], got \[3\]"):
        writer.append([np.zeros(3, np.float32)])
    with pytest.raises(SpecMismatchError, match="a step has 2 fields, the table stores 1"):
        writer.append([np.zeros(2, np.float32), 1.0])
    with pytest.raises(SpecMismatchError, match="field 'x'"):
        writer.append([["a", "b"]])
    assert table.size == 0


def test_a_writer_of_another_length_or_an_unknown_table_is_refused():
    client, _ = client_of(length=3)
    with pytest.raises(ConfigError, match="table 't' holds items of 3 steps, a writer asked for 2"):
        client.window_writer([("t", 2, 1, 1.0, False)])
    with pytest.raises(ConfigError, match=r"no table 'u'; its tables are \['t'\]"):
        client.window_writer([("u", 3, 1, 1.0, False)])


def test_server_info_reports_each_table_as_reverb_does():
    client, table = client_of(length=2)
    writer = client.window_writer([("t", 2, 1, 1.0, False)])
    for step in range(4):
        writer.append([np.full(2, step, np.float32)])
    info = client.server_info()["t"]
    assert client.server_address == LOCAL_ADDRESS
    assert (info.name, info.max_size, info.current_size) == ("t", 100, 3)
    assert info.rate_limiter_info.insert_stats.completed == table.inserts == 3


def test_priorities_are_checked_whole_and_deletes_are_refused():
    client, table = client_of(length=2)
    writer = client.window_writer([("t", 2, 1, 1.0, False)])
    for step in range(3):
        writer.append([np.full(2, step, np.float32)])
    _, priorities, _ = table.items()
    with pytest.raises(ConfigError, match="deleting items by key is not supported"):
        client.mutate_priorities("t", deletes=[1])
    with pytest.raises(ConfigError):
        client.mutate_priorities("t", {0: float("nan")})
    np.testing.assert_array_equal(table.items()[1], priorities)
    client.reset("t")
    assert table.size == 0


@pytest.mark.parametrize("bad", ["shape", "dtype", "count"])
@pytest.mark.parametrize("when", ["first", "later"])
def test_checked_steps_are_checked_whole_until_one_of_their_kind_passed(bad, when):
    """A collector's cast steps (`CheckedStep`): the first of a kind is checked as a list is,
    with the same errors, and nothing written; once one passed, the kind's others are taken
    as they are (a step of another kind is checked whole again)."""
    wrong = {
        "shape": [np.zeros(3, np.float32)],
        "dtype": [np.array(["a", "b"])],
        "count": [np.zeros(2, np.float32), np.zeros(2, np.float32)],
    }[bad]
    checked = checked_step_type()
    plain_client, _ = client_of(length=2)
    with pytest.raises(SpecMismatchError) as plain:
        plain_client.window_writer([("t", 2, 1, 1.0, False)]).append(list(wrong))
    client, table = client_of(length=2)
    writer = client.window_writer([("t", 2, 1, 1.0, False)])
    if when == "later":
        writer.append(checked([np.zeros(2, np.float32)]))
        writer.append(checked([np.ones(2, np.float32)]))
        assert writer._checked is checked
        writer.append(checked([np.full(2, 2, np.float32)]))
        before = steps_of(table)
        assert before == [[0, 1], [1, 2]]
        other = checked_step_type()  # another kind: checked whole
        with pytest.raises(SpecMismatchError) as raised:
            writer.append(other(wrong))
        assert str(raised.value) == str(plain.value)
        assert steps_of(table) == before
    else:
        with pytest.raises(SpecMismatchError) as raised:
            writer.append(checked(wrong))
        assert str(raised.value) == str(plain.value)
        assert writer._checked is None and table.size == 0
        writer.append(checked([np.zeros(2, np.float32)]))
        writer.append(checked([np.ones(2, np.float32)]))
        assert steps_of(table) == [[0, 1]]
