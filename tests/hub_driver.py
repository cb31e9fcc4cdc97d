"""A test driver for the sans-IO hub: the hub's effects carried out on fake links, behind a method API.

Tests written before the hub returned effects drive it through this, their assertions unchanged (the
server carries effects out itself, ``broker.server.entry.apply``). Each method (``add_game``, ``game_step``,
``trainer_act``, ...) calls one entry point and carries out the effects it returns, in order, on the links
(``link.send``, ``link.close``) and the scheduler. A link whose ``send`` cannot encode a batch for its
peer raises ``UnencodableMessage``; that goes back into the hub (``batch_undeliverable``), whose answer
is carried out in its place.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, Protocol

from broker.core.batching import UnencodableMessage
from broker.core.effects import Close, Deadline, Effect, Send, StallCheck, StartTimer, Timer
from broker.core.flow import Hub
from broker.core.sessions import GameSession, TrainerSession
from broker.protocol.messages import Batch, Error, GameStep, Hello, Message, StepOptions, TrainerAct, TrainerReset

Scheduler = Callable[[float, Callable[[], None]], Any]  # (delay in seconds, callback) -> handle


class Link(Protocol):
    """What the driver needs of a connection: send a message, or close with an error."""

    label: str

    def send(self, message: Message) -> None: ...

    def close(self, error: Error | None = None) -> None: ...


class LinkHub(Hub):
    def __init__(
        self,
        expected_games: int = 1,
        stepping: StepOptions | None = None,
        scheduler: Scheduler | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(expected_games, stepping, clock, timers=scheduler is not None)
        self.scheduler = scheduler

    def add_game(self, link: Link, hello: Hello) -> GameSession:
        """Seat a game, or raise RemoteProtocolError naming what is wrong (nothing else changes)."""
        self.apply(self.handle(link, hello))
        game = self.session(link)
        assert isinstance(game, GameSession)
        return game

    def add_trainer(self, link: Link, hello: Hello) -> TrainerSession:
        self.apply(self.handle(link, hello))
        trainer = self.session(link)
        assert isinstance(trainer, TrainerSession)
        return trainer

    def game_step(self, game: GameSession, step: GameStep) -> None:
        self.apply(self.handle(game.peer, step))

    def trainer_act(self, trainer: TrainerSession, act: TrainerAct) -> None:
        self.apply(self.handle(trainer.peer, act))

    def trainer_reset(self, trainer: TrainerSession) -> None:
        self.apply(self.handle(trainer.peer, TrainerReset()))

    def remove_game(self, game: GameSession) -> None:
        if self.session(game.peer) is game:
            self.apply(self.peer_lost(game.peer))

    def remove_trainer(self, trainer: TrainerSession) -> None:
        if self.session(trainer.peer) is trainer:
            self.apply(self.peer_lost(trainer.peer))

    def deadline_passed(self, game: GameSession, tick: int, name: str, started: float | None = None) -> None:
        self.apply(self.timer_fired(Deadline(game.peer_id, tick, name, started)))

    def report_stalls(self) -> None:
        self.apply(self.timer_fired(StallCheck()))

    def apply(self, effects: list[Effect]) -> None:
        """Carry out ``effects`` in order on the links and the scheduler."""
        for effect in effects:
            if isinstance(effect, Send):
                self._send(effect)
            elif isinstance(effect, Close):
                effect.peer.close(effect.error)  # type: ignore[attr-defined]
            elif isinstance(effect, StartTimer):
                self._start(effect)

    def _send(self, effect: Send) -> None:
        try:
            effect.peer.send(effect.message)  # type: ignore[attr-defined]
        except UnencodableMessage as exc:
            if not isinstance(effect.message, Batch):
                raise
            self.apply(
                self.batch_undeliverable(
                    effect.peer, effect.message.step, exc.encodable, exc.message, effect.message.policy
                )
            )

    def _start(self, effect: StartTimer) -> None:
        assert self.scheduler is not None  # the hub asks for timers only when it was given a scheduler
        if isinstance(effect.timer, StallCheck):
            self.scheduler(effect.delay_s, self.report_stalls)
        else:
            self.scheduler(effect.delay_s, functools.partial(self._fire, effect.timer))

    def _fire(self, timer: Timer) -> None:
        self.apply(self.timer_fired(timer))
