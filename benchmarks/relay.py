"""The two-hop ceiling: a relay that forwards the raw ceiling's frames between games and trainer, doing nothing else.

    python -m benchmarks.relay --port A --trainer-port B --games G      (prints {"event": "ready"} once listening)

Games connect to the relay as they would to a broker; for each, the relay opens its own connection to the
raw trainer (``benchmarks.raw trainer`` on B). Then, lock-step as the raw ceiling is: read every game's
step frame and write it on to the trainer, read every actions frame and write it back. Each frame is read
whole (header, then body) into one preallocated buffer and written with one ``sendall``; nothing is decoded.
Any broker must do at least this per step, so raw (one hop) and relay (two hops) bracket what a broker can
reach. The relay waits for each frame as the broker does, polling for a while before it sleeps (``SpinWait``
here, ``LoopSpinner`` with ``--asyncio``; the raw trainer waits as the broker's trainers do): the ceilings
then differ from the broker by its work alone, not by how it waits.

    python -m benchmarks.relay --port A --trainer-port B --games G --asyncio     (mode relay_asyncio)

``--asyncio`` forwards the same frames from a uvloop event loop instead, as the broker's server reads and
writes: one ``asyncio.Protocol`` per socket, each frame written whole with one ``transport.write``. It is
what an asyncio broker costs at least, so the broker's distance from it is its own work per message, not the
event loop's.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import struct
from typing import Final, cast

import uvloop

from benchmarks.measure import emit
from benchmarks.raw import connect_retry, new_spin_wait, recv_exactly

try:
    from broker.server.spinning import LoopSpinner
except ImportError:  # an older tree under benchmarks/ab_core.py, whose broker's loop sleeps at once
    LoopSpinner = None  # type: ignore[assignment,misc]

HEADER: Final = struct.Struct("<I")


class Forwarder:
    """Moves whole frames from one socket to another through a buffer reused for every frame."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        self.buffer = bytearray(capacity)
        self.spin_wait = new_spin_wait()  # a frame's first bytes are waited for as the broker waits

    def forward(self, source: socket.socket, sink: socket.socket) -> None:
        recv_exactly(source, memoryview(self.buffer)[: HEADER.size], self.spin_wait)
        (length,) = HEADER.unpack_from(self.buffer)
        total = HEADER.size + length
        if total > len(self.buffer):
            grown = bytearray(max(total, 2 * len(self.buffer)))
            grown[: HEADER.size] = self.buffer[: HEADER.size]
            self.buffer = grown
        frame = memoryview(self.buffer)[:total]
        recv_exactly(source, frame[HEADER.size :])
        sink.sendall(frame)


def nodelay(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(None)
    return sock


def connect_pairs(port: int, trainer_port: int, games: int) -> list[tuple[socket.socket, socket.socket]]:
    """Each game's connection, and the relay's own one to the trainer for it, in the order games come."""
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
    return pairs


class FrameRelay(asyncio.Protocol):
    """One side of a pair: whole frames from this socket are written to the other side's transport."""

    def __init__(self, lost: asyncio.Future[None], spinner: LoopSpinner | None) -> None:
        self.lost = lost
        self.spinner = spinner
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.other: FrameRelay | None = None
        self.transport: asyncio.Transport | None = None
        self.pending = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is one, without subclassing it

    def data_received(self, data: bytes) -> None:
        if self.spinner is not None:  # the loop polls for a while for the next message, as the broker's does
            self.spinner.message_came()
        if self.other is None or self.other.transport is None:  # before the pair is joined: kept until then
            self.pending += data
            return
        out = self.other.transport
        if not self.pending and len(data) >= HEADER.size and HEADER.unpack_from(data)[0] + HEADER.size == len(data):
            out.write(data)  # the usual case: one read, one whole frame
            return
        pending = self.pending
        pending += data
        while len(pending) >= HEADER.size:
            total = HEADER.size + HEADER.unpack_from(pending)[0]
            if len(pending) < total:
                break
            out.write(bytes(pending[:total]))
            del pending[:total]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed.set_result(None)
        if not self.lost.done():
            self.lost.set_result(None)


async def _relay_asyncio(pairs: list[tuple[socket.socket, socket.socket]]) -> None:
    loop = asyncio.get_running_loop()
    lost: asyncio.Future[None] = loop.create_future()
    spinner = LoopSpinner(loop) if LoopSpinner is not None else None
    sides: list[FrameRelay] = []
    for game, trainer in pairs:
        game.setblocking(False)
        trainer.setblocking(False)
        _, game_side = await loop.connect_accepted_socket(lambda: FrameRelay(lost, spinner), game)
        _, trainer_side = await loop.connect_accepted_socket(lambda: FrameRelay(lost, spinner), trainer)
        game_side.other, trainer_side.other = trainer_side, game_side
        sides += (game_side, trainer_side)
        game_side.data_received(b"")  # anything the game sent meanwhile
    await lost  # one peer gone: the measurement is over
    for side in sides:  # every transport closed while the loop still runs, so none outlives it
        if side.transport is not None:
            side.transport.close()
    await asyncio.gather(*(side.closed for side in sides))


def run_asyncio(port: int, trainer_port: int, games: int) -> None:
    uvloop.run(_relay_asyncio(connect_pairs(port, trainer_port, games)))


def run(port: int, trainer_port: int, games: int) -> None:
    pairs = connect_pairs(port, trainer_port, games)
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
    parser.add_argument("--asyncio", action="store_true", help="forward from a uvloop event loop (relay_asyncio)")
    args = parser.parse_args()
    (run_asyncio if args.asyncio else run)(args.port, args.trainer_port, args.games)


if __name__ == "__main__":
    main()
