"""Elo of red's self-play snapshots on one fixed scale: a round-robin among the pool's snapshots (and a
random team), ratings fitted to the outcomes with the untrained snapshot-000000 pinned at 1200.

The broker's live Elo (docs/self_play.md) rates red against its own improving snapshots, so it is
relative: it falls when the snapshots red meets get stronger. Here every player meets every other one,
without the broker (examples/magent2_battle.py's episode loop, snapshots playing argmax as the broker
plays them), and the ratings are the maximum-likelihood Elo of all the results together (each player also
gets one virtual draw with the anchor, so a player that won every game still has a finite rating).

    python examples/magent2_snapshot_elo.py --out runs/magent2_self_play    # reads OUT/pool-red

writes ``OUT/snapshot_elo.json`` (every game, the ratings) and ``OUT/snapshot_elo.png``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from broker.core.elo import INITIAL_RATING, expected_score  # noqa: E402
from examples.magent2_battle import battle_kwargs, play_episode, random_policy  # noqa: E402
from examples.magent2_battle import build_parser as battle_parser  # noqa: E402
from examples.magent2_self_play import onnx_policy  # noqa: E402

ANCHOR = "snapshot-000000"


def build_parser() -> argparse.ArgumentParser:
    parser = battle_parser()
    parser.description = __doc__.splitlines()[0]
    parser.add_argument("--snapshots", default=None, help="comma-separated snapshot indices (default: all)")
    parser.add_argument("--games", type=int, default=1, help="episodes per pair (sides alternate)")
    parser.add_argument(
        "--other-sides",
        action="store_true",
        help="play each pair with the sides the last run did not, and fit the ratings to both runs' games",
    )
    return parser


def fit(players: list[str], games: list[tuple[str, str, float]], iterations: int = 4000) -> dict[str, float]:
    """Maximum-likelihood Elo of ``games`` (a, b, a's score), ANCHOR pinned at 1200; one virtual draw of
    every player with the anchor keeps unbeaten players finite."""
    prior = [(p, ANCHOR, 0.5) for p in players if p != ANCHOR]
    every = games + prior
    ratings = dict.fromkeys(players, INITIAL_RATING)
    counts = {p: sum(p in (a, b) for a, b, _ in every) for p in players}
    for _ in range(iterations):
        surplus = dict.fromkeys(players, 0.0)
        for a, b, score in every:
            gap = score - expected_score(ratings[a], ratings[b])
            surplus[a] += gap
            surplus[b] -= gap
        for p in players:
            if p != ANCHOR:
                ratings[p] += 200.0 * surplus[p] / counts[p]
    return ratings


def main(argv: list[str] | None = None) -> int:
    from magent2.environments import battle_v4

    args = build_parser().parse_args(argv)
    out = Path(args.out)
    pool = out / "pool-red"
    paths = sorted(pool.glob("snapshot-*.onnx"))
    if args.snapshots:
        wanted = {f"snapshot-{int(i):06d}" for i in args.snapshots.split(",")}
        paths = [p for p in paths if p.stem in wanted]
    steps = {p.stem: json.loads(p.with_suffix(".json").read_text())["steps"] for p in paths}
    rng = np.random.default_rng(args.seed + 2000)
    policies: dict[str, Any] = {p.stem: onnx_policy(p) for p in paths}
    policies["random"] = random_policy(rng)
    players = list(policies)
    env = battle_v4.parallel_env(**battle_kwargs(args))
    games, played, started = [], [], time.monotonic()
    flip = 1 if args.other_sides else 0
    if args.other_sides:  # the earlier run's games count too
        played = json.loads((out / "snapshot_elo.json").read_text())["games"]
        games = [(g["red"], g["blue"], g["score_red"]) for g in played]
    for n, (a, b) in enumerate(itertools.combinations(players, 2)):
        for g in range(args.games):
            red, blue = (a, b) if (n + g + flip) % 2 == 0 else (b, a)
            seed = 20_000 + n * 10 + g + 5 * flip
            episode = play_episode(env, {"red": policies[red], "blue": policies[blue]}, seed=seed)
            alive = episode["survivors"]
            score = 1.0 if alive["red"] > alive["blue"] else 0.0 if alive["red"] < alive["blue"] else 0.5
            games.append((red, blue, score))
            played.append({"red": red, "blue": blue, "score_red": score, **episode})
            print(f"{red} vs {blue}: {alive['red']} - {alive['blue']}", file=sys.stderr, flush=True)
    env.close()
    ratings = fit(players, games)
    result = {
        "config": vars(args),
        "seconds": round(time.monotonic() - started, 1),
        "ratings": {p: round(r, 1) for p, r in ratings.items()},
        "steps": steps,
        "games": played,
    }
    (out / "snapshot_elo.json").write_text(json.dumps(result, indent=2))
    plot(ratings, steps, out / "snapshot_elo.png", len(games))
    for p in players:
        print(f"{p:>16} {steps.get(p, '-')!s:>8} steps  Elo {ratings[p]:7.1f}")
    return 0


def plot(ratings: dict[str, float], steps: dict[str, int], path: Path, n_games: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted(steps, key=steps.__getitem__)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([steps[n] for n in names], [ratings[n] for n in names], marker="o", label="red's snapshots")
    if "random" in ratings and math.isfinite(ratings["random"]):
        ax.axhline(ratings["random"], color="tab:red", linestyle="--", linewidth=1, label="random team")
    ax.axhline(INITIAL_RATING, color="grey", linewidth=0.5)
    ax.set_xlabel("red agent steps when the snapshot was taken")
    ax.set_ylabel(f"Elo ({ANCHOR} = {INITIAL_RATING:.0f})")
    ax.set_title(f"MAgent2 self-play: round-robin of red's snapshots ({n_games} games)", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    raise SystemExit(main())
