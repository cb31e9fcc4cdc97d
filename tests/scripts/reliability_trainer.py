"""A trainer process for the reliability tests, on one BrokerVecEnv:

* ``--mode ppo``: SB3 PPO for ``--timesteps`` agent steps, saving a checkpoint (atomically) at the end of
  every rollout; ``--resume CKPT`` continues from one (``PPO.load``), as a restarted trainer would.
* ``--mode random``: random actions until ``--steps`` steps (0: until SIGTERM/SIGINT).
* ``--mode tagged``: against ``reliability_game --kind tagged``: answers each row with the actions derived
  from its tags and checks that every row's tick advances by exactly the frames it spanned (nothing lost,
  nothing duplicated), until ``--seconds`` have passed.

Every mode records what SB3 saw at episode ends caused by faults: rows truncated because their game was
replaced (``game_replaced``) and steps interrupted by a lost broker (``broker_reconnected``). The JSON
report (``--report``) is rewritten twice a second and at the end. Exit codes: 0 done or stopped by a
signal, 3 after a BrokerError (its code and message are in the report).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np

from broker.protocol.messages import StepOptions
from clients.errors import BrokerError
from clients.transport import BrokerGoneError
from clients.vec_env import BrokerVecEnv
from tests.scripts.reliability_common import write_report
from tests.scripts.reliability_game import tagged_actions


class Recorder:
    """Counts steps and checks the infos of fault-caused episode ends; writes the report."""

    def __init__(self, path: str, env: BrokerVecEnv, extra: dict[str, Any]) -> None:
        self.path = path
        self.env = env
        self.report: dict[str, Any] = {
            "policy": env.policy,
            "n_envs": env.num_envs,
            "steps": 0,
            "replaced_rows": 0,
            "replaced_steps": 0,
            "reconnect_steps": 0,
            "problems": [],
            "error": None,
            "end": None,
            **extra,
        }
        self.last_write = 0.0
        self.last_step = 0.0

    def problem(self, text: str) -> None:
        if len(self.report["problems"]) < 20:
            self.report["problems"].append(text)

    def step(self, dones: np.ndarray, infos: list[dict[str, Any]]) -> None:
        r = self.report
        r["steps"] += 1
        replaced = [i for i, info in enumerate(infos) if info.get("game_replaced")]
        if replaced:
            r["replaced_steps"] += 1
            r["replaced_rows"] += len(replaced)
            for i in replaced:
                if not (dones[i] and infos[i].get("TimeLimit.truncated") and "terminal_observation" in infos[i]):
                    self.problem(f"step {r['steps']}: replaced row {i} not ended truncated: {sorted(infos[i])}")
        if any(info.get("broker_reconnected") for info in infos):
            r["reconnect_steps"] += 1
            if not all(
                d
                and info.get("broker_reconnected")
                and info.get("TimeLimit.truncated")
                and "terminal_observation" in info
                for d, info in zip(dones, infos, strict=True)
            ):
                self.problem(f"step {r['steps']}: a reconnect step did not end every env truncated")
        r["reconnects"] = self.env.reconnects
        now = time.monotonic()
        if self.last_step:  # the longest wait between two steps: what a stall of the broker costs us
            r["longest_gap_s"] = max(r.get("longest_gap_s", 0.0), now - self.last_step)
        self.last_step = now
        if now - self.last_write > 0.5:
            self.last_write = now
            self.write()

    def write(self) -> None:
        self.report["reconnects"] = self.env.reconnects
        write_report(self.path, self.report)


class TagChecker:
    """Rows of the tagged game: identity and tick continuity (ticks advance by the frames spanned)."""

    def __init__(self, env: BrokerVecEnv, recorder: Recorder) -> None:
        self.env = env
        self.recorder = recorder
        self.prev_tick: np.ndarray | None = None
        self.lost = self.duplicated = 0

    def observe(self, obs: np.ndarray, dones: np.ndarray | None, infos: list[dict[str, Any]] | None) -> None:
        tick = obs[:, 2].astype(np.int64)
        if infos is not None and any(info.get("broker_reconnected") for info in infos):
            self.prev_tick = tick  # a new session: continuity starts over
            return
        game = np.asarray(self.env.get_attr("game_index"))
        agent = np.asarray(self.env.get_attr("agent_index"))
        if not (np.array_equal(obs[:, 0], game) and np.array_equal(obs[:, 1], agent)):
            self.recorder.problem(f"step {self.recorder.report['steps']}: rows from the wrong game or agent")
        if self.prev_tick is not None and infos is not None:
            frames = np.array([info.get("frames", 1) for info in infos], np.int64)
            replaced = np.array([bool(info.get("game_replaced")) for info in infos])
            advance = tick - self.prev_tick
            ok = replaced | (advance == frames)
            self.lost += int(np.sum(~ok & (advance > frames)))
            self.duplicated += int(np.sum(~ok & (advance < frames)))
            if not ok.all():
                self.recorder.problem(f"step {self.recorder.report['steps']}: tick advance {advance[~ok][:5]}")
            assert dones is not None
            for row in np.flatnonzero(dones & ~replaced).tolist():
                final = infos[row]["terminal_observation"]["obs"]
                if final[2] != tick[row] or final[1] != obs[row, 1]:
                    self.recorder.problem(f"row {row}: terminal observation {final.tolist()} at tick {tick[row]}")
        self.prev_tick = tick
        self.recorder.report.update(lost=self.lost, duplicated=self.duplicated)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def random_actions(env: BrokerVecEnv, rng: np.random.Generator) -> np.ndarray:
    from gymnasium import spaces

    space = env.action_space
    if isinstance(space, spaces.Discrete):
        return rng.integers(0, int(space.n), env.num_envs)
    if isinstance(space, spaces.MultiDiscrete):
        return rng.integers(0, space.nvec, (env.num_envs, len(space.nvec)))
    assert isinstance(space, spaces.Box)
    return rng.uniform(space.low, space.high, (env.num_envs, *space.shape)).astype(np.float32)


def run_loop(env: BrokerVecEnv, recorder: Recorder, args: argparse.Namespace) -> None:
    rng = np.random.default_rng(args.seed)
    checker = TagChecker(env, recorder) if args.mode == "tagged" else None
    obs = env.reset()
    assert isinstance(obs, dict)
    if checker is not None:
        checker.observe(obs["obs"], None, None)
    deadline = time.monotonic() + args.seconds if args.seconds else None
    limit = args.steps
    while (not limit or recorder.report["steps"] < limit) and (deadline is None or time.monotonic() < deadline):
        if args.stop_file and not limit and os.path.exists(args.stop_file):
            # Lock-step peers stop after the same number of steps, so the games' counts can be compared.
            limit = int(Path(args.stop_file).read_text())
            if recorder.report["steps"] > limit:
                recorder.problem(f"stop file asks for {limit} steps, already at {recorder.report['steps']}")
            continue
        if checker is not None:
            rows = obs["obs"]
            actions = tagged_actions(env.policy, rows[:, 2].astype(np.int64), rows[:, 1].astype(np.int64))
        else:
            actions = random_actions(env, rng)
        obs, _, dones, infos = env.step(actions)
        assert isinstance(obs, dict)
        recorder.step(dones, infos)
        if checker is not None:
            checker.observe(obs["obs"], dones, infos)


def run_ppo(env: BrokerVecEnv, recorder: Recorder, args: argparse.Namespace) -> None:
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.vec_env import VecMonitor

    torch.set_num_threads(1)
    venv = VecMonitor(env)
    if args.resume:
        model = PPO.load(args.resume, env=venv, device="cpu")
        recorder.report["start_timesteps"] = int(model.num_timesteps)
    else:
        model = PPO("MultiInputPolicy", venv, n_steps=16, batch_size=64, n_epochs=2, seed=args.seed, device="cpu")
        recorder.report["start_timesteps"] = 0

    class Record(BaseCallback):
        def _on_step(self) -> bool:
            recorder.report["num_timesteps"] = int(self.num_timesteps)
            recorder.step(self.locals["dones"], self.locals["infos"])
            return True

        def _on_rollout_end(self) -> None:
            if args.checkpoint:  # written whole, then renamed: a kill never leaves half a checkpoint
                tmp = Path(f"{args.checkpoint}.tmp.zip")
                self.model.save(tmp)
                os.replace(tmp, args.checkpoint)
                recorder.report["checkpoint_timesteps"] = int(self.num_timesteps)

    model.learn(total_timesteps=args.timesteps, callback=Record(), reset_num_timesteps=not args.resume)
    recorder.report["num_timesteps"] = int(model.num_timesteps)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", required=True)
    parser.add_argument("--policy", required=True)
    parser.add_argument("--mode", choices=("ppo", "random", "tagged"), default="random")
    parser.add_argument("--report", required=True)
    parser.add_argument("--timesteps", type=int, default=2048, help="ppo: agent steps to learn")
    parser.add_argument("--steps", type=int, default=0, help="random/tagged: VecEnv steps (0: no limit)")
    parser.add_argument("--seconds", type=float, default=0.0, help="random/tagged: stop after this long (0: no limit)")
    parser.add_argument("--stop-file", default=None, help="random/tagged: once it exists, stop after its N steps")
    parser.add_argument("--checkpoint", default=None, help="ppo: save here at every rollout end")
    parser.add_argument("--resume", default=None, help="ppo: continue from this checkpoint")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stepping", choices=("hold", "barrier"), default=None)
    parser.add_argument("--timeout-reconnect", type=float, default=60.0)
    parser.add_argument("--reconnect-on-shutdown", action="store_true")
    parser.add_argument("--token", default=None)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, _interrupt)

    stepping = StepOptions(args.stepping) if args.stepping else None
    try:
        env = BrokerVecEnv(
            args.policy,
            args.address,
            token=args.token,
            stepping=stepping,
            timeout_reconnect=args.timeout_reconnect,
            reconnect_on_shutdown=args.reconnect_on_shutdown,
        )
    except BrokerError as exc:
        write_report(args.report, {"error": exc.code, "message": exc.message, "end": "refused"})
        print(f"reliability_trainer: {exc}", file=sys.stderr, flush=True)
        return 3
    recorder = Recorder(args.report, env, {"mode": args.mode, "started": time.time()})
    code = 0
    try:
        if args.mode == "ppo":
            run_ppo(env, recorder, args)
        else:
            run_loop(env, recorder, args)
        recorder.report["end"] = "done"
    except KeyboardInterrupt:
        recorder.report["end"] = "signal"
    except BrokerError as exc:
        recorder.report.update(end="error", error=exc.code, message=exc.message, gone=isinstance(exc, BrokerGoneError))
        print(f"reliability_trainer: {exc}", file=sys.stderr, flush=True)
        code = 3
    finally:
        env.close()
        recorder.write()
    return code


if __name__ == "__main__":
    sys.exit(main())
