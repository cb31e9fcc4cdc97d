"""MAgent2 battle, 225 red vs 225 blue, each team one PPO policy trained by its own ``gdrl-train`` process.

What it runs, top to bottom:

1. a broker (``python -m broker serve --stepping barrier``: lock-step), the battle env as one game
   (``python -m clients.pettingzoo_game --env magent2.environments.battle_v4:parallel_env``), and two
   trainers (``python -m clients.train --policy red`` / ``--policy blue``), all at once; the trainers
   save ``red.zip`` and ``blue.zip``;
2. evaluation without the broker: the saved SB3 models are loaded here and play the PettingZoo env
   directly (live agents only, sampled actions), in four match-ups over ``--eval-episodes`` episodes;
3. a markdown table on stdout and ``results.json`` in ``--out``.

    python examples/magent2_battle.py --out runs/magent2_battle   # default budget: about 12 min on 2 cores
    python examples/magent2_battle.py --eval-only --out runs/magent2_battle   # re-evaluate saved models

Counting: a kill is an opponent that died; survivors are counted when the episode ends (``max_cycles``
reached or one team wiped out); a team wins an episode when it has more survivors.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

ENV_FACTORY = "magent2.environments.battle_v4:parallel_env"
TEAMS = ("red", "blue")
N_ACTIONS = 21
Policy = Callable[[np.ndarray], np.ndarray]  # observations [n, 13, 13, 5] -> actions [n]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for models, logs and results (default: a temp folder)")
    parser.add_argument("--map-size", type=int, default=75, help="75: 225 agents a side")
    parser.add_argument("--max-cycles", type=int, default=300, help="ticks per episode")
    parser.add_argument(
        "--attack-penalty",
        type=float,
        default=0.0,
        help="battle_v4's reward for any attack (its default -0.1 teaches both teams never to attack within "
        "this budget; kills, survivors and wins do not depend on it)",
    )
    parser.add_argument(
        "--timesteps", type=int, default=2_880_000, help="agent steps per team (225 agents x 12,800 ticks)"
    )
    parser.add_argument("--n-steps", type=int, default=64, help="PPO rollout length per agent")
    parser.add_argument("--batch-size", type=int, default=1800, help="PPO minibatch (a factor of 225 x n-steps)")
    parser.add_argument("--n-epochs", type=int, default=3)
    parser.add_argument("--learning-rate", type=float, default=5e-4)
    parser.add_argument("--ent-coef", type=float, default=0.01)
    parser.add_argument("--net-arch", default="128,128", help="MLP hidden layers (gdrl-train --net-arch)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-episodes", type=int, default=20, help="episodes per match-up")
    parser.add_argument("--eval-only", action="store_true", help="skip training; evaluate --out/red.zip, blue.zip")
    return parser


def battle_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {"map_size": args.map_size, "max_cycles": args.max_cycles, "attack_penalty": args.attack_penalty}


# --- training ---------------------------------------------------------------------------------------


def _spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, *args], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)


def _train_flags(args: argparse.Namespace) -> list[str]:
    from clients.train_options import build_parser as train_parser

    known = train_parser()._option_string_actions
    flags = [
        *("--n-steps", str(args.n_steps), "--batch-size", str(args.batch_size), "--n-epochs", str(args.n_epochs)),
        *("--learning-rate", str(args.learning_rate), "--ent-coef", str(args.ent_coef), "--seed", str(args.seed)),
    ]
    if "--net-arch" in known:  # newer gdrl-train; older ones train SB3's default MLP
        flags += ["--net-arch", args.net_arch]
    if "--progress" in known:
        flags += ["--progress", "lines", "--log-every", "30"]
    return flags


def train(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    port_file = out / "broker.port"
    port_file.unlink(missing_ok=True)
    # Barrier stepping (lock-step): every tick waits for both teams, so each PPO rollout is on-policy for
    # both sides. The broker's default, hold, would let the battle run on while one team's trainer updates.
    broker = _spawn(["-m", "broker", "serve", "--port", "0", "--port-file", str(port_file), "--status-interval", "60",
                     "--stepping", "barrier"], out / "broker.log")  # fmt: skip
    procs: dict[str, subprocess.Popen[bytes]] = {}
    started = time.monotonic()
    try:
        while not port_file.exists():
            if broker.poll() is not None or time.monotonic() - started > 30:
                raise RuntimeError(f"the broker did not start; see {out / 'broker.log'}")
            time.sleep(0.05)
        address = f"127.0.0.1:{port_file.read_text()}"
        env_kwargs = json.dumps(battle_kwargs(args))
        procs["game"] = _spawn(["-m", "clients.pettingzoo_game", "--env", ENV_FACTORY, "--env-kwargs", env_kwargs,
                                "--address", address, "--seed", str(args.seed)], out / "game.log")  # fmt: skip
        for team in TEAMS:
            procs[team] = _spawn(
                ["-m", "clients.train", "--policy", team, "--broker", address, "--timesteps", str(args.timesteps),
                 "--save-model-path", str(out / f"{team}.zip"), "--report-json", str(out / f"{team}_train.json"),
                 *_train_flags(args)],
                out / f"{team}_train.log",
            )  # fmt: skip
        print(f"training red and blue: {args.timesteps:,} agent steps each; logs in {out}", file=sys.stderr)
        for team in TEAMS:
            if procs[team].wait() != 0:
                raise RuntimeError(f"the {team} trainer failed; see {out / f'{team}_train.log'}")
    finally:
        broker.send_signal(signal.SIGTERM)  # the game is told to close, and exits
        for proc in [*procs.values(), broker]:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    seconds = time.monotonic() - started
    reports = {team: json.loads((out / f"{team}_train.json").read_text()) for team in TEAMS}
    return {
        "seconds": round(seconds, 1),
        "timesteps": args.timesteps,
        "ticks": reports["red"]["steps"] // max(1, reports["red"]["agents"]),
        "teams": {t: {k: v for k, v in r.items() if k != "curve"} for t, r in reports.items()},
    }


# --- evaluation (no broker: the saved models play the env directly) ----------------------------------


def random_policy(rng: np.random.Generator) -> Policy:
    return lambda obs: rng.integers(0, N_ACTIONS, len(obs))


def model_policy(path: Path) -> Policy:
    import torch
    from stable_baselines3 import PPO

    torch.set_num_threads(1)
    model = PPO.load(path, device="cpu")

    def act(obs: np.ndarray) -> np.ndarray:
        actions, _ = model.predict({"obs": obs}, deterministic=False)  # as trained: sampled actions
        return np.asarray(actions).reshape(len(obs))

    return act


def play_episode(env: Any, policies: dict[str, Policy], seed: int) -> dict[str, Any]:
    obs, _ = env.reset(seed=seed)
    initial = {team: sum(1 for a in env.agents if a.startswith(team + "_")) for team in TEAMS}
    returns = dict.fromkeys(TEAMS, 0.0)
    ticks = 0
    while env.agents:
        actions: dict[str, int] = {}
        for team in TEAMS:
            live = [a for a in env.agents if a.startswith(team + "_")]
            if live:
                chosen = policies[team](np.stack([obs[a] for a in live]))
                actions.update(zip(live, chosen.tolist(), strict=True))
        obs, rewards, _, _, _ = env.step(actions)
        for agent, reward in rewards.items():
            returns[agent.split("_", 1)[0]] += reward
        ticks += 1
    # The engine still holds the survivors after the last step (PettingZoo's list is empty by then).
    survivors = {team: int(env.env.get_num(handle)) for team, handle in zip(TEAMS, env.handles, strict=True)}
    return {
        "ticks": ticks,
        "survivors": survivors,
        "kills": {"red": initial["blue"] - survivors["blue"], "blue": initial["red"] - survivors["red"]},
        "mean_return": {team: returns[team] / initial[team] for team in TEAMS},
    }


def evaluate(args: argparse.Namespace, out: Path) -> list[dict[str, Any]]:
    from magent2.environments import battle_v4

    env = battle_v4.parallel_env(**battle_kwargs(args))
    rng = np.random.default_rng(args.seed + 1000)
    trained = {team: model_policy(out / f"{team}.zip") for team in TEAMS}
    matchups = [
        ("random", "random"),
        ("trained", "random"),
        ("random", "trained"),
        ("trained", "trained"),
    ]
    rows = []
    for red_kind, blue_kind in matchups:
        policies = {
            "red": trained["red"] if red_kind == "trained" else random_policy(rng),
            "blue": trained["blue"] if blue_kind == "trained" else random_policy(rng),
        }
        episodes = [play_episode(env, policies, seed=10_000 + i) for i in range(args.eval_episodes)]
        rows.append(summarize(red_kind, blue_kind, episodes))
        print(f"evaluated red {red_kind} vs blue {blue_kind}", file=sys.stderr, flush=True)
    env.close()
    return rows


def summarize(red_kind: str, blue_kind: str, episodes: list[dict[str, Any]]) -> dict[str, Any]:
    def mean(get: Callable[[dict[str, Any]], float]) -> float:
        return float(np.mean([get(e) for e in episodes]))

    red_wins = sum(e["survivors"]["red"] > e["survivors"]["blue"] for e in episodes)
    blue_wins = sum(e["survivors"]["blue"] > e["survivors"]["red"] for e in episodes)
    return {
        "red": red_kind,
        "blue": blue_kind,
        "episodes": len(episodes),
        "red_kills": mean(lambda e: e["kills"]["red"]),
        "blue_kills": mean(lambda e: e["kills"]["blue"]),
        "red_survivors": mean(lambda e: e["survivors"]["red"]),
        "blue_survivors": mean(lambda e: e["survivors"]["blue"]),
        "red_win_rate": red_wins / len(episodes),
        "blue_win_rate": blue_wins / len(episodes),
        "red_return": mean(lambda e: e["mean_return"]["red"]),
        "blue_return": mean(lambda e: e["mean_return"]["blue"]),
        "ticks": mean(lambda e: e["ticks"]),
        "per_episode": episodes,
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| red | blue | red kills | blue kills | red survivors | blue survivors | red wins | blue wins "
        "| red return/agent | blue return/agent | ticks |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['red']} | {r['blue']} | {r['red_kills']:.1f} | {r['blue_kills']:.1f} | {r['red_survivors']:.1f} "
            f"| {r['blue_survivors']:.1f} | {r['red_win_rate']:.0%} | {r['blue_win_rate']:.0%} "
            f"| {r['red_return']:.2f} | {r['blue_return']:.2f} | {r['ticks']:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="gdrl-magent2-"))
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"config": vars(args)}
    if not args.eval_only:
        results["training"] = train(args, out)
    started = time.monotonic()
    results["evaluation"] = evaluate(args, out)
    results["evaluation_seconds"] = round(time.monotonic() - started, 1)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    if "training" in results:
        t = results["training"]
        print(f"\ntrained red and blue at once: {t['timesteps']:,} agent steps each in {t['seconds']:.0f} s")
    print(
        f"evaluation: {args.eval_episodes} episodes per match-up, map {args.map_size}, max_cycles {args.max_cycles}\n"
    )
    print(markdown(results["evaluation"]))
    print(f"\nresults: {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
