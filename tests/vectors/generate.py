"""Writes protocol_v1.json: hex frames and what they mean, for the Python tests and the Godot addon.

Run ``python tests/vectors/generate.py`` after a deliberate wire change; tests fail while the file is
out of date. Arrays appear in ``meaning`` as ``{"__array__": {"dtype", "shape", "values"}}``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from broker.protocol import PROTOCOL_VERSION  # noqa: E402
from broker.protocol.codec import BodyKind, encode_body  # noqa: E402
from broker.protocol.connection import GREETING_ENV_INFO, GREETING_HANDSHAKE  # noqa: E402
from broker.protocol.framing import encode_frame  # noqa: E402
from broker.protocol.messages import (  # noqa: E402
    Batch,
    Close,
    Control,
    Error,
    GameActions,
    GameLayout,
    GameStep,
    Hello,
    Message,
    PolicyInfo,
    Status,
    StepData,
    StepOptions,
    TrainerAct,
    TrainerReset,
    Waiting,
    Welcome,
)
from broker.protocol.spaces import (  # noqa: E402
    BoxSpace,
    ContinuousAction,
    DiscreteAction,
    DiscreteSpace,
    GroupSpec,
    MultiDiscreteAction,
    MultiDiscreteSpace,
    PolicySpaces,
)

OUT = Path(__file__).with_name("protocol_v1.json")
OUT_GODOT = Path(__file__).with_name("protocol_v1_godot.json")  # the Godot addon's codec

PLAYER = PolicySpaces(
    (("obs", BoxSpace((3,), "float32", -1.0, 1.0)), ("camera_2d", BoxSpace((2, 2, 3), "uint8", 0.0, 255.0))),
    (("move", ContinuousAction(2)), ("jump", DiscreteAction(2))),
)
PLATFORM = PolicySpaces(
    (("obs", BoxSpace((2,), "float32", -1.0, 1.0)), ("phase", DiscreteSpace(4)), ("cell", MultiDiscreteSpace((3, 5)))),
    (("dir", DiscreteAction(3)), ("gear", MultiDiscreteAction((2, 3)))),
)


def f32(*values: Any) -> np.ndarray:
    return np.array(values, dtype=np.float32)


def messages() -> list[tuple[str, str, Message]]:
    player_step = StepData(
        obs={
            "obs": f32([0.5, -0.25, 1.0], [0.0, 0.125, -1.0]),
            "camera_2d": np.arange(24, dtype=np.uint8).reshape(2, 2, 2, 3),
        },
        reward=f32(0.5, -1.0),
        terminated=np.array([False, True]),
        truncated=np.array([False, False]),
        final_index=np.array([1], np.int32),
        final_obs={"obs": f32([0.75, 0.75, 0.75]), "camera_2d": np.full((1, 2, 2, 3), 7, np.uint8)},
        infos={1: {"is_success": True}},
    )
    platform_step = StepData(
        obs={"obs": f32([0.5, 0.5]), "phase": np.array([3], np.int32), "cell": np.array([[2, 4]], np.int32)},
        reward=f32(0.0),
        terminated=np.array([False]),
        truncated=np.array([True]),
    )
    return [
        (
            "hello_game",
            "game->broker",
            Hello(
                "game",
                PROTOCOL_VERSION,
                "level-1",
                None,
                groups=(GroupSpec("player", 2, PLAYER), GroupSpec("platform", 1, PLATFORM)),
            ),
        ),
        (
            "hello_trainer",
            "trainer->broker",
            Hello("trainer", PROTOCOL_VERSION, "ppo-player", "s3cret", policy="player"),
        ),
        (
            "hello_trainer_barrier",
            "trainer->broker",
            Hello(
                "trainer",
                PROTOCOL_VERSION,
                "eval-player",
                None,
                policy="player",
                stepping=StepOptions("barrier", 250.0, "noop"),
            ),
        ),
        ("hello_observer", "observer->broker", Hello("observer", PROTOCOL_VERSION, "status")),
        ("welcome_game", "broker->game", Welcome(PROTOCOL_VERSION, 7, 0)),
        ("welcome_trainer", "broker->trainer", Welcome(PROTOCOL_VERSION, 8)),
        (
            "step_first",
            "game->broker",
            GameStep(
                0,
                {
                    "player": StepData(
                        {"obs": f32([0.0, 0.0, 0.0], [1.0, 1.0, 1.0]), "camera_2d": np.zeros((2, 2, 2, 3), np.uint8)},
                        f32(0.0, 0.0),
                        np.array([False, False]),
                        np.array([False, False]),
                    ),
                    "platform": StepData(
                        {
                            "obs": f32([0.0, 0.0]),
                            "phase": np.array([0], np.int32),
                            "cell": np.array([[0, 0]], np.int32),
                        },
                        f32(0.0),
                        np.array([False]),
                        np.array([False]),
                    ),
                },
            ),
        ),
        ("step_with_episode_end", "game->broker", GameStep(5, {"player": player_step, "platform": platform_step})),
        (
            "actions_all_groups",
            "broker->game",
            GameActions(
                5,
                {
                    "player": {"move": f32([0.25, -1.0], [1.0, 0.0]), "jump": np.array([1, 0], np.int32)},
                    "platform": {"dir": np.array([2], np.int32), "gear": np.array([[1, 2]], np.int32)},
                },
            ),
        ),
        (
            "actions_platform_held",
            "broker->game",
            GameActions(
                6,
                {
                    "player": {"move": f32([0.0, 0.5], [-0.5, 0.0]), "jump": np.array([0, 0], np.int32)},
                },
            ),
        ),
        ("policy_info", "broker->trainer", PolicyInfo("player", 4, PLAYER, (GameLayout(0, 0, 2), GameLayout(1, 2, 2)))),
        ("waiting", "broker->trainer", Waiting("player", 1, 2, "waiting for games: 1/2")),
        ("trainer_reset", "trainer->broker", TrainerReset()),
        (
            "batch",
            "broker->trainer",
            Batch(
                12,
                StepData(
                    obs={
                        "obs": f32([0.5, -0.25, 1.0], [0.0, 0.125, -1.0]),
                        "camera_2d": np.arange(24, dtype=np.uint8).reshape(2, 2, 2, 3),
                    },
                    reward=f32(0.5, -1.0),
                    terminated=np.array([False, True]),
                    truncated=np.array([False, False]),
                    final_index=np.array([1], np.int32),
                    final_obs={"obs": f32([0.75, 0.75, 0.75]), "camera_2d": np.full((1, 2, 2, 3), 7, np.uint8)},
                    infos={1: {"is_success": True}},
                    frames=np.array([1, 3], np.int32),
                ),
            ),
        ),
        (
            "act",
            "trainer->broker",
            TrainerAct(12, {"move": f32([0.25, -1.0], [1.0, 0.0]), "jump": np.array([1, 0], np.int32)}),
        ),
        ("status", "broker->observer", Status({"games": [{"slot": 0, "name": "level-1"}], "uptime_s": 1.5})),
        ("error_version", "broker->peer", Error("version_mismatch", "peer speaks protocol 2, this broker speaks 1")),
        ("close", "either", Close("broker shutting down")),
        # game-claiming samplers (docs/protocol.md, "Samplers")
        ("hello_sampler", "sampler->broker", Hello("sampler", PROTOCOL_VERSION, "rllib-runner-1", claim_games=2)),
        ("hello_sampler_all", "sampler->broker", Hello("sampler", PROTOCOL_VERSION, "runner", claim_games="all")),
        (
            "batch_to_sampler",
            "broker->sampler",
            Batch(3, StepData({"obs": f32([0.5, 0.0])}, f32(1.0), np.array([False]), np.array([True])), "platform"),
        ),
        ("act_from_sampler", "sampler->broker", TrainerAct(3, {"dir": np.array([2], np.int32)}, "platform")),
        ("error_no_free_game", "broker->sampler", Error("no_free_game", "claim of 2 games: 1 free")),
        ("control", "control->broker", Control("freeze", {"group": "blue", "path": "/models/blue.onnx"})),
        (
            "control_team_change",
            "control->broker",
            Control(
                "team_change",
                {
                    "team": "player",
                    "partner": "platform",
                    "pool": "/runs/pool-player",
                    "every": 2000,
                    "detached": False,
                },
            ),
        ),
    ]


def meaning(value: Any) -> Any:
    """The wire map made JSON-friendly: arrays shown with their values, bytes never appear raw."""
    if isinstance(value, dict):
        if set(value) == {"dtype", "shape", "data"}:
            array = np.frombuffer(bytes(value["data"]), dtype=value["dtype"]).reshape(value["shape"])
            return {"__array__": {"dtype": value["dtype"], "shape": value["shape"], "values": array.tolist()}}
        return {str(k): meaning(v) for k, v in value.items()}
    if isinstance(value, list):
        return [meaning(v) for v in value]
    return value


def build(codec: BodyKind = BodyKind.MSGPACK) -> dict[str, Any]:
    vectors: list[dict[str, Any]] = [
        {
            "name": "greeting_handshake",
            "direction": "broker->peer",
            "codec": "json",
            "hex": encode_frame(json.dumps(GREETING_HANDSHAKE).encode()).hex(),
            "meaning": GREETING_HANDSHAKE,
        },
        {
            "name": "greeting_env_info",
            "direction": "broker->peer",
            "codec": "json",
            "hex": encode_frame(json.dumps(GREETING_ENV_INFO).encode()).hex(),
            "meaning": GREETING_ENV_INFO,
        },
    ]
    for name, direction, message in messages():
        wire = message.to_wire()
        vectors.append(
            {
                "name": name,
                "direction": direction,
                "codec": codec.value,
                "hex": encode_frame(encode_body(codec, wire)).hex(),
                "meaning": meaning(wire),
            }
        )
    return {"protocol": PROTOCOL_VERSION, "frame": "u32 little-endian body length, then the body", "vectors": vectors}


def render() -> str:
    return json.dumps(build(), indent=1) + "\n"


def render_godot() -> str:
    """The same messages in the Godot addon's codec: Variant bodies as ``var_to_bytes`` writes them."""
    return json.dumps(build(BodyKind.GODOT), indent=1) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
    OUT_GODOT.write_text(render_godot())
    print(f"wrote {OUT_GODOT}")
