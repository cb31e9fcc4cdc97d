"""Game side in Python: speaks exactly what the Godot addon speaks (hello, step, actions)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from broker.protocol import PROTOCOL_VERSION
from broker.protocol.codec import BodyKind
from broker.protocol.messages import GameActions, GameStep, Hello, StepData
from broker.protocol.spaces import GroupSpec
from clients.errors import BrokerError
from clients.transport import Address, PeerSocket, default_name


class GameClient:
    """One game instance: announce groups once, then ``step`` in lock-step with the broker.

    ``step(data)`` sends each group's outcome (tick 0 is the first observation) and returns
    ``{policy: {action_key: array[n_agents, ...]}}``.
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
    ) -> None:
        self.groups = {g.policy: g for g in groups}
        hello = Hello("game", PROTOCOL_VERSION, name or default_name("game"), token, groups=tuple(groups))
        self.socket = PeerSocket(address, hello, timeout_connect=timeout_connect, codec=codec)
        self.game_index = self.socket.welcome.game_index
        self.tick = 0

    def step(self, groups: dict[str, StepData]) -> dict[str, dict[str, np.ndarray]]:
        self.socket.send(GameStep(self.tick, groups))
        message = self.socket.recv()
        if not isinstance(message, GameActions) or message.tick != self.tick:
            raise BrokerError("unexpected_message", f"expected actions for tick {self.tick}, got {message!r:.80}")
        self.tick += 1
        return message.groups

    def close(self, reason: str = "game closed") -> None:
        self.socket.close(reason)
