"""``gdrl-broker``: serve, run simulated games, or run the self-contained demo."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

from broker.log import configure_logging
from broker.server.config import ServerConfig
from broker.server.server import BrokerServer, new_event_loop


def _add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = ServerConfig()
    parser.add_argument("--host", default=defaults.host, help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=defaults.port, help="the one port for games and trainers")
    parser.add_argument("--unix", dest="unix_path", default=None, help="also listen on this Unix socket path")
    parser.add_argument("--games", type=int, default=defaults.expected_games, help="game instances to expect")
    parser.add_argument(
        "--token",
        default=os.environ.get("GDRL_BROKER_TOKEN"),
        help="shared token every hello must carry (env GDRL_BROKER_TOKEN); required off loopback",
    )
    parser.add_argument("--max-frame-bytes", type=int, default=defaults.max_frame_bytes)
    parser.add_argument("--max-pending-bytes", type=int, default=defaults.max_pending_bytes)
    parser.add_argument("--limit-connections", type=int, default=defaults.limit_connections)
    parser.add_argument("--timeout-hello", type=float, default=defaults.timeout_hello)
    parser.add_argument(
        "--status-interval",
        type=float,
        default=defaults.status_interval,
        help="seconds between status log lines (0: off)",
    )
    parser.add_argument("--port-file", default=None, help="write the bound TCP port here once listening")
    parser.add_argument("--log-json", action="store_true", help="log JSON lines instead of console text")
    parser.add_argument("--log-level", default="info")


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        host=args.host,
        port=args.port,
        unix_path=args.unix_path,
        expected_games=args.games,
        token=args.token,
        max_frame_bytes=args.max_frame_bytes,
        max_pending_bytes=args.max_pending_bytes,
        limit_connections=args.limit_connections,
        timeout_hello=args.timeout_hello,
        status_interval=args.status_interval,
    )


async def serve(config: ServerConfig, port_file: str | None = None) -> None:
    server = BrokerServer(config)
    await server.start()
    if port_file:
        with open(port_file + ".tmp", "w") as f:
            f.write(str(server.port))
        os.replace(port_file + ".tmp", port_file)  # readers never see a half-written file
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="gdrl-broker", description="One port, many policies.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve_parser = commands.add_parser("serve", help="run the broker daemon")
    _add_serve_arguments(serve_parser)

    from clients import sim_game

    sim_parser = commands.add_parser("sim-game", help="run simulated game instance(s) against a broker")
    sim_game.add_arguments(sim_parser)

    from clients import demo

    demo_parser = commands.add_parser("demo", help="broker + simulated games + one trainer per policy")
    demo.add_arguments(demo_parser)

    args = parser.parse_args(argv)
    if args.command == "serve":
        configure_logging(args.log_json, args.log_level)
        try:
            config = config_from_args(args)
            config.validate()
        except ValueError as exc:
            parser.exit(2, f"gdrl-broker: {exc}\n")
        loop = new_event_loop()
        try:
            loop.run_until_complete(serve(config, args.port_file))
        except OSError as exc:
            parser.exit(1, f"gdrl-broker: cannot listen: {exc}\n")
        finally:
            loop.close()
    elif args.command == "sim-game":
        sim_game.run_from_args(args)
    elif args.command == "demo":
        sys.exit(demo.run_from_args(args))


if __name__ == "__main__":
    main()
