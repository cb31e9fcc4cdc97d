"""Typed messages of protocol version 1: frozen, slotted, valid by construction and from the wire.

Every message is a msgpack map with a ``type`` string; ``docs/protocol.md`` lists them byte by byte. Each
message class declares one field table (``FIELDS``: wire key, check, decoder, encoder) that drives its
validation on construction, its wire map (``to_wire``, fields in wire order) and its decoding
(``from_wire``, in the same order, so the first bad field is the one reported). Arrays use the map form of
:mod:`broker.protocol.arrays`. Per-agent values always travel as one array per key for the whole group,
so nothing here loops over agents. A message that cannot exist raises the RemoteProtocolError its wire
form would get, with the same code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, get_args

import numpy as np

from broker.protocol.errors import ErrorCode, RemoteProtocolError, summarize
from broker.protocol.fields import (
    Field,
    WireMessage,
    check_array_map,
    check_text,
    counter,
    decode_array_field,
    decode_named_arrays,
    encode_arrays,
    is_int,
    malformed,
)
from broker.protocol.hello import ALL_GAMES, Hello
from broker.protocol.limits import MAX_GROUPS
from broker.protocol.spaces import PolicySpaces
from broker.protocol.stepdata import MAX_INFO_ENTRIES, StepData, check_info
from broker.protocol.stepping import (
    DEFAULT_HOLD_DEADLINE_MS,
    HOLD_ACTIONS,
    HOLD_DEADLINE_DEFAULT_TEXT,
    MAX_ADAPTIVE_DEADLINE_MS,
    RESPONSE_MARGIN,
    RESPONSE_WINDOW,
    STEPPING_MODES,
    StepOptions,
)

__all__ = [
    "ALL_GAMES",
    "DEFAULT_HOLD_DEADLINE_MS",
    "HOLD_ACTIONS",
    "HOLD_DEADLINE_DEFAULT_TEXT",
    "MAX_ADAPTIVE_DEADLINE_MS",
    "MAX_GROUPS",
    "MAX_INFO_ENTRIES",
    "RESPONSE_MARGIN",
    "RESPONSE_WINDOW",
    "STEPPING_MODES",
    "Batch",
    "Close",
    "Control",
    "Error",
    "GameActions",
    "GameLayout",
    "GameStep",
    "Hello",
    "Message",
    "PolicyInfo",
    "Status",
    "StepData",
    "StepOptions",
    "TrainerAct",
    "TrainerReset",
    "Waiting",
    "Welcome",
    "check_info",
    "message_from_wire",
]


# --- messages ---------------------------------------------------------------------------------------


def _decode_groups(value: Any, what: str, key: str) -> dict[str, StepData]:
    if not isinstance(value, dict) or not 1 <= len(value) <= MAX_GROUPS:
        raise malformed("step.groups must be a map of policy name to step data")
    return {str(k): StepData.from_wire(v, f"step.groups.{k}") for k, v in value.items()}


def _step_groups(value: Any, what: str, key: str) -> None:
    if not isinstance(value, dict) or not 1 <= len(value) <= MAX_GROUPS:
        raise malformed("step.groups must be a map of policy name to step data")
    for name, data in value.items():
        if type(name) is not str or not isinstance(data, StepData):
            raise malformed(f"step.groups: entry {summarize(name)} must map a policy name to step data")


@dataclass(frozen=True, slots=True)
class GameStep(WireMessage):
    """A game's observations for all its groups at one decision tick; tick 0 is the first."""

    TYPE: ClassVar[str] = "step"
    FIELDS: ClassVar[tuple[Field, ...]] = (
        Field("tick", counter()),
        Field("groups", _step_groups, _decode_groups, lambda gs: {k: v.to_wire() for k, v in gs.items()}),
    )
    tick: int
    groups: dict[str, StepData]


@dataclass(frozen=True, slots=True)
class TrainerReset(WireMessage):
    """Ask for the observations to act on. Games are not reset: their agents reset themselves."""

    TYPE: ClassVar[str] = "reset"


@dataclass(frozen=True, slots=True)
class TrainerAct(WireMessage):
    """A trainer's actions for every slot of its policy, answering batch ``step``. A sampler names the
    policy (``policy``); a per-policy trainer leaves it empty."""

    TYPE: ClassVar[str] = "act"
    FIELDS: ClassVar[tuple[Field, ...]] = (
        Field("step", counter()),
        Field("actions", check_array_map, decode_array_field, encode_arrays),
        Field("policy", check_text, absent="", sent=lambda m: m.policy != ""),
    )
    step: int
    actions: dict[str, np.ndarray]
    policy: str = ""


# --- broker -> peer -------------------------------------------------------------------------------


def _any_int(value: Any, what: str, key: str) -> None:
    if value is not None and not is_int(value):
        raise malformed(f"{what}.{key} must be an integer")


@dataclass(frozen=True, slots=True)
class Welcome(WireMessage):
    TYPE: ClassVar[str] = "welcome"
    FIELDS: ClassVar[tuple[Field, ...]] = (
        Field("protocol", counter()),
        Field("peer_id", counter()),
        Field("game_index", _any_int, sent=lambda m: m.game_index is not None),
    )
    protocol: int
    peer_id: int
    game_index: int | None = None


def _action_groups(value: Any, what: str, key: str) -> None:
    if not isinstance(value, dict):
        raise malformed("actions.groups must be a map")
    for name, arrays in value.items():
        check_array_map(arrays, what, str(name))


def _decode_action_groups(value: Any, what: str, key: str) -> dict[str, dict[str, np.ndarray]]:
    if not isinstance(value, dict):
        raise malformed("actions.groups must be a map")
    return {str(k): decode_named_arrays(v, f"actions.{k}") for k, v in value.items()}


@dataclass(frozen=True, slots=True)
class GameActions(WireMessage):
    """The actions for one game, answering its step ``tick``.

    A group missing from ``groups`` is held: its agents keep executing their previous action
    (hold-and-accumulate stepping, while that policy's trainer is busy).
    """

    TYPE: ClassVar[str] = "actions"
    FIELDS: ClassVar[tuple[Field, ...]] = (
        Field("tick", counter()),
        Field("groups", _action_groups, _decode_action_groups, lambda gs: {k: encode_arrays(v) for k, v in gs.items()}),
    )
    tick: int
    groups: dict[str, dict[str, np.ndarray]]


@dataclass(frozen=True, slots=True)
class GameLayout:
    """Where one game's agents of a policy sit in that policy's VecEnv."""

    game_index: int
    offset: int
    n_agents: int


def _layouts(value: Any, what: str, key: str) -> None:
    if not isinstance(value, tuple) or not all(isinstance(g, GameLayout) for g in value):
        raise malformed("policy.games must list [game_index, offset, n_agents] triples")


def _decode_layouts(value: Any, what: str, key: str) -> tuple[GameLayout, ...]:
    if not isinstance(value, list) or not all(
        isinstance(g, list) and len(g) == 3 and all(isinstance(v, int) for v in g) for g in value
    ):
        raise malformed("policy.games must list [game_index, offset, n_agents] triples")
    return tuple(GameLayout(*g) for g in value)


def _spaces(value: Any, what: str, key: str) -> None:
    if not isinstance(value, PolicySpaces):
        raise malformed("policy.spaces must be PolicySpaces")


@dataclass(frozen=True, slots=True)
class PolicyInfo(WireMessage):
    """Sent to a trainer once every expected game has joined: the VecEnv's size and spaces."""

    TYPE: ClassVar[str] = "policy"
    FIELDS: ClassVar[tuple[Field, ...]] = (
        Field("policy", check_text),
        Field("n_envs", counter(1)),
        Field(
            "spaces",
            _spaces,
            lambda obj, what, key: PolicySpaces.from_wire(obj.get("observation_space"), obj.get("action_space"), what),
            lambda s: {"observation_space": s.observation_wire(), "action_space": s.action_wire()},
            wire=None,
        ),
        Field("games", _layouts, _decode_layouts, lambda gs: [[g.game_index, g.offset, g.n_agents] for g in gs]),
    )
    policy: str
    n_envs: int
    spaces: PolicySpaces
    games: tuple[GameLayout, ...]


def _step_data(value: Any, what: str, key: str) -> None:
    if not isinstance(value, StepData):
        raise malformed(f"{what}.data must be StepData")


@dataclass(frozen=True, slots=True)
class Batch(WireMessage):
    """One step of a policy's VecEnv: every slot, from every game. To a sampler it names the policy."""

    TYPE: ClassVar[str] = "batch"
    FIELDS: ClassVar[tuple[Field, ...]] = (
        Field("step", counter()),
        Field("data", _step_data, lambda obj, what, key: StepData.from_wire(obj, what), StepData.to_wire, wire=None),
        Field("policy", check_text, absent="", sent=lambda m: m.policy != ""),
    )
    step: int
    data: StepData
    policy: str = ""  # set in batches to a sampler, which holds several policies


@dataclass(frozen=True, slots=True)
class Waiting(WireMessage):
    """Why a trainer's step has not returned yet (sent when the reason changes)."""

    TYPE: ClassVar[str] = "waiting"
    FIELDS: ClassVar[tuple[Field, ...]] = (
        Field("policy", check_text),
        Field("games_connected", counter()),
        Field("games_expected", counter()),
        Field("reason", check_text, absent=""),
    )
    policy: str
    games_connected: int
    games_expected: int
    reason: str


def _status_map(value: Any, what: str, key: str) -> None:
    if not isinstance(value, dict):
        raise malformed("status.status must be a map")


@dataclass(frozen=True, slots=True)
class Status(WireMessage):
    """The broker's live numbers, sent once to an observer."""

    TYPE: ClassVar[str] = "status"
    FIELDS: ClassVar[tuple[Field, ...]] = (Field("status", _status_map),)
    status: dict[str, Any]


def _control_args(value: Any, what: str, key: str) -> None:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise malformed("control.args must be a map with string keys")


@dataclass(frozen=True, slots=True)
class Control(WireMessage):
    """A control peer's one request (``freeze``, ``unfreeze``, ``self_play``); answered by a ``status``
    holding the result, or an ``error``; then the broker closes the connection."""

    TYPE: ClassVar[str] = "control"
    FIELDS: ClassVar[tuple[Field, ...]] = (Field("command", check_text), Field("args", _control_args, absent={}))
    command: str
    args: dict[str, Any]


# --- either direction -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Error(WireMessage):
    """The last message on a connection that failed: a stable code and a readable sentence."""

    TYPE: ClassVar[str] = "error"
    FIELDS: ClassVar[tuple[Field, ...]] = (Field("code", check_text), Field("message", check_text, absent=""))
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class Close(WireMessage):
    """An orderly goodbye (broker shutting down, or a peer leaving)."""

    TYPE: ClassVar[str] = "close"
    FIELDS: ClassVar[tuple[Field, ...]] = (Field("reason", check_text, absent=""),)
    reason: str = ""


Message = (
    Hello
    | GameStep
    | TrainerReset
    | TrainerAct
    | Welcome
    | GameActions
    | PolicyInfo
    | Batch
    | Waiting
    | Status
    | Control
    | Error
    | Close
)

MESSAGE_TYPES: dict[str, Any] = {cls.TYPE: cls for cls in get_args(Message)}


def message_from_wire(obj: dict[str, Any]) -> Message:
    kind = obj.get("type")
    cls = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise RemoteProtocolError(ErrorCode.UNKNOWN_MESSAGE, f"unknown message type {summarize(kind)}")
    message: Message = cls.from_wire(obj)
    return message
