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
    ReplyPlan,
    decode_flags,
    decode_numbers,
    decode_rows,
    encode_actions,
    encode_message,
    message_type,
    policy_spaces_from_godot,
    read_reply,
    reply_plan,
    write_actions,
)
from broker.protocol import PROTOCOL_VERSION
from broker.protocol.errors import ErrorCode, LocalProtocolError, RemoteProtocolError, summarize
from broker.protocol.json_body import unpack_json
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
        self._plan: ReplyPlan | None = None  # for _wire.c, once the groups are known
        self._seats: dict[int, tuple[int, int]] = {}  # agent -> (group index, row in the group)
        self._rows_of: tuple[np.ndarray | None, ...] = ()  # per group its agents, None when all in order
        self._obs_keys: tuple[tuple[str, ...], ...] = ()  # per group its observation keys, in order

    # --- from the game ----------------------------------------------------------------------------

    @property
    def replies_read_in_c(self) -> bool:
        """Whether this game's ``reset``/``step`` replies go to the C reader first (all but discrete
        observations and escaped key names, in a build with C)."""
        return self._plan is not None and self._plan.read is not None

    @property
    def awaits_reply_read_in_c(self) -> bool:
        """Whether the next frame is a ``reset``/``step`` reply for the C reader."""
        return self.replies_read_in_c and self.phase in (Phase.AWAIT_STEP, Phase.AWAIT_RESET)

    def receive_reply(self, body: bytes | memoryview) -> GameStep | None:
        """A ``reset``/``step`` reply read by the C reader (``_wire.c``) straight into arrays; None when this is
        not one it reads, and then ``receive`` takes the decoded body. Both give the same step."""
        if self._plan is None or not self.awaits_reply_read_in_c:
            return None
        first = self.phase is Phase.AWAIT_RESET
        reply = read_reply(self._plan, body, first)
        if reply is None:
            return None
        what = f"godot_rl '{'reset' if first else 'step'}' reply"
        per_group = zip(self._obs_keys, reply.observations, strict=True)
        observations = [dict(zip(keys, arrays, strict=True)) for keys, arrays in per_group]
        infos = {agent: unpack_json(body[start:end]) for agent, start, end in reply.info_spans}
        if reply.reward is None or reply.done is None:
            step = self._game_step(True, observations, np.zeros(self.n_agents), np.zeros(self.n_agents, bool), {}, what)
        else:
            step = self._game_step(False, observations, reply.reward, reply.done, infos, what)
        self.phase = Phase.AWAIT_ACTIONS
        return step

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
        self._plan = reply_plan([(g.spec.spaces, g.agents) for g in self.groups], n)
        self._seats = {agent: (index, row) for index, g in enumerate(self.groups) for row, agent in enumerate(g.agents)}
        self._rows_of = tuple(
            None if g.agents == tuple(range(n)) else np.asarray(g.agents, np.intp) for g in self.groups
        )
        self._obs_keys = tuple(tuple(key for key, _ in g.spec.spaces.observation) for g in self.groups)
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
            infos: dict[int, dict[str, Any]] = {}
        else:
            reward = decode_numbers(body.get("reward"), self.n_agents, f"{what}.reward", code)
            done = decode_flags(body.get("done"), self.n_agents, f"{what}.done", code)
            listed = body.get("info", [{}] * self.n_agents)  # older plugins send no info
            n = self.n_agents
            if not isinstance(listed, list) or len(listed) != n or not all(isinstance(x, dict) for x in listed):
                raise RemoteProtocolError(code, f"{what}: 'info' must list {self.n_agents} maps")
            infos = {i: info for i, info in enumerate(listed) if info}
        observations = [
            decode_rows(g.spec.spaces, [obs_rows[i] for i in g.agents], f"{what}.obs[{g.spec.policy}]")
            for g in self.groups
        ]
        return self._game_step(first, observations, reward, done, infos, what)

    def _game_step(
        self,
        first: bool,
        observations: list[dict[str, np.ndarray]],
        reward: np.ndarray,
        done: np.ndarray,
        infos: dict[int, dict[str, Any]],
        what: str,
    ) -> GameStep:
        """The step from decoded parts: per group its observations; per agent reward and done; the non-empty
        infos by agent."""
        per_group: list[list[tuple[int, int, dict[str, Any]]]] = [[] for _ in self.groups]
        for agent, info in infos.items():
            index, row = self._seats[agent]
            per_group[index].append((agent, row, info))
        groups = {
            g.spec.policy: self._group_step(g, rows, obs, reward, done, group_infos, what)
            for g, rows, obs, group_infos in zip(self.groups, self._rows_of, observations, per_group, strict=True)
        }
        if not first:
            self.tick += 1
        step: GameStep = GameStep.unchecked(self.tick, groups)  # parts built and checked above
        return step

    def _group_step(
        self,
        group: AgentGroup,
        agents: np.ndarray | None,
        obs: dict[str, np.ndarray],
        reward: np.ndarray,
        done: np.ndarray,
        infos: list[tuple[int, int, dict[str, Any]]],
        what: str,
    ) -> StepData:
        """One group's StepData; ``agents`` indexes the game's per-agent arrays (None: all, in order); ``infos``
        are the group's non-empty ones as (agent, row, info) in row order."""
        group_done = done if agents is None else done[agents]
        group_reward = (reward if agents is None else reward[agents]).astype(np.float32, copy=False)
        truncated = np.zeros(len(group.agents), bool)
        if not infos:  # most steps: nothing truncated, no final observation, no extra info
            return StepData.unchecked(obs, group_reward, group_done, truncated)
        finals: list[tuple[int, Any]] = []  # (row, its final observation)
        extra: dict[int, dict[str, Any]] = {}
        for agent, row, info in infos:
            truncated[row] = bool(info.get(INFO_TRUNCATED, False)) and bool(group_done[row])
            if group_done[row] and INFO_TERMINAL_OBS in info:
                finals.append((row, info[INFO_TERMINAL_OBS]))
            rest = {k: v for k, v in info.items() if k not in (INFO_TRUNCATED, INFO_TERMINAL_OBS)}
            if rest:
                check_info(rest, f"{what}.info[{agent}]")
                extra[row] = rest
        final_index = final_obs = None
        if finals:
            final_index = np.asarray([row for row, _ in finals], np.int32)
            final_obs = decode_rows(
                group.spec.spaces,
                [observation for _, observation in finals],
                f"{what}.info[{group.spec.policy}].{INFO_TERMINAL_OBS}",
            )
        # Every part is shaped here from the group's rows: nothing for StepData's construction check to find.
        return StepData.unchecked(obs, group_reward, group_done & ~truncated, truncated, final_index, final_obs, extra)

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
        per_group: list[dict[str, np.ndarray]] = []
        for group in self.groups:
            policy = group.spec.policy
            actions = message.groups.get(policy)
            if actions is None:
                actions = self._last_actions[policy]  # held: the plugin needs them spelled out
            else:
                self._last_actions[policy] = actions
            per_group.append(actions)
        self.phase = Phase.AWAIT_STEP
        if self._plan is not None:
            frame = write_actions(self._plan, per_group, [g.spec.spaces for g in self.groups])
            if frame is not None:
                return frame
        per_agent: list[dict[str, Any]] = [{} for _ in range(self.n_agents)]
        for group, actions in zip(self.groups, per_group, strict=True):
            for i, row in zip(group.agents, encode_actions(group.spec.spaces, actions), strict=True):
                per_agent[i] = row
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
