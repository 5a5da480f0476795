"""Pure factories from `TableConfig` to Reverb tables, and checks of a set of tables (no I/O)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from replay_service.config.options import SamplingConfig, TableConfig, VariableTableConfig
from replay_service.specs.layout_registry import resolve_layout
from replay_service.specs.windows import stored_spec

if TYPE_CHECKING:
    import reverb


# `MinSize` limiters bound the sample/insert difference by +-DBL_MAX; any finite bound is a
# `samples_per_insert` limiter.
_UNBOUNDED_DIFF = 1e300


def make_selector(name: str, priority_exponent: float) -> Any:
    """Returns the Reverb item selector called `name` (see `config.SAMPLERS`)."""
    import reverb

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
    import reverb

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
    import reverb

    sampling = config.sampling
    layout = resolve_layout(
        config.layout,
        stored_spec(data_spec, config.pad_end_of_episode),
        frame_stack=config.frame_stack,
        frame_axis=config.frame_axis,
    )
    return reverb.Table(
        name=config.name,
        sampler=make_selector(sampling.sampler, sampling.priority_exponent),
        remover=make_selector(sampling.remover, sampling.priority_exponent),
        max_size=config.capacity,
        rate_limiter=make_rate_limiter(sampling),
        max_times_sampled=sampling.max_times_sampled,
        signature=layout.item_signature(config.sequence_length),
    )


def draws_independently(info: Any) -> bool:
    """Whether a running table (its `reverb.TableInfo`) samples as
    `SamplingConfig.independent_draws` says: a uniform sampler, no `max_times_sampled` and a
    rate limiter that never holds a sample back for lack of inserts (`MinSize`).

    A remote client's own `TableConfig` need not be the server's (the server's config file
    decides), so streams ask the server.
    """
    limiter = info.rate_limiter_info
    return (
        info.sampler_options.WhichOneof("distribution") == "uniform"
        and info.max_times_sampled <= 0
        and limiter.min_diff <= -_UNBOUNDED_DIFF
        and limiter.max_diff >= _UNBOUNDED_DIFF
    )


def make_variable_table(config: VariableTableConfig) -> reverb.Table:
    """Builds a TF-Agents variable-container table, as `sac_reverb_server.py` does.

    Args:
      config: Name and signature of the table.

    Returns:
      A `reverb.Table` of one item (`max_size=1`, FIFO remover: a push replaces the previous
      item), sampled uniformly once it holds an item (`MinSize(1)`), never removed by sampling.
    """
    import reverb

    return reverb.Table(
        name=config.name,
        sampler=reverb.selectors.Uniform(),
        remover=reverb.selectors.Fifo(),
        rate_limiter=reverb.rate_limiters.MinSize(1),
        max_size=1,
        max_times_sampled=0,
        signature=config.spec,
    )


def make_replay_tables(configs: Sequence[TableConfig], data_spec: Any) -> list[reverb.Table]:
    """Builds one table per config; names must be unique.

    Raises:
      ValueError: If two configs share a name.
    """
    names = [c.name for c in configs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"table names must be unique, got duplicates {duplicates}")
    return [make_table(c, data_spec) for c in configs]
