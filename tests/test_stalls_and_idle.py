"""Issue #13, broker side, in the hub with a fake clock and scheduler: a barrier stall is logged and the
waiting trainers are told why; a game with no trainer at all is paced, never run flat out; status rates
fall to 0 once a trainer leaves, and trainers waiting for games are shown."""

from __future__ import annotations

from typing import Any

import numpy as np
import structlog

from broker.core.holding import IDLE_TICK_S, STALL_REPORT_S
from broker.core.metrics import RateMeter
from broker.protocol import PROTOCOL_VERSION
from broker.protocol.messages import Batch, GameActions, Hello, StepOptions, Waiting
from broker.protocol.spaces import GroupSpec
from tests.hub_driver import LinkHub as Hub
from tests.test_hold import SPACES, FakeScheduler, act, tick
from tests.test_hub import FakeLink


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def two_policy_hub(mode: str = "hold", games: int = 1) -> tuple[Hub, FakeScheduler, Clock]:
    scheduler, clock = FakeScheduler(), Clock()
    hub = Hub(games, StepOptions(mode), scheduler=scheduler, clock=clock)
    return hub, scheduler, clock


def join_game(hub: Hub, policies: tuple[str, ...] = ("mover", "picker")) -> tuple[Any, FakeLink]:
    link = FakeLink("game")
    groups = tuple(GroupSpec(p, 2, SPACES) for p in policies)
    return hub.add_game(link, Hello("game", PROTOCOL_VERSION, "g", groups=groups)), link


def join_trainer(hub: Hub, policy: str) -> tuple[Any, FakeLink]:
    link = FakeLink(policy)
    trainer = hub.add_trainer(link, Hello("trainer", PROTOCOL_VERSION, f"t-{policy}", policy=policy))
    hub.trainer_reset(trainer)
    return trainer, link


def test_barrier_stall_for_a_policy_without_trainer_is_logged_and_told_to_the_other_trainer() -> None:
    hub, scheduler, clock = two_policy_hub("barrier")
    game, game_link = join_game(hub)
    picker, picker_link = join_trainer(hub, "picker")
    hub.game_step(game, tick(0, [1, 1], policies=("mover", "picker")))
    hub.trainer_act(picker, act(0.5, picker_link.last(Batch).step))
    assert not any(isinstance(m, GameActions) for m in game_link.sent)  # barrier: waits for mover's actions
    assert [delay for delay, _ in scheduler.timers] == [STALL_REPORT_S]  # one stall check, no deadline
    with structlog.testing.capture_logs() as logs:
        for _seconds in (STALL_REPORT_S, 2 * STALL_REPORT_S):
            clock.now += STALL_REPORT_S
            scheduler.fire_all()
    warnings = [e["event"] for e in logs if e["log_level"] == "warning"]
    assert warnings == ["policy mover: no trainer; games 0 wait (barrier)"] * 2
    told = [m.reason for m in picker_link.sent if isinstance(m, Waiting)]
    assert told[-2:] == [
        "waiting for game steps: games 0 wait for policy 'mover' (no trainer, barrier stepping) for 5 s",
        "waiting for game steps: games 0 wait for policy 'mover' (no trainer, barrier stepping) for 10 s",
    ]
    assert [delay for delay, _ in scheduler.timers] == [STALL_REPORT_S]  # still stalled: checked again
    status = hub.snapshot()["policies"]
    assert status["mover"]["state"] == "no trainer" and status["picker"]["state"] == "training"


def test_barrier_stall_names_a_trainer_that_does_not_answer() -> None:
    hub, scheduler, clock = two_policy_hub("barrier")
    game, _ = join_game(hub)
    join_trainer(hub, "mover")  # gets its batch and never answers
    picker, picker_link = join_trainer(hub, "picker")
    hub.game_step(game, tick(0, [1, 1], policies=("mover", "picker")))
    hub.trainer_act(picker, act(0.5, picker_link.last(Batch).step))
    clock.now += STALL_REPORT_S
    with structlog.testing.capture_logs() as logs:
        scheduler.fire_all()
    assert [e["event"] for e in logs] == [
        "policy mover: trainer 't-mover' has not answered batch 1 for 5 s; games 0 wait (barrier)"
    ]
    assert "trainer 't-mover' has not answered batch 1" in picker_link.last(Waiting).reason
    assert hub.snapshot()["policies"]["mover"]["state"].startswith("stalled: trainer 't-mover' has not answered")


def test_no_stall_report_once_the_game_moves_on() -> None:
    hub, scheduler, clock = two_policy_hub("barrier")
    game, game_link = join_game(hub, ("mover",))
    mover, mover_link = join_trainer(hub, "mover")
    hub.game_step(game, tick(0, [1, 1], policies=("mover",)))
    hub.trainer_act(mover, act(0.5, mover_link.last(Batch).step))
    assert game_link.last(GameActions).tick == 0
    clock.now += STALL_REPORT_S
    with structlog.testing.capture_logs() as logs:
        scheduler.fire_all()
    assert logs == [] and scheduler.timers == []


def test_a_game_with_no_trainer_at_all_is_paced_to_one_tick_per_idle_interval() -> None:
    hub, scheduler, clock = two_policy_hub("hold")
    game, game_link = join_game(hub)
    hub.game_step(game, tick(0, [1, 1], policies=("mover", "picker")))
    assert game_link.last(GameActions).tick == 0  # the first tick is answered at once
    hub.game_step(game, tick(1, [1, 1], policies=("mover", "picker")))
    assert game_link.last(GameActions).tick == 0  # the next one waits for the idle interval
    assert [round(delay, 6) for delay, _ in scheduler.timers] == [IDLE_TICK_S]
    clock.now += IDLE_TICK_S
    scheduler.fire_all()
    assert game_link.last(GameActions).tick == 1 and set(game_link.last(GameActions).groups) == set()
    assert hub.snapshot()["policies"]["mover"]["held_fraction"] == 1.0


def test_pacing_keeps_hold_semantics_when_any_policy_has_a_trainer() -> None:
    hub, scheduler, _clock = two_policy_hub("hold")
    game, game_link = join_game(hub)
    picker, picker_link = join_trainer(hub, "picker")
    for t in range(3):
        hub.game_step(game, tick(t, [1, 1], policies=("mover", "picker")))
        hub.trainer_act(picker, act(0.1, picker_link.last(Batch).step))
        assert game_link.last(GameActions).tick == t  # mover (no trainer) is held at once, not paced
    assert all(round(delay, 6) != IDLE_TICK_S for delay, _ in scheduler.timers)


def test_a_trainer_attaching_to_a_paced_game_is_served_at_once() -> None:
    hub, scheduler, _clock = two_policy_hub("hold")
    game, game_link = join_game(hub, ("mover",))
    hub.game_step(game, tick(0, [1, 1], policies=("mover",)))
    hub.game_step(game, tick(1, [1, 1], policies=("mover",)))  # paced
    mover, mover_link = join_trainer(hub, "mover")
    hub.trainer_act(mover, act(0.5, mover_link.last(Batch).step))
    reply = game_link.last(GameActions)
    assert reply.tick == 1 and reply.groups["mover"]["move"].tolist() == [[0.5], [0.5]]
    scheduler.fire_all()  # the stale idle timer does nothing
    assert sum(isinstance(m, GameActions) for m in game_link.sent) == 2


def test_rates_fall_to_zero_after_the_trainer_leaves_and_state_says_no_trainer() -> None:
    hub, _scheduler, clock = two_policy_hub("hold")
    game, _game_link = join_game(hub, ("mover",))
    mover, mover_link = join_trainer(hub, "mover")
    for t in range(20):
        hub.game_step(game, tick(t, [1, 1], policies=("mover",)))
        clock.now += 0.01
        hub.trainer_act(mover, act(0.1, mover_link.last(Batch).step))
    busy = hub.snapshot()["policies"]["mover"]
    assert busy["steps_per_s"] > 0 and busy["trainer"] == "t-mover" and busy["state"] == "training"
    hub.remove_trainer(mover)
    clock.now += 11.0  # longer than the 10 s window; the game, paced, sends nothing meanwhile
    gone = hub.snapshot()["policies"]["mover"]
    assert gone["steps_per_s"] == 0.0 and gone["game_ticks_per_s"] == 0.0
    assert gone["trainer"] is None and gone["state"] == "no trainer" and gone["env_steps"] == busy["env_steps"]


def test_trainers_waiting_for_games_and_half_joined_layouts_are_shown() -> None:
    hub, _, _ = two_policy_hub("hold", games=2)
    join_trainer(hub, "mover")
    join_trainer(hub, "picker")
    early = hub.snapshot()["policies"]
    assert set(early) == {"mover", "picker"}
    assert early["mover"]["trainer"] == "t-mover" and early["mover"]["state"] == "waiting for games: 0/2"
    assert early["mover"]["agents"] == 0
    join_game(hub)  # 1 of 2 games
    half = hub.snapshot()["policies"]
    assert half["mover"]["agents"] == 2 and half["picker"]["agents"] == 2 and half["mover"]["envs"] == 0
    assert half["picker"]["trainer"] == "t-picker" and half["picker"]["state"] == "waiting for games: 1/2"
    join_game(hub)
    full = hub.snapshot()["policies"]
    assert full["mover"]["agents"] == 4 and full["mover"]["envs"] == 4 and full["mover"]["state"] == "training"
    assert np.isclose(full["mover"]["held_fraction"], 0.0)


def test_rate_meter_counts_the_window_ending_now() -> None:
    meter = RateMeter(window_s=10.0)
    for i in range(21):  # 10 events per second for 20 s
        meter.add(float(i), 10 * i)
    assert 9.0 <= meter.rate(20.0) <= 11.0
    assert 0.0 < meter.rate(25.0) < meter.rate(20.0)  # decaying: nothing new for 5 s
    assert meter.rate(30.5) == 0.0  # nothing new for longer than the window


def test_rate_meter_keeps_few_marks_at_a_high_rate_and_the_rate_exact() -> None:
    meter = RateMeter(window_s=10.0)
    for i in range(20_001):  # 1,000 events per second for 20 s
        meter.add(i / 1000, i)
    assert len(meter.marks) <= 102  # a mark per 0.1 s in the window, and the baseline
    assert 990.0 <= meter.rate(20.0) <= 1010.0
    assert meter.latest == 20_000
