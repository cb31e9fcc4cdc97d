"""What the hub tells about itself: waiting notices to trainers, stall reports, and the live snapshot."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import structlog

from broker.core import claims
from broker.core.effects import Effect, Send
from broker.core.holding import Stall
from broker.core.metrics import PolicyMetrics
from broker.core.sessions import TrainerSession
from broker.protocol.messages import Waiting

if TYPE_CHECKING:
    from broker.core.flow import Hub

log = structlog.get_logger("gdrl.hub")


def waiting_reason(hub: Hub, policy: str, connected: int) -> str:
    if connected < hub.expected_games:
        return f"waiting for games: {connected}/{hub.expected_games}"
    if policy not in hub.policies:
        return "waiting for a game that announces this policy"
    return "waiting for game steps"


def waiting_notice(hub: Hub, trainer: TrainerSession) -> list[Effect]:
    """Tell ``trainer`` what it waits for, unless it was told exactly that last time."""
    connected = hub.games_connected()
    reason = waiting_reason(hub, trainer.policy, connected)
    if trainer.last_waiting == (connected, reason):
        return []
    trainer.last_waiting = (connected, reason)
    return [Send(trainer.peer, Waiting(trainer.policy, connected, hub.expected_games, reason))]


def waiting_notices(hub: Hub) -> list[Effect]:
    """Each trainer that asked for a batch, or has no PolicyInfo yet, hears what it waits for now."""
    out: list[Effect] = []
    for trainer in list(hub.trainers.values()):
        informed = hub.policies.get(trainer.policy) is not None and hub.policies[trainer.policy].trainer is trainer
        if trainer.wants_batch or not informed:
            out += waiting_notice(hub, trainer)
    return out


def stall_report(hub: Hub, stalls: dict[str, Stall]) -> list[Effect]:
    """Log each stalled policy, and tell every trainer waiting for a batch what its games wait for."""
    for name, stall in stalls.items():
        log.warning(
            f"policy {name}: {stall.reason}; games {stall.games} wait ({stall.mode})", waited_s=round(stall.seconds)
        )
    connected = hub.games_connected()
    out: list[Effect] = []
    for trainer in hub.trainers.values():
        others = [f"{stall.games_text(name)}" for name, stall in stalls.items() if name != trainer.policy]
        policy = hub.policies.get(trainer.policy)
        if others and trainer.wants_batch and policy is not None and policy.trainer is trainer:
            reason = "waiting for game steps: " + "; ".join(others)
            trainer.last_waiting = (connected, reason)
            out.append(Send(trainer.peer, Waiting(trainer.policy, connected, hub.expected_games, reason)))
    return out


def snapshot(hub: Hub) -> dict[str, Any]:
    """Live numbers for ``gdrl-broker status`` and the periodic log line (JSON-friendly)."""
    return {
        "games": [
            {
                "slot": s.index,
                "name": s.game.name if s.game else None,
                "connected": s.game is not None,
                "ticks": s.game.steps if s.game else 0,
                "sampler": s.sampler.who if s.sampler else None,  # who holds the game (docs/protocol.md §4a)
            }
            for s in hub.slots
        ],
        "policies": policies_status(hub),
        "samplers": samplers_status(hub),
    }


def samplers_status(hub: Hub) -> list[dict[str, Any]]:
    """Each sampler, the games it holds and its own view of every policy of them (docs/protocol.md §4a)."""
    now = hub.clock()
    out = []
    for session in hub.sessions.values():
        if not isinstance(session, claims.SamplerSession):
            continue
        policies = {
            name: own.metrics.status(
                now, agents=own.n_envs, envs=own.n_envs, trainer=session.who, state="sampling", mode=own.options.mode
            )
            for name, own in session.policies.items()
        }
        out.append({"name": session.who, "games": list(session.slots), "policies": policies})
    return out


def policies_status(hub: Hub) -> dict[str, dict[str, Any]]:
    """Every policy a game announced or a trainer asked for, with who is there and what it waits for."""
    now = hub.clock()
    stalls = hub.stalls()
    names = list(hub.policies) + [p for p in hub.trainers if p not in hub.policies]
    out = {}
    for name in names:
        policy = hub.policies.get(name)
        trainer = hub.trainers.get(name)
        agents = sum(s.game.groups[name].n_agents for s in hub.slots if s.game is not None and name in s.game.groups)
        if trainer is None:
            state = "no trainer"
        elif policy is None or policy.trainer is not trainer:
            state = waiting_reason(hub, name, hub.games_connected())
        elif name in stalls:
            state = f"stalled: {stalls[name].reason}"
        else:
            state = "training"
        options = policy.options if policy else (trainer.options if trainer else None) or hub.default_stepping
        metrics = policy.metrics if policy else PolicyMetrics()
        out[name] = metrics.status(
            now,
            agents=agents,
            envs=policy.n_envs if policy else 0,
            trainer=trainer.who if trainer else None,
            state=state,
            mode=options.mode,
        )
    return out
