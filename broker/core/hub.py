"""The hub routes game observations into per-policy batches and trainer actions back to games.

Theory of operation
-------------------
* ``expected_games`` game slots. A game that joins takes the lowest free slot; a slot keeps the group
  layout (policies and agent counts) of the first game that used it, so a replacement game must match.
* A policy's VecEnv has one env per agent of that policy over all slots, in slot order. The layout is
  fixed once every slot has been filled once; trainers then receive ``PolicyInfo``.
* A game sends one ``step`` and waits for ``actions``. Each group's tick is merged into that policy's
  accumulator for the game's slot (``SlotAccumulator``). A batch goes to the policy's trainer when it
  has asked for one and every slot has at least one tick since the previous batch; rows are concatenated
  (one copy per key).
* The game's reply is sent as soon as every group either has fresh actions from its trainer or may be
  held. Hold mode (default): a group is held when its policy has no trainer, or when its trainer has not
  answered within the policy's deadline; held agents keep their last action (or get zeros, "noop").
  Barrier mode: the game waits for the actions (up to a deadline if one is set, then holds).
  Held ticks keep accumulating: the trainer's next transition carries the summed reward and ``frames``.
* An action computed from an observation whose episode has ended meanwhile is not applied to the next
  episode: those agents keep their previous action and the row's info says ``action_applied: false``.
* A lost game: its undelivered rows are dropped; when a game takes the slot again, its first step
  reports every agent of the slot as truncated, with the last observation the trainer saw as the
  final observation, so SB3's episode bookkeeping stays right.
* A lost trainer: the batch it did not answer is sent again to the next trainer of that policy.
Memory is bounded by one accumulator per slot and policy (infos replaced, never merged, across held
ticks), and one open batch per policy. A batch counts as sent only once its link has encoded it.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import structlog

from broker.core.accumulate import SlotAccumulator
from broker.core.batching import UnencodableMessage, canonical_actions, concatenate_rows, drop_unencodable_infos
from broker.core.metrics import PolicyMetrics
from broker.protocol import PROTOCOL_VERSION
from broker.protocol.errors import ErrorCode, RemoteProtocolError
from broker.protocol.messages import (
    RESPONSE_WINDOW,
    Batch,
    Error,
    GameActions,
    GameLayout,
    GameStep,
    Hello,
    Message,
    PolicyInfo,
    StepData,
    StepOptions,
    TrainerAct,
    Waiting,
    Welcome,
)
from broker.protocol.spaces import GroupSpec, PolicySpaces, check_rows

log = structlog.get_logger("gdrl.hub")

ROUND_WAIT_CAP_S = 0.5  # longest a hold-mode game waits for the other games of a round
# A game none of whose policies has a trainer gets at most one reply per this many seconds (hold mode):
# nobody learns from those ticks, so running them flat out only takes CPU from the trainers.
IDLE_TICK_S = 0.1
STALL_REPORT_S = 5.0  # a barrier game waiting this long is logged, and waiting trainers are told why
Scheduler = Callable[[float, Callable[[], None]], Any]  # (delay in seconds, callback) -> handle


@dataclass(frozen=True)
class Stall:
    """Games waiting, with no deadline, for one policy's actions (barrier stepping)."""

    reason: str  # "no trainer", or what its trainer is doing
    slots: tuple[int, ...]
    seconds: float  # the longest of those waits
    mode: str

    @property
    def games(self) -> str:
        return ",".join(str(s) for s in self.slots)

    def games_text(self, policy: str) -> str:
        waited = f"{self.seconds:.0f} s"
        return f"games {self.games} wait for policy '{policy}' ({self.reason}, {self.mode} stepping) for {waited}"


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
    awaiting: bool = False  # a step is waiting for its reply
    tick: int = -1  # the tick awaiting its reply
    ready: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)  # actions not yet sent
    released: set[str] = field(default_factory=set)  # policies whose deadline passed this tick
    armed: set[str] = field(default_factory=set)  # policies whose deadline timer runs for this tick
    last_actions: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    steps: int = 0
    waiting_since: float = 0.0  # when the tick awaiting its reply arrived
    last_reply_at: float = float("-inf")  # when the game last got actions (idle pacing)
    idle_armed: bool = False  # an idle-pacing timer runs for the waiting tick

    @property
    def label(self) -> str:
        return f"game {self.slot} ({self.name or self.link.label})"


@dataclass(eq=False)
class TrainerSession:
    link: Link
    peer_id: int
    name: str
    policy: str
    options: StepOptions | None = None
    wants_batch: bool = False
    wants_since: float = 0.0
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
    options: StepOptions
    offsets: dict[int, int] = field(default_factory=dict)  # slot -> first env index
    n_envs: int = 0
    trainer: TrainerSession | None = None
    round: dict[int, SlotAccumulator] = field(default_factory=dict)  # slot -> ticks since the last batch
    outstanding: Batch | None = None  # sent, not yet answered
    outstanding_since: float = 0.0
    outstanding_games: dict[int, GameSession] = field(default_factory=dict)
    last_obs: dict[str, np.ndarray] | None = None
    step: int = 0
    applied_at: dict[int, int] = field(default_factory=dict)  # slot -> game tick whose reply applied the actions
    unapplied: set[int] = field(default_factory=set)  # slots holding actions the game has not received yet
    metrics: PolicyMetrics = field(default_factory=PolicyMetrics)

    responses: deque[float] = field(default_factory=lambda: deque(maxlen=RESPONSE_WINDOW))  # trainer answer times
    typical_response_s: float = 0.0

    @property
    def deadline_s(self) -> float | None:
        return self.options.deadline_s(self.typical_response_s)

    def record_response(self, seconds: float) -> None:
        self.responses.append(seconds)
        self.typical_response_s = statistics.median(self.responses)  # robust to the odd long PPO update


class Hub:
    def __init__(
        self,
        expected_games: int = 1,
        stepping: StepOptions | None = None,
        scheduler: Scheduler | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if expected_games < 1:
            raise ValueError("expected_games must be at least 1")
        self.expected_games = expected_games
        self.default_stepping = stepping or StepOptions()
        self.scheduler = scheduler
        self.clock = clock
        self.slots = [Slot(i) for i in range(expected_games)]
        self.policies: dict[str, PolicyState] = {}
        self.trainers: dict[str, TrainerSession] = {}
        self.waiting_trainers: list[TrainerSession] = []  # for policies not yet announced
        self.layout_complete = False
        self._next_peer_id = 1
        self.idle_tick_s = IDLE_TICK_S
        self._stall_check_armed = False

    # --- joining ---------------------------------------------------------------------------------

    def _peer_id(self) -> int:
        peer_id = self._next_peer_id
        self._next_peer_id += 1
        return peer_id

    def add_game(self, link: Link, hello: Hello) -> GameSession:
        """Seat a game, or raise RemoteProtocolError naming what is wrong (nothing else changes)."""
        name = hello.name or link.label
        # Spaces first: a game that disagrees with the others is told so, whether or not a slot is free.
        for group in hello.groups:
            known = self.policies.get(group.policy)
            if known is not None and known.spaces != group.spaces:
                difference = known.spaces.describe_difference(group.spaces)
                raise RemoteProtocolError(
                    ErrorCode.SPACE_MISMATCH, f"game '{name}', group '{group.policy}': {difference}"
                )
        free = [s for s in self.slots if s.game is None]
        if not free:
            raise RemoteProtocolError(
                ErrorCode.BROKER_FULL,
                f"all {self.expected_games} game slots are taken (start the broker with a larger --games)",
            )
        layout = {g.policy: g.n_agents for g in hello.groups}
        # Prefer a slot this exact layout already used, then a fresh one.
        slot = next((s for s in free if s.layout == layout), None)
        slot = slot or next((s for s in free if s.layout is None), None)
        if slot is None:
            raise RemoteProtocolError(
                ErrorCode.SPACE_MISMATCH,
                f"game '{name}' announces groups {layout}, but the free slots expect {[s.layout for s in free]}",
            )
        game = GameSession(link, self._peer_id(), hello.name, slot.index, {g.policy: g for g in hello.groups})
        for group in hello.groups:
            if group.policy not in self.policies:
                trainer = self.trainers.get(group.policy)
                options = trainer.options if trainer and trainer.options else self.default_stepping
                self.policies[group.policy] = PolicyState(group.policy, group.spaces, options)
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
                self.trainers.pop(trainer.policy, None)
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
        trainer = TrainerSession(link, self._peer_id(), hello.name, policy, hello.stepping)
        self.trainers[policy] = trainer
        if policy in self.policies and hello.stepping is not None:
            self.policies[policy].options = hello.stepping
        link.send(Welcome(PROTOCOL_VERSION, trainer.peer_id))
        options = hello.stepping or self.default_stepping
        log.info("trainer joined", peer=link.label, policy=policy, name=hello.name, stepping=options.mode)
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
        game.awaiting = False
        for name in game.groups:
            policy = self.policies[name]
            policy.round.pop(slot.index, None)
            policy.unapplied.discard(slot.index)  # a replacement starts from its own first tick
            policy.applied_at.pop(slot.index, None)
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
            for slot in self.slots:  # hold-mode games stop waiting for a trainer that is gone
                if slot.game is not None and policy.name in slot.game.groups:
                    self._try_reply(slot.game)
        log.info("trainer left", policy=trainer.policy, name=trainer.name)

    # --- stepping --------------------------------------------------------------------------------

    def game_step(self, game: GameSession, step: GameStep) -> None:
        if game.awaiting:
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
                n_final = len(data.final_index)
                check_rows(data.final_obs, spec.spaces.observation, n_final, f"{what} final obs", ErrorCode.BAD_STEP)
        slot = self.slots[game.slot]
        now = self.clock()
        for name, data in step.groups.items():
            policy = self.policies[name]
            if step.tick == 0 and name in slot.seen_by_trainer and policy.last_obs is not None:
                data = self._truncate_replaced(policy, slot.index, data)
            accumulator = policy.round.get(slot.index)
            if accumulator is None:
                accumulator = policy.round[slot.index] = SlotAccumulator(data)
            else:
                accumulator.merge(data)
            accumulator.last_tick = step.tick
            policy.metrics.group_ticks += 1
            policy.metrics.ticks_rate.add(now, policy.metrics.group_ticks)
        game.awaiting = True
        game.tick = step.tick
        game.waiting_since = now
        game.released = set()
        game.armed = set()
        game.idle_armed = False
        game.next_tick += 1
        game.steps += 1
        for name in step.groups:
            self._try_emit(self.policies[name])
        self._try_reply(game)

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

    # --- replies to games ------------------------------------------------------------------------

    def _may_hold(self, game: GameSession, policy: PolicyState) -> bool:
        if policy.name in game.released:
            return True
        if policy.options.mode != "hold":
            return False
        if policy.trainer is None:
            return True
        # A trainer that has sat on its batch past the deadline is busy (a PPO update, say): hold at once
        # instead of spending a full deadline on every tick until it is back.
        deadline = policy.deadline_s or 0.0
        return policy.outstanding is not None and self.clock() - policy.outstanding_since >= deadline

    def _arm_deadline(self, game: GameSession, policy: PolicyState) -> None:
        """Start the policy's deadline for the game's waiting tick, once (a trainer may attach mid-tick)."""
        deadline = policy.deadline_s
        if self.scheduler is None or deadline is None or policy.name in game.armed:
            return
        game.armed.add(policy.name)
        self.scheduler(deadline, functools.partial(self.deadline_passed, game, game.tick, policy.name, self.clock()))

    def deadline_passed(self, game: GameSession, tick: int, name: str, started: float | None = None) -> None:
        """A policy's deadline for one game tick: from now on that group may be held.

        Holding is for a busy trainer. While the trainer is still waiting for other games to deliver the
        same round, holding would only make this game run ahead with ticks nobody decides on; so the
        deadline starts over, up to ``ROUND_WAIT_CAP_S`` in all (a stalled game must not stall the rest).
        """
        if not game.awaiting or game.tick != tick or self.slots[game.slot].game is not game:
            return
        policy = self.policies[name]
        deadline = policy.deadline_s
        waiting_for_games = (
            policy.trainer is not None
            and policy.trainer.wants_batch
            and policy.outstanding is None
            and game.slot in policy.round
        )
        if (
            waiting_for_games
            and started is not None
            and deadline is not None
            and self.scheduler is not None
            and self.clock() - started < ROUND_WAIT_CAP_S
        ):
            self.scheduler(deadline, functools.partial(self.deadline_passed, game, tick, name, started))
            return
        game.released.add(name)
        self._try_reply(game)

    def _try_reply(self, game: GameSession) -> None:
        if not game.awaiting:
            return
        held, waiting = [], []
        for name in game.groups:
            if name in game.ready:
                continue
            if self._may_hold(game, self.policies[name]):
                held.append(name)
            else:
                waiting.append(self.policies[name])
        if waiting:
            for policy in waiting:
                self._arm_deadline(game, policy)
                if policy.deadline_s is None:
                    self._watch_stalls()
            return
        if self._pace_idle(game, held):
            return
        groups: dict[str, dict[str, np.ndarray]] = {}
        for name in game.groups:
            if name in game.ready:
                groups[name] = game.last_actions[name] = game.ready.pop(name)
                policy = self.policies[name]
                policy.unapplied.discard(game.slot)
                policy.applied_at[game.slot] = game.tick
            elif self.policies[name].options.hold_action == "noop":
                groups[name] = game.groups[name].zero_actions()
        for name in held:
            self.policies[name].metrics.held_ticks += 1
        game.awaiting = False
        game.last_reply_at = self.clock()
        game.link.send(GameActions(game.tick, groups))
        for name in groups:
            self._try_emit(self.policies[name])

    def _pace_idle(self, game: GameSession, held: list[str]) -> bool:
        """Hold the reply back when no policy of the game has a trainer and the game had one recently.

        Only a game whose every group is held for want of a trainer is paced; a busy trainer's holds and
        any game with a trainer at work keep their timing. Returns True when the reply is deferred.
        """
        if self.scheduler is None or len(held) != len(game.groups):
            return False
        if any(self.policies[name].trainer is not None for name in held):
            return False
        wait = game.last_reply_at + self.idle_tick_s - self.clock()
        if wait <= 0:
            return False
        if not game.idle_armed:
            game.idle_armed = True
            self.scheduler(wait, functools.partial(self._idle_tick_due, game, game.tick))
        return True

    def _idle_tick_due(self, game: GameSession, tick: int) -> None:
        if game.awaiting and game.tick == tick and self.slots[game.slot].game is game:
            game.idle_armed = False
            self._try_reply(game)

    # --- stalls (barrier stepping) ---------------------------------------------------------------

    def _watch_stalls(self) -> None:
        """A game waits for a policy with no deadline: check back later, and say why if it still waits."""
        if self.scheduler is not None and not self._stall_check_armed:
            self._stall_check_armed = True
            self.scheduler(STALL_REPORT_S, self.report_stalls)

    def stalls(self, min_wait_s: float = STALL_REPORT_S) -> dict[str, Stall]:
        """Policies that games have waited on, with no deadline, for ``min_wait_s`` or more."""
        now = self.clock()
        waiting: dict[str, list[GameSession]] = {}
        for slot in self.slots:
            game = slot.game
            if game is None or not game.awaiting or now - game.waiting_since < min_wait_s:
                continue
            for name in game.groups:
                policy = self.policies[name]
                if name not in game.ready and policy.deadline_s is None and not self._may_hold(game, policy):
                    waiting.setdefault(name, []).append(game)
        return {
            name: Stall(
                self._stall_reason(self.policies[name], now),
                tuple(g.slot for g in games),
                now - min(g.waiting_since for g in games),
                self.policies[name].options.mode,
            )
            for name, games in waiting.items()
        }

    def _stall_reason(self, policy: PolicyState, now: float) -> str:
        trainer = policy.trainer
        if trainer is None:
            joined = self.trainers.get(policy.name)
            return f"trainer '{joined.name or joined.link.label}' waits for games" if joined else "no trainer"
        who = trainer.name or trainer.link.label
        if policy.outstanding is not None:
            waited = now - policy.outstanding_since
            return f"trainer '{who}' has not answered batch {policy.outstanding.step} for {waited:.0f} s"
        return f"trainer '{who}' waits for the other games' steps"

    def report_stalls(self) -> None:
        """Log each stalled policy, and tell every trainer waiting for a batch what its games wait for."""
        self._stall_check_armed = False
        stalls = self.stalls()
        for name, stall in stalls.items():
            log.warning(
                f"policy {name}: {stall.reason}; games {stall.games} wait ({stall.mode})", waited_s=round(stall.seconds)
            )
        connected = self.games_connected()
        for trainer in self.trainers.values():
            others = [f"{stall.games_text(name)}" for name, stall in stalls.items() if name != trainer.policy]
            if others and trainer.wants_batch and trainer.informed:
                reason = "waiting for game steps: " + "; ".join(others)
                trainer.last_waiting = (connected, reason)
                trainer.link.send(Waiting(trainer.policy, connected, self.expected_games, reason))
        if self.stalls(min_wait_s=0.0):
            self._watch_stalls()

    # --- trainers --------------------------------------------------------------------------------

    def _round_complete(self, policy: PolicyState) -> bool:
        """Every slot has ticks since the last batch, and at least one of them after its actions applied."""
        if not self.layout_complete:
            return False
        for s in policy.offsets:
            accumulator = policy.round.get(s)
            if accumulator is None or s in policy.unapplied or accumulator.last_tick <= policy.applied_at.get(s, -1):
                return False
        return True

    def _try_emit(self, policy: PolicyState) -> None:
        trainer = policy.trainer
        if trainer is None or not trainer.wants_batch or policy.outstanding is not None:
            return
        if not self._round_complete(policy):
            self._tell_waiting(trainer)
            return
        slots = sorted(policy.offsets)
        with_frames = policy.options.mode == "hold"
        parts = [policy.round[s].step_data(with_frames) for s in slots]
        data = concatenate_rows(parts, [policy.offsets[s] for s in slots], policy.spaces)
        batch = self._send_batch(policy, trainer, Batch(policy.step + 1, data))
        if batch is None:
            return
        data = batch.data
        policy.step += 1  # marked sent only now that it was encoded and written
        now = self.clock()
        policy.outstanding = batch
        policy.outstanding_since = now
        policy.outstanding_games = {s: self.slots[s].game for s in slots}  # type: ignore[misc]
        policy.last_obs = data.obs
        for s in slots:
            self.slots[s].seen_by_trainer.add(policy.name)
        policy.round = {}
        policy.metrics.record_batch(data, now - trainer.wants_since, now)
        trainer.wants_batch = False

    def _send_batch(self, policy: PolicyState, trainer: TrainerSession, batch: Batch) -> Batch | None:
        """Send ``batch``, or the batch minus the infos its trainer's codec cannot carry (logged with the
        games they came from); None, and the trainer closed, if even that cannot be encoded (our bug)."""
        try:
            trainer.link.send(batch)
            return batch
        except UnencodableMessage as exc:
            data, rows = drop_unencodable_infos(batch.data, exc.encodable)
            log.error(
                "batch not encodable, infos dropped",
                policy=policy.name,
                trainer=trainer.link.label,
                rows=rows[:16],
                games=sorted({self._game_label(policy, row) for row in rows}),
                error=exc.message,
            )
        try:
            batch = Batch(batch.step, data)
            trainer.link.send(batch)
            return batch
        except UnencodableMessage as exc:
            log.error("batch not encodable", policy=policy.name, trainer=trainer.link.label, error=exc.message)
            trainer.link.close(Error(ErrorCode.INTERNAL.value, "the broker could not encode the batch"))
            return None

    def _game_label(self, policy: PolicyState, row: int) -> str:
        """The game whose agents fill env ``row`` of ``policy``."""
        for s, start in policy.offsets.items():
            game = self.slots[s].game
            if game is not None and start <= row < start + game.groups[policy.name].n_agents:
                return game.label
        return f"row {row}"

    def trainer_reset(self, trainer: TrainerSession) -> None:
        policy = self.policies.get(trainer.policy)
        if policy is not None and policy.outstanding is not None and policy.trainer is trainer:
            # A new or restarted trainer picks up the open batch (its codec may carry less than the last one's).
            policy.outstanding = self._send_batch(policy, trainer, policy.outstanding) or policy.outstanding
            return
        trainer.wants_batch = True
        trainer.wants_since = self.clock()
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
        known = {key: space for key, space in policy.spaces.action}
        unknown = sorted(set(act.actions) - set(known))
        if unknown:
            raise RemoteProtocolError(ErrorCode.BAD_ACTIONS, f"unknown action keys {unknown}")
        actions = {k: canonical_actions(v, known[k].wire_dtype) for k, v in act.actions.items()}
        what = f"policy '{policy.name}' actions"
        check_rows(actions, policy.spaces.action, policy.n_envs, what, ErrorCode.BAD_ACTIONS)
        now = self.clock()
        games = policy.outstanding_games
        policy.metrics.trainer_busy_s += now - policy.outstanding_since
        policy.record_response(now - policy.outstanding_since)
        policy.outstanding = None
        policy.outstanding_games = {}
        trainer.wants_batch = True
        trainer.wants_since = now
        for slot_index, game in games.items():
            if self.slots[slot_index].game is not game:
                continue  # that game left; its actions have nobody to go to
            start = policy.offsets[slot_index]
            n = game.groups[policy.name].n_agents
            part = {k: v[start : start + n] for k, v in actions.items()}
            game.ready[policy.name] = self._keep_ended_rows(game, policy, slot_index, part)
            policy.unapplied.add(slot_index)
            self._try_reply(game)
        self._try_emit(policy)

    def _keep_ended_rows(
        self, game: GameSession, policy: PolicyState, slot: int, part: dict[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """Rows whose episode ended after the observation these actions answer keep their last action."""
        accumulator = policy.round.get(slot)
        if accumulator is None or not accumulator.closed.any():
            return part
        stale = accumulator.closed
        previous = game.last_actions.get(policy.name) or game.groups[policy.name].zero_actions()
        for row in np.flatnonzero(stale).tolist():
            accumulator.infos.setdefault(row, {})["action_applied"] = False
        return {k: np.where(stale.reshape(-1, *([1] * (v.ndim - 1))), previous[k], v) for k, v in part.items()}

    # --- status ----------------------------------------------------------------------------------

    def games_connected(self) -> int:
        return sum(1 for s in self.slots if s.game is not None)

    def _waiting_reason(self, policy: str) -> str:
        connected = self.games_connected()
        if connected < self.expected_games:
            return f"waiting for games: {connected}/{self.expected_games}"
        if policy not in self.policies:
            return "waiting for a game that announces this policy"
        return "waiting for game steps"

    def _tell_waiting(self, trainer: TrainerSession) -> None:
        connected = self.games_connected()
        reason = self._waiting_reason(trainer.policy)
        if trainer.last_waiting == (connected, reason):
            return
        trainer.last_waiting = (connected, reason)
        trainer.link.send(Waiting(trainer.policy, connected, self.expected_games, reason))

    def _tell_waiting_trainers(self) -> None:
        for trainer in list(self.trainers.values()):
            if trainer.wants_batch or not trainer.informed:
                self._tell_waiting(trainer)

    def snapshot(self) -> dict[str, Any]:
        """Live numbers for ``gdrl-broker status`` and the periodic log line (JSON-friendly)."""
        return {
            "games": [
                {
                    "slot": s.index,
                    "name": s.game.name if s.game else None,
                    "connected": s.game is not None,
                    "ticks": s.game.steps if s.game else 0,
                }
                for s in self.slots
            ],
            "policies": self._policies_status(),
        }

    def _policies_status(self) -> dict[str, dict[str, Any]]:
        """Every policy a game announced or a trainer asked for, with who is there and what it waits for."""
        now = self.clock()
        stalls = self.stalls()
        names = list(self.policies) + [p for p in self.trainers if p not in self.policies]
        out = {}
        for name in names:
            policy = self.policies.get(name)
            trainer = self.trainers.get(name)
            agents = sum(
                s.game.groups[name].n_agents for s in self.slots if s.game is not None and name in s.game.groups
            )
            if trainer is None:
                state = "no trainer"
            elif policy is None or policy.trainer is not trainer:
                state = self._waiting_reason(name)
            elif name in stalls:
                state = f"stalled: {stalls[name].reason}"
            else:
                state = "training"
            options = policy.options if policy else (trainer.options if trainer else None) or self.default_stepping
            metrics = policy.metrics if policy else PolicyMetrics()
            out[name] = metrics.status(
                now,
                agents=agents,
                envs=policy.n_envs if policy else 0,
                trainer=(trainer.name or trainer.link.label) if trainer else None,
                state=state,
                mode=options.mode,
            )
        return out
