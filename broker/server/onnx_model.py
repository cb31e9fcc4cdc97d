"""A policy exported to ONNX (``clients/onnx_export.py``'s contract), run by the broker with onnxruntime.

``OnnxModel.load(path)`` reads the file and its ``gdrl_layout`` metadata; ``check(spaces)`` says whether
it fits a group's spaces; ``act(obs)`` turns a batch of wire observations into wire actions, decoded as
the Godot plugin decodes them (argmax per discrete block, continuous means clamped to [-1, 1]). ``act``
is called off the event loop; onnxruntime releases the GIL while it runs.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from broker.protocol.spaces import (
    BoxSpace,
    ContinuousAction,
    DiscreteAction,
    DiscreteSpace,
    MultiDiscreteAction,
    PolicySpaces,
)

STATE_IN = "state_ins"
OUTPUT = "output"


class ModelError(ValueError):
    """The file is not a policy this broker can run for the group (unreadable, not ONNX, wrong spaces)."""


@dataclass(frozen=True)
class FileStamp:
    """What tells a changed file apart: its modification time and size."""

    mtime_ns: int
    size: int

    @classmethod
    def of(cls, path: str) -> FileStamp | None:
        try:
            st = os.stat(path)
        except OSError:
            return None
        return cls(st.st_mtime_ns, st.st_size)


def _input_length(space: Any) -> int:
    if isinstance(space, BoxSpace):
        return math.prod(space.shape)
    return 1 if isinstance(space, DiscreteSpace) else len(space.nvec)


class OnnxModel:
    def __init__(self, path: str, session: Any, layout: dict[str, Any], stamp: FileStamp | None) -> None:
        self.path = path
        self.session = session
        self.layout = layout
        self.stamp = stamp
        self.inputs: list[tuple[str, int]] = [(i["name"], int(i["len"])) for i in layout["inputs"]]
        self.actions: list[dict[str, Any]] = list(layout["actions"])

    @classmethod
    def load(cls, path: str) -> OnnxModel:
        """Read ``path`` (ModelError with the reason if it cannot be used)."""
        import onnxruntime as ort

        stamp = FileStamp.of(path)
        if stamp is None:
            raise ModelError(f"no model file at {path}")
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1  # the broker shares the machine with games and trainers
        options.inter_op_num_threads = 1
        try:
            session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises its own exception types for every kind of bad file
            raise ModelError(f"{path} is not a loadable ONNX model: {str(exc).splitlines()[0][:300]}") from None
        meta = session.get_modelmeta().custom_metadata_map
        try:
            layout = json.loads(meta["gdrl_layout"])
            [(i["name"], int(i["len"])) for i in layout["inputs"]]
            [(a["key"], a["kind"], int(a["size"]), int(a["start"]), int(a["width"])) for a in layout["actions"]]
        except (KeyError, TypeError, ValueError):
            raise ModelError(
                f"{path} has no gdrl_layout metadata: export it with gdrl-train --onnx-export-path"
            ) from None
        return cls(path, session, layout, stamp)

    def check(self, spaces: PolicySpaces) -> None:
        """ModelError unless the model's inputs and outputs are those of ``spaces``."""
        want_inputs = [(key, _input_length(space)) for key, space in spaces.observation]
        if self.inputs != want_inputs:
            raise ModelError(f"{self.path} takes observations {self.inputs}, the group has {want_inputs}")
        want_actions = []
        for key, space in spaces.action:
            if isinstance(space, ContinuousAction):
                want_actions.append((key, "continuous", space.size))
            elif isinstance(space, DiscreteAction):
                want_actions.append((key, "discrete", space.n))
            else:
                want_actions.append((key, "multi_discrete", len(space.nvec)))
        have = [(a["key"], a["kind"], int(a["size"])) for a in self.actions]
        if have != want_actions:
            raise ModelError(f"{self.path} outputs actions {have}, the group takes {want_actions}")

    def act(self, obs: dict[str, np.ndarray], spaces: PolicySpaces) -> dict[str, np.ndarray]:
        """Wire actions for every row of ``obs`` (one batched run)."""
        n = len(next(iter(obs.values())))
        feeds = {name: np.ascontiguousarray(obs[name].reshape(n, -1), dtype=np.float32) for name, _ in self.inputs}
        feeds[STATE_IN] = np.zeros(n, np.float32)
        output = self.session.run([OUTPUT], feeds)[0]
        action_spaces = dict(spaces.action)
        actions: dict[str, np.ndarray] = {}
        for block in self.actions:
            start, width, key = int(block["start"]), int(block["width"]), block["key"]
            part = output[:, start : start + width]
            space = action_spaces[key]
            if isinstance(space, ContinuousAction):
                actions[key] = np.clip(part[:, : space.size], -1.0, 1.0).astype(np.float32)
            elif isinstance(space, DiscreteAction):
                actions[key] = np.argmax(part, axis=1).astype(np.int32)
            elif isinstance(space, MultiDiscreteAction):
                columns, offset = [], 0
                for choices in space.nvec:
                    columns.append(np.argmax(part[:, offset : offset + choices], axis=1))
                    offset += choices
                actions[key] = np.stack(columns, axis=1).astype(np.int32)
        return actions
