"""The hub's records: one per game, trainer, slot and policy (their states: broker/core/states.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from broker.core.accumulate import SlotAccumulator
from broker.core.effects import Peer
from broker.core.holding import ResponseTimes
from broker.core.metrics import PolicyMetrics
from broker.core.states import GameState, GroupWait, TrainerState
from broker.protocol.messages import Batch, StepOptions
from broker.protocol.spaces import GroupSpec, PolicySpaces

if TYPE_CHECKING:
    from broker.core.claims import SamplerSession


@dataclass(eq=False)
class GameSession:
    peer: Peer
    peer_id: int
    name: str
    slot: int
    groups: dict[str, GroupSpec]
    state: GameState = GameState.STEPPING
    next_tick: int = 0
    tick: int = -1  # the tick awaiting its reply
    waits: dict[str, GroupWait] = field(default_factory=dict)  # policy -> deadline standing, this tick
    ready: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)  # actions not yet sent
    last_actions: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    steps: int = 0
    waiting_since: float = 0.0  # when the tick awaiting its reply arrived
    last_reply_at: float = float("-inf")  # when the game last got actions (idle pacing)
    # group -> the PolicyState its steps go to: the hub's, or a sampler's for a claimed game (broker/core/claims.py)
    policies: dict[str, PolicyState] = field(default_factory=dict)
    # Named in every step's checks (for their errors): built once, from what never changes in a session.
    label: str = field(init=False)

    def __post_init__(self) -> None:
        self.label = f"game {self.slot} ({self.name or self.peer.label})"

    @property
    def link(self) -> Peer:
        return self.peer

    @property
    def awaiting(self) -> bool:
        """A step waits for its reply."""
        return self.state in (GameState.WAITING, GameState.PACED)

    def wait_of(self, policy: str) -> GroupWait:
        return self.waits.get(policy, GroupWait.OPEN)


@dataclass(eq=False)
class TrainerSession:
    peer: Peer
    peer_id: int
    name: str
    policy: str
    options: StepOptions | None = None
    state: TrainerState = TrainerState.IDLE
    wants_since: float = 0.0  # when it last asked for a batch
    last_waiting: tuple[int, str] | None = None  # the last Waiting it was told (told again only if new)
    own: PolicyState | None = None  # a sampler's policy over its claimed games; None: the hub's policy

    @property
    def link(self) -> Peer:
        return self.peer

    @property
    def who(self) -> str:
        return self.name or self.peer.label

    @property
    def wants_batch(self) -> bool:
        return self.state is TrainerState.ASKING


@dataclass
class Slot:
    index: int
    layout: dict[str, int] | None = None  # policy -> n_agents, fixed by the first game in the slot
    game: GameSession | None = None
    seen_by_trainer: set[str] = field(default_factory=set)  # policies whose trainer saw these rows
    sampler: SamplerSession | None = None  # the sampler holding this slot's game now
    claimed: dict[str, PolicyState] | None = None  # once claimed, always a sampler's slot: where its groups go


class OpenBatch:
    """A batch sent to the policy's trainer and not answered yet, with the games whose rows it holds. Made
    once a step: a plain class, whose compiled constructor is C (a dataclass's ``__init__`` stays Python)."""

    def __init__(self, batch: Batch, since: float, games: dict[int, GameSession]) -> None:
        self.batch = batch
        self.since = since
        self.games = games  # slot -> the game then in it
        self.infos_dropped = False  # already re-sent without the infos its trainer's codec refused


@dataclass(eq=False)
class PolicyState:
    name: str
    spaces: PolicySpaces
    options: StepOptions
    offsets: dict[int, int] = field(default_factory=dict)  # slot -> first env index
    n_envs: int = 0
    trainer: TrainerSession | None = None  # attached: it has the PolicyInfo
    round: dict[int, SlotAccumulator] = field(default_factory=dict)  # slot -> ticks since the last batch
    open: OpenBatch | None = None
    last_obs: dict[str, np.ndarray] | None = None
    step: int = 0
    applied_at: dict[int, int] = field(default_factory=dict)  # slot -> game tick whose reply applied the actions
    unapplied: set[int] = field(default_factory=set)  # slots holding actions the game has not received yet
    metrics: PolicyMetrics = field(default_factory=PolicyMetrics)
    responses: ResponseTimes = field(default_factory=ResponseTimes)  # trainer answer times
    sampled: bool = False  # a sampler's own view of the games it claimed (broker/core/claims.py)

    @property
    def deadline_s(self) -> float | None:
        return self.options.deadline_s(self.responses.typical_s)

    @property
    def outstanding(self) -> Batch | None:
        return self.open.batch if self.open else None

    def record_response(self, seconds: float) -> None:
        if self.options.adapts:  # only an adaptive deadline reads them: no bookkeeping per answer otherwise
            self.responses.add(seconds)
