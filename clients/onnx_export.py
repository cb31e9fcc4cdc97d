"""Export one trained SB3 policy to ONNX in the form the Godot RL Agents plugin runs (one file per policy).

Contract (godot_rl_protocol.md section 5, as implemented here):

* inputs: one float32 tensor ``[batch, len]`` per observation key, named after the key, in the game's key
  order, plus ``state_ins`` float32 ``[batch]``. ``len`` is the flattened size:

  - Box of any rank: ``prod(shape)`` values in row-major (C) order; the graph reshapes them (and moves
    image channels first when SB3 transposed an image space for its CNN). Image keys take raw values
    (0-255 for uint8 spaces); the graph divides by 255 exactly as SB3 does in training.
  - Discrete(n): ``len`` 1, the index as a float; the graph rounds it and one-hot encodes it.
  - MultiDiscrete(nvec): ``len`` = ``len(nvec)``, one index per column, one-hot encoded in the graph.

* outputs: ``output`` float32 ``[batch, N]`` with a static N, and ``state_outs`` (``state_ins`` echoed).
  ``output`` walks the action keys in the game's order:

  - only continuous keys: the means, ``size`` per key (the plugin's "means only" case; it clamps them);
  - discrete(n): n logits (Q-values for DQN), the plugin takes the argmax;
  - multi_discrete(nvec): ``sum(nvec)`` logits, one block per column (our protocol's extension; stock
    plugin builds only know discrete and continuous keys);
  - mixed discrete and continuous keys (SB3 trains them as one Box, see ``clients.spaces.ActionCodec``):
    every continuous key gives its means followed by as many log-std columns (the plugin skips them), and
    every binary discrete key, trained as one Box column ``x`` with action ``x > 0``, gives the two logits
    ``[0, x]``, whose argmax is the same action.

The opset is 17 (known to work with onnxruntime 1.15 in the plugin's C# runtime); the batch axis is dynamic.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gymnasium import spaces
from torch import nn

from broker.protocol.spaces import BoxSpace, ContinuousAction, DiscreteAction, PolicySpaces
from clients.spaces import action_to_wire, observation_to_wire

OPSET = 17
STATE_IN = "state_ins"
OUTPUT = "output"
STATE_OUT = "state_outs"
ACTION_KEY = "action"  # the one action key of a model whose game spaces are unknown


@dataclass(frozen=True)
class ActionBlock:
    """One action key's slice of ``output``: ``kind`` is discrete, multi_discrete or continuous."""

    key: str
    kind: str
    size: int  # n for discrete, len(nvec) for multi_discrete, floats for continuous
    start: int
    width: int  # output columns: logits, or means (+ log-stds in mixed layouts)


@dataclass(frozen=True)
class OnnxLayout:
    inputs: tuple[tuple[str, int], ...]  # (name, len) per observation key, then state_ins has [batch]
    actions: tuple[ActionBlock, ...]
    width: int
    means_only: bool

    def to_json(self) -> str:
        return json.dumps(
            {
                "inputs": [{"name": n, "len": length} for n, length in self.inputs],
                "state_ins": STATE_IN,
                "output_width": self.width,
                "means_only": self.means_only,
                "actions": [
                    {"key": b.key, "kind": b.kind, "size": b.size, "start": b.start, "width": b.width}
                    for b in self.actions
                ],
            }
        )


def action_layout(policy_spaces: PolicySpaces) -> tuple[tuple[ActionBlock, ...], bool]:
    """The output blocks in the game's action-key order, and whether the model is "means only"."""
    kinds = [space for _, space in policy_spaces.action]
    any_continuous = any(isinstance(s, ContinuousAction) for s in kinds)
    means_only = all(isinstance(s, ContinuousAction) for s in kinds)
    blocks = []
    start = 0
    for key, space in policy_spaces.action:
        if isinstance(space, ContinuousAction):
            width = space.size if means_only else 2 * space.size
            blocks.append(ActionBlock(key, "continuous", space.size, start, width))
        elif isinstance(space, DiscreteAction):
            if any_continuous and space.n > 2:
                raise ValueError(f"action '{key}': discrete with {space.n} choices next to continuous keys")
            blocks.append(ActionBlock(key, "discrete", space.n, start, space.n))
        else:
            if any_continuous:
                raise ValueError(f"action '{key}': multi_discrete next to continuous keys is not supported")
            blocks.append(ActionBlock(key, "multi_discrete", len(space.nvec), start, sum(space.nvec)))
        start += blocks[-1].width
    return tuple(blocks), means_only


def spaces_from_model(model: Any) -> PolicySpaces:
    """Best guess of the game's spaces from a model alone (a mixed-space Box cannot be told apart
    from a continuous one; pass the real ``PolicySpaces`` for those)."""
    obs: list[tuple[str, Any]] = []
    for key, space in model.observation_space.spaces.items():
        if isinstance(space, spaces.MultiBinary):  # the graph one-hot encodes only Discrete / MultiDiscrete
            raise TypeError(f"observation '{key}': {type(space).__name__} cannot be exported")
        try:
            obs.append((key, observation_to_wire(space, f"observation '{key}'")))
        except ValueError:
            raise TypeError(f"observation '{key}': {type(space).__name__} cannot be exported") from None
    act = model.action_space
    if isinstance(act, spaces.MultiBinary):  # SB3's Bernoulli head has no per-choice logits
        raise TypeError(f"action space {type(act).__name__} cannot be exported")
    try:
        action = ((ACTION_KEY, action_to_wire(act, "action space")),)
    except ValueError:
        raise TypeError(f"action space {type(act).__name__} cannot be exported") from None
    return PolicySpaces(tuple(obs), action)


def _input_length(space: spaces.Space[Any]) -> int:
    if isinstance(space, spaces.Box):
        return math.prod(space.shape)
    if isinstance(space, spaces.Discrete):
        return 1
    if isinstance(space, spaces.MultiDiscrete):
        return len(space.nvec)
    raise TypeError(f"{type(space).__name__} observations cannot be exported")


class _ObservationInput(nn.Module):
    """A flat float input ``[B, len]`` -> the tensor SB3's policy expects for that key."""

    def __init__(self, key: str, model_space: spaces.Space[Any], game_shape: tuple[int, ...] | None) -> None:
        super().__init__()
        self.kind = type(model_space).__name__
        self.model_shape = tuple(model_space.shape or ())
        self.game_shape = game_shape or self.model_shape
        self.channels_first = False
        if isinstance(model_space, spaces.Box) and self.game_shape != self.model_shape:
            g = self.game_shape
            if len(g) == 3 and self.model_shape == (g[2], g[0], g[1]):
                self.channels_first = True  # SB3's VecTransposeImage moved the channels of this image key
            else:
                raise ValueError(f"observation '{key}': game shape {g} does not match the model's {self.model_shape}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "Box":
            shaped = x.reshape(-1, *self.game_shape)
            return shaped.permute(0, 3, 1, 2) if self.channels_first else shaped
        if self.kind == "Discrete":
            return torch.round(x).reshape(-1)
        return torch.round(x).reshape(-1, self.model_shape[0])


class _PolicyGraph(nn.Module):
    """Raw observations in, the plugin's ``output`` layout out (deterministic: logits and means)."""

    def __init__(self, model: Any, policy_spaces: PolicySpaces, blocks: tuple[ActionBlock, ...]) -> None:
        super().__init__()
        from stable_baselines3.common.policies import ActorCriticPolicy
        from stable_baselines3.dqn.policies import DQNPolicy
        from stable_baselines3.sac.policies import SACPolicy

        self.policy = model.policy
        self.keys = list(model.observation_space.spaces)
        game_shapes = {k: s.shape for k, s in policy_spaces.observation if isinstance(s, BoxSpace)}
        self.inputs = nn.ModuleDict(
            {k: _ObservationInput(k, model.observation_space[k], game_shapes.get(k)) for k in self.keys}
        )
        self.blocks = blocks
        self.mixed = any(b.kind == "continuous" for b in blocks) and any(b.kind != "continuous" for b in blocks)
        if isinstance(self.policy, ActorCriticPolicy):
            self.family = "actor_critic"
        elif isinstance(self.policy, SACPolicy):
            self.family = "sac"
        elif isinstance(self.policy, DQNPolicy):
            self.family = "dqn"
        else:
            raise TypeError(f"ONNX export supports PPO, A2C, SAC and DQN policies, not {type(self.policy).__name__}")

    def _head(self, obs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits or means [B, W], log-std [B, W] or None) in SB3's own action columns."""
        from stable_baselines3.common.distributions import DiagGaussianDistribution

        policy: Any = self.policy
        if self.family == "dqn":
            return policy.q_net(obs), None
        if self.family == "sac":
            mean, log_std, _ = policy.actor.get_action_dist_params(obs)
            return torch.tanh(mean), None if policy.actor.use_sde else log_std  # gSDE: no per-action log-std
        features = policy.extract_features(obs)
        if isinstance(features, tuple):
            features = features[0]
        raw = policy.action_net(policy.mlp_extractor.forward_actor(features))
        if not isinstance(policy.action_space, spaces.Box):
            return raw, None
        if policy.squash_output:
            raw = torch.tanh(raw)
        log_std = None
        if isinstance(policy.action_dist, DiagGaussianDistribution):
            log_std = policy.log_std.expand_as(raw)
        return raw, log_std

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        *flat, state_ins = args
        obs = {k: self.inputs[k](x) for k, x in zip(self.keys, flat, strict=True)}
        head, log_std = self._head(obs)
        if not self.mixed:
            return head, state_ins
        # Mixed: SB3's Box has one column per continuous float and per (binary) discrete key.
        if log_std is None:
            log_std = torch.zeros_like(head)
        parts = []
        column = 0
        for block in self.blocks:
            if block.kind == "continuous":
                parts.append(head[:, column : column + block.size])
                parts.append(log_std[:, column : column + block.size])
                column += block.size
            else:
                x = head[:, column : column + 1]
                parts.append(torch.cat([torch.zeros_like(x), x], dim=1) if block.size == 2 else torch.zeros_like(x))
                column += 1
        return torch.cat(parts, dim=1), state_ins


def export_onnx(
    model: Any,
    path: str | Path,
    policy_spaces: PolicySpaces | None = None,
    *,
    policy_name: str = "",
    opset: int = OPSET,
    check: bool = True,
) -> OnnxLayout:
    """Write ``model`` (PPO, A2C, SAC or DQN with Dict observations) to ``path``; return the layout.

    ``policy_spaces`` are the game's spaces (``BrokerVecEnv.spaces``); without them the model's own
    spaces are used, which is right unless the actions mix discrete and continuous keys.
    With ``check`` the file is run in onnxruntime on sampled observations and compared with torch.
    """

    if not isinstance(model.observation_space, spaces.Dict):
        raise TypeError("ONNX export expects a model trained on Dict observations (MultiInputPolicy)")
    policy_spaces = policy_spaces or spaces_from_model(model)
    blocks, means_only = action_layout(policy_spaces)
    width = sum(b.width for b in blocks)
    graph = _PolicyGraph(model, policy_spaces, blocks).eval()
    inputs = tuple((k, _input_length(model.observation_space[k])) for k in graph.keys)
    sample = _sample_inputs(model, graph.keys, batch=4)
    with torch.no_grad():
        expected = graph(*sample)[0]
    if expected.shape[1] != width:
        raise ValueError(f"the policy outputs {expected.shape[1]} columns, the action layout needs {width}")
    names = [k for k, _ in inputs] + [STATE_IN]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    was_training = model.policy.training
    model.policy.set_training_mode(False)
    try:
        _torch_export(graph, sample, path, names, opset)
    finally:
        model.policy.set_training_mode(was_training)
    layout = OnnxLayout(inputs, blocks, width, means_only)
    _finish_export(path, layout, policy_name, type(model).__name__)
    if check:
        _check_with_onnxruntime(path, names, sample, expected.numpy())
    return layout


def _finish_export(path: Path, layout: OnnxLayout, policy_name: str, algorithm: str) -> None:
    """Pin the exported graph's output width and write the contract's metadata (policy, algorithm,
    layout) into it, then check the model: the last step of every export (SB3's here, RLlib's in
    clients/rllib_env.py)."""
    import onnx

    proto = onnx.load(str(path))
    _pin_output_width(proto, layout.width)
    for key, value in (("gdrl_policy", policy_name), ("gdrl_algorithm", algorithm), ("gdrl_layout", layout.to_json())):
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.checker.check_model(proto)
    onnx.save(proto, str(path))


def _torch_export(graph: nn.Module, sample: list[torch.Tensor], path: Path, names: list[str], opset: int) -> None:
    with warnings.catch_warnings():
        # The TorchScript exporter is deprecated since torch 2.9, but it handles this graph (named inputs,
        # dynamic batch, opset 17) quickly and reliably, and godot_rl's own exporter uses it too.
        warnings.filterwarnings("ignore", "You are using the legacy TorchScript-based ONNX export", DeprecationWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.onnx")
        torch.onnx.export(
            graph,
            tuple(sample),
            str(path),
            opset_version=opset,
            input_names=names,
            output_names=[OUTPUT, STATE_OUT],
            dynamic_axes={name: {0: "batch_size"} for name in [*names, OUTPUT, STATE_OUT]},
            dynamo=False,
        )


def _pin_output_width(proto: Any, width: int) -> None:
    """The plugin reads ``output``'s dim 1 as the action vector length: it must be a number."""
    for value in proto.graph.output:
        if value.name == OUTPUT:
            dims = value.type.tensor_type.shape.dim
            if len(dims) != 2:
                raise ValueError(f"'{OUTPUT}' has rank {len(dims)}, expected 2")
            dims[1].Clear()
            dims[1].dim_value = width


def _sample_inputs(model: Any, keys: list[str], batch: int) -> list[torch.Tensor]:
    out = []
    for key in keys:
        space = model.observation_space[key]
        rows = np.stack([np.asarray(space.sample(), dtype=np.float32).reshape(-1) for _ in range(batch)])
        out.append(torch.as_tensor(rows))
    out.append(torch.ones(batch, dtype=torch.float32))
    return out


def _check_with_onnxruntime(path: Path, names: list[str], sample: list[torch.Tensor], expected: np.ndarray) -> None:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    output, state_outs = session.run([OUTPUT, STATE_OUT], {n: t.numpy() for n, t in zip(names, sample, strict=True)})
    if not np.allclose(output, expected, atol=1e-4, rtol=1e-4):
        raise RuntimeError(f"{path}: onnxruntime output differs from torch by {np.abs(output - expected).max()}")
    if not np.array_equal(state_outs, sample[-1].numpy()):
        raise RuntimeError(f"{path}: state_outs does not echo state_ins")
