"""Hold-and-accumulate against strict lock-step, in one run (issue: trainers never stall each other).

Two simulated games, two policies, two trainer processes:

* ``mover`` is trained by a slow PPO (large ``n_steps`` and many epochs: long updates);
* ``picker`` is trained by a fast PPO (short rollouts, one epoch).

For each stepping mode the same setup runs for the same wall time; the table compares game ticks/s and
each policy's samples/s. ``--learning`` instead trains both policies for the same number of their own
steps in each mode and compares the mean episode reward they reach.

    python -m benchmarks.hold_vs_strict --seconds 40
    python -m benchmarks.hold_vs_strict --learning --timesteps 40000
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

SLOW = {"policy": "mover", "n_steps": 512, "n_epochs": 10, "batch_size": 256}
FAST = {"policy": "picker", "n_steps": 16, "n_epochs": 1, "batch_size": 64}


def trainer_main(argv: list[str]) -> None:
    """One trainer process: PPO on a BrokerVecEnv in the given stepping mode, for a time or step budget."""
    parser = argparse.ArgumentParser()
    for name in ("--address", "--policy", "--mode", "--report"):
        parser.add_argument(name, required=True)
    parser.add_argument("--n-steps", type=int, required=True)
    parser.add_argument("--n-epochs", type=int, required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--seconds", type=float, default=0.0)
    parser.add_argument("--timesteps", type=int, default=10**9)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import numpy as np
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.vec_env import VecMonitor

    from broker.protocol.messages import StepOptions
    from clients.vec_env import BrokerVecEnv

    torch.set_num_threads(1)
    env = BrokerVecEnv(args.policy, args.address, stepping=StepOptions(args.mode), name=f"bench-{args.policy}")
    returns: list[float] = []
    frames: list[int] = []
    started = time.monotonic()

    class Budget(BaseCallback):
        def _on_step(self) -> bool:
            for info in self.locals["infos"]:
                if "episode" in info:
                    returns.append(float(info["episode"]["r"]))
                frames.append(int(info.get("frames", 1)))
            return not args.seconds or time.monotonic() - started < args.seconds

    model = PPO(
        "MultiInputPolicy",
        VecMonitor(env),
        n_steps=args.n_steps,
        n_epochs=args.n_epochs,
        batch_size=args.batch_size,
        seed=args.seed,
        verbose=0,
    )
    model.learn(total_timesteps=args.timesteps, callback=Budget())
    elapsed = time.monotonic() - started
    report = {
        "policy": args.policy,
        "mode": args.mode,
        "env_steps": int(model.num_timesteps),
        "seconds": elapsed,
        "samples_per_s": model.num_timesteps / elapsed,
        "episodes": len(returns),
        "reward_end": float(np.mean(returns[-200:])) if returns else None,
        "mean_frames": float(np.mean(frames)) if frames else 1.0,
        "max_frames": max(frames, default=1),
    }
    Path(args.report).write_text(json.dumps(report))
    env.close()


def run_mode(mode: str, seconds: float, timesteps: int, workdir: Path, agents: int, seed: int = 0) -> dict[str, Any]:
    """Throughput (``seconds`` > 0): rates read from the broker's status over a window while both trainers run.
    Learning (``timesteps``): both trainers run to the same number of their own steps."""
    from tests.helpers import broker_process, python_env  # the same subprocess broker the tests use

    env = python_env()
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    with broker_process(workdir, "--games", "2", "--stepping", mode, "--status-interval", "0") as (_, address):
        games = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "broker",
                    "sim-game",
                    "--address",
                    address,
                    "--movers",
                    str(agents),
                    "--pickers",
                    str(agents),
                    "--seed",
                    str(100 * seed + i),
                ],
                env=env,
                **quiet,
            )
            for i in range(2)
        ]
        trainers = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "benchmarks.hold_vs_strict",
                    "--trainer",
                    "--address",
                    address,
                    "--policy",
                    spec["policy"],
                    "--mode",
                    mode,
                    "--seed",
                    str(seed),
                    "--report",
                    str(workdir / f"{mode}-{spec['policy']}.json"),
                    "--n-steps",
                    str(spec["n_steps"]),
                    "--n-epochs",
                    str(spec["n_epochs"]),
                    "--batch-size",
                    str(spec["batch_size"]),
                    "--timesteps",
                    str(timesteps),
                ],
                env=env,
                **quiet,
            )
            for spec in (SLOW, FAST)
        ]
        result: dict[str, Any] = {"mode": mode}
        try:
            if seconds:
                _wait_until(lambda: all(p["env_steps"] > 0 for p in _status(address)["policies"].values()), 120)
                time.sleep(5.0)  # past start-up and the first updates
                before, t0 = _status(address), time.monotonic()
                time.sleep(seconds)
                after, t1 = _status(address), time.monotonic()
                result.update(_rates(before, after, t1 - t0))
            else:
                started = time.monotonic()
                for proc in trainers:
                    proc.wait(timeout=1800)
                result["seconds"] = time.monotonic() - started
                for spec in (SLOW, FAST):
                    result[spec["policy"]] = json.loads((workdir / f"{mode}-{spec['policy']}.json").read_text())
        finally:
            for proc in trainers:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    for proc in games:
        proc.wait(timeout=30)
    return result


def _rates(before: dict[str, Any], after: dict[str, Any], elapsed: float) -> dict[str, Any]:
    ticks = sum(g["ticks"] for g in after["games"]) - sum(g["ticks"] for g in before["games"])
    rates: dict[str, Any] = {"seconds": elapsed, "game_ticks_per_s": ticks / len(after["games"]) / elapsed}
    for name, policy in after["policies"].items():
        steps = policy["env_steps"] - before["policies"][name]["env_steps"]
        rates[name] = {
            "samples_per_s": steps / elapsed,
            "held_fraction": policy["held_fraction"],
            "longest_hold": policy["longest_hold"],
        }
    return rates


def _wait_until(condition: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("trainers did not start")
        time.sleep(0.5)


def _status(address: str) -> dict[str, Any]:
    from broker.status import fetch_status

    return fetch_status(address)


def main() -> None:
    if "--trainer" in sys.argv:
        sys.argv.remove("--trainer")
        trainer_main(sys.argv[1:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=40.0, help="wall time per mode (throughput run)")
    parser.add_argument("--learning", action="store_true", help="compare rewards after equal own steps instead")
    parser.add_argument("--timesteps", type=int, default=40_960, help="own steps per policy (learning run)")
    parser.add_argument("--agents", type=int, default=8, help="agents per group per game")
    parser.add_argument("--seeds", type=int, default=3, help="learning run: seeds per mode")
    parser.add_argument("--out", default="hold_vs_strict.json")
    args = parser.parse_args()
    # Equal own steps: a multiple of both PPO rollouts (2 games x agents envs each), so neither trainer
    # finishes early and leaves the other waiting in barrier mode.
    rollout = SLOW["n_steps"] * 2 * args.agents
    learning_steps = -(-args.timesteps // rollout) * rollout
    seconds, timesteps = (0.0, learning_steps) if args.learning else (args.seconds, 10**9)
    if args.learning:
        runs = []
        with tempfile.TemporaryDirectory() as tmp:
            for seed in range(args.seeds):
                runs.append([run_mode(m, 0.0, timesteps, Path(tmp), args.agents, seed) for m in ("barrier", "hold")])
        Path(args.out).write_text(json.dumps(runs, indent=2))
        print(render_learning(runs))
        return
    with tempfile.TemporaryDirectory() as tmp:
        results = [run_mode(mode, seconds, timesteps, Path(tmp), args.agents) for mode in ("barrier", "hold")]
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(render(results, learning=False))


def render_learning(runs: list[list[dict[str, Any]]]) -> str:
    import numpy as np

    lines = [
        f"| policy | own steps | reward, strict (mean ± sd of {len(runs)} seeds) | reward, hold | "
        "hold - strict per seed | mean frames (hold) |",
        "|---|---|---|---|---|---|",
    ]
    for p in (SLOW["policy"], FAST["policy"]):
        strict = np.array([run[0][p]["reward_end"] for run in runs])
        hold = np.array([run[1][p]["reward_end"] for run in runs])
        diffs = ", ".join(f"{d:+.3f}" for d in hold - strict)
        frames = np.mean([run[1][p]["mean_frames"] for run in runs])
        lines.append(
            f"| {p} | {runs[0][1][p]['env_steps']} | {strict.mean():.3f} ± {strict.std():.3f} | "
            f"{hold.mean():.3f} ± {hold.std():.3f} | {diffs} | {frames:.2f} |"
        )
    return "\n".join(lines)


def render(results: list[dict[str, Any]], learning: bool) -> str:
    strict, hold = results
    lines = []
    if learning:
        lines += [
            "| policy | own steps | reward (strict) | reward (hold) | mean frames (hold) |",
            "|---|---|---|---|---|",
        ]
        for p in (SLOW["policy"], FAST["policy"]):
            lines.append(
                f"| {p} | {hold[p]['env_steps']} | {strict[p]['reward_end']:.3f} | "
                f"{hold[p]['reward_end']:.3f} | {hold[p]['mean_frames']:.2f} |"
            )
        return "\n".join(lines)
    lines += ["| per game | strict (barrier) | hold | hold / strict |", "|---|---|---|---|"]
    lines.append(
        f"| game ticks/s | {strict['game_ticks_per_s']:.0f} | {hold['game_ticks_per_s']:.0f} | "
        f"{hold['game_ticks_per_s'] / strict['game_ticks_per_s']:.2f}x |"
    )
    for p, label in ((SLOW["policy"], "slow PPO"), (FAST["policy"], "fast PPO")):
        s, h = strict[p]["samples_per_s"], hold[p]["samples_per_s"]
        lines.append(f"| {p} ({label}) samples/s | {s:.0f} | {h:.0f} | {h / s:.2f}x |")
    for p in (SLOW["policy"], FAST["policy"]):
        lines.append(
            f"| {p} held fraction / longest transition (ticks) | {strict[p]['held_fraction']:.1%} / "
            f"{strict[p]['longest_hold']} | {hold[p]['held_fraction']:.1%} / {hold[p]['longest_hold']} | |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
