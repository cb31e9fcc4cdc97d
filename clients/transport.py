"""Blocking framed socket for peers (SB3 and games are synchronous): connect with backoff, one
write per frame, TCP_NODELAY, and a sans-IO PeerConnection doing the protocol work."""

from __future__ import annotations

import mmap
import os
import secrets
import socket
import struct
import time
from dataclasses import dataclass, replace
from typing import Final

import structlog

from broker.protocol import DEFAULT_HOST, DEFAULT_PORT, TOKEN_ENV
from broker.protocol.codec import BodyKind
from broker.protocol.connection import PeerConnection, State
from broker.protocol.errors import ErrorCode, ProtocolError
from broker.protocol.gather import frame_buffers
from broker.protocol.messages import Close, Error, Hello, Message, Welcome
from broker.protocol.ring import TOKEN_OFFSET, RingOffer, RingReader
from broker.tuning import SPIN_WAIT_S, SpinBudget, tune_allocator
from clients.errors import BrokerError

DEFAULT_TIMEOUT_RECONNECT: Final = 60.0  # seconds a client waits for a lost broker to come back
MAX_BACKOFF: Final = 1.0  # longest pause between connection attempts, so a broker that is back is found fast
HANDSHAKE_TIMEOUT: Final = 10.0  # a broker that accepts but never welcomes us, while reconnecting
MIN_GREETING_WINDOW: Final = 1.0  # the greeting's share of the connect timeout, when connecting took it all
RETRY_NOTICE_AFTER: Final = 2.0  # seconds without a broker before saying that we are retrying
RETRY_NOTICE_EVERY: Final = 10.0  # and again this often, so a long wait is never silent
# A blocking socket with the kernel's receive timeout waits for a message with one system call; Python's own
# timeout puts a poll before every send and receive (two more a step). Where the option is missing: Python's.
KERNEL_RECV_TIMEOUT: Final = hasattr(socket, "SO_RCVTIMEO") and os.name == "posix"
_DONTWAIT: Final = getattr(socket, "MSG_DONTWAIT", 0)  # Linux and the BSDs; elsewhere receives just block
NOT_A_BROKER: Final = "not_a_broker"  # something answered at the address, but not with the broker's greeting
START_BROKER_HINT: Final = "start it with `gdrl-broker serve`, or check the address"
WRONG_PORT_HINT: Final = (
    f"check the address: give the port `gdrl-broker serve` listens on (default {DEFAULT_PORT}; "
    "its --metrics-port is HTTP)"
)
# Answers that mean "not yet" while the broker still releases our previous session, or is still starting.
RETRIED_WHILE_RECONNECTING: Final = frozenset(
    {"connect_failed", "connection_lost", "timeout", ErrorCode.BROKER_FULL.value, ErrorCode.POLICY_TAKEN.value}
)
log = structlog.get_logger("gdrl.client")


class BrokerGoneError(BrokerError):
    """The broker stayed unreachable for the whole reconnect window. Code ``connection_lost``, as any
    loss of the broker, so existing ``except`` clauses keep working; ``seconds`` says how long it was gone."""

    def __init__(self, address: Address, seconds: float, timeout: float, last: BrokerError) -> None:
        super().__init__(
            "connection_lost",
            f"the broker at {address} was gone for {seconds:.0f} s; gave up reconnecting after the "
            f"{timeout:g} s timeout_reconnect (last error: {last.code}: {last.message})",
        )
        self.seconds = seconds


@dataclass(frozen=True)
class Address:
    """``host:port`` over TCP, or ``unix:/path`` for a Unix domain socket."""

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    unix_path: str | None = None

    @classmethod
    def parse(cls, text: str) -> Address:
        text = text.strip()
        if text.startswith("unix:"):
            return cls(unix_path=text[len("unix:") :])
        text = text.removeprefix("tcp://")
        host, sep, port = text.rpartition(":")
        if not sep:
            return cls(host=text or DEFAULT_HOST)
        return cls(host=host.strip("[]") or DEFAULT_HOST, port=int(port))

    def __str__(self) -> str:
        return f"unix:{self.unix_path}" if self.unix_path else f"{self.host}:{self.port}"


def _open_socket(address: Address, timeout: float) -> socket.socket:
    if address.unix_path:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        sock.connect(address.unix_path)
    else:
        sock = socket.create_connection((address.host, address.port), timeout=timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(None)
    return sock


class PeerSocket:
    """One connection to the broker. ``recv`` returns the next message, raising BrokerError on an
    ``error`` frame or a lost connection."""

    def __init__(
        self,
        address: Address | str,
        hello: Hello,
        timeout_connect: float = 60.0,
        timeout_recv: float | None = None,
        codec: BodyKind = BodyKind.MSGPACK,
        spin_wait_s: float = SPIN_WAIT_S,
        ring_bytes: int = 0,
    ) -> None:
        """``ring_bytes``: a trainer offers the broker a shared-memory ring of this size for its large frames
        (docs/protocol.md §3b), used when the broker runs on this host and can map it; 0: the socket only."""
        self.address = Address.parse(address) if isinstance(address, str) else address
        self.hello = hello
        self.codec = codec
        self.timeout_recv = timeout_recv
        self.spin_wait = SpinWait(spin_wait_s)
        self.ring_bytes = ring_bytes if hello.role == "trainer" and hasattr(os, "memfd_create") else 0
        self.ring: SharedRing | None = None
        self.closed_by_broker = False  # the broker said goodbye (close or error frame), as on its shutdown
        tune_allocator()
        try:
            # The connect timeout covers the greeting and the welcome too: a listener that accepts and
            # never answers must not hang us.
            self._open_first(timeout_connect, None)
        except BrokerError as exc:
            raise self._explain_first_failure(exc) from exc

    def _open_first(self, timeout_connect: float, timeout_handshake: float | None) -> None:
        """The first connection. A trainer retries ``broker_full`` (the broker's connection budget is spent,
        maybe by silent connections it sheds) with backoff for up to ``timeout_connect``; anything else,
        and any refusal of a game, is raised at once."""
        deadline = time.monotonic() + timeout_connect
        delay = 0.05
        while True:
            try:
                self._open(max(deadline - time.monotonic(), 0.1), timeout_handshake)
                return
            except BrokerError as exc:
                retry = self.hello.role == "trainer" and exc.code == ErrorCode.BROKER_FULL.value
                if not retry or time.monotonic() + delay > deadline:
                    raise
                log.info("broker full, retrying", address=str(self.address), delay_s=delay)
            time.sleep(delay)
            delay = min(delay * 2, MAX_BACKOFF)

    def _open(self, timeout_connect: float, timeout_handshake: float | None) -> None:
        """Connect (with backoff), say hello and read the welcome, on a fresh protocol state.
        ``timeout_handshake`` None: whatever is left of ``timeout_connect`` (at least MIN_GREETING_WINDOW)."""
        deadline = time.monotonic() + timeout_connect
        # msgpack, or Godot Variant as the addon. Arrays are writable views of their frame: this socket
        # alone holds what it receives, so a VecEnv may hand them to SB3 without a copy.
        hello = self.hello
        if self.ring_bytes:  # a fresh ring for every connection: nothing of an earlier session can reach it
            if self.ring is not None:
                self.ring.close()
            self.ring = SharedRing(self.ring_bytes)
            hello = replace(hello, ring=self.ring.offer)
        self.connection = PeerConnection(hello, codec=self.codec, writable_arrays=True)
        if self.ring is not None:
            self.connection.ring = RingReader(self.ring.view, self.connection.max_frame_bytes)
        self.closed_by_broker = False
        self._first_bytes = b""  # what the server sent first, to show when it is not the greeting
        self.sock = self._connect_with_backoff(timeout_connect)
        if timeout_handshake is None:
            timeout_handshake = max(deadline - time.monotonic(), MIN_GREETING_WINDOW)
        self.handshake_window = timeout_handshake
        self.sock.settimeout(timeout_handshake)
        self.closed = False
        try:
            self.sock.sendall(self.connection.initial_bytes())
        except OSError as exc:
            self.close()
            raise BrokerError("connection_lost", f"lost the broker at {self.address}: {exc}") from exc
        try:
            welcome = self.recv()
        except BrokerError:
            self.close()
            raise
        if not isinstance(welcome, Welcome):
            self.close()
            raise BrokerError(ErrorCode.UNEXPECTED_MESSAGE.value, f"expected welcome, got {welcome.TYPE}")
        self.sock.settimeout(self.timeout_recv)
        self._kernel_timeout: float | None = None
        self.welcome = welcome

    def _explain_first_failure(self, exc: BrokerError) -> BrokerError:
        """Tell "not a broker" (no greeting, or not the broker's) apart from the broker refusing or closing.

        A broker greets every connection at once, before anything else, even one it refuses."""
        if exc.code == "connect_failed" or self.connection.state is not State.AWAIT_GREETING:
            return exc
        if exc.code == ErrorCode.VERSION_MISMATCH.value:
            return BrokerError(exc.code, f"the broker at {self.address}: {exc.message}; install the same version")
        if exc.code == "timeout":
            what = f"it accepted the connection but sent no greeting within {self.handshake_window:.0f} s"
        elif exc.code == "connection_lost" and not self._first_bytes:
            what = "it closed the connection without a greeting"
        else:
            what = f"it sent {self._first_bytes[:24]!r} where a broker sends its greeting ({exc.message})"
        return BrokerError(NOT_A_BROKER, f"{self.address} is not a godot-rl-broker: {what}; {WRONG_PORT_HINT}")

    def reconnect(self, timeout: float, cause: BrokerError) -> None:
        """Replace a lost connection: connect and say hello again, with backoff, for up to ``timeout`` s.

        While the broker is still releasing our previous session it may answer ``broker_full`` or
        ``policy_taken``; those are retried too. Raises BrokerGoneError once ``timeout`` has passed.
        """
        self.close()
        started = time.monotonic()
        deadline = started + timeout
        delay = 0.05
        last = cause
        while True:
            remaining = max(deadline - time.monotonic(), 0.0)
            try:
                self._open(remaining, min(max(remaining, 0.1), HANDSHAKE_TIMEOUT))
                return
            except BrokerError as exc:
                if exc.code not in RETRIED_WHILE_RECONNECTING:
                    raise
                last = exc
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BrokerGoneError(self.address, time.monotonic() - started, timeout, last)
            time.sleep(min(delay, remaining))  # the last attempt falls on the deadline itself
            delay = min(delay * 2, MAX_BACKOFF)

    def lost_broker(self, exc: BrokerError, on_shutdown: bool) -> bool:
        """Whether ``exc`` means the broker went away (so reconnecting may help), not that it refused us.

        A dropped connection always counts; an orderly shutdown (``close`` to a game, ``shutting_down``
        to a trainer) counts only with ``on_shutdown``, since by default a peer told to stop stops.
        """
        if exc.code == "connection_lost":
            return True
        return on_shutdown and self.closed_by_broker and exc.code in ("closed", ErrorCode.SHUTTING_DOWN.value)

    def _connect_with_backoff(self, timeout: float) -> socket.socket:
        started = time.monotonic()
        deadline = started + timeout
        delay = 0.05
        next_notice = started + RETRY_NOTICE_AFTER
        while True:
            try:
                return _open_socket(self.address, timeout=max(0.1, min(5.0, deadline - time.monotonic())))
            except OSError as exc:
                now = time.monotonic()
                if now + delay > deadline:
                    raise BrokerError(
                        "connect_failed",
                        f"no broker at {self.address} within {timeout:.0f} s ({_reason(exc)}): {START_BROKER_HINT}",
                    ) from exc
                if now >= next_notice:
                    next_notice = now + RETRY_NOTICE_EVERY
                    _log_retrying(self.address, exc, now - started, deadline - now)
                time.sleep(delay)
                delay = min(delay * 2, MAX_BACKOFF)

    def send(self, message: Message) -> None:
        if self.closed:
            raise BrokerError("closed", "connection is closed")
        try:
            # _send_buffers returns only once all is sent: the caller's arrays may be referenced
            _send_buffers(self.sock, frame_buffers(self.connection.codec, message, writable_too=True))
        except OSError as exc:
            raise BrokerError("connection_lost", f"lost the broker at {self.address}: {exc}") from exc

    def set_recv_timeout(self, seconds: float | None) -> None:
        """How long ``recv`` waits (None: for ever) before it raises ``BrokerError("timeout")``. Nothing to do
        when it is that already (a change is a system call, and a trainer waits once a step). A socket without
        a timeout of Python's stays blocking and gets the kernel's receive timeout instead, so sends and
        receives stay one system call each."""
        if self.closed:
            return
        if KERNEL_RECV_TIMEOUT and self.sock.gettimeout() is None:
            if seconds != self._kernel_timeout:
                whole = int(seconds or 0)
                micros = int(((seconds or 0) - whole) * 1e6)
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", whole, micros))
                self._kernel_timeout = seconds
        elif self.sock.gettimeout() != seconds:
            self.sock.settimeout(seconds)

    def recv(self) -> Message:
        first_read = True  # later reads continue a frame that has begun: they just block
        while True:
            try:
                message = self.connection.next_event()
            except ProtocolError as exc:
                self.close()
                raise BrokerError(exc.code.value, exc.message) from exc
            if message is not None:
                if isinstance(message, Error):
                    self.closed_by_broker = True
                    self.close()
                    raise BrokerError(message.code, message.message)
                if isinstance(message, Close):
                    self.closed_by_broker = True
                    self.close()
                    raise BrokerError("closed", message.reason or "the broker closed the connection")
                return message
            # Straight into the decoder's buffer: a frame's body lands in its own buffer, which the
            # decoded arrays then view (no joins of chunks, no copy of array bytes).
            buffer = self.connection.get_buffer()
            try:
                # A socket with Python's timeout polls before each receive: it never spins.
                if first_read and self.sock.gettimeout() is None:
                    received = self.spin_wait.recv_into(self.sock, buffer)
                else:
                    received = self.sock.recv_into(buffer)
                first_read = False
            except (TimeoutError, BlockingIOError) as exc:  # Python's timeout, or the kernel's (SO_RCVTIMEO)
                raise BrokerError("timeout", f"no message from the broker at {self.address}") from exc
            except OSError as exc:
                self.close()
                raise BrokerError("connection_lost", f"lost the broker at {self.address}: {exc}") from exc
            if not received:
                self.close()
                raise BrokerError("connection_lost", f"the broker at {self.address} closed the connection")
            if not self._first_bytes:
                self._first_bytes = bytes(buffer[: min(received, 64)])
            self.connection.buffer_updated(received)

    def close(self, reason: str = "") -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if reason:
                self.sock.sendall(self.connection.send(Close(reason)))
        except OSError:
            pass
        self.sock.close()
        if self.ring is not None:
            self.ring.close()
            self.ring = None

    @property
    def ring_frames(self) -> int:
        """Frames this connection has received through its shared-memory ring (0: none, or no ring)."""
        ring = self.connection.ring
        return 0 if ring is None else ring.frames


class SharedRing:
    """The memory a trainer offers the broker for its large frames: an anonymous memory file (``memfd``) the
    broker opens through ``/proc/<our pid>/fd/<fd>``, with a random token in it so that the broker maps this
    file and no other. It lives as long as the connection; its pages are the trainer's and the broker's only."""

    def __init__(self, size: int) -> None:
        self.fd = os.memfd_create("gdrl-broker-ring", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)  # sparse: pages cost memory only once a frame touches them
            self.map = mmap.mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise
        self.view = memoryview(self.map)
        token = secrets.token_bytes(16)
        self.view[TOKEN_OFFSET : TOKEN_OFFSET + len(token)] = token
        self.offer = RingOffer(f"/proc/{os.getpid()}/fd/{self.fd}", size, token)

    def close(self) -> None:
        self.view.release()
        self.map.close()
        os.close(self.fd)


class SpinWait:
    """How a peer waits for the next message: first asking for it without sleeping, for as long as its
    ``SpinBudget`` allows (broker/tuning.py: SPIN_WAIT_S, less after spins that found nothing), yielding the
    core between asks so that a peer with work to do gets it; then blocking as usual, with the socket's
    timeout. An answer that comes within the spin costs no wake-up, neither here nor to its sender."""

    def __init__(self, spin_s: float = SPIN_WAIT_S) -> None:
        self.budget = SpinBudget(spin_s if _DONTWAIT else 0.0)

    def recv_into(self, sock: socket.socket, buffer: memoryview | bytearray) -> int:
        """``sock.recv_into(buffer)``, waiting as above."""
        spin_s = self.budget.next_spin()
        if spin_s:
            until = time.perf_counter() + spin_s
            while True:
                try:
                    received = sock.recv_into(buffer, 0, _DONTWAIT)
                except BlockingIOError:
                    if time.perf_counter() < until:
                        os.sched_yield()
                        continue
                    self.budget.missed()
                    break
                self.budget.found()
                return received
        return sock.recv_into(buffer)


def _send_buffers(sock: socket.socket, buffers: list[bytes | bytearray | memoryview]) -> None:
    """One frame in one gather write (``sendmsg``), large arrays straight from their own memory; the loop
    only continues a write the kernel took in part."""
    if len(buffers) == 1:
        sock.sendall(buffers[0])
        return
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= views[0].nbytes:
            sent -= views[0].nbytes
            views.pop(0)
        if sent:
            views[0] = views[0][sent:]


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc) or type(exc).__name__


def _log_retrying(address: Address, exc: OSError, waited: float, left: float) -> None:
    log.warning(
        f"no broker at {address} yet; retrying",
        error=_reason(exc),
        waited_s=round(waited),
        gives_up_in_s=round(left),
        hint=START_BROKER_HINT,
    )


def default_token(token: str | None) -> str | None:
    """``token``, else the shared token from the environment (TOKEN_ENV), as `serve` and `status` read it."""
    return token if token is not None else os.environ.get(TOKEN_ENV)


def default_name(kind: str) -> str:
    return f"{kind}@{socket.gethostname()}:{os.getpid()}"
