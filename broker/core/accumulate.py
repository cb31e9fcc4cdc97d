"""Per-slot accumulation of game ticks between two deliveries to a trainer (hold-and-accumulate).

A ``SlotAccumulator`` starts from the first tick a game reports after a delivery and merges every later
tick until the trainer next receives the slot's rows. Per agent it keeps the newest observation, the reward
summed since the last delivery, the number of ticks (``frames``), and the first episode end: once an agent's
episode has ended its transition is closed (reward, flags and final observation are frozen) while its
observation keeps following the new episode, so the trainer acts on the newest state.
With one tick per delivery (strict stepping) the result is exactly that tick.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from broker.protocol.messages import StepData


class SlotAccumulator:
    def __init__(self, first: StepData) -> None:
        n = first.n_rows
        self.obs = first.obs
        self.reward = np.array(first.reward, dtype=np.float32, copy=True)
        self.terminated = np.array(first.terminated, dtype=np.bool_, copy=True)
        self.truncated = np.array(first.truncated & ~first.terminated, dtype=np.bool_, copy=True)
        self.closed = self.terminated | self.truncated
        self.frames = np.ones(n, np.int32)
        self.infos: dict[int, dict[str, Any]] = {row: dict(info) for row, info in first.infos.items()}
        self.final_obs: dict[str, np.ndarray] | None = None
        self.has_final = np.zeros(n, np.bool_)
        self._store_finals(first, self.closed)
        self.last_tick = -1  # the game tick merged last (set by the hub)

    @property
    def ticks(self) -> int:
        return int(self.frames.max(initial=0))

    def merge(self, step: StepData) -> None:
        open_rows = ~self.closed
        self.reward[open_rows] += step.reward[open_rows]
        self.frames[open_rows] += 1
        ended = open_rows & (step.terminated | step.truncated)
        if ended.any():
            self.terminated |= ended & step.terminated
            self.truncated |= ended & step.truncated & ~step.terminated
            self.closed |= ended
            self._store_finals(step, ended)
        self.obs = step.obs
        for row, info in step.infos.items():
            self.infos.setdefault(row, {}).update(info)

    def _store_finals(self, step: StepData, rows: np.ndarray) -> None:
        """Keep the final observation of the ``rows`` whose episode ended in ``step``."""
        if not rows.any():
            return
        if self.final_obs is None:
            self.final_obs = {k: np.zeros_like(v) for k, v in step.obs.items()}
        given = np.zeros(len(rows), np.bool_)
        if step.final_index is not None and step.final_obs is not None and len(step.final_index):
            wanted = rows[step.final_index]
            for key, values in step.final_obs.items():
                self.final_obs[key][step.final_index[wanted]] = values[wanted]
            given[step.final_index[wanted]] = True
        # A game that sends no final observation: the episode's last reported one stands in (godot_rl's way).
        missing = rows & ~given
        if missing.any():
            for key, values in step.obs.items():
                self.final_obs[key][missing] = values[missing]
        self.has_final |= rows

    def step_data(self, with_frames: bool) -> StepData:
        final_index = final_obs = None
        if self.final_obs is not None and self.has_final.any():
            final_index = np.flatnonzero(self.has_final).astype(np.int32)
            final_obs = {k: v[final_index] for k, v in self.final_obs.items()}
        return StepData(
            self.obs,
            self.reward,
            self.terminated,
            self.truncated,
            final_index,
            final_obs,
            self.infos,
            self.frames if with_frames else None,
        )
