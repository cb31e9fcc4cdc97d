"""The per-step messages (step, batch, act, actions) decoded straight into message objects.

The general way decodes a body into maps (msgpack), then walks the maps into typed messages
(``message_from_wire``), checking each field. For the four messages every step carries, msgspec's typed
decoder (``codec.HOT_DECODER``) already parses the body into structs with the right types, in C, with the
arrays' data as views of the body; this module turns those structs into the messages with only the checks
the types leave: dtype names, shapes against data lengths, row counts, limits, finiteness.

It accepts a subset of what the general way accepts and builds the same message from it. Anything else
(infos, an unknown key, a bad value, ...) returns None and goes the general way, so every refusal and its
text stay with the message table (``tests/test_hot.py`` checks both ways agree).
"""

from __future__ import annotations

import os
from typing import Any, Final

import msgspec
import numpy as np

from broker.protocol.arrays import DTYPES, MAX_NDIM, WIRE_NAMES, encode_array
from broker.protocol.codec import (
    HOT_DECODER,
    HOT_PREFIXES,
    ActionsWire,
    ActWire,
    ArrayWire,
    BatchWire,
    FinalWire,
    StepDataWire,
    StepWire,
    check_msgpack_bounds,
)
from broker.protocol.errors import ErrorCode
from broker.protocol.fields import MAX_ARRAY_KEYS, MAX_TEXT
from broker.protocol.framing import HEADER, Buffer, bin_header
from broker.protocol.limits import INT_MAX, MAX_FRAME_ELEMENTS, MAX_GROUPS
from broker.protocol.messages import Batch, GameActions, GameStep, Message, StepData, TrainerAct
from broker.protocol.native import NATIVE
from broker.protocol.spaces import check_finite
from broker.protocol.variant import FAST_MAX_BYTES as VARIANT_FAST_MAX_BYTES

_BOOL: Final = np.dtype("?")
_INT32: Final = np.dtype("<i4")
_FLOAT32: Final = np.dtype("<f4")
_UNSET: Final = msgspec.UNSET


class _Refused(Exception):
    """Not for this path: the general way decodes the body again and says what is wrong, if anything."""


def _configured_native() -> Any:
    """The C codec (broker/protocol/_native.c), handed the facts it checks against from their one place here."""
    native: Any = NATIVE
    if native is not None:
        limits = {
            "max_array_keys": MAX_ARRAY_KEYS,
            "max_text": MAX_TEXT,
            "max_groups": MAX_GROUPS,
            "max_ndim": MAX_NDIM,
            "int_max": INT_MAX,
        }
        native.configure(StepData, GameStep, Batch, TrainerAct, GameActions, DTYPES, limits)
    return native


# The bodies this package writes take the C way when it is built; what it leaves (None) goes on below.
_NATIVE: Final[Any] = _configured_native()


# --- building the per-step messages ---------------------------------------------------------------------
# The classes' ``unchecked`` constructors, made in C when the codec is in use: a lock-step builds several (a
# batch's step data and the batch, a reply per game, an act), and the Python constructor is a frame each.


def new_step_data(
    obs: dict[str, np.ndarray],
    reward: np.ndarray,
    terminated: np.ndarray,
    truncated: np.ndarray,
    final_index: np.ndarray | None,
    final_obs: dict[str, np.ndarray] | None,
    infos: dict[int, dict[str, Any]],
    frames: np.ndarray | None,
) -> StepData:
    if _NATIVE is None:
        return StepData.unchecked(obs, reward, terminated, truncated, final_index, final_obs, infos, frames)
    data: StepData = _NATIVE.new(StepData, obs, reward, terminated, truncated, final_index, final_obs, infos, frames)
    return data


def new_batch(step: int, data: StepData, policy: str) -> Batch:
    if _NATIVE is None:
        return Batch.unchecked(step, data, policy)
    batch: Batch = _NATIVE.new(Batch, step, data, policy)
    return batch


def new_game_actions(tick: int, groups: dict[str, dict[str, np.ndarray]]) -> GameActions:
    if _NATIVE is None:
        return GameActions.unchecked(tick, groups)
    actions: GameActions = _NATIVE.new(GameActions, tick, groups)
    return actions


def new_act(step: int, actions: dict[str, np.ndarray], policy: str) -> TrainerAct:
    if _NATIVE is None:
        return TrainerAct.unchecked(step, actions, policy)
    act: TrainerAct = _NATIVE.new(TrainerAct, step, actions, policy)
    return act


def decode_hot(body: bytes | memoryview) -> Message | None:
    """A step, batch, act or actions message from a msgpack body, or None when the body is none of those
    as this package writes them, or needs a check only the general way makes."""
    if not bytes(body[1:14]).startswith(HOT_PREFIXES):
        return None
    if _NATIVE is not None:
        message: Message | None = _NATIVE.decode(body)
        if message is not None:
            return message
    return _decode_typed(body)


def decode_hot_godot(body: bytes | memoryview) -> Message | None:
    """The same from a Godot Variant body (the addon's), by the C way only; None: the general way decodes it
    (no C codec, a body longer than the fast Variant reader takes, or anything the C way does not read)."""
    if _NATIVE is None or len(body) > VARIANT_FAST_MAX_BYTES:
        return None
    message: Message | None = _NATIVE.decode_godot(body)
    return message


def decode_typed(body: bytes | memoryview) -> Message | None:
    """``decode_hot``'s Python way: msgspec's typed structs, then the checks the types leave."""
    if not bytes(body[1:14]).startswith(HOT_PREFIXES):
        return None
    return _decode_typed(body)


def _decode_typed(body: bytes | memoryview) -> Message | None:
    """``decode_typed`` once the body's prefix is known to be a hot message's."""
    if len(body) > MAX_FRAME_ELEMENTS:
        check_msgpack_bounds(body)  # as the general way does first: its refusal is the peer's error
    try:
        wire = HOT_DECODER.decode(body)
        if type(wire) is StepWire:
            return _step(wire)
        if type(wire) is BatchWire:
            return _batch(wire)
        if type(wire) is ActWire:
            return _act(wire)
        return _actions(wire)
    except Exception:  # _Refused, msgspec's refusals, numpy's for a shape it cannot make: the general way says
        return None


def _counter(value: int) -> int:
    if not 0 <= value <= INT_MAX:
        raise _Refused
    return value


def _text(value: str) -> str:
    if len(value) > MAX_TEXT:
        raise _Refused
    return value


def _array(wire: ArrayWire) -> np.ndarray:
    """The typed decode checked the dtype's name, the shape's length and its sizes; the data must fill it."""
    data = wire.data
    array = np.ndarray(wire.shape, DTYPES[wire.dtype], data)  # a view of data (frombuffer + reshape in one call)
    if array.nbytes != len(data):  # ndarray takes a longer buffer than it needs
        raise _Refused
    return array


def _arrays(wires: dict[str, ArrayWire]) -> dict[str, np.ndarray]:
    if len(wires) > MAX_ARRAY_KEYS:
        raise _Refused
    return {key: _array(wire) for key, wire in wires.items()}


def _rows(arrays: dict[str, np.ndarray], n: int) -> None:
    for array in arrays.values():
        if array.ndim < 1 or array.shape[0] != n:
            raise _Refused


def _step_data(wire: StepDataWire | BatchWire) -> StepData:
    """StepData.from_wire's checks, on the typed parts."""
    if wire.infos is not _UNSET:
        raise _Refused  # free-form infos: the general way checks them
    reward, terminated, truncated = _array(wire.reward), _array(wire.terminated), _array(wire.truncated)
    if reward.ndim != 1 or reward.dtype != _FLOAT32:
        raise _Refused
    check_finite(reward, "reward", ErrorCode.BAD_STEP)  # the one rule; a refusal goes the general way
    rows = reward.shape
    n = rows[0]
    if terminated.shape != rows or terminated.dtype != _BOOL or truncated.shape != rows or truncated.dtype != _BOOL:
        raise _Refused
    obs = _arrays(wire.obs)
    _rows(obs, n)
    final_index = final_obs = None
    final = wire.final
    if final is not None:
        final_index = _array(final.index)
        if final_index.ndim != 1 or final_index.dtype != _INT32:
            raise _Refused
        if len(final_index) and (final_index.min() < 0 or final_index.max() >= n):
            raise _Refused
        final_obs = _arrays(final.obs)
        _rows(final_obs, len(final_index))
    frames = None
    if wire.frames is not _UNSET:
        frames = _array(wire.frames)  # type: ignore[arg-type]
        if frames.shape != rows or frames.dtype != _INT32:
            raise _Refused
    return StepData.unchecked(obs, reward, terminated, truncated, final_index, final_obs, None, frames)


def _step(wire: StepWire) -> GameStep:
    groups = wire.groups
    if not 1 <= len(groups) <= MAX_GROUPS:
        raise _Refused
    step: GameStep = GameStep.unchecked(_counter(wire.tick), {k: _step_data(v) for k, v in groups.items()})
    return step


def _batch(wire: BatchWire) -> Batch:
    policy: Any = wire.policy
    batch: Batch = Batch.unchecked(
        _counter(wire.step),
        _step_data(wire),
        "" if policy is _UNSET else _text(policy),
    )
    return batch


def _act(wire: ActWire) -> TrainerAct:
    policy: Any = wire.policy
    act: TrainerAct = TrainerAct.unchecked(
        _counter(wire.step), _arrays(wire.actions), "" if policy is _UNSET else _text(policy)
    )
    return act


def _actions(wire: ActionsWire) -> GameActions:
    actions: GameActions = GameActions.unchecked(_counter(wire.tick), {k: _arrays(v) for k, v in wire.groups.items()})
    return actions


# --- encoding ----------------------------------------------------------------------------------------
# The decoding structs, filled from the message's parts: msgspec encodes them byte for byte as msgpack
# encodes ``to_wire()`` (tests/test_hot.py checks it on the shared vectors and on random messages).
# Encoding takes any buffer for an array's data (and a Raw stand-in) and any sequence for its shape, where
# decoding gives a memoryview and a list: hence the untyped constructor.
_array_wire: Any = ArrayWire


_ENCODER: Final = msgspec.msgpack.Encoder()
# Stands in for a large array's data in the encoded body, where the array's own memory goes instead. Random
# per process, so no peer can plant it; found any other number of times than placed, the frame goes the
# general way.
_MARKER: Final = os.urandom(16)


class _References:
    """The large arrays' memory an encoding refers to instead of copying, in the order they appear."""

    __slots__ = ("memory", "min_bytes", "writable_too")

    def __init__(self, min_bytes: int, writable_too: bool) -> None:
        self.memory: list[memoryview] = []
        self.min_bytes = min_bytes
        self.writable_too = writable_too


def _array_out(array: np.ndarray, refs: _References | None = None) -> ArrayWire:
    name = WIRE_NAMES.get(array.dtype)
    if name is None or array.ndim == 0 or not array.flags.c_contiguous:
        wire = encode_array(array)  # the general rules: a cast, a copy, a 0-d array made 1-d
        return _array_wire(wire["dtype"], wire["shape"], wire["data"])
    if refs is not None and array.nbytes >= refs.min_bytes and (refs.writable_too or not array.flags.writeable):
        refs.memory.append(array.data.cast("B"))
        return _array_wire(name, array.shape, msgspec.Raw(bin_header(array.nbytes) + _MARKER))
    return _array_wire(name, array.shape, array.data.cast("B") if array.size else b"")


def _arrays_out(arrays: dict[str, np.ndarray], refs: _References | None = None) -> dict[str, ArrayWire]:
    return {key: _array_out(array, refs) for key, array in arrays.items()}


def _step_data_parts(data: StepData, refs: _References | None) -> tuple[Any, Any, Any, Any, Any, Any, Any]:
    obs = _arrays_out(data.obs, refs)  # before the final obs: refs must be in the order they are encoded
    final = None
    if data.final_index is not None and data.final_obs is not None and len(data.final_index):
        final = FinalWire(_array_out(data.final_index), _arrays_out(data.final_obs, refs))
    return (
        obs,
        _array_out(data.reward),
        _array_out(data.terminated),
        _array_out(data.truncated),
        final,
        data.infos if data.infos else _UNSET,
        _UNSET if data.frames is None else _array_out(data.frames),
    )


def _out(message: Message, refs: _References | None = None) -> msgspec.Struct | None:
    if isinstance(message, Batch):
        obs, reward, terminated, truncated, final, infos, frames = _step_data_parts(message.data, refs)
        return BatchWire(
            step=message.step,
            obs=obs,
            reward=reward,
            terminated=terminated,
            truncated=truncated,
            final=final,
            infos=infos,
            frames=frames,
            policy=message.policy or _UNSET,
        )
    if isinstance(message, GameStep):
        groups = {k: StepDataWire(*_step_data_parts(v, refs)) for k, v in message.groups.items()}
        return StepWire(message.tick, groups)
    if isinstance(message, TrainerAct):
        return ActWire(message.step, _arrays_out(message.actions, refs), message.policy or _UNSET)
    if isinstance(message, GameActions):
        return ActionsWire(message.tick, {k: _arrays_out(v, refs) for k, v in message.groups.items()})
    return None


def encode_hot_frame(message: Message) -> bytes | None:
    """A step, batch, act or actions message's msgpack frame (header and body), or None for the others."""
    if _NATIVE is not None:
        buffers: list[bytes] | None = _NATIVE.encode(message, -1, False)
        if buffers is not None:
            return buffers[0]
    return encode_typed_frame(message)


def encode_hot_godot_frame(message: Message) -> bytes | None:
    """A step, batch, act or actions message's frame with a Godot Variant body, by the C way only: the bytes
    ``variant.encode(message.to_wire())`` gives; None: the general way encodes it (no C codec, infos, ...)."""
    if _NATIVE is None:
        return None
    frame: bytes | None = _NATIVE.encode_godot(message)
    return frame


def encode_typed_frame(message: Message) -> bytes | None:
    """``encode_hot_frame``'s Python way: msgspec encodes the typed structs filled from the message."""
    out = _out(message)
    if out is None:
        return None
    body = _ENCODER.encode(out)
    return HEADER.pack(len(body)) + body


def hot_frame_buffers(message: Message, min_bytes: int, writable_too: bool) -> list[Buffer] | None:
    """A step, batch, act or actions message's frame as buffers for one gather write: array data of
    ``min_bytes`` or more from the arrays' own memory (read-only memory only, unless ``writable_too``),
    the rest encoded; None for other messages. Joined, the bytes of ``encode_hot_frame``."""
    if _NATIVE is not None:
        buffers: list[Buffer] | None = _NATIVE.encode(message, min_bytes, writable_too)
        if buffers is not None:
            return buffers
    return typed_frame_buffers(message, min_bytes, writable_too)


def typed_frame_buffers(message: Message, min_bytes: int, writable_too: bool) -> list[Buffer] | None:
    """``hot_frame_buffers``' Python way: large arrays stood in by a marker in msgspec's encoding, then spliced."""
    refs = _References(min_bytes, writable_too)
    out = _out(message, refs)
    if out is None:
        return None
    body = _ENCODER.encode(out)
    memory = refs.memory
    if not memory:
        return [HEADER.pack(len(body)) + body]
    pieces = body.split(_MARKER)
    if len(pieces) != len(memory) + 1:
        return None  # the marker turned up inside the message too
    size = len(body) - len(memory) * len(_MARKER) + sum(ref.nbytes for ref in memory)
    parts: list[Buffer] = [HEADER.pack(size) + pieces[0]]
    for ref, piece in zip(memory, pieces[1:], strict=True):
        parts.append(ref)
        if piece:
            parts.append(piece)
    return parts
