"""Trainer side: a Stable-Baselines3 VecEnv whose envs are all the agents of one policy, in every game.

``BrokerVecEnv(policy="player", address="127.0.0.1:11008")`` (or ``"unix:/path"``) connects over a
socket; ``InProcessBroker.vec_env(policy)`` returns the same class wired to a broker running in this
process, with no socket in between. ``BrokerEnv`` is a single-agent gymnasium view for ``check_env``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

import gymnasium as gym
import numpy as np
import structlog
from stable_baselines3.common.vec_env import VecEnv
from stable_baselines3.common.vec_env.base_vec_env import VecEnvIndices, VecEnvObs, VecEnvStepReturn

from broker.protocol import DEFAULT_ADDRESS, PROTOCOL_VERSION
from broker.protocol.errors import ErrorCode
from broker.protocol.hot import new_act
from broker.protocol.messages import Batch, Hello, Message, PolicyInfo, StepData, StepOptions, TrainerReset, Waiting
from broker.protocol.native import NATIVE
from broker.protocol.ring import DEFAULT_RING_BYTES
from clients.errors import BrokerError
from clients.spaces import ActionCodec, ObsConverter, observation_dict
from clients.transport import (
    DEFAULT_TIMEOUT_RECONNECT,
    SPIN_WAIT_S,
    Address,
    PeerSocket,
    default_name,
    default_token,
)

log = structlog.get_logger("gdrl.trainer")
WAITING_NOTICE_EVERY = 10.0  # seconds between repeats of what a waiting trainer waits for


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

    A lost broker (connection dropped; with ``reconnect_on_shutdown`` also an orderly shutdown) is
    reconnected for up to ``timeout_reconnect`` seconds (0: never; an in-process ``link`` never is). The
    broker must offer the same spaces and ``n_envs`` again (else BrokerError ``space_mismatch``). The
    interrupted ``step_wait`` then returns the new session's first observations with every env done and
    truncated (``terminal_observation`` = the last observation returned, reward 0, ``broker_reconnected``
    in the info). After the timeout it raises BrokerGoneError.

    ``spin_wait_s``: how long ``step_wait`` asks for the next batch without sleeping before it blocks
    (clients/transport.py, ``SPIN_WAIT_S``; 0 turns it off, e.g. on a machine with fewer cores than busy
    processes).

    ``ring_bytes``: with the broker on this host, batches of 32 KB or more come through a shared-memory ring of
    this size (virtual: only the pages a batch touches are used) instead of the socket, copied out once
    (docs/protocol.md §3b; docs/performance_history.md, "A shared-memory ring"); 0: the socket only.
    """

    def __init__(
        self,
        policy: str,
        address: str | Address = DEFAULT_ADDRESS,
        *,
        name: str | None = None,
        token: str | None = None,
        timeout_connect: float = 60.0,
        stepping: StepOptions | None = None,
        link: TrainerLink | None = None,
        timeout_reconnect: float = DEFAULT_TIMEOUT_RECONNECT,
        reconnect_on_shutdown: bool = False,
        spin_wait_s: float = SPIN_WAIT_S,
        ring_bytes: int = DEFAULT_RING_BYTES,
    ) -> None:
        self.policy = policy
        self.closed = False
        self.timeout_reconnect = timeout_reconnect
        self.reconnect_on_shutdown = reconnect_on_shutdown
        self.reconnects = 0
        self._socket: PeerSocket | None = None  # only a socket of our own can be reconnected
        self._lost: BrokerError | None = None  # the broker was lost in step_async; step_wait reconnects
        self._last_obs: dict[str, np.ndarray] | None = None  # what reset/step_wait last returned
        self._built = False
        self._open_step: int | None = None
        self._pending: dict[str, np.ndarray] | None = None
        self.last_waiting: str | None = None
        self.stepping = stepping
        # What a fresh start after a long pause needs (clients/callbacks.py): the actions sent last (the games
        # repeat them while this trainer is away), whether the broker holds this policy (its batches then
        # report frames), and when the last observations went to the caller.
        self.last_actions: np.ndarray | None = None
        self.holding = False
        self.returned_at = time.monotonic()
        if link is None:
            trainer_name = name or default_name(f"trainer[{policy}]")
            hello = Hello(
                "trainer", PROTOCOL_VERSION, trainer_name, default_token(token), policy=policy, stepping=stepping
            )
            link = self._socket = PeerSocket(
                address, hello, timeout_connect=timeout_connect, spin_wait_s=spin_wait_s, ring_bytes=ring_bytes
            )
        self._link = link
        try:
            info = self._await(PolicyInfo)
        except BrokerError as exc:
            if not self._lost_broker(exc):
                raise
            info = self._reconnect(exc)
        assert isinstance(info, PolicyInfo)
        self.spaces = info.spaces
        self._convert_obs = ObsConverter(info.spaces)
        self._codec = ActionCodec(info.spaces)
        self._attrs: dict[str, list[Any]] = {"render_mode": [None] * info.n_envs, "policy": [policy] * info.n_envs}
        self._adopt_layout(info)
        super().__init__(info.n_envs, observation_dict(info.spaces), self._codec.space)
        self._built = True

    def _adopt_layout(self, info: PolicyInfo) -> None:
        self.policy_info = info
        game_index = np.zeros(info.n_envs, np.int64)
        agent_index = np.zeros(info.n_envs, np.int64)
        for game in info.games:
            game_index[game.offset : game.offset + game.n_agents] = game.game_index
            agent_index[game.offset : game.offset + game.n_agents] = np.arange(game.n_agents)
        self._attrs["game_index"] = game_index.tolist()
        self._attrs["agent_index"] = agent_index.tolist()

    # --- messages --------------------------------------------------------------------------------

    def _await(self, kind: type) -> Message:
        while True:
            message = self._recv_saying_what_we_wait_for()
            if isinstance(message, kind):
                return message
            if isinstance(message, Waiting):
                if message.reason != self.last_waiting:
                    log.info(message.reason, policy=self.policy)
                self.last_waiting = message.reason
            elif not isinstance(message, (PolicyInfo, Batch)):
                raise BrokerError("unexpected_message", f"trainer got '{message.TYPE}'")

    def _recv_saying_what_we_wait_for(self) -> Message:
        """The next message; while the broker has said we wait (for games, say), repeat that every
        WAITING_NOTICE_EVERY seconds, so a long wait is never silent."""
        sock = self._socket
        if sock is None or self.last_waiting is None:
            if sock is not None:
                sock.set_recv_timeout(sock.timeout_recv)
            return self._link.recv()
        started = time.monotonic()
        # Kept from one step to the next (each change is a system call): this is the socket's only reader.
        sock.set_recv_timeout(WAITING_NOTICE_EVERY)
        while True:
            try:
                return sock.recv()
            except BrokerError as exc:
                if exc.code != "timeout":
                    raise
                log.info(self.last_waiting, policy=self.policy, waited_s=round(time.monotonic() - started))

    def _next_batch(self) -> Batch:
        batch = self._await(Batch)
        assert isinstance(batch, Batch)
        self._open_step = batch.step
        return batch

    # --- VecEnv API ------------------------------------------------------------------------------

    def reset(self) -> VecEnvObs:
        lost, self._lost = self._lost, None
        try:
            if lost is not None:
                raise lost
            self._link.send(TrainerReset())
            batch = self._next_batch()
        except BrokerError as exc:
            if not self._lost_broker(exc):
                raise
            batch = self._reconnect_and_reset(exc)
        self._reset_seeds()
        self._reset_options()
        self.reset_infos = [dict(batch.data.infos.get(i, {})) for i in range(self.num_envs)]
        self._last_obs = self._convert_obs(batch.data.obs)
        self.holding = batch.data.frames is not None
        self.returned_at = time.monotonic()
        return self._last_obs

    def step_async(self, actions: np.ndarray) -> None:
        if self._open_step is None:
            raise BrokerError("unexpected_message", "call reset() before step()")
        self.last_actions = actions  # SB3 hands over a fresh array every step: no copy
        try:
            # Unchecked: the codec's arrays are the wire's by construction, and the broker checks every shape.
            self._link.send(new_act(self._open_step, self._codec.to_wire(actions), ""))
        except BrokerError as exc:
            if not self._lost_broker(exc):
                raise
            self._lost = exc

    def step_wait(self) -> VecEnvStepReturn:
        batch, resumed = self._batch_after_act()
        if resumed:
            return self._resume_after_reconnect(batch)
        data = batch.data
        obs = self._convert_obs(data.obs)
        # SB3's own VecEnvs set TimeLimit.truncated on every step's info, not only at episode ends. SB3 wants
        # one dict per env: built in C with the dones and their count where it can (400 dicts in a few us),
        # else numpy's way.
        ends = NATIVE.step_ends(data.terminated, data.truncated, data.frames) if NATIVE is not None else None
        if ends is not None:
            dones, infos, ended = ends
        else:
            terminated = np.asarray(data.terminated)
            truncated = np.asarray(data.truncated)
            dones = terminated | truncated
            ended = int(np.count_nonzero(dones))
            time_limit = (truncated & ~terminated).tolist()
            if data.frames is None:
                infos = [{"TimeLimit.truncated": t} for t in time_limit]
            else:  # hold mode: game ticks each transition spanned
                frames = data.frames.tolist()
                infos = [{"TimeLimit.truncated": t, "frames": f} for t, f in zip(time_limit, frames, strict=True)]
        for row, info in data.infos.items():
            infos[row].update(info)
        if ended:  # most steps end no episode
            put_terminal_obs(infos, dones, data, obs, self._convert_obs.plan)
        self._last_obs = obs
        self.holding = data.frames is not None
        self.returned_at = time.monotonic()
        return obs, np.array(data.reward, dtype=np.float32), dones, infos

    # --- surviving a lost broker -----------------------------------------------------------------

    def _lost_broker(self, exc: BrokerError) -> bool:
        if self._socket is None or self.timeout_reconnect <= 0 or self.closed:
            return False
        return self._socket.lost_broker(exc, self.reconnect_on_shutdown)

    def _batch_after_act(self) -> tuple[Batch, bool]:
        """The batch answering our actions; or, once the broker was lost, the new session's first batch
        (and True)."""
        if self._lost is None:
            try:
                return self._next_batch(), False
            except BrokerError as exc:
                if not self._lost_broker(exc):
                    raise
                self._lost = exc
        lost, self._lost = self._lost, None
        return self._reconnect_and_reset(lost), True

    def _resume_after_reconnect(self, batch: Batch) -> VecEnvStepReturn:
        """The interrupted step ends every episode, truncated at the last observation SB3 saw; the new
        session's observations start the next ones. Its reward is 0: no action of ours produced it."""
        data = batch.data
        obs = self._convert_obs(data.obs)
        last = self._last_obs if self._last_obs is not None else obs
        infos: list[dict[str, Any]] = []
        for row in range(self.num_envs):
            info = dict(data.infos.get(row, {}))
            info.update({"TimeLimit.truncated": True, "broker_reconnected": True})
            info["terminal_observation"] = {k: v[row].copy() for k, v in last.items()}
            infos.append(info)
        self._last_obs = obs
        self.returned_at = time.monotonic()
        return obs, np.zeros(self.num_envs, np.float32), np.ones(self.num_envs, np.bool_), infos

    def _reconnect_and_reset(self, cause: BrokerError) -> Batch:
        while True:
            self._reconnect(cause)
            try:
                self._link.send(TrainerReset())
                return self._next_batch()
            except BrokerError as exc:
                if not self._lost_broker(exc):
                    raise
                cause = exc

    def _reconnect(self, cause: BrokerError) -> PolicyInfo:
        """Say hello again until the broker answers with this policy's layout (BrokerGoneError after
        ``timeout_reconnect`` without a broker); the layout must be the one this VecEnv was built for."""
        assert self._socket is not None
        address = str(self._socket.address)
        while True:
            log.warning("lost the broker; reconnecting", policy=self.policy, address=address, error=cause.message)
            self._socket.reconnect(self.timeout_reconnect, cause)
            try:
                info = self._await(PolicyInfo)
            except BrokerError as exc:
                if not self._lost_broker(exc):
                    raise
                cause = exc
                continue
            assert isinstance(info, PolicyInfo)
            if self._built and (info.n_envs != self.num_envs or info.spaces != self.spaces):
                self.closed = True
                self._socket.close("layout changed")
                raise BrokerError(
                    ErrorCode.SPACE_MISMATCH.value,
                    f"after reconnecting to the broker at {address}, policy '{self.policy}' has {info.n_envs} envs "
                    f"and spaces {info.spaces}; this VecEnv was built for {self.num_envs} envs and {self.spaces}. "
                    "Start a new trainer for the new layout.",
                )
            if self._built:
                self._adopt_layout(info)
            self.reconnects += 1
            log.info("reconnected to the broker", policy=self.policy, address=address, n_envs=info.n_envs)
            return info

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

    def __init__(self, policy: str, address: str | Address = DEFAULT_ADDRESS, **kwargs: Any) -> None:
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


def put_terminal_obs(
    infos: list[dict[str, Any]],
    dones: np.ndarray,
    data: StepData,
    obs: dict[str, np.ndarray],
    plan: tuple[tuple[str, np.dtype[Any]], ...],
) -> None:
    """SB3's ``terminal_observation`` in the info of every row that ended: the game's final observation of that
    row (of the space's dtype, ``plan``) when the step has one, else the row of ``obs``; a writable row each,
    copied straight from the wire arrays. In one C call where it reads the arrays (cold, numpy's way costs tens of
    microseconds a step at 400 agents)."""
    if NATIVE is not None and NATIVE.terminal_obs(infos, dones, data.final_index, data.final_obs, obs, plan):
        return
    finals: dict[int, int] = {}
    if data.final_index is not None and data.final_obs is not None:
        finals = dict(zip(data.final_index.tolist(), range(len(data.final_index)), strict=True))
    dtypes = dict(plan)
    for row in np.flatnonzero(dones).tolist():
        j = finals.get(row)
        if j is not None:
            source = data.final_obs
            assert source is not None
            infos[row]["terminal_observation"] = {k: np.array(v[j], dtype=dtypes[k]) for k, v in source.items()}
        else:
            infos[row]["terminal_observation"] = {k: v[row].copy() for k, v in obs.items()}
