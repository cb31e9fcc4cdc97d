"""The one table between gymnasium spaces and announced (wire) spaces, both ways, and SB3 action arrays
<-> per-key wire actions.

gymnasium -> wire (``observation_to_wire`` / ``action_to_wire``: a PettingZoo env's spaces, a model's):

==========================  ==========================================  ================================
gymnasium                   wire observation                            wire action
==========================  ==========================================  ================================
``Box``                     ``BoxSpace`` (bool -> uint8, float16 ->     ``ContinuousAction(prod(shape))``
                            float32; low/high: the bounds' min/max)     in [-1, 1]
``Discrete(n)``             ``DiscreteSpace(n)``                        ``DiscreteAction(n)``
``MultiDiscrete(nvec)``     ``MultiDiscreteSpace(nvec)`` (1-d)          ``MultiDiscreteAction(nvec)``
``MultiBinary(k)``          ``MultiDiscreteSpace((2,) * k)`` (1-d)      ``MultiDiscreteAction((2,) * k)``
==========================  ==========================================  ================================

wire -> gymnasium (``observation_space`` / ``action_space`` per key; what a BrokerVecEnv shows SB3) is the
inverse: ``BoxSpace`` -> ``Box`` of its dtype, ``DiscreteSpace`` -> ``Discrete``, ``MultiDiscreteSpace`` ->
``MultiDiscrete``; ``ContinuousAction(size)`` -> ``Box(-1, 1, (size,))``, ``DiscreteAction(n)`` ->
``Discrete(n)``, ``MultiDiscreteAction`` -> ``MultiDiscrete``.

Several action keys become one SB3 action space (``ActionCodec``) following godot_rl's conversion, so that
models and habits carry over:

* one discrete key -> ``Discrete(n)``;
* only discrete / multi-discrete keys -> ``MultiDiscrete`` of all choices, columns in key order;
* any continuous key -> one ``Box(-1, 1)``: continuous sizes in key order, and one column per
  discrete key (binary only; ``> 0`` means 1), as godot_rl does.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
from gymnasium import spaces

from broker.protocol.arrays import DTYPES
from broker.protocol.native import NATIVE
from broker.protocol.spaces import (
    ActionSpace,
    BoxSpace,
    ContinuousAction,
    DiscreteAction,
    DiscreteSpace,
    MultiDiscreteAction,
    MultiDiscreteSpace,
    ObservationSpace,
    PolicySpaces,
)

# --- gymnasium -> wire ----------------------------------------------------------------------------


def wire_box_dtype(dtype: np.dtype[Any], what: str) -> str:
    """The wire dtype a gymnasium Box of ``dtype`` travels in."""
    if dtype == np.bool_:
        return "uint8"
    if dtype == np.float16:
        return "float32"
    if dtype.name not in DTYPES:
        raise ValueError(f"{what}: Box dtype {dtype} has no wire form; use a numeric dtype")
    return dtype.name


def _one_dim_nvec(nvec: np.ndarray, what: str) -> tuple[int, ...]:
    if nvec.ndim != 1:
        raise ValueError(f"{what}: only 1-d MultiDiscrete spaces are supported, got nvec of shape {nvec.shape}")
    return tuple(int(n) for n in nvec)


def _binary_width(space: spaces.MultiBinary, what: str) -> int:
    if len(space.shape) != 1:
        raise ValueError(f"{what}: only 1-d MultiBinary spaces are supported, got shape {space.shape}")
    return int(space.shape[0])


def observation_to_wire(space: spaces.Space[Any], what: str) -> ObservationSpace:
    """One gymnasium observation space as its wire space (raises ValueError for others)."""
    if isinstance(space, spaces.Box):
        low = float(np.min(space.low)) if space.low.size else 0.0
        high = float(np.max(space.high)) if space.high.size else 0.0
        return BoxSpace(tuple(space.shape), wire_box_dtype(np.dtype(space.dtype), what), low, high)
    if isinstance(space, spaces.Discrete):
        return DiscreteSpace(int(space.n))
    if isinstance(space, spaces.MultiDiscrete):
        return MultiDiscreteSpace(_one_dim_nvec(space.nvec, what))
    if isinstance(space, spaces.MultiBinary):
        return MultiDiscreteSpace((2,) * _binary_width(space, what))
    raise ValueError(
        f"{what}: observation space {space} is not supported; use Box, Discrete, MultiDiscrete, MultiBinary "
        "or a flat Dict of those"
    )


def action_to_wire(space: spaces.Space[Any], what: str) -> ActionSpace:
    """One gymnasium action space as one wire action key (raises ValueError for others)."""
    if isinstance(space, spaces.Discrete):
        return DiscreteAction(int(space.n))
    if isinstance(space, spaces.MultiDiscrete):
        return MultiDiscreteAction(_one_dim_nvec(space.nvec, what))
    if isinstance(space, spaces.MultiBinary) and len(space.shape) == 1:
        return MultiDiscreteAction((2,) * int(space.shape[0]))
    if isinstance(space, spaces.Box):
        return ContinuousAction(int(math.prod(space.shape)))
    raise ValueError(f"{what}: action space {space} is not supported; use Box, Discrete, MultiDiscrete")


# --- wire -> gymnasium ----------------------------------------------------------------------------


def observation_space(space: ObservationSpace) -> spaces.Space[Any]:
    if isinstance(space, BoxSpace):
        return spaces.Box(space.low, space.high, space.shape, np.dtype(space.dtype))  # type: ignore[arg-type,unused-ignore]
    if isinstance(space, DiscreteSpace):
        return spaces.Discrete(space.n)
    return spaces.MultiDiscrete(np.array(space.nvec, dtype=np.int64))


def action_space(space: ActionSpace) -> spaces.Space[Any]:
    """One wire action key as SB3 sees it when it is the policy's only key."""
    if isinstance(space, ContinuousAction):
        return spaces.Box(-1.0, 1.0, (space.size,), np.float32)
    if isinstance(space, DiscreteAction):
        return spaces.Discrete(space.n)
    return spaces.MultiDiscrete(np.array(space.nvec, dtype=np.int64))


def observation_dict(policy: PolicySpaces) -> spaces.Dict:
    # A list keeps the game's key order (a plain dict would be sorted by gymnasium).
    return spaces.Dict([(key, observation_space(space)) for key, space in policy.observation])


class ObsConverter:
    """Wire observations -> writable C-contiguous arrays of the gymnasium spaces' dtypes, for one policy.

    Read-only views of a received frame are copied (one copy per key); an array that already is writable,
    contiguous and of the right dtype (the in-process broker's freshly concatenated batches) is handed over
    as it is: copying it again would only cost time. The keys and dtypes are worked out once (it runs every
    step), and the common case is one call into the C codec.
    """

    def __init__(self, policy: PolicySpaces) -> None:
        self.plan = tuple(
            (key, np.dtype(space.dtype) if isinstance(space, BoxSpace) else np.dtype(np.int64))
            for key, space in policy.observation
        )

    def __call__(self, obs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if NATIVE is not None:
            owned = NATIVE.owned_arrays(obs, self.plan)
            if owned is not None:
                return owned
        out = {}
        for key, dtype in self.plan:
            array = obs[key]
            flags = array.flags
            if array.dtype == dtype and flags.writeable and flags.c_contiguous:
                out[key] = array
            else:
                out[key] = np.array(array, dtype=dtype, copy=True)
        return out


class ActionCodec:
    def __init__(self, policy: PolicySpaces) -> None:
        self.policy = policy
        self.keys = [key for key, _ in policy.action]
        kinds = [space for _, space in policy.action]
        self.continuous = any(isinstance(s, ContinuousAction) for s in kinds)
        if self.continuous:
            for key, s in policy.action:
                if isinstance(s, DiscreteAction) and s.n > 2:
                    raise NotImplementedError(
                        f"action '{key}' is discrete with {s.n} choices next to continuous actions; "
                        "like godot_rl, mixed spaces support only binary discrete actions"
                    )
                if isinstance(s, MultiDiscreteAction):
                    raise NotImplementedError(f"action '{key}': multi-discrete next to continuous is not supported")
            widths = [s.size if isinstance(s, ContinuousAction) else 1 for s in kinds]
            self.space: spaces.Space[Any] = spaces.Box(-1.0, 1.0, (sum(widths),), np.float32)
        elif len(kinds) == 1 and isinstance(kinds[0], DiscreteAction):
            widths = [1]
            self.space = action_space(kinds[0])
        else:
            nvec: list[int] = []
            widths = []
            for s in kinds:
                part = [s.n] if isinstance(s, DiscreteAction) else list(s.nvec)  # type: ignore[union-attr]
                nvec += part
                widths.append(len(part))
            self.space = spaces.MultiDiscrete(np.array(nvec, dtype=np.int64))
        # What to_wire does per key, worked out once (it runs every step): key, kind, first and last column.
        starts = [0, *itertools.accumulate(widths)]
        self._plan: list[tuple[str, str, int, int]] = []
        for (key, space), start, stop in zip(policy.action, starts[:-1], starts[1:], strict=True):
            if isinstance(space, ContinuousAction):
                kind = "box"
            elif isinstance(space, DiscreteAction):
                kind = "binary" if self.continuous and space.n > 1 else "never" if self.continuous else "discrete"
            else:
                kind = "multi"
            self._plan.append((key, kind, start, stop))
        self._discrete = isinstance(self.space, spaces.Discrete)
        self._one_key = len(self._plan) == 1  # a lone Box key spans every column: no slice needed
        self._lone_box = self._one_key and self._plan[0][1] == "box"  # the usual case: one call into C

    def to_wire(self, actions: np.ndarray) -> dict[str, np.ndarray]:
        """SB3 actions for all envs -> one array per action key, in wire dtypes."""
        if self._lone_box and NATIVE is not None:
            clipped = NATIVE.clip_unit(actions)
            if clipped is not None:
                return {self.keys[0]: clipped}
        actions = np.asarray(actions)
        n = actions.shape[0]
        if self._discrete:
            return {self.keys[0]: actions.reshape(n).astype(np.int32)}
        columns = actions.reshape(n, -1)
        out = {}
        for key, kind, start, stop in self._plan:
            if kind == "box":
                block = columns if self._one_key else columns[:, start:stop]
                # maximum/minimum: np.clip's result, for half its cost on the small arrays of a step
                out[key] = np.minimum(np.maximum(block, -1.0), 1.0).astype(np.float32, copy=False)
            elif kind == "binary":  # one Box column per binary key: > 0 means choice 1 (godot_rl's rule)
                out[key] = (columns[:, start] > 0).astype(np.int32)
            elif kind == "never":  # a one-choice key beside continuous ones: always choice 0
                out[key] = np.zeros(n, np.int32)
            elif kind == "discrete":
                out[key] = columns[:, start].astype(np.int32)
            else:
                out[key] = columns[:, start:stop].astype(np.int32)
        return out
