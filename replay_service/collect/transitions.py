"""Collect into a replay table from PyTorch or gymnasium code, without TF-Agents.

`TransitionWriter` takes transitions `(state, action, reward, next_state, done, truncated)` and
writes exactly what `TrajectoryObserver` writes for the same episodes: TF-Agents `Trajectory`
steps, and one item per window of `sequence_length` consecutive steps of one episode. TF-Agents
learners and `torch_sampling` read the result like any collected data.

A transition becomes one trajectory step `(step_type, observation=state, action, policy_info,
next_step_type, reward, discount)`:

- `step_type` is FIRST for the first transition of an episode, MID afterwards;
- `next_step_type` is LAST if the transition ends the episode, MID otherwise;
- `discount` is 0.0 if it terminated the episode (`done`), 1.0 otherwise (truncation included).

After the transition that ends an episode comes the boundary step TF-Agents writes: `step_type`
LAST with the episode's final observation, zero action and policy info, `next_step_type` FIRST,
reward 0 and discount 1; the episode then ends, so no window spans two episodes. An episode of
T transitions is T + 1 steps and gives T - sequence_length + 2 items (stride 1). Items are made
by the writers the client hands out (`collect.writing.WindowWriter`: the windows of
every table), one writer per environment.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tree

from replay_service.collect.observer import FLUSH_DOWN_TO, WriteTarget
from replay_service.collect.writing import WindowWriter, WritingClient
from replay_service.config.options import Timeouts
from replay_service.errors import ManagerClosedError, SpecMismatchError
from replay_service.specs.arrays import to_numpy
from replay_service.specs.layouts import NESTED, Layout
from replay_service.specs.nests import check_collect_spec, flatten_with_paths
from replay_service.specs.windows import padding_step

# TF-Agents' `StepType` values.
FIRST = 0
MID = 1
LAST = 2
TERMINAL_DISCOUNT = 0.0
CONTINUING_DISCOUNT = 1.0


class TransitionWriter:
    """Writes transitions from one environment or a vector of auto-resetting ones.

    Single environment: `add(state, action, reward, next_state, done, truncated)`, with the
    values of one step and no batch dimension. `next_state` is the observation that followed
    the action, also when the episode ended (an environment that does not reset itself).

    Vectorized environments: `add_multi(...)`, every argument with a leading dimension of size
    `num_envs`; row `i` belongs to environment `i`, whose episodes are written by their own
    Reverb writer. The environments are taken to reset themselves in the step that ends an
    episode (the seeds' `was_done` convention; gym < 1.0 vector envs, Stable-Baselines3
    VecEnv, gymnasium >= 1.0 with `autoreset_mode=SAME_STEP`): when `dones[i]` or
    `truncated[i]` is True, `next_states[i]` is already the first observation of env `i`'s next
    episode. The transition `(states[i], actions[i], rewards[i])` is then the last of the
    episode; the final observation of that episode, stored in its boundary step, is
    `final_states[i]` (gym's `info["terminal_observation"]`, gymnasium's `info["final_obs"]`).
    Without `final_states` it is unknown: a terminated episode stores zeros there (never part
    of a TD target, as its discount is 0), and a truncated one is refused because its value
    target needs that observation. Env `i`'s next transition, whose state is `next_states[i]`,
    starts a new episode with `step_type` FIRST. Gymnasium's default next-step auto-reset
    (an extra reset step after each end) must not be written as transitions.

    `done` means terminated (gymnasium's `terminated`); pass time-limit ends as `truncated`.
    When both are True the transition terminated. Each call is validated completely before
    anything is written: a refused call changes nothing.

    After the first call, values that already have the spec's shapes and dtypes (or dtypes
    cast within a kind), and flags that are booleans, take a fast path with the same checks;
    any other value goes through the full validation, which converts it or names the argument
    and field that is wrong.

    Args:
      client: Client of the server holding the table.
      table_name: Table to write to.
      sequence_length: Steps per item; must equal the table's.
      data_spec: Per-step TF-Agents `Trajectory` spec (e.g. `agent.collect_data_spec`).
      stride_length: A new item every `stride_length` steps (1: every window).
      priority: Initial priority of new items.
      timeouts: `timeouts.write` bounds every wait for the server.
      check_continuity: Refuse a transition whose state is not the previous transition's
        `next_state` (as expected within an episode, and after an auto-reset).
      extra_tables: `(name, sequence_length)` of further tables on the same server that get
        the windows of the same steps.
      pad_end_of_episode: Write `Masked(step, mask)` steps and pad the end of each env's
        episodes (the tables must be padded too; see `replay_service.specs.windows`).
      layout: The tables' storage layout, "nested" or "packed" (see `config.TableConfig`), or
        the `specs.layouts.Layout` it resolves to.

    Raises:
      SpecMismatchError: If `data_spec` is not a TF-Agents `Trajectory` spec.
      ConfigError: If `sequence_length` or `stride_length` is not an integer >= 1,
        `priority` not a finite number >= 0, or `layout` not a layout name.
    """

    def __init__(
        self,
        client: WritingClient,
        table_name: str,
        sequence_length: int,
        data_spec: Any,
        *,
        stride_length: int = 1,
        priority: float = 1.0,
        timeouts: Timeouts | None = None,
        check_continuity: bool = True,
        extra_tables: Sequence[tuple[str, int]] = (),
        pad_end_of_episode: bool = False,
        layout: Layout | str = NESTED,
    ) -> None:
        spec = check_collect_spec(data_spec, "TransitionWriter")
        self._target = target = WriteTarget.build(
            client,
            table_name,
            sequence_length,
            data_spec,
            stride_length=stride_length,
            priority=priority,
            timeouts=timeouts,
            extra_tables=extra_tables,
            pad_end_of_episode=pad_end_of_episode,
            layout=layout,
        )
        self._flush_every = target.flush_every  # read on every step
        self._check_continuity = check_continuity
        self._spec = spec
        # A padded table stores Masked(step, mask): flat, the step's leaves then the mask.
        self._mask: list[Any] = [np.True_] if pad_end_of_episode else []
        self._padding = tree.flatten(padding_step(spec)) if pad_end_of_episode else None
        self._plan = _FlatSteps(spec)
        # The names of a policy_info dict: extra per-step fields given as keywords.
        info = spec.policy_info
        self._extra_names: tuple[str, ...] = (
            tuple(info) if isinstance(info, dict) and tree.flatten(info) else ()
        )
        self._hidden_extra = "hidden" in self._extra_names
        self._batched: bool | None = None
        self._writers: list[WindowWriter | None] = []
        self._steps: list[int] = []
        self._since_flush: list[int] = []
        # The previous call's next states, one `bytes` per observation leaf (all envs' rows).
        self._expected: list[bytes] = []
        self._has_expected: list[bool] = []
        self._closed = False

    @property
    def num_envs(self) -> int | None:
        """Environments written for (1 for `add`); None before the first call."""
        return None if self._batched is None else len(self._writers)

    @property
    def py_client(self) -> WritingClient:
        """The client written through."""
        return self._target.client

    def add(
        self,
        state: Any,
        action: Any,
        reward: Any,
        next_state: Any,
        done: Any,
        truncated: Any = False,
        *,
        hidden: Any = None,
        **extras: Any,
    ) -> None:
        """Writes one transition of a single environment (no batch dimension).

        Extra per-step fields declared as a `policy_info` dict (`ReplayBufferManager.from_spaces(
        extras=...)`) are given one keyword each, e.g. `add(..., hidden=h, log_prob=lp)`; every
        declared extra is required.

        Args:
          state: Observation before the action (numpy, torch or Python values; a nest if the
            spec's observation is one).
          action: Action taken.
          reward: Reward received; must be finite.
          next_state: Observation after the action (the final one when the episode ended).
          done: The episode terminated.
          truncated: The episode ended without terminating (e.g. a time limit).
          hidden: Policy info matching the spec's `policy_info`, whole; or, when the spec's
            `policy_info` is a dict with a "hidden" key, that extra's value (any value but a
            dict).
          **extras: The spec's `policy_info` dict's fields, one keyword each.

        Raises:
          SpecMismatchError: If a value does not match the spec, a reward is not finite, the
            writer was used with `add_multi`, `state` does not continue the episode, or an
            extra is missing, unknown or of the wrong shape or dtype (named).
          WriteTimeoutError: If the server does not confirm items within the write timeout.
          ManagerClosedError: If the writer was closed.
        """
        label = "hidden"
        if extras or (hidden is not None and self._hidden_extra and not isinstance(hidden, dict)):
            hidden, label = self._gather_extras(hidden, extras, "hidden"), "extras"
        elif hidden is None and self._extra_names:
            self._gather_extras(None, {}, "hidden")  # raises: names the missing extras
        if (
            self._batched is False
            and not self._closed
            and self._add_fast(state, action, reward, next_state, done, truncated, hidden)
        ):
            return
        self._require_open()
        batch = _Batch.build(
            self._spec,
            {"state": state, "action": action, "reward": reward, "next_state": next_state},
            {"done": done, "truncated": truncated},
            hidden,
            hidden_label=label,
            batched=False,
        )
        self._require_mode(batched=False, num_envs=1)
        self._check_state(batch.states, "state")
        self._write(batch, batch.next_states)
        self._remember(batch.next_states, [not batch.ended[0]])

    def add_multi(
        self,
        states: Any,
        actions: Any,
        rewards: Any,
        next_states: Any,
        dones: Any,
        truncated: Any = None,
        *,
        final_states: Any = None,
        hiddens: Any = None,
        **extras: Any,
    ) -> None:
        """Writes one transition per environment of an auto-resetting vector env.

        See the class docstring for how `dones`, `truncated`, `next_states` and `final_states`
        map onto episode boundaries.

        Args:
          states: `[num_envs, ...]` observations before the actions.
          actions: `[num_envs, ...]` actions.
          rewards: `[num_envs]` rewards; must be finite.
          next_states: `[num_envs, ...]` observations returned by the step (for an env whose
            episode ended: the first observation of its next episode).
          dones: `[num_envs]` terminated flags (bool or 0/1).
          truncated: `[num_envs]` truncated flags; None means none.
          final_states: `[num_envs, ...]` final observations of the episodes that ended (other
            rows are ignored); needed when an episode is truncated.
          hiddens: `[num_envs, ...]` policy info, whole; required when the spec's is not empty
            and not given as `extras`.
          **extras: The spec's `policy_info` dict's fields, one keyword each, `[num_envs, ...]`
            (e.g. `hidden=`, `log_prob=`); every declared extra is required.

        Raises:
          SpecMismatchError: If a value does not match the spec, batch sizes differ or are 0
            (no env), a reward is not finite, `final_states` is missing for a truncated
            episode, the number of envs changed, or a state does not continue its env's episode.
          WriteTimeoutError: If the server does not confirm items within the write timeout.
          ManagerClosedError: If the writer was closed.
        """
        label = "hiddens"
        if extras:
            hiddens, label = self._gather_extras(hiddens, extras, "hiddens"), "extras"
        elif hiddens is None and self._extra_names:
            self._gather_extras(None, {}, "hiddens")  # raises: names the missing extras
        if (
            self._batched
            and not self._closed
            and self._add_multi_fast(
                states, actions, rewards, next_states, dones, truncated, final_states, hiddens
            )
        ):
            return
        self._require_open()
        flags = {"dones": dones, "truncated": truncated}
        if truncated is None:
            flags["truncated"] = np.zeros_like(to_numpy(dones), dtype=bool)
        values = {
            "states": states,
            "actions": actions,
            "rewards": rewards,
            "next_states": next_states,
        }
        if final_states is not None:
            values["final_states"] = final_states
        batch = _Batch.build(self._spec, values, flags, hiddens, hidden_label=label, batched=True)
        final_states = self._final_states(batch)
        self._require_mode(batched=True, num_envs=batch.size)
        self._check_state(batch.states, "states")
        self._write(batch, final_states)
        self._remember(batch.next_states, [True] * batch.size)

    def reset(self, env_index: int | None = None) -> None:
        """Ends the current episode of one env (or all) without writing a boundary step.

        Use it after resetting an environment by hand mid-episode. Items already written stay;
        the next transition starts a new episode.

        Args:
          env_index: The env to reset; None resets all.
        """
        indices = range(len(self._writers)) if env_index is None else [env_index]
        for index in indices:
            if self._steps[index]:
                self._end_episode(index)
            self._has_expected[index] = False

    def flush(self, timeout_ms: int | None = None) -> None:
        """Blocks until every item written so far is confirmed by the server.

        Args:
          timeout_ms: Bound on each writer's wait in milliseconds; None: the write timeout.

        Raises:
          WriteTimeoutError: If that takes longer than the bound (the items stay on their way
            to the server; the writer stays usable).
        """
        wait_ms = self._target.timeout_ms if timeout_ms is None else timeout_ms
        for index, writer in enumerate(self._writers):
            if writer is not None:
                self._target.wait(lambda w=writer: w.flush(timeout_ms=wait_ms), wait_ms)
                self._since_flush[index] = 0

    def close(self) -> None:
        """Flushes pending items, ends every episode and closes the writers. Idempotent.

        Raises:
          WriteTimeoutError: If the server does not confirm the pending items in time (the
            writer is closed all the same).
        """
        if self._closed:
            return
        self._closed = True
        error: Exception | None = None
        for index in range(len(self._writers)):
            try:
                self._end_episode(index)
            except Exception as e:  # end the other episodes before reporting it
                writer = self._writers[index]
                if writer is not None:
                    writer.abandon()
                error = error or e
        self._writers = []
        if error is not None:
            raise error

    def __enter__(self) -> TransitionWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _gather_extras(self, whole: Any, extras: dict[str, Any], whole_name: str) -> Any:
        """The `policy_info` dict of one call from its extras given as keywords.

        Args:
          whole: The `hidden`/`hiddens` argument: the "hidden" extra's value (`add` only), or
            None.
          extras: The other keyword arguments.
          whole_name: "hidden" (`add`) or "hiddens" (`add_multi`).

        Returns:
          A dict with every declared extra.

        Raises:
          SpecMismatchError: If the spec declares no extras, one is unknown, missing, or given
            both whole and as a keyword.
        """
        names = self._extra_names
        given = dict(extras)
        if whole is not None:
            if whole_name != "hidden" or "hidden" not in names or isinstance(whole, dict):
                raise SpecMismatchError(
                    f"give the policy info either whole as {whole_name}= or as one keyword per "
                    f"extra ({list(names)}), not both: got {whole_name}= and {sorted(given)}"
                )
            given["hidden"] = whole
        if not names:
            raise SpecMismatchError(
                f"unexpected keyword argument(s) {sorted(given)}: the data spec declares no "
                "extras (its policy_info is not a dict; declare them with "
                "ReplayBufferManager.from_spaces(..., extras={name: (shape, dtype)}))"
            )
        unknown = sorted(set(given) - set(names))
        if unknown:
            raise SpecMismatchError(
                f"unknown extra(s) {unknown}: the data spec declares the extras {list(names)}"
            )
        missing = [name for name in names if name not in given]
        if missing:
            raise SpecMismatchError(
                f"extra(s) {missing} required: the data spec declares the extras {list(names)}; "
                f"pass each as a keyword, e.g. {', '.join(f'{n}=...' for n in names)}"
            )
        return {name: given[name] for name in names}

    # ------------------------------------------------------------------------- fast paths

    def _add_fast(
        self,
        state: Any,
        action: Any,
        reward: Any,
        next_state: Any,
        done: Any,
        truncated: Any,
        hidden: Any,
    ) -> bool:
        """Writes one `add` transition whose values need no conversion beyond a cast.

        Returns:
          False, having written nothing, if any value needs the full validation (which then
          raises or converts it); True once the transition is written.
        """
        plan = self._plan
        states = plan.observation.convert(state)
        actions = plan.action.convert(action)
        rewards = plan.reward.convert(reward)
        next_states = plan.observation.convert(next_state)
        if states is None or actions is None or rewards is None or next_states is None:
            return False
        if plan.hidden.leaves:
            hiddens = None if hidden is None else plan.hidden.convert(hidden)
            if hiddens is None:
                return False
        elif hidden is None:
            hiddens = []
        else:
            return False
        if not plan.reward.all_finite(rewards, batched=False):
            return False
        terminated = _fast_flag(done)
        cut = _fast_flag(truncated)
        if terminated is None or cut is None:
            return False
        if (
            self._check_continuity
            and self._has_expected[0]
            and not _same_bytes(states, self._expected)
        ):
            return False
        ended = terminated or cut
        self._append(
            0,
            [
                plan.mid if self._steps[0] else plan.first,
                *states,
                *actions,
                *hiddens,
                plan.next_last if ended else plan.next_mid,
                *rewards,
                plan.terminal if terminated else plan.continuing,
            ],
        )
        if ended:
            self._append(0, [plan.last, *next_states, *plan.boundary_tail])
            self._end_episode(0, confirm=False)
        if self._check_continuity:
            self._expected = [a.tobytes() for a in next_states]
        self._has_expected[0] = not ended
        return True

    def _add_multi_fast(
        self,
        states: Any,
        actions: Any,
        rewards: Any,
        next_states: Any,
        dones: Any,
        truncated: Any,
        final_states: Any,
        hiddens: Any,
    ) -> bool:
        """Writes one `add_multi` call whose values need no conversion beyond a cast.

        Returns:
          False, having written nothing, if any value needs the full validation (which then
          raises or converts it); True once the transitions are written.
        """
        plan = self._plan
        size = len(self._writers)
        obs = plan.observation
        state_leaves = obs.convert(states, size)
        action_leaves = plan.action.convert(actions, size)
        reward_leaves = plan.reward.convert(rewards, size)
        next_leaves = obs.convert(next_states, size)
        if (
            state_leaves is None
            or action_leaves is None
            or reward_leaves is None
            or next_leaves is None
        ):
            return False
        if final_states is None:
            final_leaves = None
        else:
            final_leaves = obs.convert(final_states, size)
            if final_leaves is None:
                return False
        if plan.hidden.leaves:
            hidden_leaves = None if hiddens is None else plan.hidden.convert(hiddens, size)
            if hidden_leaves is None:
                return False
        elif hiddens is None:
            hidden_leaves = []
        else:
            return False
        if not plan.reward.all_finite(reward_leaves, batched=True):
            return False
        terminated = _fast_flags(dones, size)
        cut = terminated if truncated is None else _fast_flags(truncated, size)
        if terminated is None or cut is None:
            return False
        ended = terminated | cut
        if final_leaves is None and (ended & ~terminated).any():
            return False
        if (
            self._check_continuity
            and any(self._has_expected)
            and not (all(self._has_expected) and _same_bytes(state_leaves, self._expected))
        ):
            return False
        ended_rows = ended.tolist()
        terminal_rows = terminated.tolist()
        first, mid, next_mid, next_last = plan.first, plan.mid, plan.next_mid, plan.next_last
        columns = [
            [mid if steps else first for steps in self._steps],
            *map(list, state_leaves),
            *map(list, action_leaves),
            *map(list, hidden_leaves),
            [next_last if end else next_mid for end in ended_rows],
            *map(list, reward_leaves),
            [plan.terminal if end else plan.continuing for end in terminal_rows],
        ]
        for index, step in enumerate(zip(*columns, strict=True)):
            self._append(index, step)
            if ended_rows[index]:
                final = (
                    plan.unknown_final
                    if final_leaves is None
                    else [leaf[index] for leaf in final_leaves]
                )
                self._append(index, [plan.last, *final, *plan.boundary_tail])
                self._end_episode(index, confirm=False)
        if self._check_continuity:
            self._expected = [a.tobytes() for a in next_leaves]
        self._has_expected = [True] * size
        return True

    # ------------------------------------------------------------------------- helpers

    def _require_open(self) -> None:
        if self._closed:
            raise ManagerClosedError("this writer is closed; get a new one from the manager")

    def _require_mode(self, *, batched: bool, num_envs: int) -> None:
        if self._batched is None:
            self._batched = batched
            self._writers = [None] * num_envs
            self._steps = [0] * num_envs
            self._since_flush = [0] * num_envs
            self._has_expected = [False] * num_envs
            return
        if self._batched != batched:
            used, called = ("add_multi", "add") if self._batched else ("add", "add_multi")
            raise SpecMismatchError(
                f"this writer was used with {used}(); {called}() cannot be mixed with it "
                "(use one writer per environment or vector of environments)"
            )
        if num_envs != len(self._writers):
            raise SpecMismatchError(
                f"this writer collects from {len(self._writers)} envs (set by its first "
                f"add_multi call), got a batch of {num_envs}"
            )

    def _check_state(self, states: list[np.ndarray], label: str) -> None:
        if not self._check_continuity or not any(self._has_expected):
            return
        expected = [
            np.frombuffer(raw, state.dtype).reshape(state.shape)
            for state, raw in zip(states, self._expected, strict=True)
        ]
        broken = np.array(self._has_expected) & ~_rows_equal(states, expected)
        if broken.any():
            where = f" of envs {np.flatnonzero(broken).tolist()}" if self._batched else ""
            raise SpecMismatchError(
                f"{label!r}{where} is not the next_state of the previous transition, so it "
                "would not continue its episode; end the episode with done/truncated, call "
                "reset() after resetting an environment by hand, or create the writer with "
                "check_continuity=False"
            )

    def _final_states(self, batch: _Batch) -> list[np.ndarray]:
        if batch.final_states is not None:
            return batch.final_states
        cut_short = batch.ended & ~batch.terminated
        if cut_short.any():
            raise SpecMismatchError(
                f"envs {np.flatnonzero(cut_short).tolist()} were truncated, and their final "
                "observations are needed (their value targets bootstrap from them): pass "
                "final_states= (gym's info['terminal_observation'], gymnasium's "
                "info['final_obs'])"
            )
        return [np.zeros_like(leaf) for leaf in batch.next_states]

    def _write(self, batch: _Batch, final_states: list[np.ndarray]) -> None:
        plan = self._plan
        for index in range(batch.size):
            ended = bool(batch.ended[index])
            self._append(
                index,
                [
                    plan.mid if self._steps[index] else plan.first,
                    *[leaf[index] for leaf in batch.states],
                    *[leaf[index] for leaf in batch.actions],
                    *[leaf[index] for leaf in batch.hiddens],
                    plan.next_last if ended else plan.next_mid,
                    *[leaf[index] for leaf in batch.rewards],
                    plan.terminal if batch.terminated[index] else plan.continuing,
                ],
            )
            if ended:
                self._append(
                    index,
                    [plan.last, *[leaf[index] for leaf in final_states], *plan.boundary_tail],
                )
                self._end_episode(index, confirm=False)

    def _remember(self, next_states: list[np.ndarray], known: list[bool]) -> None:
        if self._check_continuity:
            self._expected = [leaf.tobytes() for leaf in next_states]
        self._has_expected = [bool(k) for k in known]

    def _append(self, index: int, step: Sequence[Any]) -> None:
        if self._mask:  # a padded table: the step is real, Masked(step, mask=True)
            step = [*step, *self._mask]
        self._append_raw(index, step)

    def _append_raw(self, index: int, step: Sequence[Any]) -> None:
        writer = self._writers[index]
        if writer is None:
            writer = self._target.open_writer()
            self._writers[index] = writer
        writer.append(step)
        self._steps[index] += 1
        since_flush = self._since_flush[index] + 1
        if since_flush >= self._flush_every:
            self._target.wait(
                lambda: writer.flush(FLUSH_DOWN_TO, timeout_ms=self._target.timeout_ms)
            )
            since_flush = 0
        self._since_flush[index] = since_flush

    def _end_episode(self, index: int, *, confirm: bool = True) -> None:
        """Ends env `index`'s episode (padding it first where the table pads).

        Args:
          index: The env.
          confirm: Wait until the writer's items are confirmed (reset, close). False, at an
            episode boundary inside a stream of steps: a writer that can end an episode
            without waiting (`WindowWriter.next_episode`) does, and its items stay
            counted for the periodic wait, which bounds them as within an episode.
        """
        writer = self._writers[index]
        if self._padding is not None and writer is not None:
            steps = int(self._steps[index])
            for _ in range(self._target.padding(steps)):
                self._append_raw(index, self._padding)
        self._steps[index] = 0
        if writer is None:
            self._since_flush[index] = 0
            return
        if not confirm and writer.next_episode():
            return
        self._since_flush[index] = 0
        target = self._target
        target.wait(lambda: writer.end_episode(clear_buffers=True, timeout_ms=target.timeout_ms))


class _Leaf:
    """One flattened spec leaf: its numpy dtype and per-step shape."""

    __slots__ = ("dtype", "finite_scalar", "inexact", "scalar_type", "shape")

    def __init__(self, spec: Any) -> None:
        self.dtype = np.dtype(_np_dtype(spec))
        self.shape: tuple[int, ...] = tuple(int(d) for d in spec.shape)
        scalar = self.shape == ()
        self.scalar_type = self.dtype.type if scalar else None
        self.inexact = np.issubdtype(self.dtype, np.inexact)
        self.finite_scalar = scalar and self.dtype.kind == "f"

    def convert(self, value: Any, size: int | None = None) -> list[Any] | None:
        """`value` as this leaf's dtype, or None if it is not exactly what the leaf takes.

        Args:
          value: One value (numpy, torch or Python).
          size: Leading batch dimension the value must have; None for none.

        Returns:
          A one-element list: an array (or numpy scalar) of shape `[size, *shape]` (`shape`
          without `size`); or None when the value has another shape, or a dtype that is not cast
          within its kind.
        """
        kind = type(value)
        if kind is np.ndarray:
            array = value
        elif kind is self.scalar_type and size is None:
            return [value]
        elif kind is float and self.finite_scalar and size is None:
            return [self.scalar_type(value)]
        else:
            array = to_numpy(value)
        if size is None:
            if array.shape != self.shape:
                if array.shape != () or self.shape != (1,):
                    return None
                array = array.reshape(1)  # a scalar for a one-element leaf (Discrete actions)
        elif array.shape[:1] != (size,) or array.shape[1:] != self.shape:
            return None
        dtype = array.dtype
        if dtype is not self.dtype and dtype != self.dtype:
            if not _same_kind(dtype, self.dtype):
                return None
            array = array.astype(self.dtype)
        return [array]


class _Part:
    """The leaves of one spec field (observation, action, reward or policy info)."""

    def __init__(self, spec: Any) -> None:
        self.spec = spec
        self.nested = tree.is_nested(spec)
        self.leaves = [_Leaf(leaf) for leaf in tree.flatten(spec)]
        self._single = None if self.nested else self.leaves[0]
        # Flattens and converts a value of this field: one array per leaf, or None if the value
        # needs the full validation (see `_Leaf.convert`).
        self.convert: Callable[..., list[Any] | None] = (
            self._convert_nest if self._single is None else self._single.convert
        )

    def _convert_nest(self, value: Any, size: int | None = None) -> list[Any] | None:
        """`convert` for a nested field."""
        try:
            tree.assert_same_structure(self.spec, value, check_types=False)
        except (ValueError, TypeError):
            return None
        out: list[Any] = []
        for leaf, item in zip(self.leaves, tree.flatten(value), strict=True):
            array = leaf.convert(item, size)
            if array is None:
                return None
            out += array
        return out

    def all_finite(self, arrays: list[Any], batched: bool) -> bool:
        """Whether no value of these (converted) leaves is NaN or infinite.

        Args:
          arrays: What `convert` returned.
          batched: Whether they have a batch dimension.

        Returns:
          True if every value is finite (or not a floating point one).
        """
        single = self._single
        if single is not None and single.finite_scalar and not batched:
            return math.isfinite(arrays[0])
        for leaf, array in zip(self.leaves, arrays, strict=True):
            if not leaf.inexact:
                continue
            if leaf.finite_scalar and not batched:
                if not math.isfinite(array):
                    return False
            elif not np.isfinite(array).all():
                return False
        return True

    def zeros(self) -> list[np.ndarray]:
        """One zero value per leaf (no batch dimension)."""
        return [np.zeros(leaf.shape, leaf.dtype) for leaf in self.leaves]


class _FlatSteps:
    """A Trajectory spec flattened once: its fields' leaves and the constant step values.

    A step is written as a flat list in `tree.flatten(spec)` order (Trajectory field order),
    which is what the StructuredWriter's pattern indexes: no nest is packed per step.

    Args:
      spec: The normalized per-step Trajectory spec.
    """

    def __init__(self, spec: Any) -> None:
        self.observation = _Part(spec.observation)
        self.action = _Part(spec.action)
        self.reward = _Part(spec.reward)
        self.hidden = _Part(spec.policy_info)
        step_type = np.dtype(_np_dtype(spec.step_type)).type
        next_step_type = np.dtype(_np_dtype(spec.next_step_type)).type
        discount = np.dtype(_np_dtype(spec.discount)).type
        self.first, self.mid, self.last = step_type(FIRST), step_type(MID), step_type(LAST)
        self.next_mid, self.next_last = next_step_type(MID), next_step_type(LAST)
        self.terminal = discount(TERMINAL_DISCOUNT)
        self.continuing = discount(CONTINUING_DISCOUNT)
        # The final observation of a terminated episode that add_multi was not given.
        self.unknown_final = self.observation.zeros()
        # The boundary step after the observation: zero action and policy info, next_step_type
        # FIRST, zero reward and discount 1.
        self.boundary_tail = [
            *self.action.zeros(),
            *self.hidden.zeros(),
            next_step_type(FIRST),
            *self.reward.zeros(),
            self.continuing,
        ]


def _fast_flag(value: Any) -> bool | None:
    """A Python or numpy bool as `bool`; None for anything else."""
    if value is True or value is False:
        return value
    if type(value) is np.bool_:
        return bool(value)
    return None


def _fast_flags(value: Any, size: int) -> np.ndarray | None:
    """A `[size]` boolean array as is; None for anything else."""
    array = value if type(value) is np.ndarray else to_numpy(value)
    if array.dtype != bool or array.shape != (size,):
        return None
    return array


def _same_bytes(arrays: list[Any], expected: list[bytes]) -> bool:
    """Whether every array's bytes are the expected ones (then the values are equal too)."""
    if len(arrays) == 1:
        return arrays[0].tobytes() == expected[0]
    return all(a.tobytes() == e for a, e in zip(arrays, expected, strict=True))


_SAME_KIND: dict[tuple[np.dtype, np.dtype], bool] = {}


def _same_kind(given: np.dtype, want: np.dtype) -> bool:
    """Whether `given` is cast to `want` (as the full validation does), memoized."""
    key = (given, want)
    allowed = _SAME_KIND.get(key)
    if allowed is None:
        allowed = _SAME_KIND[key] = bool(np.can_cast(given, want, casting="same_kind"))
    return allowed


class _Batch:
    """One call's validated values as flat lists of `[size, ...]` arrays in spec order."""

    def __init__(self, **fields: Any) -> None:
        self.size: int = fields["size"]
        self.states: list[np.ndarray] = fields["states"]
        self.actions: list[np.ndarray] = fields["actions"]
        self.hiddens: list[np.ndarray] = fields["hiddens"]
        self.rewards: list[np.ndarray] = fields["rewards"]
        self.next_states: list[np.ndarray] = fields["next_states"]
        self.final_states: list[np.ndarray] | None = fields["final_states"]
        self.terminated: np.ndarray = fields["terminated"]
        self.ended: np.ndarray = fields["ended"]

    @classmethod
    def build(
        cls,
        spec: Any,
        values: dict[str, Any],
        flags: dict[str, Any],
        hidden: Any,
        *,
        hidden_label: str,
        batched: bool,
    ) -> _Batch:
        """Validates and casts one call's arguments (see `TransitionWriter.add`/`add_multi`).

        Raises:
          SpecMismatchError: Naming the argument (and field) that is wrong.
        """
        names = list(values)
        state, action, reward, next_state = names[:4]
        specs_of = {
            state: spec.observation,
            action: spec.action,
            reward: spec.reward,
            next_state: spec.observation,
        }
        if "final_states" in values:
            specs_of["final_states"] = spec.observation
        leaves = {name: _leaves(name, values[name], specs_of[name]) for name in specs_of}
        leaves[hidden_label] = _hidden_leaves(hidden_label, hidden, spec.policy_info)
        flag_arrays = {name: to_numpy(value) for name, value in flags.items()}
        size = _batch_size(leaves, flag_arrays) if batched else 1
        cast = {
            name: [
                _cast(label, array, leaf_spec, size, batched) for label, array, leaf_spec in items
            ]
            for name, items in leaves.items()
        }
        rewards = cast[reward]
        for label, leaf in zip((label for label, _, _ in leaves[reward]), rewards, strict=True):
            _check_finite(label, leaf, batched)
        done_name, truncated_name = list(flags)
        terminated = _flags(done_name, flag_arrays[done_name], size, batched)
        truncated = _flags(truncated_name, flag_arrays[truncated_name], size, batched)
        return cls(
            size=size,
            states=cast[state],
            actions=cast[action],
            hiddens=cast[hidden_label],
            rewards=rewards,
            next_states=cast[next_state],
            final_states=cast.get("final_states"),
            terminated=terminated,
            ended=terminated | truncated,
        )


def _leaves(name: str, value: Any, spec: Any) -> list[tuple[str, np.ndarray, Any]]:
    """Pairs each leaf of `value` with its spec; a non-nested spec takes `value` whole."""
    if not tree.is_nested(spec):
        return [(name, to_numpy(value), spec)]
    try:
        tree.assert_same_structure(spec, value, check_types=False)
    except (ValueError, TypeError) as e:
        raise SpecMismatchError(f"{name!r}: structure differs from the data spec: {e}") from e
    return [
        (f"{name}/{path}", to_numpy(leaf), leaf_spec)
        for (path, leaf_spec), leaf in zip(
            flatten_with_paths(spec), tree.flatten(value), strict=True
        )
    ]


def _hidden_leaves(label: str, value: Any, spec: Any) -> list[tuple[str, np.ndarray, Any]]:
    if not tree.flatten(spec):
        if value is not None and tree.flatten(value):
            raise SpecMismatchError(
                f"{label!r} was given, but the data spec's policy_info is empty"
            )
        return []
    if value is None:
        raise SpecMismatchError(
            f"{label!r} is required: the data spec's policy_info is "
            f"{[p for p, _ in flatten_with_paths(spec)]}"
        )
    return _leaves(label, value, spec)


def _batch_size(leaves: dict[str, list[tuple[str, np.ndarray, Any]]], flags: dict[str, Any]) -> int:
    sizes: dict[str, int | None] = {
        label: (array.shape[0] if array.ndim else None)
        for items in leaves.values()
        for label, array, _ in items
    }
    sizes.update({name: (a.shape[0] if a.ndim else None) for name, a in flags.items()})
    unbatched = sorted(label for label, size in sizes.items() if size is None)
    if unbatched:
        raise SpecMismatchError(
            f"add_multi needs a leading batch dimension (one row per env), {unbatched} have none"
        )
    if len(set(sizes.values())) != 1:
        shown = ", ".join(f"{label} {size}" for label, size in sizes.items())
        raise SpecMismatchError(f"batch sizes differ: {shown}")
    size = int(next(iter(sizes.values())))
    if size == 0:
        raise SpecMismatchError(
            "add_multi needs at least one env (one row per env), got an empty batch of 0 rows"
        )
    return size


def _cast(label: str, array: np.ndarray, spec: Any, size: int, batched: bool) -> np.ndarray:
    """Checks shape and dtype of one leaf and returns it as `[size, *spec.shape]`."""
    step_shape = tuple(int(d) for d in spec.shape)
    given = array.shape[1:] if batched else array.shape
    if given != step_shape and step_shape == () and given == (1,):
        given = ()
        array = array.reshape([size] if batched else [])
    elif given != step_shape and step_shape == (1,) and given == ():
        # A scalar for a one-element field: gymnasium's Discrete actions for SB3-style specs.
        given = (1,)
        array = array.reshape([size, 1] if batched else [1])
    want = np.dtype(_np_dtype(spec))
    if given != step_shape:
        expected = [size, *step_shape] if batched else list(step_shape)
        raise SpecMismatchError(
            f"{label!r}: expected {want.name}{expected}, got {array.dtype.name}{list(array.shape)}"
        )
    if array.dtype != want:
        if not np.can_cast(array.dtype, want, casting="same_kind"):
            raise SpecMismatchError(
                f"{label!r}: expected dtype {want.name}, got {array.dtype.name} (only casts "
                "within a kind, such as float64 to float32, are made)"
            )
        array = array.astype(want)
    return array if batched else array[np.newaxis]


def _flags(label: str, array: np.ndarray, size: int, batched: bool) -> np.ndarray:
    expected = (size,) if batched else ()
    if array.shape == (*expected, 1):
        array = array.reshape(expected)
    if array.shape != expected:
        raise SpecMismatchError(
            f"{label!r}: expected shape {list(expected)}, got {list(array.shape)}"
        )
    if array.dtype != bool:
        if not np.issubdtype(array.dtype, np.number) or not np.isin(array, (0, 1)).all():
            raise SpecMismatchError(f"{label!r} must be booleans (or 0/1), got {array.tolist()!r}")
        array = array.astype(bool)
    return array.reshape(size)


def _check_finite(label: str, rewards: np.ndarray, batched: bool) -> None:
    if not np.issubdtype(rewards.dtype, np.inexact):
        return
    bad = ~np.isfinite(rewards)
    if bad.any():
        index = np.argwhere(bad)[0]
        where = f" (env {int(index[0])})" if batched else ""
        raise SpecMismatchError(
            f"{label!r} must be finite, got {rewards[tuple(index)].item()!r}{where}"
        )


def _rows_equal(left: Sequence[np.ndarray], right: Sequence[np.ndarray]) -> np.ndarray:
    """Per row: whether every leaf is equal (NaN equal to NaN)."""
    equal = np.ones([left[0].shape[0]], bool) if left else np.ones([0], bool)
    for a, b in zip(left, right, strict=True):
        same = a == b
        if np.issubdtype(a.dtype, np.inexact):
            same |= np.isnan(a) & np.isnan(b)
        equal &= same.reshape(same.shape[0], -1).all(axis=1) if same.size else True
    return equal


def _np_dtype(spec: Any) -> Any:
    dtype = spec.dtype
    return getattr(dtype, "as_numpy_dtype", dtype)  # a tf.DType, or a numpy dtype
