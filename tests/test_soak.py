"""Soak: 8 games x 2 policies x 400 agents each through one broker, lock-step (barrier), every step
counted end to end. Games tag their observations with (game, agent, tick); trainers answer with actions
derived from the tags and check that each row's tick advances by exactly one; games check that each
action answers that very tick. At the end every game has played as many ticks as each trainer took steps,
none lost or duplicated, and the broker's memory stayed flat.

CI runs it for GDRL_SOAK_SECONDS (default 25 s); GDRL_SOAK_SECONDS=300 is the full soak.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from pathlib import Path

from tests.scripts.reliability_common import broker, exit_code, read_report, spawn, stop, wait_until

SOAK_SECONDS = float(os.environ.get("GDRL_SOAK_SECONDS", "25"))
GAMES = 8
AGENTS = 400  # per policy, per game: each policy's VecEnv has GAMES * AGENTS envs
POLICIES = ("mover", "picker")
RSS_GROWTH_LIMIT = 16 * 1024 * 1024


def test_soak(tmp_path: Path) -> None:
    stop_file = tmp_path / "stop-at-step"
    trainer_reports = {p: tmp_path / f"{p}.json" for p in POLICIES}
    game_reports = [tmp_path / f"game{i}.json" for i in range(GAMES)]
    args = ("--games", str(GAMES), "--stepping", "barrier", "--status-interval", "0", "--log-json")
    with broker(tmp_path, *args) as b:
        games = []
        for i, report in enumerate(game_reports):
            game_args = ["--address", b.address, "--kind", "tagged", "--exact", "--name", f"soak{i}"]
            game_args += ["--movers", str(AGENTS), "--pickers", str(AGENTS), "--report", str(report)]
            games.append(spawn("tests.scripts.reliability_game", *game_args, log_path=tmp_path / f"game{i}.log"))
        trainers = {}
        for policy, report in trainer_reports.items():
            trainer_args = ["--address", b.address, "--policy", policy, "--mode", "tagged"]
            trainer_args += ["--stop-file", str(stop_file), "--report", str(report)]
            log_path = tmp_path / f"{policy}.log"
            trainers[policy] = spawn("tests.scripts.reliability_trainer", *trainer_args, log_path=log_path)
        try:

            def steps() -> dict[str, int]:
                return {p: int(read_report(r).get("steps", 0)) for p, r in trainer_reports.items()}

            wait_until(lambda: min(steps().values()) >= 20, 240, "the soak to get going")
            started, first = time.monotonic(), steps()
            samples: list[tuple[float, int]] = []
            while (elapsed := time.monotonic() - started) < SOAK_SECONDS:
                assert b.proc.poll() is None, f"the broker exited: {b.log()[-2000:]}"
                assert all(p.poll() is None for p in (*games, *trainers.values())), "a game or trainer exited"
                samples.append((elapsed, b.rss()))
                time.sleep(min(1.0, SOAK_SECONDS / 20))
            last = steps()
            elapsed = time.monotonic() - started
            rate = (min(last.values()) - min(first.values())) / elapsed
            # Both trainers stop after the same step, so every game can be checked against them exactly.
            stop_at = max(last.values()) + math.ceil(3 * rate) + 20
            stop_file.write_text(str(stop_at))
            codes = {p: exit_code(proc, 120) for p, proc in trainers.items()}
            final_rss = b.rss()
        finally:
            for proc in trainers.values():
                stop(proc)
    game_codes = [exit_code(game) for game in games]
    reports = {p: read_report(r) for p, r in trainer_reports.items()}
    assert codes == {"mover": 0, "picker": 0}, reports
    for policy, result in reports.items():
        assert result["n_envs"] == GAMES * AGENTS
        assert result["steps"] == stop_at, (policy, result["steps"], stop_at)
        assert result["lost"] == 0 and result["duplicated"] == 0 and result["problems"] == [], (policy, result)
    assert game_codes == [0] * GAMES
    for i, path in enumerate(game_reports):
        game = read_report(path)
        # The broker forwarded every one of the trainers' steps to every game, once.
        assert game["ticks"] == stop_at and game["mismatches"] == 0 and game["end"] == "closed", (i, game)

    quarter = max(1, len(samples) // 4)
    early = statistics.median(rss for _, rss in samples[:quarter])
    late = statistics.median(rss for _, rss in samples[-quarter:])
    print(
        f"\nsoak {elapsed:.0f} s: {rate:.1f} steps/s per policy = {rate * GAMES * AGENTS * len(POLICIES):,.0f} "
        f"agent-steps/s; {stop_at} steps x {GAMES * AGENTS} envs x {len(POLICIES)} policies counted end to end; "
        f"broker RSS {early / 2**20:.1f} MiB early, {late / 2**20:.1f} MiB late, {final_rss / 2**20:.1f} MiB at the end"
    )
    assert late - early < RSS_GROWTH_LIMIT, samples
