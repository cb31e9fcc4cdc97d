"""What the hub asks its caller to do: typed, frozen values returned by every entry point of ``Hub``.

The hub never calls up into a connection. A peer is an opaque hashable key the caller passed in (the
server's connection object, say); the hub reads only its ``label``. Timers are frozen values the hub
understands when the caller hands them back to ``Hub.timer_fired`` after ``delay_s``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from broker.protocol.messages import Error, Message


class Peer(Protocol):
    """A connection as the hub sees it: a hashable key with a name for the logs."""

    @property
    def label(self) -> str: ...


@dataclass(frozen=True, slots=True)
class Deadline:
    """A policy's deadline for one game tick (``started``: when the first wait for it began)."""

    game_id: int
    tick: int
    policy: str
    started: float | None


@dataclass(frozen=True, slots=True)
class IdleTick:
    """A paced game (no trainer for any of its policies) may have its reply for ``tick`` now."""

    game_id: int
    tick: int


@dataclass(frozen=True, slots=True)
class StallCheck:
    """Time to look at games waiting, with no deadline, for a policy (barrier stepping)."""


Timer = Deadline | IdleTick | StallCheck


@dataclass(frozen=True, slots=True)
class Send:
    peer: Peer
    message: Message


@dataclass(frozen=True, slots=True)
class Close:
    """Close ``peer``, telling it ``error`` first when there is one."""

    peer: Peer
    error: Error | None = None


@dataclass(frozen=True, slots=True)
class StartTimer:
    delay_s: float
    timer: Timer


Effect = Send | Close | StartTimer
