"""``gdrl-broker demo``: a broker, simulated games and one trainer process per policy, no Godot."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from clients.sim_game import MOVER, PICKER


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--games", type=int, default=2, help="simulated game instances")
    parser.add_argument("--agents", type=int, default=8, help="agents per group in each game")
    parser.add_argument("--timesteps", type=int, default=60_000, help="steps per policy (all agents summed)")
    parser.add_argument("--port", type=int, default=0, help="broker port (0: any free port)")
    parser.add_argument("--out", default=None, help="folder for models and reports (default: a temp folder)")


def run_from_args(args: argparse.Namespace) -> int:
    from broker.log import configure_logging
    from clients.inprocess import InProcessBroker

    configure_logging()
    out = Path(args.out or tempfile.mkdtemp(prefix="gdrl-demo-"))
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with InProcessBroker(expected_games=args.games, port=args.port, status_interval=0) as broker:
        games = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "broker",
                    "sim-game",
                    "--address",
                    broker.address,
                    "--movers",
                    str(args.agents),
                    "--pickers",
                    str(args.agents),
                    "--seed",
                    str(i),
                    "--name",
                    f"sim-{i}",
                ]
            )
            for i in range(args.games)
        ]
        trainers = {
            policy: subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "clients.train",
                    "--policy",
                    policy,
                    "--broker",
                    broker.address,
                    "--timesteps",
                    str(args.timesteps),
                    "--report-json",
                    str(out / f"{policy}.json"),
                    "--save-model-path",
                    str(out / f"{policy}.zip"),
                ],
                stdout=subprocess.DEVNULL if False else None,
            )
            for policy in (MOVER, PICKER)
        }
        codes = {policy: proc.wait() for policy, proc in trainers.items()}
    for game in games:
        try:
            game.wait(timeout=15)
        except subprocess.TimeoutExpired:
            game.kill()
    print(f"\ndemo finished in {time.monotonic() - started:.0f} s; outputs in {out}\n")
    print(f"{'policy':<8} {'agents':>6} {'steps':>8} {'reward start':>13} {'reward end':>11}")
    for policy in (MOVER, PICKER):
        report_path = out / f"{policy}.json"
        if codes[policy] != 0 or not report_path.exists():
            print(f"{policy:<8} trainer failed with exit code {codes[policy]}")
            continue
        r = json.loads(report_path.read_text())
        print(f"{policy:<8} {r['agents']:>6} {r['steps']:>8} {r['reward_start']:>13.3f} {r['reward_end']:>11.3f}")
    return 0 if all(code == 0 for code in codes.values()) else 1
