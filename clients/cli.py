"""``gdrl-broker``, the program: the broker's ``serve`` (``broker.cli``) and the peers' subcommands,
``sim-game``, ``demo`` and ``status``, in one parser. ``python -m broker`` runs this too."""

from __future__ import annotations

import argparse
import json
import os
import sys

from broker import cli as broker_cli
from broker.protocol import DEFAULT_ADDRESS, TOKEN_ENV
from broker.status import prometheus_text
from clients import demo, sim_game, status


def main(argv: list[str] | None = None) -> None:
    parser, commands = broker_cli.build_parser()
    sim_parser = commands.add_parser(
        "sim-game", help="run simulated game instance(s) against a broker", formatter_class=broker_cli.HelpFormatter
    )
    sim_game.add_arguments(sim_parser)
    demo_parser = commands.add_parser(
        "demo", help="broker + simulated games + one trainer per policy", formatter_class=broker_cli.HelpFormatter
    )
    demo.add_arguments(demo_parser)
    _add_status_command(commands)
    _add_control_commands(commands)

    args = parser.parse_args(argv)
    if args.command == "serve":
        broker_cli.run_serve(parser, args)
    elif args.command == "status":
        _print_status(parser, args)
    elif args.command in ("freeze", "unfreeze"):
        _control(parser, args)
    elif args.command == "sim-game":
        sys.exit(sim_game.run_from_args(args))
    elif args.command == "demo":
        sys.exit(demo.run_from_args(args))


def _add_status_command(commands: broker_cli.Subcommands) -> None:
    parser = commands.add_parser(
        "status",
        help="show a running broker's games, trainers and policies",
        formatter_class=broker_cli.HelpFormatter,
        epilog=status.COLUMNS,
    )
    parser.add_argument("--address", default=DEFAULT_ADDRESS, help="broker address, host:port or unix:/path")
    parser.add_argument("--token", default=os.environ.get(TOKEN_ENV), help=f"shared token (env {TOKEN_ENV})")
    parser.add_argument("--token-file", default=None, metavar="PATH", help="read the token from this file")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the broker's answer")
    parser.add_argument("--json", action="store_true", help="print the raw JSON")
    parser.add_argument("--prometheus", action="store_true", help="print Prometheus text format")


def _add_control_commands(commands: broker_cli.Subcommands) -> None:
    freeze = commands.add_parser(
        "freeze",
        help="have a running broker play a group itself with an ONNX model (docs/self_play.md)",
        formatter_class=broker_cli.HelpFormatter,
    )
    freeze.add_argument("target", metavar="GROUP=PATH.onnx", help="the group and its model file")
    unfreeze = commands.add_parser(
        "unfreeze", help="stop playing a frozen group: it waits for a trainer", formatter_class=broker_cli.HelpFormatter
    )
    unfreeze.add_argument("group", help="the frozen group")
    for sub in (freeze, unfreeze):
        sub.add_argument("--address", default=DEFAULT_ADDRESS, help="broker address, host:port or unix:/path")
        sub.add_argument(
            "--token", default=os.environ.get("GDRL_BROKER_TOKEN"), help="shared token (env GDRL_BROKER_TOKEN)"
        )


def _control(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    try:
        if args.command == "freeze":
            group, sep, path = args.target.partition("=")
            if not sep or not group or not path:
                raise ValueError(f"expected GROUP=PATH.onnx, got {args.target!r}")
            result = status.send_control(
                args.address, "freeze", {"group": group, "path": os.path.abspath(path)}, args.token
            )
        else:
            result = status.send_control(args.address, "unfreeze", {"group": args.group}, args.token)
    except Exception as exc:
        parser.exit(1, f"gdrl-broker {args.command}: {exc}\n")
    sys.stdout.write(json.dumps(result, indent=2) + "\n")


def _print_status(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    try:
        token = broker_cli.read_token_file(args.token_file) if args.token_file else args.token
        numbers = status.fetch_status(args.address, token, timeout=args.timeout)
    except Exception as exc:
        parser.exit(1, f"gdrl-broker status: {exc}\n")
    if args.json:
        text = json.dumps(numbers, indent=2) + "\n"
    elif args.prometheus:
        text = prometheus_text(numbers)
    else:
        text = status.render_table(numbers) + "\n"
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        # `gdrl-broker status --json | head`: the reader has what it wanted. Point stdout at /dev/null so
        # the interpreter's final flush does not fail too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


if __name__ == "__main__":
    main()
