"""Pure functions that move rows between games and a policy's batch: no per-agent Python work."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from broker.protocol.checks import canonical_actions
from broker.protocol.errors import ErrorCode, LocalProtocolError
from broker.protocol.hot import new_step_data
from broker.protocol.messages import StepData
from broker.protocol.native import NATIVE
from broker.protocol.spaces import PolicySpaces

# What replaces an info the trainer's codec cannot carry: the row still arrives, and says why it has no info.
DROPPED_INFO = {"info_dropped": "not encodable for this trainer"}

__all__ = ["DROPPED_INFO", "UnencodableMessage", "canonical_actions", "concatenate_rows", "drop_unencodable_infos"]


class UnencodableMessage(LocalProtocolError):
    """A link's ``send`` could not encode the message for its peer, and wrote nothing.

    ``encodable`` says whether one value can be encoded in that peer's codec, so the caller can find the
    part of the message at fault (a game's info, say) and send the rest.
    """

    def __init__(self, message: str, encodable: Callable[[Any], bool]) -> None:
        super().__init__(ErrorCode.INTERNAL, message)
        self.encodable = encodable


def drop_unencodable_infos(data: StepData, encodable: Callable[[Any], bool]) -> tuple[StepData, list[int]]:
    """``data`` with every info that ``encodable`` refuses replaced by ``DROPPED_INFO``; and those rows."""
    rows = {row for row, info in data.infos.items() if not encodable(info)}
    infos = {row: (dict(DROPPED_INFO) if row in rows else info) for row, info in data.infos.items()}
    kept = StepData.unchecked(
        data.obs,
        data.reward,
        data.terminated,
        data.truncated,
        data.final_index,
        data.final_obs,
        infos,
        data.frames,
    )
    return kept, sorted(rows)


def _frozen(array: np.ndarray) -> np.ndarray:
    """Read-only, so that the server's gather write may send the memory by reference (an asyncio transport
    can keep a buffer after ``write`` returns) instead of packing a copy: nothing changes a batch once built."""
    array.flags.writeable = False
    return array


def _stack(arrays: list[np.ndarray], read_only: bool) -> np.ndarray:
    """The arrays one after another along their first axis (one C call for the usual contiguous parts)."""
    stacked: np.ndarray | None = None if NATIVE is None else NATIVE.stack(arrays, read_only)
    if stacked is None:
        stacked = np.concatenate(arrays)
        if read_only:
            _frozen(stacked)
    return stacked


def _stack_index(indexes: list[np.ndarray], offsets: list[int]) -> np.ndarray:
    """Each part's final rows moved by its offset, one after another, as int32."""
    stacked: np.ndarray | None = None if NATIVE is None else NATIVE.stack_index(indexes, offsets)
    if stacked is None:
        stacked = np.concatenate([index + off for index, off in zip(indexes, offsets, strict=True)]).astype(np.int32)
    return stacked


def concatenate_rows(parts: list[StepData], offsets: list[int], spaces: PolicySpaces) -> StepData:
    """Stack the slots' rows into one batch: one copy per key, no per-agent work. The parts were checked when
    they came in, so the batch is built unchecked.

    A single slot is handed on as it is: its arrays are the accumulator's own (dropped after the batch) or
    the game's read-only wire views, so nothing aliases and copying them would only cost time.
    """
    if len(parts) == 1 and offsets[0] == 0:
        only = parts[0]
        frames = None if only.frames is None else only.frames.astype(np.int32, copy=False)
        return new_step_data(
            {key: only.obs[key] for key, _ in spaces.observation},
            only.reward,
            only.terminated,
            only.truncated,
            only.final_index,
            only.final_obs,
            dict(only.infos),
            frames,
        )
    obs = {key: _stack([p.obs[key] for p in parts], True) for key, _ in spaces.observation}
    reward = _stack([p.reward for p in parts], False)
    terminated = _stack([p.terminated for p in parts], False)
    truncated = _stack([p.truncated for p in parts], False)
    frames = None
    if all(p.frames is not None for p in parts):
        frames = np.concatenate([p.frames for p in parts if p.frames is not None]).astype(np.int32)
    final_parts = [
        (p.final_index, p.final_obs, off)
        for p, off in zip(parts, offsets, strict=True)
        if p.final_index is not None and p.final_obs is not None and len(p.final_index)
    ]
    final_index = final_obs = None
    if final_parts:
        final_index = _stack_index([f[0] for f in final_parts], [f[2] for f in final_parts])
        final_obs = {key: _stack([f[1][key] for f in final_parts], True) for key, _ in spaces.observation}
    infos = {row + off: info for p, off in zip(parts, offsets, strict=True) for row, info in p.infos.items()}
    return new_step_data(obs, reward, terminated, truncated, final_index, final_obs, infos, frames)
