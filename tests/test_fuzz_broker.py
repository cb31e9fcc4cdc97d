"""Fuzzing the broker's message handling (tests/test_framing.py fuzzes the frame and connection decoders).

Hypothesis builds message maps, mostly plausible and then bent (wrong ticks, shapes, dtypes, keys,
missing fields), plus raw bytes, and feeds them as one peer's stream into the broker while a good game
and trainer share the hub:

* sans-IO: a ``BrokerConnection`` and the ``Hub`` with fake links. Only RemoteProtocolError may escape,
  from the decoders or from the hub.
* the server's own ``PeerProtocol`` over a fake transport (msgpack, Godot Variant and godot_rl JSON
  bodies, the JSON with hostile tokens: 400-digit integers, lone surrogates, NaN, numeric strings, nesting
  past every limit): no input may reach its "internal error" path, every error frame it writes carries a
  known code, and error frames and log lines stay under 1 KiB.

Every message the hub sends to a fake link must be encodable as msgpack, Godot Variant and godot_rl JSON:
whatever a peer got accepted (infos with uint64 or deep nesting, say) would otherwise cut another peer.

After every example the hub is consistent: the fuzzed peer's session is released, the good pair steps on,
and the slot or policy the fuzzed peer used serves an honest peer again.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import structlog
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.core.sessions import GameSession, TrainerSession
from broker.legacy.wire import encode_message
from broker.protocol import PROTOCOL_VERSION, variant
from broker.protocol.arrays import DTYPES
from broker.protocol.codec import BodyKind, body_kind, decode_body, encode_body
from broker.protocol.connection import BrokerConnection, LegacyMessage
from broker.protocol.errors import ErrorCode, LocalProtocolError, RemoteProtocolError
from broker.protocol.framing import encode_frame
from broker.protocol.messages import (
    Batch,
    Close,
    Error,
    GameActions,
    GameStep,
    Hello,
    Message,
    StepData,
    TrainerAct,
    TrainerReset,
)
from broker.protocol.spaces import BoxSpace, ContinuousAction, DiscreteAction, GroupSpec, PolicySpaces
from broker.server.config import ServerConfig
from broker.server.peer import PeerProtocol
from broker.server.server import BrokerServer
from tests.hub_driver import LinkHub as Hub

GOOD = PolicySpaces((("obs", BoxSpace((3,), "float32", -5.0, 5.0)),), (("pick", DiscreteAction(3)),))
OTHER = PolicySpaces((("obs", BoxSpace((2,), "float32", -5.0, 5.0)),), (("move", ContinuousAction(2)),))
SUPPRESSED = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]


def fuzz(examples: int) -> settings:
    return settings(max_examples=examples, deadline=None, suppress_health_check=SUPPRESSED)


KNOWN_CODES = {code.value for code in ErrorCode}


class FakeLink:
    def __init__(self, label: str) -> None:
        self.label = label
        self.sent: list[Message] = []
        self.closed_with: Error | Close | bool | None = False

    def send(self, message: Message) -> None:
        """Whatever the hub sends must be encodable in every codec a real peer might speak."""
        wire = message.to_wire()
        encode_body(BodyKind.MSGPACK, wire)
        encode_body(BodyKind.GODOT, wire)
        encode_message(wire)  # godot_rl JSON (what the adapters forward of a batch: its infos)
        self.sent.append(message)

    def close(self, error: Error | Close | None = None) -> None:
        self.closed_with = error

    def last(self, kind: type) -> Any:
        return next((m for m in reversed(self.sent) if isinstance(m, kind)), None)


def rows(n: int, width: int, value: float = 0.5) -> StepData:
    no = np.zeros(n, np.bool_)
    return StepData({"obs": np.full((n, width), value, np.float32)}, np.zeros(n, np.float32), no, no.copy())


@dataclass
class World:
    """A hub with two slots. Slot 0: the good game and its trainer, between ticks (tick 1 comes next).
    Slot 1 has the layout {"other": 2}: free, or (``occupied``) held by a game that sent tick 0."""

    hub: Hub
    good_game: GameSession
    good_game_link: FakeLink
    good_trainer: TrainerSession
    good_trainer_link: FakeLink
    other_game: GameSession | None = None
    other_game_link: FakeLink | None = None
    links: list[FakeLink] = field(default_factory=list)

    @classmethod
    def make(cls, hub: Hub | None = None, occupied: bool = False) -> World:
        hub = hub or Hub(expected_games=2)
        game_link, trainer_link, first_link = FakeLink("good-game"), FakeLink("good-trainer"), FakeLink("first")
        game = hub.add_game(game_link, Hello("game", PROTOCOL_VERSION, "good", groups=(GroupSpec("good", 2, GOOD),)))
        first = hub.add_game(
            first_link, Hello("game", PROTOCOL_VERSION, "first", groups=(GroupSpec("other", 2, OTHER),))
        )
        hub.remove_game(first)  # slot 1 keeps its layout
        trainer = hub.add_trainer(trainer_link, Hello("trainer", PROTOCOL_VERSION, "t", policy="good"))
        hub.game_step(game, GameStep(0, {"good": rows(2, 3)}))
        hub.trainer_reset(trainer)
        batch = trainer_link.last(Batch)
        hub.trainer_act(trainer, TrainerAct(batch.step, {"pick": np.array([0, 2], np.int32)}))
        assert game_link.last(GameActions).tick == 0
        world = cls(hub, game, game_link, trainer, trainer_link)
        if occupied:
            world.other_game_link = FakeLink("other-game")
            world.other_game = hub.add_game(world.other_game_link, other_game_hello())
            hub.game_step(world.other_game, GameStep(0, {"other": rows(2, 2)}))
        return world

    def check(self, role: str | None) -> None:
        """The good pair steps on, and what the fuzzed peer used serves an honest peer."""
        hub = self.hub
        hub.game_step(self.good_game, GameStep(1, {"good": rows(2, 3, 1.0)}))
        batch = self.good_trainer_link.last(Batch)
        assert batch is not None and batch.data.obs["obs"][0, 0] == 1.0
        hub.trainer_act(self.good_trainer, TrainerAct(batch.step, {"pick": np.array([1, 1], np.int32)}))
        assert self.good_game_link.last(GameActions).tick == 1
        assert set(hub.trainers) <= {"good"} and hub.trainers["good"] is self.good_trainer
        assert hub.snapshot()
        if role == "trainer":  # the policy is free again, and its open batch waits for the next trainer
            assert self.other_game is not None and self.other_game_link is not None
            link = FakeLink("honest-trainer")
            trainer = hub.add_trainer(link, Hello("trainer", PROTOCOL_VERSION, "h", policy="other"))
            hub.trainer_reset(trainer)
            open_batch = link.last(Batch)
            # The fuzzed trainer may have answered its batch: then the game's next steps make the next one
            # (a batch needs a tick after the answered actions reached the game).
            for _ in range(2):
                if open_batch is not None:
                    break
                hub.game_step(self.other_game, GameStep(self.other_game.next_tick, {"other": rows(2, 2)}))
                open_batch = link.last(Batch)
            assert open_batch is not None
            hub.trainer_act(trainer, TrainerAct(open_batch.step, {"move": np.zeros((2, 2), np.float32)}))
            assert self.other_game_link.last(GameActions) is not None
        else:  # slot 1 is free again
            assert hub.slots[1].game is None
            link = FakeLink("honest-game")
            game = hub.add_game(link, other_game_hello())
            hub.game_step(game, GameStep(0, {"other": rows(2, 2)}))
            assert link.last(GameActions) is not None  # "other" has no trainer: held, answered at once


def other_game_hello() -> Hello:
    return Hello("game", PROTOCOL_VERSION, "other", groups=(GroupSpec("other", 2, OTHER),))


# --- strategies ------------------------------------------------------------------------------------


def wire_array(array: np.ndarray) -> dict[str, Any]:
    """The wire's array map, built here (empty arrays included) so the decoders get every shape."""
    little = array.astype(array.dtype.newbyteorder("<"))
    return {"dtype": array.dtype.name, "shape": list(array.shape), "data": little.tobytes()}


DTYPE_NAMES = [*DTYPES, "complex64", "float16", ""]
wire_ints = st.integers(-(2**63), 2**64 - 1)  # what msgpack can carry


@st.composite
def arrays(draw: st.DrawFn) -> Any:
    """An array map: a real encoded array of any dtype and small shape, or a bent one."""
    if draw(st.booleans()):
        dtype = draw(st.sampled_from(list(DTYPES)))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        raw = draw(st.binary(min_size=0, max_size=256))
        size = int(np.prod(shape)) * DTYPES[dtype].itemsize
        data = (raw * (size // max(len(raw), 1) + 1))[:size] if raw else bytes(size)
        return wire_array(np.frombuffer(data, DTYPES[dtype]).reshape(shape))
    return draw(
        st.fixed_dictionaries(
            {},
            optional={
                "dtype": st.sampled_from(DTYPE_NAMES) | wire_ints,
                "shape": st.lists(st.integers(-2, 6), max_size=9) | wire_ints | st.none(),
                "data": st.binary(max_size=64) | st.text(max_size=8),
            },
        )
    )


scalars = st.none() | st.booleans() | wire_ints | st.floats() | st.text(max_size=12)
values = st.recursive(
    scalars | st.binary(max_size=32) | arrays(),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6) | st.integers(-3, 5), inner, max_size=4)
    ),
    max_leaves=12,
)


@st.composite
def deep_values(draw: st.DrawFn) -> Any:
    """A value nested 10 to 40 levels deep in lists and maps: past what an info may hold, or a codec."""
    value: Any = draw(scalars)
    for _ in range(draw(st.integers(10, 40))):
        value = [value] if draw(st.booleans()) else {draw(st.text(max_size=2)): value}
    return value


info_values = values | deep_values() | st.integers(2**63, 2**64 - 1)


@st.composite
def plausible_rows(draw: st.DrawFn, n_default: int = 2, width_default: int = 2) -> Any:
    """Step data for the "other" group, usually right, often bent in one or two places."""
    n = draw(st.sampled_from([n_default] * 4 + [0, 1, 3]))
    width = draw(st.sampled_from([width_default] * 4 + [1, 3]))
    dtype = draw(st.sampled_from(["float32"] * 4 + ["float64", "int32", "uint8"]))
    obs = np.asarray(draw(st.lists(st.floats(width=32), min_size=n * width, max_size=n * width)), dtype=np.float64)
    with np.errstate(all="ignore"):
        obs_array = obs.reshape(n, width).astype(dtype)
    wire: dict[str, Any] = {
        "obs": {"obs": wire_array(obs_array)},
        "reward": wire_array(np.zeros(n, np.float32)),
        "terminated": wire_array(np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)), np.bool_)),
        "truncated": wire_array(np.zeros(n, np.bool_)),
    }
    if draw(st.booleans()):
        index = draw(st.lists(st.integers(-1, n + 1), max_size=3))
        final = np.zeros((len(index), draw(st.sampled_from([width, width + 1]))), np.float32)
        wire["final"] = {"index": wire_array(np.array(index, np.int32)), "obs": {"obs": wire_array(final)}}
    if draw(st.booleans()):
        info = st.dictionaries(
            st.text(max_size=3) | st.integers(-3, 3) | st.binary(max_size=2), info_values, max_size=3
        )
        wire["infos"] = draw(st.dictionaries(st.integers(-1, n + 1) | st.text(max_size=3), info | values, max_size=3))
    if draw(st.booleans()):
        wire["frames"] = wire_array(np.array(draw(st.lists(st.integers(-1, 5), min_size=n, max_size=n)), np.int32))
    if draw(st.integers(0, 5)) == 0:  # one field replaced by anything
        wire[draw(st.sampled_from(sorted(wire)))] = draw(values)
    return wire


@st.composite
def plausible_step(draw: st.DrawFn) -> dict[str, Any]:
    groups = {draw(st.sampled_from(["other"] * 6 + ["good", "ghost"])): draw(plausible_rows())}
    if draw(st.integers(0, 6)) == 0:
        groups[draw(st.text(max_size=4))] = draw(plausible_rows())
    return {"type": "step", "tick": draw(st.integers(0, 2) | st.integers(-2, 2**40)), "groups": groups}


@st.composite
def plausible_act(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(st.sampled_from([2, 2, 2, 0, 1, 3]))
    width = draw(st.sampled_from([2, 2, 2, 1, 3]))
    dtype = draw(st.sampled_from(["float32", "float32", "float64", "int32", "int64", "bool", "uint8"]))
    fill = draw(st.floats(allow_nan=True, allow_infinity=True))
    with np.errstate(all="ignore"):
        action = np.full((n, width), fill).astype(dtype)
    actions: dict[str, Any] = {draw(st.sampled_from(["move"] * 5 + ["pick", ""])): wire_array(action)}
    if draw(st.integers(0, 5)) == 0:
        actions = draw(st.dictionaries(st.text(max_size=4), arrays(), max_size=3))
    return {"type": "act", "step": draw(st.integers(0, 3) | st.integers(-5, 2**40)), "actions": actions}


wild_maps = st.fixed_dictionaries(
    {"type": st.sampled_from(["hello", "step", "reset", "act", "close", "batch", "welcome", "error", "dance"])},
    optional={
        k: values
        for k in ("protocol", "role", "name", "token", "groups", "policy", "tick", "step", "actions", "stepping")
    },
)
messages = st.one_of(
    plausible_step(),
    plausible_act(),
    st.just({"type": "reset"}),
    st.just({"type": "close", "reason": "fuzz"}),
    wild_maps,
)
prefixes = st.sampled_from(["game", "trainer", "taken", "none"])


def hello_for(prefix: str) -> dict[str, Any] | None:
    if prefix == "game":
        return other_game_hello().to_wire()
    if prefix == "trainer":
        return Hello("trainer", PROTOCOL_VERSION, "fuzz", policy="other").to_wire()
    if prefix == "taken":
        return Hello("trainer", PROTOCOL_VERSION, "fuzz", policy="good").to_wire()
    return None


def stream(prefix: str, maps: list[Any], tail: bytes = b"", godot: bool = False) -> bytes:
    """The frames of one peer: msgpack bodies, or (``godot``) Godot Variant ones where Variant can carry
    the map (else msgpack, which that peer may not switch to)."""
    hello = hello_for(prefix)
    bodies = ([hello] if hello else []) + maps
    return b"".join(encode_frame(body_of(m, godot)) for m in bodies) + tail


def body_of(message: Any, godot: bool) -> bytes:
    if godot:
        try:
            return variant.encode(message)
        except (LocalProtocolError, TypeError, ValueError):
            pass
    return bytes(msgpack.packb(message, use_bin_type=True))


def role_of(prefix: str) -> str | None:
    return "trainer" if prefix == "trainer" else None


# --- sans-IO: connection + hub ----------------------------------------------------------------------


class SansIOPeer:
    """What PeerProtocol does with one connection, minus the socket: decode, dispatch, release."""

    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        self.connection = BrokerConnection(max_frame_bytes=1 << 16)
        self.link = FakeLink("fuzz")
        self.game: GameSession | None = None
        self.trainer: TrainerSession | None = None
        self.refused: RemoteProtocolError | None = None

    def feed(self, data: bytes, chunk: int) -> None:
        try:
            for i in range(0, len(data), chunk):
                self.connection.receive_data(data[i : i + chunk])
                while (event := self.connection.next_event()) is not None:
                    if not self.dispatch(event):
                        return
        except RemoteProtocolError as exc:  # the only exception allowed out of decoders and hub
            assert exc.code.value in KNOWN_CODES
            self.refused = exc
        finally:
            self.release()

    def dispatch(self, event: Message | LegacyMessage) -> bool:
        hub = self.hub
        if isinstance(event, Hello):
            if event.role == "game":
                self.game = hub.add_game(self.link, event)
            elif event.role == "trainer":
                self.trainer = hub.add_trainer(self.link, event)
            else:
                return False  # an observer gets its status and leaves
        elif isinstance(event, GameStep):
            assert self.game is not None
            hub.game_step(self.game, event)
        elif isinstance(event, TrainerAct):
            assert self.trainer is not None
            hub.trainer_act(self.trainer, event)
        elif isinstance(event, TrainerReset):
            assert self.trainer is not None
            hub.trainer_reset(self.trainer)
        elif isinstance(event, (Close, LegacyMessage)):
            return False  # a goodbye; godot_rl JSON is the server-level test's business
        return True

    def release(self) -> None:
        """The connection is gone (PeerProtocol.connection_lost)."""
        if self.game is not None:
            self.hub.remove_game(self.game)
        if self.trainer is not None:
            self.hub.remove_trainer(self.trainer)


@fuzz(1200)
@given(prefixes, st.lists(messages, max_size=6), st.integers(1, 64), st.booleans())
def test_message_maps_through_connection_and_hub(prefix: str, maps: list[Any], chunk: int, godot: bool) -> None:
    with structlog.testing.capture_logs():  # quiet: thousands of examples
        world = World.make(occupied=prefix == "trainer")
        SansIOPeer(world.hub).feed(stream(prefix, maps, godot=godot), chunk)
        world.check(role_of(prefix))


@fuzz(1000)
@given(prefixes, st.binary(max_size=200), st.integers(1, 32))
def test_random_bytes_after_a_hello(prefix: str, tail: bytes, chunk: int) -> None:
    with structlog.testing.capture_logs():
        world = World.make(occupied=prefix == "trainer")
        SansIOPeer(world.hub).feed(stream(prefix, [], tail), chunk)
        world.check(role_of(prefix))


# --- the server's PeerProtocol ------------------------------------------------------------------------


class FakeTransport:
    def __init__(self) -> None:
        self.written = bytearray()
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 40000)}.get(name, default)

    def get_write_buffer_size(self) -> int:
        return 0


def read_into_protocol(protocol: PeerProtocol, data: bytes, read_size: int) -> list[memoryview]:
    """Deliver ``data`` as a transport reads: at most ``read_size`` bytes a time, into the protocol's buffer
    (``get_buffer``/``buffer_updated``). Returns the buffers it was given, one per read."""
    given: list[memoryview] = []
    pos = 0
    while pos < len(data):
        buffer = protocol.get_buffer(-1)
        n = min(len(buffer), read_size, len(data) - pos)
        buffer[:n] = data[pos : pos + n]
        given.append(buffer)
        protocol.buffer_updated(n)
        pos += n
    return given


def written_frames(data: bytes) -> list[bytes]:
    frames, offset = [], 0
    while offset + 4 <= len(data):
        (length,) = np.frombuffer(data, "<u4", 1, offset)
        frames.append(data[offset + 4 : offset + 4 + int(length)])
        offset += 4 + int(length)
    assert offset == len(data), "the broker wrote a partial frame"
    return frames


def legacy_bodies() -> st.SearchStrategy[bytes]:
    """JSON as a godot_rl plugin game sends it: env_info, then steps; plausible or bent."""
    env_info = st.fixed_dictionaries(
        {"type": st.sampled_from(["env_info", "step", "call", "dance"])},
        optional={
            "observation_space": st.just({"obs": {"size": [2], "space": "box"}}) | values,
            "action_space": st.just({"move": {"size": 2, "action_type": "continuous"}}) | values,
            "n_agents": st.integers(-1, 3) | values,
            "agent_policy_names": st.just(["other", "other"]) | values,
            "obs": values,
            "reward": values,
            "done": values,
            "returns": values,
        },
    )

    def encode(obj: Any) -> bytes:
        return json.dumps(obj, default=repr).encode("ascii")

    return env_info.map(encode) | st.binary(max_size=40).map(lambda b: b"{" + b)


def legacy_streams() -> st.SearchStrategy[list[bytes]]:
    return st.lists(legacy_bodies(), max_size=3) | legacy_session()


HOSTILE_JSON = [
    "1" * 400,
    str(10**30),
    str(2**63),
    '"\\ud800"',
    '"\\udfff x"',
    '"1.5"',
    "NaN",
    "Infinity",
    "-1e400",
    "1e300",
    "[" * 40 + "1" + "]" * 40,
    "[" * 50_000,
    "{}",
    "0.5",
    "true",
]
json_tokens = st.sampled_from(HOSTILE_JSON) | st.floats(-10, 10).map(repr) | st.integers(-3, 2**40).map(str)


@st.composite
def legacy_session(draw: st.DrawFn) -> list[bytes]:
    """A plugin game's env_info, reset and step replies as JSON text, with hostile tokens where any JSON
    value may go: huge or 400-digit integers, lone surrogates (in keys, values and policy names), numeric
    strings, NaN and infinities, nesting beyond every limit."""
    token = draw(json_tokens)
    name = draw(st.sampled_from(['"other"'] * 4 + ['"\\ud800"', token]))
    env_info = (
        '{"type": "env_info", "n_agents": 2, '
        '"observation_space": {"obs": {"size": [2], "space": "box", "low": -5.0, "high": 5.0}}, '
        '"action_space": {"move": {"size": 2, "action_type": "continuous"}}, '
        f'"agent_policy_names": [{name}, {name}]}}'
    )

    def obs() -> str:
        return f'[{{"obs": [{draw(json_tokens)}, 0.5]}}, {{"obs": [0.5, 0.5]}}]'

    bodies = [env_info, f'{{"type": "reset", "obs": {obs()}}}']
    for _ in range(draw(st.integers(0, 3))):
        key = draw(st.sampled_from(['"k"', '"\\ud800"', '"TimeLimit.truncated"']))
        info = f"[{{{key}: {draw(json_tokens)}}}, {{}}]"
        reward = f"[{draw(json_tokens)}, 0.0]"
        bodies.append(f'{{"type": "step", "obs": {obs()}, "reward": {reward}, "done": [false, false], "info": {info}}}')
    return [body.encode("ascii") for body in bodies]


async def _through_peer_protocol(world: World, data: bytes, chunk: int) -> tuple[PeerProtocol, FakeTransport]:
    server = BrokerServer(ServerConfig(port=0, status_interval=0, max_frame_bytes=1 << 16), hub=world.hub)
    protocol = PeerProtocol(server)
    transport = FakeTransport()
    protocol.connection_made(transport)  # type: ignore[arg-type]
    read_into_protocol(protocol, data, chunk)
    protocol.connection_lost(None)
    return protocol, transport


@fuzz(1000)
@given(
    prefixes,
    st.lists(messages, max_size=5),
    legacy_streams(),
    st.booleans(),
    st.integers(1, 64),
    st.booleans(),
)
def test_peer_protocol_never_fails_internally(
    prefix: str, maps: list[Any], legacy: list[bytes], as_legacy: bool, chunk: int, godot: bool
) -> None:
    role = None if as_legacy else role_of(prefix)
    with structlog.testing.capture_logs():
        world = World.make(occupied=role == "trainer")
    data = b"".join(encode_frame(body) for body in legacy) if as_legacy else stream(prefix, maps, godot=godot)
    with structlog.testing.capture_logs() as logs:
        _, transport = asyncio.run(_through_peer_protocol(world, data, chunk))
    assert not [e for e in logs if e["log_level"] in ("error", "critical") or e["event"] == "internal error"], logs
    assert all(len(repr(e)) <= 1024 for e in logs if e["event"] == "peer error"), logs  # never the value whole
    for body in written_frames(bytes(transport.written)):
        if body[:1] != b"{":
            message = decode_body(body_kind(body), body)
            if message.get("type") == "error":
                assert message["code"] in KNOWN_CODES and message["code"] != "internal", message
                assert len(body) <= 1024, message
    with structlog.testing.capture_logs():
        world.check(role)
