"""A trainer that checks every row of its batches against what tests/scripts/echo_game.py sends, answers
with actions derived from each row's origin, then trains the same VecEnv with PPO."""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from broker.protocol.messages import StepOptions
from clients.vec_env import BrokerVecEnv
from tests.scripts.echo_game import GROUP_ID, N_AGENTS


def derive(policy: str, obs: np.ndarray, env: BrokerVecEnv) -> np.ndarray:
    game, agent, tick = obs[:, 0], obs[:, 2], obs[:, 3]
    if policy == "red":
        return np.stack([game * 0.25, agent * 0.25 + (tick % 2) * 0.125], 1).astype(np.float32)
    return np.stack([game, agent + 4 * (tick % 2)], 1).astype(np.int64)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", required=True)
    parser.add_argument("--policy", required=True)
    parser.add_argument("--games", type=int, required=True)
    parser.add_argument("--check-steps", type=int, required=True)
    parser.add_argument("--ppo-iterations", type=int, required=True)
    parser.add_argument("--report", required=True)
    args = parser.parse_args()
    env = BrokerVecEnv(args.policy, args.address, stepping=StepOptions("barrier"))  # exact tick for tick
    n = N_AGENTS[args.policy]
    problems: list[str] = []
    layout = [(g.game_index, g.offset, g.n_agents) for g in env.policy_info.games]
    if env.num_envs != n * args.games or layout != [(i, i * n, n) for i in range(args.games)]:
        problems.append(f"layout {layout} with {env.num_envs} envs")
    expected_origin = np.array([[g, GROUP_ID[args.policy], a] for g in range(args.games) for a in range(n)], np.float32)
    obs = env.reset()
    episodes = 0
    for step in range(args.check_steps):
        rows = obs["obs"]
        if not np.array_equal(rows[:, :3], expected_origin):
            problems.append(f"step {step}: rows {rows[:, :3].tolist()}")
        if not np.all(rows[:, 3] == step):
            problems.append(f"step {step}: ticks {rows[:, 3].tolist()}")
        obs, reward, dones, infos = env.step(derive(args.policy, rows, env))
        if not np.allclose(reward, 1.0 if args.policy == "red" else 0.5):
            problems.append(f"step {step}: reward {reward.tolist()}")
        for row in np.flatnonzero(dones):
            episodes += 1
            final = infos[row]["terminal_observation"]["obs"]
            truncated = infos[row]["TimeLimit.truncated"]
            if not (np.array_equal(final[:3], expected_origin[row]) and final[3] == -(step + 1)):
                problems.append(f"step {step} row {row}: terminal obs {final.tolist()}")
            if truncated != (args.policy == "blue"):
                problems.append(f"step {step} row {row}: TimeLimit.truncated={truncated}")

    from stable_baselines3 import PPO
    from stable_baselines3.common.vec_env import VecMonitor

    model = PPO("MultiInputPolicy", VecMonitor(env), n_steps=32, batch_size=64, n_epochs=2, seed=0, verbose=0)
    model.learn(total_timesteps=32 * env.num_envs * args.ppo_iterations)
    report = {
        "policy": args.policy,
        "n_envs": env.num_envs,
        "episodes": episodes,
        "problems": problems[:20],
        "ppo_steps": int(model.num_timesteps),
    }
    env.close()
    with open(args.report, "w") as f:
        json.dump(report, f)
    return 0 if not problems and episodes > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
