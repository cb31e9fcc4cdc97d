"""``gdrl-broker status``: ask a running broker for its live numbers, and the table that shows them (the
command itself is in clients/cli.py)."""

from __future__ import annotations

from typing import Any

from broker.protocol import PROTOCOL_VERSION
from broker.protocol.messages import Control, Hello, Status
from clients.transport import PeerSocket

COLUMNS = """columns (README "Troubleshooting" says what to do about what they show):
  agents            VecEnv slots of the policy (its agents summed over all games)
  trainer           the trainer's name, - while none is connected
  link              how the trainer is reached: tcp, unix ("+ ring": batches of 32 KB or more through its
                    shared-memory ring, docs/protocol.md section 3b), in-process, godot_rl script, frozen
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


def send_control(
    address: str, command: str, args: dict[str, Any], token: str | None = None, timeout: float = 30.0
) -> dict[str, Any]:
    """One control request (``freeze``, ``unfreeze``, ``self_play``; docs/self_play.md): the broker's result,
    or BrokerError with its reason (code ``bad_control``)."""
    sock = PeerSocket(
        address,
        Hello("control", PROTOCOL_VERSION, "gdrl-broker control", token),
        timeout_connect=timeout,
        timeout_recv=timeout,
    )
    try:
        sock.send(Control(command, args))
        message = sock.recv()
        if not isinstance(message, Status):
            raise RuntimeError(f"expected status, got {message.TYPE}")
        return message.status
    finally:
        sock.close()


def render_frozen(status: dict[str, Any]) -> list[str]:
    """The frozen groups and Elo ratings, under the policy table."""
    lines = []
    for group, f in status.get("frozen", {}).items():
        pool = f.get("pool")
        where = f"pool {pool['directory']} opponent {pool['opponent']} swaps {pool['swaps']}" if pool else ""
        elo = f"{f['elo']:.0f}" if f.get("elo") is not None else "-"
        lines.append(
            f"frozen {group}: model {f.get('model') or '-'} version {f.get('version')} elo {elo} "
            f"agent steps {f.get('agent_steps')} {where}".rstrip()
        )
        if f.get("error"):
            lines.append(f"  error: {f['error']}")
    for pair, t in status.get("team_change", {}).items():
        lines.append(f"team change {pair}: {t['learner']} learns, turn {t['turns']}, {t['steps']}/{t['every']} steps")
    ratings = status.get("elo", {})
    if ratings:
        lines.append("elo: " + ", ".join(f"{p} {r:.0f}" for p, r in sorted(ratings.items(), key=lambda x: -x[1])))
    return ["", *lines] if lines else []


def render_table(status: dict[str, Any]) -> str:
    games = status.get("games", [])
    connected = sum(1 for g in games if g.get("connected"))
    lines = [
        f"broker up {status.get('uptime_s', 0):.0f} s, {status.get('connections', 0)} connections, "
        f"games {connected}/{len(games)}",
        "",
        f"{'policy':<16} {'agents':>6} {'trainer':<24} {'link':<15} {'state':<30} {'mode':<8} {'steps/s':>9} "
        f"{'ticks/s':>8} {'mean ep. reward':>15} {'held':>6} {'longest hold':>12} {'trainer waited s':>16} "
        f"{'games waited s':>14}",
    ]
    for name, p in status.get("policies", {}).items():
        state = p.get("state") or ("training" if p.get("trainer") else "no trainer")
        if name in status.get("frozen", {}):
            state = f"frozen v{status['frozen'][name].get('version')}"
        lines.append(_policy_row(name, p, state))
    for sampler in status.get("samplers", []):  # a sampler's own view of each policy of the games it holds
        games = ",".join(str(g) for g in sampler.get("games", []))
        for name, p in sampler.get("policies", {}).items():
            lines.append(_policy_row(name, p, f"sampling games {games}"))
    return "\n".join(lines + render_frozen(status))


def _policy_row(name: str, p: dict[str, Any], state: str) -> str:
    reward = p.get("mean_episode_reward")
    return (
        f"{name:<16} {p['agents']:>6} {(p.get('trainer') or '-')[:24]:<24} {(p.get('link') or '-')[:15]:<15} "
        f"{state[:30]:<30} {p['mode']:<8} "
        f"{p['steps_per_s']:>9.1f} {p['game_ticks_per_s']:>8.1f} "
        f"{(f'{reward:.3f}' if reward is not None else '-'):>15} {p['held_fraction']:>6.1%} "
        f"{p['longest_hold']:>12} {p['trainer_waited_s']:>16.1f} {p['games_waited_s']:>14.1f}"
    )
