"""Telling a frame body's kind from its first bytes (docs/protocol.md, "Body kinds"). A body is one of:

* a msgpack map (first byte 0x80-0x8f, 0xde or 0xdf): this protocol, from Python peers;
* a Godot Variant Dictionary as ``var_to_bytes`` writes it (first bytes ``1b 00``): this protocol,
  from the Godot addon, with the same message maps;
* a JSON object (first byte ``{``): the godot_rl plugin protocol, ASCII only.

Asked of every frame, so compiled with the per-step modules (``codec.py``, which holds the codecs and their
msgspec structs, is not).
"""

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
