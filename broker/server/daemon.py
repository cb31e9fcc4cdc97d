"""``gdrl-broker serve`` on its event loop: the server, the game copies it launches and the godot_rl
training scripts it dials, until SIGINT or SIGTERM; then an orderly shutdown."""

from __future__ import annotations

import asyncio
import os
import signal

from broker.server.config import ServerConfig
from broker.server.dialer import GodotRlTrainerConnector, parse_trainer_target
from broker.server.launcher import GameLauncher, LaunchSpec
from broker.server.server import BrokerServer, new_event_loop


async def serve(config: ServerConfig, port_file: str | None = None) -> None:
    server = BrokerServer(config)
    await server.start()
    if port_file:
        with open(port_file + ".tmp", "w") as f:
            f.write(str(server.port))
        os.replace(port_file + ".tmp", port_file)  # readers never see a half-written file
    launcher = None
    if config.env_path:
        spec = LaunchSpec(
            config.env_path,
            config.n_parallel,
            server.port,
            config.seed,
            config.speedup,
            config.action_repeat,
            config.headless,
        )
        launcher = GameLauncher(spec)
        launcher.start()
    connectors = [GodotRlTrainerConnector(server, *parse_trainer_target(target)) for target in config.godot_rl_trainers]
    for connector in connectors:
        connector.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    if launcher is not None:
        launcher.stop_relaunching()
    for connector in connectors:
        await connector.stop()
    await server.shutdown()
    if launcher is not None:
        await launcher.stop()  # what the close message did not end


def run_daemon(config: ServerConfig, port_file: str | None = None) -> None:
    """Serve until a signal (OSError if the port cannot be bound)."""
    loop = new_event_loop()
    try:
        loop.run_until_complete(serve(config, port_file))
    finally:
        loop.close()
