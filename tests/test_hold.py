"""Hold-and-accumulate stepping in the hub, with a fake clock: a busy trainer never stalls a game beyond its
deadline; held ticks are summed into the transition, which reports its length in frames; an episode end during
a hold closes the transition with its terminal observation; no action is ever invented for training."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from broker.protocol import PROTOCOL_VERSION
from broker.protocol.messages import Batch, GameActions, GameStep, Hello, StepData, StepOptions, TrainerAct
from broker.protocol.spaces import BoxSpace, ContinuousAction, GroupSpec, PolicySpaces
from tests.hub_driver import LinkHub as Hub
from tests.test_hub import FakeLink

SPACES = PolicySpaces((("obs", BoxSpace((1,), "float32", -100, 100)),), (("move", ContinuousAction(1)),))


class FakeScheduler:
    """Collects the hub's deadline timers; tests fire them explicitly (no sleeping)."""

    def __init__(self) -> None:
        self.timers: list[tuple[float, Callable[[], None]]] = []

    def __call__(self, delay: float, callback: Callable[[], None]) -> None:
        self.timers.append((delay, callback))

    def deadlines(self) -> list[float]:
        """The delays of the pending timers other than the hub's stall report (barrier games waiting long)."""
        return [delay for delay, callback in self.timers if getattr(callback, "__name__", "") != "report_stalls"]

    def fire_all(self) -> None:
        timers, self.timers = self.timers, []
        for _, callback in timers:
            callback()


def make_hub(policies: tuple[str, ...] = ("fast",), n: int = 2, **options: Any) -> tuple[Hub, FakeScheduler, Any]:
    scheduler = FakeScheduler()
    hub = Hub(1, StepOptions(**options), scheduler=scheduler)
    game_link = FakeLink("game")
    groups = tuple(GroupSpec(p, n, SPACES) for p in policies)
    game = hub.add_game(game_link, Hello("game", PROTOCOL_VERSION, "g", groups=groups))
    return hub, scheduler, (game, game_link)


def add_trainer(hub: Hub, policy: str, **options: Any) -> tuple[Any, FakeLink]:
    link = FakeLink(policy)
    stepping = StepOptions(**options) if options else None
    trainer = hub.add_trainer(link, Hello("trainer", PROTOCOL_VERSION, policy, policy=policy, stepping=stepping))
    hub.trainer_reset(trainer)
    return trainer, link


def tick(
    tick: int,
    rewards: list[float],
    policies: tuple[str, ...] = ("fast",),
    ended: dict[int, str] | None = None,
    final: float | None = None,
) -> GameStep:
    n = len(rewards)
    groups = {}
    for p in policies:
        data = StepData(
            {"obs": np.full((n, 1), tick, np.float32)},
            np.array(rewards, np.float32),
            np.zeros(n, bool),
            np.zeros(n, bool),
        )
        for row, kind in (ended or {}).items():
            (data.terminated if kind == "terminated" else data.truncated)[row] = True
        if ended and final is not None:
            data = replace(
                data,
                final_index=np.array(sorted(ended), np.int32),
                final_obs={"obs": np.full((len(ended), 1), final, np.float32)},
            )
        groups[p] = data
    return GameStep(tick, groups)


def act(value: float, step: int, n: int = 2) -> TrainerAct:
    return TrainerAct(step, {"move": np.full((n, 1), value, np.float32)})


def test_held_ticks_are_summed_and_reported_as_frames() -> None:
    hub, scheduler, (game, game_link) = make_hub()
    trainer, t_link = add_trainer(hub, "fast")
    hub.game_step(game, tick(0, [0, 0]))
    first = t_link.last(Batch)
    assert first.data.frames is not None and first.data.frames.tolist() == [1, 1]
    # The trainer is busy (say, a PPO update): the game is answered at its deadline, without this group.
    assert not game_link.sent or not isinstance(game_link.sent[-1], GameActions)
    scheduler.fire_all()
    assert game_link.last(GameActions).tick == 0 and game_link.last(GameActions).groups == {}
    hub.game_step(game, tick(1, [1.0, 10.0]))
    scheduler.fire_all()
    hub.game_step(game, tick(2, [2.0, 20.0]))
    # The trainer answers the batch it got at tick 0; the game, waiting on tick 2, receives it at once.
    hub.trainer_act(trainer, act(0.5, first.step))
    reply = game_link.last(GameActions)
    assert reply.tick == 2 and reply.groups["fast"]["move"].tolist() == [[0.5], [0.5]]
    assert t_link.last(Batch) is first  # no transition before its action has acted for a tick
    hub.game_step(game, tick(3, [4.0, 40.0]))
    batch = t_link.last(Batch)
    assert batch.step == first.step + 1
    assert batch.data.reward.tolist() == [7.0, 70.0]
    assert batch.data.frames is not None and batch.data.frames.tolist() == [3, 3]
    assert batch.data.obs["obs"][:, 0].tolist() == [3.0, 3.0]  # the newest observation
    status = hub.snapshot()["policies"]["fast"]
    assert status["held_fraction"] == pytest.approx(2 / 4) and status["longest_hold"] == 3


def test_terminal_during_hold_closes_the_transition_with_its_final_observation() -> None:
    hub, scheduler, (game, game_link) = make_hub()
    trainer, t_link = add_trainer(hub, "fast")
    hub.game_step(game, tick(0, [0, 0]))
    first = t_link.last(Batch)
    hub.trainer_act(trainer, act(0.25, first.step))  # applied at tick 0's reply: agents now do 0.25
    hub.game_step(game, tick(1, [1.0, 1.0]))
    second = t_link.last(Batch)
    scheduler.fire_all()  # trainer busy again: held
    hub.game_step(game, tick(2, [2.0, 2.0], ended={1: "terminated"}, final=-2.0))
    scheduler.fire_all()
    hub.game_step(game, tick(3, [4.0, 4.0]))  # agent 1 is in its next episode, still held
    hub.trainer_act(trainer, act(0.75, second.step))
    reply = game_link.last(GameActions)
    # Agent 0 gets the new action; agent 1's episode ended after the observation it was computed from,
    # so agent 1 keeps its previous action rather than carrying a decision into an episode it never saw.
    assert reply.groups["fast"]["move"].tolist() == [[0.75], [0.25]]
    hub.game_step(game, tick(4, [8.0, 8.0]))
    data = t_link.last(Batch).data
    assert data.terminated.tolist() == [False, True]
    assert data.reward.tolist() == [14.0, 2.0]  # agent 1: only up to its terminal tick
    assert data.frames is not None and data.frames.tolist() == [3, 1]
    assert data.final_index is not None and data.final_obs is not None
    assert data.final_index.tolist() == [1] and data.final_obs["obs"][:, 0].tolist() == [-2.0]
    assert data.obs["obs"][:, 0].tolist() == [4.0, 4.0]
    assert data.infos[1]["action_applied"] is False and 0 not in data.infos


def test_held_groups_never_get_invented_actions_and_noop_is_explicit() -> None:
    hub, scheduler, (game, game_link) = make_hub(policies=("a", "b"))
    ta, ta_link = add_trainer(hub, "a")
    add_trainer(hub, "b", hold_action="noop")
    hub.game_step(game, tick(0, [0, 0], policies=("a", "b")))
    hub.trainer_act(ta, act(0.5, ta_link.last(Batch).step))
    scheduler.fire_all()  # b is busy
    reply = game_link.last(GameActions)
    assert set(reply.groups) == {"a", "b"}
    assert reply.groups["a"]["move"].tolist() == [[0.5], [0.5]]
    assert reply.groups["b"]["move"].tolist() == [[0.0], [0.0]]  # the declared no-op, not a guess


def test_repeat_hold_omits_the_group_from_the_reply() -> None:
    hub, scheduler, (game, game_link) = make_hub(policies=("a", "b"))
    ta, ta_link = add_trainer(hub, "a")
    add_trainer(hub, "b")
    hub.game_step(game, tick(0, [0, 0], policies=("a", "b")))
    hub.trainer_act(ta, act(0.5, ta_link.last(Batch).step))
    assert not isinstance(game_link.sent[-1], GameActions)  # b has until its deadline
    scheduler.fire_all()
    assert set(game_link.last(GameActions).groups) == {"a"}


def test_policy_without_trainer_does_not_stall_others() -> None:
    hub, scheduler, (game, game_link) = make_hub(policies=("a", "orphan"))
    ta, ta_link = add_trainer(hub, "a")
    for t in range(3):
        hub.game_step(game, tick(t, [1, 1], policies=("a", "orphan")))
        hub.trainer_act(ta, act(0.1, ta_link.last(Batch).step))
        assert game_link.last(GameActions).tick == t  # answered at once: nobody trains "orphan"
    assert scheduler.timers == [] or all(d > 0 for d, _ in scheduler.timers)


def test_strict_barrier_waits_and_reports_no_frames() -> None:
    hub, scheduler, (game, game_link) = make_hub(mode="barrier")
    trainer, t_link = add_trainer(hub, "fast")
    hub.game_step(game, tick(0, [1, 1]))
    batch = t_link.last(Batch)
    assert batch.data.frames is None
    assert scheduler.deadlines() == []  # no deadline: the game waits as long as the trainer needs
    assert not any(isinstance(m, GameActions) for m in game_link.sent)
    hub.trainer_act(trainer, act(0.5, batch.step))
    assert game_link.last(GameActions).groups["fast"]["move"].tolist() == [[0.5], [0.5]]
    hub.game_step(game, tick(1, [2, 2]))
    assert t_link.last(Batch).data.reward.tolist() == [2.0, 2.0]


def test_barrier_with_deadline_falls_back_to_hold() -> None:
    hub, scheduler, (game, game_link) = make_hub(mode="barrier", deadline_ms=500.0)
    add_trainer(hub, "fast")
    hub.game_step(game, tick(0, [1, 1]))
    assert [d for d, _ in scheduler.timers] == [0.5]
    scheduler.fire_all()
    assert game_link.last(GameActions).groups == {}


def test_trainer_choice_overrides_broker_default() -> None:
    hub, scheduler, (game, _) = make_hub(mode="hold")
    add_trainer(hub, "fast", mode="barrier")
    assert hub.policies["fast"].options.mode == "barrier"
    hub.game_step(game, tick(0, [1, 1]))
    assert scheduler.deadlines() == []


def test_trainer_attaching_mid_tick_gets_a_deadline_instead_of_stalling_the_game() -> None:
    hub, scheduler, (game, game_link) = make_hub(policies=("a", "b"))
    ta, ta_link = add_trainer(hub, "a")
    hub.game_step(game, tick(0, [0, 0], policies=("a", "b")))  # b has no trainer yet: no timer for it
    add_trainer(hub, "b")  # b's trainer arrives while the game waits for a's actions
    hub.trainer_act(ta, act(0.5, ta_link.last(Batch).step))
    assert not isinstance(game_link.sent[-1], GameActions)  # now waiting for b, within its deadline
    scheduler.fire_all()
    assert set(game_link.last(GameActions).groups) == {"a"}


def test_a_trainer_busy_past_its_deadline_is_held_at_once_on_later_ticks() -> None:
    now = [0.0]
    scheduler = FakeScheduler()
    hub = Hub(1, StepOptions(), scheduler=scheduler, clock=lambda: now[0])
    game_link = FakeLink("game")
    hello = Hello("game", PROTOCOL_VERSION, "g", groups=(GroupSpec("a", 2, SPACES), GroupSpec("b", 2, SPACES)))
    game = hub.add_game(game_link, hello)
    ta, ta_link = add_trainer(hub, "a")
    add_trainer(hub, "b")  # b takes its batch and goes quiet (a long update)
    hub.game_step(game, tick(0, [0, 0], policies=("a", "b")))
    hub.trainer_act(ta, act(0.5, ta_link.last(Batch).step))
    now[0] += 0.021
    scheduler.fire_all()  # first tick: b is held after its deadline
    assert set(game_link.last(GameActions).groups) == {"a"}
    hub.game_step(game, tick(1, [0, 0], policies=("a", "b")))
    hub.trainer_act(ta, act(0.5, ta_link.last(Batch).step))
    # b's batch has been open longer than its deadline: no second wait
    assert game_link.last(GameActions).tick == 1 and set(game_link.last(GameActions).groups) == {"a"}


def test_default_deadline_adapts_to_a_slow_but_steady_trainer() -> None:
    now = [0.0]
    scheduler = FakeScheduler()
    hub = Hub(1, StepOptions(), scheduler=scheduler, clock=lambda: now[0])
    game = hub.add_game(FakeLink("game"), Hello("game", PROTOCOL_VERSION, "g", groups=(GroupSpec("a", 2, SPACES),)))
    trainer, t_link = add_trainer(hub, "a")
    for t in range(10):  # the trainer answers every batch in 15 ms: a 20 ms floor would hold it often
        hub.game_step(game, tick(t, [0, 0], policies=("a",)))
        now[0] += 0.015
        hub.trainer_act(trainer, act(0.1, t_link.last(Batch).step))
        scheduler.timers.clear()
    assert hub.policies["a"].deadline_s == pytest.approx(4 * 0.015)
    explicit = Hub(1, StepOptions(deadline_ms=5.0))
    explicit.add_game(FakeLink("g"), Hello("game", PROTOCOL_VERSION, "g", groups=(GroupSpec("a", 2, SPACES),)))
    assert explicit.policies["a"].deadline_s == pytest.approx(0.005)  # an explicit deadline is kept


def test_a_game_waits_for_the_round_not_for_a_busy_trainer() -> None:
    now = [0.0]
    scheduler = FakeScheduler()
    hub = Hub(2, StepOptions(), scheduler=scheduler, clock=lambda: now[0])
    hello = Hello("game", PROTOCOL_VERSION, "g", groups=(GroupSpec("a", 2, SPACES),))
    fast_link, slow_link = FakeLink("fast"), FakeLink("slow")
    fast, slow = hub.add_game(fast_link, hello), hub.add_game(slow_link, hello)
    trainer, t_link = add_trainer(hub, "a")
    hub.game_step(fast, tick(0, [0, 0], policies=("a",)))
    now[0] += 0.021
    scheduler.fire_all()  # the trainer is waiting for the slow game, not busy: keep waiting
    assert not any(isinstance(m, GameActions) for m in fast_link.sent)
    hub.game_step(slow, tick(0, [0, 0], policies=("a",)))
    hub.trainer_act(trainer, act(0.5, t_link.last(Batch).step, n=4))
    assert fast_link.last(GameActions).groups["a"]["move"].tolist() == [[0.5], [0.5]]
    # A game that never delivers holds the others back at most ROUND_WAIT_CAP_S.
    hub.game_step(fast, tick(1, [0, 0], policies=("a",)))
    for _ in range(30):
        now[0] += 0.021
        scheduler.fire_all()
    assert fast_link.last(GameActions).tick == 1 and fast_link.last(GameActions).groups == {}


def test_adaptive_deadline_is_capped() -> None:
    hub, _, _ = make_hub()
    policy = hub.policies["fast"]
    for _ in range(10):
        policy.record_response(5.0)  # a script that steps another policy in between, say
    assert policy.deadline_s == pytest.approx(0.1)


def test_a_barrier_trainer_attaching_after_its_policy_was_held_answers_the_tick_it_saw() -> None:
    # The broker's default is hold: "b" has no trainer, so game ticks are answered without it. Its trainer
    # arrives (barrier) just after tick 0 was answered: a batch of tick 0 now would have its actions applied
    # at tick 1 and its next transition span two ticks unannounced. It gets tick 1, which still waits.
    hub, _scheduler, (game, game_link) = make_hub(policies=("a", "b"))
    ta, ta_link = add_trainer(hub, "a", mode="barrier")
    hub.game_step(game, tick(0, [0, 0], policies=("a", "b")))
    hub.trainer_act(ta, act(0.0, ta_link.last(Batch).step))
    assert game_link.last(GameActions).tick == 0 and set(game_link.last(GameActions).groups) == {"a"}
    tb, tb_link = add_trainer(hub, "b", mode="barrier")
    assert not tb_link.sent or not isinstance(tb_link.sent[-1], Batch)  # tick 0 is answered already
    hub.game_step(game, tick(1, [1, 1], policies=("a", "b")))
    first = tb_link.last(Batch)
    assert first.data.obs["obs"][:, 0].tolist() == [1.0, 1.0]
    hub.trainer_act(tb, act(0.5, first.step))
    assert game_link.last(GameActions).tick == 0  # barrier: tick 1 waits for "a" as well
    hub.trainer_act(ta, act(0.0, ta_link.last(Batch).step))
    reply = game_link.last(GameActions)
    assert reply.tick == 1 and reply.groups["b"]["move"].tolist() == [[0.5], [0.5]]
    hub.game_step(game, tick(2, [2, 2], policies=("a", "b")))
    batch = tb_link.last(Batch)
    assert batch.step == first.step + 1 and batch.data.obs["obs"][:, 0].tolist() == [2.0, 2.0]
    assert batch.data.frames is None  # one tick: lock-step, as godot_rl


def test_barrier_transitions_that_span_held_ticks_report_their_frames() -> None:
    hub, scheduler, (game, game_link) = make_hub(mode="barrier", deadline_ms=500.0)
    trainer, t_link = add_trainer(hub, "fast")
    hub.game_step(game, tick(0, [1, 1]))
    first = t_link.last(Batch)
    scheduler.fire_all()  # the deadline: tick 0 is answered without the trainer
    hub.game_step(game, tick(1, [2, 2]))
    hub.trainer_act(trainer, act(0.5, first.step))  # applied at tick 1
    assert game_link.last(GameActions).tick == 1
    hub.game_step(game, tick(2, [4, 4]))
    batch = t_link.last(Batch)
    assert batch.data.reward.tolist() == [6.0, 6.0]
    assert batch.data.frames is not None and batch.data.frames.tolist() == [2, 2]
