"""Arrays decoded as views of their frame's own buffer, and the general decode for whatever the hot-path
schemas do not match (same maps, same errors)."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.protocol import PROTOCOL_VERSION
from broker.protocol.codec import (
    VIEW_MIN_BYTES,
    BodyKind,
    decode_body,
    encode_message_frame,
    unpack,
    unpack_viewing_arrays,
)
from broker.protocol.errors import ErrorCode, RemoteProtocolError
from broker.protocol.framing import FrameDecoder, encode_frame
from broker.protocol.limits import MAX_FRAME_ELEMENTS
from broker.protocol.messages import (
    Batch,
    GameActions,
    GameStep,
    Hello,
    Message,
    StepData,
    TrainerAct,
    message_from_wire,
)
from broker.protocol.spaces import BoxSpace, ContinuousAction, GroupSpec, PolicySpaces
from broker.server.config import ServerConfig
from broker.server.peer import PeerProtocol
from broker.server.server import BrokerServer
from tests.test_fuzz_broker import FakeTransport, read_into_protocol


def _data(n: int) -> StepData:
    return StepData(
        {"obs": np.arange(n * 64, dtype=np.float32).reshape(n, 64)},
        np.ones(n, np.float32),
        np.zeros(n, bool),
        np.zeros(n, bool),
        frames=np.ones(n, np.int32),
    )


def _receive(frame: bytes, writable: bool) -> memoryview | bytes:
    decoder = FrameDecoder(writable_bodies=writable)
    pos = 0
    while pos < len(frame):
        buffer = decoder.get_buffer(-1)
        n = min(len(buffer), len(frame) - pos)
        buffer[:n] = frame[pos : pos + n]
        decoder.buffer_updated(n)
        pos += n
    body = decoder.next_frame_view()
    assert body is not None
    return body


@pytest.mark.parametrize("writable", [False, True])
def test_batch_arrays_are_views_of_the_frame_buffer(writable: bool) -> None:
    sent = Batch(4, _data(400))
    body = _receive(encode_message_frame(BodyKind.MSGPACK, sent.to_wire()), writable)
    batch = message_from_wire(decode_body(BodyKind.MSGPACK, body))
    assert isinstance(batch, Batch)
    frame_bytes = np.frombuffer(body, np.uint8)
    for array in (batch.data.obs["obs"], batch.data.reward, batch.data.terminated, batch.data.frames):
        assert array is not None and np.shares_memory(array, frame_bytes)
        assert array.flags.writeable is writable
    np.testing.assert_array_equal(batch.data.obs["obs"], sent.data.obs["obs"])


def _array_maps(value: object) -> list[dict]:
    if isinstance(value, dict):
        if "data" in value and "dtype" in value:
            return [value]
        return [a for item in value.values() for a in _array_maps(item)]
    return []


@pytest.mark.parametrize(
    "message",
    [
        GameStep(3, {"a": _data(20), "b": _data(50)}),
        TrainerAct(2, {"move": np.ones((3000, 2), np.float32)}),
        GameActions(2, {"a": {"move": np.ones((3000, 2), np.float32)}, "b": {}}),
        Batch(0, _data(100)),
    ],
)
def test_hot_messages_decode_to_the_general_map(message: object) -> None:
    body = encode_message_frame(BodyKind.MSGPACK, message.to_wire())[4:]  # type: ignore[attr-defined]
    assert len(body) >= VIEW_MIN_BYTES
    viewed = unpack_viewing_arrays(body)
    assert any(isinstance(a["data"], memoryview) for a in _array_maps(viewed))
    assert viewed == unpack(body)  # memoryview == bytes compares the content


def _body(wire: dict) -> bytes:
    """Over VIEW_MIN_BYTES, so the hot schemas are tried: padded with an array where the message has a map
    of them, else with a key no message has (which sends the body the general way)."""
    padding = _array(shape=[VIEW_MIN_BYTES], data=bytes(4 * VIEW_MIN_BYTES))
    if wire["type"] == "act" and isinstance(wire.get("actions"), dict):
        wire = {**wire, "actions": {**wire["actions"], "padding": padding}}
    elif wire["type"] == "actions" and isinstance(wire.get("groups"), dict):
        wire = {**wire, "groups": {**wire["groups"], "padding": {"x": padding}}}
    else:
        wire = {**wire, "padding": padding}
    body = msgpack.packb(wire, use_bin_type=True)
    assert len(body) >= VIEW_MIN_BYTES
    return body


def _array(shape: object = (2,), data: object = b"\x00" * 8, dtype: object = "float32") -> dict:
    return {"dtype": dtype, "shape": shape, "data": data}


def _outcome(wire: dict) -> tuple[str, str] | bytes:
    """What the message table makes of a decoded map: its error, or the message encoded again."""
    try:
        return encode_message_frame(BodyKind.MSGPACK, message_from_wire(wire).to_wire())
    except RemoteProtocolError as exc:
        return (exc.code.value, exc.message)


@pytest.mark.parametrize(
    "wire",
    [
        {"type": "act", "step": 1, "actions": {"a": _array(shape=[True])}},  # bool in a shape
        {"type": "act", "step": 1, "actions": {"a": _array(data="text")}},  # str data
        {"type": "act", "step": True, "actions": {}},
        {"type": "act", "step": 1, "actions": {5: _array()}},  # a key of another type: accepted as "5"
        {"type": "actions", "tick": 1, "groups": {"p": {"a": _array(dtype=3)}}},
        {"type": "step", "tick": 0, "groups": {"p": {"obs": {}, "reward": _array(), "terminated": None}}},
        {"type": "step"},
        {
            "type": "batch",
            "step": 1,
            "obs": {},
            "reward": _array(),
            "terminated": _array(),
            "truncated": _array(),
            "infos": {0: {"x": msgpack.ExtType(3, b"x")}},
        },
    ],
)
def test_what_the_hot_schemas_refuse_gets_the_general_decode_and_its_errors(wire: dict) -> None:
    body = _body(wire)
    general = unpack(body)
    assert unpack_viewing_arrays(body) == general
    assert _outcome(decode_body(BodyKind.MSGPACK, body)) == _outcome(general)


def test_deep_nesting_in_a_hot_message_is_the_peers_error() -> None:
    """msgspec's typed decode recurses into an info map; nesting too deep for it must end as the general
    decoder's malformed error, never as a RecursionError (an internal error)."""
    array = _array(shape=[1], data=b"\x00" * 4)
    head = _body({"type": "batch", "step": 1, "obs": {}, "reward": array, "terminated": array, "truncated": array})
    body = bytes([head[0] + 1]) + head[1:] + msgpack.packb("infos") + b"\x81\x00" + b"\x91" * 100_000 + b"\xc0"
    assert len(body) < MAX_FRAME_ELEMENTS  # not scanned by the bounds check: the decoders meet it
    with pytest.raises(RemoteProtocolError) as err:
        decode_body(BodyKind.MSGPACK, body)
    assert err.value.code is ErrorCode.MALFORMED


_BIG_BATCH = encode_message_frame(BodyKind.MSGPACK, Batch(4, _data(100)).to_wire())[4:]


def _decoded_outcome(decode: object, body: bytes) -> tuple[str, str] | bytes:
    try:
        wire = decode(body)  # type: ignore[operator]
    except RemoteProtocolError as exc:
        return (exc.code.value, exc.message)
    return _outcome(wire)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 299), st.integers(0, 255)), min_size=1, max_size=4))
def test_mutated_large_bodies_fare_the_same_either_way(flips: list[tuple[int, int]]) -> None:
    """Bytes changed in a large batch's structure: the hot path accepts, or refuses with the same error,
    exactly what the general decoder does."""
    body = bytearray(_BIG_BATCH)
    for at, value in flips:
        body[at] = value
    assert _decoded_outcome(unpack_viewing_arrays, bytes(body)) == _decoded_outcome(unpack, bytes(body))


async def test_the_server_reads_a_games_step_into_the_memory_its_arrays_view() -> None:
    """PeerProtocol reads as a BufferedProtocol: the step's observations that reach the hub are views of the
    buffers the transport read into, with no bytes object per read and no join of a frame's pieces."""
    server = BrokerServer(ServerConfig(port=0, status_interval=0))
    entered: list[Message] = []
    enter = server.enter

    def recording_enter(peer: object, message: Message) -> None:
        entered.append(message)
        enter(peer, message)  # type: ignore[arg-type]

    server.enter = recording_enter  # type: ignore[method-assign]
    protocol = PeerProtocol(server)
    protocol.connection_made(FakeTransport())  # type: ignore[arg-type]
    spaces = PolicySpaces((("obs", BoxSpace((64,), "float32", -1.0, 1.0)),), (("move", ContinuousAction(2)),))
    hello = Hello("game", PROTOCOL_VERSION, "g", groups=(GroupSpec("p", 400, spaces),))
    read_into = read_into_protocol(protocol, encode_frame(msgpack.packb(hello.to_wire(), use_bin_type=True)), 1 << 16)
    for tick in range(2):  # the first frame's body gets its own buffer, the second lands in a fresh read
        data = _data(400)
        data.obs["obs"][:] = tick / 10
        frame = encode_message_frame(BodyKind.MSGPACK, GameStep(tick, {"p": data}).to_wire())
        read_into += read_into_protocol(protocol, frame, 1 << 16)
    steps = [m for m in entered if isinstance(m, GameStep)]
    assert [s.tick for s in steps] == [0, 1] and not protocol.closing
    for step in steps:
        obs = step.groups["p"].obs["obs"]
        assert obs[0, 0] == np.float32(step.tick / 10)
        assert any(np.shares_memory(obs, np.frombuffer(b, np.uint8)) for b in read_into)
