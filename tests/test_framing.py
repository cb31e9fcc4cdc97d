"""Frame decoder: split streams correctly, refuse huge lengths before allocating, fail only with
RemoteProtocolError on garbage."""

from __future__ import annotations

import struct
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.protocol.connection import BrokerConnection
from broker.protocol.errors import ErrorCode, RemoteProtocolError
from broker.protocol.framing import FrameDecoder, encode_frame
from broker.protocol.messages import GameStep, Hello, TrainerReset


def test_frames_split_across_arbitrary_chunks() -> None:
    bodies = [b"a", b"", b"hello world", bytes(range(256)) * 40]
    stream = b"".join(encode_frame(b) for b in bodies)
    for chunk in (1, 3, 7, 4096):
        decoder = FrameDecoder()
        out = []
        for i in range(0, len(stream), chunk):
            decoder.feed(stream[i : i + chunk])
            while (frame := decoder.next_frame()) is not None:
                out.append(frame)
        assert out == bodies
        assert decoder.buffered_bytes == 0


def test_header_is_little_endian_u32() -> None:
    assert encode_frame(b"xyz")[:4] == b"\x03\x00\x00\x00"
    assert encode_frame(b"\x00" * 300)[:4] == struct.pack("<I", 300)


def test_over_limit_length_is_refused_from_the_header_alone() -> None:
    decoder = FrameDecoder(max_frame_bytes=1000)
    decoder.feed(struct.pack("<I", 1001))
    with pytest.raises(RemoteProtocolError) as err:
        decoder.next_frame()
    assert err.value.code is ErrorCode.FRAME_TOO_LARGE


def test_huge_declared_length_allocates_nothing() -> None:
    decoder = FrameDecoder(max_frame_bytes=2**32 - 1)  # even with no effective limit
    tracemalloc.start()
    try:
        decoder.feed(struct.pack("<I", 2**32 - 1) + b"x" * 10)
        assert decoder.next_frame() is None
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024
    assert decoder.buffered_bytes == 14


@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300), st.integers(min_value=1, max_value=64))
def test_random_streams_give_messages_or_protocol_errors(data: bytes, chunk: int) -> None:
    connection = BrokerConnection(max_frame_bytes=4096)
    try:
        for i in range(0, len(data), chunk):
            connection.receive_data(data[i : i + chunk])
            while connection.next_event() is not None:
                pass
    except RemoteProtocolError:
        pass


def _valid_stream() -> bytes:
    from broker.protocol import PROTOCOL_VERSION
    from tests.vectors.generate import messages

    parts = []
    for _, _, message in messages():
        if isinstance(message, (Hello, GameStep, TrainerReset)):
            parts.append(BrokerConnection().send(message))
    assert PROTOCOL_VERSION == 1
    return b"".join(parts)


VALID = _valid_stream()


@settings(max_examples=3000, deadline=None)
@given(
    st.integers(min_value=0, max_value=len(VALID)),
    st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), max_size=6),
)
def test_truncated_and_mutated_valid_streams(cut: int, flips: list[tuple[int, int]]) -> None:
    data = bytearray(VALID[:cut])
    for pos, value in flips:
        if pos < len(data):
            data[pos] = value
    connection = BrokerConnection(max_frame_bytes=1 << 16)
    connection.receive_data(bytes(data))
    try:
        while connection.next_event() is not None:
            pass
    except RemoteProtocolError:
        pass


def test_frames_before_hello_are_capped_small() -> None:
    connection = BrokerConnection(max_frame_bytes=64 << 20)
    connection.receive_data(struct.pack("<I", (1 << 20) + 1))
    with pytest.raises(RemoteProtocolError) as err:
        connection.next_event()
    assert err.value.code is ErrorCode.FRAME_TOO_LARGE


def test_empty_arrays_round_trip() -> None:
    import msgpack
    import numpy as np

    from broker.protocol.arrays import decode_array, encode_array

    wire = msgpack.unpackb(msgpack.packb(encode_array(np.zeros((0, 3), np.float32))))
    assert decode_array(wire, "empty").shape == (0, 3)


# --- reading straight into the decoder's buffers (asyncio BufferedProtocol, socket.recv_into) -------------


def _read_into(decoder: FrameDecoder, stream: bytes, cuts: list[int]) -> list[bytes | memoryview]:
    """Deliver ``stream`` as a socket would: each read writes at most up to the next cut into get_buffer()."""
    out: list[bytes | memoryview] = []
    pos = 0
    for cut in [*cuts, len(stream)]:
        while pos < cut:
            buffer = decoder.get_buffer(-1)
            n = min(len(buffer), cut - pos)
            assert n > 0
            buffer[:n] = stream[pos : pos + n]
            decoder.buffer_updated(n)
            pos += n
            while (body := decoder.next_frame_view()) is not None:
                out.append(body)
    return out


def test_recv_into_frames_split_at_every_byte_boundary() -> None:
    bodies = [b"a", b"", b"hello world", bytes(range(256)) * 40]
    stream = b"".join(encode_frame(b) for b in bodies)
    for cut in range(1, len(stream)):
        decoder = FrameDecoder()
        out = _read_into(decoder, stream, [cut])
        assert [bytes(b) for b in out] == bodies, cut
        assert decoder.buffered_bytes == 0


def test_recv_into_large_frames_get_their_own_buffers_and_views_stay_valid() -> None:
    small, large, huge = b"s" * 100, bytes(range(256)) * 1000, b"\x07" * (3 << 20)  # 256 KB, 3 MiB
    bodies = [small, large, huge, small, large]
    stream = b"".join(encode_frame(b) for b in bodies)
    for step in (1000, 8192, 65536, 1 << 20):
        decoder = FrameDecoder()
        out = _read_into(decoder, stream, list(range(step, len(stream), step)))
        # every view is still what it was when handed out: no buffer was reused under it
        assert [bytes(b) for b in out] == bodies
        assert all(isinstance(b, memoryview) and b.readonly for b in out if len(b) > 8192)
        assert decoder.buffered_bytes == 0


def test_recv_into_writable_bodies() -> None:
    decoder = FrameDecoder(writable_bodies=True)
    (body,) = _read_into(decoder, encode_frame(b"x" * 100_000), [])
    assert isinstance(body, memoryview) and not body.readonly and bytes(body) == b"x" * 100_000


def test_recv_into_refuses_an_oversized_frame_from_its_header() -> None:
    decoder = FrameDecoder(max_frame_bytes=1000)
    tracemalloc.start()
    try:
        buffer = decoder.get_buffer(-1)
        buffer[:8] = struct.pack("<I", 2**32 - 1) + b"abcd"
        decoder.buffer_updated(8)
        with pytest.raises(RemoteProtocolError) as err:
            decoder.next_frame_view()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert err.value.code is ErrorCode.FRAME_TOO_LARGE
    assert peak < 64 * 1024


def test_large_declared_length_allocates_only_with_its_bytes() -> None:
    """A 64 MiB header with a few KiB behind it costs a few KiB, not 64 MiB, until an eighth arrived."""
    decoder = FrameDecoder()
    tracemalloc.start()
    try:
        _read_into(decoder, struct.pack("<I", 64 << 20) + b"x" * 100_000, [])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    assert decoder.buffered_bytes == 100_004


def test_a_limit_raised_after_a_frame_applies_to_the_frames_behind_it() -> None:
    """The connection raises its limit once the hello is decoded; a big frame in the same read must pass."""
    stream = encode_frame(b"hello") + encode_frame(b"y" * 5000)
    for feed in (True, False):
        decoder = FrameDecoder(max_frame_bytes=1000)
        if feed:
            decoder.feed(stream)
        else:
            decoder.get_buffer(-1)[: len(stream)] = stream
            decoder.buffer_updated(len(stream))
        assert decoder.next_frame() == b"hello"
        decoder.max_frame_bytes = 10_000
        assert decoder.next_frame() == b"y" * 5000


def test_recv_into_a_frame_like_the_last_lands_whole_in_its_read_and_is_not_copied() -> None:
    """After a large frame, the next read's buffer holds one like it whole: its body is a view of that buffer."""
    body = bytes(range(256)) * 800  # 200 KiB
    frame = encode_frame(body)
    decoder = FrameDecoder()
    _read_into(decoder, frame, [])  # the first: its header came in the small first read
    buffer = decoder.get_buffer(-1)
    assert len(buffer) > len(frame)  # and the read stops short of its end (one system call)
    buffer[: len(frame)] = frame
    decoder.buffer_updated(len(frame))
    got = decoder.next_frame_view()
    assert isinstance(got, memoryview) and got.readonly and bytes(got) == body
    assert np.shares_memory(np.frombuffer(got, np.uint8), np.frombuffer(buffer, np.uint8))


def test_recv_into_a_frame_cut_short_in_its_read_is_finished_in_place() -> None:
    first, second = b"\x01" * 100_000, b"\x02" * 100_000
    decoder = FrameDecoder()
    _read_into(decoder, encode_frame(first), [])
    frame = encode_frame(second)
    buffer = decoder.get_buffer(-1)
    buffer[:1000] = frame[:1000]  # the read got only this much of it
    decoder.buffer_updated(1000)
    rest = decoder.get_buffer(-1)
    assert np.shares_memory(np.frombuffer(rest, np.uint8), np.frombuffer(buffer, np.uint8))  # the same memory
    rest[: len(frame) - 1000] = frame[1000:]
    decoder.buffer_updated(len(frame) - 1000)
    got = decoder.next_frame_view()
    assert got is not None and bytes(got) == second
    assert np.shares_memory(np.frombuffer(got, np.uint8), np.frombuffer(buffer, np.uint8))


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 300_000), min_size=1, max_size=8),
    st.lists(st.integers(1, 400_000), min_size=0, max_size=12),
)
def test_recv_into_frames_of_any_sizes_cut_anywhere_keep_every_view(sizes: list[int], cuts: list[int]) -> None:
    """Fresh buffers, frames finished in place, the scratch and large frames' own buffers, mixed: every body
    arrives whole, and nothing written later changes a body handed out before."""
    bodies = [bytes([i % 251 + 1]) * size for i, size in enumerate(sizes)]
    stream = b"".join(encode_frame(b) for b in bodies)
    decoder = FrameDecoder()
    out = _read_into(decoder, stream, sorted({c for c in cuts if c < len(stream)}))
    assert [bytes(b) for b in out] == bodies
    assert decoder.buffered_bytes == 0
