"""The in-process ceiling: the least any broker inside the trainers' process does, one trainer thread per policy.

    python -m benchmarks.inprocess_ceiling --config JSON [--warmup W --measure M]   (prints JSON lines)

One process, one interpreter lock, as the mode ``inprocess`` with several policies: a relay thread accepts the
games (no hello, as the raw ceiling's trainer does), reads every game's step frame whole into a preallocated
buffer (polling for a while before it sleeps, as the raw trainer does), decodes it once as the raw trainer does
and hands each policy's groups to that policy's trainer thread through an in-memory queue; each trainer thread
takes views of its arrays (the raw trainer's work) and answers its prepared actions; once every policy has
answered, the relay thread writes one actions frame to every game. Nothing else: no checks, no stacking, no
VecEnv. Its distance from the raw ceiling is what the thread hops and one shared interpreter lock cost, so an
in-process target above it cannot be reached by any broker with a trainer thread per policy on this machine.
With one policy the in-process broker runs its loop on the trainer's own thread (one hop), and its ceiling is
the raw one: this mode is measured with several policies only (benchmarks/run.py, ``SEVERAL_POLICIES_ONLY``).

Its threads share one interpreter lock and take turns, so they run on one core (``one_core``; Linux, with more
than one core allowed): across cores every turn is a wake-up across them and the lock handed over, and an idle
core pulls a preempted thread to itself. Measured on 2 cores: 1.31x to 1.34x faster pinned than free, with 4
games and with 400 agents (docs/performance_history.md, "Session 28"). A ceiling runs its best way.

Its ready event names the relay thread (``broker_tid``), so the orchestrator counts that thread's CPU as the
middle's and the rest of the process as the trainers', as for ``inprocess``.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import socket
import threading
import time
from typing import Any

import msgpack
import numpy as np

from benchmarks.configs import ACTION_SIZE, MIN_STEPS, BenchConfig
from benchmarks.measure import Meter, emit
from benchmarks.raw import SPIN_WAIT_S, FrameReader, actions_frame, decode_group


def _policy_views(groups: list[dict[str, Any]]) -> None:
    """A policy's part of every game's step as arrays: the raw trainer's work on it (benchmarks/raw.py)."""
    for group in groups:
        decode_group(group)


class Ceiling:
    """The relay thread and the trainer threads of one run."""

    def __init__(self, config: BenchConfig, warmup_s: float, measure_s: float) -> None:
        self.config = config
        self.warmup_s = warmup_s
        self.measure_s = measure_s
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(config.games)
        # SimpleQueue (C, one lock), as the in-process broker's trainer inboxes. Lock-step bounds them: an inbox
        # holds at most one step's groups, the answers one entry per policy.
        self.inboxes: dict[str, queue.SimpleQueue[list[dict[str, Any]]]] = {
            name: queue.SimpleQueue() for name in config.policy_names
        }
        self.answers: queue.SimpleQueue[tuple[str, np.ndarray]] = queue.SimpleQueue()
        rng = np.random.default_rng(0)
        self.actions = {
            name: rng.uniform(-1, 1, (config.agents, ACTION_SIZE)).astype(np.float32) for name in config.policy_names
        }

    @property
    def port(self) -> int:
        return int(self.listener.getsockname()[1])

    def relay(self) -> None:
        """Accept the games, then forward: steps in (decoded once, split per policy), actions out."""
        self.listener.settimeout(60)
        games: list[tuple[socket.socket, FrameReader]] = []
        for _ in range(self.config.games):
            sock, _ = self.listener.accept()
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(None)
            # A frame's first bytes are waited for as the raw trainer waits: polling first, yielding the core and
            # the interpreter lock between polls (measured 1.05x to 1.25x faster here than blocking at once).
            games.append((sock, FrameReader(sock, spin_wait_s=SPIN_WAIT_S)))
        self.listener.close()
        tick = 0
        try:
            while True:
                parts: dict[str, list[dict[str, Any]]] = {name: [] for name in self.inboxes}
                for _, reader in games:
                    for name, group in msgpack.unpackb(reader.read_frame(), raw=False)["groups"].items():
                        parts[name].append(group)
                for name, inbox in self.inboxes.items():
                    inbox.put(parts[name])
                answered = dict(self.answers.get() for _ in self.inboxes)
                frame = actions_frame(tick, answered)
                for sock, _ in games:
                    sock.sendall(frame)
                tick += 1
        except (ConnectionError, OSError):
            return
        finally:
            for sock, _ in games:
                sock.close()

    def trainer(self, name: str) -> None:
        """One policy's trainer: its groups in, its actions out, every step timed as a VecEnv step."""
        inbox, actions = self.inboxes[name], self.actions[name]
        meter = Meter(self.warmup_s, self.measure_s, MIN_STEPS, self.config.agents * self.config.games, name)
        _policy_views(inbox.get())
        while True:
            started = time.perf_counter()
            self.answers.put((name, actions))
            _policy_views(inbox.get())
            meter.record(started, time.perf_counter())


def one_core() -> int | None:
    """Hold this process (and the threads it starts) to its highest allowed core; the core, or None where it
    cannot be pinned or has one core only."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        return None
    core = max(allowed)
    os.sched_setaffinity(0, {core})
    return core


def run(config: BenchConfig, warmup_s: float, measure_s: float) -> None:
    one_core()  # before the threads start: they inherit it
    ceiling = Ceiling(config, warmup_s, measure_s)
    relay = threading.Thread(target=ceiling.relay, name="relay", daemon=True)
    relay.start()
    trainers = [
        threading.Thread(target=ceiling.trainer, args=(name,), name=f"trainer-{name}", daemon=True)
        for name in config.policy_names
    ]
    for thread in trainers:
        thread.start()
    emit({"event": "ready", "port": ceiling.port, "broker_tid": relay.native_id})
    relay.join()  # the games are gone: the run is over


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="a BenchConfig as JSON")
    parser.add_argument("--warmup", type=float, default=0.5)
    parser.add_argument("--measure", type=float, default=2.0)
    args = parser.parse_args()
    run(BenchConfig.from_json(json.loads(args.config)), args.warmup, args.measure)


if __name__ == "__main__":
    main()
