"""A trainer that plays the two-policy example with a fixed scripted policy and records everything it sees.

``python -m tests.scripts.scripted_godot_trainer POLICY ADDRESS STEPS OUT.json``: barrier stepping, actions a
deterministic function of the observation (exactly representable in float32, so the JSON of godot_rl's
plugin and the binary arrays of BrokerSync carry the same numbers), every step's observations, rewards,
episode ends and terminal observations written to OUT.json. tests/test_godot_e2e.py compares the records of
the same game through godot_rl's Sync and through BrokerSync.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from broker.protocol.messages import StepOptions
from clients.vec_env import BrokerVecEnv


def player_action(obs: np.ndarray) -> np.ndarray:
    """obs: goal distance, platform offset, over the pit. Walk right, but wait at the pit's edge for a platform
    that is far to the right (one that is close may or may not come in time: some episodes end in a fall)."""
    at_edge = (obs[:, 0] > 0.5) & (obs[:, 0] < 0.52)
    move = np.where(at_edge & (obs[:, 1] > 0.08), 0.0, 1.0)
    return move.astype(np.float32)[:, None]


def platform_action(obs: np.ndarray) -> np.ndarray:
    """obs: player offset, platform place, player's distance to the pit. Follow the player once it is close."""
    close = obs[:, 2] < 0.05
    action = np.where(obs[:, 0] > 0.02, 2, np.where(obs[:, 0] < -0.02, 0, 1))
    return np.where(close, action, 1).astype(np.int64)


def main(policy: str, address: str, steps: int, out: Path) -> None:
    script = {"player": player_action, "platform": platform_action}[policy]
    env = BrokerVecEnv(policy, address, stepping=StepOptions(mode="barrier"))
    first = env.reset()
    assert isinstance(first, dict)
    obs = first["obs"]
    record: dict[str, Any] = {"obs": [obs.tolist()], "reward": [], "done": [], "terminal": []}
    for _ in range(steps):
        next_obs, reward, done, infos = env.step(script(obs))
        assert isinstance(next_obs, dict)
        obs = next_obs["obs"]
        record["obs"].append(obs.tolist())
        record["reward"].append(reward.tolist())
        record["done"].append(done.tolist())
        record["terminal"].append(
            [info["terminal_observation"]["obs"].tolist() if "terminal_observation" in info else None for info in infos]
        )
    out.write_text(json.dumps(record))
    env.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4]))
