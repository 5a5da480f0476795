"""Fill a starter replay buffer from a baseline policy, or copy one for a training run.

A starter buffer is collected once (by default: the building env under the schedule policy,
one week of 15-minute steps per run) and never modified afterwards; every training run trains
from its own copy, made with --copy-to.

  replay-populate --buffer-name my-starter-buffer --capacity 50000 \\
      --steps-per-run 672 --num-runs 10
  replay-populate --buffer-name my-starter-buffer --copy-to runs/exp1/replay
  replay-populate --buffer-name default --copy-to runs/exp1/replay \\
      --data-spec my_project.specs:collect_data_spec   # an sbsim buffer (no signature)

The buffer is <output-dir>/<buffer-name>, a replay_service checkpoint directory, and appears
under that name only once every run was collected and checkpointed. A summary plot of the
collected rewards and actions is written beside it as <buffer-name>.summary.png. Flags may be
spelled with hyphens or underscores (--buffer-name or --buffer_name). Exit status: 0 on success,
2 on an error, reported as one line on stderr that starts with "error:".
"""

from __future__ import annotations

import contextlib
import importlib
import re
import sys
from collections.abc import Iterator, Sequence
from typing import NoReturn, TextIO

import tqdm
from absl import app, flags, logging

from replay_service.cli.parsing import asks_for_help
from replay_service.cli.stack import require_reverb_imports
from replay_service.config.options import DEFAULT_TABLE_NAME
from replay_service.errors import ConfigError, ReplayServiceError
from replay_service.specs.layouts import NESTED
from replay_service.starter.checks import check_target
from replay_service.starter.envs import BUILDING_ENV_ID
from replay_service.starter.naming import starter_buffer_path
from replay_service.starter.options import (
    DATA_SPEC_ENV_PREFIX,
    DEFAULT_CAPACITY,
    DEFAULT_ENV,
    DEFAULT_NUM_ENVS,
    DEFAULT_NUM_RUNS,
    DEFAULT_OUTPUT_DIR,
    DEFAULT_POLICY,
    DEFAULT_SEQUENCE_LENGTH,
    DEFAULT_STEPS_PER_RUN,
    PopulateConfig,
)
from replay_service.storage.store import CheckpointStore

EXIT_ERROR = 2
EXIT_INTERRUPTED = 130
WORK_MODULES = (
    "replay_service.starter.copying",
    "replay_service.starter.filling",
    "replay_service.starter.results",
    "replay_service.starter.sources",
)
"""The modules that do the work, imported (with TensorFlow and TF-Agents) once the flags are
checked; `run` imports them before absl's `app.run` starts `main`, as TensorFlow needs."""
REFRESH_S = 0.1
PLAIN_REFRESH_S = 10.0
_FLAG_ARG = re.compile(r"(--?)([A-Za-z][\w-]*)(=.*)?", re.DOTALL)

POPULATE_FLAGS = flags.FlagValues()
"""This command's flags, kept apart from `absl.flags.FLAGS` so that no other module's flags
(e.g. `replay_service.cli.demo`'s --env and --capacity) can clash with them."""

_BUFFER_NAME = flags.DEFINE_string(
    "buffer_name",
    None,
    "Name of the starter buffer (required): the directory in --output-dir that holds it. A "
    "single directory name: not empty, no '/', not starting with '.'.",
    flag_values=POPULATE_FLAGS,
)
_OUTPUT_DIR = flags.DEFINE_string(
    "output_dir",
    DEFAULT_OUTPUT_DIR,
    "Directory holding starter buffers; created if missing.",
    flag_values=POPULATE_FLAGS,
)
_ENV = flags.DEFINE_string(
    "env",
    DEFAULT_ENV,
    f"Environment: '{BUILDING_ENV_ID}' (one thermal zone, 15-minute steps, one-week episodes) "
    "or any gym id suite_gym can load, e.g. CartPole-v0.",
    flag_values=POPULATE_FLAGS,
)
_POLICY = flags.DEFINE_string(
    "policy",
    DEFAULT_POLICY,
    "Behaviour policy: 'schedule' (comfort setpoints 08:00-18:00 on weekdays, setback "
    "otherwise; building env only), 'random' (uniform within the action bounds), or a "
    "directory holding a saved policy (PolicySaver layout).",
    flag_values=POPULATE_FLAGS,
)
_CAPACITY = flags.DEFINE_integer(
    "capacity",
    DEFAULT_CAPACITY,
    "Maximum number of items in the buffer (an item is a window of --sequence-length "
    "consecutive steps). It must hold everything collected: a capacity below num-envs x "
    "num-runs x steps-per-run (twice that with --sequence-length 1, where episode ends are "
    "items too) is refused up front, rather than letting later runs evict the first ones. With "
    "--append the buffer's own capacity is used.",
    flag_values=POPULATE_FLAGS,
)
_STEPS_PER_RUN = flags.DEFINE_integer(
    "steps_per_run",
    DEFAULT_STEPS_PER_RUN,
    "Environment steps per run and environment (672 = one week of 15-minute steps). Episodes "
    "carry on from one run to the next.",
    flag_values=POPULATE_FLAGS,
)
_NUM_RUNS = flags.DEFINE_integer(
    "num_runs",
    DEFAULT_NUM_RUNS,
    "Number of runs; the buffer is checkpointed after each.",
    flag_values=POPULATE_FLAGS,
)
_SEQUENCE_LENGTH = flags.DEFINE_integer(
    "sequence_length",
    DEFAULT_SEQUENCE_LENGTH,
    "Consecutive steps per item; must match the training's num_steps. With --append the "
    "buffer's own value is used.",
    flag_values=POPULATE_FLAGS,
)
_NUM_ENVS = flags.DEFINE_integer(
    "num_envs",
    DEFAULT_NUM_ENVS,
    "Environments stepped in turn, each with its own observer, so their episodes stay "
    "separate. Environment i (and its random policy) is seeded with seed + i.",
    flag_values=POPULATE_FLAGS,
)
_SEED = flags.DEFINE_integer(
    "seed",
    None,
    "Base seed of the environments and random policies. Default: drawn at random and printed "
    "in the summary, so the buffer can be rebuilt.",
    flag_values=POPULATE_FLAGS,
)
_OVERWRITE = flags.DEFINE_boolean(
    "overwrite",
    False,
    "Replace an existing buffer of that name. The new one is built beside it; the old one is "
    "removed only once the new one is complete. With --copy-to: replace the buffer in the "
    "target directory.",
    flag_values=POPULATE_FLAGS,
)
_APPEND = flags.DEFINE_boolean(
    "append",
    False,
    "Add the collected steps to an existing buffer of that name (same env, policy specs, "
    "capacity and sequence length). The extended buffer replaces the old one only once complete.",
    flag_values=POPULATE_FLAGS,
)
_COPY_TO = flags.DEFINE_string(
    "copy_to",
    None,
    "Instead of populating, copy the newest checkpoint of the starter buffer --buffer-name into "
    "this directory, e.g. a training run's own replay checkpoint dir; it must be new or empty "
    "(see --overwrite). Train from the copy: the starter buffer stays unchanged.",
    flag_values=POPULATE_FLAGS,
)
_DATA_SPEC = flags.DEFINE_string(
    "data_spec",
    None,
    "With --copy-to: the per-step data spec the buffer holds, checked against the stored "
    "items (each field's dtype and shape) before anything is written, and required for a bare "
    "Reverb checkpoint root whose table has no signature (sbsim's starter buffers). Either "
    f"'{DATA_SPEC_ENV_PREFIX}<env id>' (the spec of '{BUILDING_ENV_ID}' or a gym id with an "
    "empty policy_info, as the schedule and random policies collect) or 'module:function' "
    "(an importable function returning the spec, e.g. agent.collect_data_spec; the current "
    "directory is searched too).",
    flag_values=POPULATE_FLAGS,
)

_VERBOSITY = flags.DEFINE_integer(
    "verbosity",
    -1,
    "Log level: -1 shows only this command's own lines; 0 (INFO) or more also shows the log "
    "lines of TensorFlow, Reverb and gym (as does the environment variable "
    "REPLAY_SERVICE_VERBOSE=1).",
    flag_values=POPULATE_FLAGS,
)

_OWN_FLAGS = (
    _BUFFER_NAME,
    _OUTPUT_DIR,
    _ENV,
    _POLICY,
    _CAPACITY,
    _STEPS_PER_RUN,
    _NUM_RUNS,
    _SEQUENCE_LENGTH,
    _NUM_ENVS,
    _SEED,
    _OVERWRITE,
    _APPEND,
    _COPY_TO,
    _DATA_SPEC,
    _VERBOSITY,
)


class ProgressBar:
    """Shows collection progress and speed on a stream, as a tqdm bar.

    On a terminal the bar is redrawn at most every `REFRESH_S` seconds; otherwise (a log file, a
    pipe) at most every `PLAIN_REFRESH_S` seconds, and once more when the collection ends.

    Args:
      stream: Where to write, normally `sys.stderr`.
      label: Text in front of the bar.
    """

    def __init__(self, stream: TextIO, label: str = "collecting") -> None:
        self._stream = stream
        self._label = label
        self._bar: tqdm.tqdm | None = None

    def __call__(self, done: int, total: int) -> None:
        """Reports `done` of `total` steps."""
        if self._bar is None:
            tty = self._stream.isatty()
            self._bar = tqdm.tqdm(
                total=total,
                desc=self._label,
                unit="steps",
                file=self._stream,
                mininterval=REFRESH_S if tty else PLAIN_REFRESH_S,
                dynamic_ncols=tty,
                ascii=not tty,
                leave=True,
            )
        self._bar.total = total
        self._bar.update(done - self._bar.n)

    def close(self) -> None:
        """Draws the final state and ends the bar's line."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def normalize_flag_spelling(argv: Sequence[str], flag_values: flags.FlagValues) -> list[str]:
    """Rewrites `--some-flag[=value]` to `--some_flag[=value]` for flags `flag_values` knows.

    `--no-some-flag` becomes `--nosome_flag` for boolean flags. The value of a flag given as a
    separate argument, and everything after `--`, is left as it is.

    Args:
      argv: The command line, program name first.
      flag_values: The defined flags.

    Returns:
      The rewritten command line.
    """
    booleans = {name: flag_values[name].boolean for name in flag_values}
    result, args = list(argv[:1]), list(argv[1:])
    expects_value = False
    for index, arg in enumerate(args):
        if expects_value:
            result.append(arg)
            expects_value = False
            continue
        if arg == "--":
            result.extend(args[index:])
            break
        match = _FLAG_ARG.fullmatch(arg)
        name = _canonical_flag_name(match.group(2), booleans) if match else None
        if match is None or name is None:
            result.append(arg)
            continue
        dashes, _, value = match.groups()
        result.append(f"{dashes}{name}{value or ''}")
        expects_value = value is None and not booleans.get(name, True)
    return result


def _canonical_flag_name(name: str, booleans: dict[str, bool]) -> str | None:
    underscored = name.replace("-", "_")
    if underscored in booleans:
        return underscored
    negated = underscored.removeprefix("no").lstrip("_")
    if underscored.startswith("no") and booleans.get(negated):
        return f"no{negated}"
    return None


def help_text() -> str:
    """Returns the usage text: this module's docstring and its flags, spelled with hyphens."""
    module = POPULATE_FLAGS.find_module_defining_flag(_BUFFER_NAME.name)
    text = POPULATE_FLAGS.module_help(module)
    text = text.strip("\n").removeprefix(f"{module}:").strip("\n")
    for holder in _OWN_FLAGS:
        text = re.sub(rf"--(\[no\])?{holder.name}\b", rf"--\g<1>{_hyphenated(holder.name)}", text)
    return f"{__doc__.strip()}\n\nflags:\n{text}\n"


def _hyphenated(name: str) -> str:
    return name.replace("_", "-")


def parse_flags(argv: Sequence[str]) -> list[str]:
    """The `flags_parser` of `app.run`: accepts hyphenated names, prints help, exits on errors.

    Parses `POPULATE_FLAGS`; `absl.flags.FLAGS` is marked parsed with no arguments, as
    `app.run` requires.

    Args:
      argv: The command line, program name first.

    Returns:
      The arguments left after parsing the flags, program name first.
    """
    args = normalize_flag_spelling(argv, POPULATE_FLAGS)
    if asks_for_help(args):
        sys.stdout.write(help_text())
        sys.exit(0)
    try:
        remaining = POPULATE_FLAGS(args)
    except flags.Error as e:
        _fail(f"{e} (see --help)")
    flags.FLAGS(remaining[:1])
    return remaining


def _explicit(holder: flags.FlagHolder[int]) -> int | None:
    return holder.value if holder.present else None


def config_from_flags() -> PopulateConfig:
    """Builds the `PopulateConfig` the parsed flags describe.

    With --append, --capacity and --sequence-length count only when given, so the buffer's
    own values apply otherwise.

    Raises:
      ConfigError: If a value is invalid.
    """
    append = _APPEND.value
    return PopulateConfig(
        buffer_name=_required_buffer_name(),
        output_dir=_OUTPUT_DIR.value,
        env=_ENV.value,
        policy=_POLICY.value,
        capacity=_explicit(_CAPACITY) if append else _CAPACITY.value,
        steps_per_run=_STEPS_PER_RUN.value,
        num_runs=_NUM_RUNS.value,
        sequence_length=_explicit(_SEQUENCE_LENGTH) if append else _SEQUENCE_LENGTH.value,
        num_envs=_NUM_ENVS.value,
        seed=_SEED.value,
        overwrite=_OVERWRITE.value,
        append=append,
    )


def _required_buffer_name() -> str:
    if _BUFFER_NAME.value is None:
        raise ConfigError("--buffer-name is required: the name of the starter buffer")
    return _BUFFER_NAME.value


def check_flags(argv: Sequence[str]) -> PopulateConfig | None:
    """Checks the parsed flags and everything they name that needs no TensorFlow.

    Refused here: unexpected arguments, --append or no --buffer-name with --copy-to,
    --data-spec without it, a bad value (`config_from_flags`), and what `populate` checks before
    it builds anything (`starter.checks.check_target`: the output directory, an existing buffer
    without --overwrite or --append, the sizes, the capacity, the env id).

    Args:
      argv: The arguments left after parsing the flags, program name first.

    Returns:
      The config to populate, or None to copy (--copy-to).

    Raises:
      ConfigError: If an argument or a value is invalid; the message names it.
      CheckpointExistsError: If the buffer exists and neither --overwrite nor --append is given.
      NoCheckpointError: If --append is given and there is no complete buffer to add to.
      CheckpointError: If the output directory cannot be written or holds a foreign directory
        of that name.
    """
    if len(argv) > 1:
        raise ConfigError(f"unexpected arguments {list(argv[1:])!r}; see --help")
    if _COPY_TO.value is not None:
        _check_copy_flags()
        return None
    if _DATA_SPEC.value is not None:
        raise ConfigError(
            f"--data-spec {_DATA_SPEC.value!r} applies only with --copy-to (populating takes "
            "the spec from --env and --policy)"
        )
    config = config_from_flags()
    check_target(config)
    return config


def _check_copy_flags() -> None:
    if _APPEND.value:
        raise ConfigError(
            f"--copy-to {_COPY_TO.value!r} copies a buffer; it cannot be combined with --append"
        )
    _required_buffer_name()


def copy_from_flags() -> str:
    """Copies the starter buffer named by the flags to --copy-to and describes the copy.

    Returns:
      Lines to print.

    Raises:
      ConfigError: If --append is given too, or --data-spec names no usable spec.
      CheckpointError: If the copy is refused or fails (see `copy_buffer`).
      SpecMismatchError: If the buffer does not hold the --data-spec spec.
    """
    from replay_service.starter.copying import copy_buffer
    from replay_service.starter.sources import load_data_spec

    _check_copy_flags()
    name = _required_buffer_name()
    source = starter_buffer_path(_OUTPUT_DIR.value, name)
    data_spec = None if _DATA_SPEC.value is None else load_data_spec(_DATA_SPEC.value)
    target = copy_buffer(source, _COPY_TO.value, overwrite=_OVERWRITE.value, data_spec=data_spec)
    store = CheckpointStore(target)
    stored, latest = store.read_metadata(), store.latest()
    items = latest.info.get("num_items") if latest is not None else None
    count = f"{items} items" if items is not None else "its newest checkpoint"
    # A load checks the stored settings against the manager's: the line names each one that
    # is not the manager's default (a table named otherwise, such as TF-Agents' `experience`,
    # padded items, the packed layout), so that it loads the copy as printed.
    options = []
    if stored.table_name != DEFAULT_TABLE_NAME:
        options.append(f", table_name={stored.table_name!r}")
    if stored.pad_end_of_episode:
        options.append(", pad_end_of_episode=True")
    if stored.layout != NESTED:
        options.append(f", layout={stored.layout!r}")
    more = ""
    if stored.extra_tables or stored.variable_tables:
        more = (
            "\n(the copy holds more tables: pass them as extra_tables=/variable_tables=, "
            "see docs/guide/tables.md)"
        )
    return (
        f"copied starter buffer {name!r} ({count}) from {source} to {target}\n"
        f"train from the copy: ReplayBufferManager(data_spec, {stored.capacity}, {target!r}, "
        f"{stored.sequence_length}{''.join(options)}).load_replay_buffer(){more}"
    )


def _fail(message: str, notes: Sequence[str] = (), code: int = EXIT_ERROR) -> NoReturn:
    """Prints `message` and `notes` as one line on stderr and exits with `code`."""
    text = " ".join("; ".join(part for part in (message, *notes) if part).split())
    sys.stderr.write(f"error: {text}\n")
    sys.exit(code)


@contextlib.contextmanager
def _errors_reported() -> Iterator[None]:
    """Reports a `ReplayServiceError` or an interrupt as one line (`_fail`) and exits."""
    try:
        yield
    except ReplayServiceError as e:
        _fail(str(e), getattr(e, "__notes__", ()))
    except KeyboardInterrupt as e:
        _fail("interrupted", getattr(e, "__notes__", ()), EXIT_INTERRUPTED)


def main(argv: Sequence[str]) -> None:
    """Populates the starter buffer, or copies it with --copy-to, and prints a summary.

    `run` has checked the flags (`check_flags`) and imported the stack before it starts this.
    """
    logging.set_verbosity(_VERBOSITY.value if _VERBOSITY.value >= 0 else logging.WARNING)
    with _errors_reported():
        if _COPY_TO.value is not None:
            print(copy_from_flags())
            return
        config = config_from_flags()
        from replay_service.starter.filling import populate
        from replay_service.starter.results import format_summary

        with ProgressBar(sys.stderr) as progress:
            result = populate(config, progress=progress)
        print(format_summary(result))


def run() -> None:
    """Console-script entry point (`replay-populate`).

    The flags are parsed and checked first, without TensorFlow: `--help`, a bad flag and every
    refusal of `check_flags` answer at once. TensorFlow, TF-Agents, Reverb and `WORK_MODULES`
    are then imported before absl's `app.run` starts `main`: imported inside it, TensorFlow's
    tf.data functions would compare tensors as TF1 does.
    """
    remaining = parse_flags(sys.argv)
    with _errors_reported():
        check_flags(remaining)
    require_reverb_imports("replay-populate")
    for module in WORK_MODULES:
        importlib.import_module(module)
    app.run(main, flags_parser=lambda _argv: remaining)


if __name__ == "__main__":
    run()
