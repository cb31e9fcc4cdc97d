"""How a policy's agents wait for its trainer: the ``stepping`` options of a trainer's hello."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from broker.protocol.errors import ErrorCode, RemoteProtocolError

STEPPING_MODES = ("hold", "barrier")
HOLD_ACTIONS = ("repeat", "noop")
# The hold deadline of a policy whose trainer sets none adapts to that trainer (StepOptions.deadline_s).
DEFAULT_HOLD_DEADLINE_MS = 20.0  # the floor, and the deadline of a trainer that answers fast
RESPONSE_MARGIN = 4.0  # at least this many typical answers
RESPONSE_WINDOW = 64  # recent answer times whose median is "typical"
# The cap matters when one script steps several policies in turn: each trainer's answer time then includes
# the others' steps (and their deadlines), which would otherwise feed back into ever longer deadlines.
MAX_ADAPTIVE_DEADLINE_MS = 100.0
HOLD_DEADLINE_DEFAULT_TEXT = (
    f"adapts: the larger of {DEFAULT_HOLD_DEADLINE_MS:g} ms and {RESPONSE_MARGIN:g} x the trainer's median "
    f"answer time over its last {RESPONSE_WINDOW} batches, at most {MAX_ADAPTIVE_DEADLINE_MS:g} ms"
)


@dataclass(frozen=True)
class StepOptions:
    """How a policy's agents wait for its trainer (see docs/protocol.md, hold-and-accumulate).

    ``mode`` "hold": a game waits at most ``deadline_ms`` for this policy's actions, then its agents keep
    their last action ("repeat") or get zeros ("noop"). "barrier": the game waits for the actions, up to
    ``deadline_ms`` if given (then it falls back to hold), else for as long as it takes.
    """

    mode: str = "hold"
    deadline_ms: float | None = None
    hold_action: str = "repeat"

    @property
    def adapts(self) -> bool:
        """The deadline follows the trainer's answer times (hold mode, no deadline given)."""
        return self.mode == "hold" and self.deadline_ms is None

    def deadline_s(self, typical_response_s: float) -> float | None:
        """Seconds a game waits for this policy's actions; None: no limit. An explicit deadline is kept as
        given. The hold default adapts: a trainer that always needs, say, 30 ms to turn a large batch around
        is slow, not busy, and holding it would only add game ticks that carry no decision; so the default
        is the larger of 20 ms and a few typical answers (``HOLD_DEADLINE_DEFAULT_TEXT``)."""
        if self.deadline_ms is not None:
            return self.deadline_ms / 1000.0
        if not self.adapts:
            return None
        adaptive = min(RESPONSE_MARGIN * typical_response_s, MAX_ADAPTIVE_DEADLINE_MS / 1000.0)
        return max(DEFAULT_HOLD_DEADLINE_MS / 1000.0, adaptive)

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"mode": self.mode, "hold_action": self.hold_action}
        if self.deadline_ms is not None:
            wire["deadline_ms"] = self.deadline_ms
        return wire

    @classmethod
    def from_wire(cls, obj: Any) -> StepOptions:
        if not isinstance(obj, dict):
            raise RemoteProtocolError(ErrorCode.BAD_HELLO, "hello.stepping must be a map")
        mode, hold_action, deadline = obj.get("mode", "hold"), obj.get("hold_action", "repeat"), obj.get("deadline_ms")
        if mode not in STEPPING_MODES:
            raise RemoteProtocolError(ErrorCode.BAD_HELLO, f"hello.stepping.mode must be one of {STEPPING_MODES}")
        if hold_action not in HOLD_ACTIONS:
            raise RemoteProtocolError(ErrorCode.BAD_HELLO, f"hello.stepping.hold_action must be one of {HOLD_ACTIONS}")
        if deadline is not None and (
            isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or not 0 <= deadline <= 3.6e6
        ):
            raise RemoteProtocolError(ErrorCode.BAD_HELLO, "hello.stepping.deadline_ms must be a number of ms >= 0")
        return cls(mode, None if deadline is None else float(deadline), hold_action)
