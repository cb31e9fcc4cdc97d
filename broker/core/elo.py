"""Elo ratings for any number of teams, from episode outcomes (sans-IO: a table of numbers and its rules).

A player is a live policy (named by its policy, e.g. ``red``) or a frozen snapshot (``red@snapshot-000003``).
An episode of one agent of a team gives that team a score, 1 win, 0.5 draw, 0 loss, against every other
team in the game; with N teams the K factor is split over the N - 1 pairings, so one outcome moves a
rating as much as in a two-team game. Ratings start at 1200, ML-Agents' ghost trainer's start and K.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

INITIAL_RATING = 1200.0
K_FACTOR = 16.0
OUTCOME_SCORES = {"win": 1.0, "draw": 0.5, "loss": 0.0}  # the ``outcome`` info key's values


def outcome_score(info: dict[str, Any] | None, episode_return: float) -> float:
    """An agent's score for its ended episode: the ``outcome`` info key if the game sets it, else the sign
    of the episode's return (positive win, zero draw, negative loss)."""
    outcome = info.get("outcome") if info else None
    if isinstance(outcome, str) and outcome in OUTCOME_SCORES:
        return OUTCOME_SCORES[outcome]
    if not math.isfinite(episode_return) or episode_return == 0.0:
        return 0.5
    return 1.0 if episode_return > 0 else 0.0


def expected_score(rating: float, opponent: float) -> float:
    return 1.0 / (1.0 + 10.0 ** ((opponent - rating) / 400.0))


class EloTable:
    """Ratings and game counts by player; ``record`` applies one outcome."""

    def __init__(self, ratings: dict[str, float] | None = None, games: dict[str, int] | None = None) -> None:
        self.ratings: dict[str, float] = dict(ratings or {})
        self.games: dict[str, int] = dict(games or {})

    def rating(self, player: str) -> float:
        return self.ratings.get(player, INITIAL_RATING)

    def record(self, player: str, score: float, opponents: Iterable[str]) -> None:
        """``player`` scored ``score`` (0..1) in one episode against each of ``opponents``."""
        others = [o for o in opponents if o != player]
        if not others:
            return
        k = K_FACTOR / len(others)
        mine = self.rating(player)
        for other in others:
            theirs = self.rating(other)
            change = k * (score - expected_score(mine, theirs))
            self.ratings[player] = self.rating(player) + change
            self.ratings[other] = theirs - change
            self.games[other] = self.games.get(other, 0) + 1
        self.games[player] = self.games.get(player, 0) + 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "ratings": {p: round(r, 3) for p, r in sorted(self.ratings.items())},
            "games": dict(sorted(self.games.items())),
        }

    @classmethod
    def from_dict(cls, obj: Any) -> EloTable:
        """A table saved by ``to_dict``; anything malformed in it raises ValueError."""
        if not isinstance(obj, dict):
            raise ValueError("elo table must be a map")
        ratings, games = obj.get("ratings", {}), obj.get("games", {})
        if not isinstance(ratings, dict) or not isinstance(games, dict):
            raise ValueError("elo table: ratings and games must be maps")
        try:
            return cls({str(p): float(r) for p, r in ratings.items()}, {str(p): int(n) for p, n in games.items()})
        except (TypeError, ValueError) as exc:
            raise ValueError(f"elo table: {exc}") from None
