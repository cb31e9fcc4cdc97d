"""RLlib on the broker (clients/rllib_env.py, examples/rllib_two_policies.py): real Ray, real PPO, a real
broker and sim-game subprocesses. One Ray session for the single-broker tests (Ray's start-up is most of
their cost); the two-broker test starts a small local cluster of its own.

Learning is shown against the random policy measured in the same run, through the same environment, so the
same episode rule (an RLlib episode ends once every agent has ended a game episode): the mean return per
agent of the last iterations against that of uniformly random actions. Not a timed assertion anywhere.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

if os.environ.get("GDRL_REQUIRE_RLLIB") != "1":  # CI installs the [rllib] extra and sets it: never skipped there
    pytest.importorskip("ray.rllib", reason="needs the [rllib] extra: pip install -e '.[rllib]'")

import ray

from clients.rllib_env import BrokerMultiAgentEnv, export_module_onnx, policy_mapping_fn
from clients.sim_game import MOVER, PICKER
from examples.rllib_two_policies import mean_agent_returns, ppo_config
from examples.rllib_two_policies import random_returns as random_episode_returns
from tests.test_onnx_export import assert_plugin_contract, expected_width, plugin_decode
from tests.test_train import sim_broker

GAMES = [(4, 4)] * 4  # (movers, pickers) per game; each of the two env runners claims two
RANDOM_STEPS = 240
ITERATIONS = 8
MARGIN = {MOVER: 0.8, PICKER: 0.2}  # over the random policy's mean return per agent


def runner_games(runner: Any) -> list[int]:
    games: list[int] = runner.env.unwrapped.envs[0].unwrapped.games  # one env per runner (num_envs_per_env_runner)
    return games


def random_returns(address: str, steps: int) -> dict[str, float]:
    """Mean return per agent per (RLlib) episode of uniformly random actions, through the env itself."""
    finished = random_episode_returns(address, steps)
    assert all(len(finished[p]) >= 16 for p in (MOVER, PICKER)), {p: len(v) for p, v in finished.items()}
    return {p: float(np.mean(v)) for p, v in finished.items()}


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def test_env_contract_agent_ids_spaces_and_episode_ends(tmp_path: Path) -> None:
    with sim_broker(tmp_path, [(2, 3)]) as address:
        env = BrokerMultiAgentEnv({"broker": address, "claim_games": 1, "stepping": "barrier"})
        try:
            assert env.possible_agents == ["mover/0", "mover/1", "picker/0", "picker/1", "picker/2"]
            assert {policy_mapping_fn(a) for a in env.possible_agents} == {MOVER, PICKER}
            assert list(env.observation_spaces["picker/0"].spaces) == ["obs", "goal_side"]
            assert env.action_spaces["mover/1"].shape == (2,) and env.action_spaces["picker/2"].n == 3
            obs, _ = env.reset()
            assert set(obs) == set(env.possible_agents)
            ended: set[str] = set()
            for _ in range(60):
                actions = {a: env.action_spaces[a].sample() for a in obs}
                obs, rewards, terminateds, truncateds, infos = env.step(actions)
                assert not (set(obs) & ended)  # an ended agent is out until the episode ends for all
                for agent in set(terminateds) - {"__all__"}:
                    assert terminateds[agent] or truncateds[agent]
                    assert agent in obs and agent in rewards  # final observation and reward of that step
                    assert env.observation_spaces[agent].contains(obs[agent])
                    ended.add(agent)
                assert "frames" not in next(iter(infos.values()), {})  # barrier: one tick per transition
                if terminateds["__all__"]:
                    assert ended == set(env.possible_agents)
                    break
            else:
                raise AssertionError("no RLlib episode ended in 60 steps (horizons 40 and 20)")
        finally:
            env.close()


@pytest.mark.timeout(1200)  # about 5 min on the loaded 2-core machine; the default is 600 s
def test_two_brokers_runners_placed_per_broker_by_a_custom_resource(tmp_path: Path) -> None:
    """Two game hosts, as on a cluster: a local Ray cluster of a head and two nodes, each node with the
    ``game_host`` resource the env runners need and a marker resource naming its broker."""
    from ray.cluster_utils import Cluster

    assert not ray.is_initialized()
    for host in ("a", "b"):
        (tmp_path / host).mkdir()
    with sim_broker(tmp_path / "a", GAMES[:2]) as host_a, sim_broker(tmp_path / "b", GAMES[2:]) as host_b:
        random = {host: random_returns(host, RANDOM_STEPS) for host in (host_a, host_b)}
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
        try:
            for marker in ("broker_a", "broker_b"):
                cluster.add_node(num_cpus=1, resources={"game_host": 1, marker: 1})
            ray.init(address=cluster.address, configure_logging=False, log_to_driver=False)
            env_config = {"broker_by_resource": {"broker_a": host_a, "broker_b": host_b}, "claim_games": "all"}
            algo = ppo_config(env_config, env_runners=2, runner_resources={"game_host": 1}).build_algo()
            try:
                placed = algo.env_runner_group.foreach_env_runner(
                    lambda r: (r.env.unwrapped.envs[0].unwrapped.address, r.env.unwrapped.envs[0].unwrapped.games),
                    local_env_runner=False,
                )
                assert sorted(placed) == sorted([(host_a, [0, 1]), (host_b, [0, 1])])  # one runner per broker
                history = [mean_agent_returns(algo.train()) for _ in range(ITERATIONS)]
            finally:
                algo.stop()
        finally:
            ray.shutdown()
            cluster.shutdown()
    trained = {p: float(np.mean([h[p] for h in history[-3:]])) for p in (MOVER, PICKER)}
    baseline = {p: float(np.mean([r[p] for r in random.values()])) for p in (MOVER, PICKER)}
    print(f"two brokers: random {random}, trained (last 3 iterations) {trained}, first {history[0]}")
    for policy in (MOVER, PICKER):
        assert trained[policy] >= baseline[policy] + MARGIN[policy], (policy, random, history)


@pytest.mark.timeout(1200)  # about 5 min on the loaded 2-core machine; the default is 600 s
def test_ppo_two_env_runners_learn_both_policies_restart_and_export(tmp_path: Path, local_ray: None) -> None:
    with sim_broker(tmp_path, GAMES) as address:
        random = random_returns(address, RANDOM_STEPS)
        algo = ppo_config({"broker": address, "claim_games": 2}, env_runners=2).build_algo()
        try:
            claims = algo.env_runner_group.foreach_env_runner(runner_games, local_env_runner=False)
            assert sorted(g for games in claims for g in games) == [0, 1, 2, 3]  # each runner its own two
            history = []
            for _ in range(ITERATIONS):
                history.append(mean_agent_returns(algo.train()))
            trained = {p: float(np.mean([h[p] for h in history[-3:]])) for p in (MOVER, PICKER)}
            print(f"random {random}, trained (last 3 iterations) {trained}, first {history[0]}")
            for policy in (MOVER, PICKER):
                assert trained[policy] >= random[policy] + MARGIN[policy], (policy, random, history)

            # An env runner killed mid-run: RLlib restarts it, and its new env claims the freed games.
            pids = algo.env_runner_group.foreach_env_runner(lambda r: os.getpid(), local_env_runner=False)
            os.kill(pids[0], signal.SIGKILL)
            for _ in range(10):
                algo.train()
                if algo.env_runner_group.num_remote_worker_restarts() >= 1:
                    break
            assert algo.env_runner_group.num_remote_worker_restarts() >= 1
            algo.train()
            claims = algo.env_runner_group.foreach_env_runner(runner_games, local_env_runner=False)
            assert sorted(g for games in claims for g in games) == [0, 1, 2, 3], claims

            checkpoint = algo.save_to_path(str(tmp_path / "checkpoint"))
            modules = {p: algo.get_module(p) for p in (MOVER, PICKER)}
        finally:
            algo.stop()
        spaces_env = BrokerMultiAgentEnv({"broker": address, "claim_games": 1})
        spaces = dict(spaces_env.spaces)
        spaces_env.close()
    check_checkpoint_and_onnx(Path(checkpoint), modules, spaces, tmp_path)


def check_checkpoint_and_onnx(
    checkpoint: Path,
    modules: dict[str, Any],
    spaces: dict[str, Any],
    out: Path,
    module_dir: Path = Path("learner_group", "learner", "rl_module"),
) -> None:
    """Each module restored from ``checkpoint``, exported to ONNX, checked against the addon's contract, and
    run as the plugin runs it: the same action distribution inputs as the live module."""
    import torch
    from ray.rllib.core.rl_module.rl_module import RLModule
    from ray.rllib.utils.numpy import flatten_inputs_to_1d_tensor
    from ray.rllib.utils.spaces.space_utils import get_base_struct_from_space

    from clients.spaces import observation_dict

    for policy, module in modules.items():
        restored = RLModule.from_checkpoint(checkpoint / module_dir / policy)
        path = out / f"{policy}.onnx"
        export_module_onnx(restored, path, spaces[policy], policy_name=policy)
        width = expected_width(spaces[policy])
        assert_plugin_contract(path, spaces[policy], width)
        # the ONNX file, fed as the plugin feeds it, gives the live module's own action distribution inputs
        import onnxruntime as ort

        space = observation_dict(spaces[policy])
        space.seed(1)
        rows = [space.sample() for _ in range(8)]
        feeds = {k: np.stack([np.asarray(r[k], np.float32).reshape(-1) for r in rows]) for k in space.spaces}
        feeds["state_ins"] = np.ones(8, np.float32)
        output = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(["output"], feeds)[0]
        batched = {k: np.stack([r[k] for r in rows]) for k in space.spaces}  # as FlattenObservations sees them
        flat = flatten_inputs_to_1d_tensor(batched, get_base_struct_from_space(space))
        with torch.no_grad():
            live = module.forward_inference({"obs": torch.as_tensor(flat, dtype=torch.float32)})["action_dist_inputs"]
        np.testing.assert_allclose(output, live.numpy()[:, :width], atol=1e-4)
        action_space = {k: v.to_wire() for k, v in spaces[policy].action}
        assert all(plugin_decode(row, action_space) for row in output)


def test_onnx_export_of_fresh_modules_meets_the_addon_contract(tmp_path: Path) -> None:
    """The same export and checks as after training, on untrained PPO modules (no Ray session needed)."""
    from gymnasium.spaces import Box
    from ray.rllib.algorithms.ppo.torch.default_ppo_torch_rl_module import DefaultPPOTorchRLModule
    from ray.rllib.core.rl_module.rl_module import RLModuleSpec
    from ray.rllib.utils.spaces.space_utils import flatten_space

    from clients.sim_game import mover_spaces, picker_spaces
    from clients.spaces import ActionCodec, observation_dict

    spaces = {MOVER: mover_spaces(), PICKER: picker_spaces()}
    modules = {}
    for policy, policy_spaces in spaces.items():
        flat = flatten_space(observation_dict(policy_spaces))
        size = sum(int(np.prod(s.shape)) if s.shape else int(s.n) for s in flat)  # one-hot for discrete keys
        modules[policy] = RLModuleSpec(
            module_class=DefaultPPOTorchRLModule,
            observation_space=Box(-np.inf, np.inf, (size,), np.float32),
            action_space=ActionCodec(policy_spaces).space,
            model_config={"fcnet_hiddens": [16]},
        ).build()
        path = tmp_path / "checkpoint" / policy
        modules[policy].save_to_path(str(path))
    check_checkpoint_and_onnx(tmp_path / "checkpoint", modules, spaces, tmp_path, module_dir=Path())


def test_appo_samples_whole_episodes_because_rllib_vtrace_drops_a_cut_chunks_bootstrap() -> None:
    """Why the example's APPO samples complete episodes: RLlib 2.60's APPO learner appends a phantom step to
    every episode chunk (AddOneTsToEpisodesAndTruncate: reward 0, loss mask 0) and multiplies V-trace's
    discounts by the loss mask (appo_torch_learner.py); V-trace's recursion through that step cancels the
    value it bootstraps from, so a chunk cut mid-episode is learned as if its episode had ended there. An RLlib
    that keeps the bootstrap fails this test, and complete episodes are then no longer needed."""
    import torch
    from ray.rllib.algorithms.impala.torch.vtrace_torch_v2 import vtrace_torch
    from ray.rllib.connectors.learner import AddOneTsToEpisodesAndTruncate
    from ray.rllib.core.columns import Columns
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode

    gamma, bootstrap = 0.99, 10.0
    # two steps of an episode that goes on (neither terminated nor truncated): a chunk cut by the sampler
    chunk = SingleAgentEpisode(observations=[0, 1, 2], actions=[0, 1], rewards=[1.0, 1.0], len_lookback_buffer=0)
    chunk = chunk.to_numpy()
    batch: dict[str, Any] = {}
    AddOneTsToEpisodesAndTruncate()(rl_module=None, batch=batch, episodes=[chunk], shared_data={})
    (loss_mask,) = batch[Columns.LOSS_MASK].values()
    (terminated,) = batch[Columns.TERMINATEDS].values()

    def time_major(x: Any) -> torch.Tensor:  # [T, B=1]
        return torch.tensor(np.asarray(x, np.float32))[:, None]

    discounts = (1.0 - time_major(terminated)) * gamma * time_major(loss_mask)  # the learner's formula
    rewards = time_major(chunk.get_rewards())  # 1, 1 and the phantom step's 0
    values = time_major([0.0, 0.0, bootstrap])  # the phantom step repeats the last observation: its value
    logp = torch.zeros_like(rewards)  # on-policy: every importance ratio 1
    vs, advantages = vtrace_torch(
        target_action_log_probs=logp,
        behaviour_action_log_probs=logp,
        discounts=discounts,
        rewards=rewards,
        values=values,
        bootstrap_values=torch.zeros(1),
    )
    # bootstrapped, the last real step's target and advantage would be 1 + 0.99 * 10; they are the reward alone
    assert vs[1, 0].item() == pytest.approx(1.0) and advantages[1, 0].item() == pytest.approx(1.0)
    assert ppo_config({}, algo="appo").batch_mode == "complete_episodes"  # so no episode is cut into chunks
