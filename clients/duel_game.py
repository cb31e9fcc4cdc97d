"""A simulated two-team game for self-play: ``red`` and ``blue`` race to a goal, pair by pair.

Pair i is red agent i and blue agent i on a corridor of ``CORRIDOR + 1`` cells with one goal cell. The
first to stand on the goal wins; both at once, or nobody within ``horizon`` ticks, is a draw. Both teams
have the same spaces (the sim game's picker spaces), seen from their own side: ``obs`` = (goal - me,
goal - opponent) / CORRIDOR and the time used, ``goal_side`` = where the goal is (left, here, right);
action ``move`` = Discrete(3) (left, stay, right). Reward: +1 win, -1 loss, 0 draw at the end, plus a
little for each step toward the goal. Each ended episode's info says ``outcome``: win, loss or draw
(docs/self_play.md), which is what the broker's Elo counts.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np

from broker.protocol import DEFAULT_ADDRESS
from broker.protocol.messages import StepData
from broker.protocol.spaces import GroupSpec
from clients.sim_game import picker_spaces

RED, BLUE = "red", "blue"
CORRIDOR = 8
SHAPING = 0.05  # reward per cell of progress toward the goal


class DuelGame:
    def __init__(self, n_pairs: int = 4, seed: int = 0, horizon: int = 24) -> None:
        self.n = n_pairs
        self.horizon = horizon
        self.rng = np.random.default_rng(seed)
        self.cell = {RED: np.zeros(n_pairs, np.int64), BLUE: np.zeros(n_pairs, np.int64)}
        self.goal = np.zeros(n_pairs, np.int64)
        self.t = np.zeros(n_pairs, np.int64)
        self._reset(np.ones(n_pairs, bool))

    def group_specs(self) -> list[GroupSpec]:
        return [GroupSpec(RED, self.n, picker_spaces()), GroupSpec(BLUE, self.n, picker_spaces())]

    def _reset(self, mask: np.ndarray) -> None:
        k = int(mask.sum())
        self.goal[mask] = self.rng.integers(0, CORRIDOR + 1, k)
        start = self.rng.integers(0, CORRIDOR + 1, k)  # both start on the same cell: a fair race
        for team in (RED, BLUE):
            self.cell[team][mask] = start
        self.t[mask] = 0

    def _obs(self, team: str) -> dict[str, np.ndarray]:
        other = BLUE if team == RED else RED
        mine, theirs = self.goal - self.cell[team], self.goal - self.cell[other]
        scaled = np.stack([mine / CORRIDOR, theirs / CORRIDOR, self.t / self.horizon], axis=1).astype(np.float32)
        return {"obs": scaled, "goal_side": (np.sign(mine) + 1).astype(np.int32)}

    def first_step(self) -> dict[str, StepData]:
        zeros = np.zeros(self.n, np.float32)
        flags = np.zeros(self.n, np.bool_)
        return {team: StepData(self._obs(team), zeros, flags, flags) for team in (RED, BLUE)}

    def apply(self, actions: dict[str, dict[str, np.ndarray]]) -> dict[str, StepData]:
        progress = {}
        for team in (RED, BLUE):
            before = np.abs(self.goal - self.cell[team])
            self.cell[team] = np.clip(self.cell[team] + actions[team]["move"].astype(np.int64) - 1, 0, CORRIDOR)
            progress[team] = before - np.abs(self.goal - self.cell[team])
        self.t += 1
        at_goal = {team: self.cell[team] == self.goal for team in (RED, BLUE)}
        won = {RED: at_goal[RED] & ~at_goal[BLUE], BLUE: at_goal[BLUE] & ~at_goal[RED]}
        terminated = at_goal[RED] | at_goal[BLUE]
        truncated = ~terminated & (self.t >= self.horizon)
        done = terminated | truncated
        final_index = np.flatnonzero(done).astype(np.int32)
        final = {team: {k: v[final_index] for k, v in self._obs(team).items()} for team in (RED, BLUE)}
        out = {}
        for team in (RED, BLUE):
            other = BLUE if team == RED else RED
            reward = SHAPING * progress[team] + won[team].astype(np.float64) - won[other].astype(np.float64)
            infos: dict[int, dict[str, Any]] = {}
            for row in final_index.tolist():
                outcome = "win" if won[team][row] else "loss" if won[other][row] else "draw"
                infos[row] = {"outcome": outcome}
            out[team] = (reward.astype(np.float32), infos)
        if done.any():
            self._reset(done)
        return {
            team: StepData(
                self._obs(team),
                reward,
                terminated.copy(),
                truncated.copy(),
                final_index if len(final_index) else None,
                final[team] if len(final_index) else None,
                infos,
            )
            for team, (reward, infos) in out.items()
        }


def run_duel_game(
    address: str, n_pairs: int = 4, seed: int = 0, max_ticks: int | None = None, name: str | None = None
) -> int:
    """Play until the broker closes the game (or ``max_ticks``); returns the ticks played."""
    from clients.game import GameClient

    game = DuelGame(n_pairs, seed)
    client = GameClient(address, game.group_specs(), name=name or f"duel-{seed}")
    try:
        return client.play(game.first_step(), game.apply, max_ticks)
    finally:
        client.close()


def main(argv: list[str] | None = None) -> None:
    from broker.log import configure_logging

    parser = argparse.ArgumentParser(prog="python -m clients.duel_game", description=__doc__.splitlines()[0])
    parser.add_argument("--address", default=DEFAULT_ADDRESS, help="broker address, host:port or unix:/path")
    parser.add_argument("--pairs", type=int, default=4, help="red/blue pairs (agents per team)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-ticks", type=int, default=None)
    args = parser.parse_args(argv)
    configure_logging()
    run_duel_game(args.address, args.pairs, args.seed, args.max_ticks)
    sys.exit(0)


if __name__ == "__main__":
    main()
