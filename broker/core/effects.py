"""What the hub asks its caller to do: typed, frozen values returned by every entry point of ``Hub``.

The hub never calls up into a connection. A peer is an opaque hashable key the caller passed in (the
server's connection object, say); the hub reads only its ``label``. Timers are frozen values the hub
understands when the caller hands them back to ``Hub.timer_fired`` after ``delay_s``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Protocol, final

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


@final
class Send:
    """Send ``message`` to ``peer``.

    Every step makes several, so it is a plain class: compiled, its constructor is C (about 0.1 us against
    0.6 for a frozen dataclass, whose ``__init__`` stays Python under mypyc). Its attributes are ``Final``:
    mypy refuses a write, and compiled they are read-only (AttributeError)."""

    __slots__ = ("message", "peer")

    def __init__(self, peer: Peer, message: Message) -> None:
        self.peer: Final = peer
        self.message: Final = message

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Send) and self.peer == other.peer and self.message == other.message

    def __hash__(self) -> int:
        return hash((self.peer, self.message))

    def __repr__(self) -> str:
        return f"Send(peer={self.peer!r}, message={self.message!r})"


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
