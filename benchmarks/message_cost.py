"""CPU cost of the hot-path messages: construct, encode (frame bytes) and decode, per message.

``python -m benchmarks.message_cost`` prints microseconds per operation (best of ``--repeat`` rounds) for
the four messages built per step (GameStep, Batch, TrainerAct, GameActions) at two sizes. Run it before and
after a change in the same shell to compare; it measures one process on one thread.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from broker.protocol.codec import BodyKind, decode_body, encode_message_frame
from broker.protocol.framing import FrameDecoder
from broker.protocol.messages import Batch, GameActions, GameStep, StepData, TrainerAct, message_from_wire


def _step_data(n: int, width: int) -> StepData:
    return StepData(
        {"obs": np.ones((n, width), np.float32)},
        np.zeros(n, np.float32),
        np.zeros(n, np.bool_),
        np.zeros(n, np.bool_),
        frames=np.ones(n, np.int32),
    )


def builders(n: int, width: int) -> dict[str, Callable[[], Any]]:
    data = _step_data(n, width)
    actions = {"move": np.zeros((n, 2), np.float32)}
    return {
        "step": lambda: GameStep(7, {"p": _step_data(n, width)}),
        "batch": lambda: Batch(7, _step_data(n, width)),
        "act": lambda: TrainerAct(7, dict(actions)),
        "actions": lambda: GameActions(7, {"p": dict(actions)}),
        "_data": lambda: data,
    }


def _best(fn: Callable[[], Any], repeat: int, number: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - started) / number)
    return best * 1e6


def _decode(frame: bytes) -> Any:
    decoder = FrameDecoder()
    decoder.feed(frame)
    body = decoder.next_frame_view()
    assert body is not None
    return message_from_wire(decode_body(BodyKind.MSGPACK, body))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--number", type=int, default=2000)
    args = parser.parse_args()
    print(f"{'config':>8} {'message':>8} {'bytes':>8} {'build us':>9} {'encode us':>10} {'decode us':>10}")
    for n, width in ((1, 8), (400, 64)):
        for name, build in builders(n, width).items():
            if name.startswith("_"):
                continue
            message = build()
            frame = encode_message_frame(BodyKind.MSGPACK, message.to_wire())
            cost_build = _best(build, args.repeat, args.number)
            cost_encode = _best(
                lambda m=message: encode_message_frame(BodyKind.MSGPACK, m.to_wire()), args.repeat, args.number
            )
            cost_decode = _best(lambda f=frame: _decode(f), args.repeat, args.number)
            print(
                f"{n}x{width:<5} {name:>8} {len(frame):>8} {cost_build:>9.2f} {cost_encode:>10.2f} {cost_decode:>10.2f}"
            )


if __name__ == "__main__":
    main()
