"""BrokerVecEnv keeps Stable-Baselines3's VecEnv contract: compared step by step with a DummyVecEnv over the
same environments, wrapped by SB3's own wrappers, and checked by SB3's check_env through BrokerEnv."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces
from stable_baselines3 import PPO
from stable_baselines3.common.env_checker import check_env
from stable_baselines3.common.vec_env import DummyVecEnv, VecCheckNan, VecFrameStack, VecMonitor, VecNormalize

import clients.spaces
import clients.vec_env
from broker.protocol.messages import StepData, StepOptions
from broker.protocol.spaces import BoxSpace, DiscreteAction, GroupSpec, PolicySpaces
from clients.errors import BrokerError
from clients.game import GameClient
from clients.inprocess import InProcessBroker
from clients.sim_game import run_sim_game
from clients.vec_env import BrokerEnv, BrokerVecEnv

N_AGENTS = 4


class CounterEnv(gym.Env[dict[str, np.ndarray], int]):
    """Observation = steps taken; terminates after ``length`` steps, truncated by TimeLimit otherwise."""

    observation_space = spaces.Dict([("obs", spaces.Box(-1000.0, 1000.0, (1,), np.float32))])
    action_space = spaces.Discrete(2)

    def __init__(self, length: int) -> None:
        self.length = length
        self.t = 0

    def _obs(self) -> dict[str, np.ndarray]:
        return {"obs": np.array([self.t], np.float32)}

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action: int) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        self.t += 1
        return self._obs(), float(action) + 0.5, self.t >= self.length, False, {}


def make_env(i: int) -> gym.Env[Any, Any]:
    # Odd agents hit the time limit before terminating.
    return gym.wrappers.TimeLimit(CounterEnv(length=3 + i), max_episode_steps=4 if i % 2 else 100)


SPACES = PolicySpaces((("obs", BoxSpace((1,), "float32", -1000.0, 1000.0)),), (("act", DiscreteAction(2)),))


def serve_counter_game(address: str, stop: threading.Event) -> None:
    """The same environments, auto-reset per agent, served through the broker as one game."""
    envs = [make_env(i) for i in range(N_AGENTS)]
    obs = np.stack([e.reset()[0]["obs"] for e in envs])
    client = GameClient(address, [GroupSpec("counter", N_AGENTS, SPACES)], name="counter")
    data = StepData({"obs": obs}, np.zeros(N_AGENTS, np.float32), np.zeros(N_AGENTS, bool), np.zeros(N_AGENTS, bool))
    try:
        while not stop.is_set():
            actions = client.step({"counter": data})["counter"]["act"]
            rows, rewards, terms, truncs, final_rows, finals = [], [], [], [], [], []
            for i, env in enumerate(envs):
                o, r, term, trunc, _ = env.step(int(actions[i]))
                if term or trunc:
                    final_rows.append(i)
                    finals.append(o["obs"])
                    o, _ = env.reset()
                rows.append(o["obs"])
                rewards.append(r)
                terms.append(term)
                truncs.append(trunc)
            data = StepData({"obs": np.stack(rows)}, np.array(rewards, np.float32), np.array(terms), np.array(truncs))
            if final_rows:
                data = replace(data, final_index=np.array(final_rows, np.int32), final_obs={"obs": np.stack(finals)})
    except BrokerError:
        pass
    finally:
        client.close()


@pytest.fixture
def counter_broker() -> Iterator[Callable[[], BrokerVecEnv]]:
    # Lock-step from the first tick, so the game waits for the trainer before its first move.
    broker = InProcessBroker(expected_games=1, status_interval=0, stepping="barrier")
    stop = threading.Event()
    game = threading.Thread(target=serve_counter_game, args=(broker.address, stop), daemon=True)
    game.start()
    envs: list[BrokerVecEnv] = []

    def make() -> BrokerVecEnv:
        # Lock-step (barrier) stepping is what makes it comparable tick for tick with DummyVecEnv.
        env = BrokerVecEnv("counter", broker.address, stepping=StepOptions("barrier"))
        envs.append(env)
        return env

    yield make
    stop.set()
    for env in envs:
        env.close()
    broker.close()
    game.join(timeout=10)


@pytest.mark.parametrize("way", ["C codec", "numpy"])
def test_matches_dummy_vec_env_step_by_step(
    counter_broker: Callable[[], BrokerVecEnv], way: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if way == "numpy":  # what a build without the C codec returns must be the same
        monkeypatch.setattr(clients.vec_env, "NATIVE", None)
        monkeypatch.setattr(clients.spaces, "NATIVE", None)
    broker_env = counter_broker()
    dummy = DummyVecEnv([lambda i=i: make_env(i) for i in range(N_AGENTS)])
    assert broker_env.num_envs == dummy.num_envs == N_AGENTS
    assert broker_env.observation_space == dummy.observation_space
    assert broker_env.action_space == dummy.action_space
    obs_b, obs_d = broker_env.reset(), dummy.reset()
    np.testing.assert_array_equal(obs_b["obs"], obs_d["obs"])
    rng = np.random.default_rng(0)
    ends = 0
    for _ in range(25):
        actions = rng.integers(0, 2, N_AGENTS)
        obs_b, rew_b, done_b, info_b = broker_env.step(actions)
        obs_d, rew_d, done_d, info_d = dummy.step(actions)
        np.testing.assert_array_equal(obs_b["obs"], obs_d["obs"])
        np.testing.assert_array_equal(rew_b, rew_d)
        np.testing.assert_array_equal(done_b, done_d)
        assert rew_b.dtype == np.float32 and done_b.dtype == np.bool_
        for b, d in zip(info_b, info_d, strict=True):
            assert b.keys() == d.keys()
            if "terminal_observation" in d:
                ends += 1
                np.testing.assert_array_equal(b["terminal_observation"]["obs"], d["terminal_observation"]["obs"])
                assert b["TimeLimit.truncated"] == d["TimeLimit.truncated"]
    assert ends >= 10


def test_vec_env_api_attrs_seed_and_close(counter_broker: Callable[[], BrokerVecEnv]) -> None:
    env = counter_broker()
    assert env.get_attr("render_mode") == [None] * N_AGENTS
    assert env.get_attr("game_index") == [0] * N_AGENTS
    assert env.get_attr("agent_index", indices=[1, 3]) == [1, 3]
    env.set_attr("difficulty", 2, indices=[0])
    assert env.get_attr("difficulty") == [2, None, None, None]
    with pytest.raises(AttributeError):
        env.get_attr("nonexistent")
    with pytest.raises(NotImplementedError, match="env_method"):
        env.env_method("render")
    assert env.env_is_wrapped(gym.Wrapper) == [False] * N_AGENTS
    assert env.seed(7) == [7, 8, 9, 10]
    env.reset()
    assert env._seeds == [None] * N_AGENTS  # consumed by reset, as SB3 expects
    env.close()
    env.close()  # safe twice


def test_sb3_wrappers_and_ppo(counter_broker: Callable[[], BrokerVecEnv]) -> None:
    env = VecNormalize(VecCheckNan(VecMonitor(counter_broker()), raise_exception=True), norm_reward=True)
    stacked = VecFrameStack(env, n_stack=2)
    obs = stacked.reset()
    assert obs["obs"].shape == (N_AGENTS, 2)
    episodes = 0
    for _ in range(10):
        obs, reward, _done, infos = stacked.step(np.ones(N_AGENTS, dtype=np.int64))
        episodes += sum("episode" in info for info in infos)  # VecMonitor's episode records
        assert np.isfinite(reward).all() and obs["obs"].shape == (N_AGENTS, 2)
    assert episodes >= N_AGENTS
    model = PPO("MultiInputPolicy", env, n_steps=16, batch_size=32, n_epochs=1, seed=0)
    model.learn(total_timesteps=16 * N_AGENTS * 3)
    assert model.num_timesteps == 16 * N_AGENTS * 3


def test_check_env_on_single_agent_view() -> None:
    with InProcessBroker(expected_games=1, status_interval=0) as broker:
        game = threading.Thread(
            target=run_sim_game, args=(broker.address,), kwargs={"n_movers": 1, "n_pickers": 0}, daemon=True
        )
        game.start()
        env = BrokerEnv("mover", broker.address)
        check_env(env, warn=True)
        obs, _ = env.reset()
        assert env.observation_space.contains(obs)
        episode_ends = 0
        for _ in range(200):
            obs, _reward, terminated, truncated, _info = env.step(env.action_space.sample())
            assert env.observation_space.contains(obs)
            if terminated or truncated:
                episode_ends += 1
                obs, _ = env.reset()
        assert episode_ends > 0
        env.close()
    game.join(timeout=10)


def test_brokerenv_refuses_policies_with_many_agents() -> None:
    with InProcessBroker(expected_games=1, status_interval=0) as broker:
        game = threading.Thread(
            target=run_sim_game, args=(broker.address,), kwargs={"n_movers": 3, "n_pickers": 0}, daemon=True
        )
        game.start()
        with pytest.raises(ValueError, match="exactly one agent"):
            BrokerEnv("mover", broker.address)
    game.join(timeout=10)


def test_in_process_vec_env_trains_without_a_socket() -> None:
    with InProcessBroker(expected_games=1, status_interval=0) as broker:
        game = threading.Thread(
            target=run_sim_game, args=(broker.address,), kwargs={"n_movers": 8, "n_pickers": 0}, daemon=True
        )
        game.start()
        env = broker.vec_env("mover")
        assert type(env._link).__name__ == "InProcessTrainerLink"
        model = PPO("MultiInputPolicy", VecMonitor(env), n_steps=32, batch_size=64, n_epochs=1, seed=0)
        model.learn(total_timesteps=32 * 8 * 4)
        assert model.num_timesteps == 32 * 8 * 4
        env.close()
    game.join(timeout=10)
