"""Count the bytes a game exchanges, for "bytes per step": a socket proxy, and periodic reports."""

from __future__ import annotations

import socket
from typing import Any, Protocol

from benchmarks.measure import emit

REPORT_EVERY = 64  # ticks between reports, after the first reports at ticks 1, 2, 4, ... 64


class CountingSocket:
    """Forwards everything to a socket; counts bytes through recv/recv_into/sendall."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.bytes_in = 0
        self.bytes_out = 0

    def recv(self, size: int, *flags: int) -> bytes:
        data = self._sock.recv(size, *flags)
        self.bytes_in += len(data)
        return data

    def recv_into(self, buffer: Any, *args: int) -> int:
        n = self._sock.recv_into(buffer, *args)
        self.bytes_in += n
        return n

    def sendall(self, data: Any, *flags: int) -> None:
        self._sock.sendall(data, *flags)
        self.bytes_out += memoryview(data).nbytes

    def sendmsg(self, buffers: list[Any], *args: Any) -> int:
        sent = self._sock.sendmsg(buffers, *args)
        self.bytes_out += sent
        return sent

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class ByteCounts(Protocol):
    @property
    def bytes_in(self) -> int: ...

    @property
    def bytes_out(self) -> int: ...


class WireReport:
    """Cumulative bytes and ticks as JSON lines, at ticks 1, 2, 4, ... then every REPORT_EVERY ticks."""

    def __init__(self, counter: ByteCounts) -> None:
        self.counter = counter
        self.ticks = 0

    def tick(self) -> None:
        self.ticks += 1
        if self.ticks % REPORT_EVERY == 0 or (self.ticks & (self.ticks - 1)) == 0:
            emit(
                {
                    "event": "wire",
                    "ticks": self.ticks,
                    "bytes_in": self.counter.bytes_in,
                    "bytes_out": self.counter.bytes_out,
                }
            )
