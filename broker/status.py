"""The broker's live numbers in their outside forms: made safe for the wire (the ``status`` message) and
as Prometheus text (``serve --metrics-port``, ``gdrl-broker status --prometheus``)."""

from __future__ import annotations

import json
from typing import Any


def wire_safe(value: Any) -> Any:
    """``value`` with every string made encodable (a lone surrogate becomes its ``\\udxxx`` escape) and
    every integer beyond 64 bits made a float: status reports names peers chose, and must always encode."""
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return value
    if isinstance(value, int):
        return value if -(2**63) <= value < 2**64 else float(value)
    if isinstance(value, dict):
        return {wire_safe(k): wire_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [wire_safe(v) for v in value]
    return wire_safe(str(value))


PROMETHEUS_FIELDS = {
    "agents": ("gdrl_policy_agents", "gauge", "agents of the policy in the games connected now"),
    "envs": ("gdrl_policy_envs", "gauge", "VecEnv slots of the policy (0 until every game slot has been filled)"),
    "trainer": ("gdrl_policy_trainer_connected", "gauge", "1 while a trainer for the policy is connected"),
    "ring_batches": (
        "gdrl_policy_ring_batches_total",
        "counter",
        "batches sent through the trainer's shared-memory ring (its connection's so far)",
    ),
    "env_steps": ("gdrl_policy_env_steps_total", "counter", "env steps delivered to the trainer"),
    "steps_per_s": ("gdrl_policy_steps_per_second", "gauge", "env steps per second (last 10 s)"),
    "game_ticks_per_s": ("gdrl_policy_game_ticks_per_second", "gauge", "game ticks carrying the policy per second"),
    "mean_episode_reward": ("gdrl_policy_mean_episode_reward", "gauge", "mean of the last 100 episode returns"),
    "episodes": ("gdrl_policy_episodes_total", "counter", "episodes ended"),
    "held_fraction": ("gdrl_policy_held_fraction", "gauge", "fraction of game ticks held for this policy"),
    "longest_hold": ("gdrl_policy_longest_hold_ticks", "gauge", "most ticks one transition spanned"),
    "trainer_waited_s": ("gdrl_policy_trainer_waited_seconds_total", "counter", "trainer waiting for games"),
    "games_waited_s": ("gdrl_policy_games_waited_seconds_total", "counter", "batch open, trainer not answered"),
}


def prometheus_text(status: dict[str, Any]) -> str:
    games = status.get("games", [])
    out = [
        "# HELP gdrl_games_connected Game instances connected.",
        "# TYPE gdrl_games_connected gauge",
        f"gdrl_games_connected {sum(1 for g in games if g.get('connected'))}",
        "# HELP gdrl_games_expected Game slots (--games).",
        "# TYPE gdrl_games_expected gauge",
        f"gdrl_games_expected {len(games)}",
    ]
    policies = status.get("policies", {})
    for field_name, (metric, kind, help_text) in PROMETHEUS_FIELDS.items():
        out += [f"# HELP {metric} {help_text}.", f"# TYPE {metric} {kind}"]
        for name, p in policies.items():
            value = p.get(field_name)
            if field_name == "trainer":
                value = 1 if value else 0
            if value is not None:
                out.append(f"{metric}{{policy={json.dumps(name)}}} {float(value)}")
    out += _self_play_metrics(status)
    return "\n".join(out) + "\n"


def _self_play_metrics(status: dict[str, Any]) -> list[str]:
    """Frozen groups (docs/self_play.md) and the Elo table."""
    frozen, ratings = status.get("frozen", {}), status.get("elo", {})
    out = [
        "# HELP gdrl_frozen_model_version Models loaded so far by a group the broker plays itself.",
        "# TYPE gdrl_frozen_model_version gauge",
    ]
    out += [f"gdrl_frozen_model_version{{policy={json.dumps(g)}}} {float(f['version'])}" for g, f in frozen.items()]
    out += [
        "# HELP gdrl_frozen_agent_steps_total Agent steps a frozen group was answered by its model.",
        "# TYPE gdrl_frozen_agent_steps_total counter",
    ]
    out += [
        f"gdrl_frozen_agent_steps_total{{policy={json.dumps(g)}}} {float(f['agent_steps'])}" for g, f in frozen.items()
    ]
    out += ["# HELP gdrl_elo_rating Elo rating of a live policy or a snapshot.", "# TYPE gdrl_elo_rating gauge"]
    out += [f"gdrl_elo_rating{{player={json.dumps(p)}}} {float(r)}" for p, r in ratings.items()]
    return out
