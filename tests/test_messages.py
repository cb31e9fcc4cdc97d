"""Messages: frozen and slotted, checked on construction with the codes their wire form gets, and
round-tripped through every codec that carries them."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from broker.protocol.codec import BodyKind, decode_body, encode_body
from broker.protocol.errors import ErrorCode, RemoteProtocolError
from broker.protocol.json_body import pack_json, unpack_json
from broker.protocol.messages import (
    MESSAGE_TYPES,
    Batch,
    Close,
    Error,
    GameActions,
    GameStep,
    Hello,
    Message,
    Status,
    StepData,
    TrainerAct,
    Waiting,
    Welcome,
    message_from_wire,
)
from tests.vectors.generate import messages

SAMPLES = [message for _, _, message in messages()]


def _data(n: int = 2) -> StepData:
    return StepData(
        {"obs": np.zeros((n, 3), np.float32)}, np.zeros(n, np.float32), np.zeros(n, bool), np.zeros(n, bool)
    )


def test_the_samples_cover_every_message_type() -> None:
    assert {type(m).TYPE for m in SAMPLES} == set(MESSAGE_TYPES)


def test_game_step_with_a_negative_tick_cannot_be_built() -> None:
    with pytest.raises(RemoteProtocolError) as err:
        GameStep(-5, {})
    assert err.value.code is ErrorCode.MALFORMED
    assert err.value.message == "step.tick must be an integer >= 0, got -5"


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_messages_are_frozen_and_slotted(message: Message) -> None:
    assert not hasattr(message, "__dict__")
    field = dataclasses.fields(message)[0].name if dataclasses.fields(message) else None
    if field is not None:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(message, field, getattr(message, field))


# (message, field, bad value, wire key or None when the wire form has no such value): constructing with the
# bad value raises the code that decoding a wire map holding it raises.
BAD_VALUES: list[tuple[Message, str, Any, str | None]] = [
    (GameStep(0, {"p": _data()}), "tick", -5, "tick"),
    (GameStep(0, {"p": _data()}), "tick", True, "tick"),
    (GameStep(0, {"p": _data()}), "groups", {}, "groups"),
    (TrainerAct(1, {"a": np.zeros(2, np.int32)}), "step", "1", "step"),
    (TrainerAct(1, {"a": np.zeros(2, np.int32)}), "actions", [1, 2], "actions"),
    (GameActions(1, {"p": {}}), "tick", -1, "tick"),
    (GameActions(1, {"p": {}}), "groups", [], "groups"),
    (Batch(3, _data()), "step", -2, "step"),
    (Welcome(1, 4), "peer_id", -3, "peer_id"),
    (Welcome(1, 4, 0), "game_index", "zero", "game_index"),
    (Waiting("p", 1, 2, "why"), "games_expected", 1.5, "games_expected"),
    (Waiting("p", 1, 2, "why"), "policy", None, "policy"),
    (Status({"a": 1}), "status", [1], "status"),
    (Error("code", "text"), "message", None, "message"),
    (Close("bye"), "reason", 7, "reason"),
    (Hello("observer", 1), "role", "robot", "role"),
    (Hello("observer", 1), "token", 5, "token"),
    (Hello("observer", 1), "protocol", "1", "protocol"),
]


@pytest.mark.parametrize(("message", "field", "bad", "key"), BAD_VALUES, ids=lambda v: str(v)[:30])
def test_bad_values_raise_the_code_their_wire_form_gets(message: Message, field: str, bad: Any, key: str) -> None:
    wire = message.to_wire()
    wire[key] = bad
    with pytest.raises(RemoteProtocolError) as from_wire:
        message_from_wire(wire)
    with pytest.raises(RemoteProtocolError) as built:
        dataclasses.replace(message, **{field: bad})  # type: ignore[type-var]
    assert built.value.code is from_wire.value.code


@pytest.mark.parametrize(
    "build",
    [
        lambda: StepData(
            {"obs": np.zeros((3, 2), np.float32)}, np.zeros(2, np.float32), np.zeros(2, bool), np.zeros(2, bool)
        ),
        lambda: StepData({"obs": np.zeros((2, 2))}, np.zeros(2, np.float32), np.zeros(3, bool), np.zeros(2, bool)),
        lambda: StepData({"obs": [[0.0]] * 2}, np.zeros(2, np.float32), np.zeros(2, bool), np.zeros(2, bool)),  # type: ignore[dict-item]
        lambda: dataclasses.replace(_data(), infos={5: {"x": 1}}),
        lambda: dataclasses.replace(_data(), frames=np.ones(3, np.int32)),
        lambda: dataclasses.replace(_data(), final_index=np.array([0], np.int32), final_obs={"obs": np.zeros((2, 3))}),
        lambda: Batch(1, {"obs": {}}),  # type: ignore[arg-type]
        lambda: GameStep(1, {"p": {"obs": {}}}),  # type: ignore[dict-item]
    ],
)
def test_inconsistent_step_data_cannot_be_built(build: Any) -> None:
    with pytest.raises(RemoteProtocolError) as err:
        build()
    assert err.value.code is ErrorCode.MALFORMED


def _reencoded(kind: BodyKind, message: Message) -> bytes:
    return encode_body(kind, message_from_wire(decode_body(kind, encode_body(kind, message.to_wire()))).to_wire())


@pytest.mark.parametrize("kind", [BodyKind.MSGPACK, BodyKind.GODOT])
@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips_in_the_native_codecs(kind: BodyKind, message: Message) -> None:
    assert _reencoded(kind, message) == encode_body(kind, message.to_wire())


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_messages_without_arrays_round_trip_in_json(message: Message) -> None:
    """JSON is the godot_rl plugin's codec: it has no binary type, so only messages without arrays have a
    JSON form; those round-trip through the same message table."""
    wire = message.to_wire()
    if type(message) in (GameStep, TrainerAct, GameActions, Batch):
        with pytest.raises(TypeError):
            pack_json(wire)
        return
    body = pack_json(wire)
    assert pack_json(message_from_wire(unpack_json(body)).to_wire()) == body
