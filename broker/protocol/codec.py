"""Body codecs. One place for the msgpack settings and for telling body kinds apart.

A frame body is one of:

* a msgpack map (first byte 0x80-0x8f, 0xde or 0xdf): this protocol;
* a JSON object (first byte ``{``): the godot_rl plugin protocol, ASCII only.
"""

from __future__ import annotations

import json
from enum import Enum
from typing import Any

import msgpack

from broker.protocol.errors import ErrorCode, RemoteProtocolError


class BodyKind(Enum):
    MSGPACK = "msgpack"
    JSON = "json"


def body_kind(body: bytes) -> BodyKind:
    if not body:
        raise RemoteProtocolError(ErrorCode.MALFORMED, "empty frame body")
    first = body[0]
    if 0x80 <= first <= 0x8F or first in (0xDE, 0xDF):
        return BodyKind.MSGPACK
    if first == 0x7B:  # "{"
        return BodyKind.JSON
    raise RemoteProtocolError(
        ErrorCode.MALFORMED, f"frame body starts with byte 0x{first:02x}: neither a msgpack map nor JSON"
    )


def pack(obj: dict[str, Any]) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]


def unpack(body: bytes) -> dict[str, Any]:
    """Decode a msgpack body into a map; any failure is the peer's."""
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=False, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise RemoteProtocolError(ErrorCode.MALFORMED, f"undecodable msgpack body: {exc}") from None
    if not isinstance(obj, dict):
        raise RemoteProtocolError(ErrorCode.MALFORMED, f"message must be a map, got {type(obj).__name__}")
    return obj


def pack_json(obj: dict[str, Any]) -> bytes:
    """JSON exactly as godot_rl's Python side writes it: default separators, ASCII only."""
    return json.dumps(obj).encode("ascii")


def unpack_json(body: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise RemoteProtocolError(ErrorCode.MALFORMED, f"undecodable JSON body: {exc}") from None
    if not isinstance(obj, dict):
        raise RemoteProtocolError(ErrorCode.MALFORMED, "JSON message must be an object")
    return obj
