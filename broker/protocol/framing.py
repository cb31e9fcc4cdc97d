"""Length-prefixed frames: ``u32 little-endian length`` then that many body bytes.

The same framing is used by the godot_rl plugin (JSON bodies) and by this protocol (msgpack bodies),
which is what lets both share one port.
"""

from __future__ import annotations

import struct
from collections import deque
from typing import Final

from broker.protocol.errors import ErrorCode, RemoteProtocolError

HEADER: Final = struct.Struct("<I")
DEFAULT_MAX_FRAME_BYTES: Final = 64 * 1024 * 1024

Body = bytes | memoryview  # a frame body: a read-only view into received bytes when no copy was needed


def encode_frame(body: bytes | bytearray | memoryview) -> bytes:
    """Header and body as one bytes object (one copy of the body), so a frame goes out in a single write."""
    return b"".join((HEADER.pack(memoryview(body).nbytes), body))


class FrameDecoder:
    """Splits a byte stream into frame bodies.

    The declared length is checked against ``max_frame_bytes`` as soon as the 4 header bytes are in,
    before the body arrives, so a hostile length never makes us buffer or allocate it.

    Received chunks are kept as they came (``bytes`` are immutable, so no copy is taken). A body spread over
    several chunks is joined once into ``bytes``; one that lies inside a chunk is a ``memoryview`` of it
    from ``next_frame_view`` (zero copy) and one copy from ``next_frame``.
    """

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._chunks: deque[bytes] = deque()
        self._offset = 0  # bytes of _chunks[0] already consumed
        self._buffered = 0
        self._body_length: int | None = None

    @property
    def buffered_bytes(self) -> int:
        return self._buffered

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        # A caller may reuse a bytearray or memoryview after this call: keep only immutable bytes.
        chunk = data if type(data) is bytes else bytes(data)
        self._chunks.append(chunk)
        self._buffered += len(chunk)

    def _take(self, n: int) -> Body:
        """Remove the next ``n`` buffered bytes (``n`` <= buffered): a view if they lie in one chunk."""
        first = self._chunks[0]
        start = self._offset
        if len(first) - start >= n:
            end = start + n
            if end == len(first):
                self._chunks.popleft()
                self._offset = 0
            else:
                self._offset = end
            self._buffered -= n
            return first if start == 0 and end == len(first) else memoryview(first)[start:end]
        parts = []
        needed = n
        while needed:
            chunk = self._chunks[0]
            available = len(chunk) - self._offset
            if available <= needed:
                parts.append(memoryview(chunk)[self._offset :])
                self._chunks.popleft()
                self._offset = 0
                needed -= available
            else:
                parts.append(memoryview(chunk)[self._offset : self._offset + needed])
                self._offset += needed
                needed = 0
        self._buffered -= n
        return b"".join(parts)

    def _peek_header(self) -> int:
        first = self._chunks[0]
        if len(first) - self._offset >= HEADER.size:
            return int(HEADER.unpack_from(first, self._offset)[0])
        # The header is split over chunks (rare): merge whole chunks until it is in the first one.
        parts = []
        merged = 0
        while merged < HEADER.size:
            chunk = memoryview(self._chunks.popleft())[self._offset :]
            self._offset = 0
            parts.append(chunk)
            merged += len(chunk)
        self._chunks.appendleft(b"".join(parts))
        return int(HEADER.unpack_from(self._chunks[0])[0])

    def next_frame(self) -> bytes | None:
        """The next complete body as ``bytes`` (at most one copy), or None until more data arrives."""
        body = self.next_frame_view()
        return body if body is None or type(body) is bytes else bytes(body)

    def next_frame_view(self) -> Body | None:
        """The next complete body, or None until more data arrives: a zero-copy ``memoryview`` when the
        body lies in one received chunk. Header bytes stay buffered until their whole frame is in."""
        if self._body_length is None:
            if self._buffered < HEADER.size:
                return None
            length = self._peek_header()
            if length > self.max_frame_bytes:
                raise RemoteProtocolError(
                    ErrorCode.FRAME_TOO_LARGE,
                    f"frame declares {length} bytes; the limit is {self.max_frame_bytes}",
                )
            self._body_length = length
        length = self._body_length
        end = HEADER.size + length
        if self._buffered < end:
            return None
        self._body_length = None
        first = self._chunks[0]
        start = self._offset
        if len(first) - start >= end:  # the common case: the whole frame in the first chunk
            end += start
            if end == len(first):
                self._chunks.popleft()
                self._offset = 0
            else:
                self._offset = end
            self._buffered -= HEADER.size + length
            return memoryview(first)[start + HEADER.size : end]
        self._take(HEADER.size)
        return self._take(length) if length else b""
