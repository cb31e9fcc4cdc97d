"""RLlib PPO (or APPO) training both policies of the simulated game through a broker (docs/scale_out.md).

Start a broker and its games, then this script::

    gdrl-broker serve --games 4 &
    for i in 0 1 2 3; do gdrl-broker sim-game --seed $i & done
    python examples/rllib_two_policies.py --env-runners 2 --claim-games 2 --iterations 20 --random-steps 240
    python examples/rllib_two_policies.py --algo appo --stepping barrier --claim-games 2 --iterations 24

(``--stepping barrier``: one game tick per transition however loaded the machine; docs/scale_out.md, APPO.)

Each env runner's ``BrokerMultiAgentEnv`` claims its own games from the broker on its node and steps both
groups of them; one RLModule per broker policy (``policy_mapping_fn``: the agent id's prefix). On a cluster
give every game host a resource (``ray start --resources='{"game_host": 1}'``) and pass
``--runner-resource game_host`` so that each env runner lands on a game host and dials its broker there.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from broker.protocol import DEFAULT_ADDRESS
from clients.rllib_env import BrokerMultiAgentEnv, policy_mapping_fn, policy_of
from clients.sim_game import MOVER, PICKER

ENV_NAME = "gdrl-broker"

APPO_BUFFER_BATCHES, APPO_PASSES = 4, 10


def appo_training(batch: int) -> dict[str, Any]:
    """APPO's training settings (RLlib 2.60, new API stack): its tuned pendulum_appo example (many passes over
    each batch, KL loss, lr) and what all its tuned examples share (entropy_coeff=0), fitted to a sampler that
    is slower than the learner."""
    return {
        "train_batch_size_per_learner": batch,
        "lr": 3e-4,
        "entropy_coeff": 0.0,  # PPO's default too; APPO's 0.01 pays the movers' Gaussian for widening
        "circular_buffer_num_batches": APPO_BUFFER_BATCHES,
        "circular_buffer_iterations_per_batch": APPO_PASSES,  # each batch is learned from 10 times, not 2
        # Counted in buffer batches x passes x batch trained env steps: here one env step, so that the target
        # policy (the clip's and the KL's reference) may follow at each new batch, like PPO's old policy; the
        # default (2, with 8 batches x 2 passes) waits for 32 batches' worth. RLlib counts trained steps from
        # the learner results it has read, so with the learner behind it followed rarely (docs/scale_out.md).
        "target_network_update_freq": 1 / (APPO_BUFFER_BATCHES * APPO_PASSES * batch),
        "use_kl_loss": True,
        "kl_coeff": 1.0,
        "kl_target": 0.04,
    }


# And batch_mode="complete_episodes": RLlib's V-trace loss ends every sampled chunk with a phantom step
# whose discount is 0, which cancels the chunk's bootstrap value (tests/test_rllib.py shows it), so a chunk
# cut mid-episode (truncate_episodes, every rollout_fragment_length steps) is learned as if the episode had
# ended there. This env's RLlib episodes last at most the longest game horizon (40 ticks), so sampling
# whole ones costs nothing.


def ppo_config(
    env_config: dict[str, Any],
    policies: Sequence[str] = (MOVER, PICKER),
    env_runners: int = 2,
    runner_resources: dict[str, float] | None = None,
    seed: int = 0,
    algo: str = "ppo",
) -> Any:
    """A PPOConfig (or, ``algo="appo"``, an APPOConfig: asynchronous sampling, recommended across nodes) for
    one module per policy over broker games (RLlib's new API stack)."""
    from ray.rllib.algorithms.appo import APPOConfig
    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.rllib.connectors.env_to_module import FlattenObservations
    from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig
    from ray.rllib.core.rl_module.multi_rl_module import MultiRLModuleSpec
    from ray.rllib.core.rl_module.rl_module import RLModuleSpec
    from ray.tune.registry import register_env

    register_env(ENV_NAME, lambda config: BrokerMultiAgentEnv(config))
    if algo == "appo":
        config: Any = (
            APPOConfig()
            .training(**appo_training(100 * env_runners))
            .env_runners(batch_mode="complete_episodes")  # see appo_training: no episode cut into chunks
        )
    else:
        config = PPOConfig().training(
            train_batch_size_per_learner=100 * env_runners, minibatch_size=50 * env_runners, num_epochs=4, lr=3e-4
        )
    return (
        config.environment(ENV_NAME, env_config=env_config)
        .env_runners(
            num_env_runners=env_runners,
            num_cpus_per_env_runner=0.5,  # stepping a broker session is light; leave the cores to the learner
            custom_resources_per_env_runner=runner_resources or {},
            env_to_module_connector=lambda env, spaces, device: FlattenObservations(multi_agent=True),
            rollout_fragment_length=50,
        )
        .multi_agent(policies=set(policies), policy_mapping_fn=policy_mapping_fn)
        .rl_module(
            rl_module_spec=MultiRLModuleSpec(
                rl_module_specs={
                    p: RLModuleSpec(model_config=DefaultModelConfig(fcnet_hiddens=[64, 64])) for p in policies
                }
            )
        )
        .fault_tolerance(restart_failed_env_runners=True)
        .debugging(seed=seed)
    )


def mean_agent_returns(result: dict[str, Any]) -> dict[str, float]:
    """Mean return per agent of each policy, from a training result (``agent_episode_returns_mean``)."""
    per_agent = result.get("env_runners", {}).get("agent_episode_returns_mean", {})
    totals: dict[str, list[float]] = {}
    for agent, value in per_agent.items():
        totals.setdefault(policy_of(agent), []).append(float(value))
    return {policy: sum(v) / len(v) for policy, v in totals.items()}


def random_returns(
    address: str, steps: int, claim: int | str = "all", seed: int = 0, stepping: str | None = None
) -> dict[str, list[float]]:
    """Returns per agent of finished (RLlib) episodes of uniformly random actions, per policy, through the env
    itself: the baseline measured by the same episode rule as training."""
    import numpy as np

    env = BrokerMultiAgentEnv({"broker": address, "claim_games": claim, "name": "random", "stepping": stepping})
    rng = np.random.default_rng(seed)
    finished: dict[str, list[float]] = {p: [] for p in env.spaces}
    action_spaces = dict(env.action_spaces or {})
    try:
        for space in action_spaces.values():
            space.seed(int(rng.integers(1 << 30)))
        obs, _ = env.reset()
        returns = dict.fromkeys(map(str, env.possible_agents), 0.0)
        for _ in range(steps):
            obs, rewards, terminateds, _truncateds, _infos = env.step(
                {agent: action_spaces[agent].sample() for agent in obs}
            )
            for agent, reward in rewards.items():
                returns[agent] += reward
            if terminateds["__all__"]:
                for agent, total in returns.items():
                    finished[policy_of(agent)].append(total)
                returns = dict.fromkeys(returns, 0.0)
                obs, _ = env.reset()
    finally:
        env.close()
    return finished


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def train(algo: Any, iterations: int) -> list[dict[str, float]]:
    """``algo.train()`` that many times; the mean return per agent of each policy, per iteration."""
    history = []
    for i in range(iterations):
        result = algo.train()
        history.append(mean_agent_returns(result))
        steps = result.get("env_runners", {}).get("num_env_steps_sampled_lifetime")
        learners = result.get("learners", {})
        targets = {p: v["num_target_updates"] for p, v in learners.items() if "num_target_updates" in v}  # APPO
        print(
            f"iteration {i + 1}: mean return per agent {history[-1]}, env steps {steps}"
            + (f", target policy updates {targets}" if targets else ""),
            flush=True,
        )
    return history


def export_onnx(address: str, modules: dict[str, Any], out_dir: str) -> None:
    from clients.rllib_env import export_module_onnx

    env = BrokerMultiAgentEnv({"broker": address, "claim_games": 1})  # for the game's spaces
    try:
        for policy, spaces in env.spaces.items():
            path = f"{out_dir}/{policy}.onnx"
            export_module_onnx(modules[policy], path, spaces, policy_name=policy)
            print("onnx:", path)
    finally:
        env.close()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--broker", default=DEFAULT_ADDRESS, help="the broker on each env runner's node")
    parser.add_argument("--env-runners", type=int, default=2)
    parser.add_argument("--claim-games", default="all", help="games per env runner, or 'all'")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--algo", choices=("ppo", "appo"), default="ppo")
    parser.add_argument("--runner-resource", default="", help="a custom resource each env runner needs")
    parser.add_argument("--checkpoint", default="", help="save the algorithm here at the end")
    parser.add_argument("--onnx-dir", default="", help="export one ONNX file per policy here at the end")
    parser.add_argument("--random-steps", type=int, default=0, help="first measure random actions (env steps)")
    parser.add_argument(
        "--stepping",
        choices=("hold", "barrier"),
        default=None,
        help="the games' stepping (default: the broker's, hold); barrier: one game tick per transition however "
        "slow the sampler, so returns compare across machines and with --random-steps",
    )
    args = parser.parse_args(argv)
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    import ray

    ray.init(ignore_reinit_error=True)
    random = {}
    if args.random_steps:  # before the env runners claim the games
        measured = random_returns(args.broker, args.random_steps, stepping=args.stepping)
        random = {p: _mean(v) for p, v in measured.items()}
        print(f"random actions: mean return per agent {random}", flush=True)
    claim = args.claim_games if args.claim_games == "all" else int(args.claim_games)
    resources = {args.runner_resource: 1.0} if args.runner_resource else None
    env_config = {"broker": args.broker, "claim_games": claim, "stepping": args.stepping}
    algo = ppo_config(env_config, env_runners=args.env_runners, runner_resources=resources, algo=args.algo).build_algo()
    history = train(algo, args.iterations)
    last = {p: _mean([h[p] for h in history[-3:] if p in h]) for p in (MOVER, PICKER)}
    print(f"random {random} -> trained (mean of the last 3 iterations) {last}", flush=True)
    if args.checkpoint:
        print("checkpoint:", algo.save_to_path(args.checkpoint))
    modules = {policy: algo.get_module(policy) for policy in (MOVER, PICKER)}
    algo.stop()  # the env runners release their games
    if args.onnx_dir:
        export_onnx(args.broker, modules, args.onnx_dir)


if __name__ == "__main__":
    main()
