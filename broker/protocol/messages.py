"""Typed messages of protocol version 1. Each is valid by construction from the wire.

Every message is a msgpack map with a ``type`` string; ``docs/protocol.md`` lists them byte by byte.
Arrays use the map form of :mod:`broker.protocol.arrays`. Per-agent values always travel as one array
per key for the whole group, so nothing here loops over agents.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np

from broker.protocol import PROTOCOL_VERSION
from broker.protocol.arrays import decode_array, encode_array
from broker.protocol.errors import ErrorCode, RemoteProtocolError, summarize
from broker.protocol.limits import INT_MAX, INT_MIN, MAX_INFO_NESTING
from broker.protocol.spaces import MAX_AGENTS, MAX_NAME, GroupSpec, PolicySpaces, check_finite

MAX_GROUPS = 64
MAX_INFO_ENTRIES = MAX_AGENTS


def _malformed(message: str) -> RemoteProtocolError:
    return RemoteProtocolError(ErrorCode.MALFORMED, message)


def _int(obj: dict[str, Any], key: str, what: str, minimum: int = 0) -> int:
    value = obj.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not minimum <= value <= INT_MAX:
        raise _malformed(f"{what}.{key} must be an integer >= {minimum}, got {summarize(value)}")
    return value


def _str(obj: dict[str, Any], key: str, what: str, default: str | None = None) -> str:
    value = obj.get(key, default)
    if not isinstance(value, str) or len(value) > MAX_NAME * 8:
        raise _malformed(f"{what}.{key} must be a string of at most {MAX_NAME * 8} characters, got {summarize(value)}")
    return value


def check_info(info: Any, what: str, code: ErrorCode = ErrorCode.BAD_STEP) -> None:
    """An agent's info map must be something every codec the broker forwards it in can carry (msgpack to
    Python trainers, Godot Variant to the addon, JSON to godot_rl scripts): keys are strings or integers;
    values are None, bools, 64-bit integers, floats, strings, bytes, lists and such maps, nested at most
    MAX_INFO_NESTING deep. Strings need no check here: every decoder refuses text that is not UTF-8."""
    if not isinstance(info, dict):
        raise RemoteProtocolError(code, f"{what} must be a map, got {summarize(info)}")
    _check_free_value(info, what, code, 1)


def _check_free_value(value: Any, what: str, code: ErrorCode, level: int) -> None:
    if isinstance(value, dict):
        if level > MAX_INFO_NESTING:
            raise RemoteProtocolError(code, f"{what} nests deeper than {MAX_INFO_NESTING} levels")
        for key, item in value.items():
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                raise RemoteProtocolError(code, f"{what}: key {summarize(key)} is neither a string nor an integer")
            _check_free_value(key, what, code, level)
            _check_free_value(item, what, code, level + 1)
    elif isinstance(value, list):
        if level > MAX_INFO_NESTING:
            raise RemoteProtocolError(code, f"{what} nests deeper than {MAX_INFO_NESTING} levels")
        for item in value:
            _check_free_value(item, what, code, level + 1)
    elif isinstance(value, int) and not isinstance(value, bool):
        if not INT_MIN <= value <= INT_MAX:
            raise RemoteProtocolError(code, f"{what}: integer {summarize(value)} does not fit 64 signed bits")
    elif value is not None and not isinstance(value, (bool, float, str, bytes)):
        raise RemoteProtocolError(code, f"{what}: a {type(value).__name__} cannot be forwarded")


def _array(obj: Any, what: str, key: str) -> np.ndarray:
    """``decode_array`` naming the array ``what.key``; the name is only built for an error message."""
    try:
        return decode_array(obj, key)
    except RemoteProtocolError:
        return decode_array(obj, f"{what}.{key}")  # raises again, with the full name


def _arrays(obj: Any, what: str) -> dict[str, np.ndarray]:
    if not isinstance(obj, dict) or len(obj) > 64:
        raise _malformed(f"{what} must be a map of key to array")
    return {(k if type(k) is str else str(k)): _array(v, what, str(k)) for k, v in obj.items()}


def _encode_arrays(arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    return {k: encode_array(v) for k, v in arrays.items()}


@dataclass
class StepData:
    """Outcome of one step for a set of rows (a game's group, or a policy's whole VecEnv).

    ``obs`` holds the observation to act on next. For rows whose episode just ended (``terminated`` or
    ``truncated``) that is already the next episode's first observation, and ``final_obs`` (rows listed
    in ``final_index``) holds the observation the episode ended on. ``infos`` is sparse: row -> map.
    """

    obs: dict[str, np.ndarray]
    reward: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    final_index: np.ndarray | None = None
    final_obs: dict[str, np.ndarray] | None = None
    infos: dict[int, dict[str, Any]] = field(default_factory=dict)
    frames: np.ndarray | None = None  # int32 [n]: game ticks each transition spanned (hold mode)

    @property
    def n_rows(self) -> int:
        return int(self.reward.shape[0])

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {
            "obs": _encode_arrays(self.obs),
            "reward": encode_array(self.reward),
            "terminated": encode_array(self.terminated),
            "truncated": encode_array(self.truncated),
        }
        if self.final_index is not None and self.final_obs is not None and len(self.final_index):
            wire["final"] = {"index": encode_array(self.final_index), "obs": _encode_arrays(self.final_obs)}
        if self.infos:
            wire["infos"] = self.infos
        if self.frames is not None:
            wire["frames"] = encode_array(self.frames)
        return wire

    @classmethod
    def from_wire(cls, obj: Any, what: str) -> StepData:
        if not isinstance(obj, dict):
            raise _malformed(f"{what} must be a map")
        reward = _array(obj.get("reward"), what, "reward")
        terminated = _array(obj.get("terminated"), what, "terminated")
        truncated = _array(obj.get("truncated"), what, "truncated")
        if reward.ndim != 1 or reward.dtype != np.float32:
            raise _malformed(f"{what}.reward must be a 1-d float32 array")
        check_finite(reward, f"{what}.reward", ErrorCode.BAD_STEP)
        n = reward.shape[0]
        for name, flags in (("terminated", terminated), ("truncated", truncated)):
            if flags.shape != (n,) or flags.dtype != np.bool_:
                raise _malformed(f"{what}.{name} must be a bool array of shape [{n}]")
        obs = _arrays(obj.get("obs"), f"{what}.obs")
        for key, array in obs.items():
            if array.ndim < 1 or array.shape[0] != n:
                raise _malformed(f"{what}.obs.{key} must have {n} rows like reward")
        final_index = final_obs = None
        final = obj.get("final")
        if final is not None:
            if not isinstance(final, dict):
                raise _malformed(f"{what}.final must be a map")
            final_index = decode_array(final.get("index"), f"{what}.final.index")
            if final_index.ndim != 1 or final_index.dtype != np.int32:
                raise _malformed(f"{what}.final.index must be a 1-d int32 array")
            if len(final_index) and (final_index.min() < 0 or final_index.max() >= n):
                raise _malformed(f"{what}.final.index has rows outside [0, {n})")
            final_obs = _arrays(final.get("obs"), f"{what}.final.obs")
            for key, array in final_obs.items():
                if array.ndim < 1 or array.shape[0] != len(final_index):
                    raise _malformed(f"{what}.final.obs.{key} must have one row per final index")
        infos = obj.get("infos", {})
        if not isinstance(infos, dict) or len(infos) > MAX_INFO_ENTRIES:
            raise _malformed(f"{what}.infos must be a map of row to map")
        for row, info in infos.items():
            if not isinstance(row, int) or isinstance(row, bool) or not 0 <= row < n or not isinstance(info, dict):
                raise _malformed(f"{what}.infos: entry {summarize(row)} must map a row in [0, {n}) to a map")
            check_info(info, f"{what}.infos[{row}]")
        frames = None
        if "frames" in obj:
            frames = decode_array(obj["frames"], f"{what}.frames")
            if frames.shape != (n,) or frames.dtype != np.int32:
                raise _malformed(f"{what}.frames must be an int32 array of shape [{n}]")
        return cls(obs, reward, terminated, truncated, final_index, final_obs, infos, frames)


# --- peer -> broker -------------------------------------------------------------------------------

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

    def deadline_s(self, typical_response_s: float) -> float | None:
        """Seconds a game waits for this policy's actions; None: no limit. An explicit deadline is kept as
        given. The hold default adapts: a trainer that always needs, say, 30 ms to turn a large batch around
        is slow, not busy, and holding it would only add game ticks that carry no decision; so the default
        is the larger of 20 ms and a few typical answers (``HOLD_DEADLINE_DEFAULT_TEXT``)."""
        if self.deadline_ms is not None:
            return self.deadline_ms / 1000.0
        if self.mode != "hold":
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


@dataclass
class Hello:
    """First message of every native peer: a game, a trainer, or an observer asking for status."""

    TYPE: ClassVar[str] = "hello"
    role: Literal["game", "trainer", "observer"]
    protocol: int
    name: str = ""
    token: str | None = None
    groups: tuple[GroupSpec, ...] = ()  # games only
    policy: str = ""  # trainers only
    stepping: StepOptions | None = None  # trainers only; None: the broker's defaults

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"type": self.TYPE, "protocol": self.protocol, "role": self.role, "name": self.name}
        if self.token is not None:
            wire["token"] = self.token
        if self.role == "game":
            wire["groups"] = [g.to_wire() for g in self.groups]
        elif self.role == "trainer":
            wire["policy"] = self.policy
            if self.stepping is not None:
                wire["stepping"] = self.stepping.to_wire()
        return wire

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> Hello:
        protocol = obj.get("protocol")
        if protocol != PROTOCOL_VERSION or isinstance(protocol, bool):  # first: whatever else a hello holds
            raise RemoteProtocolError(
                ErrorCode.VERSION_MISMATCH,
                f"peer speaks protocol {summarize(protocol)}, this broker speaks {PROTOCOL_VERSION}",
            )
        role = obj.get("role")
        name = _str(obj, "name", "hello", default="")
        token = obj.get("token")
        if token is not None and not isinstance(token, str):
            raise RemoteProtocolError(ErrorCode.BAD_HELLO, "hello.token must be a string")
        if role == "game":
            groups = obj.get("groups")
            if not isinstance(groups, list) or not 1 <= len(groups) <= MAX_GROUPS:
                raise RemoteProtocolError(ErrorCode.BAD_HELLO, f"hello.groups must list 1 to {MAX_GROUPS} groups")
            specs = tuple(GroupSpec.from_wire(g, f"hello.groups[{i}]") for i, g in enumerate(groups))
            names = [g.policy for g in specs]
            if len(set(names)) != len(names):
                twice = sorted({n for n in names if names.count(n) > 1})[:3]
                raise RemoteProtocolError(ErrorCode.BAD_HELLO, f"hello.groups names a policy twice: {twice}")
            return cls("game", PROTOCOL_VERSION, name, token, groups=specs)
        if role == "trainer":
            policy = obj.get("policy")
            if not isinstance(policy, str) or not policy or len(policy) > MAX_NAME:
                raise RemoteProtocolError(ErrorCode.BAD_HELLO, "hello.policy must be a non-empty string")
            stepping = obj.get("stepping")
            options = None if stepping is None else StepOptions.from_wire(stepping)
            return cls("trainer", PROTOCOL_VERSION, name, token, policy=policy, stepping=options)
        if role == "observer":
            return cls("observer", PROTOCOL_VERSION, name, token)
        raise RemoteProtocolError(
            ErrorCode.BAD_HELLO, f"hello.role must be 'game', 'trainer' or 'observer', got {summarize(role)}"
        )


@dataclass
class GameStep:
    """A game's observations for all its groups at one decision tick; tick 0 is the first."""

    TYPE: ClassVar[str] = "step"
    tick: int
    groups: dict[str, StepData]

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, "tick": self.tick, "groups": {k: v.to_wire() for k, v in self.groups.items()}}

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> GameStep:
        tick = _int(obj, "tick", "step")
        groups = obj.get("groups")
        if not isinstance(groups, dict) or not 1 <= len(groups) <= MAX_GROUPS:
            raise _malformed("step.groups must be a map of policy name to step data")
        return cls(tick, {str(k): StepData.from_wire(v, f"step.groups.{k}") for k, v in groups.items()})


@dataclass
class TrainerReset:
    """Ask for the observations to act on. Games are not reset: their agents reset themselves."""

    TYPE: ClassVar[str] = "reset"

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE}

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> TrainerReset:
        return cls()


@dataclass
class TrainerAct:
    """A trainer's actions for every slot of its policy, answering batch ``step``."""

    TYPE: ClassVar[str] = "act"
    step: int
    actions: dict[str, np.ndarray]

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, "step": self.step, "actions": _encode_arrays(self.actions)}

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> TrainerAct:
        return cls(_int(obj, "step", "act"), _arrays(obj.get("actions"), "act.actions"))


# --- broker -> peer -------------------------------------------------------------------------------


@dataclass
class Welcome:
    TYPE: ClassVar[str] = "welcome"
    protocol: int
    peer_id: int
    game_index: int | None = None

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"type": self.TYPE, "protocol": self.protocol, "peer_id": self.peer_id}
        if self.game_index is not None:
            wire["game_index"] = self.game_index
        return wire

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> Welcome:
        game_index = obj.get("game_index")
        if game_index is not None and (not isinstance(game_index, int) or isinstance(game_index, bool)):
            raise _malformed("welcome.game_index must be an integer")
        return cls(_int(obj, "protocol", "welcome"), _int(obj, "peer_id", "welcome"), game_index)


@dataclass
class GameActions:
    """The actions for one game, answering its step ``tick``.

    A group missing from ``groups`` is held: its agents keep executing their previous action
    (hold-and-accumulate stepping, while that policy's trainer is busy).
    """

    TYPE: ClassVar[str] = "actions"
    tick: int
    groups: dict[str, dict[str, np.ndarray]]

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, "tick": self.tick, "groups": {k: _encode_arrays(v) for k, v in self.groups.items()}}

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> GameActions:
        groups = obj.get("groups")
        if not isinstance(groups, dict):
            raise _malformed("actions.groups must be a map")
        return cls(_int(obj, "tick", "actions"), {str(k): _arrays(v, f"actions.{k}") for k, v in groups.items()})


@dataclass(frozen=True)
class GameLayout:
    """Where one game's agents of a policy sit in that policy's VecEnv."""

    game_index: int
    offset: int
    n_agents: int


@dataclass
class PolicyInfo:
    """Sent to a trainer once every expected game has joined: the VecEnv's size and spaces."""

    TYPE: ClassVar[str] = "policy"
    policy: str
    n_envs: int
    spaces: PolicySpaces
    games: tuple[GameLayout, ...]

    def to_wire(self) -> dict[str, Any]:
        return {
            "type": self.TYPE,
            "policy": self.policy,
            "n_envs": self.n_envs,
            "observation_space": self.spaces.observation_wire(),
            "action_space": self.spaces.action_wire(),
            "games": [[g.game_index, g.offset, g.n_agents] for g in self.games],
        }

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> PolicyInfo:
        games = obj.get("games")
        if not isinstance(games, list) or not all(
            isinstance(g, list) and len(g) == 3 and all(isinstance(v, int) for v in g) for g in games
        ):
            raise _malformed("policy.games must list [game_index, offset, n_agents] triples")
        return cls(
            _str(obj, "policy", "policy"),
            _int(obj, "n_envs", "policy", minimum=1),
            PolicySpaces.from_wire(obj.get("observation_space"), obj.get("action_space"), "policy"),
            tuple(GameLayout(*g) for g in games),
        )


@dataclass
class Batch:
    """One step of a policy's VecEnv: every slot, from every game."""

    TYPE: ClassVar[str] = "batch"
    step: int
    data: StepData

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, "step": self.step, **self.data.to_wire()}

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> Batch:
        return cls(_int(obj, "step", "batch"), StepData.from_wire(obj, "batch"))


@dataclass
class Waiting:
    """Why a trainer's step has not returned yet (sent when the reason changes)."""

    TYPE: ClassVar[str] = "waiting"
    policy: str
    games_connected: int
    games_expected: int
    reason: str

    def to_wire(self) -> dict[str, Any]:
        return {
            "type": self.TYPE,
            "policy": self.policy,
            "games_connected": self.games_connected,
            "games_expected": self.games_expected,
            "reason": self.reason,
        }

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> Waiting:
        return cls(
            _str(obj, "policy", "waiting"),
            _int(obj, "games_connected", "waiting"),
            _int(obj, "games_expected", "waiting"),
            _str(obj, "reason", "waiting", default=""),
        )


@dataclass
class Status:
    """The broker's live numbers, sent once to an observer."""

    TYPE: ClassVar[str] = "status"
    status: dict[str, Any]

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, "status": self.status}

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> Status:
        status = obj.get("status")
        if not isinstance(status, dict):
            raise _malformed("status.status must be a map")
        return cls(status)


# --- either direction -----------------------------------------------------------------------------


@dataclass
class Error:
    """The last message on a connection that failed: a stable code and a readable sentence."""

    TYPE: ClassVar[str] = "error"
    code: str
    message: str

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, "code": self.code, "message": self.message}

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> Error:
        return cls(_str(obj, "code", "error"), _str(obj, "message", "error", default=""))


@dataclass
class Close:
    """An orderly goodbye (broker shutting down, or a peer leaving)."""

    TYPE: ClassVar[str] = "close"
    reason: str = ""

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, "reason": self.reason}

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> Close:
        return cls(_str(obj, "reason", "close", default=""))


Message = (
    Hello
    | GameStep
    | TrainerReset
    | TrainerAct
    | Welcome
    | GameActions
    | PolicyInfo
    | Batch
    | Waiting
    | Status
    | Error
    | Close
)

MESSAGE_TYPES: dict[str, Any] = {
    cls.TYPE: cls
    for cls in (
        Hello,
        GameStep,
        TrainerReset,
        TrainerAct,
        Welcome,
        GameActions,
        PolicyInfo,
        Batch,
        Waiting,
        Status,
        Error,
        Close,
    )
}


def message_from_wire(obj: dict[str, Any]) -> Message:
    kind = obj.get("type")
    cls = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise RemoteProtocolError(ErrorCode.UNKNOWN_MESSAGE, f"unknown message type {summarize(kind)}")
    message: Message = cls.from_wire(obj)
    return message
