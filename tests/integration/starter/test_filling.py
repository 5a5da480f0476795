"""`starter.filling.populate`, on what the end-to-end tests (tests/system/cli/test_populate.py)
leave out: the progress it reports with several envs, an empty directory under the buffer's
name, and output directories it cannot write."""

from __future__ import annotations

import os

import pytest

from conftest import FAST_TIMEOUTS
from replay_service import CheckpointError, NoCheckpointError
from replay_service.starter import PopulateConfig, populate
from replay_service.starter.naming import SUMMARY_PLOT_SUFFIX


def config(tmp_path, **kwargs) -> PopulateConfig:
    kwargs.setdefault("output_dir", str(tmp_path / "buffers"))
    kwargs.setdefault("seed", 0)
    return PopulateConfig("starter", **kwargs)


@pytest.mark.heavy
def test_progress_counts_the_steps_of_every_env_up_to_the_total(tmp_path):
    reported = []
    result = populate(
        config(tmp_path, steps_per_run=3, num_runs=2, num_envs=2, capacity=100),
        progress=lambda done, total: reported.append((done, total)),
        timeouts=FAST_TIMEOUTS,
    )
    assert reported == [(done, 12) for done in range(2, 13, 2)]
    assert (result.steps, result.mode, result.items) == (12, "created", 2 * 5)
    assert sorted(os.listdir(tmp_path / "buffers")) == ["starter", "starter" + SUMMARY_PLOT_SUFFIX]


def test_appending_to_an_empty_directory_is_refused_and_leaves_it(tmp_path):
    (tmp_path / "buffers" / "starter").mkdir(parents=True)
    with pytest.raises(
        NoCheckpointError, match=r"no starter buffer '.*/buffers/starter' to append"
    ):
        populate(config(tmp_path, append=True, steps_per_run=2))
    assert os.listdir(tmp_path / "buffers") == ["starter"]
    assert os.listdir(tmp_path / "buffers" / "starter") == []


def test_an_output_dir_that_cannot_be_written_is_refused_before_anything_is_made(
    tmp_path, monkeypatch
):
    locked = tmp_path / "locked"
    locked.mkdir()
    # The machine's user may write anywhere (root): `os.access` says what a user could not.
    monkeypatch.setattr(os, "access", lambda path, mode: path != str(locked))
    for output_dir in (locked, locked / "below"):
        with pytest.raises(
            CheckpointError, match=rf"output dir '{output_dir}' is not writable \('{locked}'\)"
        ):
            populate(config(tmp_path, output_dir=str(output_dir), steps_per_run=2))
    assert os.listdir(locked) == []
