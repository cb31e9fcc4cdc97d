"""The hot-path codec today (msgpack-python + ``messages.py``'s ``to_wire`` / ``from_wire``) against msgspec
``Struct``s on the same msgpack bytes: a game's ``step``, a trainer's ``act`` and the broker's ``batch``.

    python -m benchmarks.codec_compare [--configs 1x8,16x64,400x64] [--repeat 7] [--markdown]

``AxF`` is A agents with F float32 observations each (one observation key, one continuous action key of
2 floats, as benchmarks/configs.py). For each message and size it prints the microseconds per message of:

* ``encode``: message object -> msgpack body (``pack(msg.to_wire())`` against ``msgspec.msgpack.Encoder``);
* ``decode``: body -> validated message with numpy arrays (``message_from_wire(unpack(body))``, whose checks
  are the broker's: dtypes, shapes against byte counts, finite rewards, info contents), against msgspec's
  typed decode into frozen Structs plus the same array checks (``np.frombuffer`` views);
* msgspec alone: encoding a Struct that is already built (as it would be if the messages were Structs), and
  the typed decode with no numpy views and no array checks (what msgspec does by itself).

Both sides read and write the same bytes (checked before timing: each decodes the other's encoding to equal
arrays), so the wire format is unchanged. Timings are the best of ``--repeat`` runs in one process; compare
the ratio column, not the absolute numbers, on a shared machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from broker.protocol.arrays import DTYPES
from broker.protocol.codec import pack, unpack
from broker.protocol.errors import ErrorCode, RemoteProtocolError
from broker.protocol.messages import Batch, GameStep, StepData, TrainerAct, message_from_wire
from broker.protocol.spaces import check_finite
from broker.tuning import tune_allocator

try:
    import msgspec
except ImportError:  # pragma: no cover - msgspec is not a dependency of the broker
    sys.exit("benchmarks.codec_compare needs msgspec (pip install msgspec)")

POLICY = "p"
OBS_KEY = "obs"
ACTION_KEY = "move"
ACTION_SIZE = 2


# --- the same messages as msgspec Structs (wire-compatible: maps with the same keys) --------------


class WireArray(msgspec.Struct, frozen=True):
    dtype: str
    shape: list[int]
    data: bytes  # decoded as bytes; encoding takes the array's memoryview as it is (no copy)


class WireFinal(msgspec.Struct, frozen=True):
    index: WireArray
    obs: dict[str, WireArray]


class WireStepData(msgspec.Struct, frozen=True, omit_defaults=True):
    obs: dict[str, WireArray]
    reward: WireArray
    terminated: WireArray
    truncated: WireArray
    final: WireFinal | None = None
    infos: dict[int, dict[str, Any]] = {}
    frames: WireArray | None = None


class WireGameStep(msgspec.Struct, frozen=True, tag_field="type", tag="step"):
    tick: int
    groups: dict[str, WireStepData]


class WireTrainerAct(msgspec.Struct, frozen=True, tag_field="type", tag="act"):
    step: int
    actions: dict[str, WireArray]


class WireBatch(msgspec.Struct, frozen=True, omit_defaults=True, tag_field="type", tag="batch"):
    step: int
    obs: dict[str, WireArray]
    reward: WireArray
    terminated: WireArray
    truncated: WireArray
    final: WireFinal | None = None
    infos: dict[int, dict[str, Any]] = {}
    frames: WireArray | None = None


WireMessage = WireGameStep | WireTrainerAct | WireBatch
ENCODER = msgspec.msgpack.Encoder()
DECODER = msgspec.msgpack.Decoder(WireMessage)


def wire_array(array: np.ndarray) -> WireArray:
    return WireArray(array.dtype.name, list(array.shape), array.data.cast("B") if array.size else b"")


def numpy_view(array: WireArray, what: str) -> np.ndarray:
    """The check ``arrays.decode_array`` makes that a schema cannot: the bytes match dtype and shape."""
    dtype = DTYPES.get(array.dtype)
    if dtype is None:
        raise RemoteProtocolError(ErrorCode.MALFORMED, f"{what}: unknown dtype {array.dtype}")
    count = 1
    for d in array.shape:
        if d < 0:
            raise RemoteProtocolError(ErrorCode.MALFORMED, f"{what}: bad shape {array.shape}")
        count *= d
    if len(array.data) != count * dtype.itemsize:
        raise RemoteProtocolError(ErrorCode.MALFORMED, f"{what}: shape {array.shape} does not match its bytes")
    return np.frombuffer(array.data, dtype).reshape(array.shape)


def step_data_from_struct(data: WireStepData | WireBatch, what: str) -> StepData:
    """The rest of ``StepData.from_wire``'s checks (final rows and infos are empty on this hot path)."""
    reward = numpy_view(data.reward, f"{what}.reward")
    terminated = numpy_view(data.terminated, f"{what}.terminated")
    truncated = numpy_view(data.truncated, f"{what}.truncated")
    if reward.ndim != 1 or reward.dtype != np.float32:
        raise RemoteProtocolError(ErrorCode.MALFORMED, f"{what}.reward must be a 1-d float32 array")
    check_finite(reward, f"{what}.reward", ErrorCode.BAD_STEP)
    n = reward.shape[0]
    for name, flags in (("terminated", terminated), ("truncated", truncated)):
        if flags.shape != (n,) or flags.dtype != np.bool_:
            raise RemoteProtocolError(ErrorCode.MALFORMED, f"{what}.{name} must be a bool array of shape [{n}]")
    obs = {key: numpy_view(array, f"{what}.obs.{key}") for key, array in data.obs.items()}
    for key, array in obs.items():
        if array.ndim < 1 or array.shape[0] != n:
            raise RemoteProtocolError(ErrorCode.MALFORMED, f"{what}.obs.{key} must have {n} rows like reward")
    return StepData(obs, reward, terminated, truncated, infos=dict(data.infos))


def struct_to_message(wire: WireMessage) -> GameStep | TrainerAct | Batch:
    if isinstance(wire, WireGameStep):
        groups = {name: step_data_from_struct(d, f"step.groups.{name}") for name, d in wire.groups.items()}
        return GameStep(wire.tick, groups)
    if isinstance(wire, WireTrainerAct):
        return TrainerAct(wire.step, {k: numpy_view(a, f"act.actions.{k}") for k, a in wire.actions.items()})
    return Batch(wire.step, step_data_from_struct(wire, "batch"))


def struct_step_data(data: StepData) -> dict[str, Any]:
    return {
        "obs": {k: wire_array(v) for k, v in data.obs.items()},
        "reward": wire_array(data.reward),
        "terminated": wire_array(data.terminated),
        "truncated": wire_array(data.truncated),
    }


def message_to_struct(message: GameStep | TrainerAct | Batch) -> WireMessage:
    if isinstance(message, GameStep):
        groups = {k: WireStepData(**struct_step_data(v)) for k, v in message.groups.items()}
        return WireGameStep(message.tick, groups)
    if isinstance(message, TrainerAct):
        return WireTrainerAct(message.step, {k: wire_array(v) for k, v in message.actions.items()})
    return WireBatch(message.step, **struct_step_data(message.data))


# --- the measured messages ------------------------------------------------------------------------


def sample_messages(agents: int, floats: int) -> dict[str, GameStep | TrainerAct | Batch]:
    rng = np.random.default_rng(0)
    data = StepData(
        {OBS_KEY: rng.standard_normal((agents, floats)).astype(np.float32)},
        rng.standard_normal(agents).astype(np.float32),
        np.zeros(agents, np.bool_),
        np.zeros(agents, np.bool_),
    )
    actions = {ACTION_KEY: rng.uniform(-1, 1, (agents, ACTION_SIZE)).astype(np.float32)}
    return {"step": GameStep(7, {POLICY: data}), "act": TrainerAct(7, actions), "batch": Batch(7, data)}


def arrays_of(message: GameStep | TrainerAct | Batch) -> list[np.ndarray]:
    if isinstance(message, TrainerAct):
        return list(message.actions.values())
    data = message.groups[POLICY] if isinstance(message, GameStep) else message.data
    return [*data.obs.values(), data.reward, data.terminated, data.truncated]


def check_same_bytes_meaning(message: GameStep | TrainerAct | Batch) -> None:
    """Each codec reads what the other wrote, to the same arrays: the wire format does not change."""
    ours = pack(message.to_wire())  # type: ignore[union-attr]
    theirs = ENCODER.encode(message_to_struct(message))
    for decoded in (message_from_wire(unpack(theirs)), struct_to_message(DECODER.decode(ours))):
        assert type(decoded) is type(message)
        for a, b in zip(arrays_of(decoded), arrays_of(message), strict=True):
            np.testing.assert_array_equal(a, b)


def best_us(fn: Callable[[], Any], repeat: int) -> float:
    """Best of ``repeat`` runs, each long enough (>= 20 ms) to time, in microseconds of CPU per call (CPU
    time, not wall time: other processes on a shared machine then cost less noise)."""
    number = 1
    while True:
        start = time.process_time()
        for _ in range(number):
            fn()
        if time.process_time() - start >= 0.02:
            break
        number *= 2
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        for _ in range(number):
            fn()
        best = min(best, (time.process_time() - start) / number)
    return best * 1e6


def measure(configs: list[tuple[int, int]], repeat: int) -> list[dict[str, Any]]:
    rows = []
    for agents, floats in configs:
        for name, message in sample_messages(agents, floats).items():
            check_same_bytes_meaning(message)
            body = pack(message.to_wire())  # type: ignore[union-attr]
            struct = message_to_struct(message)
            present = {
                "encode": best_us(lambda m=message: pack(m.to_wire()), repeat),  # type: ignore[misc]
                "decode": best_us(lambda b=body: message_from_wire(unpack(b)), repeat),
            }
            candidate = {
                "encode": best_us(lambda m=message: ENCODER.encode(message_to_struct(m)), repeat),  # type: ignore[misc]
                "decode": best_us(lambda b=body: struct_to_message(DECODER.decode(b)), repeat),
                "typed": best_us(lambda b=body: DECODER.decode(b), repeat),
            }
            rows.append(
                {
                    "config": f"{agents}x{floats}",
                    "message": name,
                    "bytes": len(body),
                    "present": present,
                    "msgspec": candidate,
                    "struct_encode_only": best_us(lambda s=struct: ENCODER.encode(s), repeat),
                }
            )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| config | message | bytes | encode: msgpack+to_wire / msgspec (ratio) | "
        "decode: msgpack+from_wire / msgspec+checks (ratio) | msgspec alone: encode a built Struct, typed decode |",
        "|---|---|---:|---|---|---|",
    ]
    for row in rows:
        p, m = row["present"], row["msgspec"]
        lines.append(
            f"| {row['config']} | {row['message']} | {row['bytes']:,} | "
            f"{p['encode']:.1f} / {m['encode']:.1f} us ({p['encode'] / m['encode']:.1f}x) | "
            f"{p['decode']:.1f} / {m['decode']:.1f} us ({p['decode'] / m['decode']:.1f}x) | "
            f"{row['struct_encode_only']:.1f} us, {m['typed']:.1f} us |"
        )
    return "\n".join(lines)


def parse_configs(text: str) -> list[tuple[int, int]]:
    configs = []
    for part in text.split(","):
        agents, _, floats = part.strip().partition("x")
        configs.append((int(agents), int(floats)))
    return configs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.codec_compare", description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="1x8,16x64,400x64", help="AGENTSxFLOATS, comma-separated")
    parser.add_argument("--repeat", type=int, default=7, help="timed runs per figure; the best is kept")
    args = parser.parse_args(argv)
    tune_allocator()  # as the broker and its clients do: 100 KB bodies then do not hit the heap-trim path
    rows = measure(parse_configs(args.configs), args.repeat)
    print(f"msgpack-python {'.'.join(map(str, __import__('msgpack').version))}, msgspec {msgspec.__version__}")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
