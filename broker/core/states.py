"""The states of the hub's sessions, and the one table of their transitions.

Every state change goes through ``advance``: a change the table does not list is a bug in the hub (an
AssertionError), never something a peer can cause, because the hub checks what peers send before it
changes anything.
"""

from __future__ import annotations

from enum import Enum
from typing import TypeVar


class GameState(Enum):
    STEPPING = "stepping"  # its turn: the hub waits for the game's next step
    WAITING = "waiting"  # a step arrived and its reply is not sent yet
    PACED = "paced"  # waiting, and its reply is held back until an IdleTick (no trainer anywhere)
    LEFT = "left"

    __hash__ = object.__hash__  # members are singletons; keeps the table's lookups in C


class GroupWait(Enum):
    """Where one group of a waiting game tick stands with its policy's deadline (reset every tick)."""

    OPEN = "open"  # no deadline runs (none set, or no trainer yet)
    TIMED = "timed"  # the policy's deadline timer runs for this tick
    RELEASED = "released"  # the deadline passed: the group may be held

    __hash__ = object.__hash__  # members are singletons; keeps the table's lookups in C


class TrainerState(Enum):
    IDLE = "idle"  # not asking for a batch: just joined, or working on the batch it has
    ASKING = "asking"  # asked for a batch (reset, or answered the last one) and has none yet
    LEFT = "left"

    __hash__ = object.__hash__  # members are singletons; keeps the table's lookups in C


State = TypeVar("State", GameState, GroupWait, TrainerState)

TRANSITIONS: dict[tuple[Enum, str], Enum] = {
    (GameState.STEPPING, "step"): GameState.WAITING,
    (GameState.WAITING, "pace"): GameState.PACED,
    (GameState.PACED, "idle_tick"): GameState.WAITING,
    (GameState.WAITING, "reply"): GameState.STEPPING,
    (GameState.PACED, "reply"): GameState.STEPPING,
    **{(state, "leave"): GameState.LEFT for state in (GameState.STEPPING, GameState.WAITING, GameState.PACED)},
    (GroupWait.OPEN, "arm"): GroupWait.TIMED,
    (GroupWait.OPEN, "release"): GroupWait.RELEASED,
    (GroupWait.TIMED, "release"): GroupWait.RELEASED,
    (GroupWait.RELEASED, "release"): GroupWait.RELEASED,  # a timer handed back twice changes nothing
    (TrainerState.IDLE, "ask"): TrainerState.ASKING,
    (TrainerState.ASKING, "ask"): TrainerState.ASKING,
    (TrainerState.ASKING, "batch_sent"): TrainerState.IDLE,
    (TrainerState.IDLE, "leave"): TrainerState.LEFT,
    (TrainerState.ASKING, "leave"): TrainerState.LEFT,
}


def advance(state: State, event: str) -> State:
    """The state after ``event``; an event the table does not allow in ``state`` is a hub bug."""
    following = TRANSITIONS.get((state, event))
    if following is None:
        raise AssertionError(f"no transition from {state} on {event!r}")
    return following  # type: ignore[return-value]
