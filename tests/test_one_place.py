"""One place for each fact (issue 18, item 4): zero actions, the gymnasium <-> wire space table, the default
address and the hold-deadline default each live in one module, and every user reads them from there."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gymnasium import spaces

from broker.legacy.godot_rl_game import GodotRlGame
from broker.protocol import DEFAULT_ADDRESS, DEFAULT_HOST, DEFAULT_PORT
from broker.protocol.errors import ErrorCode, RemoteProtocolError
from broker.protocol.messages import (
    DEFAULT_HOLD_DEADLINE_MS,
    MAX_ADAPTIVE_DEADLINE_MS,
    GameActions,
    GameStep,
    StepOptions,
)
from broker.protocol.spaces import (
    BoxSpace,
    ContinuousAction,
    DiscreteAction,
    DiscreteSpace,
    GroupSpec,
    MultiDiscreteAction,
    MultiDiscreteSpace,
    PolicySpaces,
    check_rows,
)
from clients import onnx_export, pettingzoo_game, pettingzoo_groups
from clients.spaces import ActionCodec, action_space, action_to_wire, observation_space, observation_to_wire

ROOT = Path(__file__).resolve().parent.parent
OBS = (("x", BoxSpace((2,))),)
EVERY_ACTION = (("move", ContinuousAction(2)), ("jump", DiscreteAction(2)), ("grip", MultiDiscreteAction((3, 4))))


# --- zero actions ---------------------------------------------------------------------------------


def test_zero_actions_are_valid_actions_of_every_action_kind() -> None:
    spec = GroupSpec("p", 3, PolicySpaces(OBS, EVERY_ACTION))
    zeros = spec.zero_actions()
    check_rows(zeros, spec.spaces.action, 3, "zeros", ErrorCode.BAD_ACTIONS)  # the broker's own rule accepts them
    assert {k: (a.dtype.name, a.shape) for k, a in zeros.items()} == {
        "move": ("float32", (3, 2)),
        "jump": ("int32", (3,)),
        "grip": ("int32", (3, 2)),
    }
    assert all(not a.any() for a in zeros.values())


def test_the_old_godot_rl_zero_rule_gave_multi_discrete_keys_floats() -> None:
    """godot_rl_game.py used to give float32 zeros to every key that was not discrete: a multi-discrete key
    then got floats, which the broker's check of actions refuses."""
    spec = GroupSpec("p", 2, PolicySpaces(OBS, EVERY_ACTION))
    old = {
        key: np.zeros((spec.n_agents, *space.row_shape), np.int32 if isinstance(space, DiscreteAction) else np.float32)
        for key, space in spec.spaces.action
    }
    with pytest.raises(RemoteProtocolError, match="grip: expected int32"):
        check_rows(old, spec.spaces.action, 2, "old zeros", ErrorCode.BAD_ACTIONS)
    check_rows(spec.zero_actions(), spec.spaces.action, 2, "zeros", ErrorCode.BAD_ACTIONS)


def test_a_held_godot_rl_group_sends_the_group_specs_zeros_before_its_first_answer() -> None:
    game = GodotRlGame()
    game.receive(
        {
            "type": "env_info",
            "observation_space": {"obs": {"size": [2], "space": "box"}},
            "action_space": {
                "move": {"size": 2, "action_type": "continuous"},
                "jump": {"size": 3, "action_type": "discrete"},
            },
            "n_agents": 2,
        }
    )
    game.reset_request()
    step = game.receive({"type": "reset", "obs": [{"obs": [0.0, 0.0]}] * 2})
    assert isinstance(step, GameStep)
    body: dict[str, Any] = json.loads(game.actions_request(GameActions(0, {}))[4:])  # every group held
    assert body["action"] == [{"move": [0.0, 0.0], "jump": 0}] * 2
    assert isinstance(body["action"][0]["jump"], int) and isinstance(body["action"][0]["move"][0], float)


# --- the space table ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gym_space", "wire"),
    [
        (spaces.Box(-1.0, 1.0, (3,), np.float32), BoxSpace((3,), "float32", -1.0, 1.0)),
        (spaces.Box(0, 255, (4, 4, 3), np.uint8), BoxSpace((4, 4, 3), "uint8", 0.0, 255.0)),
        (spaces.Discrete(5), DiscreteSpace(5)),
        (spaces.MultiDiscrete([3, 4]), MultiDiscreteSpace((3, 4))),
    ],
)
def test_observation_spaces_go_both_ways(gym_space: spaces.Space[Any], wire: Any) -> None:
    assert observation_to_wire(gym_space, "obs") == wire
    assert observation_space(wire) == gym_space


def test_observation_spaces_with_no_wire_twin_map_to_the_nearest() -> None:
    assert observation_to_wire(spaces.MultiBinary(3), "o") == MultiDiscreteSpace((2, 2, 2))
    assert observation_to_wire(spaces.Box(0, 1, (2,), np.bool_), "o") == BoxSpace((2,), "uint8", 0.0, 1.0)
    assert observation_to_wire(spaces.Box(-2, 2, (2,), np.float16), "o").dtype == "float32"
    with pytest.raises(ValueError, match=r"o: observation space Tuple.* is not supported"):
        observation_to_wire(spaces.Tuple((spaces.Discrete(2),)), "o")


@pytest.mark.parametrize(
    ("gym_space", "wire"),
    [
        (spaces.Box(-1.0, 1.0, (3,), np.float32), ContinuousAction(3)),
        (spaces.Discrete(4), DiscreteAction(4)),
        (spaces.MultiDiscrete([3, 2]), MultiDiscreteAction((3, 2))),
    ],
)
def test_action_spaces_go_both_ways(gym_space: spaces.Space[Any], wire: Any) -> None:
    assert action_to_wire(gym_space, "a") == wire
    assert action_space(wire) == gym_space
    assert ActionCodec(PolicySpaces(OBS, (("a", wire),))).space == gym_space  # what a BrokerVecEnv shows SB3


def test_the_pettingzoo_adapter_and_the_onnx_export_use_the_one_table() -> None:
    for module in (pettingzoo_groups, onnx_export):
        assert module.observation_to_wire is observation_to_wire
        assert module.action_to_wire is action_to_wire
    box = spaces.Box(-3.0, 3.0, (2,), np.float64)
    codec = pettingzoo_groups.ObservationCodec(box, "g")
    assert codec.layout == (("obs", observation_to_wire(box, "g")),)
    assert pettingzoo_groups.ActionCodec(spaces.MultiBinary(3), "g").wire == MultiDiscreteAction((2, 2, 2))


# --- the default address --------------------------------------------------------------------------


def _parser_default(build: Any, dest: str) -> Any:
    parser = argparse.ArgumentParser()
    build(parser)
    return parser.get_default(dest)


def test_every_default_address_is_the_protocols() -> None:
    from broker.server.config import ServerConfig
    from broker.server.launcher import LaunchSpec
    from clients import sim_game, train_options
    from clients.plugin_emulator import EmulatorConfig
    from clients.transport import Address

    assert DEFAULT_ADDRESS == f"{DEFAULT_HOST}:{DEFAULT_PORT}" == "127.0.0.1:11008"
    assert (ServerConfig().host, ServerConfig().port) == (DEFAULT_HOST, DEFAULT_PORT)
    assert Address() == Address.parse(DEFAULT_ADDRESS) == Address.parse("") == Address(DEFAULT_HOST, DEFAULT_PORT)
    assert LaunchSpec("game").port == DEFAULT_PORT
    assert (EmulatorConfig().host, EmulatorConfig().port) == (DEFAULT_HOST, DEFAULT_PORT)
    assert _parser_default(sim_game.add_arguments, "address") == DEFAULT_ADDRESS
    assert pettingzoo_game.build_parser().get_default("address") == DEFAULT_ADDRESS
    assert train_options.build_parser().get_default("broker") == DEFAULT_ADDRESS


def test_no_code_spells_the_default_port_but_the_protocol() -> None:
    found = []
    for folder in ("broker", "clients"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]
                if re.search(r"\b11008\b", code) and not code.lstrip().startswith(("``", '"""')):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert found == ["broker/protocol/__init__.py:9: DEFAULT_PORT = 11008"]


# --- the hold deadline ----------------------------------------------------------------------------


def test_the_hold_deadline_default_adapts_between_its_floor_and_its_cap() -> None:
    hold = StepOptions()
    assert hold.deadline_s(0.0) == DEFAULT_HOLD_DEADLINE_MS / 1000.0 == 0.02
    assert hold.deadline_s(0.0075) == pytest.approx(0.03)  # 4 x a steady 7.5 ms answer
    assert hold.deadline_s(5.0) == MAX_ADAPTIVE_DEADLINE_MS / 1000.0 == 0.1
    assert StepOptions("hold", 250.0).deadline_s(0.0) == 0.25  # an explicit deadline is kept as given
    assert StepOptions("barrier").deadline_s(1.0) is None


def test_serve_help_tells_the_deadline_and_metrics_binding_truthfully(capsys: pytest.CaptureFixture[str]) -> None:
    from broker import cli

    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert (
        "the larger of 20 ms and 4 x the trainer's median answer time over its last 64 batches, at most 100 ms" in text
    )
    assert "bound to loopback (127.0.0.1) whatever --host" in text
    assert "same --host" not in text


# --- gdrl-train's options -------------------------------------------------------------------------


def test_gdrl_train_flags_are_the_fields_of_train_options() -> None:
    from dataclasses import fields

    from clients.train_options import TrainOptions, build_parser, resolve_options

    parser = build_parser()
    dests = {action.dest for action in parser._actions if action.dest != "help"}
    assert dests == {option.name for option in fields(TrainOptions)}
    plain = resolve_options(parser.parse_args(["--policy", "p"]))
    assert plain == TrainOptions(policy="p")  # every default is the dataclass's
    assert plain.hyper == {
        "n_steps": 128,
        "batch_size": 256,
        "n_epochs": 4,
        "learning_rate": 3e-4,
        "gamma": 0.99,
        "gae_lambda": 0.95,
        "clip_range": 0.2,
        "ent_coef": 0.0,
        "vf_coef": 0.5,
        "max_grad_norm": 0.5,
    }
    assert (plain.total_timesteps, plain.step_options, plain.policy_kwargs) == (100_000, None, {})
    given = resolve_options(
        parser.parse_args(["--policy", "p", "--gamma", "0.9", "--stepping", "hold", "--deadline-ms", "50"])
    )
    assert given.explicit_hyper == {"gamma": 0.9} and given.hyper["n_steps"] == 128
    assert given.step_options == StepOptions("hold", 50.0, "repeat")
    sac = resolve_options(parser.parse_args(["--policy", "p", "--algo", "sac", "--ent-coef", "auto_0.1"]))
    assert sac.hyper == {"ent_coef": "auto_0.1"}
    with pytest.raises(ValueError, match=r"--n-epochs does not apply to SAC \(it takes --batch-size"):
        resolve_options(parser.parse_args(["--policy", "p", "--algo", "sac", "--n-epochs", "3"]))
    with pytest.raises(ValueError, match="--inference runs a saved model"):
        resolve_options(parser.parse_args(["--policy", "p", "--inference"]))
    with pytest.raises(ValueError, match="--deadline-ms and --hold-action need --stepping"):
        resolve_options(parser.parse_args(["--policy", "p", "--deadline-ms", "5"]))
