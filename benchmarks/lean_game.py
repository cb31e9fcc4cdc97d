"""The native protocol's game as lean as a game can be, the counterpart of ``lean_plugin_game.py``.

A game engine builds its observations in its own code (Godot: ``var_to_bytes`` in C++), so the benchmark's game
should cost the Python side of the measurement as little as the lean plugin game costs godot_rl: every step frame
is built at start, one per phase of the staggered time limit (configs.HORIZON; the rows whose episodes end carry
their final observation), from the benchmark world stepped with zero actions. A step patches the frame's tick
(encoded as a fixed-width uint32, which msgpack allows for any value) and writes the frame with one ``sendall``;
the answer is read into a preallocated buffer and only its type is looked at (an ``error`` or ``close`` ends the
game). The world does not react to the actions, as in the lean plugin game. ``--codec godot`` writes the bodies
as Godot Variants (``var_to_bytes``), as this repository's addon does, the tick as a 64-bit int (mode
``broker_variant``).

    python -m benchmarks.lean_game --address 127.0.0.1:11008 --config JSON --game-index 0     (through a broker)
    python -m benchmarks.lean_game --raw-port P --config JSON --game-index 0                   (raw / relay ceilings)

Through a broker it says hello and reads the welcome with ``clients.game.GameClient``, then steps on its socket.
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
from typing import Final

import numpy as np

from benchmarks.configs import ACTION_KEY, ACTION_SIZE, HORIZON, BenchConfig, BenchWorld
from benchmarks.counting import CountingSocket, WireReport
from benchmarks.raw import FrameReader, connect_retry
from broker.log import configure_logging
from broker.protocol.codec import BodyKind, decode_body, encode_body
from broker.protocol.framing import HEADER
from broker.protocol.messages import GameStep

# A tick no run reaches, so msgpack writes it as uint32 (0xce + 4 bytes), a Godot Variant as a 64-bit int
# (INT with the 64-bit flag), and its place in the frame is found.
TICK_MARK: Final = 0x8000_0000
TICK_FIELDS: Final = {
    BodyKind.MSGPACK: (b"\xa4tick\xce", struct.Struct(">I")),
    BodyKind.GODOT: (b"tick\x02\x00\x01\x00", struct.Struct("<q")),
}
# The broker's and the raw trainer's actions bodies name their type in their first bytes.
TYPE_WINDOWS: Final = {BodyKind.MSGPACK: 24, BodyKind.GODOT: 40}


class StepFrames:
    """One prepared step frame (header included) per phase, with the offset of its tick's 4 bytes."""

    def __init__(self, config: BenchConfig, game_index: int, codec: BodyKind = BodyKind.MSGPACK) -> None:
        world = BenchWorld(config, game_index)
        zeros = {name: {ACTION_KEY: np.zeros((config.agents, ACTION_SIZE), np.float32)} for name in world.groups}
        prefix, self.tick = TICK_FIELDS[codec]
        field = prefix + self.tick.pack(TICK_MARK)
        self.codec = codec
        self.frames: list[bytearray] = []
        self.tick_at: list[int] = []
        for _ in range(HORIZON):
            frame = bytearray(HEADER.size) + encode_body(codec, GameStep(TICK_MARK, world.step_data()).to_wire())
            HEADER.pack_into(frame, 0, len(frame) - HEADER.size)
            at = frame.find(field)
            if at < 0 or frame.find(field, at + 1) >= 0:
                raise AssertionError("the step frame's tick is not where a lean game can patch it")
            self.frames.append(frame)
            self.tick_at.append(at + len(prefix))
            world.apply(zeros)

    def frame(self, tick: int) -> bytearray:
        phase = tick % HORIZON
        frame = self.frames[phase]
        self.tick.pack_into(frame, self.tick_at[phase], tick)
        return frame


def answered(body: memoryview, codec: BodyKind = BodyKind.MSGPACK) -> bool:
    """True for an ``actions`` answer; False for the broker's ``close`` or ``error`` (the end of the run)."""
    if b"actions" in bytes(body[: TYPE_WINDOWS[codec]]):
        return True
    message = decode_body(codec, body)
    if message.get("type") in ("close", "error"):
        return False
    raise ConnectionError(f"expected actions, got {str(message)[:120]}")


def play(sock: socket.socket, frames: StepFrames, godot_wait: bool = False) -> int:
    """Step until the other side ends the run; returns the ticks played. ``godot_wait``: wait for each answer
    as a Godot game does (``benchmarks.raw.GodotWait``), not blocked in ``recv``."""
    counter = CountingSocket(sock)
    report = WireReport(counter)
    reader = FrameReader(counter, godot_wait=godot_wait)  # type: ignore[arg-type]
    tick = 0
    try:
        while True:
            counter.sendall(frames.frame(tick))
            if not answered(reader.read_frame(), frames.codec):
                return tick
            tick += 1
            report.tick()
    except (ConnectionError, OSError):
        return tick


def through_broker(
    address: str, config: BenchConfig, game_index: int, codec: BodyKind = BodyKind.MSGPACK, godot_wait: bool = False
) -> None:
    from clients.game import GameClient

    frames = StepFrames(config, game_index, codec)
    client = GameClient(address, config.groups(), name=f"lean-game-{game_index}", codec=codec)
    sock = client.socket.sock
    sock.settimeout(None)
    try:
        play(sock, frames, godot_wait)
    finally:
        sock.close()


def raw(port: int, config: BenchConfig, game_index: int, godot_wait: bool = False) -> None:
    frames = StepFrames(config, game_index)
    sock = connect_retry(port)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(None)
    try:
        play(sock, frames, godot_wait)
    finally:
        sock.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--address", help="a broker: host:port or unix:/path")
    where.add_argument("--raw-port", type=int, help="the raw trainer's or the relay's port (no hello)")
    parser.add_argument("--config", required=True, help="a BenchConfig as JSON")
    parser.add_argument("--game-index", type=int, default=0)
    parser.add_argument("--codec", choices=("msgpack", "godot"), default="msgpack", help="godot: Variant bodies")
    parser.add_argument("--godot-wait", action="store_true", help="wait for answers as a Godot game does")
    args = parser.parse_args(argv)
    configure_logging(level="warning")
    config = BenchConfig.from_json(json.loads(args.config))
    if args.address is not None:
        through_broker(args.address, config, args.game_index, BodyKind(args.codec), args.godot_wait)
    else:
        raw(args.raw_port, config, args.game_index, args.godot_wait)


if __name__ == "__main__":
    main()
