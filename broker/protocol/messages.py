"""Typed messages of protocol version 1: frozen, slotted, valid by construction and from the wire.

Every message is a msgpack map with a ``type`` string; ``docs/protocol.md`` lists them byte by byte. Each
message class declares one field table (``FIELDS``: wire key, check, decoder, encoder) that drives its
validation on construction, its wire map (``to_wire``, fields in wire order) and its decoding
(``from_wire``, in the same order, so the first bad field is the one reported). Arrays use the map form of
:mod:`broker.protocol.arrays`. Per-agent values always travel as one array per key for the whole group,
so nothing here loops over agents. A message that cannot exist raises the RemoteProtocolError its wire
form would get, with the same code.
"""

from __future__ import annotations

from collections.abc import Callable
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
MAX_TEXT = MAX_NAME * 8
MAX_ARRAY_KEYS = 64


def _malformed(message: str) -> RemoteProtocolError:
    return RemoteProtocolError(ErrorCode.MALFORMED, message)


# --- field checks: (value, message label, key) -> None, raising for a value the message cannot hold ------


def _is_int(value: Any) -> bool:
    return type(value) is int or (isinstance(value, int) and not isinstance(value, bool))


def counter(minimum: int = 0) -> Callable[[Any, str, str], None]:
    def check(value: Any, what: str, key: str) -> None:
        if not _is_int(value) or not minimum <= value <= INT_MAX:
            raise _malformed(f"{what}.{key} must be an integer >= {minimum}, got {summarize(value)}")

    return check


def _text(value: Any, what: str, key: str) -> None:
    if type(value) is not str or len(value) > MAX_TEXT:
        raise _malformed(f"{what}.{key} must be a string of at most {MAX_TEXT} characters, got {summarize(value)}")


def _array_map(value: Any, what: str, key: str) -> None:
    if type(value) is not dict or len(value) > MAX_ARRAY_KEYS:
        raise _malformed(f"{what}.{key} must be a map of key to array")
    for name, array in value.items():
        if type(name) is not str or not isinstance(array, np.ndarray):
            raise _malformed(f"{what}.{key}: entry {summarize(name)} must map a string to an array")


# --- wire decoders: (wire value or None when absent, label, key) -> the field's value -------------------


def _array(obj: Any, what: str, key: str) -> np.ndarray:
    """``decode_array`` naming the array ``what.key``; the name is only built for an error message."""
    try:
        return decode_array(obj, key)
    except RemoteProtocolError:
        return decode_array(obj, f"{what}.{key}")  # raises again, with the full name


def _arrays(obj: Any, what: str) -> dict[str, np.ndarray]:
    if not isinstance(obj, dict) or len(obj) > MAX_ARRAY_KEYS:
        raise _malformed(f"{what} must be a map of key to array")
    return {(k if type(k) is str else str(k)): _array(v, what, str(k)) for k, v in obj.items()}


def _encode_arrays(arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    return {k: encode_array(v) for k, v in arrays.items()}


def _decode_arrays(value: Any, what: str, key: str) -> dict[str, np.ndarray]:
    return _arrays(value, f"{what}.{key}")


@dataclass(frozen=True, slots=True)
class Field:
    """One row of a message's field table.

    ``check`` runs on construction; ``decode`` turns the wire value (None when the key is absent) into the
    field's value, raising the peer's error (default: ``check`` it and keep it); ``encode`` gives the wire
    value (default: the value itself). ``wire`` None merges the encoded map into the message's own map
    (and hands ``decode`` the whole message map). ``sent`` decides, per message, whether the key is written;
    ``absent`` stands in for a missing key (an explicit nil is still checked as nil).
    """

    name: str
    check: Callable[[Any, str, str], None]
    decode: Callable[[Any, str, str], Any] | None = None
    encode: Callable[[Any], Any] | None = None
    wire: str | None = ""
    sent: Callable[[Any], bool] | None = None
    absent: Any = None  # what ``decode`` gets when the key is missing

    @property
    def key(self) -> str:
        return self.name if self.wire == "" else (self.wire or self.name)


class WireMessage:
    """Generic construction check, ``to_wire`` and ``from_wire`` driven by the subclass's ``FIELDS``."""

    __slots__ = ()
    TYPE: ClassVar[str]
    FIELDS: ClassVar[tuple[Field, ...]] = ()
    LABEL: ClassVar[str] = ""  # names the message in error texts (default: TYPE)

    def __post_init__(self) -> None:
        what = self.LABEL or self.TYPE
        for f in self.FIELDS:
            f.check(getattr(self, f.name), what, f.key)
        self._check_whole()

    def _check_whole(self) -> None:
        """Rules across fields (none by default)."""

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"type": self.TYPE}
        for f in self.FIELDS:
            value = getattr(self, f.name)
            if f.sent is not None and not f.sent(self):
                continue
            if f.encode is not None:
                value = f.encode(value)
            if f.wire is None:
                wire.update(value)
            else:
                wire[f.wire or f.name] = value
        return wire

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> Any:
        what = cls.LABEL or cls.TYPE
        values = {}
        for f in cls.FIELDS:
            if f.wire is None:
                raw = obj
            else:
                raw = obj.get(f.wire or f.name, f.absent)
            if f.decode is None:
                f.check(raw, what, f.key)
                values[f.name] = raw
            else:
                values[f.name] = f.decode(raw, what, f.key)
        return cls._trusted(values)

    @classmethod
    def _trusted(cls, values: dict[str, Any]) -> Any:
        """Build from values already checked (by ``from_wire``), without checking them again."""
        message = object.__new__(cls)
        for name, value in values.items():
            object.__setattr__(message, name, value)
        message._check_whole()
        return message


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


@dataclass(frozen=True, slots=True)
class StepData:
    """Outcome of one step for a set of rows (a game's group, or a policy's whole VecEnv).

    ``obs`` holds the observation to act on next. For rows whose episode just ended (``terminated`` or
    ``truncated``) that is already the next episode's first observation, and ``final_obs`` (rows listed
    in ``final_index``) holds the observation the episode ended on. ``infos`` is sparse: row -> map.

    Construction checks the structure (arrays, row counts, final rows, info rows); the wire's dtype and
    finiteness rules, and the free-form content of infos, are checked when decoding a peer's data.
    """

    obs: dict[str, np.ndarray]
    reward: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    final_index: np.ndarray | None = None
    final_obs: dict[str, np.ndarray] | None = None
    infos: dict[int, dict[str, Any]] = field(default_factory=dict)
    frames: np.ndarray | None = None  # int32 [n]: game ticks each transition spanned (hold mode)

    def __post_init__(self) -> None:
        what = "step data"
        reward = self.reward
        if not isinstance(reward, np.ndarray) or reward.ndim != 1:
            raise _malformed(f"{what}.reward must be a 1-d array")
        n = reward.shape[0]
        for name in ("terminated", "truncated"):
            flags = getattr(self, name)
            if not isinstance(flags, np.ndarray) or flags.shape != (n,):
                raise _malformed(f"{what}.{name} must be a bool array of shape [{n}]")
        _array_map(self.obs, what, "obs")
        for key, array in self.obs.items():
            if array.ndim < 1 or array.shape[0] != n:
                raise _malformed(f"{what}.obs.{key} must have {n} rows like reward")
        if self.final_index is not None and self.final_obs is not None:
            index = self.final_index
            if not isinstance(index, np.ndarray) or index.ndim != 1:
                raise _malformed(f"{what}.final.index must be a 1-d int32 array")
            _array_map(self.final_obs, what, "final.obs")
            for key, array in self.final_obs.items():
                if array.ndim < 1 or array.shape[0] != len(index):
                    raise _malformed(f"{what}.final.obs.{key} must have one row per final index")
        if not isinstance(self.infos, dict):
            raise _malformed(f"{what}.infos must be a map of row to map")
        for row, info in self.infos.items():
            if not _is_int(row) or not 0 <= row < n or not isinstance(info, dict):
                raise _malformed(f"{what}.infos: entry {summarize(row)} must map a row in [0, {n}) to a map")
        if self.frames is not None and (not isinstance(self.frames, np.ndarray) or self.frames.shape != (n,)):
            raise _malformed(f"{what}.frames must be an int32 array of shape [{n}]")

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
        data = object.__new__(cls)  # every check above is stricter than __post_init__'s
        for name, value in (
            ("obs", obs),
            ("reward", reward),
            ("terminated", terminated),
            ("truncated", truncated),
            ("final_index", final_index),
            ("final_obs", final_obs),
            ("infos", infos),
            ("frames", frames),
        ):
            object.__setattr__(data, name, value)
        return data


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


# --- messages ---------------------------------------------------------------------------------------


def _decode_groups(value: Any, what: str, key: str) -> dict[str, StepData]:
    if not isinstance(value, dict) or not 1 <= len(value) <= MAX_GROUPS:
        raise _malformed("step.groups must be a map of policy name to step data")
    return {str(k): StepData.from_wire(v, f"step.groups.{k}") for k, v in value.items()}


def _step_groups(value: Any, what: str, key: str) -> None:
    if not isinstance(value, dict) or not 1 <= len(value) <= MAX_GROUPS:
        raise _malformed("step.groups must be a map of policy name to step data")
    for name, data in value.items():
        if type(name) is not str or not isinstance(data, StepData):
            raise _malformed(f"step.groups: entry {summarize(name)} must map a policy name to step data")


def _bad_hello(message: str) -> RemoteProtocolError:
    return RemoteProtocolError(ErrorCode.BAD_HELLO, message)


def _role(value: Any, what: str, key: str) -> None:
    if value not in ("game", "trainer", "observer"):
        raise _bad_hello(f"hello.role must be 'game', 'trainer' or 'observer', got {summarize(value)}")


def _protocol(value: Any, what: str, key: str) -> None:
    if not _is_int(value):
        raise RemoteProtocolError(
            ErrorCode.VERSION_MISMATCH,
            f"peer speaks protocol {summarize(value)}, this broker speaks {PROTOCOL_VERSION}",
        )


def _token(value: Any, what: str, key: str) -> None:
    if value is not None and not isinstance(value, str):
        raise _bad_hello("hello.token must be a string")


def _group_specs(value: Any, what: str, key: str) -> None:
    if not isinstance(value, tuple) or not all(isinstance(g, GroupSpec) for g in value):
        raise _bad_hello("hello.groups must be a tuple of GroupSpec")


def _policy_name(value: Any, what: str, key: str) -> None:
    if not isinstance(value, str) or len(value) > MAX_NAME:
        raise _bad_hello("hello.policy must be a non-empty string")


def _stepping(value: Any, what: str, key: str) -> None:
    if value is not None and not isinstance(value, StepOptions):
        raise _bad_hello("hello.stepping must be StepOptions")


@dataclass(frozen=True, slots=True)
class Hello(WireMessage):
    """First message of every native peer: a game, a trainer, or an observer asking for status."""

    TYPE: ClassVar[str] = "hello"
    FIELDS: ClassVar[tuple[Field, ...]] = (
        Field("protocol", _protocol),
        Field("role", _role),
        Field("name", _text),
        Field("token", _token, sent=lambda m: m.token is not None),
        Field("groups", _group_specs, encode=lambda gs: [g.to_wire() for g in gs], sent=lambda m: m.role == "game"),
        Field("policy", _policy_name, sent=lambda m: m.role == "trainer"),
        Field(
            "stepping",
            _stepping,
            encode=lambda s: s.to_wire(),
            sent=lambda m: m.role == "trainer" and m.stepping is not None,
        ),
    )
    role: Literal["game", "trainer", "observer"]
    protocol: int
    name: str = ""
    token: str | None = None
    groups: tuple[GroupSpec, ...] = ()  # games only
    policy: str = ""  # trainers only
    stepping: StepOptions | None = None  # trainers only; None: the broker's defaults

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> Hello:
        """Role-dependent: the fields a role does not use are ignored, as they always were."""
        protocol = obj.get("protocol")
        if protocol != PROTOCOL_VERSION or isinstance(protocol, bool):  # first: whatever else a hello holds
            raise RemoteProtocolError(
                ErrorCode.VERSION_MISMATCH,
                f"peer speaks protocol {summarize(protocol)}, this broker speaks {PROTOCOL_VERSION}",
            )
        role = obj.get("role")
        name = obj.get("name", "")
        _text(name, "hello", "name")
        token = obj.get("token")
        _token(token, "hello", "token")
        values: dict[str, Any] = {"role": role, "protocol": PROTOCOL_VERSION, "name": name, "token": token}
        if role == "game":
            groups = obj.get("groups")
            if not isinstance(groups, list) or not 1 <= len(groups) <= MAX_GROUPS:
                raise _bad_hello(f"hello.groups must list 1 to {MAX_GROUPS} groups")
            specs = tuple(GroupSpec.from_wire(g, f"hello.groups[{i}]") for i, g in enumerate(groups))
            names = [g.policy for g in specs]
            if len(set(names)) != len(names):
                twice = sorted({n for n in names if names.count(n) > 1})[:3]
                raise _bad_hello(f"hello.groups names a policy twice: {twice}")
            return cls._trusted({**values, "groups": specs, "policy": "", "stepping": None})
        if role == "trainer":
            policy = obj.get("policy")
            if not isinstance(policy, str) or not policy or len(policy) > MAX_NAME:
                raise _bad_hello("hello.policy must be a non-empty string")
            stepping = obj.get("stepping")
            options = None if stepping is None else StepOptions.from_wire(stepping)
            return cls._trusted({**values, "groups": (), "policy": policy, "stepping": options})
        _role(role, "hello", "role")
        return cls._trusted({**values, "groups": (), "policy": "", "stepping": None})


@dataclass(frozen=True, slots=True)
class GameStep(WireMessage):
    """A game's observations for all its groups at one decision tick; tick 0 is the first."""

    TYPE: ClassVar[str] = "step"
    FIELDS: ClassVar[tuple[Field, ...]] = (
        Field("tick", counter()),
        Field("groups", _step_groups, _decode_groups, lambda gs: {k: v.to_wire() for k, v in gs.items()}),
    )
    tick: int
    groups: dict[str, StepData]


@dataclass(frozen=True, slots=True)
class TrainerReset(WireMessage):
    """Ask for the observations to act on. Games are not reset: their agents reset themselves."""

    TYPE: ClassVar[str] = "reset"


@dataclass(frozen=True, slots=True)
class TrainerAct(WireMessage):
    """A trainer's actions for every slot of its policy, answering batch ``step``."""

    TYPE: ClassVar[str] = "act"
    FIELDS: ClassVar[tuple[Field, ...]] = (
        Field("step", counter()),
        Field("actions", _array_map, _decode_arrays, _encode_arrays),
    )
    step: int
    actions: dict[str, np.ndarray]


# --- broker -> peer -------------------------------------------------------------------------------


def _any_int(value: Any, what: str, key: str) -> None:
    if value is not None and not _is_int(value):
        raise _malformed(f"{what}.{key} must be an integer")


@dataclass(frozen=True, slots=True)
class Welcome(WireMessage):
    TYPE: ClassVar[str] = "welcome"
    FIELDS: ClassVar[tuple[Field, ...]] = (
        Field("protocol", counter()),
        Field("peer_id", counter()),
        Field("game_index", _any_int, sent=lambda m: m.game_index is not None),
    )
    protocol: int
    peer_id: int
    game_index: int | None = None


def _action_groups(value: Any, what: str, key: str) -> None:
    if not isinstance(value, dict):
        raise _malformed("actions.groups must be a map")
    for name, arrays in value.items():
        _array_map(arrays, what, str(name))


def _decode_action_groups(value: Any, what: str, key: str) -> dict[str, dict[str, np.ndarray]]:
    if not isinstance(value, dict):
        raise _malformed("actions.groups must be a map")
    return {str(k): _arrays(v, f"actions.{k}") for k, v in value.items()}


@dataclass(frozen=True, slots=True)
class GameActions(WireMessage):
    """The actions for one game, answering its step ``tick``.

    A group missing from ``groups`` is held: its agents keep executing their previous action
    (hold-and-accumulate stepping, while that policy's trainer is busy).
    """

    TYPE: ClassVar[str] = "actions"
    FIELDS: ClassVar[tuple[Field, ...]] = (
        Field("tick", counter()),
        Field(
            "groups", _action_groups, _decode_action_groups, lambda gs: {k: _encode_arrays(v) for k, v in gs.items()}
        ),
    )
    tick: int
    groups: dict[str, dict[str, np.ndarray]]


@dataclass(frozen=True, slots=True)
class GameLayout:
    """Where one game's agents of a policy sit in that policy's VecEnv."""

    game_index: int
    offset: int
    n_agents: int


def _layouts(value: Any, what: str, key: str) -> None:
    if not isinstance(value, tuple) or not all(isinstance(g, GameLayout) for g in value):
        raise _malformed("policy.games must list [game_index, offset, n_agents] triples")


def _decode_layouts(value: Any, what: str, key: str) -> tuple[GameLayout, ...]:
    if not isinstance(value, list) or not all(
        isinstance(g, list) and len(g) == 3 and all(isinstance(v, int) for v in g) for g in value
    ):
        raise _malformed("policy.games must list [game_index, offset, n_agents] triples")
    return tuple(GameLayout(*g) for g in value)


def _spaces(value: Any, what: str, key: str) -> None:
    if not isinstance(value, PolicySpaces):
        raise _malformed("policy.spaces must be PolicySpaces")


@dataclass(frozen=True, slots=True)
class PolicyInfo(WireMessage):
    """Sent to a trainer once every expected game has joined: the VecEnv's size and spaces."""

    TYPE: ClassVar[str] = "policy"
    FIELDS: ClassVar[tuple[Field, ...]] = (
        Field("policy", _text),
        Field("n_envs", counter(1)),
        Field(
            "spaces",
            _spaces,
            lambda obj, what, key: PolicySpaces.from_wire(obj.get("observation_space"), obj.get("action_space"), what),
            lambda s: {"observation_space": s.observation_wire(), "action_space": s.action_wire()},
            wire=None,
        ),
        Field("games", _layouts, _decode_layouts, lambda gs: [[g.game_index, g.offset, g.n_agents] for g in gs]),
    )
    policy: str
    n_envs: int
    spaces: PolicySpaces
    games: tuple[GameLayout, ...]


def _step_data(value: Any, what: str, key: str) -> None:
    if not isinstance(value, StepData):
        raise _malformed(f"{what}.data must be StepData")


@dataclass(frozen=True, slots=True)
class Batch(WireMessage):
    """One step of a policy's VecEnv: every slot, from every game."""

    TYPE: ClassVar[str] = "batch"
    FIELDS: ClassVar[tuple[Field, ...]] = (
        Field("step", counter()),
        Field("data", _step_data, lambda obj, what, key: StepData.from_wire(obj, what), StepData.to_wire, wire=None),
    )
    step: int
    data: StepData


@dataclass(frozen=True, slots=True)
class Waiting(WireMessage):
    """Why a trainer's step has not returned yet (sent when the reason changes)."""

    TYPE: ClassVar[str] = "waiting"
    FIELDS: ClassVar[tuple[Field, ...]] = (
        Field("policy", _text),
        Field("games_connected", counter()),
        Field("games_expected", counter()),
        Field("reason", _text, absent=""),
    )
    policy: str
    games_connected: int
    games_expected: int
    reason: str


def _status_map(value: Any, what: str, key: str) -> None:
    if not isinstance(value, dict):
        raise _malformed("status.status must be a map")


@dataclass(frozen=True, slots=True)
class Status(WireMessage):
    """The broker's live numbers, sent once to an observer."""

    TYPE: ClassVar[str] = "status"
    FIELDS: ClassVar[tuple[Field, ...]] = (Field("status", _status_map),)
    status: dict[str, Any]


# --- either direction -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Error(WireMessage):
    """The last message on a connection that failed: a stable code and a readable sentence."""

    TYPE: ClassVar[str] = "error"
    FIELDS: ClassVar[tuple[Field, ...]] = (Field("code", _text), Field("message", _text, absent=""))
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class Close(WireMessage):
    """An orderly goodbye (broker shutting down, or a peer leaving)."""

    TYPE: ClassVar[str] = "close"
    FIELDS: ClassVar[tuple[Field, ...]] = (Field("reason", _text, absent=""),)
    reason: str = ""


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
