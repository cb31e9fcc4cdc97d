"""The raw ceiling: a game and a trainer exchanging the protocol's own step/actions bytes directly.

One hop, no broker, no hub, no typed messages: the trainer listens, each game connects and sends its
``step`` frames (byte-identical to ``GameStep.to_wire()`` packed with msgpack, checked at start), the
trainer answers each with an ``actions`` frame. Frames are read into a preallocated buffer and arrays
are ``numpy.frombuffer`` views: this is as little as Python can do per step with these bytes.

    python -m benchmarks.raw trainer --port P --config JSON ...   (prints JSON lines)
    python -m benchmarks.raw game --port P --config JSON --game-index I
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
import time
from typing import Any, Final

import msgpack
import numpy as np

from benchmarks.configs import ACTION_KEY, ACTION_SIZE, MIN_STEPS, BenchConfig, BenchWorld, GroupWorld
from benchmarks.counting import CountingSocket, WireReport
from benchmarks.measure import Meter, emit
from broker.protocol.codec import pack
from broker.protocol.framing import encode_frame
from broker.protocol.messages import GameStep

try:
    from clients.transport import SPIN_WAIT_S, SpinWait
except ImportError:  # an older tree under benchmarks/ab_core.py: its peers wait blocking, and so do these
    SPIN_WAIT_S = 0.0  # type: ignore[misc]

HEADER: Final = struct.Struct("<I")


def _array(array: np.ndarray) -> dict[str, Any]:
    return {"dtype": array.dtype.name, "shape": list(array.shape), "data": array.data.cast("B")}


def _group_wire(group: GroupWorld) -> dict[str, Any]:
    wire: dict[str, Any] = {
        "obs": {key: _array(value) for key, value in group.obs.items()},
        "reward": _array(group.reward),
        "terminated": _array(group.terminated),
        "truncated": _array(group.truncated),
    }
    if group.final_index is not None and group.final_obs is not None and len(group.final_index):
        wire["final"] = {
            "index": _array(group.final_index),
            "obs": {key: _array(value) for key, value in group.final_obs.items()},
        }
    return wire


def _step_map(world: BenchWorld) -> dict[str, Any]:
    return {"type": "step", "tick": world.tick, "groups": {name: _group_wire(g) for name, g in world.groups.items()}}


def step_frame(world: BenchWorld) -> bytes:
    body = msgpack.packb(_step_map(world), use_bin_type=True)
    return HEADER.pack(len(body)) + body


def send_step(sock: Any, world: BenchWorld, packer: msgpack.Packer) -> None:
    """The step frame with no intermediate copies: packed into a reused buffer, header and body written by
    one ``sendmsg`` (gather) call. Same bytes as ``step_frame``."""
    packer.pack(_step_map(world))
    try:
        with packer.getbuffer() as body:
            send_parts(sock, [memoryview(HEADER.pack(len(body))), body])
    finally:
        packer.reset()


def send_parts(sock: Any, parts: list[memoryview]) -> None:
    """``sendall`` for several buffers: one gather write, repeated only if the kernel took part of it."""
    while parts:
        sent = sock.sendmsg(parts)
        while sent:
            if sent >= len(parts[0]):
                sent -= len(parts.pop(0))
            else:
                parts[0] = parts[0][sent:]
                sent = 0


def actions_frame(tick: int, actions: dict[str, np.ndarray]) -> bytes:
    body = msgpack.packb(
        {"type": "actions", "tick": tick, "groups": {name: {ACTION_KEY: _array(a)} for name, a in actions.items()}},
        use_bin_type=True,
    )
    return HEADER.pack(len(body)) + body


def check_same_bytes(world: BenchWorld) -> None:
    """The ceiling must carry exactly what the broker's game carries."""
    if step_frame(world) != encode_frame(pack(GameStep(world.tick, world.step_data()).to_wire())):
        raise AssertionError("raw step frame differs from the protocol's GameStep encoding")


def new_spin_wait(spin_s: float = SPIN_WAIT_S) -> SpinWait | None:
    """A wait that polls first, as the broker's clients and the broker wait; None: plain blocking reads."""
    return SpinWait(spin_s) if spin_s > 0 else None


GODOT_POLL_S: Final = 10e-6  # OS.delay_usec(10) between looks at an empty socket (sync.gd, broker_client.gd)


class GodotWait:
    """How a Godot game waits for its actions: godot_rl's ``sync.gd`` and this repository's ``broker_client.gd``
    look at the socket without blocking and sleep ``OS.delay_usec(10)`` while it is empty. The sleep lasts what
    the kernel makes of it (with Linux's default 50 us timer slack, and a halted core woken by its timer, much
    longer than 10 us), so an answer waits until the game looks again, and its sender wakes no one."""

    def __init__(self, poll_s: float = GODOT_POLL_S) -> None:
        self.poll_s = poll_s

    def recv_into(self, sock: socket.socket, buffer: memoryview | bytearray) -> int:
        while True:
            try:
                return sock.recv_into(buffer, 0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                time.sleep(self.poll_s)


def recv_exactly(sock: socket.socket, view: memoryview, first: SpinWait | GodotWait | None = None) -> None:
    """Fill ``view`` from ``sock``, blocking; its first read waits by ``first`` when given."""
    got = 0
    while got < len(view):
        n = first.recv_into(sock, view[got:]) if first is not None and not got else sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed the connection")
        got += n


class FrameReader:
    """Blocking reads of whole frames into one preallocated, growing buffer. With ``spin_wait_s``, the wait
    for a frame's first bytes first asks without sleeping, as the broker's clients do
    (``clients.transport.SpinWait``); with ``godot_wait``, it looks and sleeps as a Godot game does
    (``GodotWait``)."""

    def __init__(
        self, sock: socket.socket, capacity: int = 1 << 16, spin_wait_s: float = 0.0, godot_wait: bool = False
    ) -> None:
        self.sock = sock
        self.buffer = bytearray(capacity)
        self.header = bytearray(HEADER.size)
        # How a frame's first bytes are waited for (the rest of a frame is already on its way: read blocking).
        self.first_wait: SpinWait | GodotWait | None = GodotWait() if godot_wait else new_spin_wait(spin_wait_s)

    def read_frame(self) -> memoryview:
        """The next frame's body, a view of the buffer (valid until the next read)."""
        recv_exactly(self.sock, memoryview(self.header), self.first_wait)
        (length,) = HEADER.unpack(self.header)
        if length > len(self.buffer):
            self.buffer = bytearray(max(length, 2 * len(self.buffer)))
        view = memoryview(self.buffer)[:length]
        recv_exactly(self.sock, view)
        return view

    def read(self) -> Any:
        return msgpack.unpackb(self.read_frame(), raw=False, strict_map_key=False)


def _view(wire: dict[str, Any]) -> np.ndarray:
    return np.frombuffer(wire["data"], dtype=wire["dtype"]).reshape(wire["shape"])


def connect_retry(port: int, timeout: float = 60.0) -> socket.socket:
    """Connect to a listener that may not be up yet."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=5)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def run_game(port: int, config: BenchConfig, game_index: int) -> None:
    world = BenchWorld(config, game_index)
    check_same_bytes(world)
    raw_sock = connect_retry(port)
    raw_sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    raw_sock.settimeout(None)
    sock = CountingSocket(raw_sock)
    report = WireReport(sock)
    reader = FrameReader(sock)  # type: ignore[arg-type]
    packer = msgpack.Packer(use_bin_type=True, autoreset=False)
    try:
        while True:
            send_step(sock, world, packer)
            message = reader.read()
            groups = message["groups"]
            world.apply({name: {ACTION_KEY: _view(g[ACTION_KEY])} for name, g in groups.items()})
            report.tick()
    except (ConnectionError, OSError):
        return
    finally:
        sock.close()


def run_trainer(port: int, config: BenchConfig, warmup_s: float, measure_s: float) -> None:
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(config.games)
    emit({"event": "ready"})
    listener.settimeout(60)
    games: list[tuple[socket.socket, FrameReader]] = []
    for _ in range(config.games):
        sock, _ = listener.accept()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(None)
        # The trainer waits as the broker's trainers do (BrokerVecEnv's PeerSocket), so that a ratio against
        # the ceilings is the broker's cost alone.
        games.append((sock, FrameReader(sock, spin_wait_s=SPIN_WAIT_S)))
    listener.close()
    rng = np.random.default_rng(0)
    actions = {
        name: rng.uniform(-1, 1, (config.agents, ACTION_SIZE)).astype(np.float32) for name in config.policy_names
    }
    meter = Meter(warmup_s, measure_s, MIN_STEPS, config.agents_per_step, "raw")
    for _, reader in games:
        _decode_step(reader.read())
    tick = 0
    try:
        while True:
            started = time.perf_counter()
            frame = actions_frame(tick, actions)
            for sock, _ in games:
                sock.sendall(frame)
            for _, reader in games:
                _decode_step(reader.read())
            tick += 1
            meter.record(started, time.perf_counter())
    except (ConnectionError, OSError):
        return


def _decode_step(message: dict[str, Any]) -> None:
    for group in message["groups"].values():
        decode_group(group)


def decode_group(group: dict[str, Any]) -> None:
    """One group of a step as arrays (views of the frame): the raw trainer's work on it."""
    for wire in group["obs"].values():
        _view(wire)
    _view(group["reward"])
    _view(group["terminated"])
    _view(group["truncated"])
    final = group.get("final")
    if final is not None:
        _view(final["index"])
        for wire in final["obs"].values():
            _view(wire)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("role", choices=("game", "trainer"))
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--config", required=True, help="a BenchConfig as JSON")
    parser.add_argument("--game-index", type=int, default=0)
    parser.add_argument("--warmup", type=float, default=0.5)
    parser.add_argument("--measure", type=float, default=2.0)
    args = parser.parse_args()
    config = BenchConfig.from_json(json.loads(args.config))
    if args.role == "game":
        run_game(args.port, config, args.game_index)
    else:
        run_trainer(args.port, config, args.warmup, args.measure)


if __name__ == "__main__":
    main()
