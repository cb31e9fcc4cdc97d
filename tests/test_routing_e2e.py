"""3 game processes x 2 groups x 2 trainer processes over real loopback sockets, through a broker process:
every observation reaches the right policy and slot, every action the right game and agent, then both
policies train with PPO."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.helpers import broker_process, spawn_python

GAMES = 3
CHECK_STEPS = 40
PPO_ITERATIONS = 8  # x 32 steps per env, per policy (red: 6 envs, blue: 9 envs)


def test_three_games_two_groups_two_trainers(tmp_path: Path) -> None:
    with broker_process(tmp_path, "--games", str(GAMES), "--stepping", "barrier") as (_broker, address):
        games = [
            spawn_python(
                "-m",
                "tests.scripts.echo_game",
                "--address",
                address,
                "--check-ticks",
                str(CHECK_STEPS),
                "--report",
                str(tmp_path / f"game{i}.json"),
            )
            for i in range(GAMES)
        ]
        trainers = {
            policy: spawn_python(
                "-m",
                "tests.scripts.echo_trainer",
                "--address",
                address,
                "--policy",
                policy,
                "--games",
                str(GAMES),
                "--check-steps",
                str(CHECK_STEPS),
                "--ppo-iterations",
                str(PPO_ITERATIONS),
                "--report",
                str(tmp_path / f"{policy}.json"),
            )
            for policy in ("red", "blue")
        }
        try:
            codes = {policy: proc.wait(timeout=300) for policy, proc in trainers.items()}
        finally:
            for proc in trainers.values():
                proc.kill() if proc.poll() is None else None
    # The broker stopped (SIGTERM): games were told to close and must have exited by themselves.
    game_codes = []
    for proc in games:
        try:
            game_codes.append(proc.wait(timeout=30))
        except subprocess.TimeoutExpired:
            proc.kill()
            game_codes.append("hung")
    reports = {p: json.loads((tmp_path / f"{p}.json").read_text()) for p in ("red", "blue")}
    game_reports = [json.loads((tmp_path / f"game{i}.json").read_text()) for i in range(GAMES)]
    assert codes == {"red": 0, "blue": 0}, reports
    assert game_codes == [0] * GAMES, game_reports
    assert sorted(r["game"] for r in game_reports) == list(range(GAMES))
    for r in game_reports:
        assert r["checked"] == CHECK_STEPS and r["mismatches"] == [] and r["end"] == "closed"
    assert reports["red"]["n_envs"] == 6 and reports["blue"]["n_envs"] == 9
    for policy, report in reports.items():
        assert report["problems"] == [] and report["episodes"] > 0, policy
        assert report["ppo_steps"] == 32 * report["n_envs"] * PPO_ITERATIONS
