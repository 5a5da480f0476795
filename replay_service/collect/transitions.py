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

from collections.abc import Sequence
from typing import Any

import numpy as np
import tree

from replay_service.collect.env_writers import EnvWriters
from replay_service.collect.observer import WriteTarget
from replay_service.collect.stacked_steps import StackedSteps
from replay_service.collect.transition_steps import (
    Batch,
    FlatSteps,
    check_continues,
    fast_flag,
    fast_flags,
    final_observations,
    gather_extras,
    same_bytes,
)
from replay_service.collect.writing import CheckedStep, WritingClient, checked_step_type
from replay_service.config.options import Timeouts
from replay_service.errors import ManagerClosedError, SpecMismatchError
from replay_service.specs.arrays import to_numpy
from replay_service.specs.frames import FrameStack
from replay_service.specs.layouts import NESTED, Layout
from replay_service.specs.nests import check_collect_spec
from replay_service.specs.windows import padding_step


class TransitionWriter(StackedSteps):
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
        frame_stack: int | None = None,
        frame_axis: int = 0,
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
        self._check_continuity = check_continuity
        self._spec = spec
        # A frame-stacked table's writers check each stack as it is appended; the stacks an
        # append would refuse after others of the same call were appended (an episode's first,
        # a terminal step's final one) are checked here first, so a refused call writes nothing.
        self._frames = (
            None
            if frame_stack is None
            else FrameStack(frame_stack, frame_axis, 0, tuple(spec.observation.shape))
        )
        self._frames_where = f"table {table_name!r} (frame_stack={frame_stack})"
        self._plan = FlatSteps(spec)
        # The fast path's steps, cast to the plan's dtypes and shapes: `CheckedStep`s for a
        # client whose writers take them as they are once they checked one.
        self._checked: type[CheckedStep] | None = (
            checked_step_type() if getattr(client, "takes_checked_steps", False) else None
        )
        # The names of a policy_info dict: extra per-step fields given as keywords.
        info = spec.policy_info
        self._extra_names: tuple[str, ...] = (
            tuple(info) if isinstance(info, dict) and tree.flatten(info) else ()
        )
        self._hidden_extra = "hidden" in self._extra_names
        self._batched: bool | None = None
        # One writer per env; a padded table stores Masked(step, mask), flat: the step's
        # leaves, then the mask.
        self._envs = EnvWriters(
            target, tree.flatten(padding_step(spec)) if pad_end_of_episode else None
        )
        # The previous call's next states, one `bytes` per observation leaf (all envs' rows).
        self._expected: list[bytes | bytearray] = []
        self._has_expected: list[bool] = []
        self._closed = False
        bindable = check_continuity and not pad_end_of_episode and not extra_tables
        self._init_stacked(frame_stack, frame_axis, bindable)

    @property
    def num_envs(self) -> int | None:
        """Environments written for (1 for `add`); None before the first call."""
        return None if self._batched is None else len(self._envs.writers)

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
        stacked = self._stacked
        if (
            stacked
            and hidden is None
            and not extras
            and self._add_stacked(state, action, reward, next_state, done, truncated)
        ):
            return
        label = "hidden"
        if extras or (hidden is not None and self._hidden_extra and not isinstance(hidden, dict)):
            hidden, label = gather_extras(self._extra_names, hidden, extras, "hidden"), "extras"
        elif hidden is None and self._extra_names:
            gather_extras(self._extra_names, None, {}, "hidden")  # raises: names the missing extras
        if (
            self._batched is False
            and not self._closed
            and self._add_fast(state, action, reward, next_state, done, truncated, hidden)
        ):
            return
        self._require_open()
        batch = Batch.build(
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
            hiddens, label = gather_extras(self._extra_names, hiddens, extras, "hiddens"), "extras"
        elif hiddens is None and self._extra_names:
            gather_extras(
                self._extra_names, None, {}, "hiddens"
            )  # raises: names the missing extras
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
        batch = Batch.build(self._spec, values, flags, hiddens, hidden_label=label, batched=True)
        final_states = final_observations(batch)
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
        envs = self._envs
        indices = range(len(envs.writers)) if env_index is None else [env_index]
        for index in indices:
            if envs.steps[index]:
                envs.end_episode(index)
            self._has_expected[index] = False

    def flush(self, timeout_ms: int | None = None) -> None:
        """Blocks until every item written so far is confirmed by the server.

        Args:
          timeout_ms: Bound on each writer's wait in milliseconds; None: the write timeout.

        Raises:
          WriteTimeoutError: If that takes longer than the bound (the items stay on their way
            to the server; the writer stays usable).
        """
        self._envs.flush(timeout_ms)

    def close(self) -> None:
        """Flushes pending items, ends every episode and closes the writers. Idempotent.

        Raises:
          WriteTimeoutError: If the server does not confirm the pending items in time (the
            writer is closed all the same).
        """
        if self._closed:
            return
        self._closed = True
        self._stacked = False
        self._envs.close()

    def __enter__(self) -> TransitionWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
        hiddens = plan.hidden.convert_optional(hidden)
        if hiddens is None:
            return False
        if not plan.reward.all_finite(rewards, batched=False):
            return False
        terminated = fast_flag(done)
        cut = fast_flag(truncated)
        if terminated is None or cut is None:
            return False
        if self._check_continuity and self._has_expected[0]:
            if not same_bytes(states, self._expected):
                return False
            if self._stack is not None:
                # The state is the previous next_state's copy, byte for byte: the step holds
                # that copy (read-only; a writer need not copy it again), not the caller's array.
                states = [np.ndarray(*self._stack, self._expected[0])]
        ended = terminated or cut
        if self._frames is not None and ended:
            self._check_stacks(states, [next_states[0]], [True])
        step = [
            plan.mid if self._envs.steps[0] else plan.first,
            *states,
            *actions,
            *hiddens,
            plan.next_last if ended else plan.next_mid,
            *rewards,
            plan.terminal if terminated else plan.continuing,
        ]
        checked = self._checked
        self._envs.append(0, step if checked is None else checked(step))
        if ended:
            boundary = [plan.last, *next_states, *plan.boundary_tail]
            self._envs.append(0, boundary if checked is None else checked(boundary))
            self._envs.end_episode(0, confirm=False)
        if self._pool:
            self._keep_next(next_states[0])
        elif self._check_continuity:
            self._expected = (
                [next_states[0].tobytes()]
                if len(next_states) == 1
                else [a.tobytes() for a in next_states]
            )
        self._has_expected[0] = not ended
        if self._stacked is None and self._stacked_possible:
            self._bind_stacked()
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
        size = len(self._envs.writers)
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
        hidden_leaves = plan.hidden.convert_optional(hiddens, size)
        if hidden_leaves is None:
            return False
        if not plan.reward.all_finite(reward_leaves, batched=True):
            return False
        terminated = fast_flags(dones, size)
        cut = terminated if truncated is None else fast_flags(truncated, size)
        if terminated is None or cut is None:
            return False
        ended = terminated | cut
        if final_leaves is None and (ended & ~terminated).any():
            return False
        if (
            self._check_continuity
            and any(self._has_expected)
            and not (all(self._has_expected) and same_bytes(state_leaves, self._expected))
        ):
            return False
        ended_rows = ended.tolist()
        terminal_rows = terminated.tolist()
        if self._frames is not None:
            self._check_stacks(
                state_leaves[0], None if final_leaves is None else final_leaves[0], ended_rows
            )
        first, mid, next_mid, next_last = plan.first, plan.mid, plan.next_mid, plan.next_last
        columns = [
            [mid if steps else first for steps in self._envs.steps],
            *map(list, state_leaves),
            *map(list, action_leaves),
            *map(list, hidden_leaves),
            [next_last if end else next_mid for end in ended_rows],
            *map(list, reward_leaves),
            [plan.terminal if end else plan.continuing for end in terminal_rows],
        ]
        for index, step in enumerate(zip(*columns, strict=True)):
            self._envs.append(index, step)
            if ended_rows[index]:
                final = (
                    plan.unknown_final
                    if final_leaves is None
                    else [leaf[index] for leaf in final_leaves]
                )
                self._envs.append(index, [plan.last, *final, *plan.boundary_tail])
                self._envs.end_episode(index, confirm=False)
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
            self._envs.start(num_envs)
            self._has_expected = [False] * num_envs
            return
        if self._batched != batched:
            used, called = ("add_multi", "add") if self._batched else ("add", "add_multi")
            raise SpecMismatchError(
                f"this writer was used with {used}(); {called}() cannot be mixed with it "
                "(use one writer per environment or vector of environments)"
            )
        if num_envs != len(self._envs.writers):
            raise SpecMismatchError(
                f"this writer collects from {len(self._envs.writers)} envs (set by its first "
                f"add_multi call), got a batch of {num_envs}"
            )

    def _check_state(self, states: list[np.ndarray], label: str) -> None:
        if self._check_continuity:
            check_continues(states, self._expected, self._has_expected, self._batched, label)

    def _write(self, batch: Batch, final_states: list[np.ndarray]) -> None:
        plan = self._plan
        if self._frames is not None:
            self._check_stacks(
                batch.states[0],
                final_states[0] if final_states else None,
                [bool(end) for end in batch.ended],
            )
        for index in range(batch.size):
            ended = bool(batch.ended[index])
            self._envs.append(
                index,
                [
                    plan.mid if self._envs.steps[index] else plan.first,
                    *[leaf[index] for leaf in batch.states],
                    *[leaf[index] for leaf in batch.actions],
                    *[leaf[index] for leaf in batch.hiddens],
                    plan.next_last if ended else plan.next_mid,
                    *[leaf[index] for leaf in batch.rewards],
                    plan.terminal if batch.terminated[index] else plan.continuing,
                ],
            )
            if ended:
                self._envs.append(
                    index,
                    [plan.last, *[leaf[index] for leaf in final_states], *plan.boundary_tail],
                )
                self._envs.end_episode(index, confirm=False)

    def _remember(self, next_states: list[np.ndarray], known: list[bool]) -> None:
        if self._check_continuity:
            self._expected = [leaf.tobytes() for leaf in next_states]
            self._expected_kept = None
        self._has_expected = [bool(k) for k in known]
