"""``gdrl-broker status``: ask a running broker for its live numbers, and the table that shows them (the
command itself is in clients/cli.py)."""

from __future__ import annotations

from typing import Any

from broker.protocol import PROTOCOL_VERSION
from broker.protocol.messages import Hello, Status
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
