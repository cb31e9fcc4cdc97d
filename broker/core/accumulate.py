"""Per-slot accumulation of game ticks between two deliveries to a trainer (hold-and-accumulate).

A ``SlotAccumulator`` starts from the first tick a game reports after a delivery and merges every later
tick until the trainer next receives the slot's rows. Per agent it keeps the newest observation, the reward
summed since the last delivery, the number of ticks (``frames``), and the first episode end: once an agent's
episode has ended its transition is closed (reward, flags and final observation are frozen) while its
observation keeps following the new episode, so the trainer acts on the newest state.
Infos are never merged across ticks (a game sending new keys every tick would grow them without bound
while its policy is held): an open row's info is the newest tick's, a closed row keeps the info of the
tick that closed it. So a slot holds at most one tick's infos, whatever the number of held ticks.
With one tick per delivery (strict stepping) the result is exactly that tick.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from broker.protocol.messages import StepData
from broker.protocol.native import NATIVE
from broker.protocol.spaces import GroupSpec


class SlotAccumulator:
    """The ticks of one slot since its last delivery. A slot that gets one tick per delivery (barrier and
    strict stepping, and most hold-mode ticks) keeps that tick as it came: the arrays are copied into
    accumulators only when a second tick arrives, or when the tick needs work (see ``_as_is``)."""

    def __init__(self, first: StepData) -> None:
        self._first: StepData | None = first if _as_is(first) else None
        if self._first is None:
            self._open(first)
        self.last_tick = -1  # the game tick merged last (set by the hub)
        self.ticks = 1  # game ticks merged so far

    def _open(self, first: StepData) -> None:
        """Start accumulating from ``first``: the arrays become this slot's own."""
        self._first = None
        self.obs = first.obs
        self.reward = np.array(first.reward, dtype=np.float32, copy=True)
        self.terminated = np.array(first.terminated, dtype=np.bool_, copy=True)
        self.truncated = np.array(first.truncated & ~first.terminated, dtype=np.bool_, copy=True)
        self.frames = np.ones(first.n_rows, np.int32)
        self.infos: dict[int, dict[str, Any]] = {row: dict(info) for row, info in first.infos.items()}
        # Final observations stay sparse: (rows, obs of those rows) per tick that ended episodes.
        self._finals: list[tuple[np.ndarray, dict[str, np.ndarray]]] = []
        self._store_finals(first, self.closed)

    @property
    def closed(self) -> np.ndarray:
        """Rows whose transition has ended with their episode."""
        if self._first is not None:
            return self._first.terminated | self._first.truncated
        return self.terminated | self.truncated

    def any_closed(self) -> bool:
        """Whether any row's transition has ended with its episode (asked of every slot an act answers)."""
        first = self._first
        if first is not None and NATIVE is not None:
            count: int | None = NATIVE.ended_rows(first.terminated, first.truncated)
            if count is not None:
                return count > 0
        return bool(self.closed.any())

    def mark_not_applied(self, rows: list[int]) -> None:
        """Say in these rows' infos that the actions answering them were not applied (their episode ended)."""
        if self._first is not None:
            self._open(self._first)
        for row in rows:
            self.infos.setdefault(row, {})["action_applied"] = False

    def merge(self, step: StepData) -> None:
        if self._first is not None:
            self._open(self._first)
        self.ticks += 1
        open_rows = ~self.closed
        self.reward[open_rows] += step.reward[open_rows]
        self.frames[open_rows] += 1
        ended = open_rows & (step.terminated | step.truncated)
        if ended.any():
            self.terminated |= ended & step.terminated
            self.truncated |= ended & ~step.terminated
            self._store_finals(step, ended)
        self.obs = step.obs
        for row, info in step.infos.items():
            if open_rows[row]:  # replaced, not merged; closed rows keep the info their episode ended with
                self.infos[row] = dict(info)

    def _store_finals(self, step: StepData, rows: np.ndarray) -> None:
        """Keep the final observation of the ``rows`` whose episode ended in ``step``."""
        if not rows.any():
            return
        given = np.zeros(len(rows), np.bool_)
        if step.final_index is not None and step.final_obs is not None and len(step.final_index):
            wanted = rows[step.final_index]
            if wanted.all():  # the usual case: the game's own sparse rows, kept as they are
                self._finals.append((step.final_index, step.final_obs))
            elif wanted.any():
                self._finals.append((step.final_index[wanted], {k: v[wanted] for k, v in step.final_obs.items()}))
            given[step.final_index[wanted]] = True
        # A game that sends no final observation: the episode's last reported one stands in (godot_rl's way).
        missing = np.flatnonzero(rows & ~given).astype(np.int32)
        if len(missing):
            self._finals.append((missing, {k: v[missing] for k, v in step.obs.items()}))

    def step_data(self, with_frames: bool) -> StepData:
        first = self._first
        if first is not None:
            if not with_frames:
                return first  # immutable: the tick as it came is the transition
            return StepData.unchecked(
                first.obs, first.reward, first.terminated, first.truncated, first.final_index, first.final_obs,
                first.infos, np.ones(first.n_rows, np.int32),
            )  # fmt: skip
        final_index = final_obs = None
        if len(self._finals) == 1:
            final_index, final_obs = self._finals[0]
        elif self._finals:
            index = np.concatenate([rows for rows, _ in self._finals])
            order = np.argsort(index, kind="stable")
            final_index = index[order].astype(np.int32)
            keys = self._finals[0][1]
            final_obs = {k: np.concatenate([obs[k] for _, obs in self._finals])[order] for k in keys}
        return StepData.unchecked(
            self.obs,
            self.reward,
            self.terminated,
            self.truncated,
            final_index,
            final_obs,
            self.infos,
            self.frames if with_frames else None,
        )


def _as_is(step: StepData) -> bool:
    """``step`` can be delivered unchanged as a one-tick accumulation: no row both terminated and truncated,
    and every ended row's final observation given by the game (exactly those rows)."""
    if NATIVE is not None:  # one pass over the flags in C, no temporary arrays
        known: bool | None = NATIVE.as_is(step.terminated, step.truncated, step.final_index, step.final_obs)
        if known is not None:
            return known
    ended = step.terminated | step.truncated
    if not np.count_nonzero(ended):  # cheaper than ended.any() on a step's small arrays
        return step.final_index is None or len(step.final_index) == 0  # an empty or absent final block
    index = step.final_index
    if index is None or step.final_obs is None or (step.terminated & step.truncated).any():
        return False
    return len(index) == int(np.count_nonzero(ended)) and bool(ended[index].all())


def replaced_game_step(last_obs: dict[str, np.ndarray], start: int, data: StepData) -> StepData:
    """A game's first step in a slot the trainer already saw: the old episodes end truncated, with the
    last observation the trainer saw of that slot (rows from ``start``) as their final observation."""
    n = data.n_rows
    final_obs = {k: v[start : start + n] for k, v in last_obs.items()}
    return StepData.unchecked(
        data.obs,
        np.zeros(n, np.float32),
        np.zeros(n, np.bool_),
        np.ones(n, np.bool_),
        np.arange(n, dtype=np.int32),
        final_obs,
        {row: {**data.infos.get(row, {}), "game_replaced": True} for row in range(n)},
    )


def keep_ended_rows(
    accumulator: SlotAccumulator | None,
    last: dict[str, np.ndarray] | None,
    group: GroupSpec,
    part: dict[str, np.ndarray],
) -> dict[str, np.ndarray]:
    """Rows whose episode ended after the observation these actions answer keep their ``last`` action
    (zeros before the first), and their info says so."""
    if accumulator is None or not accumulator.any_closed():
        return part
    stale = accumulator.closed
    previous = last or group.zero_actions()
    accumulator.mark_not_applied(np.flatnonzero(stale).tolist())
    return {k: np.where(stale.reshape(-1, *([1] * (v.ndim - 1))), previous[k], v) for k, v in part.items()}
