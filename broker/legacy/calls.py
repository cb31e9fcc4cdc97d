"""A godot_rl trainer's ``call`` relayed to the plugin games of its policy: the bookkeeping. Sans-IO.

godot_rl's ``env.call(method)`` runs ``method`` on every agent of the game. The broker serves one policy
to such a script over all games, so it asks every plugin game that has agents of that policy (native
games have no ``call``) and answers with their ``returns`` lists joined in slot order. A game that does
not answer within the timeout (it left, say) contributes nothing: the server arms a timer for each
``CallDeadline`` this returns and hands it back to ``expire`` when it fires.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Generic, TypeVar

import structlog

from broker.legacy.godot_rl_game import CallResult

log = structlog.get_logger("gdrl.legacy")

DEFAULT_TIMEOUT_CALL: Final = 30.0

Asker = TypeVar("Asker")
Game = TypeVar("Game", bound=Hashable)


@dataclass(frozen=True)
class CallDeadline:
    """A timer for the server to arm; when it fires, pass it to ``CallRelay.expire``."""

    call_id: int
    delay_s: float


@dataclass(frozen=True)
class CallDone(Generic[Asker]):
    """The answer for ``asker``: every answering game's returns, in slot order."""

    call_id: int
    asker: Asker
    returns: list[Any]


@dataclass
class _OpenCall(Generic[Asker, Game]):
    asker: Asker
    policy: str
    method: str
    waiting: dict[Game, int]  # game -> its place in slot order
    results: dict[int, list[Any]] = field(default_factory=dict)

    def done(self, call_id: int) -> CallDone[Asker]:
        return CallDone(call_id, self.asker, [value for i in sorted(self.results) for value in self.results[i]])


class CallRelay(Generic[Asker, Game]):
    """Open calls, at most one per asker (a godot_rl script waits for each answer)."""

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_CALL) -> None:
        self.timeout_s = timeout_s
        self._open: dict[int, _OpenCall[Asker, Game]] = {}
        self._ids = itertools.count()

    def start(self, asker: Asker, policy: str, method: str, called: Sequence[Game]) -> CallDone[Asker] | CallDeadline:
        """``called``: the games that took the ``call`` request, in slot order."""
        call_id = next(self._ids)
        call: _OpenCall[Asker, Game] = _OpenCall(asker, policy, method, {game: i for i, game in enumerate(called)})
        if not call.waiting:
            return call.done(call_id)
        self._open[call_id] = call
        return CallDeadline(call_id, self.timeout_s)

    def answered(self, game: Game, result: CallResult) -> CallDone[Asker] | None:
        """A game's answer; the whole answer once it was the last one awaited. A late answer is dropped."""
        for call_id, call in self._open.items():
            index = call.waiting.pop(game, None)
            if index is None:
                continue
            call.results[index] = result.returns
            if call.waiting:
                return None
            del self._open[call_id]
            return call.done(call_id)
        return None

    def expire(self, deadline: CallDeadline) -> CallDone[Asker] | None:
        """The timeout passed: answer with what came, or None if the call was complete already."""
        call = self._open.pop(deadline.call_id, None)
        if call is None:
            return None
        log.warning("call unanswered", policy=call.policy, method=call.method, games=len(call.waiting))
        return call.done(deadline.call_id)
