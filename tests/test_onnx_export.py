"""ONNX per policy: the exported graph, run in onnxruntime and decoded the way the Godot plugin decodes it,
picks the same actions as SB3's deterministic ``predict`` (through our ActionCodec to wire actions)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from stable_baselines3 import A2C, DQN, PPO, SAC

from broker.protocol.spaces import (
    BoxSpace,
    ContinuousAction,
    DiscreteAction,
    DiscreteSpace,
    MultiDiscreteAction,
    MultiDiscreteSpace,
    PolicySpaces,
)
from clients.onnx_export import export_onnx, spaces_from_model
from clients.sim_game import mover_spaces, picker_spaces
from clients.spaces import ActionCodec, observation_dict

N_OBS = 100

GRID_AND_KEYS = (
    ("grid", BoxSpace((13, 13, 5), "float32", 0.0, 1.0)),
    ("side", DiscreteSpace(3)),
    ("flags", MultiDiscreteSpace((2, 4))),
)
CONTINUOUS = PolicySpaces(GRID_AND_KEYS, (("move", ContinuousAction(2)), ("turn", ContinuousAction(1))))
ALL_DISCRETE = PolicySpaces(
    GRID_AND_KEYS,
    (("move", DiscreteAction(3)), ("aim", MultiDiscreteAction((2, 5))), ("fire", DiscreteAction(4))),
)
MIXED = PolicySpaces(
    (("obs", BoxSpace((6,), "float32", -1.0, 1.0)), ("side", DiscreteSpace(3))),
    (("jump", DiscreteAction(2)), ("move", ContinuousAction(2)), ("fire", DiscreteAction(2))),
)
IMAGE = PolicySpaces(
    (("camera", BoxSpace((36, 36, 3), "uint8", 0.0, 255.0)), ("side", DiscreteSpace(2))),
    (("move", DiscreteAction(3)),),
)


class SpacesEnv(gym.Env[dict[str, np.ndarray], Any]):
    """Random observations in the policy's spaces; the reward favours action column 0 being high, so a
    few hundred training steps move the policy away from its initialisation."""

    def __init__(self, policy_spaces: PolicySpaces, seed: int = 0) -> None:
        self.observation_space = observation_dict(policy_spaces)
        self.action_space = ActionCodec(policy_spaces).space
        self.observation_space.seed(seed)
        self.t = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict]:
        self.t = 0
        return self.observation_space.sample(), {}

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        self.t += 1
        reward = float(np.asarray(action, dtype=np.float64).reshape(-1)[0])
        return self.observation_space.sample(), reward, False, self.t >= 16, {}


def plugin_decode(output_row: np.ndarray, action_space: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Mirror of the plugin's ``sync.gd _extract_action_dict`` and ``set_action_means_only`` (reference §5.3),
    working from the game's action space as Godot declares it (``action_type`` and ``size``), extended with
    our ``multi_discrete`` keys (one block of logits per column)."""
    continuous_size = sum(v["size"] for v in action_space.values() if v["action_type"] == "continuous")
    means_only = all(v["action_type"] == "continuous" for v in action_space.values()) and continuous_size == len(
        output_row
    )
    actions: dict[str, Any] = {}
    index = 0
    for key, spec in action_space.items():
        if spec["action_type"] == "discrete":
            n = spec["size"]
            actions[key] = int(np.argmax(output_row[index : index + n]))  # first maximum, like the plugin
            index += n
        elif spec["action_type"] == "multi_discrete":
            picks = []
            for n in spec["nvec"]:
                picks.append(int(np.argmax(output_row[index : index + n])))
                index += n
            actions[key] = picks
        else:
            n = spec["size"]
            actions[key] = np.clip(output_row[index : index + n], -1.0, 1.0)
            index += n if means_only else 2 * n  # skip the log-stds
    assert index == len(output_row), "the output must be consumed exactly"
    return actions


def make_model(algo: type, policy_spaces: PolicySpaces, train_steps: int) -> Any:
    env = SpacesEnv(policy_spaces)
    kwargs: dict[str, Any] = {"seed": 0, "device": "cpu"}
    if algo is PPO:
        kwargs.update(n_steps=64, batch_size=64, n_epochs=2)
    if algo in (SAC, DQN):
        kwargs.update(learning_starts=32, buffer_size=2_000, batch_size=32)
    model = algo("MultiInputPolicy", env, **kwargs)
    if train_steps:
        model.learn(train_steps)
    else:
        # Fresh networks output values near 0; spread the weights so that every decision is clear-cut
        # (and means leave [-1, 1], which exercises the plugin's clamping).
        torch.manual_seed(1)
        with torch.no_grad():
            for param in model.policy.parameters():
                if param.dim() > 1:
                    param.normal_(0.0, 2.0 / math.sqrt(math.prod(param.shape[1:])))
                else:
                    param.normal_(0.0, 0.1)
    return model


def sample_observations(policy_spaces: PolicySpaces, n: int, seed: int) -> dict[str, np.ndarray]:
    space = observation_dict(policy_spaces)
    space.seed(seed)
    samples = [space.sample() for _ in range(n)]
    return {key: np.stack([s[key] for s in samples]) for key in space.spaces}


def run_onnx(path: Path, obs: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    n = len(next(iter(obs.values())))
    feeds = {key: value.reshape(n, -1).astype(np.float32) for key, value in obs.items()}  # as the plugin feeds
    feeds["state_ins"] = np.ones(n, np.float32)
    output, state_outs = session.run(["output", "state_outs"], feeds)
    return output, state_outs


def assert_varied(actions: dict[str, np.ndarray], policy_spaces: PolicySpaces) -> None:
    """The comparison means something only if the observations lead to different actions."""
    for key, space in policy_spaces.action:
        if isinstance(space, ContinuousAction):
            inside = np.mean(np.abs(actions[key]) < 0.99)
            assert inside > 0.2 and np.std(actions[key]) > 0.1, f"{key}: means hardly vary or all clamp"
        else:
            assert len(np.unique(actions[key], axis=0)) >= 2, f"{key}: always the same action"


def assert_same_actions(model: Any, policy_spaces: PolicySpaces, path: Path, varied: bool) -> None:
    obs = sample_observations(policy_spaces, N_OBS, seed=7)
    sb3_actions, _ = model.predict(obs, deterministic=True)
    expected = ActionCodec(policy_spaces).to_wire(sb3_actions)
    if varied:
        assert_varied(expected, policy_spaces)
    output, state_outs = run_onnx(path, obs)
    assert output.dtype == np.float32 and output.shape[0] == N_OBS
    np.testing.assert_array_equal(state_outs, np.ones(N_OBS, np.float32))
    declared = policy_spaces.action_wire()
    mismatches = 0
    for row in range(N_OBS):
        decoded = plugin_decode(output[row], declared)
        for key, space in policy_spaces.action:
            want = expected[key][row]
            if isinstance(space, ContinuousAction):
                np.testing.assert_allclose(decoded[key], want, atol=1e-4, err_msg=f"row {row} key {key}")
            else:
                mismatches += int(not np.array_equal(np.asarray(decoded[key]), np.asarray(want)))
    assert mismatches == 0, f"{mismatches} discrete actions differ from SB3's predict"


def assert_plugin_contract(path: Path, policy_spaces: PolicySpaces, width: int) -> None:
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto)
    assert max(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")) <= 17
    inputs = {i.name: i for i in proto.graph.input}
    expected_names = [key for key, _ in policy_spaces.observation] + ["state_ins"]
    assert [i.name for i in proto.graph.input] == expected_names
    for key, space in policy_spaces.observation:
        dims = inputs[key].type.tensor_type.shape.dim
        if isinstance(space, BoxSpace):
            length = math.prod(space.shape)
        else:
            length = 1 if isinstance(space, DiscreteSpace) else len(space.nvec)
        assert inputs[key].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
        assert len(dims) == 2 and dims[0].dim_param and dims[1].dim_value == length
    state_dims = inputs["state_ins"].type.tensor_type.shape.dim
    assert len(state_dims) == 1 and state_dims[0].dim_param
    outputs = {o.name: o for o in proto.graph.output}
    assert set(outputs) == {"output", "state_outs"}
    out_dims = outputs["output"].type.tensor_type.shape.dim
    assert outputs["output"].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert len(out_dims) == 2 and out_dims[1].dim_value == width  # the plugin reads dim 1 as a number
    meta = {p.key: p.value for p in proto.metadata_props}
    assert json.loads(meta["gdrl_layout"])["output_width"] == width


def expected_width(policy_spaces: PolicySpaces) -> int:
    kinds = [s for _, s in policy_spaces.action]
    all_continuous = all(isinstance(s, ContinuousAction) for s in kinds)
    width = 0
    for s in kinds:
        if isinstance(s, ContinuousAction):
            width += s.size if all_continuous else 2 * s.size
        elif isinstance(s, DiscreteAction):
            width += s.n
        else:
            width += sum(s.nvec)
    return width


CASES = [
    pytest.param(PPO, CONTINUOUS, 0, id="ppo-continuous-fresh"),
    pytest.param(PPO, CONTINUOUS, 256, id="ppo-continuous-trained"),
    pytest.param(A2C, CONTINUOUS, 0, id="a2c-continuous-fresh"),
    pytest.param(SAC, CONTINUOUS, 0, id="sac-continuous-fresh"),
    pytest.param(SAC, mover_spaces(), 200, id="sac-mover-trained"),
    pytest.param(PPO, picker_spaces(), 0, id="ppo-discrete-fresh"),
    pytest.param(PPO, picker_spaces(), 256, id="ppo-discrete-trained"),
    pytest.param(DQN, picker_spaces(), 0, id="dqn-discrete-fresh"),
    pytest.param(DQN, picker_spaces(), 200, id="dqn-discrete-trained"),
    pytest.param(PPO, ALL_DISCRETE, 0, id="ppo-multidiscrete-fresh"),
    pytest.param(PPO, ALL_DISCRETE, 256, id="ppo-multidiscrete-trained"),
    pytest.param(A2C, ALL_DISCRETE, 0, id="a2c-multidiscrete-fresh"),
    pytest.param(PPO, MIXED, 0, id="ppo-mixed-fresh"),
    pytest.param(PPO, MIXED, 256, id="ppo-mixed-trained"),
    pytest.param(SAC, MIXED, 0, id="sac-mixed-fresh"),
    pytest.param(A2C, MIXED, 0, id="a2c-mixed-fresh"),
    pytest.param(PPO, IMAGE, 0, id="ppo-image-cnn-fresh"),
]


@pytest.mark.parametrize(("algo", "policy_spaces", "train_steps"), CASES)
def test_onnx_decoded_like_the_plugin_matches_sb3_predict(
    tmp_path: Path, algo: type, policy_spaces: PolicySpaces, train_steps: int
) -> None:
    model = make_model(algo, policy_spaces, train_steps)
    path = tmp_path / "policy.onnx"
    layout = export_onnx(model, path, policy_spaces, policy_name="p")
    assert layout.width == expected_width(policy_spaces)
    assert_plugin_contract(path, policy_spaces, layout.width)
    assert_same_actions(model, policy_spaces, path, varied=train_steps == 0)


def test_batch_of_one_as_the_plugin_runs_it(tmp_path: Path) -> None:
    model = make_model(PPO, MIXED, 0)
    path = tmp_path / "one.onnx"
    export_onnx(model, path, MIXED)
    obs = sample_observations(MIXED, 5, seed=3)
    batch_output, _ = run_onnx(path, obs)
    for row in range(5):
        single, state_outs = run_onnx(path, {k: v[row : row + 1] for k, v in obs.items()})
        assert single.shape == (1, batch_output.shape[1])
        np.testing.assert_allclose(single[0], batch_output[row], atol=1e-5)
        np.testing.assert_array_equal(state_outs, [1.0])


def test_mixed_layout_puts_log_std_after_means_and_two_logits_per_binary_key(tmp_path: Path) -> None:
    model = make_model(PPO, MIXED, 0)
    path = tmp_path / "mixed.onnx"
    layout = export_onnx(model, path, MIXED)
    assert [(b.key, b.kind, b.start, b.width) for b in layout.actions] == [
        ("jump", "discrete", 0, 2),
        ("move", "continuous", 2, 4),
        ("fire", "discrete", 6, 2),
    ]
    assert not layout.means_only
    output, _ = run_onnx(path, sample_observations(MIXED, 10, seed=5))
    np.testing.assert_array_equal(output[:, 0], 0.0)  # binary keys: logits [0, x]
    np.testing.assert_array_equal(output[:, 6], 0.0)
    # PPO's log-std does not depend on the observation; "move" is columns 1-2 of SB3's Box.
    log_std = model.policy.log_std.detach().numpy()
    np.testing.assert_allclose(output[:, 4:6], np.broadcast_to(log_std[1:3], (10, 2)), atol=1e-6)


def test_without_game_spaces_the_model_spaces_are_used(tmp_path: Path) -> None:
    model = make_model(PPO, ALL_DISCRETE, 0)
    guessed = spaces_from_model(model)
    assert [k for k, _ in guessed.observation] == ["grid", "side", "flags"]
    layout = export_onnx(model, tmp_path / "guess.onnx")
    assert layout.width == 3 + 7 + 4
    obs = sample_observations(ALL_DISCRETE, 20, seed=1)
    output, _ = run_onnx(tmp_path / "guess.onnx", obs)
    sb3_actions, _ = model.predict(obs, deterministic=True)
    picks = np.stack([np.argmax(output[:, a:b], axis=1) for a, b in ((0, 3), (3, 5), (5, 10), (10, 14))], axis=1)
    np.testing.assert_array_equal(picks, sb3_actions)


def test_export_refuses_what_it_cannot_express(tmp_path: Path) -> None:
    model = make_model(PPO, MIXED, 0)
    wrong = PolicySpaces(MIXED.observation, (("move", ContinuousAction(3)),))
    with pytest.raises(ValueError, match="columns"):
        export_onnx(model, tmp_path / "wrong.onnx", wrong)
    box_model = PPO("MlpPolicy", "Pendulum-v1", n_steps=16, batch_size=16, device="cpu")
    with pytest.raises(TypeError, match="Dict observations"):
        export_onnx(box_model, tmp_path / "box.onnx")
