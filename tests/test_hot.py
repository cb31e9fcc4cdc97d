"""The per-step fast way (broker/protocol/hot.py) against the general way: the same bytes out, the same
message in, and nothing accepted that the general way refuses."""

from __future__ import annotations

import json
import typing
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.protocol import hot
from broker.protocol.arrays import DTYPES
from broker.protocol.codec import BodyKind, WireDtype, encode_message_frame, unpack
from broker.protocol.errors import RemoteProtocolError
from broker.protocol.framing import HEADER
from broker.protocol.gather import frame_buffers
from broker.protocol.hot import decode_hot, encode_hot_frame, hot_frame_buffers
from broker.protocol.messages import Batch, GameActions, GameStep, Message, StepData, TrainerAct, message_from_wire

VECTORS = json.loads((Path(__file__).parent / "vectors" / "protocol_v1.json").read_text())
HOT_TYPES = ("step", "batch", "act", "actions")
HOT_VECTORS = [
    v
    for v in VECTORS["vectors"]
    if v["codec"] == "msgpack" and unpack(bytes.fromhex(v["hex"])[HEADER.size :])["type"] in HOT_TYPES
]


def _general(body: bytes) -> Message:
    return message_from_wire(unpack(body))


def _same(a: Any, b: Any) -> bool:
    """Equal messages: the same type, fields, array dtypes, shapes and values."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        nan_too = a.dtype.kind == "f"  # a damaged body may carry NaN, which both ways decode alike
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b, equal_nan=nan_too)
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if hasattr(a, "__slots__") and not isinstance(a, (str, bytes)):
        return all(_same(getattr(a, name), getattr(b, name)) for name in a.__slots__)
    return bool(a == b)


def _has_infos(message: Message) -> bool:
    if isinstance(message, Batch):
        return bool(message.data.infos)
    return isinstance(message, GameStep) and any(d.infos for d in message.groups.values())


def test_the_typed_dtype_names_are_the_wire_dtypes() -> None:
    assert set(typing.get_args(WireDtype)) == set(DTYPES)


def test_there_are_hot_vectors_of_every_kind() -> None:
    kinds = {unpack(bytes.fromhex(v["hex"])[4:])["type"] for v in HOT_VECTORS}
    assert kinds == set(HOT_TYPES)


@pytest.mark.parametrize("vector", HOT_VECTORS, ids=lambda v: v["name"])
def test_every_hot_vector_decodes_and_encodes_as_the_general_way(vector: dict) -> None:
    frame = bytes.fromhex(vector["hex"])
    body = frame[HEADER.size :]
    general = _general(body)
    fast = decode_hot(body)
    if _has_infos(general):
        assert fast is None  # free-form infos are checked the general way
    else:
        assert fast is not None, "a vector this package wrote must take the fast way"
        assert _same(fast, general)
    assert encode_hot_frame(general) == frame


# --- random messages ---------------------------------------------------------------------------------

_DTYPE_NAMES = sorted(DTYPES)


@st.composite
def _arrays(draw: st.DrawFn, rows: int) -> np.ndarray:
    name = draw(st.sampled_from(_DTYPE_NAMES))
    width = draw(st.sampled_from([(), (3,), (2, 2), (0,)]))
    rng = np.random.default_rng(draw(st.integers(0, 1000)))
    values = rng.integers(0, 100, (rows, *width)).astype(DTYPES[name])
    return values


@st.composite
def _step_data(draw: st.DrawFn) -> StepData:
    n = draw(st.integers(0, 5))
    keys = draw(st.lists(st.sampled_from(["obs", "img", "ray", "x"]), unique=True, max_size=3))
    obs = {k: draw(_arrays(n)) for k in keys}
    reward = np.linspace(-1, 1, n).astype(np.float32)
    flags = np.array([draw(st.booleans()) for _ in range(n)], np.bool_)
    final_index = final_obs = None
    if n and draw(st.booleans()):
        final_index = np.array(sorted(draw(st.sets(st.integers(0, n - 1), min_size=1))), np.int32)
        final_obs = {k: np.zeros((len(final_index), *a.shape[1:]), a.dtype) for k, a in obs.items()}
    infos = {0: {"why": "timeout", "n": [1, 2.5, None]}} if n and draw(st.booleans()) else {}
    frames = np.arange(n, dtype=np.int32) if draw(st.booleans()) else None
    return StepData(obs, reward, flags, ~flags, final_index, final_obs, infos, frames)


_messages = st.one_of(
    st.builds(Batch, st.integers(0, 2**40), _step_data(), st.sampled_from(["", "red"])),
    st.builds(
        GameStep,
        st.integers(0, 2**40),
        st.dictionaries(st.sampled_from(["a", "b", "c"]), _step_data(), min_size=1, max_size=3),
    ),
    st.builds(
        TrainerAct,
        st.integers(0, 2**33),
        st.dictionaries(st.sampled_from(["move", "jump"]), _arrays(3), max_size=2),
        st.sampled_from(["", "blue"]),
    ),
    st.builds(
        GameActions,
        st.integers(0, 300),
        st.dictionaries(
            st.sampled_from(["a", "b"]), st.dictionaries(st.sampled_from(["m"]), _arrays(2), max_size=1), max_size=2
        ),
    ),
)


@settings(max_examples=300, deadline=None)
@given(_messages)
def test_random_messages_take_the_fast_way_to_the_same_bytes_and_back(message: Message) -> None:
    general_frame = encode_message_frame(BodyKind.MSGPACK, message.to_wire())
    assert encode_hot_frame(message) == general_frame
    assert hot.encode_typed_frame(message) == general_frame  # the Python way, whether or not the C way is built
    body = general_frame[HEADER.size :]
    general = _general(body)
    for fast in (decode_hot(body), hot.decode_typed(body)):
        if _has_infos(message):
            assert fast is None  # free-form infos are checked the general way
        else:
            assert fast is not None
            assert _same(fast, general)


def damaged(message: Message, data: st.DataObject) -> bytes:
    """``message``'s body with one bit flipped, one byte replaced, its end cut off, or bytes put in."""
    body = bytearray(encode_message_frame(BodyKind.MSGPACK, message.to_wire())[HEADER.size :])
    how = data.draw(st.sampled_from(["flip", "cut", "extend", "byte"]))
    position = data.draw(st.integers(0, len(body) - 1))
    if how == "flip":
        body[position] ^= 1 << data.draw(st.integers(0, 7))
    elif how == "byte":
        body[position] = data.draw(st.sampled_from([0x00, 0x7F, 0xC0, 0xC2, 0xC3, 0xCA, 0xCB, 0xD0, 0xFF, 0x90]))
    elif how == "cut":
        del body[position:]
    else:
        body[position:position] = data.draw(st.binary(min_size=1, max_size=4))
    return bytes(body)


@settings(max_examples=1500, deadline=None)
@given(_messages, st.data())
def test_a_damaged_body_is_never_accepted_by_the_fast_way_alone(message: Message, data: st.DataObject) -> None:
    """Flip, cut or extend a valid body: the fast way either declines it, or decodes what the general way
    decodes; it never accepts a body the general way refuses."""
    frozen = damaged(message, data)
    if not frozen:
        return
    try:
        general: Message | None = _general(frozen)
    except RemoteProtocolError:
        general = None
    fast = decode_hot(frozen)
    if fast is not None:
        assert general is not None, f"the fast way accepted a body the general way refuses: {frozen.hex()}"
        assert _same(fast, general)


def _read_only(array: np.ndarray) -> np.ndarray:
    array.setflags(write=False)
    return array


def test_large_arrays_go_out_from_their_own_memory_and_join_to_the_same_bytes() -> None:
    big = _read_only(np.arange(400 * 64, dtype=np.float32).reshape(400, 64))
    writable = np.ones((400, 64), np.float32)
    data = StepData(
        {"obs": big, "other": writable}, np.zeros(400, np.float32), np.zeros(400, np.bool_), np.zeros(400, np.bool_)
    )
    message = Batch(7, data)
    frame = encode_hot_frame(message)
    parts = hot_frame_buffers(message, 16 * 1024, writable_too=False)
    assert parts is not None and b"".join(bytes(p) for p in parts) == frame
    referenced = [p for p in parts if isinstance(p, memoryview)]
    assert len(referenced) == 1 and np.shares_memory(np.frombuffer(referenced[0], np.float32), big)
    parts = hot_frame_buffers(message, 16 * 1024, writable_too=True)
    assert parts is not None and b"".join(bytes(p) for p in parts) == frame
    assert sum(isinstance(p, memoryview) for p in parts) == 2


def test_the_marker_found_elsewhere_sends_the_frame_the_general_way() -> None:
    planted = np.frombuffer(hot._MARKER * 2, np.uint8).reshape(1, 32)  # as if a peer had guessed it
    big = _read_only(np.zeros((1, 8192), np.float32))
    data = StepData(
        {"obs": big, "planted": planted}, np.zeros(1, np.float32), np.zeros(1, np.bool_), np.zeros(1, np.bool_)
    )
    assert hot.typed_frame_buffers(Batch(1, data), 16 * 1024, writable_too=False) is None  # (the C way has no marker)
    parts = frame_buffers(BodyKind.MSGPACK, Batch(1, data))
    assert b"".join(bytes(p) for p in parts) == encode_message_frame(BodyKind.MSGPACK, Batch(1, data).to_wire())


@pytest.mark.parametrize("writable_too", [False, True])
def test_large_final_obs_and_several_groups_gather_in_their_encoded_order(writable_too: bool) -> None:
    def data(rows: int, ended: int, width: int) -> StepData:
        obs = {"img": _read_only(np.full((rows, width), rows, np.uint8)), "vec": np.ones((rows, 3), np.float32)}
        final_obs = {"img": _read_only(np.full((ended, width), 7, np.uint8)), "vec": np.zeros((ended, 3), np.float32)}
        index = np.arange(ended, dtype=np.int32)
        return StepData(
            obs, np.zeros(rows, np.float32), np.zeros(rows, np.bool_), np.ones(rows, np.bool_), index, final_obs
        )

    for message in (
        GameStep(3, {"a": data(4, 1, 84 * 84 * 3), "b": data(2, 2, 20_000)}),
        Batch(9, data(4, 1, 84 * 84 * 3)),
    ):
        parts = hot_frame_buffers(message, 16 * 1024, writable_too)
        assert parts is not None and sum(isinstance(p, memoryview) for p in parts) >= 2
        frame = b"".join(bytes(p) for p in parts)
        assert frame == encode_message_frame(BodyKind.MSGPACK, message.to_wire())
        assert _same(decode_hot(frame[HEADER.size :]), message)


def test_a_body_over_the_element_bound_is_scanned_then_takes_the_fast_way() -> None:
    from broker.protocol.limits import MAX_FRAME_ELEMENTS

    rows = MAX_FRAME_ELEMENTS // 256 + 1
    image = np.arange(rows * 256, dtype=np.uint32).astype(np.uint8).reshape(rows, 256)
    data = StepData({"img": image}, np.zeros(rows, np.float32), np.zeros(rows, np.bool_), np.zeros(rows, np.bool_))
    body = encode_message_frame(BodyKind.MSGPACK, GameStep(4, {"a": data}).to_wire())[HEADER.size :]
    assert len(body) > MAX_FRAME_ELEMENTS
    fast = decode_hot(body)
    assert fast is not None and _same(fast, _general(body))
    # a large body whose containers declare more values than the bound: the same refusal both ways
    at = body.index(b"\xa5shape\x92") + len(b"\xa5shape")
    hostile = body[:at] + b"\xdd\xff\xff\xff\xff" + body[at + 1 :]  # the shape declares 2**32 - 1 values
    with pytest.raises(RemoteProtocolError) as general:
        _general(bytes(hostile))
    with pytest.raises(RemoteProtocolError) as hot_way:
        decode_hot(bytes(hostile))
    assert str(hot_way.value) == str(general.value)
