"""Frozen-group inference against a trainer-served group, in one run: agent-steps/s of one group of 225
agents with MAgent2-battle-sized observations (13x13x5 floats, 21 discrete actions).

    python -m benchmarks.frozen_throughput [--agents 225] [--measure-s 10] [--out results.json]

Both cases run the same policy (a PPO MultiInputPolicy, exported to ONNX for the frozen case) against
the same game, one after the other: a game in this process sends random observations for the group and
steps as soon as the broker answers (barrier stepping: every tick waits for that group's actions), the
broker is a ``gdrl-broker serve`` subprocess, and the group is answered either

* ``frozen``: by the broker itself (``--frozen GROUP=model.onnx``, onnxruntime off the event loop), or
* ``trainer``: by a ``gdrl-train --inference`` subprocess (SB3's deterministic ``predict`` in torch).

It prints one JSON line per case and the ratio; it asserts nothing about speed (CI runs it only as a smoke).
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from broker.protocol.messages import StepData
from broker.protocol.spaces import BoxSpace, DiscreteAction, GroupSpec, PolicySpaces

GROUP = "frozen_bench"
SPACES = PolicySpaces((("grid", BoxSpace((13, 13, 5), "float32", 0.0, 1.0)),), (("move", DiscreteAction(21)),))


def make_model(folder: Path) -> tuple[Path, Path]:
    """A PPO policy on the group's spaces (untrained: inference costs the same), saved and exported."""
    import gymnasium as gym
    from stable_baselines3 import PPO

    from clients.onnx_export import export_onnx
    from clients.spaces import ActionCodec, observation_dict

    class Spaces(gym.Env[Any, Any]):
        observation_space = observation_dict(SPACES)
        action_space = ActionCodec(SPACES).space

    model = PPO("MultiInputPolicy", Spaces(), n_steps=64, batch_size=64, seed=0, device="cpu")
    model.save(folder / "bench.zip")
    export_onnx(model, folder / "bench.onnx", SPACES, policy_name=GROUP)
    return folder / "bench.zip", folder / "bench.onnx"


class Game:
    """One game of ``n`` agents in a thread, counting ticks answered."""

    def __init__(self, address: str, n: int) -> None:
        from clients.game import GameClient

        rng = np.random.default_rng(0)
        self.observations = [rng.random((n, 13, 13, 5), dtype=np.float32) for _ in range(4)]
        self.n = n
        self.ticks = 0
        self.stop = threading.Event()
        self.client = GameClient(address, [GroupSpec(GROUP, n, SPACES)], name="bench-game", timeout_connect=60)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _data(self) -> dict[str, StepData]:
        zeros, flags = np.zeros(self.n, np.float32), np.zeros(self.n, np.bool_)
        return {GROUP: StepData({"grid": self.observations[self.ticks % 4]}, zeros, flags, flags)}

    def _apply(self, actions: dict[str, dict[str, np.ndarray]]) -> dict[str, StepData]:
        if self.stop.is_set():
            raise StopIteration
        self.ticks += 1
        return self._data()

    def _run(self) -> None:
        try:
            self.client.play(self._data(), self._apply)
        except StopIteration:
            pass
        finally:
            self.client.close()


def serve(folder: Path, *flags: str) -> tuple[subprocess.Popen[bytes], str]:
    port_file = folder / f"port-{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "broker", "serve", "--port", "0", "--port-file", str(port_file), "--stepping"]
    proc = subprocess.Popen([*cmd, "barrier", "--log-level", "warning", *flags])
    deadline = time.monotonic() + 60
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("broker did not start")
        time.sleep(0.05)
    return proc, f"127.0.0.1:{port_file.read_text()}"


def measure(address: str, n: int, warmup_s: float, measure_s: float) -> dict[str, float]:
    game = Game(address, n)
    deadline = time.monotonic() + 120
    while game.ticks == 0:  # the trainer process is still importing torch: not part of its speed
        if time.monotonic() > deadline:
            raise RuntimeError("the group was never answered")
        time.sleep(0.05)
    time.sleep(warmup_s)
    start_ticks, started = game.ticks, time.monotonic()
    time.sleep(measure_s)
    ticks, elapsed = game.ticks - start_ticks, time.monotonic() - started
    game.stop.set()
    game.thread.join(timeout=30)
    return {"ticks_per_s": ticks / elapsed, "agent_steps_per_s": ticks * n / elapsed, "ticks": ticks}


def stop(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run(n: int, warmup_s: float, measure_s: float) -> dict[str, Any]:
    results: dict[str, Any] = {"agents": n, "obs": "13x13x5 float32", "actions": "discrete(21)"}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        zip_path, onnx_path = make_model(folder)
        broker, address = serve(folder, "--frozen", f"{GROUP}={onnx_path}")
        try:
            results["frozen"] = measure(address, n, warmup_s, measure_s)
        finally:
            stop(broker)
        print(json.dumps({"case": "frozen", **results["frozen"]}), flush=True)
        broker, address = serve(folder)
        trainer = subprocess.Popen(
            [
                *(sys.executable, "-m", "clients.train", "--broker", address, "--policy", GROUP, "--inference"),
                *("--resume-model-path", str(zip_path), "--progress", "off"),
            ],
            stdout=subprocess.DEVNULL,
        )
        try:
            results["trainer"] = measure(address, n, warmup_s, measure_s)
        finally:
            stop(trainer)
            stop(broker)
        print(json.dumps({"case": "trainer", **results["trainer"]}), flush=True)
    results["frozen_over_trainer"] = results["frozen"]["agent_steps_per_s"] / results["trainer"]["agent_steps_per_s"]
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=225)
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--measure-s", type=float, default=10.0)
    parser.add_argument("--out", default=None, help="also write the results here (JSON)")
    args = parser.parse_args(argv)
    results = run(args.agents, args.warmup_s, args.measure_s)
    print(json.dumps(results, indent=1), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
