"""Per-frame decoding bounds and encodability at the edge, codec by codec (issue #14).

Each hostile body must come back as a RemoteProtocolError with a stable code and a short message, never
as another exception, and before the body's objects are built (a 63 MiB frame of empty maps is refused by
its container header). Every value the decoders accept must be encodable again by every codec the broker
forwards it in: msgpack, Godot Variant and godot_rl JSON.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.core.batching import canonical_actions
from broker.legacy.godot_rl_game import GodotRlGame
from broker.legacy.wire import decode_actions, decode_numbers, encode_message
from broker.protocol import variant
from broker.protocol.codec import check_msgpack_bounds, unpack
from broker.protocol.connection import BrokerConnection
from broker.protocol.errors import MAX_ERROR_TEXT, ErrorCode, RemoteProtocolError
from broker.protocol.framing import encode_frame
from broker.protocol.json_body import pack_json, unpack_json
from broker.protocol.limits import MAX_FRAME_ELEMENTS, MAX_INFO_NESTING, MAX_NESTING
from broker.protocol.messages import GameActions, GameStep, Hello, StepData, check_info
from broker.protocol.spaces import BoxSpace, ContinuousAction, DiscreteAction, PolicySpaces, check_rows

BIG = 63 * 2**20


def refusal(call: Any, *args: Any) -> RemoteProtocolError:
    with pytest.raises(RemoteProtocolError) as caught:
        call(*args)
    assert len(caught.value.message) <= MAX_ERROR_TEXT
    return caught.value


# --- msgpack ---------------------------------------------------------------------------------------


def test_msgpack_frame_of_empty_maps_is_refused_by_its_header() -> None:
    body = b"\x81\xa1a\xdd" + BIG.to_bytes(4, "big") + b"\x80" * BIG
    error = refusal(unpack, body)
    assert error.code is ErrorCode.MALFORMED and f"more than {MAX_FRAME_ELEMENTS} values" in error.message


def test_msgpack_many_small_containers_and_deep_nesting_are_refused() -> None:
    wide = b"\x81\xa1a\xdc\xff\xff" + (b"\xdc\xff\xff" + b"\x00" * 65535) * 16
    assert "values" in refusal(unpack, wide).message
    deep = b"\x81\xa1a" + b"\x91" * (MAX_NESTING + 5) + b"\x00" + b"\x00" * MAX_FRAME_ELEMENTS
    assert f"deeper than {MAX_NESTING}" in refusal(unpack, deep).message


def count_values(value: Any) -> int:
    if isinstance(value, list):
        return 1 + sum(count_values(v) for v in value)
    if isinstance(value, dict):
        return 1 + sum(count_values(k) + count_values(v) for k, v in value.items())
    return 1


def nesting(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max((nesting(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((max(nesting(k), nesting(v)) for k, v in value.items()), default=0)
    return 0


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text() | st.binary(),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=4), inner, max_size=5),
    max_leaves=40,
)


@settings(max_examples=300, deadline=None)
@given(msgpack_values)
def test_msgpack_scan_counts_values_and_levels_exactly(value: Any) -> None:
    body = msgpack.packb(value, use_bin_type=True)
    values, levels = count_values(value), nesting(value)
    check_msgpack_bounds(body, values, max(levels, 1))
    if values > 1:
        with pytest.raises(RemoteProtocolError):
            check_msgpack_bounds(body, values - 1, 64)
    if levels > 1:
        with pytest.raises(RemoteProtocolError):
            check_msgpack_bounds(body, values, levels - 1)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_msgpack_scan_never_fails_otherwise_on_junk(junk: bytes) -> None:
    try:
        check_msgpack_bounds(junk, 50, 4)
    except RemoteProtocolError as exc:
        assert exc.code is ErrorCode.MALFORMED


# --- Godot Variant ---------------------------------------------------------------------------------


def variant_map_of(key: str, value_bytes: bytes) -> bytes:
    """A one-entry Godot Dictionary ``{key: value}`` from the value's raw Variant bytes."""
    return variant.encode({key: None})[:-4] + value_bytes  # drop the NIL value's header


def test_variant_body_with_too_many_values_is_refused_before_building_them() -> None:
    count = MAX_FRAME_ELEMENTS + 1
    empty_dict = variant.encode({})
    array = struct.pack("<II", variant.ARRAY, count) + empty_dict * count
    assert "values in one body" in refusal(variant.decode, variant_map_of("a", array)).message
    packed = struct.pack("<II", variant.PACKED_INT32_ARRAY, count) + bytes(4 * count)
    assert "values in one body" in refusal(variant.decode, variant_map_of("k", packed)).message
    small = struct.pack("<II", variant.PACKED_INT32_ARRAY, 3) + bytes(12)
    assert variant.decode(variant_map_of("k", small)) == {"k": [0, 0, 0]}


# --- godot_rl JSON ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (b"[" * 100_000, f"deeper than {MAX_NESTING}"),
        (b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}", f"deeper than {MAX_NESTING}"),
        (b'{"a":' + b"1" * 400 + b"}", "400 digits"),
        (b'{"a":' + str(2**63).encode() + b"}", "does not fit 64 bits"),
        (b'{"a":"\\ud800"}', "lone surrogate"),
        (b'{"\\udfff":1}', "lone surrogate"),
        (b'{"a":[' + b"{}," * (MAX_FRAME_ELEMENTS + 1) + b"{}]}", f"more than {MAX_FRAME_ELEMENTS} values"),
    ],
)
def test_hostile_json_is_malformed_never_another_error(body: bytes, words: str) -> None:
    error = refusal(unpack_json, body)
    assert error.code is ErrorCode.MALFORMED and words in error.message


def test_json_within_the_limits_decodes_as_before() -> None:
    escaped = '{"a": "\\ud83d\\ude00 \\\\ \\" [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[", "b": [[1]]}'
    assert unpack_json(escaped.encode()) == json.loads(escaped)
    nested = "[" * (MAX_NESTING - 1) + "]" * (MAX_NESTING - 1)
    assert unpack_json(f'{{"a": {nested}, "i": {-(2**63)}}}'.encode())["i"] == -(2**63)
    big = {"type": "step", "obs": [{"img2d": "ab" * 200_000, "v": [0.5] * 64} for _ in range(16)]}
    assert unpack_json(pack_json(big)) == big


# --- infos and names: encodable by every codec -----------------------------------------------------


def encodable_everywhere(info: dict[Any, Any]) -> None:
    batch = {"type": "batch", "step": 1, "infos": {0: info}}
    assert msgpack.unpackb(msgpack.packb(batch, use_bin_type=True), strict_map_key=False)
    variant.decode(variant.encode(batch))
    encode_message({"type": "step", "info": [info]})


@pytest.mark.parametrize(
    ("info", "words"),
    [
        ({"big": 2**64 - 1}, "64 signed bits"),
        ({"deep": [[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]}, "deeper than"),
        ({b"raw": 1}, "neither a string nor an integer"),
        ({1.5: 1}, "neither a string nor an integer"),
        ({"ext": msgpack.ExtType(3, b"x")}, "cannot be forwarded"),
    ],
)
def test_infos_no_codec_could_forward_are_bad_step(info: dict[Any, Any], words: str) -> None:
    error = refusal(check_info, info, "info")
    assert error.code is ErrorCode.BAD_STEP and words in error.message


@settings(max_examples=200, deadline=None)
@given(msgpack_values)
def test_every_info_check_info_accepts_is_encodable_by_every_codec(value: Any) -> None:
    info = {"v": value}
    try:
        check_info(info, "info")
    except RemoteProtocolError:
        return
    encodable_everywhere(info)


def step_wire(infos: dict[int, Any]) -> dict[str, Any]:
    no = np.zeros(2, np.bool_)
    data = StepData({"obs": np.zeros((2, 3), np.float32)}, np.zeros(2, np.float32), no, no, infos=infos)
    return unpack(msgpack.packb(GameStep(0, {"p": data}).to_wire(), use_bin_type=True))  # as received


def test_a_native_step_with_a_uint64_or_deep_info_is_bad_step() -> None:
    assert refusal(GameStep.from_wire, step_wire({0: {"n": 2**64 - 1}})).code is ErrorCode.BAD_STEP
    deep: Any = 1
    for _ in range(MAX_INFO_NESTING):
        deep = [deep]
    assert refusal(GameStep.from_wire, step_wire({1: {"d": deep}})).code is ErrorCode.BAD_STEP
    assert GameStep.from_wire(step_wire({1: {"d": deep[0]}})).groups["p"].infos[1]["d"] == deep[0]


def plugin_game() -> GodotRlGame:
    """A plugin game (one agent) that has reset and been sent its first actions: it may step now."""
    game = GodotRlGame()
    game.receive(
        {
            "type": "env_info",
            "n_agents": 1,
            "observation_space": {"obs": {"size": [2], "space": "box"}},
            "action_space": {"pick": {"size": 3, "action_type": "discrete"}},
        }
    )
    game.reset_request()
    game.receive({"type": "reset", "obs": [{"obs": [0.0, 0.0]}]})
    game.actions_request(GameActions(0, {}))
    return game


def json_step(info: str = "{}", reward: str = "0.5", obs: str = "[0.0, 0.0]") -> bytes:
    text = f'{{"type": "step", "obs": [{{"obs": {obs}}}], "reward": [{reward}], "done": [false], "info": [{info}]}}'
    return text.encode()


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (json_step(info='{"big": 1000000000000000000000000000000}'), ErrorCode.MALFORMED),
        (json_step(info='{"s": "\\ud800"}'), ErrorCode.MALFORMED),
        (json_step(info='{"\\ud800": 1}'), ErrorCode.MALFORMED),
        (json_step(info='{"d": ' + "[" * 20 + "]" * 20 + "}"), ErrorCode.BAD_STEP),
        (json_step(reward='"1.5"'), ErrorCode.BAD_STEP),
        (json_step(reward="NaN"), ErrorCode.BAD_STEP),
        (json_step(reward="1e400"), ErrorCode.BAD_STEP),
        (json_step(reward="1e300"), ErrorCode.BAD_STEP),
        (json_step(obs="[-1e300, 0.0]"), ErrorCode.BAD_STEP),
        (json_step(obs="[Infinity, 0.0]"), ErrorCode.BAD_STEP),
        (json_step(obs='["0.5", 0.0]'), ErrorCode.BAD_STEP),
    ],
)
def test_plugin_game_steps_no_codec_could_forward_are_refused(body: bytes, code: ErrorCode) -> None:
    game = plugin_game()

    def receive() -> None:
        game.receive(unpack_json(body))

    assert refusal(receive).code is code


def test_json_policy_name_with_a_lone_surrogate_never_reaches_the_hub() -> None:
    body = b'{"type": "env_info", "n_agents": 1, "agent_policy_names": ["\\ud800"]}'
    assert refusal(unpack_json, body).code is ErrorCode.MALFORMED


# --- numbers: ranges before casts, one rule for non-finite values ------------------------------------

SPACES = PolicySpaces(
    (("obs", BoxSpace((2,), "float32")),), (("pick", DiscreteAction(3)), ("move", ContinuousAction(1)))
)


@pytest.mark.parametrize("dtype", [np.int64, np.uint64])
def test_discrete_action_beyond_int32_is_refused_not_wrapped(dtype: Any) -> None:
    wide = np.array([2**32 + 2, 1], dtype)
    actions = {"pick": canonical_actions(wide, "int32"), "move": np.zeros((2, 1), np.float32)}
    error = refusal(check_rows, actions, SPACES.action, 2, "act", ErrorCode.BAD_ACTIONS)
    assert error.code is ErrorCode.BAD_ACTIONS and "[0, 3)" in error.message
    fine = {"pick": canonical_actions(np.array([2, 1], dtype), "int32"), "move": np.zeros((2, 1), np.float32)}
    check_rows(fine, SPACES.action, 2, "act", ErrorCode.BAD_ACTIONS)
    assert fine["pick"].dtype == np.int32


def test_float64_action_beyond_float32_is_refused_as_non_finite() -> None:
    actions = {"pick": np.zeros(2, np.int32), "move": canonical_actions(np.full((2, 1), 1e300), "float32")}
    error = refusal(check_rows, actions, SPACES.action, 2, "act", ErrorCode.BAD_ACTIONS)
    assert error.code is ErrorCode.BAD_ACTIONS and "finite" in error.message


def test_json_discrete_action_beyond_int32_is_refused_not_wrapped() -> None:
    rows = [{"pick": 2**32 + 2, "move": [0.0]}]
    assert "[0, 3)" in refusal(decode_actions, SPACES, rows, "action").message


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_values_are_refused_on_the_native_path(bad: float) -> None:
    obs = {"obs": np.array([[0.0, bad], [0.0, 0.0]], np.float32)}
    assert refusal(check_rows, obs, SPACES.observation, 2, "obs", ErrorCode.BAD_STEP).code is ErrorCode.BAD_STEP
    actions = {"pick": np.zeros(2, np.int32), "move": np.array([[bad], [0.0]], np.float32)}
    error = refusal(check_rows, actions, SPACES.action, 2, "act", ErrorCode.BAD_ACTIONS)
    assert error.code is ErrorCode.BAD_ACTIONS and "finite" in error.message
    wire = step_wire({})
    wire["groups"]["p"]["reward"] = {"dtype": "float32", "shape": [2], "data": np.array([bad, 0], np.float32).tobytes()}
    assert refusal(GameStep.from_wire, wire).code is ErrorCode.BAD_STEP


def test_non_finite_and_string_numbers_are_refused_on_the_json_path() -> None:
    assert refusal(decode_numbers, [float("nan")], 1, "reward", ErrorCode.BAD_STEP).code is ErrorCode.BAD_STEP
    assert refusal(decode_numbers, ["1.5"], 1, "reward", ErrorCode.BAD_STEP).code is ErrorCode.BAD_STEP
    rows = [{"pick": 1, "move": [float("inf")]}]
    assert refusal(decode_actions, SPACES, rows, "action").code is ErrorCode.BAD_ACTIONS


# --- hellos and error texts ----------------------------------------------------------------------


@pytest.mark.parametrize("protocol", [2, 0, "1", None, 2**70, [1]])
def test_any_other_protocol_version_is_version_mismatch_whatever_else_the_hello_holds(protocol: Any) -> None:
    hello = {"type": "hello", "protocol": protocol, "role": "admin", "groups": "nonsense"}
    if protocol is None:
        del hello["protocol"]
    assert refusal(Hello.from_wire, hello).code is ErrorCode.VERSION_MISMATCH


@pytest.mark.parametrize(
    "message",
    [
        {"type": "x" * 2**20},
        {"type": "hello", "protocol": 1, "role": "x" * 2**20},
        {"type": "hello", "protocol": 1, "role": "trainer", "policy": "p", "name": list(range(2**17))},
        {"type": "hello", "protocol": 1, "role": "game", "groups": [{"policy": "p" * 2**20, "n_agents": 1}]},
    ],
)
def test_a_megabyte_bad_frame_gives_a_short_error(message: dict[str, Any]) -> None:
    connection = BrokerConnection()
    body = msgpack.packb(message, use_bin_type=True)
    assert len(body) > 2**17
    connection.receive_data(encode_frame(body))
    error = refusal(connection.next_event)
    assert len(error.message) <= MAX_ERROR_TEXT and len(str(error)) < 1024
