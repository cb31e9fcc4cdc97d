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
  policies of a mode in the same games, ``EVAL_EPISODES_PER_AGENT`` whole episodes per agent, each agent's
  start states from its own random stream (every model meets the same start states).

It also records, per trainer, what happened around each PPO update (seconds, game ticks meanwhile, and the
first transition after it). ``--modes barrier,hold,hold-fresh`` adds the trainer-side fix that gdrl-train applies by
default (``clients.callbacks.FreshStartCallback``): after an update the trainer starts its rollout from the
newest observation instead of the one from before the update. Plain ``hold`` is SB3 without it.

    python -m benchmarks.hold_vs_strict --seconds 40
    python -m benchmarks.hold_vs_strict --learning --seeds 30 --out hold_learning.json
    python -m benchmarks.hold_vs_strict --render hold_learning.json
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
    """One trainer process: PPO on a BrokerVecEnv in the given stepping mode ("hold-fresh": hold, with the
    library's FreshStartCallback, as gdrl-train uses it), for a time or step budget; writes a JSON report and,
    with --save, the model."""
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
    parser.add_argument("--diagnose", action="store_true", help="count the game ticks during each update")
    args = parser.parse_args(argv)

    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.vec_env import VecMonitor

    from broker.protocol.messages import StepOptions
    from clients.callbacks import FreshStartCallback
    from clients.vec_env import BrokerVecEnv

    torch.set_num_threads(1)
    stepping, _, variant = args.mode.partition("-")  # "hold-fresh": hold stepping, FreshStartCallback
    env = BrokerVecEnv(args.policy, args.address, stepping=StepOptions(stepping), name=f"bench-{args.policy}")
    fresh = FreshStartCallback() if variant == "fresh" else None
    returns: list[float] = []
    touched: list[bool] = []  # per episode in ``returns``: some of its ticks ran on held actions in an update
    histogram = np.zeros(FRAMES_HISTOGRAM + 1, np.int64)  # transitions by game ticks spanned
    after_update = HoldDiagnostics()
    started = time.monotonic()

    def game_ticks() -> float:
        from clients.status import fetch_status

        games = fetch_status(args.address)["games"]
        return float(np.mean([g["ticks"] for g in games]))

    class Budget(BaseCallback):
        rollout_ended: tuple[float, float] | None = None  # (time, game ticks) when the last rollout ended
        first_of_rollout = False
        in_touched = np.zeros(env.num_envs, np.bool_)  # rows whose current episode ran on held actions
        fresh_starts_seen = 0
        recorded_not_applied = 0  # transitions PPO trains on whose action was never applied

        def _on_rollout_start(self) -> None:
            self.first_of_rollout = self.rollout_ended is not None  # the first step after an update
            if self.rollout_ended is not None:
                ended_at, ticks_then = self.rollout_ended
                after_update.start(time.monotonic() - ended_at, game_ticks() - ticks_then if args.diagnose else None)
                if fresh is not None and fresh.fresh_starts > self.fresh_starts_seen:
                    self.fresh_starts_seen = fresh.fresh_starts
                    assert fresh.last_refresh is not None
                    _, rewards, dones, infos = fresh.last_refresh  # the unrecorded step: episodes ended in it
                    self.observe(infos, np.asarray(dones, np.bool_), rewards, recorded=False)

        def _on_rollout_end(self) -> None:  # a status request per rollout: only when asked for
            self.rollout_ended = (time.monotonic(), game_ticks() if args.diagnose else 0.0)

        def observe(self, infos: list[dict[str, Any]], dones: np.ndarray, rewards: np.ndarray, recorded: bool) -> None:
            frames = np.array([info.get("frames", 1) for info in infos], np.int64)
            if recorded:  # transitions PPO trains on
                histogram[:] += np.bincount(np.minimum(frames, FRAMES_HISTOGRAM), minlength=FRAMES_HISTOGRAM + 1)
            not_applied = np.array([info.get("action_applied") is False for info in infos], np.bool_)
            if recorded:
                self.recorded_not_applied += int(not_applied.sum())
            if self.first_of_rollout:
                after_update.add(frames, dones, rewards, not_applied)
                self.in_touched |= frames > 1  # these episodes ran on held actions (ended now or go on)
                self.first_of_rollout = False
            for row, info in enumerate(infos):
                if "episode" in info:
                    returns.append(float(info["episode"]["r"]))
                    touched.append(bool(self.in_touched[row]))
            # The next episode of a row whose action came too late began on held actions too.
            self.in_touched = np.where(dones, not_applied, self.in_touched)

        def _on_step(self) -> bool:
            dones = np.asarray(self.locals["dones"], np.bool_)
            self.observe(self.locals["infos"], dones, self.locals["rewards"], recorded=True)
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
    budget = Budget()
    callbacks: list[BaseCallback] = [budget]
    if fresh is not None:
        callbacks.insert(0, fresh)  # first: the budget callback reads the step it adds
    model.learn(total_timesteps=args.timesteps, callback=callbacks)
    elapsed = time.monotonic() - started
    if args.save:
        model.save(args.save)
    transitions = int(histogram.sum())
    last = np.array(returns[-200:])
    last_touched = np.array(touched[-200:], np.bool_)
    report = {
        "policy": args.policy,
        "mode": args.mode,
        "env_steps": int(model.num_timesteps),
        "seconds": elapsed,
        "samples_per_s": model.num_timesteps / elapsed,
        "episodes": len(returns),
        "reward_end": float(last.mean()) if returns else None,
        "reward_end_touched_fraction": float(last_touched.mean()) if returns else None,
        "reward_end_untouched": float(last[~last_touched].mean()) if (~last_touched).any() else None,
        "reward_end_touched": float(last[last_touched].mean()) if last_touched.any() else None,
        "episodes_touched": int(sum(touched)),
        "mean_frames": float(histogram @ np.arange(FRAMES_HISTOGRAM + 1) / max(transitions, 1)),
        "max_frames": int(np.flatnonzero(histogram).max(initial=1)),
        "frames_histogram": {str(f): int(n) for f, n in enumerate(histogram) if n},
        "recorded_not_applied": budget.recorded_not_applied,
        "after_update": after_update.summary(),
    }
    Path(args.report).write_text(json.dumps(report))
    env.close()


class HoldDiagnostics:
    """Each PPO update, and the first transition after it (its action was chosen from the observation of
    before the update): the update's seconds, the game ticks that ran meanwhile (held, in hold mode), the
    fraction of agents whose episode ended meanwhile (their new action is then not applied: the next episode
    starts on held actions too), the ticks those ended transitions spanned, and the rewards they carried."""

    def __init__(self) -> None:
        self.update_seconds: list[float] = []
        self.update_ticks: list[float] = []  # game ticks (mean over games) while the trainer updated
        self.done_fraction: list[float] = []
        self.not_applied_fraction: list[float] = []
        self.frames_done: list[float] = []  # mean ticks spanned by the transitions that ended an episode
        self.frames_open: list[float] = []  # mean ticks spanned by the others
        self.reward_done: list[float] = []
        self.reward_open: list[float] = []

    def start(self, seconds: float, ticks: float | None) -> None:
        self.update_seconds.append(seconds)
        if ticks is not None:
            self.update_ticks.append(ticks)

    def add(self, frames: np.ndarray, dones: np.ndarray, rewards: np.ndarray, not_applied: np.ndarray) -> None:
        self.done_fraction.append(float(dones.mean()))
        self.not_applied_fraction.append(float(not_applied.mean()))
        for rows, spans, reward in (
            (dones, self.frames_done, self.reward_done),
            (~dones, self.frames_open, self.reward_open),
        ):
            if rows.any():
                spans.append(float(frames[rows].mean()))
                reward.append(float(np.mean(rewards[rows])))

    def summary(self) -> dict[str, Any]:
        def mean(values: list[float]) -> float | None:
            return float(np.mean(values)) if values else None

        return {
            "updates": len(self.update_seconds),
            "update_seconds_mean": mean(self.update_seconds),
            "update_ticks_mean": mean(self.update_ticks),
            "update_ticks": [round(t, 1) for t in self.update_ticks],
            "first_step_done_fraction": mean(self.done_fraction),
            "first_step_not_applied_fraction": mean(self.not_applied_fraction),
            "first_step_frames_done": mean(self.frames_done),
            "first_step_frames_open": mean(self.frames_open),
            "first_step_reward_done": mean(self.reward_done),
            "first_step_reward_open": mean(self.reward_open),
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
    from clients.game import GameClient

    game = evaluation_game(agents, agents, seed)
    client = GameClient(address, game.group_specs(), name=name, timeout_reconnect=0)
    try:
        client.play(game.first_step(), game.apply)
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
    with InProcessBroker(
        expected_games=len(game_seeds), stepping="barrier", status_interval=0, local_trainers=len(POLICIES)
    ) as broker:
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
    stepping = mode.partition("-")[0]
    with broker_process(workdir, "--games", "2", "--stepping", stepping, "--status-interval", "0") as (_, address):
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
                    *(() if seconds else ("--diagnose",)),
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
    from clients.status import fetch_status

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
    parser.add_argument(
        "--resume",
        action="store_true",
        help="learning run: keep the seeds in --out, run the rest up to --seeds",
    )
    parser.add_argument(
        "--modes",
        default="barrier,hold",
        help="learning run: stepping modes, the first is the reference (hold-fresh: hold, and the trainer "
        "starts each rollout from the newest observation with clients.callbacks.FreshStartCallback)",
    )
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
    print(render(results))


def run_learning(args: argparse.Namespace, timesteps: int, workroot: Path) -> dict[str, Any]:
    """Per seed: train in each mode, then evaluate every trained model in the common setting. The JSON is
    rewritten after every seed, so an interrupted run keeps the seeds it finished."""
    import torch

    from broker.log import configure_logging

    configure_logging(level="warning")  # the evaluation's in-process broker: no info lines between the results
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
    if args.resume and Path(args.out).exists():
        done = json.loads(Path(args.out).read_text())
        settings = {k: v for k, v in result.items() if k != "runs"}
        same_modes = all([m["mode"] for m in run] == args.modes.split(",") for run in done["runs"])
        if {k: v for k, v in done.items() if k != "runs"} != settings or not same_modes:
            raise SystemExit(f"--resume: {args.out} was made with other settings")
        result["runs"] = done["runs"]
    for seed in range(len(result["runs"]), args.seeds):
        workdir = workroot / f"seed-{seed}"
        workdir.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        modes = [run_mode(mode, 0.0, timesteps, workdir, args.agents, seed) for mode in args.modes.split(",")]
        for run in modes:
            run["seed"] = seed
            models = {policy: workdir / f"{run['mode']}-{policy}.zip" for policy in POLICIES}
            evaluation = evaluate_models(models, args.agents, args.eval_episodes)
            for policy in POLICIES:
                run[policy]["eval"] = evaluation[policy]
        pair_with_reference(modes)
        result["runs"].append(modes)
        Path(args.out).write_text(json.dumps(result, indent=2))
        summary = ", ".join(
            f"{run['mode']} {p} train {run[p]['reward_end']:.3f} eval {run[p]['eval']['return_mean']:.3f}"
            for run in modes
            for p in POLICIES
        )
        print(f"seed {seed} ({time.monotonic() - started:.0f} s): {summary}", file=sys.stderr, flush=True)
    return result


def pair_with_reference(modes: list[dict[str, Any]]) -> None:
    """Each mode's evaluation against the first mode's, episode by episode over the same start states: the mean
    difference and its standard error (the evaluation noise of that seed's difference). The per-episode returns
    are dropped afterwards, to keep the JSON small."""
    for policy in POLICIES:
        reference = np.array(modes[0][policy]["eval"]["returns"])
        for run in modes:
            diffs = np.array(run[policy]["eval"]["returns"]) - reference
            run[policy]["eval"]["paired_vs_reference"] = {
                "mean": float(diffs.mean()),
                "se": float(diffs.std(ddof=1) / np.sqrt(len(diffs))),
            }
    for run in modes:
        for policy in POLICIES:
            del run[policy]["eval"]["returns"]


MODE_LABELS = {"barrier": "strict"}


def render_learning(result: dict[str, Any]) -> str:
    """Per policy: training and evaluation returns of every mode against the first (strict), over seeds; the
    evaluation noise of one seed's difference; then what happened around the slow trainer's updates."""
    runs = result["runs"]
    n = len(runs)
    episodes = result["evaluation"]["episodes_per_agent"] * result["games"] * result["agents"]
    modes = [MODE_LABELS.get(run["mode"], run["mode"]) for run in runs[0]]
    reference = modes[0]

    def sd(values: np.ndarray) -> float:
        return float(values.std(ddof=1)) if len(values) > 1 else 0.0

    lines = []
    for index, mode in enumerate(modes[1:], start=1):
        lines += [
            f"| policy | return | {reference} (mean ± sd, {n} seeds) | {mode} | {mode} - {reference} (mean ± se) | "
            f"{mode} - {reference} per seed |",
            "|---|---|---|---|---|---|",
        ]
        for p in POLICIES:
            for label, value in (
                ("training, last 200 episodes", lambda r: r["reward_end"]),
                (f"evaluation, {episodes} episodes", lambda r: r["eval"]["return_mean"]),
            ):
                base = np.array([value(run[0][p]) for run in runs])
                other = np.array([value(run[index][p]) for run in runs])
                diffs = other - base
                lines.append(
                    f"| {p} | {label} | {base.mean():.3f} ± {sd(base):.3f} | {other.mean():.3f} ± {sd(other):.3f} | "
                    f"{diffs.mean():+.3f} ± {sd(diffs) / np.sqrt(n):.3f} | {', '.join(f'{d:+.3f}' for d in diffs)} |"
                )
        noise = [
            f"{p} ±{np.mean([run[index][p]['eval']['paired_vs_reference']['se'] for run in runs]):.3f}"
            for p in POLICIES
        ]
        lines += [
            "",
            f"Evaluation noise of one seed's {mode} - {reference} difference (standard error, paired over the same "
            f"{episodes} start states): {', '.join(noise)}.",
            "",
        ]

    def avg(values: list[Any]) -> float:
        present = [v for v in values if v is not None]
        return float(np.mean(present)) if present else float("nan")

    lines += [
        "| policy | mode | eval: goal reached | eval: ticks per episode | training: mean frames (recorded) | "
        "update: seconds / game ticks meanwhile | first step after an update (hold-fresh: the unrecorded "
        "refresh step): episode ended / action not applied / ticks spanned / reward |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in POLICIES:
        for index, mode in enumerate(modes):
            reports = [run[index][p] for run in runs]
            update = [r["after_update"] for r in reports if r["after_update"]["updates"]]  # seeds that measured it
            spans, rewards = [], []
            for u in update:
                ended = u["first_step_done_fraction"]
                spans.append(
                    (u["first_step_frames_done"] or 0.0) * ended + (u["first_step_frames_open"] or 0.0) * (1 - ended)
                )
                rewards.append(
                    (u["first_step_reward_done"] or 0.0) * ended + (u["first_step_reward_open"] or 0.0) * (1 - ended)
                )
            measured = "" if len(update) == n else f" ({len(update)} seeds)"
            lines.append(
                f"| {p} | {mode} | {avg([r['eval']['goal_fraction'] for r in reports]):.1%} | "
                f"{avg([r['eval']['length_mean'] for r in reports]):.2f} | "
                f"{avg([r['mean_frames'] for r in reports]):.3f} | "
                f"{avg([u['update_seconds_mean'] for u in update]):.2f} / "
                f"{avg([u['update_ticks_mean'] for u in update]):.0f}{measured} | "
                f"{avg([u['first_step_done_fraction'] for u in update]):.0%} / "
                f"{avg([u['first_step_not_applied_fraction'] for u in update]):.0%} / "
                f"{avg(spans):.1f} / {avg(rewards):+.2f}{measured} |"
            )
    return "\n".join(lines)


def render(results: list[dict[str, Any]]) -> str:
    """The throughput table (learning runs: ``render_learning``)."""
    strict, hold = results
    lines = ["| per game | strict (barrier) | hold | hold / strict |", "|---|---|---|---|"]
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
