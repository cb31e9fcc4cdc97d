"""Claims: a sampler session holds whole games, every group of them, instead of one policy over all games.

A sampler (an RLlib env runner's environment, say) says ``hello`` with ``role: sampler`` and
``claim_games``: N, or ``"all"``. It gets N of the seated games no other sampler holds, and for each policy
of those games its own ``PolicyState`` laid out over the claimed slots only, with a ``TrainerSession`` on
the sampler's peer that asks and answers for that policy. Everything past the claim is the hub's ordinary
path (accumulate, hold or barrier, batches, actions); only the routing differs: a claimed game's
``GameSession.policies`` point at the sampler's states, and its batches and acts name their ``policy``.

A slot once claimed stays a sampler's slot: per-policy layouts skip it (``seating.lay_out``), and when its
sampler leaves its groups go on to that sampler's states, which have no trainer then (held, as any policy
without a trainer; in barrier stepping the tick it left unanswered is released, and the next tick waits),
until the next sampler claims it and gets the newest ticks. A claim is refused when too few games are free
(``no_free_game``: the client retries) or when a policy of a free game is trained per-policy there
(``policy_trained``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog

from broker.core import seating
from broker.core.effects import Peer, Send
from broker.core.sessions import PolicyState, Slot, TrainerSession
from broker.core.states import advance
from broker.protocol import PROTOCOL_VERSION
from broker.protocol.errors import ErrorCode, RemoteProtocolError
from broker.protocol.messages import ALL_GAMES, Hello, TrainerAct, TrainerReset, Welcome

if TYPE_CHECKING:
    from broker.core.flow import Hub

log = structlog.get_logger("gdrl.hub")


@dataclass(eq=False)
class SamplerSession:
    peer: Peer
    peer_id: int
    name: str
    slots: tuple[int, ...]  # the claimed game slots, in the order of its layout
    policies: dict[str, PolicyState] = field(default_factory=dict)  # its own, over the claimed slots only
    trainers: dict[str, TrainerSession] = field(default_factory=dict)  # per policy: asks and answers

    @property
    def who(self) -> str:
        return self.name or self.peer.label


def _trained_here(policy: PolicyState, slot: Slot) -> bool:
    """A per-policy trainer learns from this slot's agents (attached, or its batch still open)."""
    return slot.index in policy.offsets and (policy.trainer is not None or policy.open is not None)


def choose_games(hub: Hub, hello: Hello) -> list[Slot]:
    """The slots this claim gets, lowest first; or the RemoteProtocolError that says why none."""
    unheld = [s for s in hub.slots if s.game is not None and s.sampler is None]
    trained = {s.index: name for s in unheld for name in s.layout or () if _trained_here(hub.policies[name], s)}
    free = [s for s in unheld if s.index not in trained]
    wanted = len(free) if hello.claim_games == ALL_GAMES else int(hello.claim_games)
    if free and len(free) >= wanted:
        return free[:wanted]
    if trained and len(unheld) >= max(wanted, 1):
        index, name = next(iter(trained.items()))
        trainer = hub.policies[name].trainer
        by = f" by '{trainer.who}'" if trainer else ""
        raise RemoteProtocolError(
            ErrorCode.POLICY_TRAINED,
            f"policy '{name}' of game {index} is trained per-policy{by}; a sampler claims only games "
            f"none of whose policies has a per-policy trainer",
        )
    held = sum(1 for s in hub.slots if s.sampler is not None)
    seated = sum(1 for s in hub.slots if s.game is not None)
    raise RemoteProtocolError(
        ErrorCode.NO_FREE_GAME,
        f"claim of {hello.claim_games} games: {len(free)} free ({seated} of {len(hub.slots)} game slots "
        f"seated, {held} held by samplers)",
    )


def add_sampler(hub: Hub, peer: Peer, hello: Hello) -> None:
    chosen = choose_games(hub, hello)
    sampler = SamplerSession(peer, hub.new_peer_id(), hello.name, tuple(s.index for s in chosen))
    options = hello.stepping or hub.default_stepping
    for slot in chosen:
        assert slot.game is not None and slot.layout is not None
        for name, n_agents in slot.layout.items():
            own = sampler.policies.get(name)
            if own is None:
                own = sampler.policies[name] = PolicyState(name, hub.policies[name].spaces, options, sampled=True)
                trainer = TrainerSession(peer, sampler.peer_id, hello.name, name, options, own=own)
                sampler.trainers[name] = own.trainer = trainer
            own.offsets[slot.index] = own.n_envs
            own.n_envs += n_agents
            before = slot.game.policies[name]
            if (accumulator := before.round.pop(slot.index, None)) is not None:
                own.round[slot.index] = accumulator  # the newest observation is the sampler's first
            before.unapplied.discard(slot.index)
            before.applied_at.pop(slot.index, None)
            slot.game.policies[name] = own
        slot.sampler = sampler
        slot.claimed = sampler.policies
    hub.sessions[peer] = sampler
    if hub.layout_complete:  # the untrained policies' layouts lose the claimed slots
        seating.lay_out(hub.slots, {n: p for n, p in hub.policies.items() if p.trainer is None and p.open is None})
    hub.out.append(Send(peer, Welcome(PROTOCOL_VERSION, sampler.peer_id)))
    for own in sampler.policies.values():
        hub.out.append(Send(peer, seating.policy_info(hub.slots, own)))
    log.info(
        "sampler joined", peer=peer.label, name=hello.name, games=list(sampler.slots), policies=list(sampler.policies)
    )


def sampler_message(hub: Hub, sampler: SamplerSession, message: TrainerAct | TrainerReset) -> None:
    """``reset`` asks for every policy's batch; ``act`` answers the batch of the policy it names."""
    if isinstance(message, TrainerReset):
        for trainer in sampler.trainers.values():
            hub._trainer_reset(trainer)
        return
    asked = sampler.trainers.get(message.policy)
    if asked is None:
        known = ", ".join(sorted(sampler.trainers))
        raise RemoteProtocolError(
            ErrorCode.UNKNOWN_POLICY, f"act names policy '{message.policy}'; this sampler holds {known}"
        )
    hub._trainer_act(asked, message)


def remove_sampler(hub: Hub, sampler: SamplerSession) -> None:
    """Its games stay seated and claimed-for-samplers; with no trainer their groups are held."""
    for index in sampler.slots:
        slot = hub.slots[index]
        if slot.sampler is sampler:
            slot.sampler = None
    for own in sampler.policies.values():
        own.trainer = None
        own.open = None  # nobody answers it; the next sampler starts from the newest ticks
    for index in sampler.slots:
        game = hub.slots[index].game
        if game is None:
            continue
        if game.awaiting:  # nobody will answer this tick's open batches: release it (held), even in barrier
            for name in sampler.policies:
                if name in game.groups and name not in game.ready:
                    game.waits[name] = advance(game.wait_of(name), "release")
        hub.try_reply(game)  # the next tick accumulates for the next sampler (which gets the newest ticks)
    log.info("sampler left", name=sampler.who, games=list(sampler.slots))
