"""The shared-memory ring between the broker and a trainer on its host (docs/protocol.md §3b), sans-IO.

A trainer offers a ring in its ``hello`` (``RingOffer``: a memory file of its own that the broker can open, its
size, a random token written in it). The broker, once it has mapped it, writes a large frame for that trainer
(a ``batch`` of RING_MIN_BYTES or more) into the ring instead of the socket, and sends a *doorbell* on the socket
in its place: a 24-byte frame body saying where the frame lies. The socket keeps the order of everything; the
ring saves the kernel's two copies of the frame and the socket's work for them (the trainer copies the frame out
once, into a buffer of its own, so its arrays never change under it).

Layout of the ring's memory: bytes 0-7 the trainer's *release* (u64 little-endian: the ring total up to which
it has copied frames out; written by the trainer only), 16-31 the token, frames from DATA_OFFSET on. The
broker keeps its own *write* total: a frame starts at ``write % capacity`` and never wraps (the rest of the
ring is skipped instead), and a frame is placed only where everything the trainer has not released is left
untouched. Once the trainer has released all (lock-step: always, when the next batch is due) the next frame
goes to the start again, so a ring much larger than a frame costs only the pages a frame touches. Both sides
here only compute and copy; mapping the memory is the caller's (clients/transport.py, broker/server/ring.py).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Final

from broker.protocol.errors import ErrorCode, RemoteProtocolError, summarize
from broker.protocol.framing import HEADER, Buffer, new_buffer

RING_MARK: Final = 0xC1  # a doorbell body's first byte: never used by msgpack, nor by a Variant or JSON body
DOORBELL: Final = struct.Struct("<B3xIQQ")  # mark, frame body length, its offset in the ring, release total
RELEASE: Final = struct.Struct("<Q")
TOKEN_OFFSET: Final = 16
TOKEN_BYTES: Final = 16
DATA_OFFSET: Final = 64  # a cache line for the release and the token
RING_MIN_BYTES: Final = 32 * 1024  # smaller frames gain nothing (benchmarks/ring_vs_socket.py): the socket
DEFAULT_RING_BYTES: Final = 64 * 1024 * 1024  # virtual; pages are touched only as large frames need them
MAX_RING_BYTES: Final = 1 << 30
MIN_RING_BYTES: Final = DATA_OFFSET + RING_MIN_BYTES


def _bad_ring(message: str) -> RemoteProtocolError:
    return RemoteProtocolError(ErrorCode.BAD_HELLO, message)


def _check_offer(path: Any, size: Any, token: Any) -> None:
    if type(path) is not str or not path or len(path) > 256:
        raise _bad_ring("hello.ring.path must be a string of at most 256 characters")
    if type(size) is not int or not MIN_RING_BYTES <= size <= MAX_RING_BYTES:
        raise _bad_ring(f"hello.ring.size must be {MIN_RING_BYTES} to {MAX_RING_BYTES}, got {summarize(size)}")
    if type(token) is not bytes or len(token) != TOKEN_BYTES:
        raise _bad_ring(f"hello.ring.token must be {TOKEN_BYTES} bytes")


@dataclass(frozen=True, slots=True)
class RingOffer:
    """A trainer's offer of a ring: ``path`` the broker opens (``/proc/<pid>/fd/<fd>`` of a memory file),
    ``size`` its bytes, ``token`` the random bytes at TOKEN_OFFSET that prove it is the one offered."""

    path: str
    size: int
    token: bytes

    def __post_init__(self) -> None:
        _check_offer(self.path, self.size, self.token)

    def to_wire(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "token": self.token}

    @classmethod
    def from_wire(cls, obj: Any) -> RingOffer:
        if type(obj) is not dict:
            raise _bad_ring("hello.ring must be a map of path, size and token")
        path: Any = obj.get("path")
        size: Any = obj.get("size")
        token: Any = obj.get("token")
        token = bytes(token) if isinstance(token, (bytes, bytearray)) else token
        _check_offer(path, size, token)  # before construction: compiled, it would refuse a wrong type itself
        return cls(path, size, token)


def is_doorbell(body: bytes | memoryview) -> bool:
    return len(body) > 0 and body[0] == RING_MARK


class RingWriter:
    """The broker's side: ``place`` a frame in the ring, or say it does not fit (then it goes by the socket)."""

    def __init__(self, memory: memoryview) -> None:
        self.memory = memory
        self.capacity = len(memory) - DATA_OFFSET
        self.written = 0  # ring total: every byte ever placed or skipped
        self.frames = 0  # placed so far (status, tests)

    def place(self, buffers: list[Buffer]) -> bytes | None:
        """Copy the frame ``buffers`` (header first) into the ring and return the doorbell frame to send in its
        place; None for a frame under RING_MIN_BYTES, or when the ring has no room for it now."""
        views = [_as_bytes(piece) for piece in buffers]
        total = sum(view.nbytes for view in views)
        capacity = self.capacity
        if not RING_MIN_BYTES <= total <= capacity:
            return None
        (released,) = RELEASE.unpack_from(self.memory, 0)
        start = self.written
        if released == start:  # the trainer has copied out every frame: the front of the ring is free
            start = -(-start // capacity) * capacity
        else:
            if start % capacity + total > capacity:  # never split a frame: skip the ring's tail
                start = -(-start // capacity) * capacity
            if not released < start or start + total - released > capacity:
                return None  # would overwrite what the trainer has not copied out yet (or a bad release)
        offset = DATA_OFFSET + start % capacity
        at = offset
        memory = self.memory
        for view in views:
            memory[at : at + view.nbytes] = view
            at += view.nbytes
        self.written = start + total
        self.frames += 1
        doorbell = DOORBELL.pack(RING_MARK, total - HEADER.size, offset + HEADER.size, self.written)
        return HEADER.pack(DOORBELL.size) + doorbell


def _as_bytes(piece: Buffer) -> memoryview:
    """A frame piece as flat bytes (an array's own memory is typed and may have several dimensions)."""
    view = memoryview(piece)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class RingReader:
    """The trainer's side: the frame a doorbell points to, copied into a buffer of its own, and released."""

    def __init__(self, memory: memoryview, max_frame_bytes: int) -> None:
        self.memory = memory
        self.max_frame_bytes = max_frame_bytes
        self.frames = 0  # taken so far (tests, benchmarks)

    def take(self, doorbell: bytes | memoryview) -> memoryview:
        if len(doorbell) != DOORBELL.size:
            raise RemoteProtocolError(
                ErrorCode.MALFORMED, f"a ring doorbell is {DOORBELL.size} bytes, got {len(doorbell)}"
            )
        _, length, offset, release = DOORBELL.unpack_from(doorbell)
        if length > self.max_frame_bytes or offset < DATA_OFFSET or offset + length > len(self.memory):
            raise RemoteProtocolError(
                ErrorCode.MALFORMED, f"a ring doorbell points outside the ring ({length} bytes at {offset})"
            )
        body = new_buffer(length)
        body[:] = self.memory[offset : offset + length]
        RELEASE.pack_into(self.memory, 0, release)  # after the copy: the broker may write over it now
        self.frames += 1
        return body
