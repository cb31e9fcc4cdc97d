"""Per-policy live numbers: throughput, holds, waiting time per side, episode returns."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from broker.protocol.messages import StepData
from broker.protocol.native import NATIVE


class RateMeter:
    """Events per second over the sliding window that ends now: it falls to 0 once events stop.

    Called on every step, so it keeps at most one mark per ``resolution_s`` (the window's hundredth) and
    the newest total beside them: a rate over a 10 s window needs no finer baseline."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self.resolution_s = window_s / 100
        self.marks: deque[tuple[float, int]] = deque(maxlen=256)  # 100 in the window, and the baseline
        self.latest_at = float("-inf")
        self.latest = 0

    def add(self, now: float, total: int) -> None:
        self.latest_at, self.latest = now, total
        if not self.marks or now - self.marks[-1][0] >= self.resolution_s:
            self.marks.append((now, total))
            self._forget(now)

    def _forget(self, now: float) -> None:
        """Keep the marks inside the window, plus the newest one before it as the baseline."""
        while len(self.marks) > 1 and now - self.marks[1][0] >= self.window_s:
            self.marks.popleft()

    def rate(self, now: float) -> float:
        self._forget(now)
        if not self.marks:
            return 0.0
        t0, n0 = self.marks[0]
        if now - self.latest_at >= self.window_s:  # nothing inside the window: only the baseline is left
            return 0.0
        return (self.latest - n0) / (now - t0) if now > t0 else 0.0


@dataclass
class PolicyMetrics:
    batches: int = 0
    env_steps: int = 0
    group_ticks: int = 0  # game ticks that carried this policy's group
    held_ticks: int = 0  # of those, answered without this policy's actions
    longest_hold: int = 0  # most ticks one delivered transition spanned
    trainer_wait_s: float = 0.0  # trainer asked, games had not delivered yet
    trainer_busy_s: float = 0.0  # batch sent, trainer had not answered yet
    episodes: deque[float] = field(default_factory=lambda: deque(maxlen=100))
    episode_count: int = 0
    returns: np.ndarray | None = None
    steps_rate: RateMeter = field(default_factory=RateMeter)
    ticks_rate: RateMeter = field(default_factory=RateMeter)

    def record_batch(self, data: StepData, waited_s: float, now: float) -> None:
        """Account one batch sent to the trainer (returns are summed per row until episodes end)."""
        n = len(data.reward)
        self.batches += 1
        self.env_steps += n
        self.trainer_wait_s += waited_s
        self.steps_rate.add(now, self.env_steps)
        if data.frames is not None and n:
            self.longest_hold = max(self.longest_hold, int(data.frames.max()))
        if self.returns is None or len(self.returns) != n:
            self.returns = np.zeros(n, np.float64)
        finished = (
            None if NATIVE is None else NATIVE.add_returns(self.returns, data.reward, data.terminated, data.truncated)
        )
        if finished is None:  # numpy's way, for what the C loop does not read
            self.returns += data.reward
            ended = data.terminated | data.truncated
            finished = self.returns[ended].tolist() if np.count_nonzero(ended) else []
            self.returns[ended] = 0.0
        if finished:
            self.episodes.extend(finished)
            self.episode_count += len(finished)

    def status(self, now: float, **state: Any) -> dict[str, Any]:
        """The numbers, after ``state`` (agents, envs, trainer, state, mode: what the hub knows)."""
        return {
            **state,
            "env_steps": self.env_steps,
            "steps_per_s": round(self.steps_rate.rate(now), 1),
            "game_ticks_per_s": round(self.ticks_rate.rate(now), 1),
            "mean_episode_reward": round(float(np.mean(self.episodes)), 4) if self.episodes else None,
            "episodes": self.episode_count,
            "held_fraction": round(self.held_ticks / self.group_ticks, 4) if self.group_ticks else 0.0,
            "longest_hold": self.longest_hold,
            "trainer_waited_s": round(self.trainer_wait_s, 3),
            "games_waited_s": round(self.trainer_busy_s, 3),
        }
