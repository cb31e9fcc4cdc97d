"""Connection state machines for both ends, sans-IO (after h11): ``receive_data`` buffers bytes,
``next_event`` returns the next typed message or ``None``, ``send`` returns the bytes to write.

Theory of operation
-------------------
On accept the broker speaks first, with the godot_rl greeting: two JSON frames, the ``handshake``
(versions "0"/"7" plus ``broker_protocol``) and the ``env_info`` request. An unmodified godot_rl game
answers with a JSON ``env_info`` frame; a native peer (game or trainer) sends a msgpack ``hello``
without waiting and skips the greeting. The first body byte tells the two apart (``{`` or a msgpack
map), so one port serves both with no timeout and no guessing.

The legal messages per state live in one table, ``_ALLOWED``; anything else is a protocol error
that blames the peer.

``ServerConnection`` is what the server drives, whatever the peer speaks: ``BrokerConnection`` for native
peers, and for an unmodified godot_rl plugin game the connection that ``broker.legacy.game_connection``
builds on top of it once the first frame turned out to be JSON (a ``LegacyMessage``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Final, Protocol

from mypy_extensions import mypyc_attr

from broker.protocol import PROTOCOL_VERSION
from broker.protocol.codec import decode_body
from broker.protocol.errors import ErrorCode, LocalProtocolError, RemoteProtocolError
from broker.protocol.framing import DEFAULT_MAX_FRAME_BYTES, FrameDecoder, encode_frame
from broker.protocol.gather import GATHER_MIN_BYTES, Buffer, array_bytes, frame_buffers, whole_frame
from broker.protocol.hot import decode_hot, decode_hot_godot, encode_hot_frame
from broker.protocol.json_body import pack_json, unpack_json
from broker.protocol.kinds import BodyKind, body_kind
from broker.protocol.messages import (
    Batch,
    Close,
    Control,
    Error,
    GameActions,
    GameStep,
    Hello,
    Message,
    PolicyInfo,
    Status,
    TrainerAct,
    TrainerReset,
    Waiting,
    Welcome,
    message_from_wire,
)
from broker.protocol.ring import RingReader, is_doorbell

GODOT_RL_MAJOR: Final = "0"
GODOT_RL_MINOR: Final = "7"
GREETING_HANDSHAKE: Final = {
    "type": "handshake",
    "major_version": GODOT_RL_MAJOR,
    "minor_version": GODOT_RL_MINOR,
    "broker_protocol": PROTOCOL_VERSION,
}
GREETING_ENV_INFO: Final = {"type": "env_info"}
MAX_FIRST_FRAME_BYTES: Final = 1 << 20  # a hello with 64 groups of 64 keys fits many times over
GREETING: Final = encode_frame(pack_json(GREETING_HANDSHAKE)) + encode_frame(pack_json(GREETING_ENV_INFO))


class State(Enum):
    # broker side
    AWAIT_HELLO = "await_hello"
    LEGACY = "legacy"  # an unmodified godot_rl plugin game, JSON frames
    GAME = "game"
    TRAINER = "trainer"
    SAMPLER = "sampler"  # a trainer-side session that claimed games: every group of them
    OBSERVER = "observer"  # asks for status once
    CONTROL = "control"  # sends one Control request
    # peer side
    AWAIT_GREETING = "await_greeting"
    AWAIT_WELCOME = "await_welcome"
    READY = "ready"
    CLOSED = "closed"

    __hash__ = object.__hash__  # members are singletons; keeps _ALLOWED's lookup (every message) in C


@mypyc_attr(allow_interpreted_subclasses=True)  # compiled (broker/compiled.py); broker/legacy adds its own
class ConnectionEvent:
    """Base of what a connection reports that is not a message for the hub."""

    __slots__ = ()


@dataclass(frozen=True)
class LegacyMessage(ConnectionEvent):
    """A JSON message from an unmodified godot_rl game."""

    body: dict[str, Any]


@dataclass(frozen=True)
class Refusal:
    """How a peer is told gently that it is refused: ``now`` at once, then the connection stays open for
    ``grace_s`` seconds (the server arms the timer) or until the peer's next frame, then its last word."""

    now: bytes
    grace_s: float


@dataclass(frozen=True)
class Refused(ConnectionEvent):
    """The connection refused what its peer said (it logged why): tell the peer ``refusal.now``."""

    refusal: Refusal


@dataclass(frozen=True)
class Farewell(ConnectionEvent):
    """Write ``data``, then close: the connection has nothing more to say or hear."""

    data: bytes


class CannotSend(Exception):
    """A connection cannot carry a message meant for its peer (it logged why): close it, without a last
    word, and let the hub's caller carry on."""


class ServerConnection(Protocol):
    """The broker's end of one accepted connection, sans-IO: bytes in, events out, bytes to send."""

    @property
    def codec(self) -> BodyKind:
        """The peer's body codec (for checking that a value is encodable before it is sent)."""
        ...

    @property
    def buffered_bytes(self) -> int:
        """Bytes received that are not a whole frame yet."""
        ...

    def greeting(self) -> bytes:
        """What the broker says first, on accept."""
        ...

    def receive_data(self, data: bytes | bytearray | memoryview) -> None: ...

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """Where the next read goes (asyncio's BufferedProtocol); then ``buffer_updated``."""
        ...

    def buffer_updated(self, nbytes: int) -> None: ...

    def next_event(self) -> Message | ConnectionEvent | None:
        """The next message for the hub (or a connection event), or None until more bytes arrive.
        Raises ProtocolError when the stream itself is broken."""
        ...

    def send(self, message: Message) -> bytes:
        """The bytes that carry a hub message to the peer (maybe none). Raises CannotSend."""
        ...

    def send_buffers(self, message: Message) -> list[Buffer]:
        """The same bytes as buffers for one gather write: large read-only arrays are not copied."""
        ...

    def last_word(self, message: Error | Close) -> bytes:
        """What to write before closing, to tell the peer why."""
        ...

    def refuse(self, error: RemoteProtocolError) -> Refusal | None:
        """The peer said something the broker refuses: a gentler end than an error frame, or None."""
        ...


_ALLOWED: Final[dict[State, tuple[type, ...]]] = {
    State.AWAIT_HELLO: (Hello,),
    State.GAME: (GameStep, Close),
    State.TRAINER: (TrainerReset, TrainerAct, Close),
    State.SAMPLER: (TrainerReset, TrainerAct, Close),
    State.OBSERVER: (Close,),
    State.CONTROL: (Control, Close),
}
_ALLOWED_FOR_PEER: Final[dict[str, tuple[type, ...]]] = {
    "game": (GameActions, Error, Close),
    "trainer": (PolicyInfo, Batch, Waiting, Error, Close),
    "sampler": (PolicyInfo, Batch, Waiting, Error, Close),
    "observer": (Status, Error, Close),
    "control": (Status, Error, Close),
}


def _decode_message(kind: BodyKind, body: bytes | memoryview) -> Message:
    """A body as its message: the per-step messages straight from their typed decode, the rest (and any
    of those the fast way leaves) through the maps and the message table."""
    message: Message | None = None  # JSON bodies have no fast way
    if kind is BodyKind.MSGPACK:
        message = decode_hot(body)
    elif kind is BodyKind.GODOT:
        message = decode_hot_godot(body)
    return message if message is not None else message_from_wire(decode_body(kind, body))


def _encode_message(kind: BodyKind, message: Message) -> bytes:
    """A message's frame: the small per-step msgpack messages straight from their parts, the rest through
    ``whole_frame`` (the C codec for a Godot peer's per-step messages, else ``to_wire`` and the codec's encoder)."""
    if kind is BodyKind.MSGPACK and array_bytes(message) < GATHER_MIN_BYTES:
        frame = encode_hot_frame(message)
        if frame is not None:
            return frame
    return whole_frame(kind, message)


class BrokerConnection:
    """The broker's end of one accepted connection."""

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self.state = State.AWAIT_HELLO
        self.codec = BodyKind.MSGPACK  # fixed by the hello: msgpack or Godot Variant
        self.max_frame_bytes = max_frame_bytes
        # Until a peer has said who it is, it may only send small frames (a hello, or godot_rl's env_info).
        self._decoder = FrameDecoder(min(max_frame_bytes, MAX_FIRST_FRAME_BYTES))

    @staticmethod
    def greeting() -> bytes:
        return GREETING

    @property
    def buffered_bytes(self) -> int:
        return self._decoder.buffered_bytes

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        self._decoder.feed(data)

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """Where to read the next bytes into (asyncio BufferedProtocol); then ``buffer_updated``."""
        return self._decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self._decoder.buffer_updated(nbytes)

    def next_event(self) -> Message | LegacyMessage | None:
        """Next message; raises RemoteProtocolError (and moves to CLOSED) on bad input."""
        if self.state is State.CLOSED:
            return None
        try:
            return self._next_event()
        except RemoteProtocolError:
            self.state = State.CLOSED
            raise

    def _next_event(self) -> Message | LegacyMessage | None:
        if self.state is State.LEGACY:
            legacy = self.next_legacy_body()
            return None if legacy is None else LegacyMessage(self.legacy_json(legacy))
        body = self._decoder.next_frame_view()
        if body is None:
            return None
        kind = body_kind(body)
        if self.state is State.AWAIT_HELLO and kind is BodyKind.JSON:  # an unmodified godot_rl plugin game
            self.state = State.LEGACY
            self._decoder.max_frame_bytes = self.max_frame_bytes
            return LegacyMessage(unpack_json(body))
        if kind is BodyKind.JSON or (self.state is not State.AWAIT_HELLO and kind is not self.codec):
            raise RemoteProtocolError(ErrorCode.MALFORMED, f"a {self.codec.value} peer sent a {kind.value} frame")
        message = _decode_message(kind, body)
        if not isinstance(message, _ALLOWED[self.state]):
            raise RemoteProtocolError(
                ErrorCode.UNEXPECTED_MESSAGE,
                f"'{message.TYPE}' is not allowed in state {self.state.value}",
            )
        if isinstance(message, Hello):  # Hello.from_wire refused any other protocol version first
            self.codec = kind
            self._decoder.max_frame_bytes = self.max_frame_bytes
            self.state = {
                "game": State.GAME,
                "trainer": State.TRAINER,
                "sampler": State.SAMPLER,
                "observer": State.OBSERVER,
                "control": State.CONTROL,
            }[message.role]
        return message

    def next_legacy_body(self) -> bytes | memoryview | None:
        """A godot_rl game's next frame body, JSON not yet decoded (its connection reads the per-step replies
        straight into arrays); raises RemoteProtocolError (and moves to CLOSED) on a broken or non-JSON frame."""
        if self.state is not State.LEGACY:
            raise LocalProtocolError(ErrorCode.INTERNAL, f"no godot_rl game on this connection ({self.state.value})")
        try:
            body = self._decoder.next_frame_view()
            if body is not None and body_kind(body) is not BodyKind.JSON:
                raise RemoteProtocolError(ErrorCode.MALFORMED, "a godot_rl game sent a non-JSON frame")
        except RemoteProtocolError:
            self.state = State.CLOSED
            raise
        return body

    def legacy_json(self, body: bytes | memoryview) -> dict[str, Any]:
        """``next_legacy_body``'s body decoded, as ``next_event`` decodes a godot_rl game's frames."""
        try:
            return unpack_json(body)
        except RemoteProtocolError:
            self.state = State.CLOSED
            raise

    def send(self, message: Message) -> bytes:
        if self.state is State.LEGACY:
            raise LocalProtocolError(ErrorCode.INTERNAL, "native message on a godot_rl connection")
        return _encode_message(self.codec, message)

    def send_buffers(self, message: Message) -> list[Buffer]:
        if self.state is State.LEGACY:
            raise LocalProtocolError(ErrorCode.INTERNAL, "native message on a godot_rl connection")
        return frame_buffers(self.codec, message)

    def last_word(self, message: Error | Close) -> bytes:
        if self.state is State.LEGACY:  # a godot_rl game knows no error frame
            return b""
        return self.send(message)

    def refuse(self, error: RemoteProtocolError) -> Refusal | None:
        return None  # an error frame says it all


class PeerConnection:
    """A game's or trainer's end: sends ``hello`` first, skips the greeting, expects ``welcome``."""

    def __init__(
        self,
        hello: Hello,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        codec: BodyKind = BodyKind.MSGPACK,
        writable_arrays: bool = False,
    ) -> None:
        """``writable_arrays``: decoded arrays are writable views of their frame's own buffer, for a peer that
        alone holds what it decodes (the trainer's VecEnv hands them to SB3 without a copy)."""
        if codec is BodyKind.JSON:
            raise ValueError("native peers speak msgpack or Godot Variant bodies")
        self.hello = hello
        self.codec = codec
        self.state = State.AWAIT_GREETING
        self.max_frame_bytes = max_frame_bytes
        self._decoder = FrameDecoder(max_frame_bytes, writable_bodies=writable_arrays)
        self._greeting_frames = 0
        # The shared-memory ring this peer offered in its hello (a trainer on the broker's host), once mapped:
        # a doorbell frame stands for the frame it points to there.
        self.ring: RingReader | None = None

    def initial_bytes(self) -> bytes:
        return self.send(self.hello)

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        self._decoder.feed(data)

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """Where to ``recv_into`` the next bytes; then ``buffer_updated``."""
        return self._decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self._decoder.buffer_updated(nbytes)

    def next_event(self) -> Message | None:
        while True:
            body = self._decoder.next_frame_view()
            if body is None:
                return None
            if self.state is State.AWAIT_GREETING:
                self._check_greeting(body)
                continue
            if self.ring is not None and is_doorbell(body):
                body = self.ring.take(body)
            kind = body_kind(body)
            if kind is not self.codec:
                raise RemoteProtocolError(ErrorCode.MALFORMED, f"expected {self.codec.value} bodies, got {kind.value}")
            message = _decode_message(kind, body)
            if self.state is State.AWAIT_WELCOME:
                if isinstance(message, Welcome):
                    self.state = State.READY
                    return message
                if isinstance(message, (Error, Close)):
                    self.state = State.CLOSED
                    return message
                raise RemoteProtocolError(ErrorCode.UNEXPECTED_MESSAGE, f"expected welcome, got '{message.TYPE}'")
            if not isinstance(message, _ALLOWED_FOR_PEER[self.hello.role]):
                raise RemoteProtocolError(
                    ErrorCode.UNEXPECTED_MESSAGE, f"a {self.hello.role} does not expect '{message.TYPE}'"
                )
            if isinstance(message, (Error, Close)):
                self.state = State.CLOSED
            return message

    def _check_greeting(self, body: bytes | memoryview) -> None:
        greeting = unpack_json(body) if body_kind(body) is BodyKind.JSON else {}
        if self._greeting_frames == 0:
            if greeting.get("type") != "handshake" or "broker_protocol" not in greeting:
                raise RemoteProtocolError(
                    ErrorCode.NOT_SUPPORTED,
                    "the server did not greet like godot-rl-broker (is this a plain godot_rl server?)",
                )
            if greeting["broker_protocol"] != PROTOCOL_VERSION:
                raise RemoteProtocolError(
                    ErrorCode.VERSION_MISMATCH,
                    f"broker speaks protocol {greeting['broker_protocol']}, this client {PROTOCOL_VERSION}",
                )
        elif greeting.get("type") != "env_info":
            raise RemoteProtocolError(ErrorCode.MALFORMED, "second greeting frame must be the env_info request")
        self._greeting_frames += 1
        if self._greeting_frames == 2:
            self.state = State.AWAIT_WELCOME

    def send(self, message: Message) -> bytes:
        return _encode_message(self.codec, message)
