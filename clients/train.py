"""``gdrl-train``: train one policy with Stable-Baselines3 against the broker."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gdrl-train", description="Train one policy through the broker with SB3.")
    parser.add_argument("--policy", required=True, help="policy (agent group) name to train")
    parser.add_argument("--broker", default="127.0.0.1:11008", help="broker address: host:port or unix:/path")
    parser.add_argument("--token", default=None, help="shared token, if the broker requires one")
    parser.add_argument("--timesteps", type=int, default=100_000, help="total env steps (summed over all agents)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n-steps", type=int, default=128, help="PPO rollout length per env")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--n-epochs", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=3e-4)
    parser.add_argument("--gamma", type=float, default=0.99)
    parser.add_argument("--ent-coef", type=float, default=0.0)
    parser.add_argument("--save-model-path", default=None, help="save the trained model here (.zip)")
    parser.add_argument("--report-json", default=None, help="write a JSON summary of the run here")
    parser.add_argument("--log-every", type=float, default=5.0, help="seconds between progress lines")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.vec_env import VecMonitor

    from broker.log import configure_logging
    from clients.vec_env import BrokerVecEnv

    configure_logging()
    torch.set_num_threads(1)
    env = VecMonitor(BrokerVecEnv(args.policy, args.broker, token=args.token))
    episodes: list[tuple[int, float]] = []

    class Progress(BaseCallback):
        def __init__(self) -> None:
            super().__init__()
            self.last = time.monotonic()
            self.start = self.last

        def _on_step(self) -> bool:
            for info in self.locals["infos"]:
                if "episode" in info:
                    episodes.append((self.num_timesteps, float(info["episode"]["r"])))
            now = time.monotonic()
            if now - self.last >= args.log_every:
                self.last = now
                recent = [r for _, r in episodes[-100:]]
                mean = f"{np.mean(recent):.3f}" if recent else "n/a"
                rate = self.num_timesteps / (now - self.start)
                print(
                    f"[{args.policy}] steps {self.num_timesteps} ({rate:.0f}/s) mean episode reward {mean}", flush=True
                )
            return True

    model = PPO(
        "MultiInputPolicy",
        env,
        n_steps=args.n_steps,
        batch_size=args.batch_size,
        n_epochs=args.n_epochs,
        learning_rate=args.learning_rate,
        gamma=args.gamma,
        ent_coef=args.ent_coef,
        seed=args.seed,
        verbose=0,
    )
    started = time.monotonic()
    model.learn(total_timesteps=args.timesteps, callback=Progress())
    elapsed = time.monotonic() - started
    if args.save_model_path:
        model.save(args.save_model_path)
    report = summarize(args.policy, env.num_envs, episodes, model.num_timesteps, elapsed)
    if args.report_json:
        Path(args.report_json).write_text(json.dumps(report, indent=2))
    print(json.dumps(report), flush=True)
    env.close()
    return 0


def summarize(
    policy: str, n_envs: int, episodes: list[tuple[int, float]], steps: int, seconds: float
) -> dict[str, Any]:
    k = max(1, min(100, len(episodes) // 5))
    first = [r for _, r in episodes[:k]]
    last = [r for _, r in episodes[-k:]]
    return {
        "policy": policy,
        "agents": n_envs,
        "steps": steps,
        "seconds": round(seconds, 1),
        "episodes": len(episodes),
        "reward_start": float(np.mean(first)) if first else None,
        "reward_end": float(np.mean(last)) if last else None,
        "curve": [[t, r] for t, r in episodes],
    }


if __name__ == "__main__":
    sys.exit(main())
