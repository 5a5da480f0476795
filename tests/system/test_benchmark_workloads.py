"""scripts/bench_atari.py and scripts/bench_sizes.py (the atari and sizes workloads of
scripts/benchmark.py) run end to end on tiny sizes; no figure is timed against a bound."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "scripts"))

pytest.importorskip("ale_py")
pytest.importorskip("stable_baselines3")
pytest.importorskip("cpprb")

import bench_atari
import bench_sizes

pytestmark = pytest.mark.slow

TINY_STEPS = 200
TINY_CAPACITY = 100


def test_the_atari_run_is_cached_and_its_indices_rebuild_consecutive_stacks(tmp_path):
    path = bench_atari.cached_run("BreakoutNoFrameskip-v4", TINY_STEPS, 1, str(tmp_path))
    modified = os.stat(path).st_mtime_ns
    assert bench_atari.cached_run("BreakoutNoFrameskip-v4", TINY_STEPS, 1, str(tmp_path)) == path
    assert os.stat(path).st_mtime_ns == modified  # the second call read the cache
    data = bench_atari.load_run(path)
    frames, sidx, nidx = data["frames"], data["state_idx"], data["next_idx"]
    assert frames.shape[1:] == (84, 84) and len(data["actions"]) == TINY_STEPS
    for t in range(TINY_STEPS):
        assert bench_atari.stack_hash(frames[sidx[t]]) == data["state_hash"][t]
        assert bench_atari.stack_hash(frames[nidx[t]]) == data["next_hash"][t]
        ended = data["terminated"][t] or data["truncated"][t]
        if t + 1 < TINY_STEPS and not ended:  # within an episode, s_t+1 is the next state
            assert np.array_equal(sidx[t + 1], nidx[t])


def test_every_atari_buffer_fills_samples_and_reads_back_real_pairs(tmp_path):
    rows = bench_atari.atari_rows(
        ["BreakoutNoFrameskip-v4"],
        TINY_STEPS,
        TINY_CAPACITY,
        batches=5,
        seed=1,
        cache_dir=str(tmp_path),
        run=bench_atari.measure,  # in this process: quicker than a process per buffer
    )
    names = [bench_atari.SB3_OPT, bench_atari.SB3_FULL, bench_atari.RING]
    names += list(bench_atari.ours_variants())
    paths = [path for _, _, path, *_ in rows]
    assert len(set(paths)) == len(paths)  # the table, its medians and ratios key rows by path
    values = {(metric, path.rsplit(" ", 1)[0]): value for _, metric, path, value, _, _ in rows}
    for name in names:
        assert values[("insert", name)] > 0, name
        assert values[("sample", name)] > 0, name
    # Buffers that keep each transition's true next state read back only real pairs.
    for name in [bench_atari.SB3_FULL, bench_atari.RING, *bench_atari.ours_variants()]:
        assert values[("correct", name)] == 100.0, name
    anchors = {anchor for *_, anchor in rows if anchor is not None}
    assert anchors <= {path for _, _, path, *_ in rows}  # every ratio has its anchor row


def test_a_buffer_measured_in_its_own_process_reports_its_memory(tmp_path):
    path = bench_atari.cached_run("BreakoutNoFrameskip-v4", TINY_STEPS, 1, str(tmp_path))
    result = bench_atari.measure_in_child(bench_atari.RING, path, TINY_CAPACITY, 5)
    assert result is not None
    assert result["correct"] == 1.0
    assert result["peak_b"] >= result["steady_b"]


def test_the_sizes_workload_samples_full_buffers_of_each_size():
    rows = bench_sizes.sizes_rows([300, 1000], batches=8)
    paths = {path: (value, anchor) for _, _, path, value, _, anchor in rows}
    assert len(paths) == len(rows)  # the table, its medians and ratios key rows by path
    for size in ("300", "1k"):
        value, anchor = paths[f"{bench_sizes.OURS} {size}"]
        assert value > 0 and anchor == f"{bench_sizes.CPPRB_TORCH} {size}"
        assert paths[f"{bench_sizes.CPPRB} {size}"][0] > 0
