"""PettingZoo ParallelEnv served through a real broker: fixed slots, dying agents, resets, per-group spaces.

``Skirmish`` is a tiny deterministic ParallelEnv: 3 scouts (Box obs, Discrete(3, start=-1) action) and
2 tanks (MultiDiscrete obs, Box action with bounds [0, 2] x [-10, 10]). Agents die at fixed steps, the
rest are truncated at the horizon, so every row of every step is known in advance. Exact tests run the
broker in barrier mode (lock-step); one test checks the default hold mode, where a group without an
answering trainer is held and its agents repeat their last actions.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gymnasium import spaces
from pettingzoo import ParallelEnv

from broker.protocol.spaces import BoxSpace, ContinuousAction, DiscreteAction, MultiDiscreteSpace
from clients.pettingzoo_game import ParallelEnvGame, serve_parallel_env
from clients.vec_env import BrokerVecEnv
from tests.helpers import broker_process, spawn_python

pytestmark = pytest.mark.timeout(90)  # a game thread that dies leaves the trainers waiting: fail, do not hang

SCOUTS = ["scout_0", "scout_1", "scout_2"]
TANKS = ["tank_0", "tank_1"]
TANK_LOW = np.array([0.0, -10.0], np.float32)
TANK_HIGH = np.array([2.0, 10.0], np.float32)
DEFAULT_DEATHS = {"scout_0": 2, "scout_1": 3, "tank_0": 4}  # agent -> step of its episode it dies at


class Skirmish(ParallelEnv):
    """Deterministic deaths; observations say who, when and which episode; every action is logged."""

    metadata = {"name": "skirmish_v0"}

    def __init__(self, deaths: dict[str, int] | None = None, horizon: int = 5) -> None:
        self.deaths = DEFAULT_DEATHS if deaths is None else deaths
        self.horizon = horizon
        self.possible_agents = SCOUTS + TANKS
        self.agents: list[str] = []
        self.t = 0
        self.episode = -1
        self.actions_log: list[dict[str, Any]] = []  # what step() received, one dict per step
        self._observation_spaces = {a: self._make_observation_space(a) for a in self.possible_agents}
        self._action_spaces = {a: self._make_action_space(a) for a in self.possible_agents}

    @staticmethod
    def _make_observation_space(agent: str) -> spaces.Space[Any]:
        if agent.startswith("scout"):
            return spaces.Box(-100.0, 100.0, (3,), np.float32)
        return spaces.MultiDiscrete([16, 2, 8])

    @staticmethod
    def _make_action_space(agent: str) -> spaces.Space[Any]:
        if agent.startswith("scout"):
            return spaces.Discrete(3, start=-1)
        return spaces.Box(TANK_LOW, TANK_HIGH, dtype=np.float32)

    def observation_space(self, agent: str) -> spaces.Space[Any]:
        return self._observation_spaces[agent]

    def action_space(self, agent: str) -> spaces.Space[Any]:
        return self._action_spaces[agent]

    def _obs(self, agent: str) -> np.ndarray:
        index = int(agent.split("_")[1])
        if agent.startswith("scout"):
            return np.array([index, self.t, self.episode], np.float32)
        return np.array([self.t % 16, index, self.episode % 8], np.int64)  # within MultiDiscrete([16, 2, 8])

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[dict, dict]:
        self.agents = list(self.possible_agents)
        self.t = 0
        self.episode += 1
        return {a: self._obs(a) for a in self.agents}, {a: {} for a in self.agents}

    def step(self, actions: dict[str, Any]) -> tuple[dict, dict, dict, dict, dict]:
        if set(actions) != set(self.agents):
            raise AssertionError(f"actions for {sorted(actions)}, live agents are {sorted(self.agents)}")
        self.actions_log.append(actions)
        self.t += 1
        obs = {a: self._obs(a) for a in self.agents}
        rewards = {a: scripted_reward(a, actions[a]) for a in self.agents}
        terminations = {a: self.deaths.get(a) == self.t for a in self.agents}
        truncations = {a: self.t >= self.horizon and not terminations[a] for a in self.agents}
        infos: dict[str, dict[str, Any]] = {a: {} for a in self.agents}
        if "tank_1" in infos:
            infos["tank_1"] = {"t": np.int64(self.t), "unsendable": object()}
        self.agents = [a for a in self.agents if not (terminations[a] or truncations[a])]
        return obs, rewards, terminations, truncations, infos


def scripted_reward(agent: str, action: Any) -> float:
    index = int(agent.split("_")[1])
    if agent.startswith("scout"):
        return 10.0 * index + float(action)
    return float(np.sum(action))


def make_skirmish() -> Skirmish:
    """Factory for the command-line test (``--env tests.test_pettingzoo_game:make_skirmish``)."""
    return Skirmish()


# --- helpers ----------------------------------------------------------------------------------------


class GameThread(threading.Thread):
    """``serve_parallel_env`` in a thread of this process; it ends when the broker closes."""

    def __init__(self, env: Any, address: str) -> None:
        super().__init__(name="pettingzoo-game", daemon=True)
        self.env, self.address = env, address
        self.errors: list[BaseException] = []
        self.start()

    def run(self) -> None:
        try:
            serve_parallel_env(lambda: self.env, self.address)
        except BaseException as exc:
            self.errors.append(exc)

    def finish(self) -> None:
        """Call after the broker stopped: the game must have ended cleanly by itself."""
        self.join(timeout=20)
        assert not self.is_alive(), "the game did not stop when the broker closed"
        assert not self.errors, self.errors


def step_both(envs: dict[str, BrokerVecEnv], actions: dict[str, np.ndarray]) -> dict[str, tuple]:
    """Lock-step: the game's tick needs both policies' actions, so send both, then wait for both."""
    for policy, venv in envs.items():
        venv.step_async(actions[policy])
    return {policy: venv.step_wait() for policy, venv in envs.items()}


def scout_row(index: int, t: int, episode: int) -> list[float]:
    return [index, t, episode]


def tank_row(index: int, t: int, episode: int) -> list[int]:
    return [t % 16, index, episode % 8]


ZERO_SCOUT = [0.0, 0.0, 0.0]
ZERO_TANK = [0, 0, 0]


def run_script(
    tmp_path: Path, env: Skirmish, steps: int, check: Callable[[int, dict[str, tuple]], None]
) -> dict[str, Any]:
    """Broker process + game thread + one VecEnv per policy over TCP; ``check(step, results)`` each step."""
    with broker_process(tmp_path, "--stepping", "barrier") as (_, address):
        game = GameThread(env, address)
        envs = {"scout": BrokerVecEnv("scout", address), "tank": BrokerVecEnv("tank", address)}
        first = {policy: venv.reset() for policy, venv in envs.items()}
        first_infos = {policy: venv.reset_infos for policy, venv in envs.items()}
        sent: list[dict[str, np.ndarray]] = []
        for step in range(1, steps + 1):
            actions = {
                "scout": np.array([(step + i) % 3 for i in range(3)]),
                "tank": np.array([[-1.0, 1.0], [0.5, -0.5 * (step % 2)]], np.float32),
            }
            sent.append(actions)
            check(step, step_both(envs, actions))
        spaces_seen = {
            policy: (venv.observation_space, venv.action_space, venv.num_envs) for policy, venv in envs.items()
        }
        for venv in envs.values():
            venv.close()
    game.finish()
    return {"first": first, "first_infos": first_infos, "sent": sent, "spaces": spaces_seen}


# --- tests ------------------------------------------------------------------------------------------


def test_skirmish_is_a_valid_parallel_env() -> None:
    with warnings.catch_warnings():  # pettingzoo.test imports its deprecated classic envs
        warnings.simplefilter("ignore", DeprecationWarning)
        from pettingzoo.test import parallel_api_test
    parallel_api_test(Skirmish(), num_cycles=20)


def test_groups_announce_their_own_spaces() -> None:
    game = ParallelEnvGame(Skirmish())
    specs = {spec.policy: spec for spec in game.group_specs()}
    assert list(specs) == ["scout", "tank"]
    assert specs["scout"].n_agents == 3 and specs["tank"].n_agents == 2
    assert specs["scout"].spaces.observation == (("obs", BoxSpace((3,), "float32", -100.0, 100.0)),)
    assert specs["scout"].spaces.action == (("action", DiscreteAction(3)),)
    assert specs["tank"].spaces.observation == (("obs", MultiDiscreteSpace((16, 2, 8))),)
    assert specs["tank"].spaces.action == (("action", ContinuousAction(2)),)


def test_dying_agents_keep_their_slots_until_the_episode_resets(tmp_path: Path) -> None:
    env = Skirmish()
    log: list[dict[str, tuple]] = []
    out = run_script(tmp_path, env, steps=7, check=lambda step, results: log.append(results))

    # Announced spaces reach each trainer as its own gymnasium spaces.
    scout_obs, scout_act, n_scouts = out["spaces"]["scout"]
    tank_obs, tank_act, n_tanks = out["spaces"]["tank"]
    assert (n_scouts, n_tanks) == (3, 2)
    assert scout_obs["obs"] == spaces.Box(-100.0, 100.0, (3,), np.float32) and scout_act == spaces.Discrete(3)
    assert tank_obs["obs"] == spaces.MultiDiscrete([16, 2, 8]) and tank_act == spaces.Box(-1, 1, (2,), np.float32)
    assert out["first"]["scout"]["obs"].tolist() == [scout_row(i, 0, 0) for i in range(3)]
    assert out["first"]["tank"]["obs"].tolist() == [tank_row(i, 0, 0) for i in range(2)]
    assert all(info == {} for info in out["first_infos"]["scout"])

    # Episode 0: scout_0 dies at t=2, scout_1 at t=3, tank_0 at t=4; the rest are truncated at t=5.
    expected_dead = {1: set(), 2: {"scout_0"}, 3: {"scout_0", "scout_1"}, 4: {"scout_0", "scout_1", "tank_0"}}
    for t in range(1, 5):
        s_obs, s_rew, s_done, s_info = log[t - 1]["scout"]
        k_obs, k_rew, k_done, k_info = log[t - 1]["tank"]
        dead = expected_dead[t]
        died_now = dead - expected_dead.get(t - 1, set())
        assert s_obs["obs"].tolist() == [ZERO_SCOUT if a in dead else scout_row(i, t, 0) for i, a in enumerate(SCOUTS)]
        assert k_obs["obs"].tolist() == [ZERO_TANK if a in dead else tank_row(i, t, 0) for i, a in enumerate(TANKS)]
        assert s_done.tolist() == [a in died_now for a in SCOUTS]
        assert k_done.tolist() == [a in died_now for a in TANKS]
        for agents, infos, obs_of in ((SCOUTS, s_info, scout_row), (TANKS, k_info, tank_row)):
            for i, agent in enumerate(agents):
                assert infos[i].get("active", True) == (agent not in dead), (t, agent, infos[i])
                if agent in died_now:  # reported once, with the observation it died with
                    assert infos[i]["terminal_observation"]["obs"].tolist() == obs_of(i, t, 0)
                    assert infos[i]["TimeLimit.truncated"] is False
                else:
                    assert "terminal_observation" not in infos[i]
        # Rewards: the living earn what they did; the dead earn nothing.
        sent = out["sent"][t - 1]
        for i, agent in enumerate(SCOUTS):
            was_alive = agent not in expected_dead.get(t - 1, set())
            want = scripted_reward(agent, int(sent["scout"][i]) - 1) if was_alive else 0.0
            assert s_rew[i] == pytest.approx(want)
        # Only live agents' actions reach the env, decoded into its own spaces.
        received = env.actions_log[t - 1]
        alive_before = [a for a in SCOUTS + TANKS if a not in expected_dead.get(t - 1, set())]
        assert sorted(received) == sorted(alive_before)
        for i, agent in enumerate(SCOUTS):
            if agent in received:
                assert received[agent] == int(sent["scout"][i]) - 1 and isinstance(received[agent], int)
        for i, agent in enumerate(TANKS):
            if agent in received:
                scaled = TANK_LOW + (sent["tank"][i] + 1.0) / 2.0 * (TANK_HIGH - TANK_LOW)
                np.testing.assert_allclose(received[agent], scaled, rtol=1e-6)
                assert received[agent].dtype == np.float32 and received[agent].shape == (2,)
    assert k_info[1]["t"] == 4 and "unsendable" not in k_info[1]  # plain info values pass, others are dropped

    # t=5: scout_2 and tank_1 truncated -> the env resets. They get final obs + the next episode's first;
    # the agents held inactive get their new observation with no second episode end.
    s_obs, s_rew, s_done, s_info = log[4]["scout"]
    k_obs, k_rew, k_done, k_info = log[4]["tank"]
    assert s_done.tolist() == [False, False, True] and k_done.tolist() == [False, True]
    assert s_obs["obs"].tolist() == [scout_row(i, 0, 1) for i in range(3)]
    assert k_obs["obs"].tolist() == [tank_row(i, 0, 1) for i in range(2)]
    assert s_info[2]["terminal_observation"]["obs"].tolist() == scout_row(2, 5, 0)
    assert k_info[1]["terminal_observation"]["obs"].tolist() == tank_row(1, 5, 0)
    assert s_info[2]["TimeLimit.truncated"] is True and k_info[1]["TimeLimit.truncated"] is True
    assert [info.get("active", True) for info in s_info + k_info] == [True] * 5
    assert s_rew.tolist()[:2] == [0.0, 0.0]
    tank_1_action = TANK_LOW + (out["sent"][4]["tank"][1] + 1.0) / 2.0 * (TANK_HIGH - TANK_LOW)
    assert k_rew.tolist() == pytest.approx([0.0, float(np.sum(tank_1_action))])

    # Episode 1 runs with every slot live again.
    for t in (6, 7):
        s_obs, _, s_done, s_info = log[t - 1]["scout"]
        k_obs, _, k_done, _ = log[t - 1]["tank"]
        episode_t = t - 5
        dead = expected_dead[episode_t]
        assert s_obs["obs"].tolist() == [
            ZERO_SCOUT if a in dead else scout_row(i, episode_t, 1) for i, a in enumerate(SCOUTS)
        ]
        assert k_obs["obs"].tolist() == [tank_row(i, episode_t, 1) for i in range(2)]
    assert sorted(env.actions_log[5]) == sorted(SCOUTS + TANKS)
    assert env.episode == 1


def test_reset_when_the_last_agents_die_together(tmp_path: Path) -> None:
    # scout_0 dies at t=1; everyone else dies at t=3 (no truncation): the env resets on termination.
    deaths = {"scout_0": 1, "scout_1": 3, "scout_2": 3, "tank_0": 3, "tank_1": 3}
    env = Skirmish(deaths=deaths, horizon=100)
    log: list[dict[str, tuple]] = []
    run_script(tmp_path, env, steps=4, check=lambda step, results: log.append(results))
    s_obs, _, s_done, s_info = log[0]["scout"]
    assert s_done.tolist() == [True, False, False] and s_info[0]["active"] is False
    _, _, s_done, s_info = log[1]["scout"]
    assert s_done.tolist() == [False, False, False]  # reported once only
    s_obs, _, s_done, s_info = log[2]["scout"]
    k_obs, _, k_done, k_info = log[2]["tank"]
    assert s_done.tolist() == [False, True, True] and k_done.tolist() == [True, True]
    assert s_obs["obs"].tolist() == [scout_row(i, 0, 1) for i in range(3)]
    assert k_obs["obs"].tolist() == [tank_row(i, 0, 1) for i in range(2)]
    assert [s_info[i]["TimeLimit.truncated"] for i in (1, 2)] == [False, False]
    assert s_info[1]["terminal_observation"]["obs"].tolist() == scout_row(1, 3, 0)
    assert k_info[0]["terminal_observation"]["obs"].tolist() == tank_row(0, 3, 0)
    assert "terminal_observation" not in s_info[0] and s_info[0].get("active", True)
    _, _, s_done, _ = log[3]["scout"]
    assert s_done.tolist() == [True, False, False]  # episode 1: scout_0 dies at its t=1 again
    assert env.episode == 1


class Ghostly(Skirmish):
    """Not quite PettingZoo-conforming: keeps reporting observations of the dead."""

    def step(self, actions: dict[str, Any]) -> tuple[dict, dict, dict, dict, dict]:
        _, rewards, terminations, truncations, infos = super().step(actions)
        return {a: self._obs(a) for a in self.possible_agents}, rewards, terminations, truncations, infos


def test_the_dead_stay_inactive_even_if_the_env_still_reports_them() -> None:
    game = ParallelEnvGame(Ghostly())  # sans-IO: the adapter alone, driven like the broker would
    game.first_step()
    zero_actions: dict[str, dict[str, np.ndarray]] = {
        "scout": {"action": np.zeros(3, np.int32)},
        "tank": {"action": np.zeros((2, 2), np.float32)},
    }
    for _ in range(3):
        out = game.apply(zero_actions)
    assert out["scout"].obs["obs"].tolist() == [ZERO_SCOUT, ZERO_SCOUT, scout_row(2, 3, 0)]
    assert out["scout"].infos == {0: {"active": False}, 1: {"active": False}}
    assert sorted(game.env.actions_log[-1]) == ["scout_1", "scout_2", "tank_0", "tank_1"]  # scout_0 died at t=2


class Mixed(Skirmish):
    """scout_2 has a bigger observation than the other scouts."""

    def observation_space(self, agent: str) -> spaces.Space[Any]:
        if agent == "scout_2":
            return spaces.Box(-100.0, 100.0, (4,), np.float32)
        return super().observation_space(agent)


def test_one_group_must_share_spaces() -> None:
    with pytest.raises(ValueError, match=r"group 'scout': agents 'scout_0' and 'scout_2' have different observation"):
        ParallelEnvGame(Mixed())
    # Mapping the odd one to its own policy fixes it.
    policy_of = {a: a.split("_")[0] for a in SCOUTS + TANKS} | {"scout_2": "odd"}
    game = ParallelEnvGame(Mixed(), policy_of)
    assert [(s.policy, s.n_agents) for s in game.group_specs()] == [("scout", 2), ("odd", 1), ("tank", 2)]
    with pytest.raises(ValueError, match="agent 'tank_1' has no entry in policy_of"):
        ParallelEnvGame(Skirmish(), {a: "x" for a in SCOUTS + TANKS[:1]})


class TupleActions(Skirmish):
    def action_space(self, agent: str) -> spaces.Space[Any]:
        return spaces.Tuple((spaces.Discrete(2), spaces.Discrete(2)))


def test_unsupported_space_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"group 'scout': action space Tuple.* is not supported"):
        ParallelEnvGame(TupleActions())


def test_command_line_serves_several_games(tmp_path: Path) -> None:
    with broker_process(tmp_path, "--games", "2", "--stepping", "barrier") as (_, address):
        games = spawn_python(
            "-m", "clients.pettingzoo_game", "--env", "tests.test_pettingzoo_game:make_skirmish",
            "--address", address, "--games", "2",
        )  # fmt: skip
        try:
            envs = {"scout": BrokerVecEnv("scout", address), "tank": BrokerVecEnv("tank", address)}
            assert envs["scout"].num_envs == 6 and envs["tank"].num_envs == 4
            first = envs["scout"].reset()
            envs["tank"].reset()
            assert isinstance(first, dict) and first["obs"].tolist() == [scout_row(i, 0, 0) for i in range(3)] * 2
            for _ in range(5):
                results = step_both(envs, {"scout": np.zeros(6, np.int64), "tank": np.zeros((4, 2), np.float32)})
            assert results["scout"][2].tolist() == [False, False, True] * 2  # t=5 in both games: scout_2 truncated
            assert results["tank"][2].tolist() == [False, True] * 2
            for venv in envs.values():
                venv.close()
        except BaseException:
            games.kill()
            raise
    # The stopping broker tells the games to close: both game processes exit cleanly.
    assert games.wait(timeout=30) == 0


def test_two_ppo_trainers_at_once(inprocess_broker: Callable[..., Any]) -> None:
    from stable_baselines3 import PPO

    broker = inprocess_broker(stepping="barrier")
    env = Skirmish()
    game = GameThread(env, broker.address)
    venvs = {policy: broker.vec_env(policy) for policy in ("scout", "tank")}
    models = {policy: PPO("MultiInputPolicy", venv, n_steps=16, batch_size=16, n_epochs=1, seed=0)
              for policy, venv in venvs.items()}  # fmt: skip
    errors: list[BaseException] = []

    def learn(model: Any) -> None:
        try:
            model.learn(total_timesteps=16 * model.n_envs * 3)
        except BaseException as exc:
            errors.append(exc)

    # Lock-step: each policy's trainer must run at the same time as the other's.
    threads = [threading.Thread(target=learn, args=(model,)) for model in models.values()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    assert models["scout"].num_timesteps == 16 * 3 * 3 and models["tank"].num_timesteps == 16 * 2 * 3
    for venv in venvs.values():
        venv.close()
    broker.close()
    game.finish()
    assert len(env.actions_log) == 48  # one env step per PPO step of each trainer
    assert env.episode == 48 // 5


def test_held_group_repeats_its_last_actions(tmp_path: Path) -> None:
    # Hold mode (the broker's default): the tanks never get a trainer, so every tick holds them and they
    # repeat their last action, which is the all-zero wire action (the middle of their Box) since none came.
    env = Skirmish(deaths={}, horizon=1000)
    with broker_process(tmp_path) as (_, address):
        game = GameThread(env, address)
        scouts = BrokerVecEnv("scout", address)
        scouts.reset()
        for _ in range(5):
            scouts.step(np.full(3, 2))  # wire 2 = env action +1
        ticks_seen = len(env.actions_log)
        scouts.close()
    game.finish()
    assert ticks_seen >= 5
    log = env.actions_log[:ticks_seen]
    for actions in log:
        for tank in TANKS:
            np.testing.assert_allclose(actions[tank], (TANK_LOW + TANK_HIGH) / 2)
    scout_actions = [actions[scout] for actions in log for scout in SCOUTS]
    assert set(scout_actions) <= {-1, 1}  # wire 0 (held before the first act) or the trainer's +1
    assert scout_actions[-3:] == [1, 1, 1]


def test_magent2_battle_slots_stay_fixed(tmp_path: Path) -> None:
    battle_v4 = pytest.importorskip("magent2.environments.battle_v4")
    with broker_process(tmp_path, "--stepping", "barrier") as (_, address):
        game = GameThread(battle_v4.parallel_env(map_size=16, max_cycles=6), address)
        envs = {"red": BrokerVecEnv("red", address), "blue": BrokerVecEnv("blue", address)}
        n = envs["red"].num_envs
        assert n == envs["blue"].num_envs >= 2
        assert isinstance(envs["red"].observation_space, spaces.Dict)
        assert envs["red"].observation_space["obs"].shape == (13, 13, 5)
        assert envs["red"].action_space == spaces.Discrete(21)
        for venv in envs.values():
            venv.reset()
        rng = np.random.default_rng(0)
        ends: set[int] = set()
        for t in range(1, 13):
            results = step_both(envs, {policy: rng.integers(0, 21, n) for policy in envs})
            for obs, _, done, _ in results.values():
                assert obs["obs"].shape == (n, 13, 13, 5)
                if done.all():
                    ends.add(t)
        assert ends == {6, 12}  # max_cycles=6: the whole episode ends at steps 6 and 12, not in between
        for venv in envs.values():
            venv.close()
    game.finish()
