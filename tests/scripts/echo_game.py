"""A game whose observations say where they come from: [game_index, group, agent, tick].

It checks that every action it receives during the first ``--check-ticks`` ticks is the one a trainer
derives from that very agent's observation, then keeps playing until the broker closes.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

import numpy as np

from broker.protocol.messages import StepData
from broker.protocol.spaces import (
    BoxSpace,
    ContinuousAction,
    DiscreteAction,
    DiscreteSpace,
    GroupSpec,
    PolicySpaces,
)
from clients.errors import BrokerError
from clients.game import GameClient

GROUP_ID = {"red": 1, "blue": 2}
N_AGENTS = {"red": 2, "blue": 3}
SPACES = {
    "red": PolicySpaces((("obs", BoxSpace((4,), "float32", -1000, 1000)),), (("move", ContinuousAction(2)),)),
    "blue": PolicySpaces(
        (("obs", BoxSpace((4,), "float32", -1000, 1000)), ("flag", DiscreteSpace(5))),
        (("g", DiscreteAction(4)), ("a", DiscreteAction(8))),
    ),
}


def expected_actions(group: str, game: int, agents: np.ndarray, tick: int) -> dict[str, np.ndarray]:
    """What the echo trainer sends back for these agents (mirrors tests/scripts/echo_trainer.py)."""
    if group == "red":
        return {"move": np.stack([np.full(len(agents), game * 0.25), agents * 0.25 + (tick % 2) * 0.125], 1)}
    return {"g": np.full(len(agents), game), "a": agents + 4 * (tick % 2)}


def observe(group: str, game: int, tick: int, sign: float = 1.0) -> dict[str, np.ndarray]:
    n = N_AGENTS[group]
    agents = np.arange(n, dtype=np.float32)
    obs = np.stack([np.full(n, game), np.full(n, GROUP_ID[group]), agents, np.full(n, sign * tick)], 1)
    out = {"obs": obs.astype(np.float32)}
    if group == "blue":
        out["flag"] = (np.arange(n) % 5).astype(np.int32)
    return out


def outcome(group: str, game: int, tick: int) -> StepData:
    n = N_AGENTS[group]
    agents = np.arange(n)
    ended = (tick > 0) & (tick % (5 + agents) == 0)
    data = StepData(
        observe(group, game, tick),
        np.full(n, 1.0 if group == "red" else 0.5, np.float32),
        ended if group == "red" else np.zeros(n, bool),
        ended if group == "blue" else np.zeros(n, bool),
    )
    if ended.any():
        index = np.flatnonzero(ended).astype(np.int32)
        finals = {k: v[index] for k, v in observe(group, game, tick, sign=-1.0).items()}
        data = replace(data, final_index=index, final_obs=finals)
    return data


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", required=True)
    parser.add_argument("--check-ticks", type=int, required=True)
    parser.add_argument("--report", required=True)
    args = parser.parse_args()
    groups = [GroupSpec(name, N_AGENTS[name], SPACES[name]) for name in ("red", "blue")]
    client = GameClient(args.address, groups, name="echo")
    game = client.game_index
    assert game is not None
    mismatches: list[str] = []
    checked = 0
    tick = 0
    try:
        while True:
            actions = client.step({g: outcome(g, game, tick) for g in ("red", "blue")})
            if tick < args.check_ticks:
                checked += 1
                for group in ("red", "blue"):
                    want = expected_actions(group, game, np.arange(N_AGENTS[group]), tick)
                    for key, value in want.items():
                        if not np.allclose(actions[group][key], value):
                            mismatches.append(f"tick {tick} {group}.{key}: {actions[group][key]!r} != {value!r}")
            tick += 1
    except BrokerError as exc:
        end = exc.code
    with open(args.report, "w") as f:
        json.dump({"game": game, "ticks": tick, "checked": checked, "mismatches": mismatches[:20], "end": end}, f)
    return 0 if not mismatches and checked == args.check_ticks else 1


if __name__ == "__main__":
    sys.exit(main())
