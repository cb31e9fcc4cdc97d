"""Hold-and-accumulate against strict lock-step, in one run (issue: trainers never stall each other).

Two simulated games, two policies, two trainer processes:

* ``mover`` is trained by a slow PPO (large ``n_steps`` and many epochs: long updates);
* ``picker`` is trained by a fast PPO (short rollouts, one epoch).

For each stepping mode the same setup runs for the same wall time; the table compares game ticks/s and
each policy's samples/s. ``--learning`` instead trains both policies for the same number of their own
steps in each mode, per seed, and compares

* the training return: mean return of the last 200 training episodes. In hold mode these include the ticks
  that ran on held actions while a trainer updated (decisions the policy did not make), so it is not a fair
  measure of what was learned;
* the evaluation return: every trained model afterwards in one common setting, strict ``barrier`` stepping
  (no holds), deterministic actions, fresh games with fixed evaluation seeds (not the training seeds), both
  policies of a mode in the same games, ``EVAL_EPISODES_PER_AGENT`` whole episodes per agent.

    python -m benchmarks.hold_vs_strict --seconds 40
    python -m benchmarks.hold_vs_strict --learning --seeds 5 --out hold_learning.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

SLOW: dict[str, Any] = {"policy": "mover", "n_steps": 512, "n_epochs": 10, "batch_size": 256}
FAST: dict[str, Any] = {"policy": "picker", "n_steps": 16, "n_epochs": 1, "batch_size": 64}
POLICIES = (SLOW["policy"], FAST["policy"])

# Evaluation: game seeds the training never uses (training games are seeded 100 * seed + game index).
EVAL_GAME_SEEDS = (10_000, 10_001)
EVAL_EPISODES_PER_AGENT = 128  # 2 games x 8 agents per group: 2048 episodes per policy and model
FRAMES_HISTOGRAM = 64  # frames per transition counted exactly up to this, the rest in the last bin

Actor = Callable[[dict[str, np.ndarray]], np.ndarray]  # observations of every env -> actions of every env


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
    parser.add_argument("--save", default=None, help="save the trained model here (.zip)")
    args = parser.parse_args(argv)

    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.vec_env import VecMonitor

    from broker.protocol.messages import StepOptions
    from clients.vec_env import BrokerVecEnv

    torch.set_num_threads(1)
    env = BrokerVecEnv(args.policy, args.address, stepping=StepOptions(args.mode), name=f"bench-{args.policy}")
    returns: list[float] = []
    histogram = np.zeros(FRAMES_HISTOGRAM + 1, np.int64)  # transitions by game ticks spanned
    after_update = HoldDiagnostics()
    started = time.monotonic()

    class Budget(BaseCallback):
        rollout_ended: float | None = None
        first_of_rollout = False

        def _on_rollout_start(self) -> None:
            self.first_of_rollout = self.rollout_ended is not None  # the first step after an update
            self.update_started = self.rollout_ended

        def _on_rollout_end(self) -> None:
            self.rollout_ended = time.monotonic()

        def _on_step(self) -> bool:
            infos = self.locals["infos"]
            for info in infos:
                if "episode" in info:
                    returns.append(float(info["episode"]["r"]))
            frames = np.array([info.get("frames", 1) for info in infos], np.int64)
            histogram[:] += np.bincount(np.minimum(frames, FRAMES_HISTOGRAM), minlength=FRAMES_HISTOGRAM + 1)
            if self.first_of_rollout:
                assert self.update_started is not None
                after_update.add(frames, self.locals["dones"], self.locals["rewards"], infos, self.update_started)
                self.first_of_rollout = False
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
    if args.save:
        model.save(args.save)
    transitions = int(histogram.sum())
    report = {
        "policy": args.policy,
        "mode": args.mode,
        "env_steps": int(model.num_timesteps),
        "seconds": elapsed,
        "samples_per_s": model.num_timesteps / elapsed,
        "episodes": len(returns),
        "reward_end": float(np.mean(returns[-200:])) if returns else None,
        "mean_frames": float(histogram @ np.arange(FRAMES_HISTOGRAM + 1) / max(transitions, 1)),
        "max_frames": int(np.flatnonzero(histogram).max(initial=1)),
        "frames_histogram": {str(f): int(n) for f, n in enumerate(histogram) if n},
        "after_update": after_update.summary(),
    }
    Path(args.report).write_text(json.dumps(report))
    env.close()


class HoldDiagnostics:
    """What the first transition of each rollout (the one whose action was chosen before a PPO update and
    applied after it) looked like: how long the update took, how many game ticks it spanned, how many
    agents' episodes ended meanwhile (their action was then not applied), and its reward."""

    def __init__(self) -> None:
        self.update_seconds: list[float] = []
        self.held_ticks: list[int] = []  # per update: ticks of the longest open transition, minus the applied one
        self.ended_fraction: list[float] = []
        self.not_applied_fraction: list[float] = []
        self.reward_open: list[float] = []  # mean reward of the rows whose episode went on
        self.reward_ended: list[float] = []  # mean reward of the rows whose episode ended during the hold

    def add(
        self,
        frames: np.ndarray,
        dones: np.ndarray,
        rewards: np.ndarray,
        infos: list[dict[str, Any]],
        update_started: float,
    ) -> None:
        self.update_seconds.append(time.monotonic() - update_started)
        dones = np.asarray(dones, np.bool_)
        open_rows = ~dones
        self.held_ticks.append(int(frames[open_rows].max()) - 1 if open_rows.any() else -1)
        self.ended_fraction.append(float(dones.mean()))
        self.not_applied_fraction.append(float(np.mean([info.get("action_applied") is False for info in infos])))
        if open_rows.any():
            self.reward_open.append(float(np.mean(rewards[open_rows])))
        if dones.any():
            self.reward_ended.append(float(np.mean(rewards[dones])))

    def summary(self) -> dict[str, Any]:
        def mean(values: list[float] | list[int]) -> float | None:
            return float(np.mean(values)) if values else None

        return {
            "updates": len(self.update_seconds),
            "update_seconds_mean": mean(self.update_seconds),
            "held_ticks": self.held_ticks,
            "held_ticks_mean": mean([t for t in self.held_ticks if t >= 0]),
            "ended_during_hold_fraction": mean(self.ended_fraction),
            "action_not_applied_fraction": mean(self.not_applied_fraction),
            "reward_open_rows": mean(self.reward_open),
            "reward_ended_rows": mean(self.reward_ended),
        }


# --- evaluation -----------------------------------------------------------------------------------


def evaluate_policies(
    envs: dict[str, Any], actors: dict[str, Actor], episodes_per_agent: int, max_ticks: int = 100_000
) -> dict[str, dict[str, Any]]:
    """Step every policy's VecEnv together (so barrier stepping works), each with its actor, until every
    agent has finished ``episodes_per_agent`` episodes. Only each agent's first that many episodes count:
    counting every episode that ends within some number of ticks would over-represent short episodes.

    Per policy: episodes, mean and sd of their returns, standard error of the mean, mean length in ticks,
    the fraction that ended terminated (goal reached), game ticks stepped, held transitions seen
    (transitions that spanned more than one tick; 0 when the broker steps strictly), and the counted returns
    ordered by env row, then episode (so two evaluations in the same games can be compared episode by episode).
    """
    returns = {p: np.zeros(env.num_envs) for p, env in envs.items()}
    lengths = {p: np.zeros(env.num_envs, np.int64) for p, env in envs.items()}
    counted = {p: np.zeros(env.num_envs, np.int64) for p, env in envs.items()}
    episodes: dict[str, list[tuple[float, int, bool]]] = {p: [] for p in envs}
    by_agent = {p: np.zeros((env.num_envs, episodes_per_agent)) for p, env in envs.items()}
    held = dict.fromkeys(envs, 0)
    obs = {p: env.reset() for p, env in envs.items()}
    ticks = 0
    while any((counted[p] < episodes_per_agent).any() for p in envs):
        if ticks >= max_ticks:
            raise RuntimeError(f"evaluation: {max_ticks} ticks and still {counted} episodes per agent")
        for p, env in envs.items():
            env.step_async(actors[p](obs[p]))
        for p, env in envs.items():
            obs[p], reward, done, infos = env.step_wait()
            held[p] += sum(1 for info in infos if info.get("frames", 1) > 1)
            returns[p] += reward
            lengths[p] += 1
            for row in np.flatnonzero(done).tolist():
                if counted[p][row] < episodes_per_agent:
                    goal = not infos[row].get("TimeLimit.truncated", False)
                    episodes[p].append((float(returns[p][row]), int(lengths[p][row]), goal))
                    by_agent[p][row, counted[p][row]] = returns[p][row]
                    counted[p][row] += 1
                returns[p][row] = 0.0
                lengths[p][row] = 0
        ticks += 1
    result = {}
    for p, finished in episodes.items():
        values = np.array([r for r, _, _ in finished])
        result[p] = {
            "episodes": len(finished),
            "return_mean": float(values.mean()),
            "return_sd": float(values.std(ddof=1)) if len(values) > 1 else 0.0,
            "return_sem": float(values.std(ddof=1) / np.sqrt(len(values))) if len(values) > 1 else 0.0,
            "length_mean": float(np.mean([n for _, n, _ in finished])),
            "goal_fraction": float(np.mean([g for _, _, g in finished])),
            "ticks": ticks,
            "held_transitions": held[p],
            "returns": [round(float(r), 5) for r in by_agent[p].ravel()],  # agent by agent, episodes in order
        }
    return result


def evaluation_game(n_movers: int, n_pickers: int, seed: int) -> Any:
    """The simulated game with one change for evaluation: each agent draws its start states from its own random
    stream, so agent i's k-th episode starts from the same state whichever policy is evaluated (the game's
    shared stream would hand out start states in the order other agents' episodes happen to end). Same
    dynamics, rewards and start-state distribution; every evaluated model meets the same episodes."""
    from clients.sim_game import CORRIDOR, SimGame

    class EvaluationSimGame(SimGame):
        def __init__(self) -> None:
            streams = np.random.SeedSequence(seed).spawn(n_movers + n_pickers)
            self.mover_rngs = [np.random.default_rng(s) for s in streams[:n_movers]]
            self.picker_rngs = [np.random.default_rng(s) for s in streams[n_movers:]]
            super().__init__(n_movers, n_pickers, seed)

        def _reset_movers(self, mask: np.ndarray) -> None:
            for i in np.flatnonzero(mask).tolist():
                rng = self.mover_rngs[i]
                self.pos[i] = rng.uniform(-1, 1, 2)
                self.target[i] = rng.uniform(-1, 1, 2)
            self.mover_t[mask] = 0

        def _reset_pickers(self, mask: np.ndarray) -> None:
            for i in np.flatnonzero(mask).tolist():
                rng = self.picker_rngs[i]
                self.cell[i] = rng.integers(0, CORRIDOR + 1)
                self.goal[i] = (self.cell[i] + rng.integers(1, CORRIDOR + 1)) % (CORRIDOR + 1)
            self.picker_t[mask] = 0

    return EvaluationSimGame()


def play_evaluation_game(address: str, agents: int, seed: int, name: str) -> None:
    """Play one evaluation game until the broker closes (run_sim_game's loop, with ``evaluation_game``)."""
    from clients.errors import BrokerError
    from clients.game import GameClient

    game = evaluation_game(agents, agents, seed)
    client = GameClient(address, game.group_specs(), name=name, timeout_reconnect=0)
    data = game.first_step()
    try:
        while True:
            data = game.apply(client.step(data))
    except BrokerError as exc:
        if exc.code not in ("closed", "connection_lost"):
            raise
    finally:
        client.close()


@contextmanager
def evaluation_envs(agents: int, game_seeds: tuple[int, ...] = EVAL_GAME_SEEDS) -> Iterator[dict[str, Any]]:
    """The common evaluation setting: an in-process broker with strict ``barrier`` stepping, one fresh
    evaluation game per seed (a thread each, on the broker's port) with ``agents`` agents per group, and one
    barrier VecEnv per policy. The games wait at tick 0 until both policies' envs are attached, so every
    agent's first episode is decided by the evaluated policy from its first tick."""
    from broker.protocol.messages import StepOptions
    from clients.inprocess import InProcessBroker

    envs: dict[str, Any] = {}
    with InProcessBroker(expected_games=len(game_seeds), stepping="barrier", status_interval=0) as broker:
        games = [
            threading.Thread(
                target=play_evaluation_game,
                args=(broker.address, agents, seed, f"eval-{i}"),
                name=f"eval-game-{i}",
                daemon=True,
            )
            for i, seed in enumerate(game_seeds)
        ]
        try:
            for joined, game in enumerate(games, start=1):  # one at a time: game i takes slot i, every run
                game.start()
                deadline = time.monotonic() + 30
                while broker.call(broker.server.hub.games_connected) < joined:
                    if time.monotonic() > deadline or not game.is_alive():
                        raise RuntimeError(f"evaluation game {joined - 1} did not join the broker")
                    time.sleep(0.01)
            for policy in POLICIES:
                envs[policy] = broker.vec_env(policy, name=f"eval[{policy}]", stepping=StepOptions("barrier"))
            yield envs
        finally:
            for env in envs.values():
                env.close()
    for game in games:  # the broker closed: the games end
        if game.ident is not None:
            game.join(timeout=15)


def model_actor(path: Path) -> Actor:
    """A saved SB3 PPO model acting deterministically (the mean action, clipped to the action space)."""
    from stable_baselines3 import PPO

    model = PPO.load(path, device="cpu")

    def act(obs: dict[str, np.ndarray]) -> np.ndarray:
        actions, _ = model.predict(obs, deterministic=True)
        return actions

    return act


def evaluate_models(models: dict[str, Path], agents: int, episodes_per_agent: int) -> dict[str, dict[str, Any]]:
    """Evaluate the saved models of one mode (one per policy) together, in the common evaluation setting."""
    actors = {policy: model_actor(path) for policy, path in models.items()}
    with evaluation_envs(agents) as envs:
        return evaluate_policies(envs, actors, episodes_per_agent)


def run_mode(mode: str, seconds: float, timesteps: int, workdir: Path, agents: int, seed: int = 0) -> dict[str, Any]:
    """Throughput (``seconds`` > 0): rates read from the broker's status over a window while both trainers run.
    Learning (``timesteps``): both trainers run to the same number of their own steps and save their models
    as ``workdir/{mode}-{policy}.zip``."""
    from tests.helpers import broker_process, python_env  # the same subprocess broker the tests use

    env = python_env()
    quiet: dict[str, Any] = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
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
                    "--save",
                    str(workdir / f"{mode}-{spec['policy']}.zip"),
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
    parser.add_argument(
        "--eval-episodes",
        type=int,
        default=EVAL_EPISODES_PER_AGENT,
        help="learning run: evaluation episodes per agent (x 2 games x agents per policy)",
    )
    parser.add_argument("--workdir", default=None, help="learning run: keep models, reports and logs here")
    parser.add_argument("--render", default=None, metavar="JSON", help="only render a learning run's saved JSON")
    parser.add_argument("--out", default="hold_vs_strict.json")
    args = parser.parse_args()
    if args.render:
        print(render_learning(json.loads(Path(args.render).read_text())))
        return
    # Equal own steps: a multiple of both PPO rollouts (2 games x agents envs each), so neither trainer
    # finishes early and leaves the other waiting in barrier mode.
    rollout = SLOW["n_steps"] * 2 * args.agents
    learning_steps = -(-args.timesteps // rollout) * rollout
    seconds, timesteps = (0.0, learning_steps) if args.learning else (args.seconds, 10**9)
    if args.learning:
        with tempfile.TemporaryDirectory() as tmp:
            result = run_learning(args, timesteps, Path(args.workdir or tmp))
        print(render_learning(result))
        return
    with tempfile.TemporaryDirectory() as tmp:
        results = [run_mode(mode, seconds, timesteps, Path(tmp), args.agents) for mode in ("barrier", "hold")]
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(render(results, learning=False))


def run_learning(args: argparse.Namespace, timesteps: int, workroot: Path) -> dict[str, Any]:
    """Per seed: train in each mode, then evaluate every trained model in the common setting. The JSON is
    rewritten after every seed, so an interrupted run keeps the seeds it finished."""
    import torch

    torch.set_num_threads(1)  # the evaluation's inference: the other core stays with the games and broker
    result: dict[str, Any] = {
        "timesteps": timesteps,
        "agents": args.agents,
        "games": 2,
        "slow": SLOW,
        "fast": FAST,
        "evaluation": {
            "stepping": "barrier",
            "deterministic": True,
            "game_seeds": list(EVAL_GAME_SEEDS),
            "episodes_per_agent": args.eval_episodes,
        },
        "runs": [],
    }
    for seed in range(args.seeds):
        workdir = workroot / f"seed-{seed}"
        workdir.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        modes = [run_mode(mode, 0.0, timesteps, workdir, args.agents, seed) for mode in ("barrier", "hold")]
        for run in modes:
            models = {policy: workdir / f"{run['mode']}-{policy}.zip" for policy in POLICIES}
            evaluation = evaluate_models(models, args.agents, args.eval_episodes)
            for policy in POLICIES:
                run[policy]["eval"] = evaluation[policy]
        result["runs"].append(modes)
        Path(args.out).write_text(json.dumps(result, indent=2))
        summary = ", ".join(
            f"{run['mode']} {p} train {run[p]['reward_end']:.3f} eval {run[p]['eval']['return_mean']:.3f}"
            for run in modes
            for p in POLICIES
        )
        print(f"seed {seed} ({time.monotonic() - started:.0f} s): {summary}", file=sys.stderr, flush=True)
    return result


def render_learning(result: dict[str, Any]) -> str:
    runs = result["runs"]
    n = len(runs)
    episodes = result["evaluation"]["episodes_per_agent"] * result["games"] * result["agents"]
    lines = [
        f"| policy | return | strict (mean ± sd, {n} seeds) | hold | hold - strict (mean ± se) | "
        "hold - strict per seed |",
        "|---|---|---|---|---|---|",
    ]
    for p in POLICIES:
        for label, value in (
            ("training, last 200 episodes", lambda r: r["reward_end"]),
            (f"evaluation, {episodes} episodes", lambda r: r["eval"]["return_mean"]),
        ):
            strict = np.array([value(run[0][p]) for run in runs])
            hold = np.array([value(run[1][p]) for run in runs])
            diffs = hold - strict
            se = diffs.std(ddof=1) / np.sqrt(n) if n > 1 else 0.0
            lines.append(
                f"| {p} | {label} | {strict.mean():.3f} ± {strict.std(ddof=1) if n > 1 else 0:.3f} | "
                f"{hold.mean():.3f} ± {hold.std(ddof=1) if n > 1 else 0:.3f} | {diffs.mean():+.3f} ± {se:.3f} | "
                f"{', '.join(f'{d:+.3f}' for d in diffs)} |"
            )
    lines += [
        "",
        "| policy | mode | eval goal reached | eval episode ticks | eval sem (mean) | mean frames (training) | "
        "held ticks per update | episodes ended in the hold |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in POLICIES:
        for index, mode in enumerate(("strict", "hold")):
            reports = [run[index][p] for run in runs]
            held = [r["after_update"]["held_ticks_mean"] for r in reports if r["after_update"]["held_ticks_mean"]]
            ended = [r["after_update"]["ended_during_hold_fraction"] or 0.0 for r in reports]
            lines.append(
                f"| {p} | {mode} | {np.mean([r['eval']['goal_fraction'] for r in reports]):.1%} | "
                f"{np.mean([r['eval']['length_mean'] for r in reports]):.1f} | "
                f"{np.mean([r['eval']['return_sem'] for r in reports]):.3f} | "
                f"{np.mean([r['mean_frames'] for r in reports]):.3f} | "
                f"{np.mean(held) if held else 0.0:.1f} | {np.mean(ended):.1%} |"
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
