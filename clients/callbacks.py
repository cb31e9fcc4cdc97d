"""Stable-Baselines3 callbacks for training through the broker.

``FreshStartCallback``: with hold-and-accumulate stepping an on-policy update (PPO, A2C) lasts long enough
for the games to run on without this trainer: its agents repeat their last actions and their episodes may
end. SB3 would then start the next rollout from the observation it had before the update, choose an action
for a state that is gone, and record that transition with the held ticks' reward, often for agents whose
episode ended meanwhile, so that the action was never applied (``action_applied: False``). After such a
pause this callback instead answers the open batch with what the games were doing anyway (the last actions,
or zeros where the trainer asked for no-op holds) and starts the rollout from the newest observation. That
step is not recorded as a transition; wrappers (VecMonitor, VecNormalize) still see it, so episode returns
and lengths stay complete.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.on_policy_algorithm import OnPolicyAlgorithm
from stable_baselines3.common.vec_env import VecEnv, VecEnvWrapper

from broker.protocol.messages import DEFAULT_HOLD_DEADLINE_MS
from clients.vec_env import BrokerVecEnv

# A pause shorter than the broker's shortest hold deadline cannot have let a game run on.
FRESH_START_AFTER_S = DEFAULT_HOLD_DEADLINE_MS / 1000.0


class FreshStartCallback(BaseCallback):
    """After an update long enough for the broker to hold this policy, start the rollout from the newest
    observation instead of the one from before the update (PPO, A2C; a no-op in strict stepping)."""

    def __init__(self, after_s: float = FRESH_START_AFTER_S, verbose: int = 0) -> None:
        super().__init__(verbose)
        self.after_s = after_s
        self.fresh_starts = 0  # how many rollouts started from a refreshed observation
        # The unrecorded step of the last fresh start (obs, rewards, dones, infos), for callbacks that count
        # episodes from the infos: episodes that ended during the pause end in it.
        self.last_refresh: tuple[Any, np.ndarray, np.ndarray, list[dict[str, Any]]] | None = None
        self._broker_env: BrokerVecEnv | None = None

    def _init_callback(self) -> None:
        env = self.model.get_env()
        if not isinstance(self.model, OnPolicyAlgorithm) or env is None:
            raise TypeError("FreshStartCallback is for on-policy algorithms (PPO, A2C) on a BrokerVecEnv")
        broker_env: VecEnv = env
        while isinstance(broker_env, VecEnvWrapper):
            broker_env = broker_env.venv
        if not isinstance(broker_env, BrokerVecEnv):
            raise TypeError("FreshStartCallback needs a BrokerVecEnv (possibly wrapped)")
        self._broker_env = broker_env

    def _on_rollout_start(self) -> None:
        broker_env = self._broker_env
        if broker_env is None or not broker_env.holding or broker_env.last_actions is None:
            return
        if time.monotonic() - broker_env.returned_at < self.after_s:
            return
        model: BaseAlgorithm = self.model
        env = model.get_env()
        assert env is not None
        held = broker_env.last_actions
        stepping = broker_env.stepping
        if stepping is not None and stepping.hold_action == "noop":
            held = np.zeros_like(held)
        obs, rewards, dones, infos = env.step(held)
        self.last_refresh = (obs, rewards, dones, infos)
        model._last_obs = obs  # type: ignore[assignment]
        model._last_episode_starts = dones
        self.fresh_starts += 1

    def _on_step(self) -> bool:
        return True
