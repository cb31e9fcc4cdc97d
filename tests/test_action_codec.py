"""SB3's actions -> the wire's, per action kind (clients/spaces.py ActionCodec): what a BrokerVecEnv sends."""

from __future__ import annotations

import numpy as np
import pytest
from gymnasium import spaces

import clients.spaces
from broker.protocol.spaces import BoxSpace, ContinuousAction, DiscreteAction, MultiDiscreteAction, PolicySpaces
from clients.spaces import ActionCodec

OBS = (("x", BoxSpace((2,))),)


def _codec(*action: tuple[str, object]) -> ActionCodec:
    return ActionCodec(PolicySpaces(OBS, tuple(action)))  # type: ignore[arg-type]


@pytest.mark.parametrize("way", ["C codec", "numpy"])
def test_one_continuous_key_is_clipped_to_its_box_and_sent_as_float32(
    way: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if way == "numpy":
        monkeypatch.setattr(clients.spaces, "NATIVE", None)
    codec = _codec(("move", ContinuousAction(2)))
    for dtype in (np.float64, np.float32):
        actions = np.array([[0.5, -3.0], [2.0, 0.25]], dtype)
        wire = codec.to_wire(actions)
        assert list(wire) == ["move"] and wire["move"].dtype == np.float32 and wire["move"].shape == (2, 2)
        np.testing.assert_array_equal(wire["move"], [[0.5, -1.0], [1.0, 0.25]])
        assert not np.shares_memory(wire["move"], actions)  # SB3's array is not the wire's
    assert codec.to_wire([[0.5, -3.0]])["move"].tolist() == [[0.5, -1.0]]  # a list, as a user may pass


def test_continuous_keys_beside_binary_ones_split_sb3s_box_by_column() -> None:
    codec = _codec(
        ("move", ContinuousAction(2)),
        ("jump", DiscreteAction(2)),
        ("turn", ContinuousAction(1)),
        ("stay", DiscreteAction(1)),
    )
    assert codec.space == spaces.Box(-1.0, 1.0, (5,), np.float32)
    sb3 = np.array([[0.1, 0.2, 0.7, -5.0, 0.9], [-0.1, 0.3, -0.2, 0.4, -0.9]], np.float32)
    wire = codec.to_wire(sb3)
    assert list(wire) == ["move", "jump", "turn", "stay"]
    np.testing.assert_array_equal(wire["move"], sb3[:, :2])
    np.testing.assert_array_equal(wire["jump"], [1, 0])  # > 0 is choice 1, godot_rl's rule
    np.testing.assert_array_equal(wire["turn"], np.array([[-1.0], [0.4]], np.float32))
    np.testing.assert_array_equal(wire["stay"], [0, 0])  # one choice: always choice 0
    assert wire["jump"].dtype == wire["stay"].dtype == np.int32


def test_discrete_keys_become_one_multidiscrete_and_split_back() -> None:
    codec = _codec(("jump", DiscreteAction(3)), ("grip", MultiDiscreteAction((3, 4))))
    assert codec.space == spaces.MultiDiscrete(np.array([3, 3, 4]))
    wire = codec.to_wire(np.array([[2, 1, 3], [0, 2, 0]], np.int64))
    np.testing.assert_array_equal(wire["jump"], [2, 0])
    np.testing.assert_array_equal(wire["grip"], [[1, 3], [2, 0]])
    assert wire["jump"].dtype == wire["grip"].dtype == np.int32


def test_a_single_discrete_key_is_sb3s_discrete_space() -> None:
    codec = _codec(("choice", DiscreteAction(5)))
    assert codec.space == spaces.Discrete(5)
    wire = codec.to_wire(np.array([4, 0, 2], np.int64))
    np.testing.assert_array_equal(wire["choice"], [4, 0, 2])
    assert wire["choice"].dtype == np.int32 and wire["choice"].shape == (3,)
