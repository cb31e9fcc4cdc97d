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
  (Deadlines, pacing and stalls: broker/core/holding.py.)
* An action computed from an observation whose episode has ended meanwhile is not applied to the next
  episode: those agents keep their previous action and the row's info says ``action_applied: false``.
* A lost game: its undelivered rows are dropped; when a game takes the slot again, its first step
  reports every agent of the slot as truncated, with the last observation the trainer saw as the
  final observation, so SB3's episode bookkeeping stays right.
* A lost trainer: the batch it did not answer is sent again to the next trainer of that policy.
Memory is bounded by one accumulator per slot and policy (infos replaced, never merged, across held
ticks), and one open batch per policy. A batch its trainer's codec cannot carry comes back through
``batch_undeliverable`` and goes again without the offending infos.

Sans-IO: every entry point returns effects (broker/core/effects.py) for the caller to carry out in
order; the hub never calls into a connection. Peers are the caller's keys; the hub reads their label.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import structlog

from broker.core import seating, status
from broker.core.accumulate import SlotAccumulator
from broker.core.batching import concatenate_rows, drop_unencodable_infos
from broker.core.effects import Close, Deadline, Effect, IdleTick, Peer, Send, StallCheck, Timer
from broker.core.holding import STALL_REPORT_S, Holding, Stall
from broker.core.sessions import GameSession, OpenBatch, PolicyState, Slot, TrainerSession
from broker.core.states import GameState, advance
from broker.protocol import PROTOCOL_VERSION
from broker.protocol.checks import check_actions, check_step
from broker.protocol.errors import ErrorCode, RemoteProtocolError
from broker.protocol.messages import (
    Batch,
    Error,
    GameActions,
    GameStep,
    Hello,
    Message,
    StepData,
    StepOptions,
    TrainerAct,
    TrainerReset,
    Welcome,
)

log = structlog.get_logger("gdrl.hub")

Session = GameSession | TrainerSession


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
        self._out: list[Effect] = []

    # --- the ways in -----------------------------------------------------------------------------

    def handle(self, peer: Peer, message: Message) -> list[Effect]:
        """A peer's Hello, GameStep, TrainerAct or TrainerReset. A RemoteProtocolError raised here names
        what the peer did wrong (the caller closes that peer); nothing has changed then."""
        self._out = []
        session = self.sessions.get(peer)
        if isinstance(message, Hello) and session is None and message.role in ("game", "trainer"):
            self._add_game(peer, message) if message.role == "game" else self._add_trainer(peer, message)
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
        self._out = []
        session = self.sessions.pop(peer, None)
        if isinstance(session, GameSession):
            self._remove_game(session)
        elif isinstance(session, TrainerSession):
            self._remove_trainer(session)
        return self._take()

    def timer_fired(self, timer: Timer) -> list[Effect]:
        self._out = []
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
            self._try_reply(game)
        return self._take()

    def batch_undeliverable(self, peer: Peer, step: int, encodable: Callable[[Any], bool]) -> list[Effect]:
        """The caller could not encode batch ``step`` for ``peer``'s codec and wrote nothing: the batch goes
        again with every info ``encodable`` refuses replaced (logged with the games they came from); if it
        was that batch already, the trainer is closed (the broker's own bug)."""
        self._out = []
        trainer = self.sessions.get(peer)
        policy = self.policies.get(trainer.policy) if isinstance(trainer, TrainerSession) else None
        if policy is None or policy.open is None or policy.open.batch.step != step:
            return []
        if policy.open.infos_dropped:
            log.error("batch not encodable", policy=policy.name, trainer=peer.label, step=step)
            return [Close(peer, Error(ErrorCode.INTERNAL.value, "the broker could not encode the batch"))]
        data, rows = drop_unencodable_infos(policy.open.batch.data, encodable)
        log.error(
            "batch not encodable, infos dropped",
            policy=policy.name,
            trainer=peer.label,
            rows=rows[:16],
            games=sorted({seating.game_of_row(self.slots, policy, row) for row in rows}),
        )
        policy.open.batch = Batch(step, data)
        policy.open.infos_dropped = True
        return [Send(peer, policy.open.batch)]

    # --- queries ---------------------------------------------------------------------------------

    def session(self, peer: Peer) -> Session | None:
        return self.sessions.get(peer)

    def games_connected(self) -> int:
        return sum(1 for s in self.slots if s.game is not None)

    def stalls(self, min_wait_s: float = STALL_REPORT_S) -> dict[str, Stall]:
        """Policies that games have waited on, with no deadline, for ``min_wait_s`` or more."""
        return self.holding.stalls(self.slots, self.policies, self.trainers, min_wait_s)

    def snapshot(self) -> dict[str, Any]:
        return status.snapshot(self)

    # --- joining and leaving ---------------------------------------------------------------------

    def _take(self) -> list[Effect]:
        out, self._out = self._out, []
        return out

    def _peer_id(self) -> int:
        peer_id = self._next_peer_id
        self._next_peer_id += 1
        return peer_id

    def _add_game(self, peer: Peer, hello: Hello) -> None:
        name = hello.name or peer.label
        seating.check_spaces(hello, name, self.policies)
        layout = {g.policy: g.n_agents for g in hello.groups}
        slot = seating.choose_slot(self.slots, layout, name)
        game = GameSession(peer, self._peer_id(), hello.name, slot.index, {g.policy: g for g in hello.groups})
        for group in hello.groups:
            if group.policy not in self.policies:
                trainer = self.trainers.get(group.policy)
                options = trainer.options if trainer and trainer.options else self.default_stepping
                self.policies[group.policy] = PolicyState(group.policy, group.spaces, options)
        slot.layout = layout
        slot.game = game
        self.sessions[peer] = game
        self._out.append(Send(peer, Welcome(PROTOCOL_VERSION, game.peer_id, slot.index)))
        log.info("game joined", peer=peer.label, game=slot.index, name=hello.name, groups=layout)
        if not self.layout_complete and all(s.layout is not None for s in self.slots):
            self._complete_layout()
        self._out += status.waiting_notices(self)

    def _complete_layout(self) -> None:
        self.layout_complete = True
        seating.lay_out(self.slots, self.policies)
        for trainer in list(self.waiting_trainers):
            self.waiting_trainers.remove(trainer)
            if trainer.policy in self.policies:
                self._attach(trainer)
            else:
                self.trainers.pop(trainer.policy, None)
                self.sessions.pop(trainer.peer, None)
                self._out.append(Close(trainer.peer, self._unknown_policy(trainer.policy)))

    def _unknown_policy(self, name: str) -> Error:
        known = ", ".join(sorted(self.policies)) or "none"
        return Error(ErrorCode.UNKNOWN_POLICY.value, f"no game announces policy '{name}'; known policies: {known}")

    def _add_trainer(self, peer: Peer, hello: Hello) -> None:
        policy = hello.policy
        holder = self.trainers.get(policy)
        if holder is not None:
            raise RemoteProtocolError(
                ErrorCode.POLICY_TAKEN,
                f"policy '{policy}' already has a trainer ({holder.peer.label}); one trainer per policy",
            )
        if self.layout_complete and policy not in self.policies:
            raise RemoteProtocolError(ErrorCode.UNKNOWN_POLICY, self._unknown_policy(policy).message)
        trainer = TrainerSession(peer, self._peer_id(), hello.name, policy, hello.stepping)
        self.trainers[policy] = trainer
        self.sessions[peer] = trainer
        if policy in self.policies and hello.stepping is not None:
            self.policies[policy].options = hello.stepping
        self._out.append(Send(peer, Welcome(PROTOCOL_VERSION, trainer.peer_id)))
        options = hello.stepping or self.default_stepping
        log.info("trainer joined", peer=peer.label, policy=policy, name=hello.name, stepping=options.mode)
        if self.layout_complete:
            self._attach(trainer)
        else:
            self.waiting_trainers.append(trainer)
            self._out += status.waiting_notice(self, trainer)

    def _attach(self, trainer: TrainerSession) -> None:
        policy = self.policies[trainer.policy]
        policy.trainer = trainer
        self._out.append(Send(trainer.peer, seating.policy_info(self.slots, policy)))
        if trainer.wants_batch:
            self._try_emit(policy)

    def _remove_game(self, game: GameSession) -> None:
        slot = self.slots[game.slot]
        if slot.game is not game:
            return
        slot.game = None
        game.state = advance(game.state, "leave")
        for name in game.groups:
            policy = self.policies[name]
            policy.round.pop(slot.index, None)
            policy.unapplied.discard(slot.index)  # a replacement starts from its own first tick
            policy.applied_at.pop(slot.index, None)
        log.info("game left", game=slot.index, name=game.name, steps=game.steps)
        self._out += status.waiting_notices(self)

    def _remove_trainer(self, trainer: TrainerSession) -> None:
        if self.trainers.get(trainer.policy) is not trainer:
            return
        del self.trainers[trainer.policy]
        trainer.state = advance(trainer.state, "leave")
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
            self._accumulate(self.policies[name], self.slots[game.slot], step.tick, data, now)
        game.state = advance(game.state, "step")
        game.tick = step.tick
        game.waiting_since = now
        game.waits = {}
        game.next_tick += 1
        game.steps += 1
        for name in step.groups:
            self._try_emit(self.policies[name])
        self._try_reply(game)

    def _accumulate(self, policy: PolicyState, slot: Slot, tick: int, data: StepData, now: float) -> None:
        if tick == 0 and policy.name in slot.seen_by_trainer and policy.last_obs is not None:
            data = self._truncate_replaced(policy, slot.index, data)
        accumulator = policy.round.get(slot.index)
        if accumulator is None:
            accumulator = policy.round[slot.index] = SlotAccumulator(data)
        else:
            accumulator.merge(data)
        accumulator.last_tick = tick
        policy.metrics.group_ticks += 1
        policy.metrics.ticks_rate.add(now, policy.metrics.group_ticks)

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

    def _current_game(self, game_id: int, tick: int) -> GameSession | None:
        """The game with ``game_id``, if it is still seated and still waits for the reply to ``tick``."""
        game = next((s.game for s in self.slots if s.game is not None and s.game.peer_id == game_id), None)
        return game if game is not None and game.awaiting and game.tick == tick else None

    def _deadline_passed(self, game: GameSession, timer: Deadline) -> None:
        """A policy's deadline for one game tick: from now on that group may be held (or it starts over)."""
        policy = self.policies[timer.policy]
        again = self.holding.deadline_again(timer, game, policy)
        if again is not None:
            self._out.append(again)
            return
        game.waits[policy.name] = advance(game.wait_of(policy.name), "release")
        self._try_reply(game)

    def _try_reply(self, game: GameSession) -> None:
        if not game.awaiting:
            return
        held, waiting = [], []
        for name in game.groups:
            if name in game.ready:
                continue
            if self.holding.may_hold(game, self.policies[name]):
                held.append(name)
            else:
                waiting.append(self.policies[name])
        if waiting:
            for policy in waiting:
                self._out += self.holding.arm_deadline(game, policy)
                if policy.deadline_s is None:
                    self._out += self.holding.watch_stalls()
            return
        paced = self.holding.pace(game, held, self.policies)
        if paced is not None:
            self._out += paced
            return
        self._reply(game, held)

    def _reply(self, game: GameSession, held: list[str]) -> None:
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
        game.state = advance(game.state, "reply")
        game.last_reply_at = self.clock()
        self._out.append(Send(game.peer, GameActions(game.tick, groups)))
        for name in groups:
            self._try_emit(self.policies[name])

    def _report_stalls(self) -> None:
        self.holding.stall_check_fired()
        self._out += status.stall_report(self, self.stalls())
        if self.stalls(min_wait_s=0.0):
            self._out += self.holding.watch_stalls()

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
        if trainer is None or not trainer.wants_batch or policy.open is not None:
            return
        if not self._round_complete(policy):
            self._out += status.waiting_notice(self, trainer)
            return
        slots = sorted(policy.offsets)
        with_frames = policy.options.mode == "hold"
        parts = [policy.round[s].step_data(with_frames) for s in slots]
        data = concatenate_rows(parts, [policy.offsets[s] for s in slots], policy.spaces)
        policy.step += 1
        now = self.clock()
        batch = Batch(policy.step, data)
        policy.open = OpenBatch(batch, now, {s: self.slots[s].game for s in slots})  # type: ignore[misc]
        policy.last_obs = data.obs
        for s in slots:
            self.slots[s].seen_by_trainer.add(policy.name)
        policy.round = {}
        policy.metrics.record_batch(data, now - trainer.wants_since, now)
        trainer.state = advance(trainer.state, "batch_sent")
        self._out.append(Send(trainer.peer, batch))

    def _trainer_reset(self, trainer: TrainerSession) -> None:
        policy = self.policies.get(trainer.policy)
        if policy is not None and policy.open is not None and policy.trainer is trainer:
            # A new or restarted trainer picks up the open batch (its codec may carry less than the last one's).
            policy.open.infos_dropped = False
            self._out.append(Send(trainer.peer, policy.open.batch))
            return
        self._ask(trainer)
        if policy is not None:
            self._try_emit(policy)

    def _ask(self, trainer: TrainerSession) -> None:
        trainer.state = advance(trainer.state, "ask")
        trainer.wants_since = self.clock()

    def _trainer_act(self, trainer: TrainerSession, act: TrainerAct) -> None:
        policy = self.policies.get(trainer.policy)
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
        self._ask(trainer)
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
