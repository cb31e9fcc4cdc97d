"""The wire protocol, sans-IO: bytes in, typed messages out, and back. No sockets, no asyncio."""

from broker.protocol.errors import ErrorCode, LocalProtocolError, ProtocolError, RemoteProtocolError
from broker.protocol.framing import DEFAULT_MAX_FRAME_BYTES, FrameDecoder, encode_frame

PROTOCOL_VERSION = 1
# Where the broker listens and peers connect unless told otherwise (godot_rl's own default port).
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 11008
DEFAULT_ADDRESS = f"{DEFAULT_HOST}:{DEFAULT_PORT}"
# The environment variable that carries the shared token to every side: serve, status, trainers, games.
TOKEN_ENV = "GDRL_BROKER_TOKEN"

__all__ = [
    "DEFAULT_ADDRESS",
    "DEFAULT_HOST",
    "DEFAULT_MAX_FRAME_BYTES",
    "DEFAULT_PORT",
    "PROTOCOL_VERSION",
    "TOKEN_ENV",
    "ErrorCode",
    "FrameDecoder",
    "LocalProtocolError",
    "ProtocolError",
    "RemoteProtocolError",
    "encode_frame",
]
