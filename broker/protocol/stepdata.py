"""Step data: the per-row outcome of one step, inside a game's ``step`` and a policy's ``batch``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from broker.protocol.arrays import decode_array, encode_array
from broker.protocol.errors import ErrorCode, RemoteProtocolError, summarize
from broker.protocol.fields import (
    MAX_ARRAY_KEYS,
    decode_named_array,
    decode_named_arrays,
    encode_arrays,
    is_int,
    malformed,
)
from broker.protocol.limits import INT_MAX, INT_MIN, MAX_INFO_NESTING
from broker.protocol.spaces import MAX_AGENTS, check_finite

MAX_INFO_ENTRIES = MAX_AGENTS
_new, _set = object.__new__, object.__setattr__


def check_info(info: Any, what: str, code: ErrorCode = ErrorCode.BAD_STEP) -> None:
    """An agent's info map must be something every codec the broker forwards it in can carry (msgpack to
    Python trainers, Godot Variant to the addon, JSON to godot_rl scripts): keys are strings or integers;
    values are None, bools, 64-bit integers, floats, strings, bytes, lists and such maps, nested at most
    MAX_INFO_NESTING deep. Strings need no check here: every decoder refuses text that is not UTF-8."""
    if not isinstance(info, dict):
        raise RemoteProtocolError(code, f"{what} must be a map, got {summarize(info)}")
    _check_free_value(info, what, code, 1)


def _check_free_value(value: Any, what: str, code: ErrorCode, level: int) -> None:
    if isinstance(value, dict):
        if level > MAX_INFO_NESTING:
            raise RemoteProtocolError(code, f"{what} nests deeper than {MAX_INFO_NESTING} levels")
        for key, item in value.items():
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                raise RemoteProtocolError(code, f"{what}: key {summarize(key)} is neither a string nor an integer")
            _check_free_value(key, what, code, level)
            _check_free_value(item, what, code, level + 1)
    elif isinstance(value, list):
        if level > MAX_INFO_NESTING:
            raise RemoteProtocolError(code, f"{what} nests deeper than {MAX_INFO_NESTING} levels")
        for item in value:
            _check_free_value(item, what, code, level + 1)
    elif isinstance(value, int) and not isinstance(value, bool):
        if not INT_MIN <= value <= INT_MAX:
            raise RemoteProtocolError(code, f"{what}: integer {summarize(value)} does not fit 64 signed bits")
    elif value is not None and not isinstance(value, (bool, float, str, bytes)):
        raise RemoteProtocolError(code, f"{what}: a {type(value).__name__} cannot be forwarded")


def _check_rows(arrays: Any, n: int, what: str, key: str, rows: str) -> None:
    """A map of string -> array, each with ``n`` rows."""
    if type(arrays) is not dict or len(arrays) > MAX_ARRAY_KEYS:
        raise malformed(f"{what}.{key} must be a map of key to array")
    for name, array in arrays.items():
        if type(name) is not str or not isinstance(array, np.ndarray):
            raise malformed(f"{what}.{key}: entry {summarize(name)} must map a string to an array")
        if not array.shape or array.shape[0] != n:
            raise malformed(f"{what}.{key}.{name} must have {rows}")


@dataclass(frozen=True, slots=True)
class StepData:
    """Outcome of one step for a set of rows (a game's group, or a policy's whole VecEnv).

    ``obs`` holds the observation to act on next. For rows whose episode just ended (``terminated`` or
    ``truncated``) that is already the next episode's first observation, and ``final_obs`` (rows listed
    in ``final_index``) holds the observation the episode ended on. ``infos`` is sparse: row -> map.

    Construction checks the structure (arrays, row counts, final rows, info rows); the wire's dtype and
    finiteness rules, and the free-form content of infos, are checked when decoding a peer's data.
    """

    obs: dict[str, np.ndarray]
    reward: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    final_index: np.ndarray | None = None
    final_obs: dict[str, np.ndarray] | None = None
    infos: dict[int, dict[str, Any]] = field(default_factory=dict)
    frames: np.ndarray | None = None  # int32 [n]: game ticks each transition spanned (hold mode)

    def __post_init__(self) -> None:
        what = "step data"
        reward = self.reward
        if not isinstance(reward, np.ndarray) or reward.ndim != 1:
            raise malformed(f"{what}.reward must be a 1-d array")
        rows = reward.shape
        n = rows[0]
        terminated, truncated = self.terminated, self.truncated
        if not isinstance(terminated, np.ndarray) or terminated.shape != rows:
            raise malformed(f"{what}.terminated must be a bool array of shape [{n}]")
        if not isinstance(truncated, np.ndarray) or truncated.shape != rows:
            raise malformed(f"{what}.truncated must be a bool array of shape [{n}]")
        _check_rows(self.obs, n, what, "obs", f"{n} rows like reward")
        index = self.final_index
        if index is not None and self.final_obs is not None:
            if not isinstance(index, np.ndarray) or index.ndim != 1:
                raise malformed(f"{what}.final.index must be a 1-d int32 array")
            _check_rows(self.final_obs, len(index), what, "final.obs", "one row per final index")
        infos = self.infos
        if not isinstance(infos, dict):
            raise malformed(f"{what}.infos must be a map of row to map")
        for row, info in infos.items():
            if not is_int(row) or not 0 <= row < n or not isinstance(info, dict):
                raise malformed(f"{what}.infos: entry {summarize(row)} must map a row in [0, {n}) to a map")
        frames = self.frames
        if frames is not None and (not isinstance(frames, np.ndarray) or frames.shape != rows):
            raise malformed(f"{what}.frames must be an int32 array of shape [{n}]")

    @classmethod
    def unchecked(
        cls,
        obs: dict[str, np.ndarray],
        reward: np.ndarray,
        terminated: np.ndarray,
        truncated: np.ndarray,
        final_index: np.ndarray | None = None,
        final_obs: dict[str, np.ndarray] | None = None,
        infos: dict[int, dict[str, Any]] | None = None,
        frames: np.ndarray | None = None,
    ) -> StepData:
        """Build from parts already checked (decoded from the wire, or cut and stacked from such data by the
        hub), without the construction check: the per-step path builds several of these per step."""
        data = _new(cls)
        _set(data, "obs", obs)
        _set(data, "reward", reward)
        _set(data, "terminated", terminated)
        _set(data, "truncated", truncated)
        _set(data, "final_index", final_index)
        _set(data, "final_obs", final_obs)
        _set(data, "infos", {} if infos is None else infos)
        _set(data, "frames", frames)
        return data

    @property
    def n_rows(self) -> int:
        return int(self.reward.shape[0])

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {
            "obs": encode_arrays(self.obs),
            "reward": encode_array(self.reward),
            "terminated": encode_array(self.terminated),
            "truncated": encode_array(self.truncated),
        }
        if self.final_index is not None and self.final_obs is not None and len(self.final_index):
            wire["final"] = {"index": encode_array(self.final_index), "obs": encode_arrays(self.final_obs)}
        if self.infos:
            wire["infos"] = self.infos
        if self.frames is not None:
            wire["frames"] = encode_array(self.frames)
        return wire

    @classmethod
    def from_wire(cls, obj: Any, what: str) -> StepData:
        if not isinstance(obj, dict):
            raise malformed(f"{what} must be a map")
        reward = decode_named_array(obj.get("reward"), what, "reward")
        terminated = decode_named_array(obj.get("terminated"), what, "terminated")
        truncated = decode_named_array(obj.get("truncated"), what, "truncated")
        if reward.ndim != 1 or reward.dtype != np.float32:
            raise malformed(f"{what}.reward must be a 1-d float32 array")
        check_finite(reward, f"{what}.reward", ErrorCode.BAD_STEP)
        n = reward.shape[0]
        for name, flags in (("terminated", terminated), ("truncated", truncated)):
            if flags.shape != (n,) or flags.dtype != np.bool_:
                raise malformed(f"{what}.{name} must be a bool array of shape [{n}]")
        obs = decode_named_arrays(obj.get("obs"), f"{what}.obs")
        for key, array in obs.items():
            if array.ndim < 1 or array.shape[0] != n:
                raise malformed(f"{what}.obs.{key} must have {n} rows like reward")
        final_index = final_obs = None
        final = obj.get("final")
        if final is not None:
            if not isinstance(final, dict):
                raise malformed(f"{what}.final must be a map")
            final_index = decode_array(final.get("index"), f"{what}.final.index")
            if final_index.ndim != 1 or final_index.dtype != np.int32:
                raise malformed(f"{what}.final.index must be a 1-d int32 array")
            if len(final_index) and (final_index.min() < 0 or final_index.max() >= n):
                raise malformed(f"{what}.final.index has rows outside [0, {n})")
            final_obs = decode_named_arrays(final.get("obs"), f"{what}.final.obs")
            for key, array in final_obs.items():
                if array.ndim < 1 or array.shape[0] != len(final_index):
                    raise malformed(f"{what}.final.obs.{key} must have one row per final index")
        infos = obj.get("infos", {})
        if not isinstance(infos, dict) or len(infos) > MAX_INFO_ENTRIES:
            raise malformed(f"{what}.infos must be a map of row to map")
        for row, info in infos.items():
            if not isinstance(row, int) or isinstance(row, bool) or not 0 <= row < n or not isinstance(info, dict):
                raise malformed(f"{what}.infos: entry {summarize(row)} must map a row in [0, {n}) to a map")
            check_info(info, f"{what}.infos[{row}]")
        frames = None
        if "frames" in obj:
            frames = decode_array(obj["frames"], f"{what}.frames")
            if frames.shape != (n,) or frames.dtype != np.int32:
                raise malformed(f"{what}.frames must be an int32 array of shape [{n}]")
        # every check above is stricter than __post_init__'s
        return cls.unchecked(obs, reward, terminated, truncated, final_index, final_obs, infos, frames)
