"""The godot_rl adapters without sockets: JSON bytes in, typed messages out, and back."""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
import pytest

from broker.legacy.godot_rl_game import GodotRlGame, Phase
from broker.legacy.godot_rl_trainer import (
    ActionRequest,
    CallRequest,
    CloseRequest,
    EnvInfoRequest,
    GodotRlTrainer,
    ResetRequest,
)
from broker.legacy.wire import MessageDecoder, encode_message, godot_spaces, policy_spaces_from_godot
from broker.protocol.errors import ErrorCode, RemoteProtocolError
from broker.protocol.messages import Batch, GameActions, GameLayout, GameStep, Hello, PolicyInfo, StepData
from broker.protocol.spaces import (
    BoxSpace,
    ContinuousAction,
    DiscreteAction,
    DiscreteSpace,
    MultiDiscreteAction,
    PolicySpaces,
)

MOVE_JUMP = {"move": {"size": 2, "action_type": "continuous"}, "jump": {"size": 2, "action_type": "discrete"}}
TURN = {"turn": {"size": 3, "action_type": "discrete"}}
OBS_CAM = {"obs": {"size": [3], "space": "box"}, "cam_2d": {"size": [3, 2, 2], "space": "box"}}
OBS_PLAIN = {"obs": {"size": [2], "space": "box"}, "side": {"size": 3, "space": "discrete"}}


def frame_body(data: bytes) -> dict[str, Any]:
    (length,) = struct.unpack_from("<I", data)
    assert length == len(data) - 4  # one frame, length in bytes
    body: dict[str, Any] = json.loads(data[4:].decode("ascii"))
    return body


def image_hex(first: int) -> str:
    return bytes([first, *range(1, 12)]).hex()


def interleaved_game() -> tuple[GodotRlGame, Hello]:
    """Four agents in Godot order a, b, a, b: 'a' sees a camera and acts move+jump, 'b' turns."""
    game = GodotRlGame("test game")
    hello = game.receive(
        {
            "type": "env_info",
            "observation_space": [OBS_CAM, OBS_PLAIN, OBS_CAM, OBS_PLAIN],
            "action_space": [MOVE_JUMP, TURN, MOVE_JUMP, TURN],
            "n_agents": 4,
            "agent_policy_names": ["a", "b", "a", "b"],
        }
    )
    assert isinstance(hello, Hello)
    return game, hello


def obs_rows(tick: int) -> list[dict[str, Any]]:
    return [
        {"obs": [0.0, 0.1, tick], "cam_2d": image_hex(0)},
        {"obs": [1.0, 1.1], "side": 2},
        {"obs": [2.0, 2.1, tick], "cam_2d": image_hex(2)},
        {"obs": [3.0, 3.1], "side": 0.0},  # Godot's JSON writes some integers as floats
    ]


def started_game() -> GodotRlGame:
    game, _ = interleaved_game()
    game.reset_request()
    step = game.receive({"type": "reset", "obs": obs_rows(0), "info": [{}] * 4})
    assert isinstance(step, GameStep) and step.tick == 0
    return game


def test_frames_are_what_godot_rl_python_writes() -> None:
    assert encode_message({"type": "reset"}) == b'\x11\x00\x00\x00{"type": "reset"}'
    data = encode_message({"type": "x", "name": "caf\u00e9"})  # non-ASCII goes out escaped
    assert data[4:] == b'{"type": "x", "name": "caf\\u00e9"}' and frame_body(data)["name"] == "caf\u00e9"


def test_env_info_splits_agents_into_policies_in_godot_order() -> None:
    game, hello = interleaved_game()
    assert hello.role == "game" and [g.policy for g in hello.groups] == ["a", "b"]
    assert [g.n_agents for g in hello.groups] == [2, 2]
    assert [g.agents for g in game.groups] == [(0, 2), (1, 3)]
    a, b = (g.spaces for g in hello.groups)
    assert a.observation == (
        ("obs", BoxSpace((3,), "float32", -1.0, 1.0)),
        ("cam_2d", BoxSpace((3, 2, 2), "uint8", 0.0, 255.0)),
    )
    assert a.action == (("move", ContinuousAction(2)), ("jump", DiscreteAction(2)))
    assert b.observation[1] == ("side", DiscreteSpace(3)) and b.action == (("turn", DiscreteAction(3)),)
    assert game.phase is Phase.READY
    assert game.reset_request() == encode_message({"type": "reset"})


def test_box_bounds_from_newer_plugins_are_kept() -> None:
    spaces = policy_spaces_from_godot({"obs": {"size": [2], "space": "box", "low": 0, "high": 5}}, TURN, "t")
    assert spaces.observation == (("obs", BoxSpace((2,), "float32", 0.0, 5.0)),)


def test_older_plugins_single_dict_spaces_and_no_policy_names() -> None:
    game = GodotRlGame()
    hello = game.receive({"type": "env_info", "observation_space": OBS_PLAIN, "action_space": TURN, "n_agents": 3})
    assert isinstance(hello, Hello)
    assert [(g.policy, g.n_agents) for g in hello.groups] == [("shared_policy", 3)]
    game.reset_request()
    rows = [{"obs": [i, -i], "side": i} for i in range(3)]
    game.receive({"type": "reset", "obs": rows})
    game.actions_request(GameActions(0, {"shared_policy": {"turn": np.array([0, 1, 2], np.int32)}}))
    step = game.receive({"type": "step", "obs": rows, "reward": [1, 2, 3], "done": [0, 0, 1]})  # no info
    assert isinstance(step, GameStep) and step.tick == 1
    data = step.groups["shared_policy"]
    assert data.reward.tolist() == [1.0, 2.0, 3.0] and data.terminated.tolist() == [False, False, True]
    assert data.obs["side"].dtype == np.int32 and data.obs["side"].tolist() == [0, 1, 2]


def test_reset_reply_is_tick_zero_and_images_are_decoded_from_hex() -> None:
    game, _ = interleaved_game()
    game.reset_request()
    step = game.receive({"type": "reset", "obs": obs_rows(0), "info": [{"ignored": 1}] * 4})
    assert isinstance(step, GameStep) and step.tick == 0
    a = step.groups["a"]
    assert a.obs["cam_2d"].dtype == np.uint8 and a.obs["cam_2d"].shape == (2, 3, 2, 2)
    assert a.obs["cam_2d"].reshape(2, -1).tolist() == [[0, *range(1, 12)], [2, *range(1, 12)]]
    assert a.obs["obs"].dtype == np.float32 and a.obs["obs"][:, 0].tolist() == [0.0, 2.0]
    assert a.reward.tolist() == [0.0, 0.0] and not a.infos  # godot_rl discards the reset info too
    assert step.groups["b"].obs["side"].tolist() == [2, 0]


def test_actions_go_out_per_agent_in_godot_order_with_godot_key_order() -> None:
    game = started_game()
    data = game.actions_request(
        GameActions(
            0,
            {
                "a": {"move": np.array([[0.5, -1.0], [0.25, 0.0]], np.float32), "jump": np.array([1, 0], np.int32)},
                "b": {"turn": np.array([2, 1], np.int32)},
            },
        )
    )
    expected = (
        '{"type": "action", "action": [{"move": [0.5, -1.0], "jump": 1}, {"turn": 2}, '
        '{"move": [0.25, 0.0], "jump": 0}, {"turn": 1}]}'
    )
    assert data[4:].decode("ascii") == expected and struct.unpack_from("<I", data)[0] == len(expected)
    assert game.phase is Phase.AWAIT_STEP


def test_held_groups_repeat_their_last_actions_zeros_before_the_first() -> None:
    game = started_game()
    only_b = GameActions(0, {"b": {"turn": np.array([2, 1], np.int32)}})
    first = frame_body(game.actions_request(only_b))["action"]
    assert first[0] == {"move": [0.0, 0.0], "jump": 0} and first[2] == {"move": [0.0, 0.0], "jump": 0}
    game.receive({"type": "step", "obs": obs_rows(1), "reward": [0] * 4, "done": [False] * 4, "info": [{}] * 4})
    both = GameActions(
        1,
        {
            "a": {"move": np.array([[0.5, 0.5], [-0.5, 1.0]], np.float32), "jump": np.array([1, 1], np.int32)},
            "b": {"turn": np.array([0, 0], np.int32)},
        },
    )
    game.actions_request(both)
    game.receive({"type": "step", "obs": obs_rows(2), "reward": [0] * 4, "done": [False] * 4, "info": [{}] * 4})
    only_a = GameActions(2, {"a": {"move": np.zeros((2, 2), np.float32), "jump": np.zeros(2, np.int32)}})
    third = frame_body(game.actions_request(only_a))["action"]
    assert third[1] == {"turn": 0} and third[3] == {"turn": 0}  # b held: its last actions, spelled out
    assert third[0] == {"move": [0.0, 0.0], "jump": 0}


def test_done_is_terminated_unless_info_says_time_limit_and_terminal_obs_becomes_final() -> None:
    game = started_game()
    game.actions_request(GameActions(0, {}))
    terminal = {"obs": [9.0, 9.0, 9.0], "cam_2d": image_hex(9)}
    step = game.receive(
        {
            "type": "step",
            "obs": obs_rows(1),
            "reward": [0.5, -1, 0, 2],
            "done": [True, True, False, True],
            "info": [
                {"terminal_observation": terminal, "TimeLimit.truncated": True},
                {"is_success": True},
                {},
                {"TimeLimit.truncated": True},
            ],
        }
    )
    assert isinstance(step, GameStep) and step.tick == 1
    a, b = step.groups["a"], step.groups["b"]
    assert a.truncated.tolist() == [True, False] and a.terminated.tolist() == [False, False]
    assert a.final_index is not None and a.final_index.tolist() == [0]
    assert a.final_obs is not None and a.final_obs["cam_2d"].reshape(-1)[0] == 9
    assert a.final_obs["obs"].tolist() == [[9.0, 9.0, 9.0]] and not a.infos
    assert b.terminated.tolist() == [True, False] and b.truncated.tolist() == [False, True]
    assert b.infos == {0: {"is_success": True}} and b.final_index is None
    assert b.reward.dtype == np.float32 and b.reward.tolist() == [-1.0, 2.0]


def env_info(observation: Any, action: Any, n: int) -> dict[str, Any]:
    return {"type": "env_info", "observation_space": observation, "action_space": action, "n_agents": n}


@pytest.mark.parametrize(
    ("message", "code"),
    [
        (env_info([], [], 0), ErrorCode.BAD_HELLO),  # no agent in training mode
        (env_info([OBS_PLAIN], [TURN], 2), ErrorCode.BAD_HELLO),  # lists shorter than n_agents
        ({**env_info([OBS_PLAIN], [TURN], 1), "agent_policy_names": [""]}, ErrorCode.BAD_HELLO),
        (env_info({"o": {"size": [2], "space": "sphere"}}, TURN, 1), ErrorCode.BAD_SPACES),
        (env_info(OBS_PLAIN, {"x": {"size": 2, "action_type": "x"}}, 1), ErrorCode.BAD_SPACES),
        (env_info([OBS_PLAIN, OBS_CAM], [TURN, TURN], 2), ErrorCode.BAD_SPACES),  # one policy, two spaces
        ({"type": "reset", "obs": []}, ErrorCode.UNEXPECTED_MESSAGE),
        ({"kind": "env_info"}, ErrorCode.MALFORMED),
    ],
)
def test_bad_env_info_is_the_games_fault(message: dict[str, Any], code: ErrorCode) -> None:
    with pytest.raises(RemoteProtocolError) as caught:
        GodotRlGame().receive(message)
    assert caught.value.code is code


@pytest.mark.parametrize(
    "change",
    [
        {"obs": obs_rows(1)[:3]},
        {"reward": [0, 0, "x", 0]},
        {"done": [False] * 3},
        {"info": [{}] * 3},
        {"obs": [*obs_rows(1)[:3], {"obs": [3.0, 3.1]}]},  # missing key
        {"obs": [{"obs": [0.0, 0.1, 0.0], "cam_2d": "zz" * 12}, *obs_rows(1)[1:]]},  # not hex
        {"obs": [{"obs": [0.0, 0.1, 0.0], "cam_2d": "00"}, *obs_rows(1)[1:]]},  # short image
        {"obs": [*obs_rows(1)[:3], {"obs": [3.0, 3.1], "side": 1.5}]},  # discrete must be integral
        {"reward": [0, 0, float("nan"), 0]},
    ],
)
def test_bad_step_replies_are_the_games_fault(change: dict[str, Any]) -> None:
    game = started_game()
    game.actions_request(GameActions(0, {}))
    reply = {"type": "step", "obs": obs_rows(1), "reward": [0] * 4, "done": [False] * 4, "info": [{}] * 4, **change}
    with pytest.raises(RemoteProtocolError) as caught:
        game.receive(reply)
    assert caught.value.code is ErrorCode.BAD_STEP


def test_a_game_must_not_speak_out_of_turn() -> None:
    game = started_game()
    with pytest.raises(RemoteProtocolError, match="must wait for a command"):
        game.receive({"type": "step", "obs": obs_rows(1), "reward": [0] * 4, "done": [False] * 4})


def test_call_request_and_reply() -> None:
    game = started_game()
    assert game.can_call
    assert frame_body(game.call_request("ping")) == {"type": "call", "method": "ping"}
    result = game.receive({"type": "call", "returns": [1, 2, 3, 4, 5]})
    assert result.method == "ping" and result.returns == [1, 2, 3, 4, 5]  # type: ignore[union-attr]
    assert game.phase is Phase.AWAIT_ACTIONS
    assert frame_body(game.close_request()) == {"type": "close"}


# --- the broker as a game, for a godot_rl trainer -----------------------------------------------


def picker_spaces() -> PolicySpaces:
    return PolicySpaces(
        (
            ("obs", BoxSpace((2,), "float32", -2.0, 2.0)),
            ("side", DiscreteSpace(3)),
            ("eye_2d", BoxSpace((1, 2, 2), "uint8", 0.0, 255.0)),
        ),
        (("move", ContinuousAction(2)), ("jump", DiscreteAction(2))),
    )


def feed(session: GodotRlTrainer, *messages: dict[str, Any]) -> list[Any]:
    for message in messages:
        session.receive_data(encode_message(message))
    events = []
    while (event := session.next_event()) is not None:
        events.append(event)
    return events


def batch(step: int, terminated: list[bool], truncated: list[bool], final: bool) -> Batch:
    obs: dict[str, np.ndarray] = {
        "obs": np.array([[0.5, -0.5], [1.5, 0.0]], np.float32),
        "side": np.array([2, 0], np.int32),
        "eye_2d": np.arange(8, dtype=np.uint8).reshape(2, 1, 2, 2),
    }
    final_index: np.ndarray | None = None
    final_obs: dict[str, np.ndarray] | None = None
    if final:
        final_index = np.array([1], np.int32)
        final_obs = {
            "obs": np.array([[9.0, 9.0]], np.float32),
            "side": np.array([1], np.int32),
            "eye_2d": np.full((1, 1, 2, 2), 7, np.uint8),
        }
    data = StepData(
        obs,
        np.array([0.25, -1.0], np.float32),
        np.array(terminated),
        np.array(truncated),
        final_index,
        final_obs,
        {0: {"is_success": np.bool_(True)}},
    )
    return Batch(step, data)


def running_trainer() -> GodotRlTrainer:
    session = GodotRlTrainer("picker")
    handshake = {"type": "handshake", "major_version": "0", "minor_version": "7"}
    assert feed(session, handshake, {"type": "env_info"}) == [EnvInfoRequest()]
    info = PolicyInfo("picker", 2, picker_spaces(), (GameLayout(0, 0, 2),))
    reply = frame_body(session.env_info_reply(info))
    assert reply == {
        "type": "env_info",
        "observation_space": [
            {
                "obs": {"size": [2], "space": "box", "low": -2.0, "high": 2.0},
                "side": {"size": 3, "space": "discrete"},
                "eye_2d": {"size": [1, 2, 2], "space": "box"},
            }
        ]
        * 2,
        "action_space": [
            {"move": {"size": 2, "action_type": "continuous"}, "jump": {"size": 2, "action_type": "discrete"}}
        ]
        * 2,
        "n_agents": 2,
        "agent_policy_names": ["picker", "picker"],
    }
    return session


def test_trainer_reset_reply_has_hex_images_and_empty_infos() -> None:
    session = running_trainer()
    assert feed(session, {"type": "reset"}) == [ResetRequest()]
    reply = frame_body(session.batch_reply(batch(1, [False, False], [False, False], final=False)))
    assert reply == {
        "type": "reset",
        "obs": [
            {"obs": [0.5, -0.5], "side": 2, "eye_2d": "00010203"},
            {"obs": [1.5, 0.0], "side": 0, "eye_2d": "04050607"},
        ],
        "info": [{}, {}],
    }


def test_trainer_actions_become_arrays_and_steps_carry_done_and_terminal_obs() -> None:
    session = running_trainer()
    feed(session, {"type": "reset"})
    session.batch_reply(batch(1, [False, False], [False, False], final=False))
    actions = [{"move": [0.5, -0.25], "jump": 1}, {"move": [1.0, 0.0], "jump": 0}]
    (request,) = feed(session, {"type": "action", "action": actions})
    assert isinstance(request, ActionRequest)
    assert request.actions["move"].dtype == np.float32 and request.actions["move"].tolist() == [
        [0.5, -0.25],
        [1.0, 0.0],
    ]
    assert request.actions["jump"].dtype == np.int32 and request.actions["jump"].tolist() == [1, 0]
    reply = frame_body(session.batch_reply(batch(2, [True, False], [False, True], final=True)))
    assert reply["type"] == "step" and reply["reward"] == [0.25, -1.0] and reply["done"] == [True, True]
    assert reply["info"][0] == {
        "is_success": True,
        "terminal_observation": {"obs": [0.5, -0.5], "side": 2, "eye_2d": [[[0, 1], [2, 3]]]},
        "TimeLimit.truncated": False,
    }
    assert reply["info"][1] == {
        "terminal_observation": {"obs": [9.0, 9.0], "side": 1, "eye_2d": [[[7, 7], [7, 7]]]},
        "TimeLimit.truncated": True,
    }


def test_trainer_call_and_close() -> None:
    session = running_trainer()
    assert feed(session, {"type": "call", "method": "ping"}) == [CallRequest("ping")]
    assert frame_body(session.call_reply([1, None])) == {"type": "call", "returns": [1, None]}
    assert feed(session, {"type": "close"}) == [CloseRequest()]


@pytest.mark.parametrize(
    "action",
    [
        [{"move": [0.5, 0.5], "jump": 1}],  # one agent short
        [{"move": [0.5, 0.5], "jump": 1}, {"move": [0.5, 0.5]}],  # key missing
        [{"move": [0.5, 0.5], "jump": 1}, {"move": [0.5], "jump": 0}],  # size
        [{"move": [0.5, 0.5], "jump": 1}, {"move": [0.5, 0.5], "jump": 0.5}],  # not an integer
    ],
)
def test_bad_trainer_actions_are_the_trainers_fault(action: list[Any]) -> None:
    session = running_trainer()
    feed(session, {"type": "reset"})
    session.batch_reply(batch(1, [False, False], [False, False], final=False))
    with pytest.raises(RemoteProtocolError) as caught:
        feed(session, {"type": "action", "action": action})
    assert caught.value.code is ErrorCode.BAD_ACTIONS


def test_trainer_must_start_with_the_handshake() -> None:
    with pytest.raises(RemoteProtocolError, match="starts with 'handshake'"):
        feed(GodotRlTrainer("p"), {"type": "env_info"})


def test_spaces_godot_rl_cannot_express_are_refused() -> None:
    multi = PolicySpaces((("obs", BoxSpace((2,))),), (("move", MultiDiscreteAction((2, 3))),))
    with pytest.raises(ValueError, match="multi-discrete"):
        godot_spaces(multi, "p")
    not_image = PolicySpaces((("map_2d", BoxSpace((2,), "float32")),), (("move", ContinuousAction(1)),))
    with pytest.raises(ValueError, match="rename the key"):
        godot_spaces(not_image, "p")


def test_decoder_rejects_non_json_frames() -> None:
    decoder = MessageDecoder()
    decoder.feed(b"\x03\x00\x00\x00abc")
    with pytest.raises(RemoteProtocolError) as caught:
        decoder.next_message()
    assert caught.value.code is ErrorCode.MALFORMED
