"""Who runs the in-process broker's event loop: a trainer waiting in step_wait runs it on its own thread (a
game's step reaches the policy with no thread hop); while no trainer waits the broker's daemon thread runs
it, so games are still served; with several trainers attached, and for a trainer whose thread already runs
an event loop (a notebook), the daemon thread runs it; a broker told to expect several trainers (or none)
runs uvloop on its daemon thread the whole time; closing the broker wakes a trainer that waits.

Real parts: an in-process broker, a sim-game process over loopback, the VecEnv's public API."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import uvloop

from broker.protocol.messages import GameStep, Message, StepOptions, TrainerAct
from clients.errors import BrokerError
from clients.inprocess import InProcessBroker
from tests.helpers import spawn_python

Entries = list[tuple[str, int]]


def record_hub_entries(broker: InProcessBroker) -> Entries:
    """Every message handed to the hub, with the thread that handed it (the one running the loop)."""
    entries: Entries = []
    server = broker.server
    enter = server.enter

    def recording_enter(peer: Any, message: Message) -> None:
        entries.append((message.TYPE, threading.get_ident()))
        enter(peer, message)

    server.enter = recording_enter  # type: ignore[method-assign]
    return entries


@pytest.fixture
def hold_broker(inprocess_broker: Callable[..., InProcessBroker]) -> Iterator[InProcessBroker]:
    broker = inprocess_broker(expected_games=1, stepping="hold")
    game = spawn_python("-m", "broker", "sim-game", "--address", broker.address, "--movers", "4", "--pickers", "1")
    try:
        yield broker
    finally:
        game.terminate()
        game.wait(timeout=15)


def step(env: Any, times: int) -> None:
    actions = np.zeros((env.num_envs, *env.action_space.shape), env.action_space.dtype)
    for _ in range(times):
        env.step_async(actions)
        env.step_wait()


def test_a_stepping_trainer_runs_the_loop_on_its_own_thread(hold_broker: InProcessBroker) -> None:
    entries = record_hub_entries(hold_broker)
    env = hold_broker.vec_env("mover", stepping=StepOptions("barrier"))
    env.reset()
    step(env, 30)
    env.close()
    me = threading.get_ident()
    steps_here = sum(1 for kind, thread in entries if kind == GameStep.TYPE and thread == me)
    acts_here = sum(1 for kind, thread in entries if kind == TrainerAct.TYPE and thread == me)
    # The game's steps were read by this thread, in step_wait; its actions went to the hub from it too.
    assert steps_here > 0 and acts_here > 0, entries[-10:]


def test_a_trainer_that_may_run_the_loop_hands_its_actions_to_the_hub_within_step_async(
    hold_broker: InProcessBroker,
) -> None:
    """The act is handed over (and the game's actions written) on the trainer's thread before step_async
    returns, so step_wait's run of the loop starts by waiting for the game instead of polling for the act."""
    entries = record_hub_entries(hold_broker)
    env = hold_broker.vec_env("mover", stepping=StepOptions("barrier"))
    env.reset()
    step(env, 3)
    me = threading.get_ident()
    actions = np.zeros((env.num_envs, *env.action_space.shape), env.action_space.dtype)
    for _ in range(5):
        before = len(entries)
        env.step_async(actions)
        assert (TrainerAct.TYPE, me) in entries[before:], entries[before:]
        env.step_wait()
    env.close()


def test_with_several_trainers_the_daemon_runs_the_loop_and_one_alone_takes_it_back(
    hold_broker: InProcessBroker,
) -> None:
    """Handing the loop between trainers' threads every step costs more than one thread hop, so with two
    trainers attached the daemon thread serves both; once one leaves, the other runs the loop again."""
    entries = record_hub_entries(hold_broker)
    mover = hold_broker.vec_env("mover", stepping=StepOptions("barrier"))
    picker = hold_broker.vec_env("picker")  # hold stepping: once it leaves, the game goes on without it
    mover.reset()
    picker.reset()
    both_attached = len(entries)
    threads = [threading.Thread(target=step, args=(env, 30)) for env in (mover, picker)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    daemon = hold_broker.server_thread._thread.ident
    together = [thread for kind, thread in entries[both_attached:] if kind == GameStep.TYPE]
    assert len(together) >= 30 and set(together) == {daemon}, set(together)
    picker.close()
    time.sleep(0.1)  # the hub hears the picker leave
    alone_from = len(entries)
    step(mover, 30)
    mover.close()
    me = threading.get_ident()
    alone = [thread for kind, thread in entries[alone_from:] if kind == GameStep.TYPE]
    assert alone.count(me) >= 20, alone


def test_a_broker_expecting_several_trainers_runs_uvloop_on_its_daemon_thread_only(
    inprocess_broker: Callable[..., InProcessBroker],
) -> None:
    """Told that two policies train here, the broker never hands its loop to a trainer: the daemon thread
    runs uvloop (cheaper per event than the standard loop) for both, and both step."""
    broker = inprocess_broker(expected_games=1, stepping="hold", local_trainers=2)
    assert isinstance(broker.loop, uvloop.Loop)
    game = spawn_python("-m", "broker", "sim-game", "--address", broker.address, "--movers", "4", "--pickers", "1")
    try:
        entries = record_hub_entries(broker)
        mover = broker.vec_env("mover", stepping=StepOptions("barrier"))
        mover.reset()
        step(mover, 10)  # alone at first: still the daemon's loop
        picker = broker.vec_env("picker", stepping=StepOptions("barrier"))
        picker.reset()
        threads = [threading.Thread(target=step, args=(env, 30)) for env in (mover, picker)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert not any(thread.is_alive() for thread in threads)
        mover.close()
        picker.close()
    finally:
        game.terminate()
        game.wait(timeout=15)
    daemon = broker.server_thread._thread.ident
    game_steps = [thread for kind, thread in entries if kind == GameStep.TYPE]
    acts = [thread for kind, thread in entries if kind == TrainerAct.TYPE]
    assert len(game_steps) >= 40 and set(game_steps) == {daemon}, set(game_steps)
    assert len(acts) >= 2 * 30 + 10 and set(acts) == {daemon}, set(acts)


def test_games_are_served_while_no_trainer_waits(hold_broker: InProcessBroker) -> None:
    entries = record_hub_entries(hold_broker)
    env = hold_broker.vec_env("mover")  # hold stepping: a game goes on without the trainer's answer
    env.reset()
    step(env, 5)
    seen = len(entries)
    time.sleep(0.5)  # a PPO update, say: nobody is in step_wait
    during_pause = entries[seen:]
    daemon = hold_broker.server_thread._thread.ident
    assert any(kind == GameStep.TYPE and thread == daemon for kind, thread in during_pause), during_pause
    step(env, 5)  # and the trainer takes the loop back
    env.close()


def test_the_loop_polls_before_sleeping_only_while_a_trainer_waits_in_it(hold_broker: InProcessBroker) -> None:
    """The trainer's waits poll (SpinningSelector); the daemon thread's, while the trainer is busy with the GIL
    (between rollouts), sleep at once."""
    selector = hold_broker.server_thread._selector
    assert selector is not None
    selects: list[tuple[int, bool]] = []
    select = selector.select

    def recording_select(timeout: float | None = None) -> Any:
        selects.append((threading.get_ident(), selector.polls))
        return select(timeout)

    selector.select = recording_select  # type: ignore[method-assign]
    env = hold_broker.vec_env("mover")
    env.reset()
    step(env, 5)
    time.sleep(0.5)  # nobody is in step_wait: the daemon thread runs the loop
    step(env, 5)
    env.close()
    daemon = hold_broker.server_thread._thread.ident
    me = threading.get_ident()
    assert {polls for thread, polls in selects if thread == daemon} == {False}, selects[-10:]
    assert {polls for thread, polls in selects if thread == me} == {True}, selects[-10:]


def test_a_trainer_in_a_thread_running_an_event_loop_is_served_by_the_daemon(hold_broker: InProcessBroker) -> None:
    """As in a notebook, where the cell runs inside an asyncio loop: this loop cannot be run there."""
    entries = record_hub_entries(hold_broker)
    env = hold_broker.vec_env("mover", stepping=StepOptions("barrier"))

    async def notebook_cell() -> int:
        env.reset()
        step(env, 10)
        return threading.get_ident()

    cell_thread = asyncio.run(notebook_cell())
    env.close()
    game_steps = [thread for kind, thread in entries if kind == GameStep.TYPE]
    acts = [thread for kind, thread in entries if kind == TrainerAct.TYPE]
    assert len(game_steps) >= 10 and len(acts) >= 10
    assert cell_thread not in game_steps and cell_thread not in acts  # its acts were queued for the daemon


def test_closing_the_broker_wakes_a_trainer_that_waits(inprocess_broker: Callable[..., InProcessBroker]) -> None:
    broker = inprocess_broker(expected_games=1, stepping="barrier")
    failures: list[BaseException] = []

    def wait_for_games() -> None:
        try:
            broker.vec_env("mover")  # no game ever comes: it waits for the policy's layout
        except BaseException as exc:
            failures.append(exc)

    trainer = threading.Thread(target=wait_for_games, daemon=True)
    trainer.start()
    time.sleep(0.3)
    broker.close()
    trainer.join(timeout=20)
    assert not trainer.is_alive()
    assert len(failures) == 1 and isinstance(failures[0], BrokerError), failures
