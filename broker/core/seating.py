"""Seating: which slot a joining game takes, and the env layout of each policy over the slots."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import structlog

from broker.core.sessions import PolicyState, Slot
from broker.protocol.errors import ErrorCode, RemoteProtocolError
from broker.protocol.messages import GameLayout, Hello, PolicyInfo

log = structlog.get_logger("gdrl.hub")


def check_spaces(hello: Hello, name: str, policies: Mapping[str, PolicyState]) -> None:
    """A game that disagrees with the others is told so, whether or not a slot is free."""
    for group in hello.groups:
        known = policies.get(group.policy)
        if known is not None and known.spaces != group.spaces:
            difference = known.spaces.describe_difference(group.spaces)
            raise RemoteProtocolError(ErrorCode.SPACE_MISMATCH, f"game '{name}', group '{group.policy}': {difference}")


def choose_slot(slots: Sequence[Slot], layout: dict[str, int], name: str) -> Slot:
    """The free slot this exact layout already used, else a fresh one; or RemoteProtocolError."""
    free = [s for s in slots if s.game is None]
    if not free:
        raise RemoteProtocolError(
            ErrorCode.BROKER_FULL,
            f"all {len(slots)} game slots are taken (start the broker with a larger --games)",
        )
    slot = next((s for s in free if s.layout == layout), None)
    slot = slot or next((s for s in free if s.layout is None), None)
    if slot is None:
        raise RemoteProtocolError(
            ErrorCode.SPACE_MISMATCH,
            f"game '{name}' announces groups {layout}, but the free slots expect {[s.layout for s in free]}",
        )
    return slot


def lay_out(slots: Sequence[Slot], policies: Mapping[str, PolicyState]) -> None:
    """Every slot has been filled once: give each policy one env per agent over all slots, in slot order
    (but a slot a sampler claimed: broker/core/claims.py). ``policies``: those to lay out (again)."""
    for policy in policies.values():
        offset = 0
        policy.offsets.clear()
        for slot in slots:
            assert slot.layout is not None
            if policy.name in slot.layout and slot.claimed is None:
                policy.offsets[slot.index] = offset
                offset += slot.layout[policy.name]
        policy.n_envs = offset
    log.info("layout complete", policies={p.name: p.n_envs for p in policies.values()})


def policy_info(slots: Sequence[Slot], policy: PolicyState) -> PolicyInfo:
    games = tuple(
        GameLayout(s, policy.offsets[s], slots[s].layout[policy.name])  # type: ignore[index]
        for s in sorted(policy.offsets)
    )
    return PolicyInfo(policy.name, policy.n_envs, policy.spaces, games)


def game_of_row(slots: Sequence[Slot], policy: PolicyState, row: int) -> str:
    """The game whose agents fill env ``row`` of ``policy``."""
    for s, start in policy.offsets.items():
        game = slots[s].game
        if game is not None and start <= row < start + game.groups[policy.name].n_agents:
            return game.label
    return f"row {row}"
