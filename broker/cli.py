"""``gdrl-broker``: serve, run simulated games, or run the self-contained demo."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys

from broker.launcher import GameLauncher, LaunchSpec, resolve_env_path
from broker.log import configure_logging
from broker.protocol import DEFAULT_ADDRESS
from broker.protocol.messages import HOLD_DEADLINE_DEFAULT_TEXT
from broker.server.config import ServerConfig
from broker.server.dialer import GodotRlTrainerConnector, parse_trainer_target
from broker.server.server import BrokerServer, new_event_loop


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Show a flag's default in --help, when it has one worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        secret = action.dest == "token"  # its default comes from the environment: never print it
        meaningless = action.default is None or action.default is False or action.default in ([], argparse.SUPPRESS)
        shown = not meaningless and "default" not in text and not secret
        return text + " (default: %(default)s)" if shown else text


STATUS_COLUMNS = """columns (README "Troubleshooting" says what to do about what they show):
  agents            VecEnv slots of the policy (its agents summed over all games)
  trainer           the trainer's name, - while none is connected
  mode              hold or barrier stepping (docs/protocol.md section 5)
  steps/s           env steps delivered to the trainer per second (10 s window)
  ticks/s           game ticks carrying the policy per second
  mean ep. reward   mean return of the last 100 episodes
  held              share of game ticks on which the policy's agents repeated their last action
  longest hold      most game ticks one transition spanned
  trainer waited s  seconds the trainer waited for games
  games waited s    seconds games waited for the trainer's actions"""


def _print_status(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    from broker.status import fetch_status, prometheus_text, render_table

    try:
        token = read_token_file(args.token_file) if args.token_file else args.token
        status = fetch_status(args.address, token, timeout=args.timeout)
    except Exception as exc:
        parser.exit(1, f"gdrl-broker status: {exc}\n")
    if args.json:
        text = json.dumps(status, indent=2) + "\n"
    elif args.prometheus:
        text = prometheus_text(status)
    else:
        text = render_table(status) + "\n"
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        # `gdrl-broker status --json | head`: the reader has what it wanted. Point stdout at /dev/null so
        # the interpreter's final flush does not fail too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = ServerConfig()
    parser.add_argument("--host", default=defaults.host, help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=defaults.port, help="the one port for games and trainers")
    parser.add_argument("--unix", dest="unix_path", default=None, help="also listen on this Unix socket path")
    parser.add_argument(
        "--games", type=int, default=None, help="game instances to expect (default: --n-parallel, else 1)"
    )
    parser.add_argument(
        "--token",
        default=os.environ.get("GDRL_BROKER_TOKEN"),
        help="shared token every hello must carry (env GDRL_BROKER_TOKEN); required off loopback",
    )
    parser.add_argument(
        "--token-file",
        default=None,
        metavar="PATH",
        help="read the token from this file (first line), so it is not visible in the process list",
    )
    parser.add_argument(
        "--max-frame-bytes", type=int, default=defaults.max_frame_bytes, help="largest frame a peer may send"
    )
    parser.add_argument(
        "--max-pending-bytes",
        type=int,
        default=defaults.max_pending_bytes,
        help="bytes queued for one slow peer before it is dropped",
    )
    parser.add_argument(
        "--limit-connections", type=int, default=defaults.limit_connections, help="admitted peers (after hello)"
    )
    parser.add_argument(
        "--limit-before-hello",
        type=int,
        default=defaults.limit_before_hello,
        help="connections not yet past hello; when full, the oldest of them is shed",
    )
    parser.add_argument(
        "--timeout-hello",
        type=float,
        default=defaults.timeout_hello,
        help="seconds a new connection has to say hello",
    )
    parser.add_argument(
        "--timeout-frame",
        type=float,
        default=defaults.timeout_frame,
        help="seconds a started frame may take to arrive whole, after hello (then slow_peer)",
    )
    parser.add_argument(
        "--status-interval",
        type=float,
        default=defaults.status_interval,
        help="seconds between status log lines (0: off)",
    )
    parser.add_argument(
        "--stepping",
        choices=["hold", "barrier"],
        default=defaults.stepping,
        help="stepping of policies whose trainer does not choose: hold (a game never waits "
        "longer than the deadline for a busy trainer) or barrier (lock-step)",
    )
    parser.add_argument(
        "--deadline-ms",
        type=float,
        default=None,
        help="how long a game tick waits for a policy's actions; barrier default: no limit; hold default: "
        + HOLD_DEADLINE_DEFAULT_TEXT,
    )
    parser.add_argument(
        "--hold-action",
        choices=["repeat", "noop"],
        default=defaults.hold_action,
        help="what held agents do: repeat their last action, or all-zero actions",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus text metrics over HTTP on this port, bound to loopback (127.0.0.1) whatever --host",
    )
    parser.add_argument("--port-file", default=None, help="write the bound TCP port here once listening")
    compat = parser.add_argument_group("godot_rl compatibility")
    compat.add_argument("--env-path", default=None, help="exported game to launch, every copy on this broker's port")
    compat.add_argument("--n-parallel", type=int, default=None, help="copies of --env-path to run (default 1)")
    compat.add_argument("--speedup", type=float, default=None, help="pass --speedup=X to the games")
    compat.add_argument("--action-repeat", type=int, default=None, help="pass --action_repeat=N to the games")
    compat.add_argument("--seed", type=int, default=defaults.seed, help="copy i gets --env_seed=SEED+i")
    compat.add_argument("--headless", action="store_true", help="run the games without window or rendering")
    compat.add_argument(
        "--godot-rl-trainer",
        action="append",
        default=[],
        metavar="POLICY=HOST:PORT",
        help="serve POLICY's agents to an unmodified godot_rl training script listening there (repeatable)",
    )
    parser.add_argument("--log-json", action="store_true", help="log JSON lines instead of console text")
    parser.add_argument("--log-level", default="info", help="debug, info, warning or error")


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        host=args.host,
        port=args.port,
        unix_path=args.unix_path,
        expected_games=args.games if args.games is not None else (args.n_parallel or ServerConfig.expected_games),
        token=read_token_file(args.token_file) if args.token_file else args.token,
        max_frame_bytes=args.max_frame_bytes,
        max_pending_bytes=args.max_pending_bytes,
        limit_connections=args.limit_connections,
        limit_before_hello=args.limit_before_hello,
        timeout_hello=args.timeout_hello,
        timeout_frame=args.timeout_frame,
        status_interval=args.status_interval,
        metrics_port=args.metrics_port,
        stepping=args.stepping,
        deadline_ms=args.deadline_ms,
        hold_action=args.hold_action,
        env_path=args.env_path,
        n_parallel=args.n_parallel or 1,
        speedup=args.speedup,
        action_repeat=args.action_repeat,
        seed=args.seed,
        headless=args.headless,
        godot_rl_trainers=tuple(args.godot_rl_trainer),
    )


def read_token_file(path: str) -> str:
    """The token from the first line of ``path`` (ValueError if it cannot be read or is empty)."""
    try:
        with open(path, encoding="utf-8") as f:
            token = f.readline().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read --token-file {path}: {exc}") from None
    if not token:
        raise ValueError(f"--token-file {path} is empty")
    return token


def check_godot_rl_options(config: ServerConfig) -> None:
    """Fail before listening: a missing game executable or a malformed trainer target (ValueError)."""
    if config.env_path:
        resolve_env_path(config.env_path)
    elif config.n_parallel > 1:
        raise ValueError("--n-parallel needs --env-path (the game to launch)")
    policies = [parse_trainer_target(target)[0] for target in config.godot_rl_trainers]
    if len(set(policies)) != len(policies):
        raise ValueError(f"--godot-rl-trainer names a policy twice: {policies}")


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="gdrl-broker", description="One port, many policies.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve_parser = commands.add_parser("serve", help="run the broker daemon", formatter_class=_HelpFormatter)
    _add_serve_arguments(serve_parser)

    from clients import sim_game

    sim_parser = commands.add_parser(
        "sim-game", help="run simulated game instance(s) against a broker", formatter_class=_HelpFormatter
    )
    sim_game.add_arguments(sim_parser)

    from clients import demo

    demo_parser = commands.add_parser(
        "demo", help="broker + simulated games + one trainer per policy", formatter_class=_HelpFormatter
    )
    demo.add_arguments(demo_parser)

    status_parser = commands.add_parser(
        "status",
        help="show a running broker's games, trainers and policies",
        formatter_class=_HelpFormatter,
        epilog=STATUS_COLUMNS,
    )
    status_parser.add_argument("--address", default=DEFAULT_ADDRESS, help="broker address, host:port or unix:/path")
    status_parser.add_argument(
        "--token", default=os.environ.get("GDRL_BROKER_TOKEN"), help="shared token (env GDRL_BROKER_TOKEN)"
    )
    status_parser.add_argument("--token-file", default=None, metavar="PATH", help="read the token from this file")
    status_parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the broker's answer")
    status_parser.add_argument("--json", action="store_true", help="print the raw JSON")
    status_parser.add_argument("--prometheus", action="store_true", help="print Prometheus text format")

    args = parser.parse_args(argv)
    if args.command == "status":
        _print_status(parser, args)
        return
    if args.command == "serve":
        configure_logging(args.log_json, args.log_level)
        try:
            config = config_from_args(args)
            config.validate()
            check_godot_rl_options(config)
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
        sys.exit(sim_game.run_from_args(args))
    elif args.command == "demo":
        sys.exit(demo.run_from_args(args))


if __name__ == "__main__":
    main()
