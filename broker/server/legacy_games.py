"""The I/O around godot_rl plugin games that the sans-IO ``broker.legacy`` modules leave to the server:
where a game may connect from, and the timers and writes of a godot_rl trainer's ``call`` relay."""

from __future__ import annotations

import asyncio
import ipaddress
from typing import TYPE_CHECKING, Any, Protocol

from broker.legacy.calls import DEFAULT_TIMEOUT_CALL, CallDeadline, CallDone, CallRelay
from broker.legacy.game_connection import GodotRlGameConnection
from broker.legacy.godot_rl_game import CallResult

if TYPE_CHECKING:
    from broker.server.peer import PeerProtocol
    from broker.server.server import BrokerServer


def is_loopback(transport: asyncio.BaseTransport) -> bool:
    address = transport.get_extra_info("peername")
    if not isinstance(address, tuple):
        return True  # a Unix socket is local by construction
    try:
        return ipaddress.ip_address(address[0]).is_loopback
    except ValueError:
        return False


class CallAsker(Protocol):
    """Who relays a ``call`` (a dialed godot_rl trainer): gets the joined returns."""

    def call_answered(self, returns: list[Any]) -> None: ...


class GodotRlCalls:
    """Relays a godot_rl trainer's ``call`` to every plugin game with its policy's agents."""

    def __init__(self, server: BrokerServer, timeout_s: float = DEFAULT_TIMEOUT_CALL) -> None:
        self.server = server
        self.relay: CallRelay[CallAsker, PeerProtocol] = CallRelay(timeout_s)
        self._timers: dict[int, asyncio.TimerHandle] = {}

    def call(self, asker: CallAsker, policy: str, method: str) -> None:
        called = [peer for peer in self.games_with(policy) if peer.start_call(method)]
        self._apply(self.relay.start(asker, policy, method, called))

    def answered(self, peer: PeerProtocol, result: CallResult) -> None:
        self._apply(self.relay.answered(peer, result))

    def games_with(self, policy: str) -> list[PeerProtocol]:
        """Live plugin games that have agents of ``policy``, in slot order."""
        games = [
            peer
            for peer in self.server.connections
            if isinstance(peer.connection, GodotRlGameConnection)
            and not peer.closing
            and peer.game is not None
            and policy in peer.game.groups
        ]
        return sorted(games, key=lambda peer: peer.game.slot if peer.game else -1)

    def _apply(self, outcome: CallDone[CallAsker] | CallDeadline | None) -> None:
        if isinstance(outcome, CallDeadline):
            loop = asyncio.get_running_loop()
            self._timers[outcome.call_id] = loop.call_later(outcome.delay_s, self._expire, outcome)
        elif outcome is not None:
            timer = self._timers.pop(outcome.call_id, None)
            if timer is not None:
                timer.cancel()
            outcome.asker.call_answered(outcome.returns)

    def _expire(self, deadline: CallDeadline) -> None:
        self._timers.pop(deadline.call_id, None)
        self._apply(self.relay.expire(deadline))
