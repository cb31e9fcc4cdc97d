"""MAgent2 battle by self-play: red (225 agents, one PPO policy) learns against frozen snapshots of itself,
which the broker plays as blue; then red is evaluated against a random team and its own early snapshot.

1. a broker (``serve --stepping barrier``), the battle env as one game, and one trainer
   ``gdrl-train --policy red --opponent blue --pool-dir OUT/pool-red``; the broker plays blue from the
   pool (docs/self_play.md); ``gdrl-broker status`` is read every ``--poll-s`` for the Elo curve;
2. evaluation without the broker (examples/magent2_battle.py's episode loop): red's final model against a
   random blue, against snapshot 0 (the untrained policy) and against the pool's first trained snapshot;
   snapshots play as the broker plays them (ONNX, argmax); with ``--two-trainer DIR`` also against the
   models of an examples/magent2_battle.py run (``--eval-only --two-trainer DIR`` adds just those rows);
3. a markdown table on stdout, ``results.json`` and ``elo.png`` in ``--out``.

    python examples/magent2_self_play.py --out runs/magent2_self_play
    python examples/magent2_self_play.py --out runs/magent2_self_play --eval-only --two-trainer runs/magent2_battle

examples/magent2_snapshot_elo.py rates the pool's snapshots on one scale (a round-robin).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples.magent2_battle import (  # noqa: E402
    ENV_FACTORY,
    _spawn,
    _train_flags,
    battle_kwargs,
    markdown,
    model_policy,
    play_episode,
    random_policy,
    summarize,
)
from examples.magent2_battle import build_parser as battle_parser  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = battle_parser()
    parser.description = __doc__.splitlines()[0]
    parser.set_defaults(timesteps=900_000, eval_episodes=4)
    parser.add_argument("--snapshot-every", type=int, default=112_500, help="agent steps between snapshots")
    parser.add_argument("--swap-every", type=int, default=250, help="blue ticks between opponent swaps")
    parser.add_argument("--window", type=int, default=5)
    parser.add_argument("--play-latest", type=float, default=0.5)
    parser.add_argument("--poll-s", type=float, default=10.0, help="seconds between Elo readings")
    parser.add_argument(
        "--two-trainer",
        default=None,
        help="a folder of examples/magent2_battle.py (red.zip, blue.zip): self-play red also plays against that "
        "run's blue, and its red against self-play red; with --eval-only only these rows are played and added "
        "to --out/results.json",
    )
    return parser


def onnx_policy(path: Path) -> Any:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])

    def act(obs: np.ndarray) -> np.ndarray:
        feeds = {"obs": obs.reshape(len(obs), -1).astype(np.float32), "state_ins": np.zeros(len(obs), np.float32)}
        return np.argmax(session.run(["output"], feeds)[0], axis=1)

    return act


def train(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    from clients.status import fetch_status

    port_file = out / "broker.port"
    port_file.unlink(missing_ok=True)
    broker = _spawn(["-m", "broker", "serve", "--port", "0", "--port-file", str(port_file), "--status-interval", "60",
                     "--stepping", "barrier"], out / "broker.log")  # fmt: skip
    procs = {}
    curve: list[dict[str, Any]] = []
    started = time.monotonic()
    try:
        while not port_file.exists():
            if broker.poll() is not None or time.monotonic() - started > 30:
                raise RuntimeError(f"the broker did not start; see {out / 'broker.log'}")
            time.sleep(0.05)
        address = f"127.0.0.1:{port_file.read_text()}"
        procs["game"] = _spawn(["-m", "clients.pettingzoo_game", "--env", ENV_FACTORY, "--env-kwargs",
                                json.dumps(battle_kwargs(args)), "--address", address, "--seed", str(args.seed)],
                               out / "game.log")  # fmt: skip
        procs["red"] = _spawn(
            ["-m", "clients.train", "--policy", "red", "--opponent", "blue", "--pool-dir", str(out / "pool-red"),
             "--snapshot-every", str(args.snapshot_every), "--swap-every", str(args.swap_every),
             "--window", str(args.window), "--play-latest", str(args.play_latest), "--broker", address,
             "--timesteps", str(args.timesteps), "--save-model-path", str(out / "red.zip"),
             "--report-json", str(out / "red_train.json"), "--tensorboard-log", str(out / "tb"),
             *_train_flags(args)],
            out / "red_train.log",
        )  # fmt: skip
        print(f"self-play training of red: {args.timesteps:,} agent steps; logs in {out}", file=sys.stderr)
        while procs["red"].poll() is None:
            time.sleep(args.poll_s)
            try:
                status = fetch_status(address)
            except Exception:
                continue
            red = status.get("policies", {}).get("red", {})
            blue = status.get("frozen", {}).get("blue", {})
            curve.append(
                {
                    "seconds": round(time.monotonic() - started, 1),
                    "red_env_steps": red.get("env_steps"),
                    "elo": status.get("elo", {}),
                    "opponent": blue.get("pool", {}).get("opponent"),
                }
            )
        if procs["red"].returncode != 0:
            raise RuntimeError(f"the red trainer failed; see {out / 'red_train.log'}")
    finally:
        broker.send_signal(signal.SIGTERM)
        for proc in [*procs.values(), broker]:
            try:
                proc.wait(timeout=30)
            except Exception:
                proc.kill()
    pool = json.loads((out / "pool-red" / "pool.json").read_text())
    return {"seconds": round(time.monotonic() - started, 1), "timesteps": args.timesteps, "curve": curve, "pool": pool}


def plot(curve: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # the status' env_steps counts the VecEnv's envs, i.e. agent steps
    points = [(c["red_env_steps"], c["elo"]["red"]) for c in curve if c["elo"].get("red") and c["red_env_steps"]]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    if points:
        ax.plot([p[0] for p in points], [p[1] for p in points], label="red (live policy)")
    ax.axhline(1200, color="grey", linewidth=0.5)
    ax.set_xlabel("red agent steps")
    ax.set_ylabel("Elo")
    ax.set_title("MAgent2 battle, red by self-play against its snapshots")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def matchups(args: argparse.Namespace, out: Path, rng: np.random.Generator, own: bool) -> list[tuple[Any, ...]]:
    """(red kind, red policy, blue kind, blue policy): against random and early snapshots if ``own``, and
    against the two-trainer run's models if ``--two-trainer`` is given."""
    red = model_policy(out / "red.zip")
    games = []
    if own:
        snapshots = sorted((out / "pool-red").glob("snapshot-*.onnx"))
        opponents = [("random", random_policy(rng)), ("snapshot-000000 (untrained)", onnx_policy(snapshots[0]))]
        if len(snapshots) > 1:
            opponents.append((f"{snapshots[1].stem} (early)", onnx_policy(snapshots[1])))
        for red_kind, red_policy in (("random", random_policy(rng)), ("trained", red)):
            games += [(red_kind, red_policy, blue_kind, blue_policy) for blue_kind, blue_policy in opponents]
    if args.two_trainer:
        two = {team: model_policy(Path(args.two_trainer) / f"{team}.zip") for team in ("red", "blue")}
        games += [
            ("trained", red, "two-trainer blue", two["blue"]),
            ("two-trainer red", two["red"], "two-trainer blue", two["blue"]),
            ("two-trainer red", two["red"], "trained (self-play red as blue)", red),
        ]
    return games


def evaluate(args: argparse.Namespace, out: Path, own: bool = True) -> list[dict[str, Any]]:
    from magent2.environments import battle_v4

    env = battle_v4.parallel_env(**battle_kwargs(args))
    rng = np.random.default_rng(args.seed + 1000)
    rows = []
    for red_kind, red_policy, blue_kind, blue_policy in matchups(args, out, rng, own):
        episodes = [
            play_episode(env, {"red": red_policy, "blue": blue_policy}, seed=10_000 + i)
            for i in range(args.eval_episodes)
        ]
        rows.append(summarize(red_kind, blue_kind, episodes))
        print(f"evaluated red {red_kind} vs blue {blue_kind}", file=sys.stderr, flush=True)
    env.close()
    return rows


def replot(out: Path) -> None:
    """``elo.png`` again from a finished run's ``results.json``."""
    plot(json.loads((out / "results.json").read_text())["training"]["curve"], out / "elo.png")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="gdrl-magent2-selfplay-"))
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"config": vars(args)}
    if not args.eval_only:
        results["training"] = train(args, out)
        plot(results["training"]["curve"], out / "elo.png")
    if args.eval_only and args.two_trainer and (out / "results.json").exists():
        results = json.loads((out / "results.json").read_text())  # the rows played before stay
        added = evaluate(args, out, own=False)
        keys = {(r["red"], r["blue"]) for r in added}
        results["evaluation"] = [r for r in results["evaluation"] if (r["red"], r["blue"]) not in keys] + added
        results["two_trainer"] = str(Path(args.two_trainer).resolve())
    else:
        results["evaluation"] = evaluate(args, out)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    if "training" in results:
        pool = results["training"]["pool"]
        ratings = ", ".join(f"{p} {r:.0f}" for p, r in sorted(pool["elo"]["ratings"].items()))
        seconds = results["training"]["seconds"]
        print(f"\nself-play: {args.timesteps:,} agent steps in {seconds:.0f} s, {pool['swaps']} swaps; Elo: {ratings}")
    print(markdown(results["evaluation"]))
    print(f"\nresults: {out / 'results.json'}, Elo curve: {out / 'elo.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
