"""The godot_rl JSON wire, sans-IO: frames, space translation, and per-agent values <-> numpy arrays.

godot_rl sends one JSON object per frame (u32 little-endian length, then the text) and per-agent
values as lists of dicts, one dict per agent. Our hub works with one array per key for a whole group.
This module converts between the two, one key at a time, so that the per-agent work is a single
``tolist()`` or ``np.asarray`` per key.

godot_rl's conventions that matter here (``docs/migration.md`` and the protocol reference, section 2):

* A box observation ``{"size": [..], "space": "box"}`` is ``float32`` in [-1, 1] unless it names
  ``low``/``high``; a box whose key contains ``"2d"`` is an image: ``uint8`` in [0, 255] of shape ``size``,
  sent as a hex string of its bytes.
* ``{"size": n, "space": "discrete"}`` observations and ``{"size": n, "action_type": "discrete"}``
  actions are single integers; continuous actions are ``size`` floats.
* Text is ASCII with ``json.dumps``' default separators, and lengths count bytes.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from broker.protocol.errors import ErrorCode, LocalProtocolError, RemoteProtocolError, summarize
from broker.protocol.framing import DEFAULT_MAX_FRAME_BYTES, FrameDecoder, encode_frame
from broker.protocol.json_body import unpack_json
from broker.protocol.kinds import BodyKind, body_kind
from broker.protocol.limits import MAX_FRAME_ELEMENTS, MAX_NESTING
from broker.protocol.native import load_c
from broker.protocol.spaces import (
    BoxSpace,
    ContinuousAction,
    DiscreteAction,
    DiscreteSpace,
    PolicySpaces,
    check_finite,
)

GODOT_RL_MAJOR: Final = "0"
GODOT_RL_MINOR: Final = "7"
DEFAULT_POLICY: Final = "shared_policy"  # what godot_rl assumes when a plugin sends no policy names
IMAGE_MARK: Final = "2d"
FLOAT32_MAX: Final = float(np.finfo(np.float32).max)  # godot_rl's numbers all travel on as float32


def is_image_key(key: str) -> bool:
    """godot_rl decodes an observation key as a hex-encoded ``uint8`` image when its name contains "2d"."""
    return IMAGE_MARK in key


# --- frames ---------------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """json.dumps fallback for numpy values that reach an info map."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _json_text(obj: Any) -> bytes:
    """``json.dumps`` with its defaults (and numpy values made plain), as ASCII."""
    try:
        return json.dumps(obj, default=_plain).encode("ascii")
    except (TypeError, ValueError) as exc:
        raise LocalProtocolError(ErrorCode.INTERNAL, f"cannot encode a godot_rl message: {exc}") from None


def encode_message(obj: dict[str, Any]) -> bytes:
    """One frame exactly as godot_rl's Python side writes it: ``json.dumps`` defaults, ASCII, byte length."""
    return encode_frame(_json_text(obj))


class MessageDecoder:
    """Splits a byte stream into godot_rl JSON messages; anything that is not a JSON object is the peer's fault."""

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self._frames = FrameDecoder(max_frame_bytes)

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        self._frames.feed(data)

    def next_message(self) -> dict[str, Any] | None:
        body = self._frames.next_frame()
        if body is None:
            return None
        if body_kind(body) is not BodyKind.JSON:
            raise RemoteProtocolError(ErrorCode.MALFORMED, "expected a godot_rl JSON frame")
        return unpack_json(body)


def message_type(body: dict[str, Any]) -> str:
    kind = body.get("type")
    if not isinstance(kind, str):
        raise RemoteProtocolError(ErrorCode.MALFORMED, f"godot_rl message without a string 'type': {summarize(kind)}")
    return kind


def _field_list(body: dict[str, Any], key: str, n: int, what: str, code: ErrorCode) -> list[Any]:
    value = body.get(key)
    if not isinstance(value, list) or len(value) != n:
        got = f"{len(value)} entries" if isinstance(value, list) else repr(value)[:60]
        raise RemoteProtocolError(code, f"{what}: '{key}' must list {n} entries, one per agent; got {got}")
    return value


# --- spaces: godot_rl form -> ours ----------------------------------------------------------------


def _bad_spaces(message: str) -> RemoteProtocolError:
    return RemoteProtocolError(ErrorCode.BAD_SPACES, message)


def _shape(size: Any, what: str) -> list[int]:
    """godot_rl's box ``size`` is a shape list; older scripts send a bare length."""
    if isinstance(size, int) and not isinstance(size, bool):
        return [size]
    if isinstance(size, list):
        return size
    raise _bad_spaces(f"{what}.size must be a list of dimensions, got {summarize(size)}")


def observation_wire(key: str, space: Any, what: str) -> dict[str, Any]:
    """One godot_rl observation space as our wire form (validated later by ``PolicySpaces.from_wire``)."""
    if not isinstance(space, dict):
        raise _bad_spaces(f"{what}: expected a map, got {summarize(space)}")
    kind = space.get("space")
    if kind == "box":
        shape = _shape(space.get("size"), what)
        if is_image_key(key):
            return {"space": "box", "shape": shape, "dtype": "uint8", "low": 0.0, "high": 255.0}
        return {
            "space": "box",
            "shape": shape,
            "dtype": "float32",
            "low": space.get("low", -1.0),
            "high": space.get("high", 1.0),
        }
    if kind == "discrete":
        return {"space": "discrete", "n": space.get("size")}
    raise _bad_spaces(f"{what}: godot_rl knows observation spaces 'box' and 'discrete', got {summarize(kind)}")


def action_wire(space: Any, what: str) -> dict[str, Any]:
    if not isinstance(space, dict):
        raise _bad_spaces(f"{what}: expected a map, got {summarize(space)}")
    kind = space.get("action_type")
    if kind not in ("continuous", "discrete"):
        raise _bad_spaces(f"{what}: godot_rl knows action types 'continuous' and 'discrete', got {summarize(kind)}")
    return {"action_type": kind, "size": space.get("size")}


def policy_spaces_from_godot(observation: Any, action: Any, what: str) -> PolicySpaces:
    """One agent's godot_rl ``observation_space``/``action_space`` entries as our PolicySpaces."""
    if not isinstance(observation, dict) or not isinstance(action, dict):
        raise _bad_spaces(f"{what}: observation and action spaces must be maps of key to space")
    obs = {str(k): observation_wire(str(k), v, f"{what}.observation_space.{k}") for k, v in observation.items()}
    act = {str(k): action_wire(v, f"{what}.action_space.{k}") for k, v in action.items()}
    return PolicySpaces.from_wire(obs, act, what)


# --- spaces: ours -> godot_rl form ----------------------------------------------------------------


def godot_spaces(spaces: PolicySpaces, policy: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """One agent's spaces as a godot_rl plugin would announce them. Raises ValueError for spaces that
    godot_rl cannot express (multi-discrete, or a "2d" key that is not a uint8 box)."""
    observation: dict[str, Any] = {}
    for key, space in spaces.observation:
        if isinstance(space, BoxSpace):
            if is_image_key(key) and space.dtype != "uint8":
                raise ValueError(
                    f"policy '{policy}': observation '{key}' contains \"2d\", so godot_rl reads it as a uint8 "
                    f"image, but it is {space.dtype}; rename the key"
                )
            entry: dict[str, Any] = {"size": list(space.shape), "space": "box"}
            if not is_image_key(key) and math.isfinite(space.low) and math.isfinite(space.high):
                entry["low"], entry["high"] = space.low, space.high
            observation[key] = entry
        elif isinstance(space, DiscreteSpace):
            observation[key] = {"size": space.n, "space": "discrete"}
        else:
            raise ValueError(f"policy '{policy}': godot_rl has no multi-discrete observations ('{key}')")
    action: dict[str, Any] = {}
    for key, act in spaces.action:
        if isinstance(act, ContinuousAction):
            action[key] = {"size": act.size, "action_type": "continuous"}
        elif isinstance(act, DiscreteAction):
            action[key] = {"size": act.n, "action_type": "discrete"}
        else:
            raise ValueError(f"policy '{policy}': godot_rl has no multi-discrete actions ('{key}')")
    return observation, action


# --- values: per-agent dicts -> arrays ------------------------------------------------------------


def decode_rows(
    spaces: PolicySpaces, rows: list[Any], what: str, code: ErrorCode = ErrorCode.BAD_STEP
) -> dict[str, np.ndarray]:
    """Per-agent observation dicts (godot_rl form) -> one array per key with a leading row axis."""
    n = len(rows)
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise RemoteProtocolError(code, f"{what}[{i}] must be a map of observation key to value")
    out: dict[str, np.ndarray] = {}
    for key, space in spaces.observation:
        try:
            values = [row[key] for row in rows]
        except KeyError:
            missing = next(i for i, row in enumerate(rows) if key not in row)
            raise RemoteProtocolError(code, f"{what}[{missing}] lacks observation '{key}'") from None
        out[key] = _decode_values(key, space, values, n, f"{what}.{key}", code)
    return out


def _decode_values(key: str, space: Any, values: list[Any], n: int, what: str, code: ErrorCode) -> np.ndarray:
    if isinstance(space, BoxSpace) and is_image_key(key):
        length = 2 * math.prod(space.shape)
        if not all(isinstance(v, str) and len(v) == length for v in values):
            raise RemoteProtocolError(code, f"{what}: every agent's image must be a hex string of {length} characters")
        try:
            raw = bytes.fromhex("".join(values))
        except ValueError:
            raise RemoteProtocolError(code, f"{what}: image is not a hex string") from None
        return np.frombuffer(raw, np.uint8).reshape(n, *space.shape)
    if isinstance(space, DiscreteSpace):
        array = _numbers(values, what, code)
        if array.shape != (n,):
            raise RemoteProtocolError(code, f"{what}: a discrete observation is one integer per agent")
        return _discrete(array, space.n, what, code)
    assert isinstance(space, BoxSpace)
    array = _numbers(values, what, code)
    size = math.prod(space.shape)
    if array.size != n * size:
        raise RemoteProtocolError(code, f"{what}: expected {size} numbers per agent (shape {list(space.shape)})")
    return array.reshape(n, *space.shape).astype(space.dtype)


def _numbers(values: Any, what: str, code: ErrorCode) -> np.ndarray:
    """Numbers (nested lists of them) as float64: JSON numbers only, never numeric strings, and finite."""
    try:
        array = np.asarray(values)
    except (TypeError, ValueError):  # ragged lists
        raise RemoteProtocolError(code, f"{what}: expected numbers, got {summarize(values)}") from None
    if array.dtype.kind not in "biuf":  # strings ("1.5" is not a reward), maps, None, ragged objects
        raise RemoteProtocolError(code, f"{what}: expected numbers, got {summarize(values)}")
    array = array.astype(np.float64)
    check_finite(array, what, code)
    if array.size and np.abs(array).max() > FLOAT32_MAX:  # would become an infinity as float32
        raise RemoteProtocolError(code, f"{what}: values must be finite as float32 (|x| <= {FLOAT32_MAX:.3g})")
    return array


def _discrete(array: np.ndarray, n: int, what: str, code: ErrorCode) -> np.ndarray:
    """Whole numbers in [0, n) as int32, checked before the cast so that no value wraps into range."""
    if not np.all(np.mod(array, 1) == 0):
        raise RemoteProtocolError(code, f"{what}: expected one integer per agent")
    if array.size and (array.min() < 0 or array.max() >= n):
        raise RemoteProtocolError(code, f"{what}: values must lie in [0, {n})")
    return array.astype(np.int32)


def decode_numbers(values: Any, n: int, what: str, code: ErrorCode) -> np.ndarray:
    """A list of ``n`` plain numbers (rewards) as float64."""
    if not isinstance(values, list) or len(values) != n:
        raise RemoteProtocolError(code, f"{what}: expected a list of {n} numbers")
    array = _numbers(values, what, code)
    if array.shape != (n,):
        raise RemoteProtocolError(code, f"{what}: expected one number per agent")
    return array


def decode_flags(values: Any, n: int, what: str, code: ErrorCode) -> np.ndarray:
    """godot_rl's ``done``: bools (or 0/1) per agent."""
    if not isinstance(values, list) or len(values) != n or not all(isinstance(v, (bool, int, float)) for v in values):
        raise RemoteProtocolError(code, f"{what}: expected a list of {n} booleans")
    return np.asarray(values, dtype=np.float64) != 0


def decode_actions(spaces: PolicySpaces, rows: list[Any], what: str) -> dict[str, np.ndarray]:
    """Per-agent action dicts from a godot_rl trainer -> one wire-dtype array per key."""
    n = len(rows)
    out: dict[str, np.ndarray] = {}
    keys = {key for key, _ in spaces.action}
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or set(row) != keys:
            raise RemoteProtocolError(ErrorCode.BAD_ACTIONS, f"{what}[{i}] must map exactly the keys {sorted(keys)}")
    for key, space in spaces.action:
        array = _numbers([row[key] for row in rows], f"{what}.{key}", ErrorCode.BAD_ACTIONS)
        if isinstance(space, ContinuousAction):
            if array.shape != (n, space.size):
                raise RemoteProtocolError(
                    ErrorCode.BAD_ACTIONS, f"{what}.{key}: expected {space.size} floats per agent"
                )
            out[key] = array.astype(np.float32)
        else:
            array = array.reshape(-1) if array.shape == (n, 1) else array  # a one-element list is tolerated
            if array.shape != (n,):
                raise RemoteProtocolError(ErrorCode.BAD_ACTIONS, f"{what}.{key}: expected one integer per agent")
            assert isinstance(space, DiscreteAction)
            out[key] = _discrete(array, space.n, f"{what}.{key}", ErrorCode.BAD_ACTIONS)
    return out


# --- values: arrays -> per-agent dicts ------------------------------------------------------------


def encode_rows(spaces: PolicySpaces, obs: dict[str, np.ndarray], hex_images: bool = True) -> list[dict[str, Any]]:
    """One array per key -> per-agent dicts in key order. Images become hex strings unless ``hex_images``
    is False (then nested lists, which SB3 can read straight from an info map)."""
    columns: list[tuple[str, list[Any]]] = []
    n = 0
    for key, space in spaces.observation:
        array = np.asarray(obs[key])
        n = array.shape[0]
        if hex_images and isinstance(space, BoxSpace) and is_image_key(key):
            raw = np.ascontiguousarray(array, np.uint8).reshape(n, -1)
            columns.append((key, [row.tobytes().hex() for row in raw]))
        elif array.dtype.kind == "f":
            columns.append((key, array.astype(np.float64).tolist()))
        else:
            columns.append((key, array.tolist()))
    return [{key: values[i] for key, values in columns} for i in range(n)]


def encode_actions(spaces: PolicySpaces, actions: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    """One array per action key -> per-agent dicts: continuous as float lists, discrete as ints."""
    columns: list[tuple[str, list[Any]]] = []
    n = 0
    for key, space in spaces.action:
        array = np.asarray(actions[key])
        n = array.shape[0]
        if isinstance(space, ContinuousAction):
            # A diverged policy may produce NaN; Godot's JSON parser has no NaN, so send a neutral action.
            values = np.nan_to_num(array.astype(np.float64), nan=0.0, posinf=1.0, neginf=-1.0)
            columns.append((key, values.reshape(n, space.size).tolist()))
        else:
            columns.append((key, array.astype(np.int64).reshape(n).tolist()))
    return [{key: values[i] for key, values in columns} for i in range(n)]


# --- the same in C: one game's replies straight into arrays, its action requests from them ----------------


_C: Final[Any] = load_c("broker.legacy._wire")  # _wire.c, or None (then the Python way above)


@functools.lru_cache(maxsize=1024)
def _key_prefix(key: str) -> bytes:
    """``"key": `` as json.dumps writes a map's key, for _wire.c to put before the key's value."""
    return (json.dumps(key) + ": ").encode("ascii")


_FLOATS: Final = 0  # _wire.c's kinds of observation key
_HEX: Final = 1


@dataclass(frozen=True)
class ReplyPlan:
    """Where each agent of one game sits (its group, its row there) and what its group's keys are, in the form
    ``_wire.c`` reads; built once, from the game's ``env_info``."""

    agent_group: bytes  # int32 per agent
    agent_row: bytes  # int32 per agent
    read: tuple[tuple[int, tuple[tuple[bytes, int, int], ...]], ...] | None  # None: a key C does not read
    shapes: tuple[tuple[tuple[int, ...], ...], ...]  # per group, per observation key: a row's shape
    actions: tuple[tuple[int, tuple[bytes, ...], bytes, tuple[int, ...]], ...]  # rows, '"key": ', kinds, widths


def reply_plan(groups: Sequence[tuple[PolicySpaces, Sequence[int]]], n_agents: int) -> ReplyPlan | None:
    """The plan for a game whose groups are (spaces, agent indices) in group order; None without ``_wire.c``."""
    if _C is None:
        return None
    group_of = np.zeros(n_agents, np.int32)
    row_of = np.zeros(n_agents, np.int32)
    read: list[tuple[int, tuple[tuple[bytes, int, int], ...]]] | None = []
    shapes = []
    actions = []
    for index, (spaces, agents) in enumerate(groups):
        group_of[list(agents)] = index
        row_of[list(agents)] = np.arange(len(agents))
        keys = []
        for key, space in spaces.observation:
            if json.dumps(key)[1:-1] != key or not isinstance(space, BoxSpace):
                read = None  # discrete observations, keys JSON escapes: the Python way
                break
            if is_image_key(key):
                kind = _HEX
            elif space.dtype == "float32":
                kind = _FLOATS
            else:
                read = None
                break
            keys.append((key.encode("ascii"), kind, math.prod(space.shape)))
        if read is not None:
            read.append((len(agents), tuple(keys)))
        shapes.append(tuple(space.row_shape for _, space in spaces.observation))
        prefixes = tuple(_key_prefix(key) for key, _ in spaces.action)
        kinds = b"".join(b"c" if isinstance(space, ContinuousAction) else b"d" for _, space in spaces.action)
        widths = tuple(space.size if isinstance(space, ContinuousAction) else 1 for _, space in spaces.action)
        if any(not isinstance(space, (ContinuousAction, DiscreteAction)) for _, space in spaces.action):
            return None
        actions.append((len(agents), prefixes, kinds, widths))
    return ReplyPlan(
        group_of.tobytes(), row_of.tobytes(), None if read is None else tuple(read), tuple(shapes), tuple(actions)
    )


@dataclass(frozen=True)
class Reply:
    """A step or reset reply as read by ``_wire.c``: arrays per group in key order, and the non-empty infos."""

    observations: list[list[np.ndarray]]
    reward: np.ndarray | None  # float32 per agent; None for a reset reply
    done: np.ndarray | None  # bool per agent
    info_spans: list[tuple[int, int, int]]  # (agent, start, end) of each non-empty info map in the body


def read_reply(plan: ReplyPlan, body: bytes | memoryview, first: bool) -> Reply | None:
    """A ``reset`` (first) or ``step`` reply read in C, or None: not in what C reads, so the Python way decides."""
    if plan.read is None:
        return None
    found = _C.read_step(body, first, (plan.agent_group, plan.agent_row, plan.read), MAX_FRAME_ELEMENTS, MAX_NESTING)
    if found is None:
        return None
    observations, reward, done, spans = found
    for arrays, shapes in zip(observations, plan.shapes, strict=True):
        for k, shape in enumerate(shapes):
            if len(shape) != 1:
                arrays[k] = arrays[k].reshape(-1, *shape)
    return Reply(observations, reward, done, spans)


def write_actions(
    plan: ReplyPlan, actions: Sequence[dict[str, np.ndarray]], spaces: Sequence[PolicySpaces]
) -> bytes | None:
    """The ``action`` request frame from each group's actions, byte for byte what ``encode_message`` writes
    from ``encode_actions``' rows; None when an array is not in a form C reads (the Python way writes it)."""
    groups = tuple(
        (*layout, tuple(group[key] for key, _ in group_spaces.action))
        for layout, group, group_spaces in zip(plan.actions, actions, spaces, strict=True)
    )
    frame: bytes | None = _C.write_actions(plan.agent_group, plan.agent_row, groups)
    return frame


def write_reply(
    spaces: PolicySpaces,
    obs: dict[str, np.ndarray],
    reward: np.ndarray | None,
    done: np.ndarray | None,
    infos: dict[int, dict[str, Any]],
) -> bytes | None:
    """A ``reset`` (``reward`` None) or ``step`` reply to a godot_rl script, written by ``_wire.c`` byte for byte
    as ``encode_message`` writes the dict of ``encode_rows``' rows, the rewards, the done flags and one info per
    row (``infos``: the non-empty ones by row). None when an array is not in a form C writes (the Python way
    then writes it)."""
    if _C is None:
        return None
    columns = []
    rows = 0
    for key, space in spaces.observation:
        array = np.asarray(obs[key])
        rows = array.shape[0]
        prefix = _key_prefix(key)
        if isinstance(space, BoxSpace) and is_image_key(key):
            columns.append((prefix, "x", math.prod(array.shape[1:]), array))
        elif array.dtype.kind == "f" and array.ndim == 2:
            columns.append((prefix, "f", array.shape[1], array))
        elif array.dtype.kind == "i" and array.ndim == 1:
            columns.append((prefix, "i", 1, array))
        else:
            return None  # nested rows, booleans, unsigned integers: encode_rows' tolist
    texts = {row: _json_text(info) for row, info in infos.items() if info}
    frame: bytes | None = _C.write_reply(reward is None, rows, tuple(columns), reward, done, texts)
    return frame
