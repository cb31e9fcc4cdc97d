"""Learning proof: both policies of the simulated game, trained at the same time through one broker by two
``gdrl-train`` subprocesses, end clearly above the random policy measured in the same test.

Budget: 30,000 agent steps per policy (PPO with gdrl-train's defaults; 2 games x 8 agents per group, so
16 agents per policy; SB3 rounds up to whole rollouts: 30,720 steps). Margins over the random policy's
mean episode reward: mover +2.0 and picker +0.5. Typical values: random mover -0.5, picker -0.2;
trained mover about 5, picker about 0.8 (the optimum is a little under 1). The broker runs with its
default stepping (hold).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from clients.demo import random_episode_returns
from clients.sim_game import MOVER, PICKER
from clients.vec_env import BrokerVecEnv
from tests.helpers import python_env
from tests.test_train import sim_broker

TIMESTEPS = 30_000
GAMES = [(8, 8), (8, 8)]  # (movers, pickers) per game
RANDOM_TICKS = 400
MARGIN = {MOVER: 2.0, PICKER: 0.5}


def random_policy_rewards(address: str, ticks: int) -> dict[str, float]:
    """Mean return of the episodes that end within ``ticks`` ticks of uniformly random actions. Both policies
    are stepped together, so this works with barrier stepping (lock-step) too."""
    envs = {policy: BrokerVecEnv(policy, address, name=f"random[{policy}]") for policy in (MOVER, PICKER)}
    try:
        finished = random_episode_returns(envs, ticks)
    finally:
        for env in envs.values():
            env.close()
    assert all(len(episodes) > 50 for episodes in finished.values()), {p: len(e) for p, e in finished.items()}
    return {policy: float(np.mean(episodes)) for policy, episodes in finished.items()}


def test_both_policies_beat_the_random_policy_when_trained_together(tmp_path: Path) -> None:
    with sim_broker(tmp_path, GAMES) as address:
        random_reward = random_policy_rewards(address, RANDOM_TICKS)
        # The random envs left; each policy's open batch goes to its trainer below.
        logs = {policy: open(tmp_path / f"{policy}.log", "w") for policy in (MOVER, PICKER)}
        trainers = {
            policy: subprocess.Popen(
                [
                    *(sys.executable, "-m", "clients.train", "--policy", policy, "--broker", address),
                    *("--timesteps", str(TIMESTEPS), "--seed", "0", "--progress", "lines", "--log-every", "5"),
                    *("--report-json", str(tmp_path / f"{policy}.json")),
                ],
                env=python_env(),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            for policy, log in logs.items()
        }
        try:
            codes = {policy: proc.wait(timeout=400) for policy, proc in trainers.items()}
        finally:
            for proc in trainers.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            for log in logs.values():
                log.close()
    output = {policy: (tmp_path / f"{policy}.log").read_text() for policy in trainers}
    assert codes == {MOVER: 0, PICKER: 0}, output
    for policy in (MOVER, PICKER):
        report = json.loads((tmp_path / f"{policy}.json").read_text())
        assert report["agents"] == 16 and report["steps"] >= TIMESTEPS
        trained = report["reward_end"]
        print(f"{policy}: random {random_reward[policy]:.3f}, trained {trained:.3f} (margin {MARGIN[policy]})")
        assert trained >= random_reward[policy] + MARGIN[policy], (
            policy,
            random_reward[policy],
            report,
            output[policy],
        )
