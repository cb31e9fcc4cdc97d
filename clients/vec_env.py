"""Trainer side: a Stable-Baselines3 VecEnv whose envs are all the agents of one policy, in every game.

``BrokerVecEnv(policy="player", address="127.0.0.1:11008")`` (or ``"unix:/path"``) connects over a
socket; ``InProcessBroker.vec_env(policy)`` returns the same class wired to a broker running in this
process, with no socket in between. ``BrokerEnv`` is a single-agent gymnasium view for ``check_env``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import gymnasium as gym
import numpy as np
import structlog
from stable_baselines3.common.vec_env import VecEnv
from stable_baselines3.common.vec_env.base_vec_env import VecEnvIndices, VecEnvObs, VecEnvStepReturn

from broker.protocol import PROTOCOL_VERSION
from broker.protocol.messages import Batch, Hello, Message, PolicyInfo, TrainerAct, TrainerReset, Waiting
from clients.errors import BrokerError
from clients.spaces import ActionCodec, convert_obs, observation_dict
from clients.transport import Address, PeerSocket, default_name

log = structlog.get_logger("gdrl.trainer")


class TrainerLink(Protocol):
    """How a VecEnv reaches the broker: a socket, or a queue pair inside the broker's process."""

    def send(self, message: Message) -> None: ...

    def recv(self) -> Message: ...

    def close(self, reason: str = "") -> None: ...


class BrokerVecEnv(VecEnv):
    """All agents of ``policy`` across every game, as one SB3 VecEnv (parameter sharing).

    Episodes end per agent and games reset agents themselves: on an episode end the info holds
    ``terminal_observation`` and ``TimeLimit.truncated`` and the returned observation is the next
    episode's first. ``reset()`` returns the current observations; it does not reset the games.
    """

    def __init__(
        self,
        policy: str,
        address: str | Address = "127.0.0.1:11008",
        *,
        name: str | None = None,
        token: str | None = None,
        timeout_connect: float = 60.0,
        link: TrainerLink | None = None,
    ) -> None:
        self.policy = policy
        self.closed = False
        self._open_step: int | None = None
        self._pending: dict[str, np.ndarray] | None = None
        self.last_waiting: str | None = None
        if link is None:
            hello = Hello("trainer", PROTOCOL_VERSION, name or default_name(f"trainer[{policy}]"), token, policy=policy)
            link = PeerSocket(address, hello, timeout_connect=timeout_connect)
        self._link = link
        info = self._await(PolicyInfo)
        assert isinstance(info, PolicyInfo)
        self.policy_info = info
        self.spaces = info.spaces
        self._codec = ActionCodec(info.spaces)
        game_index = np.zeros(info.n_envs, np.int64)
        agent_index = np.zeros(info.n_envs, np.int64)
        for game in info.games:
            game_index[game.offset : game.offset + game.n_agents] = game.game_index
            agent_index[game.offset : game.offset + game.n_agents] = np.arange(game.n_agents)
        self._attrs: dict[str, list[Any]] = {
            "render_mode": [None] * info.n_envs,
            "policy": [policy] * info.n_envs,
            "game_index": game_index.tolist(),
            "agent_index": agent_index.tolist(),
        }
        super().__init__(info.n_envs, observation_dict(info.spaces), self._codec.space)

    # --- messages --------------------------------------------------------------------------------

    def _await(self, kind: type) -> Message:
        while True:
            message = self._link.recv()
            if isinstance(message, kind):
                return message
            if isinstance(message, Waiting):
                if message.reason != self.last_waiting:
                    log.info(message.reason, policy=self.policy)
                self.last_waiting = message.reason
            elif not isinstance(message, (PolicyInfo, Batch)):
                raise BrokerError("unexpected_message", f"trainer got '{message.TYPE}'")

    def _next_batch(self) -> Batch:
        batch = self._await(Batch)
        assert isinstance(batch, Batch)
        self._open_step = batch.step
        return batch

    # --- VecEnv API ------------------------------------------------------------------------------

    def reset(self) -> VecEnvObs:
        self._link.send(TrainerReset())
        batch = self._next_batch()
        self._reset_seeds()
        self._reset_options()
        self.reset_infos = [dict(batch.data.infos.get(i, {})) for i in range(self.num_envs)]
        return convert_obs(self.spaces, batch.data.obs)

    def step_async(self, actions: np.ndarray) -> None:
        if self._open_step is None:
            raise BrokerError("unexpected_message", "call reset() before step()")
        self._link.send(TrainerAct(self._open_step, self._codec.to_wire(actions)))

    def step_wait(self) -> VecEnvStepReturn:
        data = self._next_batch().data
        obs = convert_obs(self.spaces, data.obs)
        terminated = np.asarray(data.terminated)
        truncated = np.asarray(data.truncated)
        dones = terminated | truncated
        # SB3's own VecEnvs set TimeLimit.truncated on every step's info, not only at episode ends.
        infos: list[dict[str, Any]] = [{"TimeLimit.truncated": t} for t in (truncated & ~terminated).tolist()]
        for row, info in data.infos.items():
            infos[row].update(info)
        done_rows = np.flatnonzero(dones)
        if len(done_rows):
            finals: dict[int, int] = {}
            final_obs: dict[str, np.ndarray] = {}
            if data.final_index is not None and data.final_obs is not None:
                finals = {int(row): j for j, row in enumerate(data.final_index)}
                final_obs = convert_obs(self.spaces, data.final_obs)
            for row in done_rows.tolist():
                j = finals.get(row)
                source, index = (final_obs, j) if j is not None else (obs, row)
                infos[row]["terminal_observation"] = {k: v[index].copy() for k, v in source.items()}
        return obs, np.array(data.reward, dtype=np.float32), dones, infos

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._link.close("trainer closed")

    def get_attr(self, attr_name: str, indices: VecEnvIndices = None) -> list[Any]:
        if attr_name not in self._attrs:
            raise AttributeError(f"broker envs have no attribute '{attr_name}' (known: {sorted(self._attrs)})")
        values = self._attrs[attr_name]
        return [values[i] for i in self._get_indices(indices)]

    def set_attr(self, attr_name: str, value: Any, indices: VecEnvIndices = None) -> None:
        values = self._attrs.setdefault(attr_name, [None] * self.num_envs)
        for i in self._get_indices(indices):
            values[i] = value

    def env_method(
        self, method_name: str, *method_args: Any, indices: VecEnvIndices = None, **kwargs: Any
    ) -> list[Any]:
        raise NotImplementedError(
            f"env_method('{method_name}'): the envs live in game processes behind the broker; "
            "use get_attr/set_attr for env attributes"
        )

    def env_is_wrapped(self, wrapper_class: type[gym.Wrapper], indices: VecEnvIndices = None) -> list[bool]:
        return [False for _ in self._get_indices(indices)]

    def get_images(self) -> Sequence[np.ndarray | None]:
        return [None] * self.num_envs


class BrokerEnv(gym.Env[dict[str, np.ndarray], Any]):
    """A gymnasium Env over a policy that has exactly one agent in one game (for ``check_env``)."""

    def __init__(self, policy: str, address: str | Address = "127.0.0.1:11008", **kwargs: Any) -> None:
        self.venv = BrokerVecEnv(policy, address, **kwargs)
        if self.venv.num_envs != 1:
            n = self.venv.num_envs
            self.venv.close()
            raise ValueError(f"BrokerEnv needs a policy with exactly one agent; '{policy}' has {n}; use BrokerVecEnv")
        self.observation_space = self.venv.observation_space
        self.action_space = self.venv.action_space
        self._next_obs: dict[str, np.ndarray] | None = None

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        super().reset(seed=seed)
        if self._next_obs is None:
            self._next_obs = self.venv.reset()  # type: ignore[assignment]
        assert self._next_obs is not None
        obs = {k: v[0] for k, v in self._next_obs.items()}
        self._next_obs = None
        return obs, {}

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        self.venv.step_async(np.asarray([action]))
        obs, reward, dones, infos = self.venv.step_wait()
        info = infos[0]
        truncated = bool(info.pop("TimeLimit.truncated"))
        assert isinstance(obs, dict)
        self._next_obs = obs
        if not dones[0]:
            return {k: v[0] for k, v in obs.items()}, float(reward[0]), False, False, info
        final = info.pop("terminal_observation")
        return final, float(reward[0]), not truncated, truncated, info

    def close(self) -> None:
        self.venv.close()
