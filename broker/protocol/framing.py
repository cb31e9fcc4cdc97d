"""Length-prefixed frames: ``u32 little-endian length`` then that many body bytes.

The same framing is used by the godot_rl plugin (JSON bodies) and by this protocol (msgpack bodies),
which is what lets both share one port.
"""

from __future__ import annotations

import struct
from typing import Final

from broker.protocol.errors import ErrorCode, RemoteProtocolError

HEADER: Final = struct.Struct("<I")
DEFAULT_MAX_FRAME_BYTES: Final = 64 * 1024 * 1024


def encode_frame(body: bytes | bytearray | memoryview) -> bytes:
    """Header and body as one bytes object, so a frame goes out in a single write."""
    return HEADER.pack(len(body)) + bytes(body)


class FrameDecoder:
    """Splits a byte stream into frame bodies.

    The declared length is checked against ``max_frame_bytes`` as soon as the 4 header bytes are in,
    before the body arrives, so a hostile length never makes us buffer or allocate it.
    """

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._buffer = bytearray()
        self._body_length: int | None = None

    @property
    def buffered_bytes(self) -> int:
        return len(self._buffer)

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        self._buffer += data

    def next_frame(self) -> bytes | None:
        """The next complete body, or None until more data arrives."""
        if self._body_length is None:
            if len(self._buffer) < HEADER.size:
                return None
            (length,) = HEADER.unpack_from(self._buffer)
            if length > self.max_frame_bytes:
                raise RemoteProtocolError(
                    ErrorCode.FRAME_TOO_LARGE,
                    f"frame declares {length} bytes; the limit is {self.max_frame_bytes}",
                )
            self._body_length = length
        end = HEADER.size + self._body_length
        if len(self._buffer) < end:
            return None
        body = bytes(self._buffer[HEADER.size : end])
        del self._buffer[:end]
        self._body_length = None
        return body
