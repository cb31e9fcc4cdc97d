"""The Godot Variant codec (``broker.protocol.variant``): known answers from Godot's own format, the shared
godot test vectors (what the addon writes with ``var_to_bytes``), and fuzzing: for any body, ``decode``
returns a dict or raises RemoteProtocolError(MALFORMED), nothing else."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.protocol import PROTOCOL_VERSION, variant
from broker.protocol.arrays import decode_array, encode_array
from broker.protocol.codec import BodyKind, body_kind, decode_body, encode_body
from broker.protocol.connection import BrokerConnection, PeerConnection, State
from broker.protocol.errors import ErrorCode, LocalProtocolError, RemoteProtocolError
from broker.protocol.framing import FrameDecoder
from broker.protocol.messages import GameActions, Hello, Welcome, message_from_wire
from tests.vectors import generate

VECTORS_DIR = Path(__file__).parent / "vectors"
GODOT = json.loads((VECTORS_DIR / "protocol_v1_godot.json").read_text())
MSGPACK = {v["name"]: v for v in json.loads((VECTORS_DIR / "protocol_v1.json").read_text())["vectors"]}
GODOT_VECTORS = [v for v in GODOT["vectors"] if v["codec"] == "godot"]


def body_of(vector: dict[str, Any]) -> bytes:
    decoder = FrameDecoder()
    decoder.feed(bytes.fromhex(vector["hex"]))
    body = decoder.next_frame()
    assert body is not None and decoder.buffered_bytes == 0
    return body


def in_dict(value_bytes: str) -> bytes:
    """A one-entry Dictionary {"x": <value>} around raw value bytes (hex), as a message body."""
    key = bytes.fromhex("04000000 01000000 78000000")  # String "x", padded to 4
    return bytes.fromhex("1b000000 01000000") + key + bytes.fromhex(value_bytes)


def decode_or_malformed(body: bytes) -> dict[Any, Any] | None:
    """The decoder's whole contract: a dict, or RemoteProtocolError(MALFORMED)."""
    try:
        value = variant.decode(body)
    except RemoteProtocolError as exc:
        assert exc.code is ErrorCode.MALFORMED
        return None
    assert isinstance(value, dict)
    return value


# --- known answers (byte layouts from Godot's binary serialization docs and engine tests) ---------


@pytest.mark.parametrize(
    ("value", "wire"),
    [
        (None, "00000000"),
        (True, "01000000 01000000"),
        (False, "01000000 00000000"),
        (0x12345678, "02000000 78563412"),
        (-1, "02000000 ffffffff"),
        (2**31, "02000100 00000080 00000000"),  # beyond int32: ENCODE_FLAG_64
        (-(2**63), "02000100 00000000 00000080"),
        (0.15625, "03000000 0000203e"),  # exact in float32: written as 32-bit, as Godot does
        (1 / 3, "03000100 555555555555d53f"),  # needs 64 bits
        (math.inf, "03000000 0000807f"),
        ("", "04000000 00000000"),
        ("abc", "04000000 03000000 61626300"),  # padded to 4 with zeros
        ("éa", "04000000 03000000 c3a96100"),  # length counts UTF-8 bytes
        (b"\x01\x02\x03\x04\x05", "1d000000 05000000 0102030405000000"),
        ([], "1c000000 00000000"),
        ([1, "a"], "1c000000 02000000 02000000 01000000 04000000 01000000 61000000"),
    ],
)
def test_known_encodings(value: Any, wire: str) -> None:
    body = variant.encode({"x": value})
    assert body == in_dict(wire)
    decoded = variant.decode(body)["x"]
    assert decoded == value and type(decoded) is type(value)


@pytest.mark.parametrize(
    ("wire", "expected"),
    [
        ("15000000 04000000 6e616d65", "name"),  # StringName decodes as str
        ("02000100 efcdab8967452301", 0x0123456789ABCDEF),
        ("03000100 000000000000f03f", 1.0),  # a 64-bit float Godot never writes for 1.0 still decodes
        ("1e000000 02000000 01000000 feffffff", [1, -2]),  # PackedInt32Array
        ("1f000000 01000000 0100000000000080", [-(2**63) + 1]),  # PackedInt64Array
        ("20000000 01000000 0000c03f", [1.5]),  # PackedFloat32Array
        ("21000000 01000000 000000000000f83f", [1.5]),  # PackedFloat64Array
        ("22000000 02000000 02000000 61000000 03000000 62630000", ["a", "bc"]),  # counts the NUL
        ("1c000100 02000000 01000000 02000000 05000000", [5]),  # typed Array[int]
        ("1b000500 04000000 02000000 01000000 04000000 01000000 6b000000 02000000 07000000", {"k": 7}),
        ("1b000000 01000080 02000000 01000000 00000000", {1: None}),  # old "shared" bit ignored
    ],
)
def test_known_decodings(wire: str, expected: Any) -> None:
    assert variant.decode(in_dict(wire))["x"] == expected


def test_numpy_scalars_and_array_maps() -> None:
    body = variant.encode({"i": np.int64(7), "f": np.float32(0.5), "b": np.bool_(True)})
    assert variant.decode(body) == {"i": 7, "f": 0.5, "b": True}
    image = np.arange(24, dtype=np.uint8).reshape(2, 2, 2, 3)
    obs = np.array([[0.5, -0.25, 1.0]], np.float32)
    wire = {"camera_2d": encode_array(image), "obs": encode_array(obs[:, ::2])}  # a strided view too
    decoded = variant.decode(variant.encode(wire))
    assert isinstance(decoded["camera_2d"]["data"], bytes)
    np.testing.assert_array_equal(decode_array(decoded["camera_2d"], "camera_2d"), image)
    np.testing.assert_array_equal(decode_array(decoded["obs"], "obs"), obs[:, ::2])


def test_encoder_refuses_what_godot_cannot_hold() -> None:
    for bad in ({"x": object()}, {"x": 2**63}, {"x": "\ud800"}):
        with pytest.raises(LocalProtocolError):
            variant.encode(bad)
    with pytest.raises(LocalProtocolError):
        variant.encode([1, 2])  # type: ignore[arg-type]
    deep: Any = {}
    for _ in range(variant.MAX_DEPTH + 2):
        deep = {"d": deep}
    with pytest.raises(LocalProtocolError):
        variant.encode(deep)


# --- the shared vectors: what the addon writes and reads ------------------------------------------


def test_godot_vectors_file_is_up_to_date() -> None:
    assert (VECTORS_DIR / "protocol_v1_godot.json").read_text() == generate.render_godot(), (
        "run: python tests/vectors/generate.py"
    )


def test_godot_vectors_cover_every_message() -> None:
    assert [v["name"] for v in GODOT["vectors"]] == list(MSGPACK)
    assert GODOT["vectors"][0]["hex"] == MSGPACK["greeting_handshake"]["hex"]  # the greeting stays JSON


@pytest.mark.parametrize("vector", GODOT_VECTORS, ids=lambda v: v["name"])
def test_godot_vector_decodes_and_reencodes_identically(vector: dict[str, Any]) -> None:
    body = body_of(vector)
    assert body_kind(body) is BodyKind.GODOT
    wire = decode_body(BodyKind.GODOT, body)
    message = message_from_wire(wire)  # typed and validated, as the broker does
    assert generate.meaning(message.to_wire()) == vector["meaning"]
    assert variant.encode(wire) == body
    assert encode_body(BodyKind.GODOT, message.to_wire()) == body
    # Same maps as the msgpack vector of the same message: only the encoding differs.
    assert wire == decode_body(BodyKind.MSGPACK, body_of(MSGPACK[vector["name"]]))


def test_broker_connection_answers_a_godot_game_in_godot() -> None:
    vectors = {v["name"]: v for v in GODOT["vectors"]}
    broker = BrokerConnection()
    broker.receive_data(bytes.fromhex(vectors["hello_game"]["hex"]))
    hello = broker.next_event()
    assert isinstance(hello, Hello) and broker.codec is BodyKind.GODOT and broker.state is State.GAME
    assert [g.policy for g in hello.groups] == ["player", "platform"]
    assert broker.send(Welcome(PROTOCOL_VERSION, 7, 0)).hex() == vectors["welcome_game"]["hex"]
    actions = message_from_wire(decode_body(BodyKind.GODOT, body_of(vectors["actions_platform_held"])))
    assert isinstance(actions, GameActions)
    assert broker.send(actions).hex() == vectors["actions_platform_held"]["hex"]
    broker.receive_data(bytes.fromhex(MSGPACK["step_first"]["hex"]))  # switching codecs is refused
    with pytest.raises(RemoteProtocolError):
        broker.next_event()


def test_peer_connection_speaks_godot() -> None:
    vectors = {v["name"]: v for v in GODOT["vectors"]}
    hello = message_from_wire(decode_body(BodyKind.GODOT, body_of(vectors["hello_game"])))
    assert isinstance(hello, Hello)
    peer = PeerConnection(hello, codec=BodyKind.GODOT)
    assert peer.initial_bytes().hex() == vectors["hello_game"]["hex"]
    stream = "".join(vectors[n]["hex"] for n in ("greeting_handshake", "greeting_env_info", "welcome_game"))
    peer.receive_data(bytes.fromhex(stream))
    assert isinstance(peer.next_event(), Welcome)


# --- round trips of arbitrary message-like values -------------------------------------------------

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=variant.INT64_MIN, max_value=variant.INT64_MAX)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=40)
)
values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8) | st.integers(-5, 5), children, max_size=5)
    ),
    max_leaves=30,
)


@settings(max_examples=1000, deadline=None)
@given(st.dictionaries(st.text(max_size=8), values, max_size=6))
def test_round_trip(message: dict[str, Any]) -> None:
    body = variant.encode(message)
    assert len(body) % 4 == 0
    decoded = variant.decode(body)
    assert decoded == message
    assert variant.encode(decoded) == body


# --- hostile input: a dict or MALFORMED, and never a large allocation -----------------------------


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"\x1b\x00",
        bytes.fromhex("1b000000 ffffff7f"),  # 2**31-1 entries declared, none present
        in_dict("1c000000 ffffff7f"),  # huge Array
        in_dict("1d000000 ffffffff"),  # huge PackedByteArray
        in_dict("1e000000 ffffff3f"),  # huge PackedInt32Array
        in_dict("22000000 ffffffff"),  # huge PackedStringArray
        in_dict("04000000 ffffffff"),  # huge String
        in_dict("04000000 02000000 c328"),  # invalid UTF-8 (and short padding)
        in_dict("04000000 02000000 ff000000"),  # invalid UTF-8
        in_dict("01000000 02000000"),  # bool 2
        in_dict("c8000000"),  # unknown type 200
        in_dict("18000100 0100000000000000"),  # Object (as id): not message data
        in_dict("05000000 0000803f 0000803f"),  # Vector2: not message data
        in_dict("00010000"),  # unused header byte set
        in_dict("02000200 00000000"),  # unknown INT flags
        in_dict("1c000200 04000000 00000000"),  # Array typed with a class name
        in_dict("1c000100 ff000000 00000000"),  # Array typed with an unknown builtin type
        in_dict("00000000") + b"\x00\x00\x00\x00",  # trailing bytes
        in_dict("1b000000 01000000 1c000000 00000000 00000000"),  # an Array as a Dictionary key
        bytes.fromhex("1c000000 00000000"),  # top level is not a Dictionary
        bytes.fromhex("1b000000 01000000 04000000 01000000 78000000"),  # value missing
    ],
)
def test_hostile_bodies_are_malformed(body: bytes) -> None:
    with pytest.raises(RemoteProtocolError) as info:
        variant.decode(body)
    assert info.value.code is ErrorCode.MALFORMED


def test_deep_nesting_is_refused_without_recursion_error() -> None:
    body = bytes.fromhex("1b000000 01000000 04000000 01000000 78000000") + bytes.fromhex("1c000000 01000000") * 5000
    assert decode_or_malformed(body + bytes.fromhex("00000000")) is None


def test_every_truncation_of_every_vector() -> None:
    checked = 0
    for vector in GODOT_VECTORS:
        body = body_of(vector)
        for end in range(len(body)):
            assert decode_or_malformed(body[:end]) is None
            checked += 1
    assert checked > 5000


@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=256))
def test_fuzz_random_bytes(body: bytes) -> None:
    decode_or_malformed(body)
    decode_or_malformed(b"\x1b\x00\x00\x00" + body)  # past the codec sniffing, into the decoder proper


@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(GODOT_VECTORS),
    st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255), st.sampled_from("sid")), min_size=1, max_size=6),
)
def test_fuzz_mutated_vectors(vector: dict[str, Any], edits: list[tuple[int, int, str]]) -> None:
    body = bytearray(body_of(vector))
    for position, byte, how in edits:
        at = position % (len(body) + 1)
        if how == "s" and at < len(body):
            body[at] = byte
        elif how == "i":
            body[at:at] = bytes([byte])
        elif at < len(body):
            del body[at]
    decoded = decode_or_malformed(bytes(body))
    if decoded is not None:
        assert variant.encode(decoded)  # whatever decodes can be encoded again


@settings(max_examples=1500, deadline=None)
@given(st.sampled_from(GODOT_VECTORS), st.integers(0, 1 << 16), st.sampled_from([0x7FFFFFFF, 0xFFFFFFFF, 1 << 20]))
def test_fuzz_inflated_counts(vector: dict[str, Any], position: int, count: int) -> None:
    """Overwrite an aligned word with a huge count: refused by the bounds check, not by running out of memory."""
    body = bytearray(body_of(vector))
    at = (position % (len(body) // 4)) * 4
    body[at : at + 4] = struct.pack("<I", count)
    decode_or_malformed(bytes(body))
