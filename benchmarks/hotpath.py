"""CPU cost of one lock-step through the broker's code, without sockets or scheduling: for profiling.

Every component runs in this one thread, wired with in-memory byte pipes through the real sans-IO
connections: the benchmark game (``PeerConnection``), the broker (``BrokerConnection`` + ``Hub``) and one
``BrokerVecEnv`` per policy. A lock-step is: every VecEnv ``step_async``, the game's turn (actions in,
world update, step out), every VecEnv ``step_wait``. Next to it, the raw one-hop ceiling's work
(benchmarks/raw.py) on the same bytes.

    python -m benchmarks.hotpath --agents 400 --obs vec64 --policies 2 --steps 300 [--profile out.pstats]

Prints microseconds of CPU per lock-step for each side; with ``--profile`` the cProfile of the broker path.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from collections import deque
from typing import Any

import msgpack
import numpy as np

from benchmarks.configs import ACTION_KEY, ACTION_SIZE, BenchConfig, BenchWorld
from benchmarks.raw import _decode_step, _view, actions_frame, step_frame
from broker.core.effects import Effect, Send
from broker.core.flow import Hub
from broker.log import configure_logging
from broker.protocol import PROTOCOL_VERSION
from broker.protocol.connection import BrokerConnection, PeerConnection
from broker.protocol.messages import (
    Error,
    GameActions,
    GameStep,
    Hello,
    Message,
    StepOptions,
    TrainerAct,
    TrainerReset,
    Welcome,
)
from clients.vec_env import BrokerVecEnv

SIDE_SECONDS = {"game": 0.0, "broker": 0.0}  # CPU time of each side's work (the rest is the trainers')


class Pipe:
    """One direction of a connection: bytes written by one side, read by the other."""

    def __init__(self) -> None:
        self.chunks: deque[bytes] = deque()
        self.frames = 0
        self.bytes = 0

    def write(self, data: bytes) -> None:
        self.chunks.append(data)
        self.frames += 1
        self.bytes += len(data)

    def drain_into(self, receiver: BrokerConnection | PeerConnection) -> None:
        while self.chunks:
            receiver.receive_data(self.chunks.popleft())


class BrokerSide:
    """The hub's Link for one peer: encode with the broker's connection, write to the peer's pipe."""

    def __init__(self, label: str, to_peer: Pipe) -> None:
        self.label = label
        self.connection = BrokerConnection()
        self.to_peer = to_peer

    def send(self, message: Message) -> None:
        # As the server encodes (send_buffers: large read-only arrays by reference); the join stands in for
        # the copy its gather write makes into the kernel.
        self.to_peer.write(b"".join(self.connection.send_buffers(message)))

    def close(self, error: Error | None = None) -> None:
        raise RuntimeError(f"{self.label} closed: {error}")


def _handshake(peer: PeerConnection, broker: BrokerSide) -> Message:
    peer.receive_data(broker.connection.greeting())
    broker.connection.receive_data(peer.initial_bytes())
    hello = broker.connection.next_event()
    assert isinstance(hello, Hello)
    return hello


def deliver(effects: list[Effect]) -> None:
    """The hub's sends, written to the in-memory peers (lock-step barrier stepping arms no timers)."""
    for effect in effects:
        if isinstance(effect, Send):
            effect.peer.send(effect.message)  # type: ignore[attr-defined]


class MemoryTrainerLink:
    """A BrokerVecEnv's link: messages go through bytes into the hub synchronously."""

    def __init__(self, hub: Hub, policy: str) -> None:
        self.hub = hub
        self.from_broker = Pipe()
        self.to_broker = Pipe()  # counted only: the bytes go straight to the broker's connection
        self.broker = BrokerSide(f"trainer {policy}", self.from_broker)
        self.peer = PeerConnection(Hello("trainer", PROTOCOL_VERSION, f"t-{policy}", policy=policy))
        hello = _handshake(self.peer, self.broker)
        deliver(hub.handle(self.broker, hello))

    def send(self, message: Message) -> None:
        data = self.peer.send(message)
        self.to_broker.write(data)
        started = time.thread_time()
        self.broker.connection.receive_data(data)
        event = self.broker.connection.next_event()
        if isinstance(event, (TrainerAct, TrainerReset)):
            deliver(self.hub.handle(self.broker, event))
        SIDE_SECONDS["broker"] += time.thread_time() - started

    def recv(self) -> Message:
        self.from_broker.drain_into(self.peer)
        while True:
            message = self.peer.next_event()
            if message is None:
                raise RuntimeError("trainer would block: the lock-step order is wrong")
            if not isinstance(message, Welcome):
                return message

    def close(self, reason: str = "") -> None:
        pass


class MemoryGame:
    def __init__(self, hub: Hub, config: BenchConfig, index: int) -> None:
        self.world = BenchWorld(config, index)
        self.from_broker = Pipe()
        self.to_broker = Pipe()  # counted only
        self.broker = BrokerSide(f"game {index}", self.from_broker)
        self.peer = PeerConnection(Hello("game", PROTOCOL_VERSION, f"g{index}", groups=tuple(config.groups())))
        hello = _handshake(self.peer, self.broker)
        assert isinstance(hello, Hello)
        deliver(hub.handle(self.broker, hello))
        self.hub = hub

    def send_step(self) -> None:
        started = time.thread_time()
        data = self.peer.send(GameStep(self.world.tick, self.world.step_data()))
        self.to_broker.write(data)
        handed = time.thread_time()
        SIDE_SECONDS["game"] += handed - started
        self.broker.connection.receive_data(data)
        event = self.broker.connection.next_event()
        assert isinstance(event, GameStep)
        deliver(self.hub.handle(self.broker, event))
        SIDE_SECONDS["broker"] += time.thread_time() - handed

    def turn(self) -> None:
        started = time.thread_time()
        self.from_broker.drain_into(self.peer)
        while True:
            message = self.peer.next_event()
            if isinstance(message, GameActions):
                break
        self.world.apply(message.groups)
        SIDE_SECONDS["game"] += time.thread_time() - started
        self.send_step()


def broker_path(config: BenchConfig, steps: int, profile: str | None) -> tuple[float, dict[str, float]]:
    """CPU seconds per lock-step through game, broker and VecEnvs; frames and bytes per lock-step."""
    hub = Hub(config.games, stepping=StepOptions("barrier"), timers=False)
    links = [MemoryTrainerLink(hub, name) for name in config.policy_names]
    games = [MemoryGame(hub, config, i) for i in range(config.games)]
    envs = [BrokerVecEnv(name, link=link) for name, link in zip(config.policy_names, links, strict=True)]
    for game in games:
        game.send_step()
    rng = np.random.default_rng(0)
    actions = [rng.uniform(-1, 1, (env.num_envs, ACTION_SIZE)).astype(np.float32) for env in envs]
    for env in envs:
        env.reset()

    def lock_step() -> None:
        for env, action in zip(envs, actions, strict=True):
            env.step_async(action)
        for game in games:
            game.turn()
        for env in envs:
            env.step_wait()

    for _ in range(20):
        lock_step()
    pipes = {
        "game->broker": [g.to_broker for g in games],
        "broker->game": [g.from_broker for g in games],
        "trainer->broker": [link.to_broker for link in links],
        "broker->trainer": [link.from_broker for link in links],
    }
    before = {name: (sum(p.frames for p in ps), sum(p.bytes for p in ps)) for name, ps in pipes.items()}
    profiler = cProfile.Profile() if profile else None
    sides_before = dict(SIDE_SECONDS)
    started = time.thread_time()
    if profiler:
        profiler.enable()
    for _ in range(steps):
        lock_step()
    if profiler:
        profiler.disable()
    elapsed = time.thread_time() - started
    traffic = {f"{side} us": (SIDE_SECONDS[side] - sides_before[side]) / steps * 1e6 for side in SIDE_SECONDS}
    traffic["trainers us"] = (elapsed / steps * 1e6) - traffic["game us"] - traffic["broker us"]
    for name, ps in pipes.items():
        traffic[f"{name} frames"] = (sum(p.frames for p in ps) - before[name][0]) / steps
        traffic[f"{name} bytes"] = (sum(p.bytes for p in ps) - before[name][1]) / steps
    if profiler and profile:
        profiler.dump_stats(profile)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    return elapsed / steps, traffic


def raw_path(config: BenchConfig, steps: int) -> float:
    """CPU seconds per lock-step of the raw ceiling's work on the same bytes."""
    worlds = [BenchWorld(config, i) for i in range(config.games)]
    rng = np.random.default_rng(0)
    actions = {n: rng.uniform(-1, 1, (config.agents, ACTION_SIZE)).astype(np.float32) for n in config.policy_names}

    def lock_step(tick: int) -> None:
        frame = actions_frame(tick, actions)
        for world in worlds:
            message: Any = msgpack.unpackb(memoryview(frame)[4:], raw=False, strict_map_key=False)
            world.apply({n: {ACTION_KEY: _view(g[ACTION_KEY])} for n, g in message["groups"].items()})
            step = step_frame(world)
            _decode_step(msgpack.unpackb(memoryview(step)[4:], raw=False, strict_map_key=False))

    for tick in range(20):
        lock_step(tick)
    started = time.thread_time()
    for tick in range(steps):
        lock_step(tick)
    return (time.thread_time() - started) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, default=400)
    parser.add_argument("--obs", default="vec64")
    parser.add_argument("--policies", type=int, default=2)
    parser.add_argument("--games", type=int, default=1)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--profile", default=None, help="write the broker path's cProfile stats here")
    args = parser.parse_args()
    configure_logging(level="warning")
    config = BenchConfig(args.agents, args.obs, args.policies, args.games)
    broker, traffic = broker_path(config, args.steps, args.profile)
    raw = raw_path(config, args.steps)
    print(f"{config.label}: broker path {broker * 1e6:9.1f} us CPU per lock-step; raw one-hop {raw * 1e6:8.1f} us")
    print("  per lock-step: " + ", ".join(f"{k} {v:,.1f}" for k, v in traffic.items()))


if __name__ == "__main__":
    main()
