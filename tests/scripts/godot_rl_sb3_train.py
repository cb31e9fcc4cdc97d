"""An unmodified godot_rl training script: godot_rl's own StableBaselinesGodotEnv (editor mode: no
env_path, it waits on ``--port`` for a game) and SB3 PPO. The broker connects to it as the game.
Writes a report of what arrived."""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--timesteps", type=int, default=3000)
    parser.add_argument("--report", required=True)
    args = parser.parse_args()

    import torch
    from godot_rl.wrappers.stable_baselines_wrapper import StableBaselinesGodotEnv
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.vec_env import VecMonitor

    torch.set_num_threads(1)
    env = StableBaselinesGodotEnv(env_path=None, port=args.port)
    seen: dict[str, Any] = {"rewards": [], "episodes": 0, "truncated_with_obs": 0, "terminated": 0}

    class Record(BaseCallback):
        def _on_step(self) -> bool:
            seen["rewards"].extend(np.asarray(self.locals["rewards"]).tolist())
            for info, done in zip(self.locals["infos"], self.locals["dones"], strict=True):
                seen["episodes"] += "episode" in info
                if done and info.get("TimeLimit.truncated") and "terminal_observation" in info:
                    seen["truncated_with_obs"] += 1
                elif done:
                    seen["terminated"] += 1
            return True

    monitored = VecMonitor(env)
    first = monitored.reset()
    assert isinstance(first, dict)
    model = PPO("MultiInputPolicy", monitored, n_steps=64, batch_size=128, n_epochs=2, verbose=0)
    model.learn(args.timesteps, callback=Record())
    report = {
        "num_envs": env.num_envs,
        "timesteps": model.num_timesteps,
        "observation_space": str(env.observation_space),
        "action_space": str(env.action_space),
        "first_obs_shapes": {k: list(np.asarray(v).shape) for k, v in first.items()},
        "reward_mean": float(np.mean(seen["rewards"])),
        "reward_std": float(np.std(seen["rewards"])),
        "episodes": seen["episodes"],
        "truncated_with_obs": seen["truncated_with_obs"],
        "terminated": seen["terminated"],
    }
    with open(args.report, "w") as f:
        json.dump(report, f)
    env.close()


if __name__ == "__main__":
    main()
