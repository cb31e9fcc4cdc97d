"""Observation and action spaces as announced by games, and checks of data against them.

Wire forms (keys of a group's ``observation_space`` / ``action_space`` maps keep their order):

* observation ``{"space": "box", "shape": [..], "dtype": "float32", "low": -1.0, "high": 1.0}``,
  ``{"space": "discrete", "n": 5}``, ``{"space": "multi_discrete", "nvec": [3, 4]}``;
* action ``{"action_type": "continuous", "size": 2}``, ``{"action_type": "discrete", "size": 3}``
  (godot_rl's own form) and ``{"action_type": "multi_discrete", "nvec": [3, 3]}``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from broker.protocol.arrays import DTYPES
from broker.protocol.errors import ErrorCode, RemoteProtocolError, summarize
from broker.protocol.native import NATIVE as _NATIVE  # its all_finite needs no configure()

MAX_KEYS: Final = 64
MAX_ELEMENTS: Final = 1 << 26
MAX_AGENTS: Final = 1 << 16
MAX_NAME: Final = 128


def _bad(message: str) -> RemoteProtocolError:
    return RemoteProtocolError(ErrorCode.BAD_SPACES, message)


def _positive_ints(value: Any, what: str, allow_empty: bool = False) -> tuple[int, ...]:
    if not isinstance(value, list) or (not value and not allow_empty) or len(value) > 8:
        raise _bad(f"{what} must be a list of 1 to 8 positive integers, got {summarize(value)}")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value):
        raise _bad(f"{what} must hold positive integers, got {summarize(value)}")
    return tuple(value)


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise _bad(f"{what} must be a number, got {summarize(value)}")
    return float(value)


@dataclass(frozen=True)
class BoxSpace:
    shape: tuple[int, ...]
    dtype: str = "float32"
    low: float = -math.inf
    high: float = math.inf

    def to_wire(self) -> dict[str, Any]:
        return {"space": "box", "shape": list(self.shape), "dtype": self.dtype, "low": self.low, "high": self.high}

    @property
    def row_shape(self) -> tuple[int, ...]:
        return self.shape

    @property
    def wire_dtype(self) -> str:
        return self.dtype


@dataclass(frozen=True)
class DiscreteSpace:
    n: int

    def to_wire(self) -> dict[str, Any]:
        return {"space": "discrete", "n": self.n}

    @property
    def row_shape(self) -> tuple[int, ...]:
        return ()

    @property
    def wire_dtype(self) -> str:
        return "int32"


@dataclass(frozen=True)
class MultiDiscreteSpace:
    nvec: tuple[int, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"space": "multi_discrete", "nvec": list(self.nvec)}

    @property
    def row_shape(self) -> tuple[int, ...]:
        return (len(self.nvec),)

    @property
    def wire_dtype(self) -> str:
        return "int32"


ObservationSpace = BoxSpace | DiscreteSpace | MultiDiscreteSpace


@dataclass(frozen=True)
class ContinuousAction:
    """``size`` floats in [-1, 1], as godot_rl's continuous action."""

    size: int

    def to_wire(self) -> dict[str, Any]:
        return {"action_type": "continuous", "size": self.size}

    @property
    def row_shape(self) -> tuple[int, ...]:
        return (self.size,)

    @property
    def wire_dtype(self) -> str:
        return "float32"


@dataclass(frozen=True)
class DiscreteAction:
    """One choice among ``n``; godot_rl calls ``n`` the ``size``."""

    n: int

    def to_wire(self) -> dict[str, Any]:
        return {"action_type": "discrete", "size": self.n}

    @property
    def row_shape(self) -> tuple[int, ...]:
        return ()

    @property
    def wire_dtype(self) -> str:
        return "int32"


@dataclass(frozen=True)
class MultiDiscreteAction:
    nvec: tuple[int, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"action_type": "multi_discrete", "nvec": list(self.nvec)}

    @property
    def row_shape(self) -> tuple[int, ...]:
        return (len(self.nvec),)

    @property
    def wire_dtype(self) -> str:
        return "int32"


ActionSpace = ContinuousAction | DiscreteAction | MultiDiscreteAction


def observation_space_from_wire(obj: Any, what: str) -> ObservationSpace:
    if not isinstance(obj, dict):
        raise _bad(f"{what}: expected a map, got {type(obj).__name__}")
    kind = obj.get("space")
    if kind == "box":
        shape = _positive_ints(obj.get("shape"), f"{what}.shape")
        dtype = obj.get("dtype", "float32")
        if dtype not in DTYPES or dtype == "bool":
            raise _bad(f"{what}.dtype {summarize(dtype)} is not a numeric wire dtype")
        default_high = 255.0 if dtype == "uint8" else math.inf
        default_low = 0.0 if dtype == "uint8" else -math.inf
        low = _number(obj.get("low", default_low), f"{what}.low")
        high = _number(obj.get("high", default_high), f"{what}.high")
        if low > high:
            raise _bad(f"{what}: low {low} is above high {high}")
        if math.prod(shape) > MAX_ELEMENTS:
            raise _bad(f"{what}: shape {list(shape)} is too large")
        return BoxSpace(shape, dtype, low, high)
    if kind == "discrete":
        n = obj.get("n")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise _bad(f"{what}.n must be a positive integer, got {summarize(n)}")
        return DiscreteSpace(n)
    if kind == "multi_discrete":
        return MultiDiscreteSpace(_positive_ints(obj.get("nvec"), f"{what}.nvec"))
    raise _bad(f"{what}: unknown observation space {summarize(kind)}; use box, discrete or multi_discrete")


def action_space_from_wire(obj: Any, what: str) -> ActionSpace:
    if not isinstance(obj, dict):
        raise _bad(f"{what}: expected a map, got {type(obj).__name__}")
    kind = obj.get("action_type")
    if kind in ("continuous", "discrete"):
        size = obj.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise _bad(f"{what}.size must be a positive integer, got {summarize(size)}")
        return ContinuousAction(size) if kind == "continuous" else DiscreteAction(size)
    if kind == "multi_discrete":
        return MultiDiscreteAction(_positive_ints(obj.get("nvec"), f"{what}.nvec"))
    raise _bad(f"{what}: unknown action_type {summarize(kind)}; use continuous, discrete or multi_discrete")


def _key_map(obj: Any, what: str) -> dict[str, Any]:
    if not isinstance(obj, dict) or not obj:
        raise _bad(f"{what} must be a non-empty map of key to space")
    if len(obj) > MAX_KEYS:
        raise _bad(f"{what} has {len(obj)} keys; at most {MAX_KEYS}")
    for key in obj:
        if not isinstance(key, str) or not key or len(key) > MAX_NAME:
            raise _bad(f"{what}: key {summarize(key)} must be a non-empty string")
    return obj


@dataclass(frozen=True)
class PolicySpaces:
    """The spaces that every agent of one policy shares, keys in announcement order."""

    observation: tuple[tuple[str, ObservationSpace], ...]
    action: tuple[tuple[str, ActionSpace], ...]
    # Each layout as the C check reads it (check_layout), made once: every step's observations and every act's
    # actions are checked against them.
    observation_check: CheckLayout = field(init=False, repr=False, compare=False)
    action_check: CheckLayout = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "observation_check", check_layout(self.observation))
        object.__setattr__(self, "action_check", check_layout(self.action))

    def observation_wire(self) -> dict[str, Any]:
        return {key: space.to_wire() for key, space in self.observation}

    def action_wire(self) -> dict[str, Any]:
        return {key: space.to_wire() for key, space in self.action}

    @classmethod
    def from_wire(cls, observation: Any, action: Any, what: str) -> PolicySpaces:
        obs = tuple(
            (k, observation_space_from_wire(v, f"{what}.observation_space.{k}"))
            for k, v in _key_map(observation, f"{what}.observation_space").items()
        )
        act = tuple(
            (k, action_space_from_wire(v, f"{what}.action_space.{k}"))
            for k, v in _key_map(action, f"{what}.action_space").items()
        )
        return cls(obs, act)

    def zero_actions(self, n_rows: int) -> dict[str, np.ndarray]:
        """All-zero actions for ``n_rows`` agents, in each key's wire dtype and shape: what a held agent does
        before its trainer ever answered, and with hold action "noop"."""
        return {key: np.zeros((n_rows, *space.row_shape), DTYPES[space.wire_dtype]) for key, space in self.action}

    def describe_difference(self, other: PolicySpaces) -> str:
        for label, mine, theirs in (
            ("observation", self.observation, other.observation),
            ("action", self.action, other.action),
        ):
            if mine != theirs:
                return f"{label} space {dict(theirs)} differs from the known {dict(mine)}"
        return "no difference"


@dataclass(frozen=True)
class GroupSpec:
    """One agent group of a game: a policy name, how many agents, and their spaces."""

    policy: str
    n_agents: int
    spaces: PolicySpaces

    def to_wire(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "n_agents": self.n_agents,
            "observation_space": self.spaces.observation_wire(),
            "action_space": self.spaces.action_wire(),
        }

    def zero_actions(self) -> dict[str, np.ndarray]:
        """All-zero actions for every agent of the group (see ``PolicySpaces.zero_actions``)."""
        return self.spaces.zero_actions(self.n_agents)

    @classmethod
    def from_wire(cls, obj: Any, what: str) -> GroupSpec:
        if not isinstance(obj, dict):
            raise _bad(f"{what}: expected a map")
        policy, n_agents = obj.get("policy"), obj.get("n_agents")
        if not isinstance(policy, str) or not policy or len(policy) > MAX_NAME:
            raise _bad(f"{what}.policy must be a non-empty string, got {summarize(policy)}")
        if not isinstance(n_agents, int) or isinstance(n_agents, bool) or not 1 <= n_agents <= MAX_AGENTS:
            raise _bad(f"{what}.n_agents must be an integer from 1 to {MAX_AGENTS}, got {summarize(n_agents)}")
        spaces = PolicySpaces.from_wire(obj.get("observation_space"), obj.get("action_space"), f"{what}[{policy}]")
        return cls(policy, n_agents, spaces)


def value_bound(space: ObservationSpace | ActionSpace) -> int | tuple[int, ...] | None:
    """What a discrete space's values must stay below: ``n`` for every value, ``nvec`` per column; None for a
    box or continuous space (finite floats are their one value rule)."""
    if isinstance(space, (DiscreteAction, DiscreteSpace)):
        return space.n
    if isinstance(space, (MultiDiscreteAction, MultiDiscreteSpace)):
        return space.nvec
    return None


# Per key: its wire dtype, row shape and value bound, as _native.c's rows_match reads a layout.
CheckLayout = tuple[tuple[str, np.dtype[Any], tuple[int, ...], int | tuple[int, ...] | None], ...]


def check_layout(
    layout: tuple[tuple[str, ObservationSpace], ...] | tuple[tuple[str, ActionSpace], ...],
) -> CheckLayout:
    return tuple((key, DTYPES[space.wire_dtype], space.row_shape, value_bound(space)) for key, space in layout)


def rows_as_announced(arrays: dict[str, np.ndarray], layout: CheckLayout, n_rows: int) -> bool:
    """Whether check_rows would accept ``arrays``, decided in one C call for the usual case (keys in the announced
    order, contiguous arrays). False: not decided here; check_rows decides, and words any refusal."""
    return _NATIVE is not None and _NATIVE.rows_match(arrays, layout, n_rows) is not None


def check_finite(array: np.ndarray, what: str, code: ErrorCode) -> None:
    """The broker's one rule for NaN and infinities: refused in observations, rewards and continuous
    actions on every path (native and godot_rl JSON), since a trainer that learns from them diverges."""
    if array.dtype.kind != "f" or not array.size:
        return
    finite = None if _NATIVE is None else _NATIVE.all_finite(array)  # a C loop, no temporary array
    # count_nonzero: a fraction of ``.all()``'s call overhead on the small arrays of most steps, as fast at 25,600
    # values (400 x 64), about 15 % slower from some 300,000 (float images): measured, docs/performance_history.md
    if finite is None:
        finite = np.count_nonzero(np.isfinite(array)) == array.size
    if not finite:
        raise RemoteProtocolError(code, f"{what}: values must be finite (no NaN or infinity)")


def check_rows(
    arrays: dict[str, np.ndarray],
    layout: tuple[tuple[str, ObservationSpace], ...] | tuple[tuple[str, ActionSpace], ...],
    n_rows: int,
    what: str,
    code: ErrorCode,
) -> None:
    """Every key present, with ``n_rows`` rows of the space's shape and wire dtype, discrete values in
    range and float values finite. Discrete values are checked on the array as it came, before any
    dtype complaint, so a wide integer is never judged by what a cast would make of it."""
    expected = [key for key, _ in layout]
    if list(arrays) != expected and sorted(arrays) != sorted(expected):
        shown = [summarize(k) for k in sorted(arrays)[:8]]
        raise RemoteProtocolError(code, f"{what}: keys {shown} differ from the announced {expected}")
    for key, space in layout:
        array = arrays[key]
        shape = (n_rows, *space.row_shape)
        bound = value_bound(space)
        if array.shape == shape and n_rows and array.dtype.kind in "iu" and bound is not None:
            if isinstance(bound, int) and (array.min() < 0 or array.max() >= bound):
                raise RemoteProtocolError(code, f"{what}.{key}: values must lie in [0, {bound})")
            if isinstance(bound, tuple) and ((array < 0).any() or (array >= np.asarray(bound)).any()):
                raise RemoteProtocolError(code, f"{what}.{key}: values must lie in [0, nvec) per column")
        if array.shape != shape or array.dtype != DTYPES[space.wire_dtype]:
            raise RemoteProtocolError(
                code,
                f"{what}.{key}: expected {space.wire_dtype} of shape {list(shape)}, "
                f"got {array.dtype.name} of shape {list(array.shape)}",
            )
        check_finite(array, f"{what}.{key}", code)
