"""Benchmark trainers: step random actions as fast as the other side answers and time every step.

    python -m benchmarks.trainers broker --address ADDR --policy p0      (one per policy, SB3 VecEnv)
    python -m benchmarks.trainers inprocess --config JSON                (broker + one thread per policy)
    python -m benchmarks.trainers godot_rl --ports P0,P1 [--label p0]   (godot_rl's own SB3 VecEnv, a port per game)

Each prints JSON lines on stdout: ``{"event": "ready", ...}`` once listening or connected, then one
``{"event": "result", ...}`` per policy when its window closes; it keeps stepping (unmeasured) until
stopped, so lock-step peers never wait on a trainer that already finished measuring.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
import time
import warnings
from typing import Any

import numpy as np

from benchmarks.configs import ACTION_SIZE, MIN_STEPS, BenchConfig
from benchmarks.measure import Meter, emit
from broker.log import configure_logging


def _actions(n_envs: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1, 1, (n_envs, ACTION_SIZE)).astype(np.float32)


def step_vec_env(env: Any, meter: Meter, seed: int) -> None:
    """SB3's rollout loop without the policy: reset once, then step_async / step_wait."""
    from clients.errors import BrokerError

    actions = _actions(env.num_envs, seed)
    try:
        env.reset()
        while True:
            started = time.perf_counter()
            env.step_async(actions)
            env.step_wait()
            meter.record(started, time.perf_counter())
    except BrokerError:
        return


def run_broker(address: str, policy: str, warmup_s: float, measure_s: float, socket_only: bool = False) -> None:
    from clients.vec_env import BrokerVecEnv

    # socket_only: the mode broker_socket, large batches through the socket instead of the shared-memory ring
    extra: dict[str, Any] = {"ring_bytes": 0} if socket_only else {}
    env = BrokerVecEnv(policy, address, name=f"bench-trainer-{policy}", **extra)
    emit({"event": "ready", "policy": policy, "n_envs": env.num_envs})
    step_vec_env(env, Meter(warmup_s, measure_s, MIN_STEPS, env.num_envs, policy), seed=int(policy[1:]))


def run_inprocess(config: BenchConfig, warmup_s: float, measure_s: float) -> None:
    from clients.inprocess import InProcessBroker

    settings: dict[str, Any] = {"expected_games": config.games, "status_interval": 0, "stepping": "barrier"}
    try:  # one VecEnv per policy in this process, as a user training them all here would say
        broker = InProcessBroker(**settings, local_trainers=len(config.policy_names))
    except TypeError:  # an older core (benchmarks/ab_core.py) has no such choice
        broker = InProcessBroker(**settings)
    # The broker's daemon thread: with one policy it runs the loop only while no trainer waits in step_wait
    # (the broker's work on the trainer's thread counts with the trainer's); with several it runs it always.
    # An older core (benchmarks/ab_core.py) kept its daemon thread as ``_thread``.
    daemon = broker.server_thread if hasattr(broker, "server_thread") else broker._thread  # type: ignore[attr-defined]
    emit({"event": "ready", "port": broker.server.port, "broker_tid": daemon.native_id})

    def trainer(policy: str, seed: int) -> None:
        env = broker.vec_env(policy, name=f"bench-trainer-{policy}")
        step_vec_env(env, Meter(warmup_s, measure_s, MIN_STEPS, env.num_envs, policy), seed)

    threads = [
        threading.Thread(target=trainer, args=(name, j), daemon=True) for j, name in enumerate(config.policy_names)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def run_godot_rl(ports: list[int], warmup_s: float, measure_s: float, label: str = "godot_rl") -> None:
    """What users have today: godot_rl's GodotEnv per game, stepped by its StableBaselinesGodotEnv.step.

    One of these per policy (each on its own ports) is how godot_rl users train several policies with SB3."""
    from godot_rl.core.godot_env import GodotEnv
    from godot_rl.wrappers.stable_baselines_wrapper import StableBaselinesGodotEnv

    emit({"event": "ready"})
    with contextlib.redirect_stdout(sys.stderr), warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)  # godot_rl never closes its listening socket
        envs = [GodotEnv(env_path=None, port=port, seed=i, convert_action_space=True) for i, port in enumerate(ports)]
    # StableBaselinesGodotEnv refuses n_parallel > 1 without a game executable to launch; our games are
    # already running, so give it the connected envs and use its own step().
    venv = StableBaselinesGodotEnv.__new__(StableBaselinesGodotEnv)
    venv.envs = envs
    venv.n_parallel = len(envs)
    venv.results = None
    n_envs = venv.num_envs
    meter = Meter(warmup_s, measure_s, MIN_STEPS, n_envs, label)
    actions = _actions(n_envs, 0)
    try:
        venv.reset()
        while True:
            started = time.perf_counter()
            venv.step(actions)
            meter.record(started, time.perf_counter())
    except (ConnectionError, OSError, ValueError):
        return


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("kind", choices=("broker", "inprocess", "godot_rl"))
    parser.add_argument("--address", help="broker: host:port or unix:/path")
    parser.add_argument("--policy", help="broker: the policy to train")
    parser.add_argument("--ports", help="godot_rl: one port per game, comma-separated")
    parser.add_argument("--config", help="inprocess: a BenchConfig as JSON")
    parser.add_argument("--label", default="godot_rl", help="godot_rl: what the result is called")
    parser.add_argument("--socket-only", action="store_true", help="broker: no shared-memory ring")
    parser.add_argument("--warmup", type=float, default=0.5)
    parser.add_argument("--measure", type=float, default=2.0)
    args = parser.parse_args()
    configure_logging(level="warning")
    if args.kind == "broker":
        run_broker(args.address, args.policy, args.warmup, args.measure, args.socket_only)
    elif args.kind == "inprocess":
        run_inprocess(BenchConfig.from_json(json.loads(args.config)), args.warmup, args.measure)
    else:
        run_godot_rl([int(p) for p in args.ports.split(",")], args.warmup, args.measure, args.label)


if __name__ == "__main__":
    main()
