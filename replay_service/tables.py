"""Pure factories from `TableConfig` to Reverb tables (no server, no I/O)."""

from __future__ import annotations

from typing import Any

import reverb

from replay_service.config import SamplingConfig, TableConfig
from replay_service.sequences import stored_spec
from replay_service.specs import table_signature


def make_selector(name: str, priority_exponent: float) -> Any:
    """Returns the Reverb item selector called `name` (see `config.SAMPLERS`)."""
    selectors = {
        "uniform": reverb.selectors.Uniform,
        "fifo": reverb.selectors.Fifo,
        "lifo": reverb.selectors.Lifo,
        "max_heap": reverb.selectors.MaxHeap,
        "min_heap": reverb.selectors.MinHeap,
    }
    if name == "prioritized":
        return reverb.selectors.Prioritized(priority_exponent)
    return selectors[name]()


def make_rate_limiter(sampling: SamplingConfig) -> reverb.rate_limiters.RateLimiter:
    """Returns `MinSize`, or `SampleToInsertRatio` when `samples_per_insert` is set."""
    if sampling.samples_per_insert is None:
        return reverb.rate_limiters.MinSize(sampling.min_size_to_sample)
    return reverb.rate_limiters.SampleToInsertRatio(
        samples_per_insert=float(sampling.samples_per_insert),
        min_size_to_sample=sampling.min_size_to_sample,
        error_buffer=sampling.effective_error_buffer(),
    )


def make_table(config: TableConfig, data_spec: Any) -> reverb.Table:
    """Builds the Reverb table described by `config`, with a signature from `data_spec`.

    Args:
      config: Name, capacity, sequence length and sampling of the table.
      data_spec: Per-step data spec; the signature adds the time dimension (and the mask of
        a padded table).

    Returns:
      A `reverb.Table` ready to be handed to a `reverb.Server`.
    """
    sampling = config.sampling
    return reverb.Table(
        name=config.name,
        sampler=make_selector(sampling.sampler, sampling.priority_exponent),
        remover=make_selector(sampling.remover, sampling.priority_exponent),
        max_size=config.capacity,
        rate_limiter=make_rate_limiter(sampling),
        max_times_sampled=sampling.max_times_sampled,
        signature=table_signature(
            stored_spec(data_spec, config.pad_end_of_episode), config.sequence_length
        ),
    )


def make_replay_tables(configs: list[TableConfig], data_spec: Any) -> list[reverb.Table]:
    """Builds one table per config; names must be unique.

    Raises:
      ValueError: If two configs share a name.
    """
    names = [c.name for c in configs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"table names must be unique, got duplicates {duplicates}")
    return [make_table(c, data_spec) for c in configs]
