"""The hub: routes game observations into per-policy batches and trainer actions back to games.

How it works: the "Theory of operation" in broker/core/__init__.py. Sans-IO: every entry point returns
effects (broker/core/effects.py) for the caller to carry out in order; the hub never calls into a
connection. Peers are the caller's keys; the hub reads only their label.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import structlog
from mypy_extensions import mypyc_attr

from broker.core import claims, joining, seating, status
from broker.core.accumulate import SlotAccumulator, keep_ended_rows, replaced_game_step
from broker.core.batching import concatenate_rows, drop_unencodable_infos
from broker.core.effects import Close, Deadline, Effect, IdleTick, Peer, Send, StallCheck, Timer
from broker.core.holding import STALL_REPORT_S, Holding, Stall
from broker.core.sessions import GameSession, OpenBatch, PolicyState, Slot, TrainerSession
from broker.core.states import GameState, advance
from broker.protocol.checks import check_actions, check_step
from broker.protocol.errors import ErrorCode, RemoteProtocolError
from broker.protocol.hot import new_batch, new_game_actions
from broker.protocol.messages import (
    Error,
    GameStep,
    Hello,
    Message,
    StepData,
    StepOptions,
    TrainerAct,
    TrainerReset,
)

log = structlog.get_logger("gdrl.hub")

Session = GameSession | TrainerSession | claims.SamplerSession


# Compiled (broker/compiled.py); tests drive it through a subclass of their own (tests/hub_driver.py).
@mypyc_attr(allow_interpreted_subclasses=True)
class Hub:
    def __init__(
        self,
        expected_games: int = 1,
        stepping: StepOptions | None = None,
        clock: Callable[[], float] = time.monotonic,
        timers: bool = True,
    ) -> None:
        if expected_games < 1:
            raise ValueError("expected_games must be at least 1")
        self.expected_games = expected_games
        self.default_stepping = stepping or StepOptions()
        self.clock = clock
        self.holding = Holding(clock, timers)
        self.slots = [Slot(i) for i in range(expected_games)]
        self.policies: dict[str, PolicyState] = {}
        self.trainers: dict[str, TrainerSession] = {}
        self.waiting_trainers: list[TrainerSession] = []  # for policies not yet announced
        self.sessions: dict[Peer, Session] = {}
        self.layout_complete = False
        self._next_peer_id = 1
        self.out: list[Effect] = []

    # --- the ways in -----------------------------------------------------------------------------

    def handle(self, peer: Peer, message: Message) -> list[Effect]:
        """A peer's Hello, GameStep, TrainerAct or TrainerReset. A RemoteProtocolError raised here names
        what the peer did wrong (the caller closes that peer); nothing has changed then."""
        self.out = []
        session = self.sessions.get(peer)
        if isinstance(message, Hello) and session is None and message.role == "game":
            joining.add_game(self, peer, message)
        elif isinstance(message, Hello) and session is None and message.role == "trainer":
            joining.add_trainer(self, peer, message)
        elif isinstance(message, Hello) and session is None and message.role == "sampler":
            claims.add_sampler(self, peer, message)
        elif isinstance(message, (TrainerAct, TrainerReset)) and isinstance(session, claims.SamplerSession):
            claims.sampler_message(self, session, message)
        elif isinstance(message, GameStep) and isinstance(session, GameSession):
            self._game_step(session, message)
        elif isinstance(message, TrainerAct) and isinstance(session, TrainerSession):
            self._trainer_act(session, message)
        elif isinstance(message, TrainerReset) and isinstance(session, TrainerSession):
            self._trainer_reset(session)
        else:
            raise RemoteProtocolError(ErrorCode.UNEXPECTED_MESSAGE, f"unexpected {message.TYPE} message")
        return self._take()

    def peer_lost(self, peer: Peer) -> list[Effect]:
        """The connection is gone (or the caller closed it): its game or trainer leaves."""
        self.out = []
        session = self.sessions.pop(peer, None)
        if isinstance(session, GameSession):
            joining.remove_game(self, session)
        elif isinstance(session, TrainerSession):
            joining.remove_trainer(self, session)
        elif isinstance(session, claims.SamplerSession):
            claims.remove_sampler(self, session)
        return self._take()

    def timer_fired(self, timer: Timer) -> list[Effect]:
        self.out = []
        if isinstance(timer, StallCheck):
            self._report_stalls()
            return self._take()
        game = self._current_game(timer.game_id, timer.tick)
        if game is None:
            return []  # that tick was answered, or its game left, meanwhile
        if isinstance(timer, Deadline):
            self._deadline_passed(game, timer)
        elif isinstance(timer, IdleTick) and game.state is GameState.PACED:
            game.state = advance(game.state, "idle_tick")
            self.try_reply(game)
        return self._take()

    def batch_undeliverable(
        self, peer: Peer, step: int, encodable: Callable[[Any], bool], error: str = "", policy_name: str = ""
    ) -> list[Effect]:
        """The caller could not encode batch ``step`` (of ``policy_name``, for a sampler's batches, which name
        their policy) for ``peer``'s codec and wrote nothing: the batch goes again with every info
        ``encodable`` refuses replaced (logged with the games they came from); if it was that batch already,
        the trainer is closed (the broker's own bug)."""
        self.out = []
        session = self.sessions.get(peer)
        policy: PolicyState | None = None
        if isinstance(session, TrainerSession):
            policy = self.policies.get(session.policy)
        elif isinstance(session, claims.SamplerSession):
            policy = session.policies.get(policy_name)
        if policy is None or policy.open is None or policy.open.batch.step != step:
            return []
        if policy.open.infos_dropped:
            log.error("batch not encodable", policy=policy.name, trainer=peer.label, error=error)
            return [Close(peer, Error(ErrorCode.INTERNAL.value, "the broker could not encode the batch"))]
        data, rows = drop_unencodable_infos(policy.open.batch.data, encodable)
        games = sorted({seating.game_of_row(self.slots, policy, row) for row in rows})
        log.error(
            "batch not encodable, infos dropped", policy=policy.name, trainer=peer.label, rows=rows[:16], games=games
        )
        policy.open.batch = new_batch(step, data, policy.name if policy.sampled else "")
        policy.open.infos_dropped = True
        return [Send(peer, policy.open.batch)]

    # --- queries ---------------------------------------------------------------------------------

    def session(self, peer: Peer) -> Session | None:
        return self.sessions.get(peer)

    def games_connected(self) -> int:
        connected = 0
        for slot in self.slots:  # asked on every step a round is not complete yet: no list built
            if slot.game is not None:
                connected += 1
        return connected

    def stalls(self, min_wait_s: float = STALL_REPORT_S) -> dict[str, Stall]:
        """Policies that games have waited on, with no deadline, for ``min_wait_s`` or more."""
        return self.holding.stalls(self.slots, self.policies, self.trainers, min_wait_s)

    def snapshot(self) -> dict[str, Any]:
        return status.snapshot(self)

    # --- for the parts (joining, status) ----------------------------------------------------------

    def _take(self) -> list[Effect]:
        out, self.out = self.out, []
        return out

    def new_peer_id(self) -> int:
        peer_id = self._next_peer_id
        self._next_peer_id += 1
        return peer_id

    # --- stepping --------------------------------------------------------------------------------

    def _game_step(self, game: GameSession, step: GameStep) -> None:
        if game.awaiting:
            raise RemoteProtocolError(
                ErrorCode.UNEXPECTED_MESSAGE, f"{game.label} sent step {step.tick} before receiving its actions"
            )
        if step.tick != game.next_tick:
            raise RemoteProtocolError(
                ErrorCode.BAD_STEP, f"{game.label}: expected tick {game.next_tick}, got {step.tick}"
            )
        check_step(step, game.groups, game.label)
        now = self.clock()
        for name, data in step.groups.items():
            self._accumulate(game.policies[name], self.slots[game.slot], step.tick, data, now)
        game.state = advance(game.state, "step")
        game.tick = step.tick
        game.waiting_since = now
        game.waits = {}
        game.next_tick += 1
        game.steps += 1
        for name in step.groups:
            self.try_emit(game.policies[name])
        self.try_reply(game)

    def _accumulate(self, policy: PolicyState, slot: Slot, tick: int, data: StepData, now: float) -> None:
        if tick == 0 and policy.name in slot.seen_by_trainer and policy.last_obs is not None:
            data = replaced_game_step(policy.last_obs, policy.offsets[slot.index], data)
        accumulator = policy.round.get(slot.index)
        if accumulator is None:
            accumulator = policy.round[slot.index] = SlotAccumulator(data)
        else:
            accumulator.merge(data)
        accumulator.last_tick = tick
        policy.metrics.group_ticks += 1
        policy.metrics.ticks_rate.add(now, policy.metrics.group_ticks)

    # --- replies to games ------------------------------------------------------------------------

    def _current_game(self, game_id: int, tick: int) -> GameSession | None:
        """The game with ``game_id``, if it is still seated and still waits for the reply to ``tick``."""
        game = next((s.game for s in self.slots if s.game is not None and s.game.peer_id == game_id), None)
        return game if game is not None and game.awaiting and game.tick == tick else None

    def _deadline_passed(self, game: GameSession, timer: Deadline) -> None:
        """A policy's deadline for one game tick: from now on that group may be held (or it starts over)."""
        policy = game.policies[timer.policy]
        again = self.holding.deadline_again(timer, game, policy)
        if again is not None:
            self.out.append(again)
            return
        game.waits[policy.name] = advance(game.wait_of(policy.name), "release")
        self.try_reply(game)

    def try_reply(self, game: GameSession) -> None:
        if not game.awaiting:
            return
        held, waiting = [], []
        for name in game.groups:
            if name in game.ready:
                continue
            if self.holding.may_hold(game, game.policies[name]):
                held.append(name)
            else:
                waiting.append(game.policies[name])
        if waiting:
            for policy in waiting:
                self.out += self.holding.arm_deadline(game, policy)
                if policy.deadline_s is None:
                    self.out += self.holding.watch_stalls()
            return
        paced = self.holding.pace(game, held, game.policies)
        if paced is not None:
            self.out += paced
            return
        self._reply(game, held)

    def _reply(self, game: GameSession, held: list[str]) -> None:
        groups: dict[str, dict[str, np.ndarray]] = {}
        for name in game.groups:
            if name in game.ready:
                groups[name] = game.last_actions[name] = game.ready.pop(name)
                policy = game.policies[name]
                policy.unapplied.discard(game.slot)
                policy.applied_at[game.slot] = game.tick
            elif game.policies[name].options.hold_action == "noop":
                groups[name] = game.groups[name].zero_actions()
        for name in held:
            game.policies[name].metrics.held_ticks += 1
        game.state = advance(game.state, "reply")
        game.last_reply_at = self.clock()
        self.out.append(Send(game.peer, new_game_actions(game.tick, groups)))  # checked actions, or zeros
        for name in groups:
            # A reply can complete a round only in hold mode (these actions are now applied): lock-step rounds
            # need this game waiting for a reply, which it no longer is.
            if game.policies[name].options.mode == "hold":
                self.try_emit(game.policies[name])

    def _report_stalls(self) -> None:
        self.holding.stall_check_fired()
        self.out += status.stall_report(self, self.stalls())
        if self.stalls(min_wait_s=0.0):
            self.out += self.holding.watch_stalls()

    # --- trainers --------------------------------------------------------------------------------

    def _round_complete(self, policy: PolicyState) -> bool:
        """Every slot has ticks since the last batch, and at least one of them after its actions applied.
        In barrier stepping also: each slot's game still waits for the reply to the newest of those ticks, so
        that the actions answer the very tick they were computed from. (A policy held while it had no
        trainer may have had that tick answered already; the game's next tick is then the one to send.)"""
        if not self.layout_complete and not policy.sampled:  # a sampler's layout is its claim
            return False
        lock_step = policy.options.mode != "hold"
        for s in policy.offsets:
            accumulator = policy.round.get(s)
            if accumulator is None or s in policy.unapplied or accumulator.last_tick <= policy.applied_at.get(s, -1):
                return False
            if lock_step:
                game = self.slots[s].game
                if game is None or not game.awaiting or game.tick != accumulator.last_tick:
                    return False
        return True

    def try_emit(self, policy: PolicyState) -> None:
        trainer = policy.trainer
        if trainer is None or not trainer.wants_batch or policy.open is not None:
            return
        if not self._round_complete(policy):
            self.out += status.waiting_notice(self, trainer)
            return
        slots = sorted(policy.offsets)
        # Hold mode reports every transition's length; barrier mode only when one spans several ticks (held
        # at a deadline, or while the policy had no trainer), so that a transition never hides its length.
        accumulators = [policy.round[s] for s in slots]
        with_frames = policy.options.mode == "hold" or any(a.ticks > 1 for a in accumulators)
        parts = [a.step_data(with_frames) for a in accumulators]
        data = concatenate_rows(parts, [policy.offsets[s] for s in slots], policy.spaces)
        policy.step += 1
        now = self.clock()
        # Unchecked: the rows were checked as they came in; a sampler's batches name their policy.
        batch = new_batch(policy.step, data, policy.name if policy.sampled else "")
        policy.open = OpenBatch(batch, now, {s: self.slots[s].game for s in slots})  # type: ignore[misc]
        policy.last_obs = data.obs
        for s in slots:
            self.slots[s].seen_by_trainer.add(policy.name)
        policy.round = {}
        policy.metrics.record_batch(data, now - trainer.wants_since, now)
        trainer.state = advance(trainer.state, "batch_sent")
        self.out.append(Send(trainer.peer, batch))

    def _trainer_reset(self, trainer: TrainerSession) -> None:
        policy = trainer.own or self.policies.get(trainer.policy)
        if policy is not None and policy.open is not None and policy.trainer is trainer:
            # A new or restarted trainer picks up the open batch (its codec may carry less than the last one's).
            policy.open.infos_dropped = False
            self.out.append(Send(trainer.peer, policy.open.batch))
            return
        self._ask(trainer, self.clock())
        if policy is not None:
            self.try_emit(policy)

    def _ask(self, trainer: TrainerSession, now: float) -> None:
        trainer.state = advance(trainer.state, "ask")
        trainer.wants_since = now

    def _trainer_act(self, trainer: TrainerSession, act: TrainerAct) -> None:
        policy = trainer.own or self.policies.get(trainer.policy)
        if policy is None or policy.open is None or policy.trainer is not trainer:
            raise RemoteProtocolError(ErrorCode.UNEXPECTED_MESSAGE, "actions sent with no batch outstanding")
        if act.step != policy.open.batch.step:
            raise RemoteProtocolError(
                ErrorCode.BAD_ACTIONS,
                f"actions answer step {act.step}, the open batch is step {policy.open.batch.step}",
            )
        actions = check_actions(act, policy.name, policy.spaces, policy.n_envs)
        now = self.clock()
        games = policy.open.games
        policy.metrics.trainer_busy_s += now - policy.open.since
        policy.record_response(now - policy.open.since)
        policy.open = None
        self._ask(trainer, now)
        for slot_index, game in games.items():
            if self.slots[slot_index].game is not game:
                continue  # that game left; its actions have nobody to go to
            start = policy.offsets[slot_index]
            n = game.groups[policy.name].n_agents
            # One game holding every row (most runs) takes the arrays as they are: slicing makes a view per key.
            part = actions if n == policy.n_envs else {k: v[start : start + n] for k, v in actions.items()}
            last = game.last_actions.get(policy.name)
            game.ready[policy.name] = keep_ended_rows(
                policy.round.get(slot_index), last, game.groups[policy.name], part
            )
            policy.unapplied.add(slot_index)
            self.try_reply(game)
        self.try_emit(policy)
