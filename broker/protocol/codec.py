"""Body codecs. One place for the msgpack settings and for telling body kinds apart.

A frame body is one of:

* a msgpack map (first byte 0x80-0x8f, 0xde or 0xdf): this protocol, from Python peers;
* a Godot Variant Dictionary as ``var_to_bytes`` writes it (first bytes ``1b 00``): this protocol,
  from the Godot addon, with the same message maps;
* a JSON object (first byte ``{``): the godot_rl plugin protocol, ASCII only.

A native peer's hello fixes its codec; the broker answers it in the same codec.
"""

from __future__ import annotations

import json
import threading
from enum import Enum
from typing import Any, Final

import msgpack

from broker.protocol.errors import ErrorCode, RemoteProtocolError
from broker.protocol.framing import DEFAULT_MAX_FRAME_BYTES, HEADER, encode_frame


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


def encode_body(kind: BodyKind, obj: dict[str, Any]) -> bytes:
    if kind is BodyKind.MSGPACK:
        return pack(obj)
    if kind is BodyKind.GODOT:
        return _godot_codec().encode(obj)
    return pack_json(obj)


def decode_body(kind: BodyKind, body: bytes | memoryview) -> dict[str, Any]:
    if kind is BodyKind.MSGPACK:
        return unpack(body)
    if kind is BodyKind.GODOT:
        return _godot_codec().decode(body)
    return unpack_json(body)


def _godot_codec() -> Any:
    try:
        from broker.protocol import variant
    except ImportError:
        raise RemoteProtocolError(
            ErrorCode.NOT_SUPPORTED, "Godot Variant bodies are not supported by this build"
        ) from None
    return variant


def pack(obj: dict[str, Any]) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def encode_message_frame(kind: BodyKind, obj: dict[str, Any]) -> bytes:
    """``encode_frame(encode_body(kind, obj))`` with one allocation and one copy for msgpack bodies.

    The body is packed into this thread's reused msgpack buffer and copied once, behind its header, into
    the frame. Separate body and frame objects cost a second large allocation per message, and for frames
    of a few hundred KiB that (fresh pages, page faults) costs several times the packing itself.
    """
    if kind is not BodyKind.MSGPACK:
        return encode_frame(encode_body(kind, obj))
    if _packers.busy:  # re-entered on this thread (a signal handler sending): pack the plain way
        return encode_frame(pack(obj))
    packer = _packers.packer
    _packers.busy = True
    try:
        packer.pack(obj)
        with packer.getbuffer() as body:
            size = len(body)
            frame = HEADER.pack(size) + body
    finally:
        packer.reset()
        _packers.busy = False
    if size > _KEEP_PACKER_BYTES:  # do not keep a huge buffer around for one huge message
        _packers.packer = msgpack.Packer(use_bin_type=True, autoreset=False)
    return frame


# One reused Packer per thread for encode_message_frame. Its buffer grows to the largest message packed
# (kept up to the default frame limit, so what stays allocated per thread is bounded).
_KEEP_PACKER_BYTES: Final = DEFAULT_MAX_FRAME_BYTES


class _Packers(threading.local):
    def __init__(self) -> None:
        self.packer = msgpack.Packer(use_bin_type=True, autoreset=False)
        self.busy = False


_packers = _Packers()


def unpack(body: bytes | memoryview) -> dict[str, Any]:
    """Decode a msgpack body into a map; any failure is the peer's. ``bin`` values come back as bytes."""
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


def unpack_json(body: bytes | memoryview) -> dict[str, Any]:
    try:
        obj = json.loads(str(body, "utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise RemoteProtocolError(ErrorCode.MALFORMED, f"undecodable JSON body: {exc}") from None
    if not isinstance(obj, dict):
        raise RemoteProtocolError(ErrorCode.MALFORMED, "JSON message must be an object")
    return obj
