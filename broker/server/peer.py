"""One accepted connection: ``PeerProtocol`` reads frames into their own buffers, runs one receive loop
over its sans-IO ``ServerConnection`` (``BrokerConnection``, swapped for a ``GodotRlGameConnection`` when
the first frame is godot_rl's JSON), hands typed messages to the hub through ``BrokerServer.enter``, and
writes what the hub sends (one write, or one gather write for large arrays). Limits and timeouts of one
peer live here: hello and frame timeouts, pending bytes, the before-hello budget.
"""

from __future__ import annotations

import asyncio
import hmac
import socket
from typing import TYPE_CHECKING, Any, Protocol, cast

import structlog

from broker.core.batching import UnencodableMessage
from broker.core.claims import SamplerSession
from broker.core.sessions import GameSession, TrainerSession
from broker.legacy.game_connection import CallAnswered, GodotRlGameConnection
from broker.protocol import PROTOCOL_VERSION
from broker.protocol.codec import encode_body
from broker.protocol.connection import (
    BrokerConnection,
    CannotSend,
    ConnectionEvent,
    Farewell,
    LegacyMessage,
    Refusal,
    Refused,
    ServerConnection,
)
from broker.protocol.errors import ErrorCode, ProtocolError, RemoteProtocolError
from broker.protocol.gather import Buffer
from broker.protocol.messages import (
    Batch,
    Close,
    Control,
    Error,
    GameStep,
    Hello,
    Message,
    Status,
    TrainerAct,
    TrainerReset,
    Welcome,
)
from broker.protocol.ring import RingOffer
from broker.server.frozen import ControlError
from broker.server.legacy_games import is_loopback
from broker.server.ring import MappedRing, RingUnusable
from broker.status import wire_safe

if TYPE_CHECKING:
    from broker.server.server import BrokerServer

log = structlog.get_logger("gdrl.server")

# A peer that buffered this much at once (a large frame) has its freed memory handed back when it leaves.
LARGE_FRAME_BYTES = 1 << 20


class Link(Protocol):
    """What the server needs of a hub peer (a connection, a dialed godot_rl trainer, an in-process one).
    Every peer the server hands the hub is one, so the peers in the hub's effects are too."""

    label: str

    @property
    def link_kind(self) -> str:
        """How messages reach the peer, for the status: tcp, unix (either with "+ ring": a trainer's large
        batches through its shared-memory ring), in-process, godot_rl script or frozen (the broker's own)."""
        ...

    def send(self, message: Message) -> None: ...

    def close(self, error: Error | Close | None = None) -> None: ...


class PeerProtocol(asyncio.BufferedProtocol):
    def __init__(self, server: BrokerServer) -> None:
        self.server = server
        self.hub = server.hub
        self.connection: ServerConnection = BrokerConnection(server.config.max_frame_bytes)
        self.transport: asyncio.Transport | None = None
        self.label = "?"
        self.family = "tcp"  # or unix: the listener's kind, for the status
        self.game: GameSession | None = None
        self.trainer: TrainerSession | None = None
        self.sampler: SamplerSession | None = None
        self.closing = False
        self.control_task: asyncio.Future[None] | None = None  # a control request being carried out
        self._hello_timer: asyncio.TimerHandle | None = None
        self._frame_timer: asyncio.TimerHandle | None = None
        self._refusal_timer: asyncio.TimerHandle | None = None
        self.admitted = False  # past hello: counts against --limit-connections, not --limit-before-hello
        self.large_frames = False
        self.ring: MappedRing | None = None  # a trainer's shared-memory ring, for its large frames
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def link_kind(self) -> str:
        return self.family if self.ring is None else f"{self.family} + ring"

    # --- asyncio callbacks -----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        writer = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio subclasses
        self.transport = writer
        sock = transport.get_extra_info("socket")
        peer = transport.get_extra_info("peername")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.label = f"{peer[0]}:{peer[1]}"
        else:
            self.label = f"unix#{id(self) & 0xFFFF:04x}"
            self.family = "unix"
        self.server.connections.add(self)
        writer.write(self.connection.greeting())  # first, so a refused client reads the error as ours
        self._loop = asyncio.get_running_loop()
        self.server.before_hello[self] = None
        limit = self.server.config.limit_before_hello
        if len(self.server.before_hello) > limit:  # silent connections must not lock out real peers
            oldest = next(iter(self.server.before_hello))
            oldest._fail(ErrorCode.BROKER_FULL, f"{limit} connections are waiting for hello; the oldest is shed")
        self._hello_timer = self._loop.call_later(self.server.config.timeout_hello, self._hello_timed_out)
        log.debug("connected", peer=self.label)

    # Reads go straight into the frames' memory (FrameDecoder.get_buffer): no bytes object per read, no join.
    def get_buffer(self, sizehint: int) -> memoryview:
        return self.connection.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        spinner = self.server.spinner
        if spinner is not None:
            spinner.message_came()
        self.connection.buffer_updated(nbytes)
        if self.connection.buffered_bytes >= LARGE_FRAME_BYTES:
            self.large_frames = True
        frames = 0
        try:
            while not self.closing:
                event = self.connection.next_event()  # raises when the stream itself is broken
                if event is None:
                    break
                frames += 1
                try:
                    self._handle(event)
                except RemoteProtocolError as exc:  # a well-formed message the broker refuses
                    self._refuse(exc)
        except ProtocolError as exc:
            self._fail(exc.code, exc.message)
        except Exception as exc:  # a bug must cost one connection, not the broker
            log.exception("internal error", peer=self.label)
            self._fail(ErrorCode.INTERNAL, f"internal broker error: {type(exc).__name__}: {str(exc)[:200]}")
        if not self.closing:
            self._watch_frame_progress(frames)

    def _watch_frame_progress(self, completed_frames: int) -> None:
        """After hello, a started frame must be whole within --timeout-frame: a peer that trickles bytes
        must not hold its slot (and, in barrier mode, its policy) forever. Each completed frame restarts it."""
        if not self.admitted or self._loop is None:
            return
        if not self.connection.buffered_bytes:
            if self._frame_timer is not None:
                self._frame_timer.cancel()
                self._frame_timer = None
        elif self._frame_timer is None or completed_frames:
            if self._frame_timer is not None:
                self._frame_timer.cancel()
            self._frame_timer = self._loop.call_later(self.server.config.timeout_frame, self._frame_timed_out)

    def _frame_timed_out(self) -> None:
        received = self.connection.buffered_bytes
        timeout = self.server.config.timeout_frame
        self._fail(ErrorCode.SLOW_PEER, f"a frame is still incomplete {timeout:g} s after it began ({received} bytes)")

    def eof_received(self) -> bool | None:
        unfinished = self.connection.buffered_bytes
        if unfinished and not self.closing:  # the stream ended inside a frame: say so, then close
            self._fail(ErrorCode.MALFORMED, f"connection ended inside a frame ({unfinished} bytes of it received)")
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        for timer in (self._hello_timer, self._frame_timer, self._refusal_timer):
            if timer is not None:
                timer.cancel()
        self.server.connections.discard(self)
        self.server.before_hello.pop(self, None)
        self.server.admitted.discard(self)
        if self.large_frames or self.game is not None:
            self.server.schedule_heap_trim()
        if self.game is not None or self.trainer is not None or self.sampler is not None:
            self.server.leave(self)
        if self.ring is not None:  # after the hub's goodbye: nothing is sent to this peer any more
            self.ring.close()
            self.ring = None
        log.debug("disconnected", peer=self.label, reason=str(exc) if exc else "closed")

    # --- dispatch --------------------------------------------------------------------------------

    def _handle(self, event: Message | ConnectionEvent) -> None:
        if isinstance(event, LegacyMessage):
            self._become_godot_rl_game(event)
        elif isinstance(event, Hello):
            if not self.admitted:  # a native peer; a godot_rl game was let in at its first frame
                self._cancel_hello_timer()
                self._check_token(event)
                self._admit()
            if event.role in ("game", "trainer", "sampler"):
                self.server.enter(self, event)
                session = self.hub.session(self)
                self.game = session if isinstance(session, GameSession) else None
                self.trainer = session if isinstance(session, TrainerSession) else None
                self.sampler = session if isinstance(session, SamplerSession) else None
                if self.trainer is not None and event.ring is not None:
                    self._map_ring(event.ring)
            elif event.role == "control":  # one Control request follows
                self.send(Welcome(PROTOCOL_VERSION, 0))
            else:  # an observer: status once, then goodbye
                self.send(Welcome(PROTOCOL_VERSION, 0))
                self.send(Status(wire_safe(self.server.status())))
                self.close(Close("status sent"))
        elif isinstance(event, (GameStep, TrainerAct, TrainerReset)):
            self.server.enter(self, event)
        elif isinstance(event, Control):
            if self.control_task is not None:
                raise RemoteProtocolError(ErrorCode.UNEXPECTED_MESSAGE, "one control request per connection")
            self.control_task = asyncio.ensure_future(self._control(event))  # kept: a task is weakly held
        elif isinstance(event, Close):
            log.info("peer said goodbye", peer=self.label, reason=event.reason)
            self.closing = True
            assert self.transport is not None
            self.transport.close()
        elif isinstance(event, CallAnswered):
            self.server.godot_rl_calls.answered(self, event.result)
            self._write(event.then_send)
        elif isinstance(event, Refused):
            self._refused(event.refusal)
        elif isinstance(event, Farewell):
            self._close_after(event.data)

    async def _control(self, request: Control) -> None:
        """A control peer's request: the result as a ``status``, or why not as an ``error``; then goodbye."""
        try:
            result = await self.server.frozen.control(request)
        except ControlError as exc:
            log.warning("control refused", peer=self.label, command=request.command, error=str(exc))
            self.close(Error(ErrorCode.BAD_CONTROL.value, str(exc)))
            return
        except Exception as exc:  # a fault of ours: the asker hears of it, the broker goes on
            log.exception("control failed", peer=self.label, command=request.command)
            self.close(Error(ErrorCode.INTERNAL.value, f"control {request.command} failed: {exc}"))
            return
        log.info("control done", peer=self.label, command=request.command)
        self.send(Status(wire_safe(result)))
        self.close(Close("control done"))

    def _become_godot_rl_game(self, first: LegacyMessage) -> None:
        """The first frame was JSON: an unmodified godot_rl plugin game. Its connection takes over."""
        self._admit()
        assert isinstance(self.connection, BrokerConnection) and self.transport is not None
        self.connection = GodotRlGameConnection(self.connection, first, self.label)
        if self.server.config.token and not is_loopback(self.transport):
            # The plugin cannot carry our token; it always connects from 127.0.0.1, so only loopback is allowed.
            raise RemoteProtocolError(
                ErrorCode.AUTH_FAILED, "godot_rl plugin games carry no token; they may only connect over loopback"
            )

    def _map_ring(self, offer: RingOffer) -> None:
        """Use the trainer's offered ring for its large frames, if it is on this host and the offer holds."""
        assert self.transport is not None
        try:
            if not is_loopback(self.transport):
                raise RingUnusable("the trainer is not on this host")
            self.ring = MappedRing(offer)
        except RingUnusable as exc:
            log.info("trainer ring not used; frames go by the socket", peer=self.label, reason=str(exc))
            return
        log.info("trainer ring in use", peer=self.label, ring_bytes=offer.size)

    def _refuse(self, exc: RemoteProtocolError) -> None:
        refusal = self.connection.refuse(exc)
        if refusal is None:
            self._fail(exc.code, exc.message)
        else:
            self._refused(refusal)

    def _refused(self, refusal: Refusal) -> None:
        """Told gently (a godot_rl game): it leaves the hub now, and the connection after its answer."""
        if self.game is not None:
            self.server.leave(self)
            self.game = None
        self._write(refusal.now)
        if self._loop is not None and not self.closing:
            self._refusal_timer = self._loop.call_later(refusal.grace_s, self.close, Close("refused"))

    def _check_token(self, hello: Hello) -> None:
        expected = self.server.config.token
        if expected is None:
            return
        given = (hello.token or "").encode()
        if not hmac.compare_digest(given, expected.encode()):
            raise RemoteProtocolError(ErrorCode.AUTH_FAILED, "missing or wrong token")

    def _admit(self) -> None:
        """Move from the before-hello budget to the admitted one (once), or refuse with broker_full."""
        if self.admitted:
            return
        self._cancel_hello_timer()
        self.server.before_hello.pop(self, None)
        limit = self.server.config.limit_connections
        if len(self.server.admitted) >= limit:
            raise RemoteProtocolError(ErrorCode.BROKER_FULL, f"connection limit {limit} reached")
        self.admitted = True
        self.server.admitted.add(self)

    def _cancel_hello_timer(self) -> None:
        if self._hello_timer is not None:
            self._hello_timer.cancel()
            self._hello_timer = None

    def _hello_timed_out(self) -> None:
        self._fail(ErrorCode.HELLO_TIMEOUT, f"no hello within {self.server.config.timeout_hello:.0f} s")

    def _fail(self, code: ErrorCode, message: str) -> None:
        log.warning("peer error", peer=self.label, code=code.value, error=message)
        self.close(Error(code.value, message))

    # --- Link, as the hub sees us ----------------------------------------------------------------

    def send(self, message: Message) -> None:
        if self.closing or self.transport is None:
            return
        try:
            frame = self.connection.send_buffers(message)
        except CannotSend:
            self.close()
            return
        except ProtocolError:
            raise
        except Exception as exc:  # data from some peer that this peer's codec cannot carry: nothing written
            problem = f"cannot encode '{message.TYPE}' for {self.label}: {type(exc).__name__}: {str(exc)[:200]}"
            if isinstance(message, Batch):  # the hub drops the unencodable part and blames its game
                raise UnencodableMessage(problem, self._encodable) from None
            log.error("message not encodable", peer=self.label, error=problem)
            self._fail(ErrorCode.INTERNAL, f"the broker could not encode a '{message.TYPE}' message for this peer")
            return
        if self.ring is not None and isinstance(message, Batch):
            doorbell = self.ring.writer.place(frame)
            if doorbell is not None:  # else small, or no room now: the socket, in order behind the doorbells before
                self._write(doorbell)
                return
        if len(frame) == 1:
            self._write(frame[0])
        elif not self.closing:
            self.transport.writelines(frame)  # one gather write: arrays go from their own memory
            self._check_pending()

    def _encodable(self, value: Any) -> bool:
        """Whether ``value`` encodes in this peer's codec."""
        try:
            encode_body(self.connection.codec, {"value": value})
        except Exception:
            return False
        return True

    def _write(self, data: Buffer) -> None:
        if data and not self.closing and self.transport is not None:
            self.transport.write(data)
            self._check_pending()

    def _check_pending(self) -> None:
        assert self.transport is not None
        if self.transport.get_write_buffer_size() > self.server.config.max_pending_bytes:
            self._fail(ErrorCode.SLOW_PEER, "peer is not reading; too many bytes pending")

    def start_call(self, method: str) -> bool:
        """Send a godot_rl ``call`` request, if this is a plugin game that can take one now."""
        if self.closing or not isinstance(self.connection, GodotRlGameConnection):
            return False
        request = self.connection.call_request(method)
        if request is None:
            return False
        self._write(request)
        return True

    def close(self, error: Error | Close | None = None) -> None:
        """Close after telling the peer ``error`` (or an orderly ``Close``), in its own words."""
        if self.closing or self.transport is None:
            return
        self._close_after(self._last_word(error) if error is not None else b"")

    def _close_after(self, data: bytes) -> None:
        if self.closing or self.transport is None:
            return
        if data:
            self.transport.write(data)
        self.closing = True
        self.server.before_hello.pop(self, None)  # at once: the next shed picks another connection
        self.transport.close()
        if self._loop is not None and self.transport.get_write_buffer_size():  # unread bytes are not kept forever
            self._loop.call_later(self.server.config.timeout_shutdown, self.transport.abort)

    def _last_word(self, message: Error | Close) -> bytes:
        """The frame of an error or close; its text made encodable if it quotes something that is not."""
        safe: Error | Close = (
            Error(message.code, wire_safe(message.message))
            if isinstance(message, Error)
            else Close(wire_safe(message.reason))
        )
        for candidate in (message, safe):
            try:
                return self.connection.last_word(candidate)
            except ProtocolError:
                return b""
            except Exception:
                continue
        return b""
