"""Team change (``gdrl-train --team-change``): which of two teams learns now (sans-IO: a value and its rules).

Two trainers of an asymmetric game take turns: while one team's trainer learns, the broker plays the other
team from that team's own latest snapshot. A turn lasts ``every`` steps of the idle team (batches the broker
answered for it); then the learner steps aside and the teams swap. The broker holds the one ``Rotation``
of a pair of teams; it is persisted in both teams' pools, and a restarted broker continues the most
advanced of the saved ones (the rotation only moves forward).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class Rotation:
    teams: tuple[str, str]
    every: int  # steps of the idle team per turn
    learner: str
    steps: int = 0  # idle-team steps played in this turn
    turns: int = 0  # hand-overs so far
    finished: tuple[str, ...] = ()  # teams whose trainer stopped for good: the partner learns on, no turns

    def __post_init__(self) -> None:
        if len(self.teams) != 2 or self.teams[0] == self.teams[1] or not all(self.teams):
            raise ValueError(f"a team change needs two different teams, got {list(self.teams)}")
        if self.learner not in self.teams:
            raise ValueError(f"learner '{self.learner}' is not one of {list(self.teams)}")
        if self.every < 1:
            raise ValueError("the team-change period must be at least 1")
        if self.steps < 0 or self.turns < 0:
            raise ValueError("steps and turns must not be negative")
        if not set(self.finished) <= set(self.teams):
            raise ValueError(f"finished teams {list(self.finished)} are not of {list(self.teams)}")

    @property
    def idle(self) -> str:
        """The team the broker plays from its snapshot."""
        return self.teams[1] if self.learner == self.teams[0] else self.teams[0]

    @property
    def turn_over(self) -> bool:
        """The learner's turn is up; never while the idle team's trainer has finished."""
        return self.steps >= self.every and self.idle not in self.finished

    @property
    def progress(self) -> tuple[int, int]:
        return (self.turns, self.steps)

    def counted(self, steps: int = 1) -> Rotation:
        """The idle team was played ``steps`` more steps."""
        return replace(self, steps=self.steps + steps)

    def handed_over(self, finished: bool = False) -> Rotation:
        """The learner stepped aside (``finished``: for good): the idle team learns now, from step 0 of a
        new turn."""
        done = (*self.finished, self.learner) if finished and self.learner not in self.finished else self.finished
        return replace(self, learner=self.idle, steps=0, turns=self.turns + 1, finished=done)

    def resumed(self, team: str) -> Rotation:
        """A trainer of a finished team is back: turns go on."""
        return replace(self, finished=tuple(t for t in self.finished if t != team))

    def pairs(self, team: str, partner: str) -> bool:
        return set(self.teams) == {team, partner}

    def to_dict(self) -> dict[str, Any]:
        return {
            "teams": list(self.teams),
            "every": self.every,
            "learner": self.learner,
            "steps": self.steps,
            "turns": self.turns,
            "finished": list(self.finished),
        }

    @classmethod
    def from_dict(cls, obj: Any) -> Rotation:
        """A rotation saved by ``to_dict``; anything malformed raises ValueError."""
        try:
            teams = obj["teams"]
            return cls(
                (str(teams[0]), str(teams[1])) if len(teams) == 2 else tuple(teams),
                int(obj["every"]),
                str(obj["learner"]),
                int(obj["steps"]),
                int(obj["turns"]),
                tuple(str(t) for t in obj.get("finished", ())),  # absent in states saved before it existed
            )
        except (KeyError, TypeError, IndexError) as exc:
            raise ValueError(f"not a team-change state: {type(exc).__name__}: {exc}") from None


def start(team: str, partner: str, every: int, saved: Iterable[Rotation]) -> Rotation:
    """The rotation of ``team`` and ``partner``: the most advanced saved one of this pair (with the period
    the trainers give now), else a new one in which ``team``, the first to ask, learns first."""
    mine = [r for r in saved if r.pairs(team, partner)]
    if mine:
        return replace(max(mine, key=lambda r: r.progress), every=every)
    return Rotation((team, partner), every, team)


def disagreement(rotation: Rotation, team: str, partner: str, every: int) -> str | None:
    """Why ``team``'s request (partner, period) does not fit the rotation it joins, or None."""
    if not rotation.pairs(team, partner):
        other = rotation.teams[1] if rotation.teams[0] == team else rotation.teams[0]
        return f"'{team}' already changes turns with '{other}', not '{partner}'"
    if rotation.every != every:
        return (
            f"the two trainers disagree on the period: '{team}' asks --team-change-every {every}, "
            f"the rotation of {list(rotation.teams)} runs with {rotation.every}; give both the same"
        )
    return None
