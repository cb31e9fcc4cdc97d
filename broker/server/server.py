"""asyncio server: one listening port (plus an optional Unix socket) for games and trainers alike.

Each accepted connection gets a ``PeerProtocol``: bytes go into a sans-IO connection (a
``ServerConnection``: ``BrokerConnection`` for native peers, swapped for a ``GodotRlGameConnection`` when
the first frame is godot_rl's JSON), typed messages go to the ``Hub``, and the hub's sends come back
through ``PeerProtocol.send``, which writes the bytes the connection makes of them. One receive loop and
one dispatch serve both kinds. Everything runs on the event loop's thread; the hub is never entered
concurrently.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import os
import socket
import time
from typing import Any, Protocol, cast

import structlog

from broker.core.batching import UnencodableMessage
from broker.core.effects import Close as CloseEffect
from broker.core.effects import Effect, Send, StartTimer, Timer
from broker.core.flow import Hub
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
    Error,
    GameStep,
    Hello,
    Message,
    Status,
    TrainerAct,
    TrainerReset,
    Welcome,
)
from broker.server.config import ServerConfig
from broker.server.legacy_games import GodotRlCalls, is_loopback
from broker.status import wire_safe
from broker.tuning import trim_heap, tune_allocator

log = structlog.get_logger("gdrl.server")

# A peer that buffered this much at once (a large frame) has its freed memory handed back when it leaves.
LARGE_FRAME_BYTES = 1 << 20
TRIM_DELAY_S = 0.5  # heap trims after departures are coalesced: at most one per this interval


class Link(Protocol):
    """What the server needs of a hub peer (a connection, a dialed godot_rl trainer, an in-process one).
    Every peer the server hands the hub is one, so the peers in the hub's effects are too."""

    label: str

    def send(self, message: Message) -> None: ...

    def close(self, error: Error | Close | None = None) -> None: ...


class PeerProtocol(asyncio.BufferedProtocol):
    def __init__(self, server: BrokerServer) -> None:
        self.server = server
        self.hub = server.hub
        self.connection: ServerConnection = BrokerConnection(server.config.max_frame_bytes)
        self.transport: asyncio.Transport | None = None
        self.label = "?"
        self.game: GameSession | None = None
        self.trainer: TrainerSession | None = None
        self.closing = False
        self._hello_timer: asyncio.TimerHandle | None = None
        self._frame_timer: asyncio.TimerHandle | None = None
        self._refusal_timer: asyncio.TimerHandle | None = None
        self.admitted = False  # past hello: counts against --limit-connections, not --limit-before-hello
        self.large_frames = False
        self._loop: asyncio.AbstractEventLoop | None = None

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

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.connection.get_buffer(sizehint)  # the frame's own buffer: no chunk joins

    def buffer_updated(self, nbytes: int) -> None:
        self.connection.buffer_updated(nbytes)
        self._received()

    def data_received(self, data: bytes) -> None:  # a plain Protocol's way in (tests drive it so)
        self.connection.receive_data(data)
        self._received()

    def _received(self) -> None:
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
        if self.game is not None or self.trainer is not None:
            self.server.leave(self)
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
            if event.role in ("game", "trainer"):
                self.server.enter(self, event)
                session = self.hub.session(self)
                self.game = session if isinstance(session, GameSession) else None
                self.trainer = session if isinstance(session, TrainerSession) else None
            else:  # an observer: status once, then goodbye
                self.send(Welcome(PROTOCOL_VERSION, 0))
                self.send(Status(wire_safe(self.server.status())))
                self.close(Close("status sent"))
        elif isinstance(event, (GameStep, TrainerAct, TrainerReset)):
            self.server.enter(self, event)
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


class BrokerServer:
    def __init__(self, config: ServerConfig, hub: Hub | None = None) -> None:
        config.validate()
        self.config = config
        self.hub = hub or Hub(config.expected_games, config.step_options())
        self.connections: set[PeerProtocol] = set()
        self.before_hello: dict[PeerProtocol, None] = {}  # insertion order: the oldest is shed first
        self.admitted: set[PeerProtocol] = set()
        self._trim: asyncio.TimerHandle | None = None
        self._servers: list[asyncio.base_events.Server] = []
        self._status_task: asyncio.Task[None] | None = None
        self.started = time.monotonic()
        self.godot_rl_calls = GodotRlCalls(self)  # a dialed godot_rl trainer's call, relayed to plugin games

    # --- the one way into the hub, and its effects carried out -------------------------------------

    def enter(self, peer: Link, message: Message) -> None:
        """Hand ``message`` from ``peer`` to the hub and carry out what it answers. A RemoteProtocolError
        (the peer's fault) propagates to the caller, which closes that peer; the hub is unchanged then."""
        self.apply(self.hub.handle(peer, message))

    def leave(self, peer: Link) -> None:
        """``peer``'s connection is gone: its game or trainer leaves the hub."""
        self.apply(self.hub.peer_lost(peer))

    def apply(self, effects: list[Effect]) -> None:
        """Carry out the hub's effects in order: sends, closes, timers."""
        for effect in effects:
            if isinstance(effect, Send):
                self._send(cast(Link, effect.peer), effect.message)
            elif isinstance(effect, CloseEffect):
                cast(Link, effect.peer).close(effect.error)
            elif isinstance(effect, StartTimer):
                asyncio.get_running_loop().call_later(effect.delay_s, self._timer_fired, effect.timer)

    def _send(self, peer: Link, message: Message) -> None:
        try:
            peer.send(message)
        except UnencodableMessage as exc:  # the batch, not the peer, is at fault: the hub re-sends a part
            if not isinstance(message, Batch):
                raise
            self.apply(self.hub.batch_undeliverable(peer, message.step, exc.encodable, exc.message))

    def _timer_fired(self, timer: Timer) -> None:
        """A hub timer (deadline, idle pacing, stall check) is due; a failure is logged, never fatal."""
        try:
            self.apply(self.hub.timer_fired(timer))
        except Exception:
            log.exception("hub timer failed")

    def schedule_heap_trim(self) -> None:
        """Give freed memory back to the OS soon (a large peer or a game left); coalesced."""
        if self._trim is None:
            self._trim = asyncio.get_running_loop().call_later(TRIM_DELAY_S, self._trim_heap)

    def _trim_heap(self) -> None:
        self._trim = None
        trim_heap()

    @property
    def port(self) -> int:
        for server in self._servers:
            for sock in server.sockets:
                if sock.family in (socket.AF_INET, socket.AF_INET6):
                    return int(sock.getsockname()[1])
        return self.config.port

    async def start(self) -> None:
        tune_allocator()
        loop = asyncio.get_running_loop()
        tcp = await loop.create_server(
            lambda: PeerProtocol(self), self.config.host, self.config.port, reuse_address=True, backlog=256
        )
        self._servers.append(tcp)
        if self.config.unix_path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.config.unix_path)
            self._servers.append(await loop.create_unix_server(lambda: PeerProtocol(self), self.config.unix_path))
        if self.config.status_interval > 0:
            self._status_task = asyncio.create_task(self._log_status())
        if self.config.metrics_port is not None:
            # Loopback only: the endpoint has no token, so it never follows --host off this machine.
            metrics = await asyncio.start_server(self._serve_metrics, "127.0.0.1", self.config.metrics_port)
            self._servers.append(metrics)
        log.info(
            "broker listening",
            host=self.config.host,
            port=self.port,
            unix=self.config.unix_path,
            games=self.config.expected_games,
        )

    async def _serve_metrics(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A minimal HTTP endpoint with the status in Prometheus text format (any path)."""
        from broker.status import prometheus_text

        try:
            await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=5.0)
            body = prometheus_text(wire_safe(self.status())).encode()
            head = f"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {len(body)}\r\n"
            writer.write(head.encode() + b"Connection: close\r\n\r\n" + body)
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _log_status(self) -> None:
        while True:
            await asyncio.sleep(self.config.status_interval)
            snapshot = self.hub.snapshot()
            games = sum(1 for g in snapshot["games"] if g["connected"])
            log.info("status", games=f"{games}/{len(snapshot['games'])}")
            for name, policy in snapshot["policies"].items():
                log.info("policy status", policy=name, **policy)

    def status(self) -> dict[str, Any]:
        return {
            "uptime_s": round(time.monotonic() - self.started, 1),
            "connections": len(self.connections),
            "connections_before_hello": len(self.before_hello),
            **self.hub.snapshot(),
        }

    async def shutdown(self, reason: str = "broker shutting down") -> None:
        """Stop listening, tell every peer why, and give them ``timeout_shutdown`` to leave."""
        for server in self._servers:
            server.close()
        if self._status_task is not None:
            self._status_task.cancel()
        for peer in list(self.connections):
            if isinstance(peer.connection, GodotRlGameConnection):  # joined or refused: its close quits it
                peer.close(Close(reason))
            elif peer.trainer is not None:
                peer.close(Error(ErrorCode.SHUTTING_DOWN.value, reason))
            elif peer.game is not None:
                peer.close(Close(reason))
            else:
                peer.close()
        deadline = time.monotonic() + self.config.timeout_shutdown
        while self.connections and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for peer in list(self.connections):
            if peer.transport is not None:
                peer.transport.abort()
        for server in self._servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 1.0)
        if self.config.unix_path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.config.unix_path)
        log.info("broker stopped", reason=reason)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop where it is installed, else the standard loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()
