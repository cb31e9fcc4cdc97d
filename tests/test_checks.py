"""Shape checks of steps and actions (broker/protocol/checks.py), straight, without a hub: the codes and
texts a peer is told, and, fuzzed, that nothing but RemoteProtocolError ever escapes them."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.protocol.checks import canonical_actions, check_actions, check_step
from broker.protocol.errors import ErrorCode, RemoteProtocolError
from broker.protocol.messages import GameStep, StepData, TrainerAct
from broker.protocol.spaces import BoxSpace, ContinuousAction, DiscreteAction, GroupSpec, PolicySpaces, check_finite

RED = PolicySpaces((("obs", BoxSpace((3,), "float32", -10, 10)),), (("move", ContinuousAction(2)),))
BLUE = PolicySpaces((("obs", BoxSpace((1,), "float32", -10, 10)),), (("pick", DiscreteAction(4)),))
GROUPS = {"red": GroupSpec("red", 2, RED), "blue": GroupSpec("blue", 1, BLUE)}


def rows(n: int, width: int, dtype: Any = np.float32) -> StepData:
    no = np.zeros(n, np.bool_)
    return StepData({"obs": np.zeros((n, width), dtype)}, np.zeros(n, np.float32), no, no.copy())


def refusal(call: Any, *args: Any) -> RemoteProtocolError:
    with pytest.raises(RemoteProtocolError) as err:
        call(*args)
    return err.value


def test_a_step_matching_its_hello_passes() -> None:
    check_step(GameStep(0, {"red": rows(2, 3), "blue": rows(1, 1)}), GROUPS, "game 0 (g)")


def test_step_refusals_name_the_game_group_and_what_is_wrong() -> None:
    missing = refusal(check_step, GameStep(0, {"red": rows(2, 3)}), GROUPS, "game 0 (g)")
    assert missing.code is ErrorCode.BAD_STEP
    assert missing.message == "game 0 (g): step has groups ['red'], hello announced ['blue', 'red']"
    too_many = refusal(check_step, GameStep(0, {"red": rows(3, 3), "blue": rows(1, 1)}), GROUPS, "game 0 (g)")
    assert too_many.message == "game 0 (g), group 'red': 3 rows for 2 agents"
    wrong = refusal(check_step, GameStep(0, {"red": rows(2, 4), "blue": rows(1, 1)}), GROUPS, "game 0 (g)")
    assert wrong.code is ErrorCode.BAD_STEP
    assert (
        wrong.message
        == "game 0 (g), group 'red' obs.obs: expected float32 of shape [2, 3], got float32 of shape [2, 4]"
    )
    final = replace(rows(2, 3), final_index=np.array([1], np.int32), final_obs={"obs": np.zeros((1, 2), np.float32)})
    bad_final = refusal(check_step, GameStep(0, {"red": final, "blue": rows(1, 1)}), GROUPS, "game 0 (g)")
    assert bad_final.message.startswith("game 0 (g), group 'red' final obs.obs: expected float32 of shape [1, 3]")


def test_actions_are_cast_to_their_wire_dtype_once_checked() -> None:
    actions = check_actions(TrainerAct(1, {"pick": np.array([3, 0], np.int64)}), "blue", BLUE, 2)
    assert actions["pick"].dtype == np.int32 and actions["pick"].tolist() == [3, 0]
    moves = check_actions(TrainerAct(1, {"move": np.ones((2, 2), np.float64)}), "red", RED, 2)
    assert moves["move"].dtype == np.float32


def test_action_refusals_keep_their_codes_and_texts() -> None:
    unknown = refusal(check_actions, TrainerAct(1, {"jump": np.zeros((2, 2), np.float32)}), "red", RED, 2)
    assert unknown.code is ErrorCode.BAD_ACTIONS and unknown.message == "unknown action keys ['jump']"
    rows_wrong = refusal(check_actions, TrainerAct(1, {"move": np.zeros((3, 2), np.float32)}), "red", RED, 2)
    assert rows_wrong.code is ErrorCode.BAD_ACTIONS
    assert (
        rows_wrong.message == "policy 'red' actions.move: expected float32 of shape [2, 2], got float32 of shape [3, 2]"
    )
    out_of_range = refusal(check_actions, TrainerAct(1, {"pick": np.array([0, 4])}), "blue", BLUE, 2)
    assert out_of_range.message == "policy 'blue' actions.pick: values must lie in [0, 4)"
    wide = refusal(check_actions, TrainerAct(1, {"pick": np.array([2**32 + 2, 0], np.int64)}), "blue", BLUE, 2)
    assert wide.code is ErrorCode.BAD_ACTIONS  # never cast to 2 first


def test_canonical_actions_never_wraps_a_wide_integer() -> None:
    wide = np.array([2**32 + 2], np.int64)
    assert canonical_actions(wide, "int32") is wide
    assert canonical_actions(np.array([1.5], np.float64), "float32").dtype == np.float32
    ints = np.array([1], np.int32)
    assert canonical_actions(ints, "float32") is ints  # the wrong kind is left for check_rows to report


def filled(n: int, width: int, dtype: Any, value: float) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):  # NaN or 2**40 as an integer: whatever numpy makes
        return np.full((n, width), value).astype(dtype)


arrays = st.builds(
    filled,
    st.integers(0, 4),
    st.integers(0, 4),
    st.sampled_from([np.float32, np.float64, np.int32, np.int64, np.uint8, np.bool_]),
    st.sampled_from([0, 1, 3, 4, -1, 2**40, float("nan"), float("inf")]),
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["red", "blue", "green"]), arrays, max_size=3), st.integers(-1, 3))
def test_fuzzed_steps_pass_or_are_refused_with_bad_step(groups: dict[str, np.ndarray], final_rows: int) -> None:
    step = {}
    for name, obs in groups.items():
        n = len(obs)
        data = StepData({"obs": obs}, np.zeros(n, np.float32), np.zeros(n, np.bool_), np.zeros(n, np.bool_))
        if final_rows >= 0:
            try:
                data = replace(
                    data, final_index=np.arange(final_rows, dtype=np.int32), final_obs={"obs": obs[:final_rows]}
                )
            except RemoteProtocolError as exc:  # rows that disagree are refused on construction already
                assert exc.code in (ErrorCode.BAD_STEP, ErrorCode.MALFORMED), exc
                return
        step[name] = data
    try:
        built = GameStep(0, step)
    except RemoteProtocolError as exc:  # no groups at all: refused on construction already
        assert exc.code is ErrorCode.MALFORMED and not step, exc
        return
    try:
        check_step(built, GROUPS, "game 0 (g)")
    except RemoteProtocolError as exc:
        assert exc.code is ErrorCode.BAD_STEP and exc.message.startswith("game 0 (g)")


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["pick", "move", "jump"]), arrays, max_size=3))
def test_fuzzed_actions_pass_as_canonical_or_are_refused_with_bad_actions(actions: dict[str, np.ndarray]) -> None:
    flat = {k: (v[:, 0] if k == "pick" and v.ndim == 2 and v.shape[1] else v) for k, v in actions.items()}
    try:
        checked = check_actions(TrainerAct(1, flat), "blue", BLUE, 2)
    except RemoteProtocolError as exc:
        assert exc.code is ErrorCode.BAD_ACTIONS
    else:
        assert list(checked) == ["pick"] and checked["pick"].dtype == np.int32 and checked["pick"].shape == (2,)
        assert ((checked["pick"] >= 0) & (checked["pick"] < 4)).all()


@pytest.mark.parametrize("size", [1, 7, 4096, 4097, 30000])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_finite_check_refuses_every_nan_and_infinity_and_no_finite_value(size: int, dtype: Any) -> None:
    """The largest finite values pass; one NaN, one infinity, or +inf beside -inf anywhere is refused."""
    big = np.full(size, np.finfo(dtype).max, dtype)
    check_finite(big, "obs", ErrorCode.BAD_STEP)
    check_finite(np.zeros((size, 0), dtype), "obs", ErrorCode.BAD_STEP)  # no values at all
    for bad in ([np.nan], [np.inf], [-np.inf], [np.inf, -np.inf]):
        array = np.zeros(size + len(bad) - 1, dtype)
        array[-len(bad) :] = bad
        with pytest.raises(RemoteProtocolError) as err:
            check_finite(array.reshape(-1, 1), "obs", ErrorCode.BAD_STEP)
        assert err.value.code is ErrorCode.BAD_STEP and "finite" in err.value.message
