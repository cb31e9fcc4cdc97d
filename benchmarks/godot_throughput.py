"""Decisions per second of the same Godot game through BrokerSync and through godot_rl's own plugin (issue #17).

One headless Godot instance of the one-policy variant of the two-policy example (2 lanes: 2 `player` agents; the
platforms stand still), random actions, at --speedup 8 and 32 and action_repeat 1 and 4, three ways:

* ``broker_sync``: this addon's BrokerSync + ``gdrl-broker serve --stepping barrier`` + BrokerVecEnv;
* ``plugin_direct``: godot_rl_agents' Sync node + godot_rl's own StableBaselinesGodotEnv (no broker);
* ``plugin_broker``: godot_rl_agents' Sync node + the broker + BrokerVecEnv (the legacy path);
* ``broker_sync_inprocess``: BrokerSync + the broker inside the trainer's process (``InProcessBroker``, barrier):
  one hop, as godot_rl's own.

A decision is one VecEnv step: one decision tick of the game, an action for each of its 2 agents. Each cell is
steps counted over ``--seconds`` after ``--warmup`` seconds, the median of ``--rounds`` rounds that run every
mode in turn; all cells run in one invocation, so the ratios compare like with like on this machine. Not a
test: ``tests/test_godot_e2e.py`` runs ``--quick`` as a smoke.

    GODOT_BIN=... python -m benchmarks.godot_throughput [--seconds 4] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from tests.godot_engine import EXAMPLES, find_godot, prepare_project

ROOT = Path(__file__).resolve().parents[1]

SPEEDUPS = (8, 32)
ACTION_REPEATS = (1, 4)
MODES = ("broker_sync", "plugin_direct", "plugin_broker", "broker_sync_inprocess")
SCENES = {"broker_sync": "res://one_policy.tscn", "plugin_direct": "res://one_policy_sync.tscn"}
SCENES["plugin_broker"] = SCENES["plugin_direct"]
SCENES["broker_sync_inprocess"] = SCENES["broker_sync"]
POLICY = "player"


def python_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@contextmanager
def running(argv: list[str], log: Path, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    with open(log, "ab") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@contextmanager
def broker(work: Path) -> Iterator[str]:
    port_file = work / f"port-{time.monotonic_ns()}"
    argv = [sys.executable, "-m", "broker", "serve", "--port", "0", "--port-file", str(port_file)]
    argv += ["--games", "1", "--stepping", "barrier", "--status-interval", "0"]
    with running(argv, work / "broker.log", python_env()) as process:
        deadline = time.monotonic() + 30
        while not port_file.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"broker did not start: {(work / 'broker.log').read_text()}")
            time.sleep(0.05)
        yield port_file.read_text().strip()


def measure(step: Callable[[], None], warmup: float, seconds: float) -> float:
    end_warmup = time.monotonic() + warmup
    while time.monotonic() < end_warmup:
        step()
    steps, started = 0, time.monotonic()
    while time.monotonic() - started < seconds:
        step()
        steps += 1
    return steps / (time.monotonic() - started)


def random_stepper(env: Any) -> Callable[[], None]:
    rng = np.random.default_rng(0)
    n = env.num_envs
    low, high = env.action_space.low, env.action_space.high

    def step() -> None:
        env.step(rng.uniform(low, high, (n, *env.action_space.shape)).astype(np.float32))

    return step


def game_argv(godot: Path, project: Path, mode: str, port: int | str, speedup: int, action_repeat: int) -> list[str]:
    return [
        str(godot),
        "--headless",
        "--path",
        str(project),
        SCENES[mode],
        f"--port={port}",
        f"--speedup={speedup}",
        f"--action_repeat={action_repeat}",
        "--env_seed=1",
    ]


def run_cell(
    godot: Path, project: Path, work: Path, mode: str, speedup: int, action_repeat: int, warmup: float, seconds: float
) -> float:
    log = work / f"{mode}-{speedup}-{action_repeat}.log"
    if mode == "plugin_direct":
        from godot_rl.wrappers.stable_baselines_wrapper import StableBaselinesGodotEnv

        direct_port = free_port()
        # The plugin waits 1 s before it dials; godot_rl's env binds and accepts meanwhile.
        with running(game_argv(godot, project, mode, direct_port, speedup, action_repeat), log):
            env = StableBaselinesGodotEnv(env_path=None, port=direct_port)
            try:
                env.reset()
                return measure(random_stepper(env), warmup, seconds)
            finally:
                env.close()
    if mode == "broker_sync_inprocess":
        from clients.inprocess import InProcessBroker

        with InProcessBroker(stepping="barrier", status_interval=0) as inprocess:
            port = inprocess.address.rsplit(":", 1)[1]
            with running(game_argv(godot, project, mode, port, speedup, action_repeat), log):
                vec = inprocess.vec_env(POLICY)
                try:
                    vec.reset()
                    return measure(random_stepper(vec), warmup, seconds)
                finally:
                    vec.close()
    from clients.vec_env import BrokerVecEnv

    with broker(work) as port, running(game_argv(godot, project, mode, port, speedup, action_repeat), log):
        vec = BrokerVecEnv(POLICY, f"127.0.0.1:{port}")
        try:
            vec.reset()
            return measure(random_stepper(vec), warmup, seconds)
        finally:
            vec.close()


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def engine_version(godot: Path) -> str:
    return subprocess.run([str(godot), "--version"], capture_output=True, text=True, timeout=60).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="measured seconds per cell and round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every mode per setting (median)")
    parser.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds first")
    parser.add_argument("--quick", action="store_true", help="one setting (speedup 8, action_repeat 4), 1 s cells")
    parser.add_argument("--json", default=None, help="write the table here as JSON")
    args = parser.parse_args(argv)
    godot = find_godot()
    if godot is None:
        parser.error("no Godot engine: set GODOT_BIN to a Godot 4.2+ editor binary")
    speedups, repeats = ((8,), (4,)) if args.quick else (SPEEDUPS, ACTION_REPEATS)
    if args.quick:
        args.seconds, args.warmup, args.rounds = 1.0, 0.5, 1
    with tempfile.TemporaryDirectory(prefix="godot_throughput-") as tmp:
        work = Path(tmp)
        project = prepare_project(
            godot,
            EXAMPLES / "two_policies",
            work / "project",
            plugin_addon=True,
            overlay=EXAMPLES / "two_policies_plugin_sync",
        )
        rows = []
        for action_repeat in repeats:
            for speedup in speedups:
                # Rounds of all modes in turn, median per mode: a load change on a shared machine hits every mode.
                samples: dict[str, list[float]] = {m: [] for m in MODES}
                for _ in range(args.rounds):
                    for m in MODES:
                        samples[m].append(
                            run_cell(godot, project, work, m, speedup, action_repeat, args.warmup, args.seconds)
                        )
                rates = {m: float(np.median(samples[m])) for m in MODES}
                rows.append({"action_repeat": action_repeat, "speedup": speedup, **rates})
                print(json.dumps(rows[-1]), flush=True)
    result = {
        "engine": engine_version(godot),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        "rows": rows,
    }
    print_table(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


def print_table(result: dict[str, Any]) -> None:
    print(f"\nGodot {result['engine']}; {result['machine']}")
    print(
        "| action_repeat | --speedup | BrokerSync + broker | BrokerSync + in-process broker | plugin Sync + godot_rl "
        "| plugin Sync + broker | BrokerSync / plugin direct | BrokerSync / plugin via broker "
        "| BrokerSync in-process / plugin direct | verdict |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in result["rows"]:
        direct = row["broker_sync"] / row["plugin_direct"]
        via = row["broker_sync"] / row["plugin_broker"]
        inprocess = row.get("broker_sync_inprocess", 0.0)
        one_hop = inprocess / row["plugin_direct"]
        worst = min(direct, via)
        # Within 2 %: both run at the game's own tick rate (speedup x 60 / action_repeat); the rest is noise.
        verdict = "met" if worst >= 1.0 else "equal within 2 %" if worst >= 0.98 else f"missed by {1 - worst:.0%}"
        if worst < 0.98 and one_hop >= 0.98:
            verdict += f" over TCP; {'met' if one_hop >= 1.0 else 'equal within 2 %'} in-process (one hop)"
        print(
            f"| {row['action_repeat']} | {row['speedup']} | {row['broker_sync']:.0f} | {inprocess:.0f} "
            f"| {row['plugin_direct']:.0f} | {row['plugin_broker']:.0f} | {direct:.2f} | {via:.2f} | {one_hop:.2f} "
            f"| {verdict} |"
        )


if __name__ == "__main__":
    sys.exit(main())
