"""Telling a frame body's kind from its first bytes (docs/protocol.md, "Frames"): asked of every frame, so
compiled with the per-step modules (``codec.py``, which holds the codecs themselves, is not)."""

from __future__ import annotations

from enum import Enum

from broker.protocol.errors import ErrorCode, RemoteProtocolError


class BodyKind(Enum):
    MSGPACK = "msgpack"
    GODOT = "godot"
    JSON = "json"


def body_kind(body: bytes | memoryview) -> BodyKind:
    if not body:
        raise RemoteProtocolError(ErrorCode.MALFORMED, "empty frame body")
    first = body[0]
    if 0x80 <= first <= 0x8F or first in (0xDE, 0xDF):
        return BodyKind.MSGPACK
    if first == 0x7B:  # "{"
        return BodyKind.JSON
    if first == 0x1B and len(body) >= 2 and body[1] == 0x00:  # Variant type 27 = Dictionary
        return BodyKind.GODOT
    raise RemoteProtocolError(
        ErrorCode.MALFORMED,
        f"frame body starts with byte 0x{first:02x}: not a msgpack map, a Godot Dictionary or JSON",
    )
