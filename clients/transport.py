"""Blocking framed socket for peers (SB3 and games are synchronous): connect with backoff, one
write per frame, TCP_NODELAY, and a sans-IO PeerConnection doing the protocol work."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass

import structlog

from broker.protocol.codec import BodyKind
from broker.protocol.connection import PeerConnection
from broker.protocol.errors import ErrorCode, ProtocolError
from broker.protocol.messages import Close, Error, Hello, Message, Welcome
from clients.errors import BrokerError

DEFAULT_PORT = 11008
log = structlog.get_logger("gdrl.client")


@dataclass(frozen=True)
class Address:
    """``host:port`` over TCP, or ``unix:/path`` for a Unix domain socket."""

    host: str = "127.0.0.1"
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
            return cls(host=text or "127.0.0.1")
        return cls(host=host.strip("[]") or "127.0.0.1", port=int(port))

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
    ) -> None:
        self.address = Address.parse(address) if isinstance(address, str) else address
        self.connection = PeerConnection(hello, codec=codec)  # msgpack, or Godot Variant as the addon speaks
        self.sock = self._connect_with_backoff(timeout_connect)
        self.sock.settimeout(timeout_recv)
        self.closed = False
        self.sock.sendall(self.connection.initial_bytes())
        welcome = self.recv()
        if not isinstance(welcome, Welcome):
            raise BrokerError(ErrorCode.UNEXPECTED_MESSAGE.value, f"expected welcome, got {welcome.TYPE}")
        self.welcome = welcome

    def _connect_with_backoff(self, timeout: float) -> socket.socket:
        deadline = time.monotonic() + timeout
        delay = 0.05
        while True:
            try:
                return _open_socket(self.address, timeout=max(0.1, min(5.0, deadline - time.monotonic())))
            except OSError as exc:
                if time.monotonic() + delay > deadline:
                    raise BrokerError(
                        "connect_failed", f"could not reach the broker at {self.address} within {timeout:.0f} s: {exc}"
                    ) from exc
                time.sleep(delay)
                delay = min(delay * 2, 1.0)

    def send(self, message: Message) -> None:
        if self.closed:
            raise BrokerError("closed", "connection is closed")
        try:
            self.sock.sendall(self.connection.send(message))
        except OSError as exc:
            raise BrokerError("connection_lost", f"lost the broker at {self.address}: {exc}") from exc

    def recv(self) -> Message:
        while True:
            try:
                message = self.connection.next_event()
            except ProtocolError as exc:
                self.close()
                raise BrokerError(exc.code.value, exc.message) from exc
            if message is not None:
                if isinstance(message, Error):
                    self.close()
                    raise BrokerError(message.code, message.message)
                if isinstance(message, Close):
                    self.close()
                    raise BrokerError("closed", message.reason or "the broker closed the connection")
                return message
            try:
                data = self.sock.recv(1 << 20)
            except TimeoutError as exc:
                raise BrokerError("timeout", f"no message from the broker at {self.address}") from exc
            except OSError as exc:
                self.close()
                raise BrokerError("connection_lost", f"lost the broker at {self.address}: {exc}") from exc
            if not data:
                self.close()
                raise BrokerError("connection_lost", f"the broker at {self.address} closed the connection")
            self.connection.receive_data(data)

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


def default_name(kind: str) -> str:
    return f"{kind}@{socket.gethostname()}:{os.getpid()}"
