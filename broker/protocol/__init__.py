"""The wire protocol, sans-IO: bytes in, typed messages out, and back. No sockets, no asyncio."""

from broker.protocol.errors import ErrorCode, LocalProtocolError, ProtocolError, RemoteProtocolError
from broker.protocol.framing import DEFAULT_MAX_FRAME_BYTES, FrameDecoder, encode_frame

PROTOCOL_VERSION = 1

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "PROTOCOL_VERSION",
    "ErrorCode",
    "FrameDecoder",
    "LocalProtocolError",
    "ProtocolError",
    "RemoteProtocolError",
    "encode_frame",
]
