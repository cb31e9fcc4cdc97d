"""Body codecs: msgpack (one place for its settings), Godot Variant and JSON, one per ``kinds.BodyKind``.

A native peer's hello fixes its codec; the broker answers it in the same codec.
"""

from __future__ import annotations

import struct
import threading
from typing import Annotated, Any, Final, Literal

import msgpack
import msgspec

from broker.protocol.arrays import MAX_NDIM
from broker.protocol.errors import ErrorCode, RemoteProtocolError
from broker.protocol.framing import DEFAULT_MAX_FRAME_BYTES, HEADER, encode_frame
from broker.protocol.json_body import pack_json, unpack_json
from broker.protocol.kinds import BodyKind as BodyKind  # re-exported: a body kind names its codec
from broker.protocol.kinds import body_kind as body_kind
from broker.protocol.limits import MAX_FRAME_ELEMENTS, MAX_NESTING


def encode_body(kind: BodyKind, obj: dict[str, Any]) -> bytes:
    if kind is BodyKind.MSGPACK:
        return pack(obj)
    if kind is BodyKind.GODOT:
        return _godot_codec().encode(obj)
    return pack_json(obj)


def decode_body(kind: BodyKind, body: bytes | memoryview) -> dict[str, Any]:
    if kind is BodyKind.MSGPACK:
        return unpack_viewing_arrays(body)
    if kind is BodyKind.GODOT:
        return _godot_codec().decode(body)
    return unpack_json(body)


def _godot_codec() -> Any:
    try:
        from broker.protocol import variant
    except ImportError:
        raise RemoteProtocolError(
            ErrorCode.NOT_SUPPORTED, "Godot Variant bodies are not supported by this build"
        ) from None
    return variant


def pack(obj: dict[str, Any]) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def encode_message_frame(kind: BodyKind, obj: dict[str, Any]) -> bytes:
    """``encode_frame(encode_body(kind, obj))`` with one allocation and one copy for msgpack bodies.

    The body is packed into this thread's reused msgpack buffer and copied once, behind its header, into
    the frame. Separate body and frame objects cost a second large allocation per message, and for frames
    of a few hundred KiB that (fresh pages, page faults) costs several times the packing itself.
    """
    if kind is not BodyKind.MSGPACK:
        return encode_frame(encode_body(kind, obj))
    if _packers.busy:  # re-entered on this thread (a signal handler sending): pack the plain way
        return encode_frame(pack(obj))
    packer = _packers.packer
    _packers.busy = True
    try:
        packer.pack(obj)
        with packer.getbuffer() as body:
            size = len(body)
            frame = HEADER.pack(size) + body
    finally:
        packer.reset()
        _packers.busy = False
    if size > _KEEP_PACKER_BYTES:  # do not keep a huge buffer around for one huge message
        _packers.packer = msgpack.Packer(use_bin_type=True, autoreset=False)
    return frame


# One reused Packer per thread for encode_message_frame. Its buffer grows to the largest message packed
# (kept up to the default frame limit, so what stays allocated per thread is bounded).
_KEEP_PACKER_BYTES: Final = DEFAULT_MAX_FRAME_BYTES


class _Packers(threading.local):
    def __init__(self) -> None:
        self.packer = msgpack.Packer(use_bin_type=True, autoreset=False)
        self.busy = False


_packers = _Packers()


def unpack(body: bytes | memoryview) -> dict[str, Any]:
    """Decode a msgpack body into a map; any failure is the peer's. ``bin`` values come back as bytes.

    A body larger than MAX_FRAME_ELEMENTS bytes is scanned first (``check_msgpack_bounds``); a smaller one
    cannot hold more values than it has bytes.
    """
    if len(body) > MAX_FRAME_ELEMENTS:
        check_msgpack_bounds(body)
    return _unpack_checked(body)


def _unpack_checked(body: bytes | memoryview) -> dict[str, Any]:
    """``unpack`` of a body whose bounds were checked already."""
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=False, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise RemoteProtocolError(ErrorCode.MALFORMED, f"undecodable msgpack body: {exc}") from None
    if not isinstance(obj, dict):
        raise RemoteProtocolError(ErrorCode.MALFORMED, f"message must be a map, got {type(obj).__name__}")
    return obj


# --- the hot path: step, act, actions and batch with their arrays' data as views of the body -------------
# These structs are also what ``hot.py`` encodes those messages from: their fields are in the order the
# message tables write them, and absent defaults are omitted as the tables omit them.
# msgpack-python copies every bin value out of the body; msgspec's typed decoder can instead give a
# memoryview into it, which is what lets an array be a view of the frame it came in. These schemas only
# parse: anything they do not match (a missing field, a key of another type, a bool for an int, a key no
# message has, which msgspec would skip without checking its bytes ...) is decoded again the general way,
# so every check and error text stays with the message table.


WireDtype = Literal[
    "bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float32", "float64"
]  # arrays.DTYPES' names (tests/test_hot.py checks they agree)


class ArrayWire(msgspec.Struct, forbid_unknown_fields=True):
    dtype: WireDtype
    shape: Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=MAX_NDIM)]
    data: memoryview


class FinalWire(msgspec.Struct, forbid_unknown_fields=True):
    index: ArrayWire
    obs: dict[str, ArrayWire]


class StepDataWire(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    obs: dict[str, ArrayWire]
    reward: ArrayWire
    terminated: ArrayWire
    truncated: ArrayWire
    final: FinalWire | None = None
    infos: Any = msgspec.UNSET
    frames: ArrayWire | msgspec.UnsetType = msgspec.UNSET


class StepWire(msgspec.Struct, tag_field="type", tag="step", forbid_unknown_fields=True):
    tick: int
    groups: dict[str, StepDataWire]


class BatchWire(
    msgspec.Struct, tag_field="type", tag="batch", forbid_unknown_fields=True, omit_defaults=True, kw_only=True
):
    """StepDataWire's fields behind ``step``, in the order ``Batch.to_wire`` writes them."""

    step: int
    obs: dict[str, ArrayWire]
    reward: ArrayWire
    terminated: ArrayWire
    truncated: ArrayWire
    final: FinalWire | None = None
    infos: Any = msgspec.UNSET
    frames: ArrayWire | msgspec.UnsetType = msgspec.UNSET
    policy: str | msgspec.UnsetType = msgspec.UNSET  # a sampler's batch


class ActWire(msgspec.Struct, tag_field="type", tag="act", forbid_unknown_fields=True):
    step: int
    actions: dict[str, ArrayWire]
    policy: str | msgspec.UnsetType = msgspec.UNSET  # a sampler's act


class ActionsWire(msgspec.Struct, tag_field="type", tag="actions", forbid_unknown_fields=True):
    tick: int
    groups: dict[str, dict[str, ArrayWire]]


def _ext(code: int, data: memoryview) -> msgpack.ExtType:
    return msgpack.ExtType(code, bytes(data))  # the type msgpack-python gives, so texts naming it agree


HOT_DECODER: Final = msgspec.msgpack.Decoder(StepWire | BatchWire | ActWire | ActionsWire, ext_hook=_ext)
# How this package's encoders begin these messages (a map, then "type" first); other bodies go the general way.
HOT_PREFIXES: Final = tuple(b"\xa4type" + msgpack.packb(name) for name in ("step", "batch", "act", "actions"))


def _array_map(a: ArrayWire) -> dict[str, Any]:
    return {"dtype": a.dtype, "shape": a.shape, "data": a.data}


def _arrays_map(arrays: dict[str, ArrayWire]) -> dict[str, Any]:
    return {k: {"dtype": a.dtype, "shape": a.shape, "data": a.data} for k, a in arrays.items()}


def _step_data_map(s: StepDataWire | BatchWire, into: dict[str, Any]) -> dict[str, Any]:
    into["obs"] = _arrays_map(s.obs)
    into["reward"] = _array_map(s.reward)
    into["terminated"] = _array_map(s.terminated)
    into["truncated"] = _array_map(s.truncated)
    if s.final is not None:
        into["final"] = {"index": _array_map(s.final.index), "obs": _arrays_map(s.final.obs)}
    if s.infos is not msgspec.UNSET:
        into["infos"] = s.infos
    if not isinstance(s.frames, msgspec.UnsetType):
        into["frames"] = _array_map(s.frames)
    return into


def _hot_map(wire: Any) -> dict[str, Any]:
    if isinstance(wire, StepWire):
        return {"type": "step", "tick": wire.tick, "groups": {k: _step_data_map(v, {}) for k, v in wire.groups.items()}}
    if isinstance(wire, BatchWire):
        head: dict[str, Any] = {"type": "batch", "step": wire.step}
        if not isinstance(wire.policy, msgspec.UnsetType):
            head["policy"] = wire.policy
        return _step_data_map(wire, head)
    if isinstance(wire, ActWire):
        act = {"type": "act", "step": wire.step, "actions": _arrays_map(wire.actions)}
        if not isinstance(wire.policy, msgspec.UnsetType):
            act["policy"] = wire.policy
        return act
    return {"type": "actions", "tick": wire.tick, "groups": {k: _arrays_map(v) for k, v in wire.groups.items()}}


# Below this a body is decoded the general way: copying a few KiB of array data costs less than the
# typed decode and the map built from it.
VIEW_MIN_BYTES: Final = 16 * 1024


def unpack_viewing_arrays(body: bytes | memoryview) -> dict[str, Any]:
    """``unpack``, but the arrays of a well-formed step, act, actions or batch of at least VIEW_MIN_BYTES
    keep their data as views of ``body`` instead of copies (the map is otherwise the same). The body must
    then stay unchanged for as long as those views live: frame bodies are never reused (``FrameDecoder``)."""
    if len(body) < VIEW_MIN_BYTES or not bytes(body[1:14]).startswith(HOT_PREFIXES):
        return unpack(body)
    if len(body) > MAX_FRAME_ELEMENTS:
        check_msgpack_bounds(body)
    try:
        return _hot_map(HOT_DECODER.decode(body))
    except Exception:  # any refusal (msgspec raises several types): the general way says what is wrong
        return _unpack_checked(body)


def _msgpack_fixed_sizes() -> tuple[int, ...]:
    """Bytes a msgpack value takes from its first byte, for values of a fixed size (0: any other)."""
    sizes = [0] * 256
    for first in range(256):
        if first <= 0x7F or first >= 0xE0 or first in (0xC0, 0xC2, 0xC3):  # fixints, nil, bools
            sizes[first] = 1
        elif 0xA0 <= first <= 0xBF:  # fixstr
            sizes[first] = 1 + (first & 0x1F)
    fixed = {0xCA: 5, 0xCB: 9, 0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9, 0xD0: 2, 0xD1: 3, 0xD2: 5, 0xD3: 9}
    fixed.update({0xD4: 3, 0xD5: 4, 0xD6: 6, 0xD7: 10, 0xD8: 18})  # fixext 1-16
    for first, size in fixed.items():
        sizes[first] = size
    return tuple(sizes)


_MSGPACK_FIXED: Final = _msgpack_fixed_sizes()
_BE8, _BE16, _BE32 = struct.Struct(">B"), struct.Struct(">H"), struct.Struct(">I")
# str, bin and ext with a length field: first byte -> (length field, bytes between it and the payload)
_MSGPACK_SIZED: Final = {
    0xC4: (_BE8, 0),
    0xC5: (_BE16, 0),
    0xC6: (_BE32, 0),
    0xC7: (_BE8, 1),
    0xC8: (_BE16, 1),
    0xC9: (_BE32, 1),
    0xD9: (_BE8, 0),
    0xDA: (_BE16, 0),
    0xDB: (_BE32, 0),
}
# array16/32, map16/32: first byte -> (count field, values per entry)
_MSGPACK_CONTAINERS: Final = {0xDC: (_BE16, 1), 0xDD: (_BE32, 1), 0xDE: (_BE16, 2), 0xDF: (_BE32, 2)}


def check_msgpack_bounds(
    body: bytes | memoryview, max_elements: int = MAX_FRAME_ELEMENTS, max_nesting: int = MAX_NESTING
) -> None:
    """Walk a msgpack body's headers (payloads are skipped, nothing is built) and refuse it when its
    containers declare more than ``max_elements`` values in all or nest deeper than ``max_nesting``.

    Declared counts are added as each container opens, so a header announcing millions of entries is
    refused at once, and the walk visits at most ``max_elements`` values. A body that is cut short or
    otherwise invalid passes; msgpack itself then reports it.
    """
    fixed = _MSGPACK_FIXED
    size = len(body)
    pos = 0
    declared = 1
    open_counts: list[int] = []  # values still to come in each enclosing container
    left = 1
    while True:
        while not left:
            if not open_counts:
                return
            left = open_counts.pop()
        left -= 1
        if pos >= size:
            return
        first = body[pos]
        step = fixed[first]
        if step:
            pos += step
            continue
        if 0x80 <= first <= 0x9F:  # fixmap, fixarray
            count = (first & 0x0F) * (2 if first < 0x90 else 1)
            pos += 1
        elif first in _MSGPACK_CONTAINERS:
            field, per_entry = _MSGPACK_CONTAINERS[first]
            if pos + 1 + field.size > size:
                return
            count = field.unpack_from(body, pos + 1)[0] * per_entry
            pos += 1 + field.size
        elif first in _MSGPACK_SIZED:
            field, gap = _MSGPACK_SIZED[first]
            if pos + 1 + field.size > size:
                return
            pos += 1 + field.size + gap + field.unpack_from(body, pos + 1)[0]
            continue
        else:
            return  # 0xC1, never used: msgpack refuses it
        if len(open_counts) >= max_nesting:
            raise RemoteProtocolError(ErrorCode.MALFORMED, f"msgpack body nests deeper than {max_nesting} levels")
        declared += count
        if declared > max_elements:
            raise RemoteProtocolError(
                ErrorCode.MALFORMED,
                f"msgpack body declares more than {max_elements} values (a container of {count} at byte {pos})",
            )
        if count:
            open_counts.append(left)
            left = count
