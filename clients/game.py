"""Game side in Python: speaks exactly what the Godot addon speaks (hello, step, actions)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import structlog

from broker.protocol import PROTOCOL_VERSION
from broker.protocol.codec import BodyKind
from broker.protocol.messages import GameActions, GameStep, Hello, Message, StepData
from broker.protocol.spaces import GroupSpec
from clients.errors import BrokerError
from clients.transport import (
    DEFAULT_TIMEOUT_RECONNECT,
    Address,
    BrokerGoneError,
    PeerSocket,
    default_name,
    default_token,
)

log = structlog.get_logger("gdrl.game")


class GameClient:
    """One game instance: announce groups once, then ``step`` in lock-step with the broker.

    ``step(data)`` sends each group's outcome (tick 0 is the first observation) and returns
    ``{policy: {action_key: array[n_agents, ...]}}`` for every group. A group the broker held (its
    trainer was busy) gets its previous actions again (zeros before the first); ``held`` names them.

    A lost broker (connection dropped; with ``reconnect_on_shutdown`` also an orderly shutdown) is
    reconnected for up to ``timeout_reconnect`` seconds (0: never): the game says hello again and starts
    over at tick 0 with its current observations, so the broker sees a new game (``game_index`` may
    change). After the timeout ``step`` raises BrokerGoneError.
    """

    def __init__(
        self,
        address: str | Address,
        groups: Sequence[GroupSpec],
        *,
        name: str | None = None,
        token: str | None = None,
        timeout_connect: float = 60.0,
        codec: BodyKind = BodyKind.MSGPACK,
        timeout_reconnect: float = DEFAULT_TIMEOUT_RECONNECT,
        reconnect_on_shutdown: bool = False,
    ) -> None:
        self.timeout_reconnect = timeout_reconnect
        self.reconnect_on_shutdown = reconnect_on_shutdown
        self.reconnects = 0
        self.closed_by_caller = False  # close() from another thread must not look like a lost broker
        self.groups = {g.policy: g for g in groups}
        token = default_token(token)
        hello = Hello("game", PROTOCOL_VERSION, name or default_name("game"), token, groups=tuple(groups))
        self.socket = PeerSocket(address, hello, timeout_connect=timeout_connect, codec=codec)
        self.game_index = self.socket.welcome.game_index
        self.tick = 0
        self.held: set[str] = set()
        self.last_actions = {policy: spec.zero_actions() for policy, spec in self.groups.items()}

    def step(self, groups: dict[str, StepData]) -> dict[str, dict[str, np.ndarray]]:
        message = self._exchange(groups)
        if not isinstance(message, GameActions) or message.tick != self.tick:
            raise BrokerError("unexpected_message", f"expected actions for tick {self.tick}, got {message!r:.80}")
        self.tick += 1
        self.held = set(self.groups) - set(message.groups)
        self.last_actions.update(message.groups)
        return dict(self.last_actions)

    def play(
        self,
        first: dict[str, StepData],
        apply: Callable[[dict[str, dict[str, np.ndarray]]], dict[str, StepData]],
        max_ticks: int | None = None,
    ) -> int:
        """Step the game (``apply``: actions -> next step) until the broker closes it or ``max_ticks``;
        returns the ticks played. The broker closing the game or its connection is a normal end; a broker
        that stayed away for the whole reconnect window is not (BrokerGoneError)."""
        data = first
        try:
            while max_ticks is None or self.tick < max_ticks:
                data = apply(self.step(data))
        except BrokerError as exc:
            if exc.code not in ("closed", "connection_lost") or isinstance(exc, BrokerGoneError):
                raise
            log.info("broker closed the game", reason=exc.message, ticks=self.tick)
        return self.tick

    def _exchange(self, groups: dict[str, StepData]) -> Message:
        """Send this tick's step and return the broker's answer, reconnecting if the broker was lost."""
        while True:
            try:
                self.socket.send(GameStep(self.tick, groups))
                return self.socket.recv()
            except BrokerError as exc:
                if (
                    self.closed_by_caller
                    or self.timeout_reconnect <= 0
                    or not self.socket.lost_broker(exc, self.reconnect_on_shutdown)
                ):
                    raise
                log.warning("lost the broker; reconnecting", address=str(self.socket.address), error=exc.message)
                self.socket.reconnect(self.timeout_reconnect, exc)
            # A new session: tick 0 carries the current observations and no transition (nobody acted on it).
            self.game_index = self.socket.welcome.game_index
            self.tick = 0
            groups = {policy: _first_tick(data) for policy, data in groups.items()}
            self.reconnects += 1
            log.info("reconnected to the broker", address=str(self.socket.address), game=self.game_index)

    def close(self, reason: str = "game closed") -> None:
        self.closed_by_caller = True
        self.socket.close(reason)


def _first_tick(data: StepData) -> StepData:
    n = data.n_rows
    return StepData(data.obs, np.zeros(n, np.float32), np.zeros(n, np.bool_), np.zeros(n, np.bool_))
