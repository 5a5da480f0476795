"""Frozen configuration objects, validated on construction.

`TableConfig` describes one Reverb table (name, capacity, sequence length and how it is sampled);
`SamplingConfig` is the sampler / remover / rate-limiter choice; `Timeouts` bounds every blocking
call. Each `__post_init__` rejects a bad value with a message naming the field and the value.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os

from replay_service.errors import ConfigError, SpecMismatchError

DEFAULT_TABLE_NAME = "uniform_table"
# TF-Agents' name of the variable-container table (`reverb_variable_container.DEFAULT_TABLE`).
DEFAULT_VARIABLE_TABLE_NAME = "variables"
# How many verified checkpoints a checkpoint directory keeps unless told otherwise.
DEFAULT_KEEP = 3
# Reverb keeps capacities, sizes, lengths and counts in 32-bit integers (its Table, RateLimiter
# and StructuredWriter constructors refuse anything larger with a bare TypeError).
INT32_MAX = 2**31 - 1
# The longest finite timeout: Reverb takes timeouts in milliseconds, in 32-bit integers.
MAX_TIMEOUT_S = INT32_MAX / 1000
SAMPLERS = ("uniform", "prioritized", "fifo", "lifo", "max_heap", "min_heap")
REMOVERS = ("fifo", "lifo", "uniform", "min_heap", "max_heap")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def require_positive_int(name: str, value: object, maximum: int | None = INT32_MAX) -> int:
    """Checks a size or count: an integer (not a bool) >= 1 and <= `maximum`.

    Args:
      name: The option, as the user spells it (named in the error).
      value: The candidate value.
      maximum: Largest value allowed (by default Reverb's int32); None: no upper bound.

    Returns:
      The value as an `int`.

    Raises:
      ConfigError: "<name> must be a positive integer, got <value>", or that it is above
        `maximum`.
    """
    return require_int(name, value, 1, maximum, what="a positive integer")


def require_int(
    name: str, value: object, minimum: int, maximum: int | None = INT32_MAX, *, what: str = ""
) -> int:
    """Checks an integer option: an integer (`int` or a numpy integer, not a bool) in
    `minimum..maximum`.

    Args:
      name: The option, as the user spells it (named in the error).
      value: The candidate value.
      minimum: Smallest value allowed.
      maximum: Largest value allowed; by default the largest that Reverb stores (int32);
        None: no upper bound.
      what: How the error describes a valid value; default "an integer >= {minimum}".

    Returns:
      The value as an `int`.

    Raises:
      ConfigError: If the value is not an integer, is a bool, or is out of range; the message
        names the option, the value and the allowed range.
    """
    what = what or f"an integer >= {minimum}"
    # numbers.Integral: Python's int and numpy's integer scalars (np.int64(4) from an array).
    _require(
        isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= minimum,
        f"{name} must be {what}, got {value!r}",
    )
    value = int(value)  # type: ignore[call-overload]
    if maximum is None:
        return value
    _require(
        value <= maximum,  # type: ignore[operator]
        f"{name} must be an integer in {minimum}..{maximum}"
        + (" (Reverb stores it in 32 bits)" if maximum == INT32_MAX else "")
        + f", got {value!r}",
    )
    return value


def require_seed(name: str, value: object) -> int | None:
    """Checks a random seed: None, or an integer >= 0 (what `numpy.random.default_rng` takes).

    Args:
      name: The option, as the user spells it (named in the error).
      value: The candidate value.

    Returns:
      The value, unchanged.

    Raises:
      ConfigError: If the value is not None or a non-negative integer (a bool is refused).
    """
    _require(
        value is None
        or (isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0),
        f"{name} must be a non-negative integer or None, got {value!r}",
    )
    return value  # type: ignore[return-value]


def require_number(
    name: str, value: object, minimum: float, *, positive: bool = False, maximum: float = math.inf
) -> float:
    """Checks a float option: a finite `int` or `float` (not a bool, NaN or infinity).

    Args:
      name: The option, as the user spells it (named in the error).
      value: The candidate value.
      minimum: Smallest value allowed.
      positive: Whether `minimum` itself is excluded.
      maximum: Largest value allowed.

    Returns:
      The value, unchanged.

    Raises:
      ConfigError: If the value is not a finite real number (numpy scalars included) in range;
        the message names the option and the value.
    """
    bound = f"> {minimum}" if positive else f">= {minimum}"
    if maximum != math.inf:
        bound += f" and <= {maximum}"
    ok = (
        isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (value > minimum if positive else value >= minimum)
        and value <= maximum
    )
    _require(ok, f"{name} must be a finite number {bound}, got {value!r}")
    return value  # type: ignore[return-value]


def _require_timeout(name: str, value: float | None) -> None:
    ok = value is None or (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and 0 < value <= MAX_TIMEOUT_S
    )
    _require(
        ok,
        f"{name} must be a positive, finite number of seconds (at most {MAX_TIMEOUT_S:g}) or "
        f"None (wait forever), got {value!r}",
    )


def validate_manager_options(
    *, port: object, stride_length: object, keep_checkpoints: object
) -> None:
    """Checks the integer arguments of `ReplayBufferManager` that are not part of a table.

    Args:
      port: None (pick a free port) or a TCP port.
      stride_length: Steps between items written by observers and writers.
      keep_checkpoints: Complete checkpoints retained.

    Raises:
      ConfigError: Naming the argument and its value if one is not an integer in range (bools
        are refused).
    """
    if port is not None:
        require_int("port", port, 1, 65535, what="an integer in 1..65535")
    require_int("stride_length", stride_length, 1)
    require_int("keep_checkpoints", keep_checkpoints, 1)


MAX_TABLE_NAME_BYTES = 255
"""Longest table name, in UTF-8 bytes: a file name's limit (the local backend's memory-mapped
storage keeps each table in a directory of that name)."""


def validate_table_name(name: object) -> str:
    """Checks a table name: a plain file name of letters, digits, '_', '-' or '.'.

    The local backend's memory-mapped storage keeps each table's files in
    `<checkpoint_dir>/.memmap/<name>`, so a name must be a file name of its own: "." and ".."
    (this directory, its parent) are refused, and so is a name longer than a file name may be.

    Args:
      name: The candidate name.

    Returns:
      The name, unchanged.

    Raises:
      ConfigError: If the name is empty, not a string, has other characters, is "." or "..",
        or is longer than `MAX_TABLE_NAME_BYTES` bytes; the message names it.
    """
    ok = isinstance(name, str) and name != "" and all(c.isalnum() or c in "_-." for c in name)
    _require(ok, f"table name must be a non-empty string of [A-Za-z0-9_.-], got {name!r}")
    _require(
        name not in (".", ".."),
        f"table name must not be {name!r}: a table name must be a plain file name, and "
        f"{name!r} names a directory (the local backend keeps each table's memory-mapped "
        "files in a directory of its name)",
    )
    size = len(name.encode())  # type: ignore[union-attr]
    _require(
        size <= MAX_TABLE_NAME_BYTES,
        f"table name must be at most {MAX_TABLE_NAME_BYTES} bytes long (a file name's limit), "
        f"got {size} bytes: {name[:40]!r}...",  # type: ignore[index]
    )
    return name  # type: ignore[return-value]


def validate_path(path: str | os.PathLike[str], what: str) -> str:
    """Checks that a directory path given by the user can name a file at all.

    A NUL character cannot be in any path (the operating system refuses it, and Python's
    `os` calls raise a bare `ValueError: embedded null byte` that names nothing).

    Args:
      path: The path as given.
      what: What the path is, for the message (e.g. "checkpoint_dir").

    Returns:
      The path as a `str` (`os.fspath`).

    Raises:
      ConfigError: If the path is not a `str`, `bytes` or `os.PathLike`, or holds a NUL
        character, naming it and `what`.
    """
    try:
        text = os.fspath(path)
    except TypeError:
        raise ConfigError(
            f"{what} must be a path (a str or os.PathLike), got {path!r} ({type(path).__name__})"
        ) from None
    if isinstance(text, bytes):
        text = text.decode("utf-8", "surrogateescape")
    _require("\0" not in text, f"{what} {text!r} holds a NUL character, which no path can")
    return text


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How items are sampled from and removed from a table.

    Attributes:
      sampler: One of `SAMPLERS`. "uniform" (default) or "prioritized" for replay;
        "fifo"/"lifo"/heaps turn the table into a queue, stack or heap.
      remover: One of `REMOVERS`: which item is evicted once the table is full. Default "fifo".
      priority_exponent: Exponent applied to priorities by the "prioritized" sampler.
      min_size_to_sample: Sampling blocks until the table holds at least this many items.
      samples_per_insert: If set, a `SampleToInsertRatio` rate limiter keeps the number of
        samples per inserted item near this value; if None, only `min_size_to_sample` applies.
      error_buffer: Allowed deviation from `samples_per_insert`, in samples. None picks a safe
        default (see `effective_error_buffer`). Ignored without `samples_per_insert`.
      max_times_sampled: An item is removed after this many samples; 0 means never.
    """

    sampler: str = "uniform"
    remover: str = "fifo"
    priority_exponent: float = 0.6
    min_size_to_sample: int = 1
    samples_per_insert: float | None = None
    error_buffer: float | None = None
    max_times_sampled: int = 0

    def __post_init__(self) -> None:
        _require(
            self.sampler in SAMPLERS, f"sampler must be one of {SAMPLERS}, got {self.sampler!r}"
        )
        _require(
            self.remover in REMOVERS, f"remover must be one of {REMOVERS}, got {self.remover!r}"
        )
        require_number("priority_exponent", self.priority_exponent, 0)
        require_positive_int("min_size_to_sample", self.min_size_to_sample)
        require_int("max_times_sampled", self.max_times_sampled, 0)
        spi = self.samples_per_insert
        if spi is not None:
            _require(
                isinstance(spi, int | float)
                and not isinstance(spi, bool)
                and math.isfinite(spi)
                and spi > 0,
                f"samples_per_insert must be a finite number > 0 or None, got {spi!r}",
            )
        if self.error_buffer is not None:
            floor = max(1.0, spi or 1.0)
            _require(
                isinstance(self.error_buffer, int | float)
                and not isinstance(self.error_buffer, bool)
                and math.isfinite(self.error_buffer)
                and self.error_buffer >= floor,
                f"error_buffer must be a finite number >= max(1, samples_per_insert) = {floor} "
                "or else sampling and inserting can block each other forever, got "
                f"{self.error_buffer!r}",
            )

    @property
    def independent_draws(self) -> bool:
        """Whether every sample is a uniform draw with replacement that no earlier sample
        changes or holds back (uniform sampler, no `max_times_sampled`, no
        `samples_per_insert`): several batches may then be drawn at once."""
        return (
            self.sampler == "uniform"
            and not self.max_times_sampled
            and self.samples_per_insert is None
        )

    def effective_error_buffer(self) -> float:
        """Returns the error buffer used with `samples_per_insert`.

        The default is wide enough that a single-threaded loop which alternates one collect step
        with one training step cannot block itself: at least 10% of `min_size_to_sample` samples
        and never less than `2 * max(1, samples_per_insert)`.

        Raises:
          ConfigError: If `samples_per_insert` is not set.
        """
        if self.samples_per_insert is None:
            raise ConfigError("effective_error_buffer() needs samples_per_insert to be set")
        if self.error_buffer is not None:
            return float(self.error_buffer)
        spi = float(self.samples_per_insert)
        return max(2.0 * max(1.0, spi), 0.1 * spi * self.min_size_to_sample)


@dataclasses.dataclass(frozen=True)
class TableConfig:
    """One Reverb table holding fixed-length windows of a data spec.

    Attributes:
      name: Table name; clients and datasets address the table by it.
      capacity: Maximum number of items (windows of `sequence_length` steps) kept.
      sequence_length: Number of consecutive steps in one item.
      sampling: Sampler, remover and rate limiter.
      pad_end_of_episode: Store `sequences.Masked(step, mask)` steps and pad the end of each
        episode so that its last steps (and episodes shorter than `sequence_length`) are in an
        item too; see `replay_service.specs.windows`.
      layout: How steps are stored: "nested" (one Reverb column per field; the signature is
        the data spec with a time dimension) or "packed" (one `uint8` row per step in long
        chunks: several times less server memory per step, faster inserts; see
        `replay_service.specs.packed`). Every table of a server has the same layout.
      frame_stack: Local backend: the observation is a stack of this many frames along
        `frame_axis`, each step storing only its newest frame
        (`replay_service.specs.frames`); None: observations stored whole.
      frame_axis: The observation's axis the frames are stacked along: 0 (gymnasium's
        `FrameStackObservation`) or -1 (SB3's `VecFrameStack`, channels last).
    """

    name: str = DEFAULT_TABLE_NAME
    capacity: int = 50_000
    sequence_length: int = 2
    sampling: SamplingConfig = dataclasses.field(default_factory=SamplingConfig)
    pad_end_of_episode: bool = False
    layout: str = "nested"
    frame_stack: int | None = None
    frame_axis: int = 0

    def __post_init__(self) -> None:
        validate_table_name(self.name)
        require_positive_int("capacity", self.capacity)
        require_positive_int("sequence_length", self.sequence_length)
        _require(
            isinstance(self.sampling, SamplingConfig),
            f"sampling must be a SamplingConfig, got {type(self.sampling).__name__}",
        )
        _require(
            isinstance(self.pad_end_of_episode, bool),
            f"pad_end_of_episode must be True or False, got {self.pad_end_of_episode!r}",
        )
        _require(
            self.layout in ("nested", "packed"),
            f"layout must be 'nested' or 'packed', got {self.layout!r}",
        )
        _require(
            self.sampling.min_size_to_sample <= self.capacity,
            f"min_size_to_sample ({self.sampling.min_size_to_sample}) must not exceed capacity "
            f"({self.capacity}), or sampling could never start",
        )
        if self.frame_stack is not None:
            require_positive_int("frame_stack", self.frame_stack)
            _require(
                self.frame_stack >= 2,
                f"frame_stack must be an integer >= 2, got {self.frame_stack!r}",
            )
        _require(
            not isinstance(self.frame_axis, bool) and self.frame_axis in (0, -1),
            f"frame_axis must be 0 or -1, got {self.frame_axis!r}",
        )


@dataclasses.dataclass(frozen=True)
class VariableTableConfig:
    """A TF-Agents variable-container table: one item, the latest pushed variables.

    Built as TF-Agents' distributed examples build it (`sac_reverb_server.py`): `max_size=1`, a
    FIFO remover (each push replaces the previous item), a uniform sampler, `MinSize(1)` (pulls
    wait for the first push), items never removed by sampling, and `spec` as the signature, so
    `tf_agents.experimental.distributed.reverb_variable_container.ReverbVariableContainer`
    can `push` and `update` through it.

    Attributes:
      spec: Nest of `tf.TensorSpec` (or other specs, see `specs.normalize_spec`), one per
        variable and without a time dimension, e.g. `specs.variable_container_spec(variables)`;
        kept as a nest of `tf.TensorSpec`.
      name: Table name; TF-Agents' default is "variables".

    Raises:
      ConfigError: If the name is invalid or `spec` is not a non-empty nest of specs.
    """

    spec: object
    name: str = DEFAULT_VARIABLE_TABLE_NAME

    def __post_init__(self) -> None:
        validate_table_name(self.name)
        from replay_service.specs.nests import normalize_spec  # TensorFlow, only when used

        try:
            spec = normalize_spec(self.spec)
        except SpecMismatchError as e:
            raise ConfigError(
                f"variable table {self.name!r}: spec: {e} (for variables, pass "
                "replay_service.specs.nests.variable_container_spec(variables))"
            ) from e
        object.__setattr__(self, "spec", spec)


@dataclasses.dataclass(frozen=True)
class Timeouts:
    """Upper bounds, in seconds, on every blocking call. None means wait forever.

    Attributes:
      connect: Waiting for a server to answer (start-up, remote connect, `server_info`).
      write: Waiting for written items to be confirmed (`flush`, end of episode, close).
      sample: Waiting for a sample when the table is empty or the rate limiter blocks; a
        dataset then raises an error naming the table instead of hanging.
      checkpoint: Waiting for a checkpoint to be written.
    """

    connect: float | None = 10.0
    write: float | None = 30.0
    sample: float | None = 60.0
    checkpoint: float | None = 600.0

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            _require_timeout(f"timeouts.{field.name}", getattr(self, field.name))


def to_ms(seconds: float | None) -> int | None:
    """Converts a timeout in seconds to Reverb's milliseconds (None stays None)."""
    return None if seconds is None else max(1, int(seconds * 1000))
