"""Team change in the broker: the one place that decides which of two teams' trainers learns now.

Each trainer (``gdrl-train --policy A --team-change B``) sends the control command ``team_change`` with
its team, partner, pool and period, whenever it wants to know whose turn it is. The broker answers with
the rotation (broker/core/team_change.py) and keeps the idle team frozen at its own latest snapshot: an
ordinary ``FrozenGroup`` over that team's pool, so the hub has no special case. The idle team's answered
batches count the turn; once it is over the learner's trainer writes a snapshot, closes its session and
asks again with ``detached``: the broker then freezes that team and frees the other for its trainer, in
one step of the event loop (at no moment are both groups frozen or both trainer-served by the rotation).
The rotation is saved in both pools' ``pool.json``; a restarted broker continues the most advanced one.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from broker.core import team_change as rule
from broker.core.team_change import Rotation
from broker.protocol.spaces import PolicySpaces
from broker.server.frozen import ControlError, FrozenGroup
from broker.server.pool import PoolSettings, SnapshotPool, list_snapshots

if TYPE_CHECKING:
    from broker.server.frozen import FrozenGroups

log = structlog.get_logger("gdrl.team_change")

DETACH_WAIT_S = 10.0  # how long a ``detached`` request waits for the trainer's session to leave the hub
NO_SWAP = 2**62  # a team pool plays its latest snapshot for the whole turn


def team_pool(team: str, directory: str) -> SnapshotPool:
    """The pool a team is frozen from: always its newest snapshot."""
    settings = PoolSettings(str(Path(directory).resolve()), team, window=1, play_latest=1.0, swap_every=NO_SWAP)
    try:
        return SnapshotPool(settings)
    except ValueError as exc:
        raise ControlError(f"team_change: {exc}") from None


def saved_rotation(pool: SnapshotPool) -> Rotation | None:
    if pool.team_change is None:
        return None
    try:
        return Rotation.from_dict(pool.team_change)
    except ValueError as exc:
        raise ControlError(f"team_change: {pool.state_path}: {exc}") from None


class TeamChange:
    """The rotation of one pair of teams, their pools, and the frozen group of the idle one."""

    def __init__(self, groups: FrozenGroups, rotation: Rotation) -> None:
        self.groups = groups
        self.rotation = rotation
        self.pools: dict[str, SnapshotPool] = {}

    def join(self, team: str, directory: str) -> None:
        """``team``'s pool (read once; its snapshots' spaces checked), and the rotation saved in it if that
        is further on than ours."""
        known = self.pools.get(team)
        if known is not None and known.directory == Path(directory).resolve():
            return
        if known is not None and team in self.groups.groups:
            raise ControlError(f"team_change: '{team}' is played from {known.directory}; it cannot change pools now")
        pool = team_pool(team, directory)
        _check_pool_spaces(pool, self.groups.server.hub.policies[team].spaces, team)
        saved = saved_rotation(pool)
        self.pools[team] = pool
        for player, rating in pool.elo.ratings.items():
            self.groups.elo.ratings.setdefault(player, rating)
            self.groups.elo.games.setdefault(player, pool.elo.games.get(player, 0))
        if saved is not None and saved.pairs(*self.rotation.teams) and saved.progress > self.rotation.progress:
            self.rotation = replace(saved, every=self.rotation.every)
            log.info("team change continued", pool=str(pool.directory), **self.rotation.to_dict())
        self.save()

    def hand_over(self, finished: bool = False) -> None:
        """The learner's trainer has left (``finished``: for good): freeze its team, free the other for its
        trainer, count a turn."""
        old = self.rotation
        self.freeze(old.learner)
        self.rotation = old.handed_over(finished)
        if old.idle in self.groups.groups:
            self.groups.unfreeze(old.idle)
        log.info("team change", learner=self.rotation.learner, frozen=old.learner, turns=self.rotation.turns)
        self.save()

    def resume(self, team: str) -> None:
        """A trainer of a finished team asks again: the turns go on from here."""
        self.rotation = self.rotation.resumed(team)
        log.info("team change resumed", team=team, learner=self.rotation.learner)
        self.save()

    def settle(self) -> None:
        """Play the idle team from its pool once its trainer is away (and its pool known)."""
        idle = self.rotation.idle
        pool = self.pools.get(idle)
        if pool is None or idle in self.groups.groups or idle in self.groups.server.hub.trainers:
            return
        if pool.snapshots():  # its trainer writes one before it first asks
            self.freeze(idle)

    def freeze(self, team: str) -> None:
        pool = self.pools[team]
        if not pool.snapshots():
            raise ControlError(f"team_change: {pool.directory} has no snapshot of '{team}' to play it from")
        pool.opponent = None  # the newest snapshot, not the one of an earlier turn
        partner = self.rotation.teams[1] if self.rotation.teams[0] == team else self.rotation.teams[0]
        frozen = self.groups._attach(FrozenGroup(self.groups, team, pool=pool, rivals=(partner,)))
        frozen.on_answered = self.count
        frozen._maybe_swap()

    def count(self) -> None:
        self.rotation = self.rotation.counted()
        for pool in self.pools.values():
            pool.team_change = self.rotation.to_dict()  # the frozen group saves its pool every second

    def save(self) -> None:
        for pool in self.pools.values():
            pool.team_change = self.rotation.to_dict()
            pool.elo = self.groups.elo
            try:
                pool.save_state()
            except OSError as exc:
                log.error("team-change state not saved", pool=str(pool.directory), error=str(exc))

    def status(self, team: str | None = None) -> dict[str, Any]:
        r = self.rotation
        out: dict[str, Any] = {**r.to_dict(), "idle": r.idle, "turn_over": r.turn_over}
        out["pools"] = {t: str(p.directory) for t, p in self.pools.items()}
        out["frozen"] = [t for t in r.teams if t in self.groups.groups]
        if team is not None:
            out["learns"] = r.learner == team and not r.turn_over
        return out


class TeamChanges:
    """Every team change of one broker, by team."""

    def __init__(self, groups: FrozenGroups) -> None:
        self.groups = groups
        self.by_team: dict[str, TeamChange] = {}

    async def control(self, args: dict[str, Any]) -> dict[str, Any]:
        """One trainer's ``team_change`` request: join (or check) the rotation, hand over if it stepped
        aside, keep the idle team frozen, and say whose turn it is."""
        team, partner, pool_dir, every, detached, finished = _request(args)
        self._check_groups(team, partner)
        change = self._change(team, partner, every)
        try:
            change.join(team, pool_dir)
        except ControlError:
            if not change.pools:  # a refused first request leaves no rotation behind
                self.by_team.pop(team, None)
                self.by_team.pop(partner, None)
            raise
        if detached:
            await self._wait_detached(team)
            if change.rotation.learner == team and (change.rotation.turn_over or finished):
                change.hand_over(finished)  # the learner stepped aside at the end of its turn, or for good
        elif team in change.rotation.finished:
            change.resume(team)
        change.settle()
        return {"team_change": change.status(team)}

    def _check_groups(self, team: str, partner: str) -> None:
        policies = self.groups.server.hub.policies
        if team == partner:
            raise ControlError("team_change: the partner must be another group than the team")
        for name, what in ((team, "team"), (partner, "partner")):
            if name not in policies:
                known = ", ".join(sorted(policies)) or "none"
                raise ControlError(f"team_change: unknown {what} '{name}': the games have groups {known}")
            frozen = self.groups.groups.get(name)
            if frozen is not None and frozen.on_answered is None:
                raise ControlError(f"team_change: '{name}' is frozen by freeze or self_play; unfreeze it first")

    def _change(self, team: str, partner: str, every: int) -> TeamChange:
        change = self.by_team.get(team) or self.by_team.get(partner)
        if change is None:
            try:
                change = TeamChange(self.groups, rule.start(team, partner, every, []))
            except ValueError as exc:
                raise ControlError(f"team_change: {exc}") from None
            self.by_team[team] = self.by_team[partner] = change
            return change
        problem = rule.disagreement(change.rotation, team, partner, every)
        if problem is None and self.by_team.get(partner, change) is not change:
            problem = f"'{partner}' already changes turns with another team"
        if problem:
            raise ControlError(f"team_change: {problem}")
        return change

    async def _wait_detached(self, team: str) -> None:
        deadline = time.monotonic() + DETACH_WAIT_S
        while team in self.groups.server.hub.trainers:
            if time.monotonic() > deadline:
                raise ControlError(f"team_change: '{team}' still has a trainer session; close it before 'detached'")
            await asyncio.sleep(0.02)

    def save(self) -> None:
        for change in set(self.by_team.values()):
            change.save()

    def status(self) -> dict[str, Any]:
        return {" & ".join(c.rotation.teams): c.status() for c in dict.fromkeys(self.by_team.values())}


def _request(args: dict[str, Any]) -> tuple[str, str, str, int, bool, bool]:
    values = []
    for key in ("team", "partner", "pool"):
        value = args.get(key)
        if not isinstance(value, str) or not value:
            raise ControlError(f"team_change needs '{key}' (a non-empty string)")
        values.append(value)
    every, detached = args.get("every"), args.get("detached", False)
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ControlError(f"team_change needs 'every' (a positive integer), got {every!r}")
    finished = args.get("finished", False)  # the trainer stops for good: the partner need not wait out the turn
    for key, flag in (("detached", detached), ("finished", finished)):
        if not isinstance(flag, bool):
            raise ControlError(f"team_change: '{key}' must be true or false, got {flag!r}")
    if finished and not detached:
        raise ControlError("team_change: 'finished' needs 'detached' (close the trainer session first)")
    return values[0], values[1], values[2], every, detached, finished


def _check_pool_spaces(pool: SnapshotPool, spaces: PolicySpaces, team: str) -> None:
    """The pool's newest snapshot was written for this group's spaces (a pool of another game is refused)."""
    snapshots = list_snapshots(pool.directory)
    if not snapshots:
        return
    meta_path = Path(snapshots[-1].model_path).with_suffix(".json")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # list_snapshots read it a moment ago; the frozen group's load reports a broken one
    for what, mine in (("observation", spaces.observation_wire()), ("action", spaces.action_wire())):
        theirs = meta.get(f"{what}_space")
        mine = json.loads(json.dumps(mine))  # as the snapshot's JSON holds it
        if theirs is not None and theirs != mine:
            raise ControlError(
                f"team_change: {meta_path.name} in {pool.directory} has the {what} space {theirs}, but "
                f"'{team}' has {mine}: a pool of another group or game"
            )
