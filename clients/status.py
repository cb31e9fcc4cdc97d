"""``gdrl-broker status``: ask a running broker for its live numbers and show them as a table, JSON or
Prometheus text."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from broker.cli import HelpFormatter, Subcommands, read_token_file
from broker.protocol import DEFAULT_ADDRESS, PROTOCOL_VERSION
from broker.protocol.messages import Hello, Status
from broker.status import prometheus_text
from clients.transport import PeerSocket

COLUMNS = """columns (README "Troubleshooting" says what to do about what they show):
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


def add_command(commands: Subcommands) -> None:
    parser = commands.add_parser(
        "status",
        help="show a running broker's games, trainers and policies",
        formatter_class=HelpFormatter,
        epilog=COLUMNS,
    )
    parser.add_argument("--address", default=DEFAULT_ADDRESS, help="broker address, host:port or unix:/path")
    parser.add_argument(
        "--token", default=os.environ.get("GDRL_BROKER_TOKEN"), help="shared token (env GDRL_BROKER_TOKEN)"
    )
    parser.add_argument("--token-file", default=None, metavar="PATH", help="read the token from this file")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the broker's answer")
    parser.add_argument("--json", action="store_true", help="print the raw JSON")
    parser.add_argument("--prometheus", action="store_true", help="print Prometheus text format")


def fetch_status(address: str, token: str | None = None, timeout: float = 5.0) -> dict[str, Any]:
    sock = PeerSocket(
        address, Hello("observer", PROTOCOL_VERSION, "gdrl-broker status", token), timeout_connect=timeout
    )
    try:
        message = sock.recv()
        if not isinstance(message, Status):
            raise RuntimeError(f"expected status, got {message.TYPE}")
        return message.status
    finally:
        sock.close()


def print_status(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
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


def render_table(status: dict[str, Any]) -> str:
    games = status.get("games", [])
    connected = sum(1 for g in games if g.get("connected"))
    lines = [
        f"broker up {status.get('uptime_s', 0):.0f} s, {status.get('connections', 0)} connections, "
        f"games {connected}/{len(games)}",
        "",
        f"{'policy':<16} {'agents':>6} {'trainer':<24} {'state':<30} {'mode':<8} {'steps/s':>9} {'ticks/s':>8} "
        f"{'mean ep. reward':>15} {'held':>6} {'longest hold':>12} {'trainer waited s':>16} {'games waited s':>14}",
    ]
    for name, p in status.get("policies", {}).items():
        reward = p.get("mean_episode_reward")
        state = p.get("state") or ("training" if p.get("trainer") else "no trainer")
        lines.append(
            f"{name:<16} {p['agents']:>6} {(p.get('trainer') or '-')[:24]:<24} {state[:30]:<30} {p['mode']:<8} "
            f"{p['steps_per_s']:>9.1f} {p['game_ticks_per_s']:>8.1f} "
            f"{(f'{reward:.3f}' if reward is not None else '-'):>15} {p['held_fraction']:>6.1%} "
            f"{p['longest_hold']:>12} {p['trainer_waited_s']:>16.1f} {p['games_waited_s']:>14.1f}"
        )
    return "\n".join(lines)
