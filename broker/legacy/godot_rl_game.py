"""An unmodified godot_rl plugin game, seen by the hub as an ordinary game. Sans-IO.

Theory of operation
-------------------
The broker plays godot_rl's Python side. Its greeting (handshake + ``env_info`` request) has already
gone out on accept; from there:

==================  ==============================  ===========================================
phase               the game sends                  we turn it into
==================  ==============================  ===========================================
AWAIT_ENV_INFO      ``env_info``                    ``Hello(role="game")``, one group per policy
READY               (we send ``reset``)
AWAIT_RESET         ``reset`` reply                 ``GameStep`` tick 0
AWAIT_ACTIONS       (hub's ``GameActions`` ->       ``action`` request, agents in Godot order
                    or our ``call`` request)
AWAIT_STEP          ``step`` reply                  ``GameStep`` tick t+1
AWAIT_CALL          ``call`` reply                  ``CallResult``
==================  ==============================  ===========================================

Anything else from the game is a protocol error (the edge logs it and closes that connection only).
We never send a ``type`` the plugin does not know: it would pause forever.

Agents are split into groups by ``agent_policy_names`` (all ``shared_policy`` when absent, as godot_rl
does), in order of first appearance; every agent of a group must announce the same spaces. godot_rl's
``done`` is a single flag: an agent is truncated when its info carries ``"TimeLimit.truncated"``
(plugin PR #65), terminated otherwise, and ``info["terminal_observation"]`` becomes its final observation.

A ``GameActions`` without some group means that policy's trainer is busy (hold-and-accumulate): the
plugin has no notion of holding, so we repeat those agents' last actions explicitly (zeros before the
first ones).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Final

import numpy as np

from broker.legacy.wire import (
    DEFAULT_POLICY,
    decode_flags,
    decode_numbers,
    decode_rows,
    encode_actions,
    encode_message,
    message_type,
    policy_spaces_from_godot,
)
from broker.protocol import PROTOCOL_VERSION
from broker.protocol.errors import ErrorCode, LocalProtocolError, RemoteProtocolError, summarize
from broker.protocol.messages import GameActions, GameStep, Hello, StepData, check_info
from broker.protocol.spaces import MAX_AGENTS, GroupSpec, PolicySpaces

INFO_TRUNCATED: Final = "TimeLimit.truncated"
INFO_TERMINAL_OBS: Final = "terminal_observation"


class Phase(Enum):
    AWAIT_ENV_INFO = "await_env_info"
    READY = "ready"  # env_info done; the edge sends the reset request next
    AWAIT_RESET = "await_reset"
    AWAIT_ACTIONS = "await_actions"  # the game waits for our next command
    AWAIT_STEP = "await_step"
    AWAIT_CALL = "await_call"
    CLOSED = "closed"


# What the game may send in each phase; anything else is its mistake.
_EXPECTED: Final[dict[Phase, str]] = {
    Phase.AWAIT_ENV_INFO: "env_info",
    Phase.AWAIT_RESET: "reset",
    Phase.AWAIT_STEP: "step",
    Phase.AWAIT_CALL: "call",
}


@dataclass(frozen=True)
class CallResult:
    """The game's answer to a ``call`` request: one value per agent in its AGENT group."""

    method: str
    returns: list[Any]


@dataclass(frozen=True)
class AgentGroup:
    """The agents of one policy inside the game: their indices in Godot's agent order."""

    spec: GroupSpec
    agents: tuple[int, ...]


class GodotRlGame:
    """Translate one plugin game's JSON messages into typed messages for the hub, and back."""

    def __init__(self, name: str = "godot_rl game") -> None:
        self.name = name
        self.phase = Phase.AWAIT_ENV_INFO
        self.n_agents = 0
        self.groups: tuple[AgentGroup, ...] = ()
        self.tick = 0
        self._last_actions: dict[str, dict[str, np.ndarray]] = {}
        self._call_method = ""

    # --- from the game ----------------------------------------------------------------------------

    def receive(self, body: dict[str, Any]) -> Hello | GameStep | CallResult:
        """One message from the game. Raises RemoteProtocolError when it is not what this phase expects."""
        kind = message_type(body)
        expected = _EXPECTED.get(self.phase)
        if kind != expected:
            raise RemoteProtocolError(
                ErrorCode.UNEXPECTED_MESSAGE,
                f"godot_rl game sent '{kind}' while the broker waits for "
                + (f"'{expected}'" if expected else "nothing (the game must wait for a command)"),
            )
        if self.phase is Phase.AWAIT_ENV_INFO:
            return self._env_info(body)
        if self.phase is Phase.AWAIT_CALL:
            self.phase = Phase.AWAIT_ACTIONS
            returns = body.get("returns")
            if not isinstance(returns, list):
                raise RemoteProtocolError(ErrorCode.MALFORMED, "godot_rl 'call' reply needs a 'returns' list")
            return CallResult(self._call_method, returns)
        step = self._step(body, first=self.phase is Phase.AWAIT_RESET)
        self.phase = Phase.AWAIT_ACTIONS
        return step

    def _env_info(self, body: dict[str, Any]) -> Hello:
        n = body.get("n_agents")
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_AGENTS:
            raise RemoteProtocolError(ErrorCode.BAD_HELLO, f"env_info.n_agents must be an integer, got {summarize(n)}")
        if n == 0:
            raise RemoteProtocolError(
                ErrorCode.BAD_HELLO,
                "the godot_rl game has no agent in training mode (set the Sync node or AIController control "
                "mode to Training)",
            )
        observations = _per_agent("observation_space", n, body.get("observation_space"))
        actions = _per_agent("action_space", n, body.get("action_space"))
        names = _per_agent("agent_policy_names", n, body.get("agent_policy_names", [DEFAULT_POLICY] * n))
        members: dict[str, list[int]] = {}
        spaces: dict[str, PolicySpaces] = {}
        for i, (obs_space, act_space, policy) in enumerate(zip(observations, actions, names, strict=True)):
            if not isinstance(policy, str) or not policy:
                raise RemoteProtocolError(ErrorCode.BAD_HELLO, f"env_info.agent_policy_names[{i}] must be a name")
            agent_spaces = policy_spaces_from_godot(obs_space, act_space, f"env_info agent {i} ({policy})")
            known = spaces.setdefault(policy, agent_spaces)
            if known != agent_spaces:
                raise RemoteProtocolError(
                    ErrorCode.BAD_SPACES,
                    f"env_info agent {i}, policy '{policy}': {known.describe_difference(agent_spaces)} "
                    f"(of agent {members[policy][0]}); agents of one policy must share spaces, so give this "
                    "AIController another policy_name",
                )
            members.setdefault(policy, []).append(i)
        groups = []
        for policy, agents in members.items():
            wire = {"policy": policy, "n_agents": len(agents), **_spaces_wire(spaces[policy])}
            groups.append(AgentGroup(GroupSpec.from_wire(wire, f"env_info policy '{policy}'"), tuple(agents)))
        self.groups = tuple(groups)
        self.n_agents = n
        # a held group executes zeros before its trainer ever answered, as RLlib's wrapper sends
        self._last_actions = {g.spec.policy: g.spec.zero_actions() for g in self.groups}
        self.phase = Phase.READY
        return Hello("game", PROTOCOL_VERSION, self.name, groups=tuple(g.spec for g in self.groups))

    def _step(self, body: dict[str, Any], first: bool) -> GameStep:
        what = f"godot_rl '{message_type(body)}' reply"
        code = ErrorCode.BAD_STEP
        obs_rows = body.get("obs")
        if not isinstance(obs_rows, list) or len(obs_rows) != self.n_agents:
            raise RemoteProtocolError(code, f"{what}: 'obs' must list {self.n_agents} agents' observations")
        if first:  # godot_rl discards the reset reply's info; so do we
            reward = np.zeros(self.n_agents)
            done = np.zeros(self.n_agents, bool)
            infos: list[Any] = [{}] * self.n_agents
        else:
            reward = decode_numbers(body.get("reward"), self.n_agents, f"{what}.reward", code)
            done = decode_flags(body.get("done"), self.n_agents, f"{what}.done", code)
            infos = body.get("info", [{}] * self.n_agents)  # older plugins send no info
            n = self.n_agents
            if not isinstance(infos, list) or len(infos) != n or not all(isinstance(x, dict) for x in infos):
                raise RemoteProtocolError(code, f"{what}: 'info' must list {self.n_agents} maps")
        groups = {g.spec.policy: self._group_step(g, obs_rows, reward, done, infos, what) for g in self.groups}
        if not first:
            self.tick += 1
        return GameStep(self.tick, groups)

    def _group_step(
        self,
        group: AgentGroup,
        obs_rows: list[Any],
        reward: np.ndarray,
        done: np.ndarray,
        infos: list[dict[str, Any]],
        what: str,
    ) -> StepData:
        spaces = group.spec.spaces
        agents = list(group.agents)
        obs = decode_rows(spaces, [obs_rows[i] for i in agents], f"{what}.obs[{group.spec.policy}]")
        group_done = done[agents]
        truncated = np.array([bool(infos[i].get(INFO_TRUNCATED, False)) for i in agents]) & group_done
        final_rows = [row for row, i in enumerate(agents) if group_done[row] and INFO_TERMINAL_OBS in infos[i]]
        final_index = final_obs = None
        if final_rows:
            final_index = np.asarray(final_rows, np.int32)
            final_obs = decode_rows(
                spaces,
                [infos[agents[row]][INFO_TERMINAL_OBS] for row in final_rows],
                f"{what}.info[{group.spec.policy}].{INFO_TERMINAL_OBS}",
            )
        extra: dict[int, dict[str, Any]] = {}
        for row, i in enumerate(agents):
            rest = {k: v for k, v in infos[i].items() if k not in (INFO_TRUNCATED, INFO_TERMINAL_OBS)}
            if rest:
                check_info(rest, f"{what}.info[{i}]")
                extra[row] = rest
        return StepData(
            obs,
            reward[agents].astype(np.float32),
            group_done & ~truncated,
            truncated,
            final_index,
            final_obs,
            extra,
        )

    # --- to the game ------------------------------------------------------------------------------

    def reset_request(self) -> bytes:
        self._require(Phase.READY, "reset")
        self.phase = Phase.AWAIT_RESET
        return encode_message({"type": "reset"})

    def actions_request(self, message: GameActions) -> bytes:
        """The hub's actions as the plugin's ``action`` request; held groups repeat their last actions."""
        self._require(Phase.AWAIT_ACTIONS, "action")
        if message.tick != self.tick:
            raise LocalProtocolError(ErrorCode.INTERNAL, f"actions for tick {message.tick}, game is at {self.tick}")
        unknown = set(message.groups) - set(self._last_actions)
        if unknown:
            raise LocalProtocolError(ErrorCode.INTERNAL, f"actions for groups {sorted(unknown)} the game lacks")
        per_agent: list[dict[str, Any]] = [{} for _ in range(self.n_agents)]
        for group in self.groups:
            policy = group.spec.policy
            actions = message.groups.get(policy)
            if actions is None:
                actions = self._last_actions[policy]  # held: the plugin needs them spelled out
            else:
                self._last_actions[policy] = actions
            for i, row in zip(group.agents, encode_actions(group.spec.spaces, actions), strict=True):
                per_agent[i] = row
        self.phase = Phase.AWAIT_STEP
        return encode_message({"type": "action", "action": per_agent})

    def call_request(self, method: str) -> bytes:
        """Ask the game to call ``method`` on all its agents; valid only while it waits for a command."""
        self._require(Phase.AWAIT_ACTIONS, "call")
        self._call_method = method
        self.phase = Phase.AWAIT_CALL
        return encode_message({"type": "call", "method": method})

    def close_request(self) -> bytes:
        """The goodbye: the plugin quits its game on ``close``."""
        self.phase = Phase.CLOSED
        return encode_message({"type": "close"})

    @property
    def can_call(self) -> bool:
        return self.phase is Phase.AWAIT_ACTIONS

    def _require(self, phase: Phase, request: str) -> None:
        if self.phase is not phase:
            raise LocalProtocolError(
                ErrorCode.INTERNAL, f"cannot send '{request}' to a godot_rl game in phase {self.phase.value}"
            )


def _per_agent(field: str, n: int, value: Any) -> list[Any]:
    if field != "agent_policy_names" and isinstance(value, dict):
        return [value] * n  # older plugins send one space map for all agents, not one entry per agent
    if not isinstance(value, list) or len(value) != n:
        raise RemoteProtocolError(ErrorCode.BAD_HELLO, f"env_info.{field} must list {n} entries, one per agent")
    return value


def _spaces_wire(spaces: PolicySpaces) -> dict[str, Any]:
    return {"observation_space": spaces.observation_wire(), "action_space": spaces.action_wire()}
