"""The C codec of the per-step messages (broker/protocol/_native.c) against hot.py's Python way: the same
bytes out, the same messages in, nothing accepted that the general way refuses, large arrays by reference.
Godot Variant bodies (the addon's) too: the C way's message is the general way's (variant.py, then the
message table), for the shared vectors, random messages and damaged bodies.

The README's set-up builds it; ``.ci/run`` sets ``GDRL_REQUIRE_COMPILED=1``, so there these tests fail rather
than skip when it is missing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import clients.vec_env
from broker.protocol import hot, variant
from broker.protocol.codec import BodyKind, encode_message_frame
from broker.protocol.errors import ErrorCode, RemoteProtocolError
from broker.protocol.framing import HEADER
from broker.protocol.messages import Batch, GameActions, GameStep, Message, StepData, TrainerAct, message_from_wire
from broker.protocol.spaces import check_finite
from tests.test_hot import HOT_TYPES, HOT_VECTORS, _general, _has_infos, _messages, _read_only, _same, damaged

NATIVE: Any = hot._NATIVE


@pytest.fixture(autouse=True)
def native_built() -> None:
    if NATIVE is not None:
        return
    reason = "the C codec is not in use (a pure build, GDRL_BROKER_PURE=1, or a stale build)"
    if os.environ.get("GDRL_REQUIRE_COMPILED") == "1":
        pytest.fail(f"GDRL_REQUIRE_COMPILED=1 but {reason}")
    pytest.skip(reason)


def _frame(message: Message) -> bytes:
    return encode_message_frame(BodyKind.MSGPACK, message.to_wire())


def _decodes_as_the_python_way(body: bytes) -> Message | None:
    """The C way's message for ``body``, having checked it is the Python way's (or both decline)."""
    native = NATIVE.decode(body)
    typed = hot.decode_typed(body)
    assert (native is None) == (typed is None)
    if native is not None:
        assert _same(native, typed)
    return native


def test_hot_py_and_the_finite_check_take_the_c_way() -> None:
    from broker.protocol import spaces

    assert spaces._NATIVE is NATIVE and NATIVE.__file__.endswith(".so")


@pytest.mark.parametrize("vector", HOT_VECTORS, ids=lambda v: v["name"])
def test_every_hot_vector_decodes_and_encodes_as_the_python_way(vector: dict[str, Any]) -> None:
    frame = bytes.fromhex(vector["hex"])
    body = frame[HEADER.size :]
    native = _decodes_as_the_python_way(body)
    if native is not None:
        assert NATIVE.encode(native, -1, False) == [frame]


@settings(max_examples=400, deadline=None)
@given(_messages)
def test_random_messages_encode_to_the_same_bytes_and_decode_to_the_same_message(message: Message) -> None:
    frame = _frame(message)
    encoded = NATIVE.encode(message, -1, False)
    if _has_infos(message):
        assert encoded is None  # free-form infos: the Python way
    else:
        assert encoded == [frame]
    _decodes_as_the_python_way(frame[HEADER.size :])


@settings(max_examples=2000, deadline=None)
@given(_messages, st.data())
def test_a_damaged_body_is_never_accepted_by_the_c_way_alone(message: Message, data: st.DataObject) -> None:
    frozen = damaged(message, data)
    native = NATIVE.decode(frozen)
    if native is None:
        return
    try:
        general: Message | None = _general(frozen)
    except RemoteProtocolError:
        general = None
    assert general is not None, f"the C way accepted a body the general way refuses: {frozen.hex()}"
    assert _same(native, general)


def _step(rows: int = 2) -> StepData:
    return StepData(
        {"obs": np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)},
        np.zeros(rows, np.float32),
        np.zeros(rows, np.bool_),
        np.zeros(rows, np.bool_),
    )


def test_a_fixed_width_tick_and_keys_out_of_order() -> None:
    """A game may patch its tick into a uint32 (benchmarks/lean_game.py); keys in another order go the Python way."""
    body = bytearray(_frame(GameStep(5, {"a": _step()}))[HEADER.size :])
    at = body.index(b"\xa4tick") + len(b"\xa4tick")
    body[at : at + 1] = b"\xce\x00\x00\x00\x05"
    message = NATIVE.decode(bytes(body))
    assert isinstance(message, GameStep) and message.tick == 5 and _same(message, _general(bytes(body)))
    reordered = hot._ENCODER.encode({"type": "step", "groups": {}, "tick": 1})
    assert NATIVE.decode(reordered) is None


def test_arrays_are_views_of_the_body_writable_only_when_it_is() -> None:
    body = _frame(GameStep(1, {"a": _step()}))[HEADER.size :]
    read_only = NATIVE.decode(body)
    assert not read_only.groups["a"].obs["obs"].flags.writeable
    owned = memoryview(bytearray(body))
    writable = NATIVE.decode(owned)
    obs = writable.groups["a"].obs["obs"]
    assert obs.flags.writeable and np.shares_memory(obs, np.frombuffer(owned, np.uint8))
    assert hot.decode_typed(owned).groups["a"].obs["obs"].flags.writeable  # as the Python way gives them


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_reward_that_is_not_finite_goes_the_python_way_which_refuses_it(bad: float) -> None:
    data = _step()
    reward = np.array([0.0, bad], np.float32)
    message = GameStep(1, {"a": StepData(data.obs, reward, data.terminated, data.truncated)})
    body = _frame(message)[HEADER.size :]
    assert NATIVE.decode(body) is None and hot.decode_typed(body) is None
    with pytest.raises(RemoteProtocolError):
        _general(body)


def test_what_the_c_way_does_not_encode_the_python_way_does_to_the_same_bytes() -> None:
    rows = 4
    wide = np.arange(rows * 6, dtype=np.float32).reshape(rows, 6)
    for obs in (wide[:, ::2], wide.astype(">f4")):  # not contiguous, big-endian: the general rules copy them
        data = StepData({"obs": obs}, np.zeros(rows, np.float32), np.zeros(rows, np.bool_), np.zeros(rows, np.bool_))
        message = Batch(3, data)
        assert NATIVE.encode(message, -1, False) is None
        assert hot.encode_hot_frame(message) == _frame(message)
    act = TrainerAct(2, {"x": np.array(0.5, np.float32)})  # a 0-d array: the general rules make it 1-d
    assert NATIVE.encode(act, -1, False) is None and hot.encode_hot_frame(act) == _frame(act)


@pytest.mark.parametrize("writable_too", [False, True])
def test_large_arrays_go_by_reference_and_join_to_the_same_bytes(writable_too: bool) -> None:
    big = _read_only(np.arange(400 * 64, dtype=np.float32).reshape(400, 64))
    writable = np.ones((400, 64), np.float32)
    final_obs = {"obs": _read_only(np.full((2, 64), 7, np.float32)), "other": np.zeros((2, 64), np.float32)}
    index = np.array([1, 5], np.int32)
    data = StepData(
        {"obs": big, "other": writable}, np.zeros(400, np.float32), np.zeros(400, np.bool_), np.ones(400, np.bool_),
        index, final_obs, {}, np.ones(400, np.int32),
    )  # fmt: skip
    for message in (Batch(7, data, "red"), GameStep(9, {"a": data, "b": data})):
        frame = _frame(message)
        parts = NATIVE.encode(message, 16 * 1024, writable_too)
        assert parts is not None and b"".join(bytes(p) for p in parts) == frame
        referenced = [p for p in parts if isinstance(p, memoryview)]
        per_message = 2 if writable_too else 1
        assert len(referenced) == per_message * (2 if isinstance(message, GameStep) else 1)
        assert np.shares_memory(np.frombuffer(referenced[0], np.float32), big)
        typed = hot.typed_frame_buffers(message, 16 * 1024, writable_too)
        assert typed is not None and [bytes(p) for p in parts] == [bytes(p) for p in typed]  # the same pieces
        assert _same(NATIVE.decode(frame[HEADER.size :]), _general(frame[HEADER.size :]))


def test_actions_to_a_game_and_an_act_from_a_sampler() -> None:
    groups = {"red": {"move": np.ones((3, 2), np.float32)}, "blue": {"pick": np.arange(3, dtype=np.int32)}}
    actions = GameActions(12, groups)
    act = TrainerAct(4, {"move": np.zeros((5, 2), np.float32)}, "red")
    for message in (actions, act, GameActions(0, {})):
        frame = _frame(message)
        assert NATIVE.encode(message, -1, False) == [frame]
        assert _same(NATIVE.decode(frame[HEADER.size :]), _general(frame[HEADER.size :]))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_all_finite_reads_float_arrays_and_leaves_the_rest(dtype: type) -> None:
    values = np.zeros((3, 4), dtype)
    assert NATIVE.all_finite(values) is True
    for bad in (np.nan, np.inf, -np.inf):
        spoiled = values.copy()
        spoiled[2, 3] = bad
        assert NATIVE.all_finite(spoiled) is False
        with pytest.raises(RemoteProtocolError, match="finite"):
            check_finite(spoiled, "obs", ErrorCode.BAD_STEP)
    assert NATIVE.all_finite(values[:, ::2]) is None  # not contiguous: numpy decides
    raw = bytearray(values.nbytes + 1)  # a view at an odd offset, as arrays in a frame often are
    unaligned = np.frombuffer(raw, dtype, count=values.size, offset=1)
    assert not unaligned.flags.aligned and NATIVE.all_finite(unaligned) is True
    unaligned[-1] = np.nan
    assert NATIVE.all_finite(unaligned) is False
    assert NATIVE.all_finite(np.zeros(3, np.int32)) is None
    assert NATIVE.all_finite(values.astype(values.dtype.newbyteorder(">"))) is None
    strided = np.full((3, 4), np.nan, dtype)[:, ::2]
    with pytest.raises(RemoteProtocolError, match="finite"):
        check_finite(strided, "obs", ErrorCode.BAD_STEP)


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_the_episode_end_questions_answer_as_numpy_does(data: st.DataObject) -> None:
    from broker.core.accumulate import _as_is

    n = data.draw(st.integers(0, 6))
    terminated = np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), np.bool_)
    truncated = np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), np.bool_)
    index = None
    if data.draw(st.booleans()):
        index = np.array(sorted(data.draw(st.sets(st.integers(0, max(n - 1, 0)), max_size=n))), np.int32)
    final_obs = None if index is None or data.draw(st.booleans()) else {"obs": np.zeros((len(index), 2), np.float32)}
    ended = terminated | truncated
    assert NATIVE.ended_rows(terminated, truncated) == int(np.count_nonzero(ended))
    if not ended.any():
        expected = index is None or len(index) == 0
    elif index is None or final_obs is None or (terminated & truncated).any():
        expected = False
    else:
        expected = len(index) == int(np.count_nonzero(ended)) and bool(ended[index].all())
    assert NATIVE.as_is(terminated, truncated, index, final_obs) is expected
    step = StepData({"obs": np.zeros((n, 2), np.float32)}, np.zeros(n, np.float32), terminated, truncated)
    assert _as_is(step) is (not ended.any())
    assert NATIVE.ended_rows(terminated.astype(np.int8), truncated) is None  # not flags: numpy's way


def _layouts() -> st.SearchStrategy[tuple[tuple[str, Any], ...]]:
    from broker.protocol.spaces import BoxSpace, DiscreteAction, MultiDiscreteAction, MultiDiscreteSpace

    space = st.one_of(
        st.builds(BoxSpace, st.sampled_from([(), (3,), (2, 2)]), st.sampled_from(["float32", "float64", "uint8"])),
        st.builds(DiscreteAction, st.integers(1, 4)),
        st.builds(MultiDiscreteAction, st.sampled_from([(2,), (3, 2)])),
        st.builds(MultiDiscreteSpace, st.sampled_from([(4, 1)])),
    )
    return st.lists(space, min_size=1, max_size=3).map(lambda spaces: tuple((f"k{i}", s) for i, s in enumerate(spaces)))


def _arrays_for(layout: tuple[tuple[str, Any], ...], n: int, data: st.DataObject) -> dict[str, np.ndarray]:
    from broker.protocol.arrays import DTYPES
    from broker.protocol.spaces import value_bound

    arrays = {}
    for key, space in layout:
        bound = value_bound(space)
        high = 1 if bound is None else (bound if isinstance(bound, int) else min(bound))
        values = data.draw(st.lists(st.integers(0, high), min_size=1, max_size=1))[0]  # high: one past the range
        arrays[key] = np.full((n, *space.row_shape), values, DTYPES[space.wire_dtype])
    spoil = data.draw(st.sampled_from(["none", "dtype", "rows", "nan", "order", "extra", "missing", "strided"]))
    key = data.draw(st.sampled_from([k for k, _ in layout]))
    if spoil == "dtype":
        arrays[key] = arrays[key].astype(np.int64 if arrays[key].dtype.kind == "f" else np.float32)
    elif spoil == "rows":
        arrays[key] = arrays[key][: max(n - 1, 0)]
    elif spoil == "nan" and arrays[key].dtype.kind == "f" and arrays[key].size:
        arrays[key].flat[-1] = np.nan
    elif spoil == "order":
        arrays = dict(reversed(arrays.items()))
    elif spoil == "extra":
        arrays["extra"] = np.zeros(n, np.float32)
    elif spoil == "missing":
        del arrays[key]
    elif spoil == "strided":
        arrays[key] = np.repeat(arrays[key], 2, axis=0)[::2]
    return arrays


@settings(max_examples=600, deadline=None)
@given(_layouts(), st.integers(0, 4), st.data())
def test_rows_match_accepts_exactly_the_usual_case_of_what_check_rows_accepts(
    layout: tuple[tuple[str, Any], ...], n: int, data: st.DataObject
) -> None:
    """The C check only ever accepts, and it accepts only what check_rows accepts: a refusal is always
    check_rows' own (its code and words). What check_rows accepts in the announced key order, contiguous, the
    C check accepts too, so that the usual step takes one call."""
    from broker.protocol.spaces import check_layout, check_rows, rows_as_announced

    arrays = _arrays_for(layout, n, data)
    matched = NATIVE.rows_match(arrays, check_layout(layout), n)
    assert matched in (True, None)
    try:
        check_rows(arrays, layout, n, "obs", ErrorCode.BAD_STEP)
        accepted = True
    except RemoteProtocolError as exc:
        assert exc.code is ErrorCode.BAD_STEP
        accepted = False
    assert not matched or accepted
    usual = list(arrays) == [k for k, _ in layout] and all(a.flags.c_contiguous for a in arrays.values())
    if accepted and usual:
        assert matched is True and rows_as_announced(arrays, check_layout(layout), n)


def test_the_hub_checks_take_the_c_way_for_a_usual_step_and_act() -> None:
    from broker.protocol import checks
    from broker.protocol.spaces import BoxSpace, ContinuousAction, GroupSpec, PolicySpaces

    spaces = PolicySpaces((("obs", BoxSpace((4,))),), (("move", ContinuousAction(2)),))
    flags = np.zeros(3, bool)
    data = StepData({"obs": np.zeros((3, 4), np.float32)}, np.zeros(3, np.float32), flags, flags)
    assert checks._as_announced(GameStep(0, {"p": data}), {"p": GroupSpec("p", 3, spaces)})
    assert not checks._as_announced(GameStep(0, {"p": data}), {"p": GroupSpec("p", 2, spaces)})
    act = TrainerAct(1, {"move": np.zeros((3, 2), np.float32)})
    assert checks.check_actions(act, "p", spaces, 3) is act.actions  # already canonical: no copy, no new map
    wide = TrainerAct(1, {"move": np.zeros((3, 2), np.float64)})
    assert checks.check_actions(wide, "p", spaces, 3)["move"].dtype == np.float32  # the Python way casts


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from([np.float32, np.float64, np.uint8, np.int32, np.bool_]),
    st.lists(st.integers(0, 5), min_size=1, max_size=5),
    st.sampled_from([(), (3,), (2, 3)]),
    st.booleans(),
)
def test_stack_is_numpy_s_concatenate(dtype: Any, rows: list[int], row_shape: tuple[int, ...], read_only: bool) -> None:
    rng = np.random.default_rng(len(rows))
    parts = [(rng.random((n, *row_shape)) * 10).astype(dtype) for n in rows]
    stacked = NATIVE.stack(parts, read_only)
    expected = np.concatenate(parts)
    assert stacked.dtype == expected.dtype and stacked.shape == expected.shape
    assert np.array_equal(stacked, expected) and stacked.flags.writeable is not read_only
    assert not any(np.shares_memory(stacked, p) for p in parts)
    indexes = [np.arange(n, dtype=np.int32) for n in rows]
    offsets = np.cumsum([0, *rows[:-1]]).tolist()
    moved = NATIVE.stack_index(indexes, offsets)
    assert moved.dtype == np.int32 and moved.tolist() == list(range(sum(rows)))


def test_stack_leaves_what_it_does_not_take_to_numpy() -> None:
    a = np.zeros((2, 3), np.float32)
    assert NATIVE.stack([], False) is None
    assert NATIVE.stack([a, a.astype(np.float64)], False) is None  # mixed dtypes: numpy decides how
    assert NATIVE.stack([a, np.zeros((2, 4), np.float32)], False) is None  # rows differ: numpy words the error
    assert NATIVE.stack([a, a[:, ::2]], False) is None  # not contiguous
    assert NATIVE.stack([a, a.astype(a.dtype.newbyteorder(">"))], False) is None
    assert NATIVE.stack([a, [1.0, 2.0, 3.0]], False) is None
    with_refs = np.zeros(2, [("obs", np.float32), ("tag", object)])
    assert NATIVE.stack([with_refs, with_refs], False) is None  # object references: numpy counts them
    days, seconds = np.zeros(2, "datetime64[D]"), np.zeros(2, "datetime64[s]")
    assert NATIVE.stack([days, seconds], False) is None  # one type number, two units: numpy converts
    index = np.zeros(2, np.int32)
    assert NATIVE.stack_index([index], [0, 1]) is None  # an offset per part
    assert NATIVE.stack_index([index.astype(np.int64)], [0]) is None
    assert NATIVE.stack_index([np.full(1, 2**31 - 1, np.int32)], [1]) is None  # past int32: numpy's way


def test_the_per_step_messages_built_in_c_are_the_unchecked_constructors() -> None:
    from broker.protocol.hot import new_act, new_batch, new_game_actions, new_step_data

    obs, reward, flags = {"obs": np.zeros((2, 3), np.float32)}, np.zeros(2, np.float32), np.zeros(2, bool)
    data = new_step_data(obs, reward, flags, flags, None, None, {}, None)
    assert _same(data, StepData.unchecked(obs, reward, flags, flags))
    assert _same(new_batch(4, data, "p"), Batch.unchecked(4, data, "p"))
    assert _same(new_game_actions(5, {"p": obs}), GameActions.unchecked(5, {"p": obs}))
    assert _same(new_act(6, obs, ""), TrainerAct.unchecked(6, obs, ""))
    with pytest.raises(TypeError):
        NATIVE.new(Batch, 4, data)  # every field given
    with pytest.raises(TypeError):
        NATIVE.new(dict, 4, data, "p")  # only the configured message classes


def test_configure_refuses_message_classes_it_would_build_wrong() -> None:
    """The C way builds messages field by field; a class with other fields fails at configure, not later."""
    from dataclasses import dataclass

    from broker.protocol.arrays import DTYPES

    @dataclass(frozen=True, slots=True)
    class Renamed:
        tick: int
        groupz: dict[str, Any]

    limits = {"max_array_keys": 64, "max_text": 512, "max_groups": 64, "max_ndim": 8, "int_max": 2**63 - 1}
    with pytest.raises(ValueError, match="other fields"):
        NATIVE.configure(StepData, Renamed, Batch, TrainerAct, GameActions, DTYPES, limits)
    body = _frame(GameStep(3, {"a": _step()}))[HEADER.size :]
    assert type(NATIVE.decode(body)) is GameStep  # the refused call changed nothing


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_returns_add_up_and_end_with_their_episodes_as_numpy_does(data: st.DataObject) -> None:
    n = data.draw(st.integers(0, 6))
    rewards = np.array(data.draw(st.lists(st.floats(-10, 10, width=32), min_size=n, max_size=n)), np.float32)
    terminated = np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), np.bool_)
    truncated = np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), np.bool_)
    start = np.array(data.draw(st.lists(st.floats(-100, 100), min_size=n, max_size=n)), np.float64)
    returns, expected = start.copy(), start.copy()
    finished = NATIVE.add_returns(returns, rewards, terminated, truncated)
    expected += rewards
    ended = terminated | truncated
    assert finished == expected[ended].tolist()
    expected[ended] = 0.0
    assert np.array_equal(returns, expected)
    assert NATIVE.add_returns(returns.astype(np.float32), rewards, terminated, truncated) is None  # not float64
    frozen = returns.copy()
    frozen.flags.writeable = False
    assert NATIVE.add_returns(frozen, rewards, terminated, truncated) is None


@pytest.mark.parametrize("with_frames", [False, True])
def test_sb3_step_ends_are_numpy_s(with_frames: bool) -> None:
    rng = np.random.default_rng(3)
    terminated, truncated = rng.random(50) < 0.3, rng.random(50) < 0.3
    frames = rng.integers(1, 5, 50).astype(np.int32) if with_frames else None
    ends = NATIVE.step_ends(terminated, truncated, frames)
    assert ends is not None
    dones, infos, ended = ends
    expected = [{"TimeLimit.truncated": t} for t in (truncated & ~terminated).tolist()]
    if frames is not None:
        expected = [{**info, "frames": f} for info, f in zip(expected, frames.tolist(), strict=True)]
    assert infos == expected and len({id(info) for info in infos}) == 50  # a dict of its own each
    assert dones.dtype == np.bool_ and np.array_equal(dones, terminated | truncated)
    assert ended == np.count_nonzero(terminated | truncated) > 0
    assert NATIVE.step_ends(terminated, truncated, np.ones(50, np.int64)) is None  # numpy's way
    assert NATIVE.step_ends(terminated.astype(np.int8), truncated, None) is None
    assert NATIVE.step_ends(terminated, truncated[:10], None) is None


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@given(data=st.data())
@settings(max_examples=60, deadline=None)
def test_clipped_actions_are_numpy_s(dtype: type, data: st.DataObject) -> None:
    n = data.draw(st.integers(1, 20))
    columns = data.draw(st.integers(1, 6))
    values = data.draw(
        st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=n * columns, max_size=n * columns)
    )
    actions = np.array(values, dtype).reshape(n, columns)
    clipped = NATIVE.clip_unit(actions)
    expected = np.minimum(np.maximum(actions, -1.0), 1.0).astype(np.float32)
    assert clipped.dtype == np.float32 and clipped.shape == (n, columns) and clipped.flags.writeable
    assert np.array_equal(clipped, expected, equal_nan=True)
    assert np.array_equal(np.signbit(clipped), np.signbit(expected))  # -0.0 stays -0.0
    assert clipped is not actions and not np.shares_memory(clipped, actions)


def test_clip_unit_leaves_what_it_does_not_read_to_numpy() -> None:
    one_column = NATIVE.clip_unit(np.array([3.0, -0.5], np.float32))
    assert one_column.shape == (2, 1) and one_column.tolist() == [[1.0], [-0.5]]
    assert NATIVE.clip_unit(np.zeros((4, 2), np.float16)) is None
    assert NATIVE.clip_unit(np.zeros((4, 2), np.int64)) is None
    assert NATIVE.clip_unit(np.zeros((4, 2, 2), np.float32)) is None
    assert NATIVE.clip_unit(np.zeros((4, 4), np.float32)[:, ::2]) is None  # not contiguous
    assert NATIVE.clip_unit(np.zeros((4, 2), ">f4")) is None
    assert NATIVE.clip_unit([[0.5, 0.5]]) is None


def test_owned_arrays_are_writable_and_of_the_plan_s_dtype() -> None:
    frame = np.arange(16, dtype=np.float32)
    frame.flags.writeable = False
    read_only = frame.reshape(2, 8)
    writable = np.ones((2, 3), np.int64)
    plan = (("obs", np.dtype(np.float32)), ("cell", np.dtype(np.int64)))
    owned = NATIVE.owned_arrays({"cell": writable, "obs": read_only}, plan)
    assert list(owned) == ["obs", "cell"]  # the space's order
    assert owned["cell"] is writable  # already the trainer's own: handed over
    assert owned["obs"] is not read_only and owned["obs"].flags.writeable and owned["obs"].flags.c_contiguous
    assert np.array_equal(owned["obs"], read_only) and not np.shares_memory(owned["obs"], frame)
    assert NATIVE.owned_arrays({"obs": read_only}, plan) is None  # a key missing: Python's way decides
    assert NATIVE.owned_arrays({"obs": read_only, "cell": writable.astype(np.int32)}, plan) is None  # a cast
    assert NATIVE.owned_arrays({"obs": read_only[:, ::2], "cell": writable}, plan) is None  # not contiguous
    assert NATIVE.owned_arrays({"obs": read_only, "cell": [1, 2]}, plan) is None


def _numpy_terminal_obs(
    infos: list[dict[str, Any]], dones: np.ndarray, index: Any, final: Any, obs: Any, plan: Any
) -> None:
    with mock.patch.object(clients.vec_env, "NATIVE", None):
        clients.vec_env.put_terminal_obs(
            infos, dones, cast(StepData, SimpleNamespace(final_index=index, final_obs=final)), obs, plan
        )


@given(data=st.data())
@settings(max_examples=80, deadline=None)
def test_terminal_observations_are_numpy_s(data: st.DataObject) -> None:
    n = data.draw(st.integers(0, 12))
    rng = np.random.default_rng(data.draw(st.integers(0, 1000)))
    dones = np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), np.bool_)
    plan = (("obs", np.dtype(np.float32)), ("cell", np.dtype(np.int64)))
    obs = {"obs": rng.random((n, 3)).astype(np.float32), "cell": rng.integers(0, 9, (n, 2, 2))}
    k = data.draw(st.integers(0, 6))
    # Rows the game may name: any, repeated, out of range, not ended (the last entry naming a row wins).
    index = np.array(data.draw(st.lists(st.integers(-2, n + 2), min_size=k, max_size=k)), np.int32)
    wire = {"cell": rng.integers(0, 9, (k, 2, 2)), "obs": rng.random((k, 3)).astype(np.float32)}  # another order
    for array in wire.values():
        array.flags.writeable = False  # views of the frame, as the trainer's socket gives them
    given_finals = data.draw(st.booleans())
    final_index, final_obs = (index, wire) if given_finals else (None, None)
    infos_c = [{"TimeLimit.truncated": bool(i % 2)} for i in range(n)]
    infos_numpy = [dict(info) for info in infos_c]
    assert NATIVE.terminal_obs(infos_c, dones, final_index, final_obs, obs, plan) is True
    _numpy_terminal_obs(infos_numpy, dones, final_index, final_obs, obs, plan)
    assert [list(info) for info in infos_c] == [list(info) for info in infos_numpy]
    sources = [*obs.values(), *wire.values()]
    for c_info, numpy_info in zip(infos_c, infos_numpy, strict=True):
        if "terminal_observation" not in numpy_info:
            continue
        c_terminal, numpy_terminal = c_info["terminal_observation"], numpy_info["terminal_observation"]
        assert list(c_terminal) == list(numpy_terminal)  # the same keys, in the same order
        for key, expected in numpy_terminal.items():
            got = c_terminal[key]
            assert got.dtype == expected.dtype and got.shape == expected.shape and np.array_equal(got, expected)
            assert got.flags.writeable and got.flags.c_contiguous and got.flags.owndata
            assert not any(np.shares_memory(got, source) for source in sources)


def test_terminal_obs_leaves_what_it_does_not_read_to_numpy() -> None:
    plan = (("obs", np.dtype(np.float32)),)
    dones = np.array([True, False, True])
    obs = {"obs": np.zeros((3, 2), np.float32)}
    index = np.array([0], np.int32)

    def refused(infos: Any = None, dones: Any = dones, index: Any = index, final: Any = None, obs: Any = obs) -> bool:
        infos = [{}, {}, {}] if infos is None else infos
        before = [dict(info) for info in infos] if all(isinstance(i, dict) for i in infos) else None
        result = NATIVE.terminal_obs(infos, dones, index, final, obs, plan)
        return result is None and (before is None or infos == before)  # nothing changed

    assert refused(final={"obs": np.zeros((1, 2), np.float64)})  # a cast: numpy's way
    assert refused(final={"other": np.zeros((1, 2), np.float32)})  # a key the space does not have
    assert refused(final={"obs": np.zeros((1, 4), np.float32)[:, ::2]})  # not contiguous
    assert refused(final={"obs": np.zeros((2, 2), np.float32)})  # rows other than final_index's
    assert refused(index=np.array([0], np.int64), final={"obs": np.zeros((1, 2), np.float32)})
    assert refused(obs={"obs": np.zeros(3, np.float32)})  # 1-d: a row is a scalar
    assert refused(dones=np.array([1, 0, 1], np.int8))
    assert refused(infos=[{}, {}])
    assert refused(infos=[{}, {}, None])
    # Without final observations every ended row's terminal observation is its row of obs.
    infos: list[dict[str, Any]] = [{}, {}, {}]
    obs["obs"][2] = 7.0
    assert NATIVE.terminal_obs(infos, dones, None, {"obs": np.ones((1, 2), np.float32)}, obs, plan) is True
    assert infos[0]["terminal_observation"]["obs"].tolist() == [0.0, 0.0] and "terminal_observation" not in infos[1]
    assert infos[2]["terminal_observation"]["obs"].tolist() == [7.0, 7.0]


# --- Godot Variant bodies ----------------------------------------------------------------------------------

GODOT_VECTORS = [
    v
    for v in json.loads((Path(__file__).parent / "vectors" / "protocol_v1_godot.json").read_text())["vectors"]
    if v["codec"] == "godot" and variant.decode(bytes.fromhex(v["hex"])[HEADER.size :])["type"] in HOT_TYPES
]


def _godot_body(message: Message) -> bytes:
    return variant.encode(message.to_wire())


def _godot_general(body: bytes) -> Message | None:
    """What the general way makes of a Variant body: None where it refuses it."""
    try:
        return message_from_wire(variant.decode(body))
    except RemoteProtocolError:
        return None


def _decodes_godot_as_the_general_way(body: bytes) -> Message | None:
    native = hot.decode_hot_godot(body)
    if native is not None:
        general = _godot_general(body)
        assert general is not None, f"the C way accepted a Variant body the general way refuses: {body.hex()}"
        assert _same(native, general)
    return native


def test_the_godot_vectors_of_every_per_step_message_decode_the_c_way_as_the_general_way() -> None:
    """Each is taken the C way exactly when its msgpack twin is (not: one with infos), as the general way."""
    msgpack_twins = {v["name"]: bytes.fromhex(v["hex"])[HEADER.size :] for v in HOT_VECTORS}
    taken = set()
    for vector in GODOT_VECTORS:
        frame = bytes.fromhex(vector["hex"])
        native = _decodes_godot_as_the_general_way(frame[HEADER.size :])
        assert (native is None) == (NATIVE.decode(msgpack_twins[vector["name"]]) is None), vector["name"]
        if native is not None:
            taken.add(variant.decode(frame[HEADER.size :])["type"])
            assert NATIVE.encode_godot(native) == frame, vector["name"]  # and back to the very bytes
    assert taken == set(HOT_TYPES)


@settings(max_examples=400, deadline=None)
@given(_messages)
def test_random_variant_bodies_decode_the_c_way_as_the_general_way_when_msgpack_does(message: Message) -> None:
    """The C way takes a message's Variant body exactly when it takes its msgpack body (no infos, the
    encoders' key order), and gives the general way's message."""
    native = _decodes_godot_as_the_general_way(_godot_body(message))
    assert (native is None) == (NATIVE.decode(_frame(message)[HEADER.size :]) is None)


@settings(max_examples=400, deadline=None)
@given(_messages)
def test_random_messages_encode_the_c_way_to_the_bytes_of_the_variant_encoder(message: Message) -> None:
    """The C way writes what ``variant.encode`` writes (Godot's own bytes), for every message it takes: those
    without infos, as for msgpack; the rest is left to the general way."""
    encoded = NATIVE.encode_godot(message)
    assert (encoded is None) == _has_infos(message)
    if encoded is not None:
        assert encoded == encode_message_frame(BodyKind.GODOT, message.to_wire())


def test_a_godot_peer_is_sent_the_c_way_s_frame() -> None:
    from broker.protocol.connection import _encode_message
    from broker.protocol.gather import frame_buffers

    actions = GameActions(2**33, {"a": {"move": np.arange(6, dtype=np.float32).reshape(3, 2)}, "b": {}})
    frame = NATIVE.encode_godot(actions)
    assert b"tick\x02\x00\x01\x00" in frame  # a 64-bit tick
    assert frame == encode_message_frame(BodyKind.GODOT, actions.to_wire())
    assert _encode_message(BodyKind.GODOT, actions) == frame
    assert frame_buffers(BodyKind.GODOT, actions) == [frame]


@settings(max_examples=2000, deadline=None)
@given(_messages, st.data())
def test_a_damaged_variant_body_is_never_accepted_by_the_c_way_alone(message: Message, data: st.DataObject) -> None:
    body = bytearray(_godot_body(message))
    how = data.draw(st.sampled_from(["flip", "cut", "extend", "byte"]))
    position = data.draw(st.integers(0, len(body) - 1))
    if how == "flip":
        body[position] ^= 1 << data.draw(st.integers(0, 7))
    elif how == "byte":  # type bytes, the 64-bit flag, a count's top byte
        body[position] = data.draw(st.sampled_from([0x00, 0x01, 0x02, 0x04, 0x1B, 0x1C, 0x1D, 0x15, 0x80, 0xFF]))
    elif how == "cut":
        del body[position:]
    else:
        body[position:position] = data.draw(st.binary(min_size=1, max_size=8))
    _decodes_godot_as_the_general_way(bytes(body))


def test_variant_arrays_are_views_of_the_body_and_a_64_bit_tick_reads() -> None:
    message = GameStep(2**40, {"a": _step()})
    body = _godot_body(message)
    assert b"tick\x02\x00\x01\x00" in body  # the 64-bit INT form
    read_only = hot.decode_hot_godot(body)
    assert isinstance(read_only, GameStep) and read_only.tick == 2**40 and _same(read_only, message)
    assert not read_only.groups["a"].obs["obs"].flags.writeable
    owned = memoryview(bytearray(body))
    obs = hot.decode_hot_godot(owned).groups["a"].obs["obs"]
    assert obs.flags.writeable and np.shares_memory(obs, np.frombuffer(owned, np.uint8))


def test_what_the_c_way_leaves_of_variant_bodies_goes_the_general_way() -> None:
    """Keys out of order, a negative tick, a StringName key and a body longer than the fast Variant reader
    takes: the C way declines each, and a connection still decodes them (or refuses them) the general way."""
    from broker.protocol.connection import _decode_message

    step = GameStep(3, {"a": _step()})
    wire = step.to_wire()
    reordered = variant.encode({"type": "step", "groups": wire["groups"], "tick": 3})
    negative = variant.encode({**wire, "tick": -1})
    string_name = bytearray(_godot_body(step))
    at = string_name.index(b"\x04\x00\x00\x00\x04\x00\x00\x00tick")
    string_name[at] = variant.STRING_NAME
    large = _godot_body(GameStep(4, {"a": _step(rows=variant.FAST_MAX_BYTES // 16)}))  # 18 bytes a row
    assert len(large) > variant.FAST_MAX_BYTES
    for body in (reordered, negative, bytes(string_name), large):
        assert hot.decode_hot_godot(body) is None
    assert _same(_decode_message(BodyKind.GODOT, reordered), step)
    assert _same(_decode_message(BodyKind.GODOT, bytes(string_name)), step)
    assert _same(_decode_message(BodyKind.GODOT, large), _godot_general(large))
    with pytest.raises(RemoteProtocolError):  # a tick below 0
        _decode_message(BodyKind.GODOT, negative)
