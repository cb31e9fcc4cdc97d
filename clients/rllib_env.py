"""The broker as an RLlib multi-agent environment (new API stack, ray 2.60; the ``[rllib]`` extra).

Each RLlib env runner creates one ``BrokerMultiAgentEnv``, which claims games on the broker of its own node
(a sampler session, docs/protocol.md section 4a) and steps every group of them:

* agent ids are ``"<policy>/<row>"``, the row in the sampler's layout of that policy (its claimed games in
  slot order), so ``policy_mapping_fn`` is a split at the slash; ``possible_agents`` lists them all;
* per-agent spaces come from the game's announcement through the one gymnasium <-> wire table
  (clients/spaces.py): a Dict observation per agent (use ``FlattenObservations(multi_agent=True)`` as the
  env-to-module connector), the action space the SB3 clients use;
* episodes end per agent, with the final observation and the reward of the ending step; an agent whose
  game episode ended stays out of the observations (RLlib's rule for agents that do not act) until every
  agent has ended once, which ends RLlib's episode (``"__all__"``). Meanwhile its game agent, already in a
  new game episode, repeats its last action; the next ``reset`` returns every agent's newest observation;
* in hold stepping (the broker's default) ``infos[agent]["frames"]`` says how many game ticks the
  transition spanned; other infos of the game's rows are passed on.

``env_config``: ``broker`` (address, default the broker's default address on this node), or
``broker_by_resource`` ({ray node resource: address}: the broker of the node that has that resource, as
when two game hosts run on one test machine), ``claim_games`` (a count or ``"all"``, default ``"all"``),
``stepping`` (``"hold"`` or ``"barrier"``), ``timeout_claim`` (seconds to retry while the broker or its
games are not up, default 120).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from ray.rllib.env.multi_agent_env import MultiAgentEnv
from torch import nn

from broker.protocol import DEFAULT_ADDRESS
from broker.protocol.messages import ALL_GAMES, Batch, StepOptions
from broker.protocol.spaces import BoxSpace, DiscreteSpace, MultiDiscreteSpace, PolicySpaces
from clients.onnx_export import (
    OPSET,
    STATE_IN,
    OnnxLayout,
    _check_with_onnxruntime,
    _finish_export,
    _torch_export,
    action_layout,
)
from clients.sampler import DEFAULT_TIMEOUT_CLAIM, SamplerLink
from clients.spaces import ActionCodec, ObsConverter, observation_dict

AGENT_SEPARATOR = "/"


def agent_id(policy: str, row: int) -> str:
    return f"{policy}{AGENT_SEPARATOR}{row}"


def policy_of(agent: str) -> str:
    return agent.rsplit(AGENT_SEPARATOR, 1)[0]


def policy_mapping_fn(agent_id: Any, episode: Any = None, **kwargs: Any) -> str:
    """RLlib's ``policy_mapping_fn``: one RLModule per broker policy, named like it."""
    return policy_of(str(agent_id))


def broker_address(config: dict[str, Any]) -> str:
    """The broker this env runner dials: ``broker``, or the one of ``broker_by_resource`` whose resource
    this node has (each game host of a cluster is started with its own resource)."""
    by_resource = config.get("broker_by_resource")
    if not by_resource:
        return str(config.get("broker") or DEFAULT_ADDRESS)
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    node = next(n for n in ray.nodes() if n["NodeID"] == node_id)
    found = [address for resource, address in by_resource.items() if resource in node["Resources"]]
    if len(found) != 1:
        raise RuntimeError(f"node {node_id} has {len(found)} of the resources {sorted(by_resource)}; expected one")
    return str(found[0])


class BrokerMultiAgentEnv(MultiAgentEnv):
    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__()
        worker = getattr(config, "worker_index", None)  # RLlib's EnvContext
        config = dict(config or {})
        stepping = config.get("stepping")
        self.address = broker_address(config)
        self.link = SamplerLink(
            self.address,
            config.get("claim_games", ALL_GAMES),
            name=config.get("name") or (f"rllib-env-runner-{worker}" if worker is not None else None),
            stepping=StepOptions(mode=stepping) if stepping else None,
            timeout_claim=float(config.get("timeout_claim", DEFAULT_TIMEOUT_CLAIM)),
        )
        self.spaces: dict[str, PolicySpaces] = {p: info.spaces for p, info in self.link.policies.items()}
        self._codecs = {p: ActionCodec(s) for p, s in self.spaces.items()}
        self._convert_obs = {p: ObsConverter(s) for p, s in self.spaces.items()}
        self._rows = {p: [agent_id(p, r) for r in range(info.n_envs)] for p, info in self.link.policies.items()}
        self.possible_agents = [a for rows in self._rows.values() for a in rows]
        self.agents = list(self.possible_agents)
        self.observation_spaces = {a: observation_dict(self.spaces[p]) for p, rows in self._rows.items() for a in rows}
        self.action_spaces = {a: self._codecs[p].space for p, rows in self._rows.items() for a in rows}
        self._active = {p: np.ones(len(rows), bool) for p, rows in self._rows.items()}
        self._last_actions = {
            p: np.zeros((len(rows), *(self._codecs[p].space.shape or ())), self._codecs[p].space.dtype)
            for p, rows in self._rows.items()
        }

    @property
    def games(self) -> list[int]:
        return self.link.games

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[dict, dict]:
        """Every agent's newest observation (the games keep running: nothing is reset in them)."""
        batches = self.link.wait()
        obs: dict[str, Any] = {}
        infos: dict[str, Any] = {}
        for policy, batch in batches.items():
            self._active[policy][:] = True
            rows = self._convert_obs[policy](batch.data.obs)
            for row, agent in enumerate(self._rows[policy]):
                obs[agent] = {k: v[row] for k, v in rows.items()}
                infos[agent] = {}
        self.agents = list(self.possible_agents)
        return obs, infos

    def step(self, action_dict: dict[Any, Any]) -> tuple[dict, dict, dict, dict, dict]:  # type: ignore[override]
        for policy, rows in self._rows.items():
            actions = self._last_actions[policy]
            for row, agent in enumerate(rows):
                if agent in action_dict:
                    actions[row] = action_dict[agent]
            self.link.act(policy, self._codecs[policy].to_wire(actions))
        obs: dict[str, Any] = {}
        rewards: dict[str, float] = {}
        terminateds: dict[str, bool] = {}
        truncateds: dict[str, bool] = {}
        infos: dict[str, Any] = {}
        for policy, batch in self.link.wait().items():
            self._take(policy, batch, obs, rewards, terminateds, truncateds, infos)
        ended = not any(active.any() for active in self._active.values())
        terminateds["__all__"] = ended
        truncateds["__all__"] = False
        self.agents = list(obs)  # still acting, and those ending in this step (their final observation)
        return obs, rewards, terminateds, truncateds, infos

    def _take(
        self,
        policy: str,
        batch: Batch,
        obs: dict[str, Any],
        rewards: dict[str, float],
        terminateds: dict[str, bool],
        truncateds: dict[str, bool],
        infos: dict[str, Any],
    ) -> None:
        data = batch.data
        convert_obs = self._convert_obs[policy]
        rows = convert_obs(data.obs)
        finals: dict[int, int] = {}
        final_rows: dict[str, np.ndarray] = {}
        if data.final_index is not None and data.final_obs is not None:
            finals = {int(row): i for i, row in enumerate(data.final_index)}
            final_rows = convert_obs(data.final_obs)
        active = self._active[policy]
        for row in np.flatnonzero(active):
            agent = self._rows[policy][row]
            rewards[agent] = float(data.reward[row])
            info = dict(data.infos.get(int(row), {}))
            if data.frames is not None:
                info["frames"] = int(data.frames[row])
            infos[agent] = info
            if data.terminated[row] or data.truncated[row]:
                obs[agent] = {k: v[finals[int(row)]] for k, v in final_rows.items()}
                terminateds[agent] = bool(data.terminated[row])
                truncateds[agent] = not terminateds[agent]
                active[row] = False
            else:
                obs[agent] = {k: v[row] for k, v in rows.items()}

    def close(self) -> None:
        self.link.close()


# --- ONNX export of one trained RLModule, in the Godot addon's contract (clients/onnx_export.py) ---------


class _ModuleGraph(nn.Module):
    """Named per-key inputs as the plugin feeds them -> the flat observation RLlib's FlattenObservations
    builds (keys sorted, discrete keys one-hot) -> the module's action distribution inputs, cut to the
    contract's columns (means of continuous actions; logits of discrete ones)."""

    def __init__(self, module: nn.Module, policy_spaces: PolicySpaces, width: int) -> None:
        super().__init__()
        self.module = module
        self.spaces = dict(policy_spaces.observation)
        self.keys = list(self.spaces)  # the game's order: the plugin's inputs
        self.flat_order = sorted(self.keys)  # dm-tree's order of a Dict's keys
        self.width = width

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        by_key = dict(zip(self.keys, inputs[:-1], strict=True))
        parts = []
        for key in self.flat_order:
            space, x = self.spaces[key], by_key[key]
            if isinstance(space, DiscreteSpace):
                parts.append(nn.functional.one_hot(torch.round(x[:, 0]).long(), space.n).float())
            elif isinstance(space, MultiDiscreteSpace):
                parts += [
                    nn.functional.one_hot(torch.round(x[:, i]).long(), n).float() for i, n in enumerate(space.nvec)
                ]
            else:
                parts.append(x.float())
        forward: Any = self.module.forward_inference  # an RLModule's, not nn.Module's
        out = forward({"obs": torch.cat(parts, dim=1)})["action_dist_inputs"]
        return out[:, : self.width], inputs[-1]


def _input_len(space: BoxSpace | DiscreteSpace | MultiDiscreteSpace) -> int:
    if isinstance(space, BoxSpace):
        return int(np.prod(space.shape))
    return 1 if isinstance(space, DiscreteSpace) else len(space.nvec)


def export_module_onnx(
    module: nn.Module, path: str | Path, policy_spaces: PolicySpaces, *, policy_name: str = "", check: bool = True
) -> OnnxLayout:
    """Write one trained torch RLModule (``algo.get_module(policy)``) to ``path`` as the addon runs it."""

    blocks, means_only = action_layout(policy_spaces)
    if not means_only and any(b.kind == "continuous" for b in blocks):
        raise NotImplementedError("mixed discrete and continuous actions are not exported from RLlib modules")
    width = sum(b.width for b in blocks)
    graph = _ModuleGraph(module, policy_spaces, width).eval()
    inputs = tuple((k, _input_len(s)) for k, s in policy_spaces.observation)
    sample_space = observation_dict(policy_spaces)
    rows = [sample_space.sample() for _ in range(4)]
    sample = [
        torch.as_tensor(np.stack([np.asarray(r[k], np.float32).reshape(-1) for r in rows])) for k, _ in inputs
    ] + [torch.ones(4)]
    with torch.no_grad():
        expected = graph(*sample)[0]
    names = [k for k, _ in inputs] + [STATE_IN]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _torch_export(graph, sample, path, names, OPSET)
    layout = OnnxLayout(inputs, blocks, width, means_only)
    _finish_export(path, layout, policy_name, "rllib")
    if check:
        _check_with_onnxruntime(path, names, sample, expected.numpy())
    return layout


__all__ = [
    "BrokerMultiAgentEnv",
    "agent_id",
    "broker_address",
    "export_module_onnx",
    "policy_mapping_fn",
    "policy_of",
]
