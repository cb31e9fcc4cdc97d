"""The hub routes game observations into per-policy batches and trainer actions back to games.

Theory of operation
-------------------
* ``expected_games`` game slots. A game that joins takes the lowest free slot; a slot keeps the group
  layout (policies and agent counts) of the first game that used it, so a replacement game must match.
* A policy's VecEnv has one env per agent of that policy over all slots, in slot order. The layout is
  fixed once every slot has been filled once; trainers then receive ``PolicyInfo``.
* Lock-step per game: a game sends one ``step`` and waits for ``actions`` covering all of its groups.
  A policy's round collects one step from every slot that has its agents; when the round is complete
  and its trainer wants a batch, the rows are concatenated (one copy per key) and sent.
* A lost game: its undelivered rows are dropped; when a game takes the slot again, its first step
  reports every agent of the slot as truncated, with the last observation the trainer saw as the
  final observation, so SB3's episode bookkeeping stays right.
* A lost trainer: the batch it did not answer is sent again to the next trainer of that policy.
Memory is bounded by one step per game and one batch per policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import structlog

from broker.protocol import PROTOCOL_VERSION
from broker.protocol.errors import ErrorCode, RemoteProtocolError
from broker.protocol.messages import (
    Batch,
    Error,
    GameActions,
    GameLayout,
    GameStep,
    Hello,
    Message,
    PolicyInfo,
    StepData,
    TrainerAct,
    Waiting,
    Welcome,
)
from broker.protocol.spaces import DTYPES, GroupSpec, PolicySpaces, check_rows

log = structlog.get_logger("gdrl.hub")


class Link(Protocol):
    """What the hub needs of a connection: send a message, or close with an error."""

    label: str

    def send(self, message: Message) -> None: ...

    def close(self, error: Error | None = None) -> None: ...


@dataclass(eq=False)
class GameSession:
    link: Link
    peer_id: int
    name: str
    slot: int
    groups: dict[str, GroupSpec]
    next_tick: int = 0
    pending: set[str] = field(default_factory=set)  # policies whose actions we still wait for
    actions: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    steps: int = 0

    @property
    def label(self) -> str:
        return f"game {self.slot} ({self.name or self.link.label})"


@dataclass(eq=False)
class TrainerSession:
    link: Link
    peer_id: int
    name: str
    policy: str
    wants_batch: bool = False
    informed: bool = False
    last_waiting: tuple[int, str] | None = None


@dataclass
class Slot:
    index: int
    layout: dict[str, int] | None = None  # policy -> n_agents, fixed by the first game in the slot
    game: GameSession | None = None
    seen_by_trainer: set[str] = field(default_factory=set)  # policies whose trainer saw these rows


@dataclass(eq=False)
class PolicyState:
    name: str
    spaces: PolicySpaces
    offsets: dict[int, int] = field(default_factory=dict)  # slot -> first env index
    n_envs: int = 0
    trainer: TrainerSession | None = None
    round: dict[int, StepData] = field(default_factory=dict)  # slot -> this round's delivery
    outstanding: Batch | None = None  # sent, not yet answered
    outstanding_games: dict[int, GameSession] = field(default_factory=dict)
    last_obs: dict[str, np.ndarray] | None = None
    step: int = 0
    steps_done: int = 0


class Hub:
    def __init__(self, expected_games: int = 1) -> None:
        if expected_games < 1:
            raise ValueError("expected_games must be at least 1")
        self.expected_games = expected_games
        self.slots = [Slot(i) for i in range(expected_games)]
        self.policies: dict[str, PolicyState] = {}
        self.trainers: dict[str, TrainerSession] = {}
        self.waiting_trainers: list[TrainerSession] = []  # for policies not yet announced
        self.layout_complete = False
        self._next_peer_id = 1

    # --- joining ---------------------------------------------------------------------------------

    def _peer_id(self) -> int:
        peer_id = self._next_peer_id
        self._next_peer_id += 1
        return peer_id

    def add_game(self, link: Link, hello: Hello) -> GameSession:
        """Seat a game, or raise RemoteProtocolError naming what is wrong (nothing else changes)."""
        name = hello.name or link.label
        free = [s for s in self.slots if s.game is None]
        if not free:
            raise RemoteProtocolError(
                ErrorCode.BROKER_FULL,
                f"all {self.expected_games} game slots are taken (start the broker with a larger --games)",
            )
        layout = {g.policy: g.n_agents for g in hello.groups}
        # Prefer a slot this exact layout already used, then a fresh one.
        slot = next((s for s in free if s.layout == layout), None) or next((s for s in free if s.layout is None), None)
        if slot is None:
            raise RemoteProtocolError(
                ErrorCode.SPACE_MISMATCH,
                f"game '{name}' announces groups {layout}, but the free slots expect {[s.layout for s in free]}",
            )
        for group in hello.groups:
            known = self.policies.get(group.policy)
            if known is not None and known.spaces != group.spaces:
                raise RemoteProtocolError(
                    ErrorCode.SPACE_MISMATCH,
                    f"game '{name}', group '{group.policy}': {known.spaces.describe_difference(group.spaces)}",
                )
        game = GameSession(link, self._peer_id(), hello.name, slot.index, {g.policy: g for g in hello.groups})
        for group in hello.groups:
            if group.policy not in self.policies:
                self.policies[group.policy] = PolicyState(group.policy, group.spaces)
        slot.layout = layout
        slot.game = game
        link.send(Welcome(PROTOCOL_VERSION, game.peer_id, slot.index))
        log.info("game joined", peer=link.label, game=slot.index, name=hello.name, groups=layout)
        if not self.layout_complete and all(s.layout is not None for s in self.slots):
            self._complete_layout()
        self._tell_waiting_trainers()
        return game

    def _complete_layout(self) -> None:
        self.layout_complete = True
        for policy in self.policies.values():
            offset = 0
            for slot in self.slots:
                assert slot.layout is not None
                if policy.name in slot.layout:
                    policy.offsets[slot.index] = offset
                    offset += slot.layout[policy.name]
            policy.n_envs = offset
        log.info("layout complete", policies={p.name: p.n_envs for p in self.policies.values()})
        for trainer in list(self.waiting_trainers):
            self.waiting_trainers.remove(trainer)
            if trainer.policy in self.policies:
                self._attach(trainer)
            else:
                trainer.link.close(self._unknown_policy(trainer.policy))

    def _unknown_policy(self, name: str) -> Error:
        known = ", ".join(sorted(self.policies)) or "none"
        return Error(ErrorCode.UNKNOWN_POLICY.value, f"no game announces policy '{name}'; known policies: {known}")

    def add_trainer(self, link: Link, hello: Hello) -> TrainerSession:
        policy = hello.policy
        holder = self.trainers.get(policy)
        if holder is not None:
            raise RemoteProtocolError(
                ErrorCode.POLICY_TAKEN,
                f"policy '{policy}' already has a trainer ({holder.link.label}); one trainer per policy",
            )
        if self.layout_complete and policy not in self.policies:
            raise RemoteProtocolError(ErrorCode.UNKNOWN_POLICY, self._unknown_policy(policy).message)
        trainer = TrainerSession(link, self._peer_id(), hello.name, policy)
        self.trainers[policy] = trainer
        link.send(Welcome(PROTOCOL_VERSION, trainer.peer_id))
        log.info("trainer joined", peer=link.label, policy=policy, name=hello.name)
        if self.layout_complete:
            self._attach(trainer)
        else:
            self.waiting_trainers.append(trainer)
            self._tell_waiting(trainer)
        return trainer

    def _attach(self, trainer: TrainerSession) -> None:
        policy = self.policies[trainer.policy]
        policy.trainer = trainer
        games = tuple(
            GameLayout(s, policy.offsets[s], self.slots[s].layout[policy.name])  # type: ignore[index]
            for s in sorted(policy.offsets)
        )
        trainer.link.send(PolicyInfo(policy.name, policy.n_envs, policy.spaces, games))
        trainer.informed = True
        if trainer.wants_batch:
            self._try_emit(policy)

    # --- leaving ---------------------------------------------------------------------------------

    def remove_game(self, game: GameSession) -> None:
        slot = self.slots[game.slot]
        if slot.game is not game:
            return
        slot.game = None
        for name in game.groups:
            policy = self.policies[name]
            policy.round.pop(slot.index, None)
        log.info("game left", game=slot.index, name=game.name, steps=game.steps)
        self._tell_waiting_trainers()

    def remove_trainer(self, trainer: TrainerSession) -> None:
        if self.trainers.get(trainer.policy) is not trainer:
            return
        del self.trainers[trainer.policy]
        if trainer in self.waiting_trainers:
            self.waiting_trainers.remove(trainer)
        policy = self.policies.get(trainer.policy)
        if policy is not None and policy.trainer is trainer:
            policy.trainer = None
        log.info("trainer left", policy=trainer.policy, name=trainer.name)

    # --- stepping --------------------------------------------------------------------------------

    def game_step(self, game: GameSession, step: GameStep) -> None:
        if game.pending:
            raise RemoteProtocolError(
                ErrorCode.UNEXPECTED_MESSAGE, f"{game.label} sent step {step.tick} before receiving its actions"
            )
        if step.tick != game.next_tick:
            raise RemoteProtocolError(
                ErrorCode.BAD_STEP, f"{game.label}: expected tick {game.next_tick}, got {step.tick}"
            )
        if set(step.groups) != set(game.groups):
            raise RemoteProtocolError(
                ErrorCode.BAD_STEP,
                f"{game.label}: step has groups {sorted(step.groups)}, hello announced {sorted(game.groups)}",
            )
        for name, data in step.groups.items():
            spec = game.groups[name]
            what = f"{game.label}, group '{name}'"
            if data.n_rows != spec.n_agents:
                raise RemoteProtocolError(ErrorCode.BAD_STEP, f"{what}: {data.n_rows} rows for {spec.n_agents} agents")
            check_rows(data.obs, spec.spaces.observation, spec.n_agents, f"{what} obs", ErrorCode.BAD_STEP)
            if data.final_obs is not None and data.final_index is not None:
                check_rows(
                    data.final_obs,
                    spec.spaces.observation,
                    len(data.final_index),
                    f"{what} final obs",
                    ErrorCode.BAD_STEP,
                )
        slot = self.slots[game.slot]
        for name, data in step.groups.items():
            policy = self.policies[name]
            if step.tick == 0 and name in slot.seen_by_trainer and policy.last_obs is not None:
                data = self._truncate_replaced(policy, slot.index, data)
            policy.round[slot.index] = data
        game.pending = set(step.groups)
        game.actions = {}
        game.next_tick += 1
        game.steps += 1
        for name in step.groups:
            self._try_emit(self.policies[name])

    def _truncate_replaced(self, policy: PolicyState, slot: int, data: StepData) -> StepData:
        """A game's first step in a slot the trainer already saw: the old episodes end truncated."""
        assert policy.last_obs is not None
        start = policy.offsets[slot]
        n = data.n_rows
        final_obs = {k: v[start : start + n] for k, v in policy.last_obs.items()}
        return StepData(
            data.obs,
            np.zeros(n, np.float32),
            np.zeros(n, np.bool_),
            np.ones(n, np.bool_),
            np.arange(n, dtype=np.int32),
            final_obs,
            {row: {**data.infos.get(row, {}), "game_replaced": True} for row in range(n)},
        )

    def _round_complete(self, policy: PolicyState) -> bool:
        return self.layout_complete and all(s in policy.round for s in policy.offsets)

    def _try_emit(self, policy: PolicyState) -> None:
        trainer = policy.trainer
        if trainer is None or not trainer.wants_batch or policy.outstanding is not None:
            return
        if not self._round_complete(policy):
            self._tell_waiting(trainer)
            return
        slots = sorted(policy.offsets)
        parts = [policy.round[s] for s in slots]
        data = _concatenate(parts, [policy.offsets[s] for s in slots], policy.spaces)
        policy.step += 1
        batch = Batch(policy.step, data)
        policy.outstanding = batch
        policy.outstanding_games = {s: self.slots[s].game for s in slots}  # type: ignore[misc]
        policy.last_obs = data.obs
        for s in slots:
            self.slots[s].seen_by_trainer.add(policy.name)
        policy.round = {}
        trainer.wants_batch = False
        trainer.last_waiting = None
        trainer.link.send(batch)

    def trainer_reset(self, trainer: TrainerSession) -> None:
        policy = self.policies.get(trainer.policy)
        if policy is not None and policy.outstanding is not None and policy.trainer is trainer:
            trainer.link.send(policy.outstanding)  # a new or restarted trainer picks up the open batch
            return
        trainer.wants_batch = True
        if policy is not None:
            self._try_emit(policy)

    def trainer_act(self, trainer: TrainerSession, act: TrainerAct) -> None:
        policy = self.policies.get(trainer.policy)
        if policy is None or policy.outstanding is None or policy.trainer is not trainer:
            raise RemoteProtocolError(ErrorCode.UNEXPECTED_MESSAGE, "actions sent with no batch outstanding")
        if act.step != policy.outstanding.step:
            raise RemoteProtocolError(
                ErrorCode.BAD_ACTIONS,
                f"actions answer step {act.step}, the open batch is step {policy.outstanding.step}",
            )
        actions = {
            k: _canonical(v, space.wire_dtype)
            for k, v in act.actions.items()
            for key, space in policy.spaces.action
            if key == k
        }
        if len(actions) != len(act.actions):
            unknown = sorted(set(act.actions) - {k for k, _ in policy.spaces.action})
            raise RemoteProtocolError(ErrorCode.BAD_ACTIONS, f"unknown action keys {unknown}")
        check_rows(
            actions, policy.spaces.action, policy.n_envs, f"policy '{policy.name}' actions", ErrorCode.BAD_ACTIONS
        )
        games = policy.outstanding_games
        policy.outstanding = None
        policy.outstanding_games = {}
        policy.steps_done += 1
        trainer.wants_batch = True
        for slot_index, game in games.items():
            if self.slots[slot_index].game is not game:
                continue  # that game left; its actions have nobody to go to
            start = policy.offsets[slot_index]
            n = game.groups[policy.name].n_agents
            game.actions[policy.name] = {k: v[start : start + n] for k, v in actions.items()}
            game.pending.discard(policy.name)
            if not game.pending:
                game.link.send(GameActions(game.next_tick - 1, game.actions))
                game.actions = {}
        self._try_emit(policy)

    # --- status ----------------------------------------------------------------------------------

    def games_connected(self) -> int:
        return sum(1 for s in self.slots if s.game is not None)

    def _tell_waiting(self, trainer: TrainerSession) -> None:
        connected = self.games_connected()
        if connected < self.expected_games:
            reason = f"waiting for games: {connected}/{self.expected_games}"
        elif trainer.policy not in self.policies:
            reason = "waiting for a game that announces this policy"
        else:
            reason = "waiting for game steps"
        if trainer.last_waiting == (connected, reason):
            return
        trainer.last_waiting = (connected, reason)
        trainer.link.send(Waiting(trainer.policy, connected, self.expected_games, reason))

    def _tell_waiting_trainers(self) -> None:
        for trainer in self.trainers.values():
            if trainer.wants_batch or not trainer.informed:
                self._tell_waiting(trainer)

    def snapshot(self) -> dict[str, Any]:
        return {
            "games": {s.index: (s.game.name if s.game else None) for s in self.slots},
            "policies": {
                p.name: {"n_envs": p.n_envs, "steps": p.steps_done, "trainer": p.trainer is not None}
                for p in self.policies.values()
            },
        }


def _canonical(array: np.ndarray, wire_dtype: str) -> np.ndarray:
    """Accept any float for continuous and any integer for discrete actions; forward canonical dtypes."""
    target = DTYPES[wire_dtype]
    if array.dtype == target:
        return array
    if target.kind == "f" and array.dtype.kind == "f":
        return array.astype(target)
    if target.kind == "i" and array.dtype.kind in "iu":
        return array.astype(target)
    return array  # check_rows reports the wrong dtype


def _concatenate(parts: list[StepData], offsets: list[int], spaces: PolicySpaces) -> StepData:
    """Stack the slots' rows into one batch: one copy per key, no per-agent work."""
    if len(parts) == 1:
        only = parts[0]
        return StepData(
            {k: np.array(v) for k, v in only.obs.items()},
            only.reward.copy(),
            only.terminated.copy(),
            only.truncated.copy(),
            only.final_index,
            only.final_obs,
            dict(only.infos),
        )
    obs = {key: np.concatenate([p.obs[key] for p in parts]) for key, _ in spaces.observation}
    reward = np.concatenate([p.reward for p in parts])
    terminated = np.concatenate([p.terminated for p in parts])
    truncated = np.concatenate([p.truncated for p in parts])
    finals = [
        (p.final_index + off, p.final_obs)
        for p, off in zip(parts, offsets, strict=False)
        if p.final_index is not None and p.final_obs is not None and len(p.final_index)
    ]
    final_index = final_obs = None
    if finals:
        final_index = np.concatenate([f[0] for f in finals]).astype(np.int32)
        final_obs = {key: np.concatenate([f[1][key] for f in finals]) for key, _ in spaces.observation}
    infos = {row + off: info for p, off in zip(parts, offsets, strict=False) for row, info in p.infos.items()}
    return StepData(obs, reward, terminated, truncated, final_index, final_obs, infos)
