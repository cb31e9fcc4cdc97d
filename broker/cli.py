"""``gdrl-broker``'s parser and the broker's own subcommand, ``serve`` (the daemon).

The peers' subcommands (``sim-game``, ``demo``, ``status``) live with the peers: ``clients.cli`` adds them
to this parser and is what the ``gdrl-broker`` program runs, so the broker never imports a client.
``main`` here knows ``serve`` only.
"""

from __future__ import annotations

import argparse
import os
from typing import TypeAlias

from broker.log import configure_logging
from broker.protocol import TOKEN_ENV
from broker.protocol.messages import HOLD_DEADLINE_DEFAULT_TEXT
from broker.server.config import ServerConfig
from broker.server.daemon import run_daemon
from broker.server.dialer import parse_trainer_target
from broker.server.launcher import resolve_env_path

# The type of ``add_subparsers()``' result, for the peers that add their subcommands to the parser.
Subcommands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Show a flag's default in --help, when it has one worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        secret = action.dest == "token"  # its default comes from the environment: never print it
        meaningless = action.default is None or action.default is False or action.default in ([], argparse.SUPPRESS)
        shown = not meaningless and "default" not in text and not secret
        return text + " (default: %(default)s)" if shown else text


def _add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = ServerConfig()
    for add in (
        _add_network_arguments,
        _add_limit_arguments,
        _add_stepping_arguments,
        _add_compat_arguments,
        _add_frozen_arguments,
        _add_log_arguments,
    ):
        add(parser, defaults)


def _add_network_arguments(parser: argparse.ArgumentParser, defaults: ServerConfig) -> None:
    """Addresses, the token, and where the bound port and the metrics go."""
    group = parser.add_argument_group("where it listens")
    group.add_argument("--host", default=defaults.host, help="address to bind (default: loopback only)")
    group.add_argument("--port", type=int, default=defaults.port, help="the one port for games and trainers")
    group.add_argument("--unix", dest="unix_path", default=None, help="also listen on this Unix socket path")
    group.add_argument(
        "--games", type=int, default=None, help="game instances to expect (default: --n-parallel, else 1)"
    )
    group.add_argument(
        "--token",
        default=os.environ.get(TOKEN_ENV),
        help=f"shared token every hello must carry (env {TOKEN_ENV}); required off loopback",
    )
    group.add_argument(
        "--token-file",
        default=None,
        metavar="PATH",
        help="read the token from this file (first line), so it is not visible in the process list",
    )
    group.add_argument("--port-file", default=None, help="write the bound TCP port here once listening")
    group.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus text metrics over HTTP on this port, bound to loopback (127.0.0.1) whatever --host",
    )


def _add_limit_arguments(parser: argparse.ArgumentParser, defaults: ServerConfig) -> None:
    """What one peer may send and how long it may take: beyond them it gets an error and is closed."""
    group = parser.add_argument_group("limits")
    group.add_argument(
        "--max-frame-bytes", type=int, default=defaults.max_frame_bytes, help="largest frame a peer may send"
    )
    group.add_argument(
        "--max-pending-bytes",
        type=int,
        default=defaults.max_pending_bytes,
        help="bytes queued for one slow peer before it is dropped",
    )
    group.add_argument(
        "--limit-connections", type=int, default=defaults.limit_connections, help="admitted peers (after hello)"
    )
    group.add_argument(
        "--limit-before-hello",
        type=int,
        default=defaults.limit_before_hello,
        help="connections not yet past hello; when full, the oldest of them is shed",
    )
    group.add_argument(
        "--timeout-hello",
        type=float,
        default=defaults.timeout_hello,
        help="seconds a new connection has to say hello",
    )
    group.add_argument(
        "--timeout-frame",
        type=float,
        default=defaults.timeout_frame,
        help="seconds a started frame may take to arrive whole, after hello (then slow_peer)",
    )


def _add_stepping_arguments(parser: argparse.ArgumentParser, defaults: ServerConfig) -> None:
    """How games wait for policies whose trainer does not choose (docs/protocol.md section 5)."""
    group = parser.add_argument_group("stepping")
    group.add_argument(
        "--stepping",
        choices=["hold", "barrier"],
        default=defaults.stepping,
        help="stepping of policies whose trainer does not choose: hold (a game never waits "
        "longer than the deadline for a busy trainer) or barrier (lock-step)",
    )
    group.add_argument(
        "--deadline-ms",
        type=float,
        default=None,
        help="how long a game tick waits for a policy's actions; barrier default: no limit; hold default: "
        + HOLD_DEADLINE_DEFAULT_TEXT,
    )
    group.add_argument(
        "--hold-action",
        choices=["repeat", "noop"],
        default=defaults.hold_action,
        help="what held agents do: repeat their last action, or all-zero actions",
    )
    group.add_argument(
        "--spin-wait-us",
        type=float,
        default=defaults.spin_wait_s * 1e6,
        help="microseconds the broker polls for the next message before it sleeps, less after polls that found"
        " nothing; 0: never (docs/performance_history.md, 'Waiting without sleeping')",
    )


def _add_frozen_arguments(parser: argparse.ArgumentParser, defaults: ServerConfig) -> None:
    """Groups the broker plays itself from ONNX models (docs/self_play.md)."""
    group = parser.add_argument_group("frozen groups and self-play")
    group.add_argument(
        "--frozen",
        action="append",
        default=[],
        metavar="GROUP=PATH.onnx",
        help="the broker plays GROUP itself with this ONNX model (gdrl-train --onnx-export-path), reloaded "
        "when the file changes; no trainer needed (repeatable; docs/self_play.md)",
    )
    group.add_argument(
        "--self-play-pool",
        action="append",
        default=[],
        metavar="GROUP=DIR",
        help="play GROUP from this self-play pool with the settings saved in DIR/pool.json, continuing its "
        "rotation and Elo (a restarted broker; gdrl-train --opponent sets a pool up; repeatable)",
    )


def _add_log_arguments(parser: argparse.ArgumentParser, defaults: ServerConfig) -> None:
    """The log and the periodic status line."""
    group = parser.add_argument_group("logging")
    group.add_argument(
        "--status-interval",
        type=float,
        default=defaults.status_interval,
        help="seconds between status log lines (0: off)",
    )
    group.add_argument("--log-json", action="store_true", help="log JSON lines instead of console text")
    group.add_argument("--log-level", default="info", help="debug, info, warning or error")


def _add_compat_arguments(parser: argparse.ArgumentParser, defaults: ServerConfig) -> None:
    """godot_rl's own launch options, for exported games and godot_rl training scripts."""
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
        spin_wait_s=args.spin_wait_us * 1e-6,
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
        frozen=tuple(args.frozen),
        self_play_pools=tuple(args.self_play_pool),
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
    check_frozen_options(config)


def check_frozen_options(config: ServerConfig) -> None:
    """Every --frozen model loads (ValueError naming the file and what is wrong with it)."""
    from broker.server.frozen import parse_frozen_target
    from broker.server.onnx_model import OnnxModel
    from broker.server.pool import SnapshotPool, saved_settings

    groups = [parse_frozen_target(target)[0] for target in config.frozen + config.self_play_pools]
    if len(set(groups)) != len(groups):
        raise ValueError(f"--frozen and --self-play-pool name a group twice: {groups}")
    for target in config.self_play_pools:
        group, directory = parse_frozen_target(target)
        try:
            SnapshotPool(saved_settings(directory))
        except ValueError as exc:
            raise ValueError(f"--self-play-pool {group}: {exc}") from None
    for target in config.frozen:
        group, path = parse_frozen_target(target)
        try:
            OnnxModel.load(path)
        except ValueError as exc:
            raise ValueError(f"--frozen {group}: {exc}") from None


def build_parser() -> tuple[argparse.ArgumentParser, Subcommands]:
    """The ``gdrl-broker`` parser with ``serve``, and its subcommands, to which clients.cli adds the peers'."""
    parser = argparse.ArgumentParser(prog="gdrl-broker", description="One port, many policies.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve_parser = commands.add_parser("serve", help="run the broker daemon", formatter_class=HelpFormatter)
    _add_serve_arguments(serve_parser)
    return parser, commands


def run_serve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``gdrl-broker serve``: until SIGINT/SIGTERM; a bad option exits 2, a port that cannot be bound 1."""
    configure_logging(args.log_json, args.log_level)
    try:
        config = config_from_args(args)
        config.validate()
        check_godot_rl_options(config)
    except ValueError as exc:
        parser.exit(2, f"gdrl-broker: {exc}\n")
    try:
        run_daemon(config, args.port_file)
    except OSError as exc:
        parser.exit(1, f"gdrl-broker: cannot listen: {exc}\n")


def main(argv: list[str] | None = None) -> None:
    """The broker's commands alone (``serve``); the ``gdrl-broker`` program is ``clients.cli.main``."""
    parser, _ = build_parser()
    run_serve(parser, parser.parse_args(argv))


if __name__ == "__main__":
    main()
