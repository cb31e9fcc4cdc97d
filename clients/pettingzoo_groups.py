"""A PettingZoo ``ParallelEnv``'s agents as groups: one per policy, each with its observation and action codec.

The codecs turn the agents' gymnasium values into the group's wire arrays and back (the space mapping
itself is ``clients.spaces``, the one place for it); ``AgentGroup`` holds a group's rows and which of them
play. Used by ``clients.pettingzoo_game``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, Final

import numpy as np
from gymnasium import spaces as gym_spaces

from broker.protocol.spaces import ActionSpace, GroupSpec, ObservationSpace, PolicySpaces
from clients.spaces import action_to_wire, observation_to_wire

OBS_KEY: Final = "obs"  # the one observation key of a non-Dict observation space
ACTION_KEY: Final = "action"
INT32: Final = np.dtype(np.int32)
INT64: Final = np.dtype(np.int64)


# --- spaces ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _ObservationPart:
    """One observation key: how per-agent values become a wire array."""

    key: str
    sub_key: str | None  # the Dict space's key, or None for a plain space
    wire: ObservationSpace
    dtype: np.dtype[Any]  # on the wire
    read_dtype: np.dtype[Any]  # what the per-agent values are gathered into
    start: np.ndarray | None  # Discrete/MultiDiscrete ``start`` to subtract (wire values begin at 0)
    placeholder: Any  # a value of the right shape for rows that have no observation


def _nonzero(start: Any) -> np.ndarray | None:
    array = np.asarray(start, np.int64)
    return array if array.any() else None


def _observation_part(key: str, sub_key: str | None, space: Any, what: str) -> _ObservationPart:
    wire = observation_to_wire(space, what)
    if isinstance(space, gym_spaces.Box):
        dtype = np.dtype(wire.wire_dtype)
        return _ObservationPart(key, sub_key, wire, dtype, dtype, None, np.zeros(space.shape, space.dtype))
    if isinstance(space, gym_spaces.MultiBinary):
        return _ObservationPart(key, sub_key, wire, INT32, INT64, None, np.zeros(space.shape, np.int8))
    return _ObservationPart(key, sub_key, wire, INT32, INT64, _nonzero(space.start), space.start)


class ObservationCodec:
    """A gymnasium observation space <-> our keyed wire spaces, and per-agent values -> arrays."""

    def __init__(self, space: Any, what: str) -> None:
        if isinstance(space, gym_spaces.Dict):
            self.parts = tuple(_observation_part(str(k), k, s, f"{what}.{k}") for k, s in space.spaces.items())
            self.placeholder: Any = {part.sub_key: part.placeholder for part in self.parts}
        else:
            self.parts = (_observation_part(OBS_KEY, None, space, what),)
            self.placeholder = self.parts[0].placeholder
        self.layout = tuple((part.key, part.wire) for part in self.parts)

    def encode(self, rows: list[Any]) -> dict[str, np.ndarray]:
        """Per-agent observations (one per row, all present) -> one wire array per key."""
        out = {}
        for part in self.parts:
            values = rows if part.sub_key is None else [row[part.sub_key] for row in rows]
            # asarray with a dtype gathers equal-shaped rows about twice as fast as np.stack
            array = np.asarray(values, part.read_dtype) if values else np.zeros((0, *part.wire.row_shape), part.dtype)
            if part.start is not None:
                array = array - part.start
            out[part.key] = array.astype(part.dtype, copy=False)
        return out


class ActionCodec:
    """Our wire action for one group (key ``action``) -> per-agent actions in the env's own space."""

    def __init__(self, space: Any, what: str) -> None:
        self.space = space
        self.wire: ActionSpace = action_to_wire(space, what)
        self.decode: Callable[[np.ndarray], list[Any]]
        if isinstance(space, gym_spaces.Discrete):
            start = int(space.start)
            self.decode = lambda a: (a.astype(np.int64) + start).tolist()
        elif isinstance(space, gym_spaces.MultiDiscrete):
            start_vec = np.asarray(space.start, np.int64)
            self.decode = lambda a: list((a.astype(np.int64) + start_vec).astype(space.dtype))
        elif isinstance(space, gym_spaces.MultiBinary):
            self.decode = lambda a: list(a.astype(space.dtype))
        else:  # Box
            self.decode = self._box_decoder(space)

    @staticmethod
    def _box_decoder(space: gym_spaces.Box) -> Callable[[np.ndarray], list[Any]]:
        low = space.low.astype(np.float64).reshape(-1)
        high = space.high.astype(np.float64).reshape(-1)
        finite = np.isfinite(low) & np.isfinite(high)
        base = np.where(finite, low, 0.0)
        half_span = np.where(finite, (high - low) / 2.0, 0.0)
        integer = np.issubdtype(space.dtype, np.integer)

        def decode(actions: np.ndarray) -> list[Any]:
            a = actions.astype(np.float64).reshape(len(actions), -1)
            scaled = np.where(finite, base + (np.clip(a, -1.0, 1.0) + 1.0) * half_span, a)
            if integer:
                scaled = np.rint(scaled)
            return list(scaled.reshape(len(actions), *space.shape).astype(space.dtype))

        return decode


# --- the game -------------------------------------------------------------------------------------


@dataclass
class AgentGroup:
    policy: str
    agents: list[str]
    observation: ObservationCodec
    action: ActionCodec
    active: np.ndarray = field(init=False)  # bool [n]: the agent plays in the current episode
    ended: np.ndarray = field(init=False)  # bool [n]: its episode ended; held inactive until the env resets
    last_actions: list[Any] = field(init=False)  # env actions of the last tick, repeated while held

    def __post_init__(self) -> None:
        self.active = np.zeros(len(self.agents), np.bool_)
        self.ended = np.zeros(len(self.agents), np.bool_)
        zero = self.spec.zero_actions()[ACTION_KEY]
        self.last_actions = self.action.decode(zero)  # what a held group does before its first actions

    @property
    def spec(self) -> GroupSpec:
        layout = PolicySpaces(self.observation.layout, ((ACTION_KEY, self.action.wire),))
        return GroupSpec(self.policy, len(self.agents), layout)

    def start_episode(self, obs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """The first observations of an episode; the agents present in them play."""
        arrays, self.active = self.read_obs(obs)
        self.ended[:] = False
        return arrays

    def read_obs(self, obs: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """This group's rows of an env obs dict, and which agents were present in it."""
        n = len(self.agents)
        present = np.fromiter(map(obs.__contains__, self.agents), np.bool_, n)
        arrays = self.observation.encode(list(map(obs.get, self.agents, repeat(self.observation.placeholder, n))))
        return arrays, present


def group_agents(env: Any, policy_of: Callable[[str], str]) -> list[AgentGroup]:
    members: dict[str, list[str]] = {}
    for agent in env.possible_agents:
        policy = policy_of(agent)
        if not isinstance(policy, str) or not policy:
            raise ValueError(f"policy_of('{agent}') must be a non-empty string, got {policy!r}")
        members.setdefault(policy, []).append(agent)
    if not members:
        raise ValueError("the env has no possible_agents")
    groups = []
    for policy, agents in members.items():
        first = agents[0]
        obs_space, act_space = env.observation_space(first), env.action_space(first)
        for agent in agents[1:]:
            for kind, mine, theirs in (
                ("observation", obs_space, env.observation_space(agent)),
                ("action", act_space, env.action_space(agent)),
            ):
                if mine != theirs:
                    raise ValueError(
                        f"group '{policy}': agents '{first}' and '{agent}' have different {kind} spaces "
                        f"({mine} vs {theirs}); one policy needs one space, so map them to different policies "
                        "with policy_of"
                    )
        what = f"group '{policy}'"
        groups.append(AgentGroup(policy, agents, ObservationCodec(obs_space, what), ActionCodec(act_space, what)))
    return groups
