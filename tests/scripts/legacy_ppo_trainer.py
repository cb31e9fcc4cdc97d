"""A PPO trainer on BrokerVecEnv that reports what it saw: the first observations (who is who), the
episodes and rewards. Used by the godot_rl plugin-game tests."""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", required=True)
    parser.add_argument("--policy", required=True)
    parser.add_argument("--timesteps", type=int, default=3000)
    parser.add_argument("--report", required=True)
    args = parser.parse_args()

    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.vec_env import VecMonitor

    from clients.vec_env import BrokerVecEnv

    torch.set_num_threads(1)
    env = BrokerVecEnv(args.policy, args.address)
    first = env.reset()
    assert isinstance(first, dict)
    rewards: list[float] = []
    episodes: list[float] = []

    class Record(BaseCallback):
        def _on_step(self) -> bool:
            rewards.extend(np.asarray(self.locals["rewards"]).tolist())
            episodes.extend(float(i["episode"]["r"]) for i in self.locals["infos"] if "episode" in i)
            return True

    monitored = VecMonitor(env)
    model = PPO("MultiInputPolicy", monitored, n_steps=64, batch_size=96, n_epochs=2, verbose=0)
    model.learn(args.timesteps, callback=Record())
    report: dict[str, Any] = {
        "n_envs": env.num_envs,
        "timesteps": model.num_timesteps,
        "first_obs": {k: v.tolist() for k, v in first.items()},
        "episodes": len(episodes),
        "reward_std": float(np.std(rewards)),
        "action_space": str(env.action_space),
    }
    monitored.close()
    with open(args.report, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
