"""``gdrl-broker``, the program: the broker's ``serve`` (``broker.cli``) and the peers' subcommands,
``sim-game``, ``demo`` and ``status``, in one parser. ``python -m broker`` runs this too."""

from __future__ import annotations

import sys

from broker import cli as broker_cli
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
    status.add_command(commands)

    args = parser.parse_args(argv)
    if args.command == "serve":
        broker_cli.run_serve(parser, args)
    elif args.command == "status":
        status.print_status(parser, args)
    elif args.command == "sim-game":
        sys.exit(sim_game.run_from_args(args))
    elif args.command == "demo":
        sys.exit(demo.run_from_args(args))


if __name__ == "__main__":
    main()
