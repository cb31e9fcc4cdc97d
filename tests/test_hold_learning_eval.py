"""The common evaluation of benchmarks/hold_vs_strict.py (--learning): a real in-process broker with barrier
stepping, real simulated games on its port, both policies stepped together for whole episodes per agent."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

from benchmarks.hold_vs_strict import Actor, evaluate_models, evaluate_policies, evaluation_envs, evaluation_game
from broker.protocol.spaces import PolicySpaces
from clients.sim_game import MOVER, PICKER, mover_spaces, picker_spaces
from clients.spaces import ActionCodec, observation_dict

AGENTS = 2  # per group and game; 2 evaluation games
EPISODES_PER_AGENT = 4
EPISODES = 2 * AGENTS * EPISODES_PER_AGENT


def perfect_mover(obs: dict[str, np.ndarray]) -> np.ndarray:
    """Straight at the target: the offset to it, scaled so the last step lands on it."""
    return np.clip(obs["obs"][:, 2:4] / 0.15, -1.0, 1.0)


def perfect_picker(obs: dict[str, np.ndarray]) -> np.ndarray:
    return obs["goal_side"].astype(np.int64)  # left 0 / stay 1 / right 2 are also the moves


def random_actor(env: Any, seed: int) -> Any:
    env.action_space.seed(seed)
    return lambda obs: np.stack([env.action_space.sample() for _ in range(env.num_envs)])


@pytest.mark.timeout(60)
def test_scripted_perfect_policies_beat_random_ones_and_the_evaluation_is_reproducible() -> None:
    results = []
    for actors in ("perfect", "random", "perfect"):
        with evaluation_envs(AGENTS) as envs:
            assert {p: env.num_envs for p, env in envs.items()} == {MOVER: 2 * AGENTS, PICKER: 2 * AGENTS}
            chosen: dict[str, Actor]
            if actors == "perfect":
                chosen = {MOVER: perfect_mover, PICKER: perfect_picker}
            else:
                chosen = {p: random_actor(env, i) for i, (p, env) in enumerate(envs.items())}
            results.append(evaluate_policies(envs, chosen, EPISODES_PER_AGENT))
    perfect, random, again = results
    for policy in (MOVER, PICKER):
        for result in results:
            assert result[policy]["episodes"] == EPISODES
            assert result[policy]["held_transitions"] == 0  # barrier stepping: every tick decided
        assert perfect[policy]["goal_fraction"] == 1.0
        assert random[policy]["goal_fraction"] < 1.0
        assert perfect[policy]["return_mean"] > random[policy]["return_mean"] + 0.5, (perfect, random)
        assert perfect[policy]["length_mean"] < random[policy]["length_mean"]
    # Fixed game seeds, deterministic actions, games in fixed slots: the same evaluation, to the last bit.
    assert again == perfect


def test_evaluation_game_gives_each_agent_the_same_start_states_whatever_order_episodes_end_in() -> None:
    one, other = evaluation_game(3, 3, seed=7), evaluation_game(3, 3, seed=7)
    states = []
    for game, order in ((one, [0, 1, 2]), (other, [2, 0, 1])):  # agents' episodes end in different orders
        for _ in range(4):
            for agent in order:
                game._reset_movers(np.arange(3) == agent)
                game._reset_pickers(np.arange(3) == agent)
        states.append([game.pos.tolist(), game.target.tolist(), game.cell.tolist(), game.goal.tolist()])
    assert states[0] == states[1]
    assert evaluation_game(3, 3, seed=8).pos.tolist() != one.pos.tolist()  # the seed matters
    assert (one.goal != one.cell).all()  # as in the simulated game: the goal is never the start cell


class SpacesOnly(gym.Env[Any, Any]):
    """Just the spaces, to build an (untrained) PPO model for a policy; never stepped."""

    def __init__(self, spaces: PolicySpaces) -> None:
        self.observation_space = observation_dict(spaces)
        self.action_space = ActionCodec(spaces).space


@pytest.mark.timeout(60)
def test_saved_models_are_evaluated_together_for_whole_episodes(tmp_path: Path) -> None:
    from stable_baselines3 import PPO

    models = {}
    for policy, spaces in ((MOVER, mover_spaces()), (PICKER, picker_spaces())):
        models[policy] = tmp_path / f"{policy}.zip"
        PPO("MultiInputPolicy", SpacesOnly(spaces), n_steps=16, batch_size=16, seed=0, device="cpu").save(
            models[policy]
        )
    first = evaluate_models(models, AGENTS, EPISODES_PER_AGENT)
    second = evaluate_models(models, AGENTS, EPISODES_PER_AGENT)
    for policy in (MOVER, PICKER):
        assert first[policy]["episodes"] == EPISODES
        assert first[policy]["held_transitions"] == 0
        assert first[policy]["ticks"] >= EPISODES_PER_AGENT  # each episode lasts at least one tick
    assert np.isfinite(first[MOVER]["return_mean"]) and np.isfinite(first[PICKER]["return_mean"])
    assert first == second  # deterministic actions in the fixed evaluation games
