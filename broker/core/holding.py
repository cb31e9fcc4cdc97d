"""Holding: the one place where time and deadlines live.

A waiting game's group may be held (answered without its policy's actions) once its policy's deadline
passed, at once when the policy has no trainer (hold mode) or its trainer has sat on a batch past the
deadline. The default hold deadline adapts to the trainer's typical answer time. A game no trainer
learns from is paced to one reply per ``IDLE_TICK_S``. Games that wait with no deadline (barrier
stepping) are watched, and reported after ``STALL_REPORT_S``. All of it reads the injected clock and asks
for timers as effects; the hub decides what the timers mean when they come back.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from broker.core.effects import Deadline, Effect, IdleTick, StallCheck, StartTimer
from broker.core.states import GameState, GroupWait, advance
from broker.protocol.messages import RESPONSE_WINDOW

if TYPE_CHECKING:
    from broker.core.sessions import GameSession, PolicyState, Slot, TrainerSession

ROUND_WAIT_CAP_S = 0.5  # longest a hold-mode game waits for the other games of a round
# A game none of whose policies has a trainer gets at most one reply per this many seconds (hold mode):
# nobody learns from those ticks, so running them flat out only takes CPU from the trainers.
IDLE_TICK_S = 0.1
STALL_REPORT_S = 5.0  # a barrier game waiting this long is logged, and waiting trainers are told why


class ResponseTimes:
    """A trainer's last ``RESPONSE_WINDOW`` answer times and their median ("typical"), which is robust to
    the odd long PPO update. Kept sorted as they come, so an answer costs no sort of the window."""

    def __init__(self, window: int = RESPONSE_WINDOW) -> None:
        self._recent: deque[float] = deque(maxlen=window)
        self._sorted: list[float] = []
        self.typical_s = 0.0

    def add(self, seconds: float) -> None:
        if len(self._recent) == self._recent.maxlen:
            del self._sorted[bisect_left(self._sorted, self._recent[0])]
        self._recent.append(seconds)
        insort(self._sorted, seconds)
        n, mid = len(self._sorted), len(self._sorted) // 2
        self.typical_s = self._sorted[mid] if n % 2 else (self._sorted[mid - 1] + self._sorted[mid]) / 2

    def __len__(self) -> int:
        return len(self._recent)


@dataclass(frozen=True)
class Stall:
    """Games waiting, with no deadline, for one policy's actions (barrier stepping)."""

    reason: str  # "no trainer", or what its trainer is doing
    slots: tuple[int, ...]
    seconds: float  # the longest of those waits
    mode: str

    @property
    def games(self) -> str:
        return ",".join(str(s) for s in self.slots)

    def games_text(self, policy: str) -> str:
        waited = f"{self.seconds:.0f} s"
        return f"games {self.games} wait for policy '{policy}' ({self.reason}, {self.mode} stepping) for {waited}"


class Holding:
    """Deadlines, idle pacing and the stall watch. ``timers``: whether the caller runs timers at all
    (without them nothing is ever held for time: no deadline, no pacing, no stall report)."""

    def __init__(self, clock: Callable[[], float], timers: bool) -> None:
        self.clock = clock
        self.timers = timers
        self.idle_tick_s = IDLE_TICK_S
        self._stall_check_armed = False

    def may_hold(self, game: GameSession, policy: PolicyState) -> bool:
        if game.wait_of(policy.name) is GroupWait.RELEASED:
            return True
        if policy.options.mode != "hold":
            return False
        if policy.trainer is None:
            return True
        # A trainer that has sat on its batch past the deadline is busy (a PPO update, say): hold at once
        # instead of spending a full deadline on every tick until it is back.
        deadline = policy.deadline_s or 0.0
        return policy.open is not None and self.clock() - policy.open.since >= deadline

    def arm_deadline(self, game: GameSession, policy: PolicyState) -> list[Effect]:
        """Start the policy's deadline for the game's waiting tick, once (a trainer may attach mid-tick)."""
        deadline = policy.deadline_s
        if not self.timers or deadline is None or game.wait_of(policy.name) is not GroupWait.OPEN:
            return []
        game.waits[policy.name] = advance(GroupWait.OPEN, "arm")
        return [StartTimer(deadline, Deadline(game.peer_id, game.tick, policy.name, self.clock()))]

    def deadline_again(self, timer: Deadline, game: GameSession, policy: PolicyState) -> StartTimer | None:
        """A passed deadline starts over (returned) while the trainer still waits for other games to deliver
        the same round: holding would only make this game run ahead with ticks nobody decides on. Up to
        ``ROUND_WAIT_CAP_S`` in all, so that a stalled game does not stall the rest. None: release it."""
        deadline = policy.deadline_s
        trainer = policy.trainer
        waiting_for_games = (
            trainer is not None and trainer.wants_batch and policy.open is None and game.slot in policy.round
        )
        if (
            waiting_for_games
            and timer.started is not None
            and deadline is not None
            and self.timers
            and self.clock() - timer.started < ROUND_WAIT_CAP_S
        ):
            return StartTimer(deadline, timer)
        return None

    def pace(self, game: GameSession, held: list[str], policies: Mapping[str, PolicyState]) -> list[Effect] | None:
        """Hold the reply back when no policy of the game has a trainer and the game had one recently.

        Only a game whose every group is held for want of a trainer is paced; a busy trainer's holds and
        any game with a trainer at work keep their timing. None: reply now; else the reply waits, and the
        effects start its idle timer (none when one runs already).
        """
        if not self.timers or len(held) != len(game.groups):
            return None
        if any(policies[name].trainer is not None for name in held):
            return None
        wait = game.last_reply_at + self.idle_tick_s - self.clock()
        if wait <= 0:
            return None
        if game.state is GameState.PACED:
            return []
        game.state = advance(game.state, "pace")
        return [StartTimer(wait, IdleTick(game.peer_id, game.tick))]

    # --- stalls (barrier stepping) ---------------------------------------------------------------

    def watch_stalls(self) -> list[Effect]:
        """A game waits for a policy with no deadline: check back later, and say why if it still waits."""
        if not self.timers or self._stall_check_armed:
            return []
        self._stall_check_armed = True
        return [StartTimer(STALL_REPORT_S, StallCheck())]

    def stall_check_fired(self) -> None:
        self._stall_check_armed = False

    def stalls(
        self,
        slots: Iterable[Slot],
        policies: Mapping[str, PolicyState],
        trainers: Mapping[str, TrainerSession],
        min_wait_s: float = STALL_REPORT_S,
    ) -> dict[str, Stall]:
        """Policies that games have waited on, with no deadline, for ``min_wait_s`` or more."""
        now = self.clock()
        waiting: dict[str, list[GameSession]] = {}
        for slot in slots:
            game = slot.game
            if game is None or not game.awaiting or now - game.waiting_since < min_wait_s:
                continue
            for name in game.groups:
                policy = game.policies[name]
                if name not in game.ready and policy.deadline_s is None and not self.may_hold(game, policy):
                    waiting.setdefault(name, []).append(game)
        return {
            name: Stall(
                stall_reason(policies[name], trainers.get(name), now),
                tuple(g.slot for g in games),
                now - min(g.waiting_since for g in games),
                policies[name].options.mode,
            )
            for name, games in waiting.items()
        }


def stall_reason(policy: PolicyState, joined: TrainerSession | None, now: float) -> str:
    """What a stalled policy's games wait for; ``joined``: the trainer that joined for it, if any."""
    trainer = policy.trainer
    if trainer is None:
        return f"trainer '{joined.who}' waits for games" if joined else "no trainer"
    if policy.open is not None:
        waited = now - policy.open.since
        return f"trainer '{trainer.who}' has not answered batch {policy.open.batch.step} for {waited:.0f} s"
    return f"trainer '{trainer.who}' waits for the other games' steps"
