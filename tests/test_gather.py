"""Gather encoding: a frame as buffers (large arrays by reference) is byte for byte the one-buffer frame."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from broker.protocol.codec import BodyKind, body_kind, decode_body, encode_message_frame
from broker.protocol.framing import HEADER
from broker.protocol.gather import GATHER_MIN_BYTES, frame_buffers, wire_buffers
from broker.protocol.messages import Batch, GameActions, GameStep, StepData, TrainerAct, message_from_wire

VECTORS = json.loads((Path(__file__).parent / "vectors" / "protocol_v1.json").read_text())
MSGPACK_VECTORS = [v for v in VECTORS["vectors"] if v["codec"] == "msgpack"]  # the others are JSON greetings


def _joined(parts: list[bytes | bytearray | memoryview]) -> bytes:
    return b"".join(bytes(p) for p in parts)


@pytest.mark.parametrize("vector", MSGPACK_VECTORS, ids=lambda v: v["name"])
def test_every_vector_gathers_to_its_own_bytes(vector: dict) -> None:
    frame = bytes.fromhex(vector["hex"])
    body = frame[HEADER.size :]
    assert body_kind(body) is BodyKind.MSGPACK
    wire = decode_body(BodyKind.MSGPACK, body)
    assert _joined(wire_buffers(wire)) == frame
    assert _joined(wire_buffers(wire, min_bytes=1, writable_too=True)) == frame  # every bin by reference
    message = message_from_wire(wire)
    assert _joined(frame_buffers(BodyKind.MSGPACK, message)) == frame


def _data(n: int, width: int, ended: bool = True) -> StepData:
    rng = np.random.default_rng(n * 7 + width)
    final = {"obs": rng.standard_normal((1, width)).astype(np.float32)} if ended else None
    return StepData(
        {"obs": rng.standard_normal((n, width)).astype(np.float32), "img": rng.integers(0, 255, (n, 9), np.uint8)},
        rng.standard_normal(n).astype(np.float32),
        np.arange(n) % 3 == 0,
        np.zeros(n, np.bool_),
        np.array([0], np.int32) if ended else None,
        final,
        {0: {"note": "x" * 40, "n": [1, 2.5, None]}},
        np.ones(n, np.int32),
    )


@pytest.mark.parametrize("n,width", [(1, 8), (64, 64), (400, 64), (1000, 300)])
def test_large_messages_gather_to_the_single_buffer_bytes(n: int, width: int) -> None:
    messages = [
        Batch(5, _data(n, width)),
        GameStep(9, {"a": _data(n, width), "b": _data(n, width, ended=False)}),
        TrainerAct(3, {"move": np.ones((n, width), np.float32), "jump": np.zeros(n, np.int32)}),
        GameActions(4, {"a": {"move": np.ones((n, width), np.float32)}, "b": {}}),
    ]
    for message in messages:
        single = encode_message_frame(BodyKind.MSGPACK, message.to_wire())
        assert _joined(frame_buffers(BodyKind.MSGPACK, message)) == single  # writable arrays: copied
        parts = frame_buffers(BodyKind.MSGPACK, message, writable_too=True)
        assert _joined(parts) == single
        if n * width * 4 >= GATHER_MIN_BYTES:  # the array's own memory goes out, not a copy
            referenced = [p for p in parts if isinstance(p, memoryview) and p.nbytes == n * width * 4]
            assert referenced
            if isinstance(message, Batch):
                assert np.shares_memory(np.frombuffer(referenced[0], np.uint8), message.data.obs["obs"])
        else:
            assert len(parts) == 1


def test_variant_bodies_are_one_buffer() -> None:
    message = Batch(5, _data(400, 64))
    parts = frame_buffers(BodyKind.GODOT, message)
    assert parts == [encode_message_frame(BodyKind.GODOT, message.to_wire())]


def test_a_gathered_frame_crosses_a_real_socket_whole() -> None:
    """sendmsg takes a large frame in parts; the reader gets exactly the single-buffer bytes."""
    import socket
    import threading

    from clients.transport import _send_buffers

    message = Batch(5, _data(20_000, 64))  # about 5 MB, far over one socket buffer
    single = encode_message_frame(BodyKind.MSGPACK, message.to_wire())
    writer, reader = socket.socketpair()
    writer.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
    received = bytearray()

    def read() -> None:
        while len(received) < len(single):
            chunk = reader.recv(1 << 16)
            if not chunk:
                return
            received.extend(chunk)

    thread = threading.Thread(target=read)
    thread.start()
    try:
        _send_buffers(writer, frame_buffers(BodyKind.MSGPACK, message, writable_too=True))
        thread.join(timeout=60)
    finally:
        writer.close()
        reader.close()
    assert bytes(received) == single


def test_only_read_only_arrays_are_referenced_by_default() -> None:
    """An asyncio transport may keep buffers past the write call: memory its owner may change is copied."""
    data = _data(400, 64)
    readonly = {k: v.copy() for k, v in data.obs.items()}
    for array in readonly.values():
        array.flags.writeable = False
    message = Batch(1, replace(data, obs=readonly))
    parts = frame_buffers(BodyKind.MSGPACK, message)
    assert any(
        isinstance(p, memoryview) and np.shares_memory(np.frombuffer(p, np.uint8), readonly["obs"]) for p in parts
    )
    writable = frame_buffers(BodyKind.MSGPACK, Batch(1, data))
    assert not any(isinstance(p, memoryview) for p in writable)
    assert _joined(parts) == _joined(writable) == encode_message_frame(BodyKind.MSGPACK, message.to_wire())


def test_a_batch_stacked_from_several_games_goes_out_by_reference() -> None:
    """The hub's concatenated observations are read-only, so the server's gather write sends them from their
    own memory: the stack is the one user-space copy the broker makes of them (issue 18's copy count)."""
    from broker.core.batching import concatenate_rows
    from broker.protocol.spaces import BoxSpace, ContinuousAction, PolicySpaces

    spaces = PolicySpaces((("obs", BoxSpace((64,), "float32", -1, 1)), ("img", BoxSpace((9,), "uint8", 0, 255))),
                          (("move", ContinuousAction(2)),))  # fmt: skip
    parts = [_data(200, 64), _data(200, 64)]
    parts = [replace(p, final_obs={**p.final_obs, "img": p.obs["img"][:1]}) for p in parts]  # type: ignore[dict-item]
    batch = concatenate_rows(parts, [0, 200], spaces)
    assert not batch.obs["obs"].flags.writeable and not batch.final_obs["obs"].flags.writeable  # type: ignore[index]
    buffers = frame_buffers(BodyKind.MSGPACK, Batch(1, batch))
    referenced = [p for p in buffers if isinstance(p, memoryview)]
    assert any(np.shares_memory(np.frombuffer(p, np.uint8), batch.obs["obs"]) for p in referenced)
    assert _joined(buffers) == encode_message_frame(BodyKind.MSGPACK, Batch(1, batch).to_wire())
