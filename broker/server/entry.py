"""The one way into the hub, and its effects carried out: ``HubEntry``, the compiled base of ``BrokerServer``.

Every message of every step passes through ``HubEntry.enter`` and ``apply``, so they are compiled (broker/compiled.py)
with the per-step modules; interpreted, they cost about 1 us a message on the 1-agent path
(docs/performance_history.md, "Session 36"). The rest of the server (listening, status, shutdown) stays in
server.py, interpreted. Callers still reach ``enter`` as an attribute of the server, so a test may wrap it.

The effects are carried out by module functions, not methods: compiled code reaches a method of an interpreted
subclass's instance (the server) through a Python attribute lookup, a function directly.
"""

from __future__ import annotations

import asyncio
from typing import cast

import structlog
from mypy_extensions import mypyc_attr

from broker.core.batching import UnencodableMessage
from broker.core.effects import Close as CloseEffect
from broker.core.effects import Effect, Send, StartTimer, Timer
from broker.core.flow import Hub
from broker.protocol.messages import Batch, Message
from broker.server.peer import Link

log = structlog.get_logger("gdrl.server")


@mypyc_attr(allow_interpreted_subclasses=True)
class HubEntry:
    """Hands messages and departures to the hub and carries out what it answers, in order: sends, closes,
    timers. Everything runs on the event loop's thread; the hub is never entered concurrently."""

    def __init__(self, hub: Hub) -> None:
        self.hub = hub

    def enter(self, peer: Link, message: Message) -> None:
        """Hand ``message`` from ``peer`` to the hub and carry out what it answers. A RemoteProtocolError
        (the peer's fault) propagates to the caller, which closes that peer; the hub is unchanged then."""
        apply(self, self.hub.handle(peer, message))

    def leave(self, peer: Link) -> None:
        """``peer``'s connection is gone: its game or trainer leaves the hub."""
        apply(self, self.hub.peer_lost(peer))

    def timer_fired(self, timer: Timer) -> None:
        """A hub timer (deadline, idle pacing, stall check) is due; a failure is logged, never fatal."""
        try:
            apply(self, self.hub.timer_fired(timer))
        except Exception:
            log.exception("hub timer failed")


def apply(entry: HubEntry, effects: list[Effect]) -> None:
    """Carry out the hub's effects in order: sends, closes, timers."""
    for effect in effects:
        if isinstance(effect, Send):
            _send(entry, cast(Link, effect.peer), effect.message)  # every peer the server hands the hub is one
        elif isinstance(effect, CloseEffect):
            cast(Link, effect.peer).close(effect.error)
        elif isinstance(effect, StartTimer):
            asyncio.get_running_loop().call_later(effect.delay_s, entry.timer_fired, effect.timer)


def _send(entry: HubEntry, peer: Link, message: Message) -> None:
    try:
        peer.send(message)
    except UnencodableMessage as exc:  # the batch, not the peer, is at fault: the hub re-sends a part
        if not isinstance(message, Batch):
            raise
        apply(entry, entry.hub.batch_undeliverable(peer, message.step, exc.encodable, exc.message, message.policy))
