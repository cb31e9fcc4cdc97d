"""The hub without any I/O: fake links record what would be sent."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pytest
import structlog

from broker.core.batching import DROPPED_INFO
from broker.core.effects import Close, Deadline, IdleTick, Send, StallCheck, StartTimer
from broker.core.flow import Hub as CoreHub
from broker.core.holding import IDLE_TICK_S, STALL_REPORT_S
from broker.core.states import TRANSITIONS, GameState, GroupWait, TrainerState, advance
from broker.protocol import PROTOCOL_VERSION
from broker.protocol.errors import ErrorCode, RemoteProtocolError
from broker.protocol.messages import (
    Batch,
    Error,
    GameActions,
    GameLayout,
    GameStep,
    Hello,
    Message,
    PolicyInfo,
    StepData,
    StepOptions,
    TrainerAct,
    TrainerReset,
    Waiting,
    Welcome,
)
from broker.protocol.spaces import BoxSpace, ContinuousAction, DiscreteAction, GroupSpec, PolicySpaces
from tests.hub_driver import LinkHub as Hub

RED = PolicySpaces((("obs", BoxSpace((3,), "float32", -10, 10)),), (("move", ContinuousAction(2)),))
BLUE = PolicySpaces((("obs", BoxSpace((1,), "float32", -10, 10)),), (("pick", DiscreteAction(4)),))


class FakeLink:
    def __init__(self, label: str) -> None:
        self.label = label
        self.sent: list[Message] = []
        self.closed_with: Error | bool | None = False

    def send(self, message: Message) -> None:
        self.sent.append(message)

    def close(self, error: Any = None) -> None:
        self.closed_with = error

    def last(self, kind: type) -> Any:
        return next(m for m in reversed(self.sent) if isinstance(m, kind))


def game_hello(n_red: int = 2, n_blue: int = 1, red: PolicySpaces = RED) -> Hello:
    groups = []
    if n_red:
        groups.append(GroupSpec("red", n_red, red))
    if n_blue:
        groups.append(GroupSpec("blue", n_blue, BLUE))
    return Hello("game", PROTOCOL_VERSION, "g", groups=tuple(groups))


def trainer_hello(policy: str) -> Hello:
    return Hello("trainer", PROTOCOL_VERSION, f"t-{policy}", policy=policy)


def step_data(values: np.ndarray, width: int) -> StepData:
    n = len(values)
    obs = np.repeat(values.astype(np.float32)[:, None], width, axis=1)
    return StepData({"obs": obs}, values.astype(np.float32), np.zeros(n, bool), np.zeros(n, bool))


def game_step(tick: int, base: float, n_red: int = 2, n_blue: int = 1) -> GameStep:
    groups = {}
    if n_red:
        groups["red"] = step_data(base + np.arange(n_red), 3)
    if n_blue:
        groups["blue"] = step_data(base + 10 + np.arange(n_blue), 1)
    return GameStep(tick, groups)


def red_act(step: int, n: int) -> TrainerAct:
    return TrainerAct(step, {"move": np.tile(np.arange(n, dtype=np.float32)[:, None] / 10, (1, 2))})


def blue_act(step: int, n: int) -> TrainerAct:
    return TrainerAct(step, {"pick": np.arange(n, dtype=np.int64) % 4})


def test_two_games_two_policies_route_rows_and_actions() -> None:
    hub = Hub(expected_games=2, clock=lambda: 0.0)  # no hold deadline passes while the test checks arrays
    red_t, blue_t = FakeLink("red-trainer"), FakeLink("blue-trainer")
    red = hub.add_trainer(red_t, trainer_hello("red"))
    blue = hub.add_trainer(blue_t, trainer_hello("blue"))
    assert red_t.last(Waiting).reason == "waiting for games: 0/2"
    g0_link, g1_link = FakeLink("g0"), FakeLink("g1")
    g0 = hub.add_game(g0_link, game_hello())
    assert red_t.last(Waiting).reason == "waiting for games: 1/2"
    g1 = hub.add_game(g1_link, game_hello())
    assert g0_link.last(Welcome).game_index == 0 and g1_link.last(Welcome).game_index == 1
    info = red_t.last(PolicyInfo)
    assert info.n_envs == 4 and [(g.game_index, g.offset, g.n_agents) for g in info.games] == [(0, 0, 2), (1, 2, 2)]
    assert blue_t.last(PolicyInfo).n_envs == 2

    hub.trainer_reset(red)
    hub.trainer_reset(blue)
    hub.game_step(g1, game_step(0, 100))
    assert not any(isinstance(m, Batch) for m in red_t.sent)  # game 0 has not delivered yet
    hub.game_step(g0, game_step(0, 0))
    batch = red_t.last(Batch)
    np.testing.assert_array_equal(batch.data.obs["obs"][:, 0], [0, 1, 100, 101])
    np.testing.assert_array_equal(blue_t.last(Batch).data.obs["obs"][:, 0], [10, 110])

    hub.trainer_act(red, red_act(batch.step, 4))
    assert not any(isinstance(m, GameActions) for m in g0_link.sent)  # blue has not answered
    hub.trainer_act(blue, blue_act(blue_t.last(Batch).step, 2))
    a0, a1 = g0_link.last(GameActions), g1_link.last(GameActions)
    assert a0.tick == 0 and a1.tick == 0
    np.testing.assert_allclose(a0.groups["red"]["move"][:, 0], [0.0, 0.1])
    np.testing.assert_allclose(a1.groups["red"]["move"][:, 0], [0.2, 0.3])
    assert a0.groups["blue"]["pick"].tolist() == [0] and a1.groups["blue"]["pick"].tolist() == [1]
    assert a0.groups["blue"]["pick"].dtype == np.int32  # canonical dtype forwarded


def test_space_mismatch_names_game_and_group() -> None:
    hub = Hub(expected_games=2)
    hub.add_game(FakeLink("g0"), game_hello())
    other = PolicySpaces((("obs", BoxSpace((4,), "float32", -10, 10)),), (("move", ContinuousAction(2)),))
    with pytest.raises(RemoteProtocolError) as err:
        hub.add_game(FakeLink("g1"), Hello("game", PROTOCOL_VERSION, "odd-one", groups=(GroupSpec("red", 2, other),)))
    assert err.value.code is ErrorCode.SPACE_MISMATCH
    assert "odd-one" in err.value.message and "'red'" in err.value.message


def test_full_broker_unknown_policy_and_taken_policy() -> None:
    hub = Hub(expected_games=1)
    hub.add_game(FakeLink("g0"), game_hello())
    with pytest.raises(RemoteProtocolError) as err:
        hub.add_game(FakeLink("g1"), game_hello())
    assert err.value.code is ErrorCode.BROKER_FULL
    with pytest.raises(RemoteProtocolError) as err:
        hub.add_trainer(FakeLink("t"), trainer_hello("green"))
    assert err.value.code is ErrorCode.UNKNOWN_POLICY and "red" in err.value.message
    hub.add_trainer(FakeLink("t1"), trainer_hello("red"))
    with pytest.raises(RemoteProtocolError) as err:
        hub.add_trainer(FakeLink("t2"), trainer_hello("red"))
    assert err.value.code is ErrorCode.POLICY_TAKEN


def test_trainer_waiting_for_unannounced_policy_is_told_once_layout_completes() -> None:
    hub = Hub(expected_games=1)
    link = FakeLink("t")
    hub.add_trainer(link, trainer_hello("green"))
    hub.add_game(FakeLink("g0"), game_hello())
    assert isinstance(link.closed_with, Error) and link.closed_with.code == "unknown_policy"


def test_bad_steps_and_actions_are_refused_without_side_effects() -> None:
    hub = Hub(expected_games=1)
    g = hub.add_game(FakeLink("g0"), game_hello(n_blue=0))
    t_link = FakeLink("t")
    t = hub.add_trainer(t_link, trainer_hello("red"))
    with pytest.raises(RemoteProtocolError) as err:
        hub.game_step(g, game_step(1, 0, n_blue=0))
    assert err.value.code is ErrorCode.BAD_STEP and "expected tick 0" in err.value.message
    wrong_shape = GameStep(0, {"red": step_data(np.arange(3.0), 3)})
    with pytest.raises(RemoteProtocolError) as err:
        hub.game_step(g, wrong_shape)
    assert "3 rows for 2 agents" in err.value.message
    hub.game_step(g, game_step(0, 0, n_blue=0))
    with pytest.raises(RemoteProtocolError) as err:
        hub.game_step(g, game_step(1, 0, n_blue=0))
    assert err.value.code is ErrorCode.UNEXPECTED_MESSAGE
    hub.trainer_reset(t)
    step = t_link.last(Batch).step
    for bad in (
        TrainerAct(step, {"move": np.zeros((3, 2), np.float32)}),
        TrainerAct(step, {"move": np.zeros((2, 2), np.int32)}),
        TrainerAct(step, {"jump": np.zeros((2, 2), np.float32)}),
        TrainerAct(step + 1, {"move": np.zeros((2, 2), np.float32)}),
    ):
        with pytest.raises(RemoteProtocolError) as err:
            hub.trainer_act(t, bad)
        assert err.value.code is ErrorCode.BAD_ACTIONS
    hub.trainer_act(t, red_act(step, 2))  # the open batch survived the bad attempts


def test_discrete_actions_out_of_range_are_refused() -> None:
    hub = Hub(expected_games=1)
    g = hub.add_game(FakeLink("g0"), game_hello(n_red=0, n_blue=2))
    t_link = FakeLink("t")
    t = hub.add_trainer(t_link, trainer_hello("blue"))
    hub.game_step(g, game_step(0, 0, n_red=0, n_blue=2))
    hub.trainer_reset(t)
    with pytest.raises(RemoteProtocolError) as err:
        hub.trainer_act(t, TrainerAct(t_link.last(Batch).step, {"pick": np.array([0, 4])}))
    assert "[0, 4)" in err.value.message


def test_replaced_game_reports_truncation_with_last_seen_obs() -> None:
    hub = Hub(expected_games=2)
    t_link = FakeLink("t")
    t = hub.add_trainer(t_link, trainer_hello("red"))
    g0 = hub.add_game(FakeLink("g0"), game_hello(n_blue=0))
    g1 = hub.add_game(FakeLink("g1"), game_hello(n_blue=0))
    hub.trainer_reset(t)
    hub.game_step(g0, game_step(0, 0, n_blue=0))
    hub.game_step(g1, game_step(0, 100, n_blue=0))
    first = t_link.last(Batch)
    hub.remove_game(g1)  # game 1 crashes while the trainer thinks
    hub.trainer_act(t, red_act(first.step, 4))  # its slice has nobody to go to
    hub.game_step(g0, game_step(1, 1, n_blue=0))
    assert t_link.last(Batch) is first and t_link.last(Waiting).reason == "waiting for games: 1/2"
    g1b = hub.add_game(FakeLink("g1b"), game_hello(n_blue=0))
    assert g1b.slot == 1
    hub.game_step(g1b, game_step(0, 500, n_blue=0))
    batch = t_link.last(Batch)
    assert batch.step == first.step + 1
    np.testing.assert_array_equal(batch.data.truncated, [False, False, True, True])
    np.testing.assert_array_equal(batch.data.obs["obs"][:, 0], [1, 2, 500, 501])
    assert batch.data.final_index is not None and batch.data.final_obs is not None
    assert batch.data.final_index.tolist() == [2, 3]
    np.testing.assert_array_equal(batch.data.final_obs["obs"][:, 0], [100, 101])
    assert batch.data.infos[2]["game_replaced"] is True


def test_restarted_trainer_gets_the_open_batch_again() -> None:
    hub = Hub(expected_games=1)
    g_link = FakeLink("g0")
    g = hub.add_game(g_link, game_hello(n_blue=0))
    t1_link = FakeLink("t1")
    t1 = hub.add_trainer(t1_link, trainer_hello("red"))
    hub.game_step(g, game_step(0, 0, n_blue=0))
    hub.trainer_reset(t1)
    open_batch = t1_link.last(Batch)
    hub.remove_trainer(t1)  # killed before answering
    t2_link = FakeLink("t2")
    t2 = hub.add_trainer(t2_link, trainer_hello("red"))
    hub.trainer_reset(t2)
    assert t2_link.last(Batch) is open_batch
    hub.trainer_act(t2, red_act(open_batch.step, 2))
    assert g_link.last(GameActions).tick == 0


def test_replacement_game_must_match_slot_layout() -> None:
    hub = Hub(expected_games=1)
    g = hub.add_game(FakeLink("g0"), game_hello(n_red=2))
    hub.remove_game(g)
    with pytest.raises(RemoteProtocolError) as err:
        hub.add_game(FakeLink("g0b"), game_hello(n_red=3))
    assert err.value.code is ErrorCode.SPACE_MISMATCH
    hub.add_game(FakeLink("g0c"), game_hello(n_red=2))


def test_final_observations_and_infos_are_remapped_to_env_rows() -> None:
    hub = Hub(expected_games=2)
    t_link = FakeLink("t")
    t = hub.add_trainer(t_link, trainer_hello("red"))
    games = [hub.add_game(FakeLink(f"g{i}"), game_hello(n_blue=0)) for i in range(2)]
    hub.trainer_reset(t)
    for i, g in enumerate(games):
        data = step_data(np.array([i * 10.0, i * 10.0 + 1]), 3)
        data.terminated[1] = True
        data = replace(
            data,
            final_index=np.array([1], np.int32),
            final_obs={"obs": np.full((1, 3), -i - 1, np.float32)},
            infos={1: {"who": i}},
        )
        hub.game_step(g, GameStep(0, {"red": data}))
    batch = t_link.last(Batch).data
    assert batch.final_index is not None and batch.final_obs is not None
    assert batch.final_index.tolist() == [1, 3]
    np.testing.assert_array_equal(batch.final_obs["obs"][:, 0], [-1, -2])
    assert batch.infos == {1: {"who": 0}, 3: {"who": 1}}
    np.testing.assert_array_equal(batch.terminated, [False, True, False, True])


# --- the sans-IO hub itself: what each way in returns ------------------------------------------------


@dataclass(frozen=True)
class Peer:
    label: str


def test_joining_returns_welcomes_notices_and_policy_info() -> None:
    hub = CoreHub(expected_games=1, clock=lambda: 0.0)
    t, g = Peer("t"), Peer("g")
    assert hub.handle(t, trainer_hello("red")) == [
        Send(t, Welcome(PROTOCOL_VERSION, 1)),
        Send(t, Waiting("red", 0, 1, "waiting for games: 0/1")),
    ]
    assert hub.handle(g, game_hello(n_blue=0)) == [
        Send(g, Welcome(PROTOCOL_VERSION, 2, 0)),
        Send(t, PolicyInfo("red", 2, RED, (GameLayout(0, 0, 2),))),
    ]
    with pytest.raises(RemoteProtocolError) as err:
        hub.handle(t, game_step(0, 0, n_blue=0))  # a trainer's connection sending a game's step
    assert err.value.code is ErrorCode.UNEXPECTED_MESSAGE


def test_a_deadline_is_a_timer_value_and_a_stale_one_does_nothing() -> None:
    now = [0.0]
    hub = CoreHub(expected_games=1, clock=lambda: now[0])
    t, g = Peer("t"), Peer("g")
    hub.handle(g, game_hello(n_red=0, n_blue=2))
    hub.handle(t, trainer_hello("blue"))
    hub.handle(t, TrainerReset())
    effects = hub.handle(g, game_step(0, 0, n_red=0, n_blue=2))
    batch = effects[0]
    assert isinstance(batch, Send) and isinstance(batch.message, Batch) and batch.peer == t
    game_id = hub.slots[0].game.peer_id  # type: ignore[union-attr]
    deadline = Deadline(game_id, 0, "blue", 0.0)
    assert effects[1:] == [StartTimer(0.02, deadline)]
    now[0] = 0.02
    assert hub.timer_fired(deadline) == [Send(g, GameActions(0, {}))]  # held: no actions yet, repeat
    assert hub.timer_fired(deadline) == []  # that tick is answered
    late = hub.handle(t, blue_act(batch.message.step, 2))
    assert late == []  # the actions wait for the game's next step
    [reply] = hub.handle(g, game_step(1, 0, n_red=0, n_blue=2))
    assert isinstance(reply, Send) and reply.peer == g and isinstance(reply.message, GameActions)
    assert reply.message.tick == 1 and reply.message.groups["blue"]["pick"].tolist() == [0, 1]


def test_a_lost_trainer_releases_its_hold_mode_games_and_a_lost_game_its_slot() -> None:
    hub = CoreHub(expected_games=1, clock=lambda: 0.0, timers=False)
    t, g = Peer("t"), Peer("g")
    hub.handle(g, game_hello(n_red=0, n_blue=1))
    hub.handle(t, trainer_hello("blue"))
    hub.handle(t, TrainerReset())
    hub.handle(g, game_step(0, 0, n_red=0, n_blue=1))
    assert hub.peer_lost(t) == [Send(g, GameActions(0, {}))]
    assert hub.peer_lost(t) == []
    assert hub.peer_lost(g) == [] and hub.slots[0].game is None and hub.games_connected() == 0


def test_an_undeliverable_batch_goes_again_without_its_infos_then_the_trainer_is_closed() -> None:
    hub = CoreHub(expected_games=1, clock=lambda: 0.0)
    t, g = Peer("t"), Peer("g")
    hub.handle(g, game_hello(n_red=0, n_blue=2))
    hub.handle(t, trainer_hello("blue"))
    hub.handle(t, TrainerReset())
    plain = game_step(0, 0, n_red=0, n_blue=2)
    step = GameStep(0, {**plain.groups, "blue": replace(plain.groups["blue"], infos={1: {"big": 10**30}})})
    sent = hub.handle(g, step)[0]
    assert isinstance(sent, Send) and isinstance(sent.message, Batch)
    assert hub.batch_undeliverable(t, sent.message.step + 1, lambda value: False) == []  # not the open batch
    again = hub.batch_undeliverable(t, sent.message.step, lambda value: "big" not in value)
    assert len(again) == 1 and isinstance(again[0], Send) and isinstance(again[0].message, Batch)
    assert again[0].message.step == sent.message.step and again[0].message.data.infos == {1: DROPPED_INFO}
    assert hub.batch_undeliverable(t, sent.message.step, lambda value: False) == [
        Close(t, Error("internal", "the broker could not encode the batch"))
    ]


def test_every_state_change_is_in_the_one_table() -> None:
    assert advance(GameState.STEPPING, "step") is GameState.WAITING
    assert advance(TrainerState.ASKING, "batch_sent") is TrainerState.IDLE
    with pytest.raises(AssertionError, match="no transition"):
        advance(GameState.STEPPING, "reply")  # a reply with no step waiting would be a hub bug
    states = {state for state, _ in TRANSITIONS} | set(TRANSITIONS.values())
    assert states == set(GameState) | set(GroupWait) | set(TrainerState)


def test_pacing_and_stall_checks_are_timer_values_too() -> None:
    now = [0.0]
    hub = CoreHub(expected_games=1, stepping=StepOptions("hold"), clock=lambda: now[0])
    g = Peer("g")
    hub.handle(g, game_hello(n_red=0, n_blue=1))
    game_id = hub.slots[0].game.peer_id  # type: ignore[union-attr]
    assert hub.handle(g, game_step(0, 0, n_red=0, n_blue=1)) == [Send(g, GameActions(0, {}))]
    idle = IdleTick(game_id, 1)
    assert hub.handle(g, game_step(1, 0, n_red=0, n_blue=1)) == [StartTimer(IDLE_TICK_S, idle)]
    now[0] = IDLE_TICK_S / 2
    assert hub.timer_fired(idle) == [StartTimer(IDLE_TICK_S / 2, idle)]  # early: the rest of the interval
    now[0] = IDLE_TICK_S
    assert hub.timer_fired(idle) == [Send(g, GameActions(1, {}))]
    barrier = CoreHub(expected_games=1, stepping=StepOptions("barrier"), clock=lambda: now[0])
    t = Peer("t")
    barrier.handle(g, game_hello(n_red=0, n_blue=1))
    barrier.handle(t, trainer_hello("blue"))
    barrier.handle(t, TrainerReset())
    assert barrier.handle(g, game_step(0, 0, n_red=0, n_blue=1))[1:] == [StartTimer(STALL_REPORT_S, StallCheck())]
    now[0] += STALL_REPORT_S
    with structlog.testing.capture_logs() as logs:
        assert barrier.timer_fired(StallCheck()) == [StartTimer(STALL_REPORT_S, StallCheck())]  # still waiting
    assert logs[0]["event"] == "policy blue: trainer 't-blue' has not answered batch 1 for 5 s; games 0 wait (barrier)"
    untimed = CoreHub(expected_games=1, stepping=StepOptions("barrier"), timers=False)
    untimed.handle(g, game_hello(n_red=0, n_blue=1))
    untimed.handle(t, trainer_hello("blue"))
    untimed.handle(t, TrainerReset())
    assert not any(isinstance(e, StartTimer) for e in untimed.handle(g, game_step(0, 0, n_red=0, n_blue=1)))
