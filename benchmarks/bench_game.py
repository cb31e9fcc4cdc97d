"""The benchmark's native game: ``clients.game.GameClient`` stepping the vectorized world of configs.py.

    python -m benchmarks.bench_game --address 127.0.0.1:11008 --config '{"agents": 400, ...}' --game-index 0

Runs until the broker closes the connection (or the process is stopped).
"""

from __future__ import annotations

import argparse
import json

from benchmarks.configs import BenchConfig, BenchWorld
from benchmarks.counting import CountingSocket, WireReport
from broker.log import configure_logging
from clients.errors import BrokerError
from clients.game import GameClient


def run(address: str, config: BenchConfig, game_index: int) -> None:
    client = GameClient(address, config.groups(), name=f"bench-game-{game_index}")
    world = BenchWorld(config, game_index)
    counter = CountingSocket(client.socket.sock)
    client.socket.sock = counter  # type: ignore[assignment]
    report = WireReport(counter)
    try:
        while True:
            world.apply(client.step(world.step_data()))
            report.tick()
    except BrokerError:
        return  # the broker went away: the benchmark is over
    finally:
        client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--address", required=True, help="host:port or unix:/path")
    parser.add_argument("--config", required=True, help="a BenchConfig as JSON")
    parser.add_argument("--game-index", type=int, default=0)
    args = parser.parse_args()
    configure_logging(level="warning")
    run(args.address, BenchConfig.from_json(json.loads(args.config)), args.game_index)


if __name__ == "__main__":
    main()
