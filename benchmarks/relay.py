"""The two-hop ceiling: a relay that forwards the raw ceiling's frames between games and trainer, doing nothing else.

    python -m benchmarks.relay --port A --trainer-port B --games G      (prints {"event": "ready"} once listening)

Games connect to the relay as they would to a broker; for each, the relay opens its own connection to the
raw trainer (``benchmarks.raw trainer`` on B). Then, lock-step as the raw ceiling is: read every game's
step frame and write it on to the trainer, read every actions frame and write it back. Each frame is read
whole (header, then body) into one preallocated buffer and written with one ``sendall``; nothing is decoded.
Any broker must do at least this per step, so raw (one hop) and relay (two hops) bracket what a broker can
reach.
"""

from __future__ import annotations

import argparse
import socket
import struct
from typing import Final

from benchmarks.measure import emit
from benchmarks.raw import connect_retry

HEADER: Final = struct.Struct("<I")


class Forwarder:
    """Moves whole frames from one socket to another through a buffer reused for every frame."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        self.buffer = bytearray(capacity)

    @staticmethod
    def _fill(sock: socket.socket, view: memoryview) -> None:
        got = 0
        while got < len(view):
            n = sock.recv_into(view[got:])
            if n == 0:
                raise ConnectionError("peer closed the connection")
            got += n

    def forward(self, source: socket.socket, sink: socket.socket) -> None:
        self._fill(source, memoryview(self.buffer)[: HEADER.size])
        (length,) = HEADER.unpack_from(self.buffer)
        total = HEADER.size + length
        if total > len(self.buffer):
            grown = bytearray(max(total, 2 * len(self.buffer)))
            grown[: HEADER.size] = self.buffer[: HEADER.size]
            self.buffer = grown
        frame = memoryview(self.buffer)[:total]
        self._fill(source, frame[HEADER.size :])
        sink.sendall(frame)


def nodelay(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(None)
    return sock


def run(port: int, trainer_port: int, games: int) -> None:
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(games)
    emit({"event": "ready"})
    listener.settimeout(60)
    pairs: list[tuple[socket.socket, socket.socket]] = []
    for _ in range(games):
        game, _ = listener.accept()
        pairs.append((nodelay(game), nodelay(connect_retry(trainer_port))))
    listener.close()
    forwarder = Forwarder()
    try:
        while True:
            for game, trainer in pairs:
                forwarder.forward(game, trainer)
            for game, trainer in pairs:
                forwarder.forward(trainer, game)
    except (ConnectionError, OSError):
        return
    finally:
        for game, trainer in pairs:
            game.close()
            trainer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True, help="where the games connect")
    parser.add_argument("--trainer-port", type=int, required=True, help="where the raw trainer listens")
    parser.add_argument("--games", type=int, default=1)
    args = parser.parse_args()
    run(args.port, args.trainer_port, args.games)


if __name__ == "__main__":
    main()
