"""Serve any PettingZoo ``ParallelEnv`` to the broker as one game: one group per policy, one slot per agent.

* **Groups.** ``policy_of`` maps an agent name to its policy (a mapping or a function); by default the
  name's prefix before the first ``_`` (``red_12`` -> ``red``). A group's agents are in
  ``possible_agents`` order, so each policy's VecEnv has a fixed size and a stable row per agent.
* **Spaces** are announced per group from the agents' own gymnasium spaces: Box / Discrete /
  MultiDiscrete / MultiBinary observations (or a flat Dict of them, one key each) and Box / Discrete /
  MultiDiscrete / MultiBinary actions. Box actions travel as our continuous actions in [-1, 1] and are
  rescaled here to the env's bounds (dimensions with an infinite bound pass through unscaled). All
  agents of a group must have equal spaces; different groups may differ.
* **Deaths.** An agent whose episode ends while others play on is reported ``terminated`` / ``truncated``
  once, with its last observation as the final one; afterwards its row is held inactive until the episode
  ends: zero observation, zero reward, its actions ignored, ``info["active"] = False``.
* **Resets.** When no agent is left, the env resets. Agents whose episode ended at that step get the
  next episode's first observation as their observation (their final one in ``final``); rows that were
  held inactive simply receive their new observation, with no second episode end.

Per step the only per-agent Python work is what the dict API forces: reading each group's values out of
the env's dicts (``np.asarray`` / ``np.fromiter`` once per group) and building the action dict.

Python API: ``serve_parallel_env(env_fn, address)``; command line:
``python -m clients.pettingzoo_game --env magent2.environments.battle_v4:parallel_env --games 2``.
"""

from __future__ import annotations

import argparse
import importlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any, Final

import numpy as np
import structlog

from broker.protocol import DEFAULT_ADDRESS
from broker.protocol.messages import StepData
from broker.protocol.spaces import (
    GroupSpec,
)
from clients.pettingzoo_groups import ACTION_KEY, AgentGroup, group_agents
from clients.transport import DEFAULT_TIMEOUT_RECONNECT

log = structlog.get_logger("gdrl.pettingzoo")

INACTIVE_INFO: Final = {"active": False}

PolicyOf = Mapping[str, str] | Callable[[str], str]
EnvFactory = Callable[[], Any]  # returns a pettingzoo.ParallelEnv


def default_policy_of(agent: str) -> str:
    """``red_12`` -> ``red``; a name without ``_`` is its own policy."""
    return agent.split("_", 1)[0]


def _policy_function(policy_of: PolicyOf | None) -> Callable[[str], str]:
    if policy_of is None:
        return default_policy_of
    if isinstance(policy_of, Mapping):
        mapping = policy_of

        def lookup(agent: str) -> str:
            if agent not in mapping:
                raise ValueError(f"agent '{agent}' has no entry in policy_of; map every possible agent to a policy")
            return mapping[agent]

        return lookup
    return policy_of


def _plain_info(info: Mapping[Any, Any]) -> dict[str, Any]:
    """The msgpack-safe part of an env's per-agent info: string keys, scalar values."""
    out: dict[str, Any] = {}
    for key, value in info.items():
        if isinstance(value, np.generic):
            value = value.item()
        if isinstance(key, str) and isinstance(value, (bool, int, float, str)):
            out[key] = value
    return out


class ParallelEnvGame:
    """A ParallelEnv as the broker's game: ``group_specs()``, ``first_step()``, then ``apply(actions)``.

    Sans-IO (no sockets): ``serve_parallel_env`` drives it through a GameClient; evaluation and
    benchmark code can drive it directly.
    """

    def __init__(self, env: Any, policy_of: PolicyOf | None = None, seed: int | None = None) -> None:
        self.env = env
        self.seed = seed
        self.groups = group_agents(env, _policy_function(policy_of))
        self.episodes = 0  # finished episodes
        self.ticks = 0

    def group_specs(self) -> list[GroupSpec]:
        return [group.spec for group in self.groups]

    def first_step(self) -> dict[str, StepData]:
        obs, infos = self.env.reset(seed=self.seed)
        out = {}
        for group in self.groups:
            arrays = group.start_episode(obs)
            n = len(group.agents)
            self._zero_inactive(group, arrays)
            out[group.policy] = StepData(
                arrays,
                np.zeros(n, np.float32),
                np.zeros(n, np.bool_),
                np.zeros(n, np.bool_),
                infos=self._row_infos(group, infos),
            )
        self._check_someone_plays()
        return out

    def apply(self, actions: Mapping[str, Mapping[str, np.ndarray]]) -> dict[str, StepData]:
        """One env step. A group missing from ``actions`` (held by the broker) repeats its previous actions."""
        env_actions: dict[str, Any] = {}
        for group in self.groups:
            given = actions.get(group.policy)
            if given is not None:
                group.last_actions = group.action.decode(np.asarray(given[ACTION_KEY]))
            env_actions.update(zip(group.agents, group.last_actions, strict=True))
        live = {agent: env_actions[agent] for agent in self.env.agents if agent in env_actions}
        obs, rewards, terminations, truncations, infos = self.env.step(live)
        self.ticks += 1
        outcomes = [_Outcome.read(group, obs, rewards, terminations, truncations) for group in self.groups]
        episode_over = not self.env.agents or not any(group.active.any() for group in self.groups)
        if episode_over:
            self.episodes += 1
            reset_obs, reset_infos = self.env.reset()
            infos = {**infos, **{a: {**infos.get(a, {}), **i} for a, i in reset_infos.items() if i}}
        out = {}
        for group, outcome in zip(self.groups, outcomes, strict=True):
            arrays = outcome.obs
            if episode_over:
                arrays = group.start_episode(reset_obs)
            self._zero_inactive(group, arrays)
            out[group.policy] = StepData(
                arrays,
                outcome.reward,
                outcome.terminated,
                outcome.truncated,
                outcome.final_index,
                outcome.final_obs,
                self._row_infos(group, infos),
            )
        if episode_over:
            self._check_someone_plays()
        return out

    @staticmethod
    def _zero_inactive(group: AgentGroup, arrays: dict[str, np.ndarray]) -> None:
        inactive = ~group.active
        if inactive.any():
            for array in arrays.values():
                array[inactive] = 0

    @staticmethod
    def _row_infos(group: AgentGroup, infos: Mapping[str, Mapping[Any, Any]]) -> dict[int, dict[str, Any]]:
        rows: dict[int, dict[str, Any]] = {}
        for row, agent in enumerate(group.agents):
            info = infos.get(agent)
            if info:
                plain = _plain_info(info)
                if plain:
                    rows[row] = plain
        for row in np.flatnonzero(~group.active).tolist():
            rows[row] = {**rows.get(row, {}), **INACTIVE_INFO}
        return rows

    def _check_someone_plays(self) -> None:
        if not any(group.active.any() for group in self.groups):
            raise RuntimeError("the env reset to an episode with no agents in it (env.reset() returned no obs)")


@dataclass
class _Outcome:
    """One group's part of an env step, before a possible reset replaces the observations."""

    obs: dict[str, np.ndarray]
    reward: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    final_index: np.ndarray
    final_obs: dict[str, np.ndarray]

    @classmethod
    def read(
        cls,
        group: AgentGroup,
        obs: Mapping[str, Any],
        rewards: Mapping[str, float],
        terminations: Mapping[str, bool],
        truncations: Mapping[str, bool],
    ) -> _Outcome:
        """Reads the step's dicts and updates ``group.active``: agents that ended drop out."""
        agents, n, was_active = group.agents, len(group.agents), group.active
        arrays, present = group.read_obs(obs)
        # map() over dict.get loops in C: no Python frame per agent
        reward = np.fromiter(map(rewards.get, agents, repeat(0.0, n)), np.float32, n)
        reward[~was_active] = 0.0
        terminated = np.fromiter(map(terminations.get, agents, repeat(False, n)), np.bool_, n) & was_active
        truncated = np.fromiter(map(truncations.get, agents, repeat(False, n)), np.bool_, n) & was_active
        truncated |= was_active & ~present & ~terminated  # an agent that vanished without a word ended too
        ended = terminated | truncated
        final_index = np.flatnonzero(ended).astype(np.int32)
        final_obs = {key: array[final_index] for key, array in arrays.items()}
        group.ended |= ended
        group.active = present & ~group.ended  # one that appears mid-episode joins in; the ended never return
        return cls(arrays, reward, terminated, truncated, final_index, final_obs)


# --- serving --------------------------------------------------------------------------------------


def serve_parallel_env(
    env_fn: EnvFactory,
    address: str = DEFAULT_ADDRESS,
    policy_of: PolicyOf | None = None,
    *,
    seed: int | None = 0,
    name: str | None = None,
    token: str | None = None,
    max_ticks: int | None = None,
    timeout_connect: float = 60.0,
    timeout_reconnect: float = DEFAULT_TIMEOUT_RECONNECT,
) -> int:
    """Play ``env_fn()`` as one game until the broker closes (or ``max_ticks``); returns the ticks played.

    ``timeout_reconnect``: seconds to wait for a lost broker to come back (0: never), as GameClient.
    """
    from clients.game import GameClient

    env = env_fn()
    game = ParallelEnvGame(env, policy_of, seed)
    client = GameClient(
        address,
        game.group_specs(),
        name=name,
        token=token,
        timeout_connect=timeout_connect,
        timeout_reconnect=timeout_reconnect,
    )
    log.info(
        "serving parallel env",
        game=client.game_index,
        groups={g.policy: len(g.agents) for g in game.groups},
        address=str(address),
    )
    try:
        ticks = client.play(game.first_step(), game.apply, max_ticks)
    finally:
        client.close()
        env.close()
    log.info("game stopped", ticks=ticks, episodes=game.episodes)
    return ticks


def load_factory(spec: str, kwargs: Mapping[str, Any] | None = None) -> EnvFactory:
    """``"package.module:function"`` (+ keyword arguments) -> a factory that builds the env."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--env must look like 'package.module:function', got {spec!r}")
    target = getattr(importlib.import_module(module_name), attr)
    if not callable(target):
        raise ValueError(f"{spec} is not callable")
    bound = dict(kwargs or {})
    return lambda: target(**bound)


def _serve_from_spec(
    spec: str, kwargs: dict[str, Any], address: str, policy_map: dict[str, str] | None, seed: int, name: str,
    token: str | None, max_ticks: int | None, timeout_reconnect: float,
) -> None:  # fmt: skip
    from broker.log import configure_logging

    configure_logging()
    factory = load_factory(spec, kwargs)
    serve_parallel_env(
        factory, address, policy_map, seed=seed, name=name, token=token, max_ticks=max_ticks,
        timeout_reconnect=timeout_reconnect,
    )  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m clients.pettingzoo_game", description="Serve a PettingZoo ParallelEnv to the broker."
    )
    parser.add_argument("--env", required=True, help="factory of the env, 'package.module:function'")
    parser.add_argument("--env-kwargs", default="{}", help="JSON object of keyword arguments for the factory")
    parser.add_argument("--address", default=DEFAULT_ADDRESS, help="broker address: host:port or unix:/path")
    parser.add_argument("--games", type=int, default=1, help="game instances to run, one process each")
    parser.add_argument(
        "--policy-map", default=None, help="JSON object agent -> policy (default: the name's prefix before '_')"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the first reset; game i uses seed + i")
    parser.add_argument("--max-ticks", type=int, default=None, help="stop after this many ticks")
    parser.add_argument("--name", default="pettingzoo", help="game name prefix (logs)")
    parser.add_argument("--token", default=None, help="shared token, if the broker asks for one")
    parser.add_argument(
        "--timeout-reconnect",
        type=float,
        default=DEFAULT_TIMEOUT_RECONNECT,
        help="seconds to wait for a lost broker to come back (0: never)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        kwargs = json.loads(args.env_kwargs)
        policy_map = json.loads(args.policy_map) if args.policy_map else None
    except json.JSONDecodeError as exc:
        parser.exit(2, f"--env-kwargs / --policy-map must be JSON: {exc}\n")
    if not isinstance(kwargs, dict) or (policy_map is not None and not isinstance(policy_map, dict)):
        parser.exit(2, "--env-kwargs and --policy-map must be JSON objects\n")
    if args.games < 1:
        parser.exit(2, "--games must be at least 1\n")
    jobs = [
        (
            args.env,
            kwargs,
            args.address,
            policy_map,
            args.seed + i,
            f"{args.name}-{i}",
            args.token,
            args.max_ticks,
            args.timeout_reconnect,
        )
        for i in range(args.games)
    ]
    if args.games == 1:
        _serve_from_spec(*jobs[0])
        return 0
    import multiprocessing

    procs = [multiprocessing.Process(target=_serve_from_spec, args=job, name=job[5]) for job in jobs]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    return max((proc.exitcode or 0) for proc in procs)


if __name__ == "__main__":
    raise SystemExit(main())
