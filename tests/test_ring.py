"""The shared-memory ring for a trainer on the broker's host (docs/protocol.md §3b): where frames go in it and
when they may not (sans-IO, broker/protocol/ring.py), what offer the broker maps and what it refuses to touch
(broker/server/ring.py), and the whole way over real loopback sockets: a broker subprocess, a game and a
BrokerVecEnv, whose batches come through the ring, byte for byte what the game sent."""

from __future__ import annotations

import os
import secrets
import signal
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from broker.protocol import PROTOCOL_VERSION
from broker.protocol.codec import BodyKind, decode_body, encode_body
from broker.protocol.errors import ErrorCode, RemoteProtocolError
from broker.protocol.framing import HEADER
from broker.protocol.messages import Hello, StepData, message_from_wire
from broker.protocol.ring import (
    DATA_OFFSET,
    DOORBELL,
    MIN_RING_BYTES,
    RING_MIN_BYTES,
    RingOffer,
    RingReader,
    RingWriter,
    is_doorbell,
)
from broker.protocol.spaces import BoxSpace, ContinuousAction, GroupSpec, PolicySpaces
from clients.game import GameClient
from clients.status import fetch_status
from clients.vec_env import BrokerVecEnv
from tests.helpers import broker_process

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="memfd_create is Linux's")


def _frame(body: bytes) -> list[bytes | memoryview]:
    """A frame as the server's gather write has it: header, then the body in pieces (one an array's memory)."""
    array = np.frombuffer(body[8:], np.uint8).reshape(-1, 1)
    return [HEADER.pack(len(body)), body[:8], memoryview(array)]


def _ring(size: int = 1 << 16) -> tuple[RingWriter, RingReader, memoryview]:
    memory = memoryview(bytearray(size))
    return RingWriter(memory), RingReader(memory, 1 << 20), memory


def test_a_frame_placed_in_the_ring_is_taken_out_whole_and_the_ring_starts_over_once_all_is_taken() -> None:
    writer, reader, _ = _ring()
    for n in range(5):
        body = secrets.token_bytes(40_000 - n)
        doorbell = writer.place(_frame(body))
        assert doorbell is not None and HEADER.unpack_from(doorbell)[0] == DOORBELL.size
        assert is_doorbell(doorbell[HEADER.size :])
        taken = reader.take(doorbell[HEADER.size :])
        assert bytes(taken) == body
        assert not taken.readonly  # the trainer's own copy: its arrays may be handed on writable
        # everything was taken: the next frame goes to the front again, so only its pages are ever touched
        assert DOORBELL.unpack_from(doorbell, HEADER.size)[2] == DATA_OFFSET + HEADER.size
    assert writer.frames == reader.frames == 5


def test_the_doorbell_of_the_protocol_documents_example() -> None:
    writer, reader, _ = _ring(DATA_OFFSET + 100_000)
    body = secrets.token_bytes(65_600)
    doorbell = writer.place(_frame(body))
    expected = "18000000 c1000000 40000100 4400000000000000 4400010000000000"  # docs/protocol.md, section 3b
    assert doorbell == bytes.fromhex(expected.replace(" ", ""))
    assert bytes(reader.take(doorbell[HEADER.size :])) == body


def test_a_frame_is_never_written_over_what_the_trainer_has_not_taken_out() -> None:
    writer, reader, _ = _ring(DATA_OFFSET + 100_000)
    first = writer.place(_frame(bytes(range(256)) * 150))
    second = writer.place(_frame(b"\x07" * 38_400))
    assert first is not None and second is not None  # both fit side by side
    assert writer.place(_frame(b"\x09" * 38_400)) is None  # no room: it goes by the socket
    assert bytes(reader.take(first[HEADER.size :])) == bytes(range(256)) * 150
    third = writer.place(_frame(b"\x09" * 38_400))  # the tail is too short: the front, now free
    assert third is not None and DOORBELL.unpack_from(third, HEADER.size)[2] == DATA_OFFSET + HEADER.size
    assert bytes(reader.take(second[HEADER.size :])) == b"\x07" * 38_400
    assert bytes(reader.take(third[HEADER.size :])) == b"\x09" * 38_400


def test_a_frame_larger_than_the_ring_or_a_release_ahead_of_the_writer_keeps_the_socket() -> None:
    writer, _, memory = _ring(DATA_OFFSET + 50_000)
    assert writer.place(_frame(b"\x01" * 60_000)) is None
    memory[:8] = (10**9).to_bytes(8, "little")  # a trainer that claims to have taken what was never written
    assert writer.place(_frame(b"\x01" * 40_000)) is None
    assert writer.frames == 0


@pytest.mark.parametrize(
    ("doorbell", "problem"),
    [
        (b"\xc1" + bytes(10), "is 24 bytes"),
        (DOORBELL.pack(0xC1, 1000, DATA_OFFSET + 65_000, 0), "outside the ring"),
        (DOORBELL.pack(0xC1, 10, 8, 0), "outside the ring"),
        (DOORBELL.pack(0xC1, 2 << 20, DATA_OFFSET, 0), "outside the ring"),
    ],
)
def test_a_doorbell_that_points_outside_the_ring_is_a_malformed_frame(doorbell: bytes, problem: str) -> None:
    _, reader, memory = _ring()
    with pytest.raises(RemoteProtocolError) as exc:
        reader.take(doorbell)
    assert exc.value.code is ErrorCode.MALFORMED and problem in exc.value.message
    assert bytes(memory[:8]) == bytes(8)  # nothing released


def test_a_trainer_hello_carries_its_offer_and_a_bad_offer_is_a_bad_hello() -> None:
    offer = RingOffer("/proc/1/fd/3", 1 << 20, bytes(16))
    hello = Hello("trainer", PROTOCOL_VERSION, "t", policy="p", ring=offer)
    wire = decode_body(BodyKind.MSGPACK, encode_body(BodyKind.MSGPACK, hello.to_wire()))
    assert message_from_wire(wire) == hello
    assert "ring" not in Hello("trainer", PROTOCOL_VERSION, "t", policy="p").to_wire()
    for bad in ({"path": 5, "size": 1 << 20, "token": bytes(16)}, {"path": "/x", "size": 10, "token": bytes(16)},
                {"path": "/x", "size": 1 << 20, "token": b"short"}, "a string"):  # fmt: skip
        with pytest.raises(RemoteProtocolError) as exc:
            message_from_wire({**wire, "ring": bad})
        assert exc.value.code is ErrorCode.BAD_HELLO


# --- what the broker maps -------------------------------------------------------------------------------


def test_the_broker_maps_a_memory_file_holding_the_token_and_nothing_else(tmp_path: Path) -> None:
    from broker.server.ring import MappedRing, RingUnusable
    from clients.transport import SharedRing

    ring = SharedRing(MIN_RING_BYTES)
    try:
        mapped = MappedRing(ring.offer)
        assert mapped.writer.capacity == MIN_RING_BYTES - DATA_OFFSET
        held = mapped.view[:8]  # a view still alive when the connection goes: closing must not raise
        mapped.close()
        held.release()
        wrong_token = replace(ring.offer, token=bytes(16))
        wrong_size = replace(ring.offer, size=2 * MIN_RING_BYTES)
        for offer, reason in ((wrong_token, "token"), (wrong_size, "offered")):
            with pytest.raises(RingUnusable, match=reason):
                MappedRing(offer)
    finally:
        ring.close()
    victim = tmp_path / "victim"
    victim.write_bytes(bytes(MIN_RING_BYTES))
    fd = os.open(victim, os.O_RDWR)
    try:
        offer = RingOffer(f"/proc/{os.getpid()}/fd/{fd}", MIN_RING_BYTES, bytes(16))
        with pytest.raises(RingUnusable, match="not an anonymous memory file"):
            MappedRing(offer)
    finally:
        os.close(fd)
    for path in (str(victim), "/proc/self/fd/0", f"/proc/{os.getpid()}/fd/99999"):
        with pytest.raises(RingUnusable):
            MappedRing(RingOffer(path, MIN_RING_BYTES, bytes(16)))
    assert victim.read_bytes() == bytes(MIN_RING_BYTES)  # never written


# --- the whole way, over real sockets ---------------------------------------------------------------------

AGENTS = 64
OBS = 256  # 64 x 256 float32: a 64 KB batch, above RING_MIN_BYTES
SPACES = PolicySpaces((("obs", BoxSpace((OBS,), "float32", -1e6, 1e6)),), (("act", ContinuousAction(1)),))


def _observation(tick: int) -> np.ndarray:
    return (np.arange(AGENTS * OBS, dtype=np.float32).reshape(AGENTS, OBS) + tick * 0.5).astype(np.float32)


def _play_counting(address: str, stop: threading.Event) -> None:
    """A game whose observation at tick t is ``_observation(t)``, until ``stop``."""
    client = GameClient(address, [GroupSpec("p", AGENTS, SPACES)], name="counting")
    tick = 0
    try:
        while not stop.is_set():
            zeros = np.zeros(AGENTS, np.float32)
            client.step({"p": StepData({"obs": _observation(tick)}, zeros, zeros.astype(bool), zeros.astype(bool))})
            tick += 1
    except Exception:
        pass
    finally:
        client.close()


@pytest.fixture
def counting_game(tmp_path: Path) -> Iterator[str]:
    """A broker subprocess and a counting game on it."""
    assert AGENTS * OBS * 4 >= RING_MIN_BYTES
    with broker_process(tmp_path, "--games", "1", "--stepping", "barrier") as (_, address):
        stop = threading.Event()
        thread = threading.Thread(target=_play_counting, args=(address, stop), daemon=True)
        thread.start()
        yield address
        stop.set()
        thread.join(timeout=10)


def _steps(env: BrokerVecEnv, n: int) -> list[np.ndarray]:
    seen = [env.reset()["obs"].copy()]
    for _ in range(n):
        obs, *_ = env.step(np.zeros((AGENTS, 1), np.float32))
        seen.append(obs["obs"].copy())
    return seen


def test_batches_come_through_the_ring_byte_for_byte_as_the_game_sent_them(counting_game: str) -> None:
    env = BrokerVecEnv("p", counting_game)
    try:
        seen = _steps(env, 40)
        assert env._socket is not None and env._socket.ring_frames == 41  # every batch, the first included
        policy = fetch_status(counting_game)["policies"]["p"]
        assert policy["link"] == "tcp + ring" and policy["ring_batches"] == 41  # what the broker says too
    finally:
        env.close()
    ticks = [round(float(obs[0, 0]) / 0.5) for obs in seen]
    assert ticks == list(range(ticks[0], ticks[0] + 41))  # lock-step: one tick per step, none lost or repeated
    for tick, obs in zip(ticks, seen, strict=True):
        np.testing.assert_array_equal(obs, _observation(tick))


def test_without_a_ring_or_with_one_too_small_the_same_batches_come_by_the_socket(counting_game: str) -> None:
    for ring_bytes in (0, MIN_RING_BYTES):  # the second: the broker maps it, but no batch fits
        env = BrokerVecEnv("p", counting_game, ring_bytes=ring_bytes)
        try:
            seen = _steps(env, 10)
            assert env._socket is not None and env._socket.ring_frames == 0
            policy = fetch_status(counting_game)["policies"]["p"]
            if ring_bytes:
                assert policy["link"] == "tcp + ring" and policy["ring_batches"] == 0
            else:
                assert policy["link"] == "tcp" and "ring_batches" not in policy
        finally:
            env.close()
        ticks = [round(float(obs[0, 0]) / 0.5) for obs in seen]
        for tick, obs in zip(ticks, seen, strict=True):
            np.testing.assert_array_equal(obs, _observation(tick))


def test_a_trainer_that_reconnects_to_a_restarted_broker_offers_a_fresh_ring(tmp_path: Path) -> None:
    from tests.scripts.reliability_common import start_broker, stop

    first, port, _ = start_broker(tmp_path, "--games", "1", "--stepping", "barrier")
    address = f"127.0.0.1:{port}"
    halt = threading.Event()
    game = threading.Thread(target=_play_counting, args=(address, halt), daemon=True)
    game.start()
    second = None
    env = None
    try:
        env = BrokerVecEnv("p", address, timeout_reconnect=30)
        _steps(env, 5)
        assert env._socket is not None and env._socket.ring is not None
        old_ring = env._socket.ring
        assert env._socket.ring_frames == 6
        stop(first, signal.SIGKILL)
        second, _, _ = start_broker(tmp_path, "--games", "1", "--stepping", "barrier", port=port)
        _, _, dones, infos = env.step(np.zeros((AGENTS, 1), np.float32))  # the new session's first batch
        assert dones.all() and infos[0].get("broker_reconnected")
        seen = _steps(env, 5)[1:]
        assert env._socket.ring is not old_ring and old_ring.map.closed  # the first session's ring is gone
        assert env._socket.ring_frames == 7  # the new session's first batch, reset's, then five steps'
        for obs in seen:
            np.testing.assert_array_equal(obs, _observation(round(float(obs[0, 0]) / 0.5)))
    finally:
        if env is not None:
            env.close()
        halt.set()
        if second is not None:
            stop(second)
        stop(first, signal.SIGKILL)
        game.join(timeout=10)
