"""Joining and leaving: a game takes a seat, a trainer attaches to its policy, either one leaves.

Functions over the hub's records; each appends the effects it causes to ``hub.out``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import structlog

from broker.core import seating, status
from broker.core.effects import Close, Peer, Send
from broker.core.sessions import GameSession, PolicyState, TrainerSession
from broker.core.states import advance
from broker.protocol import PROTOCOL_VERSION
from broker.protocol.errors import ErrorCode, RemoteProtocolError
from broker.protocol.messages import Error, Hello, Welcome

if TYPE_CHECKING:
    from broker.core.flow import Hub

log = structlog.get_logger("gdrl.hub")


def add_game(hub: Hub, peer: Peer, hello: Hello) -> None:
    name = hello.name or peer.label
    seating.check_spaces(hello, name, hub.policies)
    layout = {g.policy: g.n_agents for g in hello.groups}
    slot = seating.choose_slot(hub.slots, layout, name)
    game = GameSession(peer, hub.new_peer_id(), hello.name, slot.index, {g.policy: g for g in hello.groups})
    for group in hello.groups:
        if group.policy not in hub.policies:
            trainer = hub.trainers.get(group.policy)
            options = trainer.options if trainer and trainer.options else hub.default_stepping
            hub.policies[group.policy] = PolicyState(group.policy, group.spaces, options)
    routing = slot.claimed or hub.policies  # a claimed slot's groups go to its sampler (claims.py)
    game.policies = {g.policy: routing[g.policy] for g in hello.groups}
    slot.layout = layout
    slot.game = game
    hub.sessions[peer] = game
    hub.out.append(Send(peer, Welcome(PROTOCOL_VERSION, game.peer_id, slot.index)))
    log.info("game joined", peer=peer.label, game=slot.index, name=hello.name, groups=layout)
    if not hub.layout_complete and all(s.layout is not None for s in hub.slots):
        complete_layout(hub)
    hub.out += status.waiting_notices(hub)


def complete_layout(hub: Hub) -> None:
    hub.layout_complete = True
    seating.lay_out(hub.slots, hub.policies)
    for trainer in list(hub.waiting_trainers):
        hub.waiting_trainers.remove(trainer)
        if trainer.policy in hub.policies and hub.policies[trainer.policy].n_envs == 0:
            hub.trainers.pop(trainer.policy, None)
            hub.sessions.pop(trainer.peer, None)
            hub.out.append(Close(trainer.peer, all_claimed(trainer.policy)))
        elif trainer.policy in hub.policies:
            attach(hub, trainer)
        else:
            hub.trainers.pop(trainer.policy, None)
            hub.sessions.pop(trainer.peer, None)
            hub.out.append(Close(trainer.peer, unknown_policy(hub.policies, trainer.policy)))


def unknown_policy(policies: Mapping[str, PolicyState], name: str) -> Error:
    known = ", ".join(sorted(policies)) or "none"
    return Error(ErrorCode.UNKNOWN_POLICY.value, f"no game announces policy '{name}'; known policies: {known}")


def all_claimed(policy: str) -> Error:
    return Error(ErrorCode.NO_FREE_GAME.value, f"every game of policy '{policy}' is claimed by a sampler")


def add_trainer(hub: Hub, peer: Peer, hello: Hello) -> None:
    policy = hello.policy
    holder = hub.trainers.get(policy)
    if holder is not None:
        raise RemoteProtocolError(
            ErrorCode.POLICY_TAKEN,
            f"policy '{policy}' already has a trainer ({holder.peer.label}); one trainer per policy",
        )
    if hub.layout_complete and policy not in hub.policies:
        raise RemoteProtocolError(ErrorCode.UNKNOWN_POLICY, unknown_policy(hub.policies, policy).message)
    if hub.layout_complete and hub.policies[policy].n_envs == 0:
        raise RemoteProtocolError(ErrorCode.NO_FREE_GAME, all_claimed(policy).message)
    trainer = TrainerSession(peer, hub.new_peer_id(), hello.name, policy, hello.stepping)
    hub.trainers[policy] = trainer
    hub.sessions[peer] = trainer
    if policy in hub.policies and hello.stepping is not None:
        hub.policies[policy].options = hello.stepping
    hub.out.append(Send(peer, Welcome(PROTOCOL_VERSION, trainer.peer_id)))
    options = hello.stepping or hub.default_stepping
    log.info("trainer joined", peer=peer.label, policy=policy, name=hello.name, stepping=options.mode)
    if hub.layout_complete:
        attach(hub, trainer)
    else:
        hub.waiting_trainers.append(trainer)
        hub.out += status.waiting_notice(hub, trainer)


def attach(hub: Hub, trainer: TrainerSession) -> None:
    policy = hub.policies[trainer.policy]
    policy.trainer = trainer
    hub.out.append(Send(trainer.peer, seating.policy_info(hub.slots, policy)))
    if trainer.wants_batch:
        hub.try_emit(policy)


def remove_game(hub: Hub, game: GameSession) -> None:
    slot = hub.slots[game.slot]
    if slot.game is not game:
        return
    slot.game = None
    game.state = advance(game.state, "leave")
    for name in game.groups:
        policy = game.policies[name]
        policy.round.pop(slot.index, None)
        policy.unapplied.discard(slot.index)  # a replacement starts from its own first tick
        policy.applied_at.pop(slot.index, None)
    log.info("game left", game=slot.index, name=game.name, steps=game.steps)
    hub.out += status.waiting_notices(hub)


def remove_trainer(hub: Hub, trainer: TrainerSession) -> None:
    if hub.trainers.get(trainer.policy) is not trainer:
        return
    del hub.trainers[trainer.policy]
    trainer.state = advance(trainer.state, "leave")
    if trainer in hub.waiting_trainers:
        hub.waiting_trainers.remove(trainer)
    policy = hub.policies.get(trainer.policy)
    if policy is not None and policy.trainer is trainer:
        policy.trainer = None
        for slot in hub.slots:  # hold-mode games stop waiting for a trainer that is gone
            if slot.game is not None and policy.name in slot.game.groups:
                hub.try_reply(slot.game)
    log.info("trainer left", policy=trainer.policy, name=trainer.name)
