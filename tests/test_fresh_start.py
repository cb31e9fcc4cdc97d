"""FreshStartCallback: after a long update in hold stepping, PPO's next rollout starts from the newest
observation, so no recorded transition carries an action that was never applied or the ticks of the pause.

Real parts: an in-process broker in hold mode, a simulated game process over loopback, SB3 PPO. The long
update is a sleep at the end of every rollout (what a big PPO update does to the games)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from stable_baselines3 import PPO
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.vec_env import VecMonitor

from broker.protocol.messages import StepOptions
from clients.callbacks import FreshStartCallback
from clients.inprocess import InProcessBroker
from tests.helpers import spawn_python

PAUSE_S = 0.3  # far beyond the policy's hold deadline (100 ms): the game runs on meanwhile
N_STEPS = 16
ROLLOUTS = 4


class Recorder(BaseCallback):
    """What PPO records: per rollout, the infos of every step it stores; the pause after each rollout."""

    def __init__(self) -> None:
        super().__init__()
        self.rollouts: list[list[list[dict[str, Any]]]] = []

    def _on_rollout_start(self) -> None:
        self.rollouts.append([])

    def _on_step(self) -> bool:
        self.rollouts[-1].append([dict(info) for info in self.locals["infos"]])
        return True

    def _on_rollout_end(self) -> None:
        time.sleep(PAUSE_S)


@pytest.fixture
def hold_broker(inprocess_broker: Callable[..., InProcessBroker]) -> Iterator[InProcessBroker]:
    broker = inprocess_broker(expected_games=1, stepping="hold")
    game = spawn_python("-m", "broker", "sim-game", "--address", broker.address, "--movers", "8", "--pickers", "1")
    try:
        yield broker
    finally:
        game.terminate()
        game.wait(timeout=15)


def train(broker: InProcessBroker, fresh_start: bool) -> tuple[Recorder, FreshStartCallback | None]:
    # A fixed 100 ms deadline instead of the adaptive 20 ms floor: a loaded machine stalls the trainer's
    # thread for tens of ms now and then, which held ticks (and ended episodes) outside the pause; the pause
    # is still three deadlines long.
    env = broker.vec_env("mover", stepping=StepOptions("hold", deadline_ms=100.0))
    model = PPO("MultiInputPolicy", VecMonitor(env), n_steps=N_STEPS, n_epochs=1, batch_size=64, seed=0)
    recorder = Recorder()
    fresh = FreshStartCallback() if fresh_start else None
    callbacks: list[BaseCallback] = [recorder] + ([fresh] if fresh else [])
    model.learn(total_timesteps=ROLLOUTS * N_STEPS * env.num_envs, callback=callbacks)
    env.close()
    return recorder, fresh


def first_steps_after_updates(recorder: Recorder) -> list[list[dict[str, Any]]]:
    return [rollout[0] for rollout in recorder.rollouts[1:]]


def test_without_fresh_start_ppo_records_the_pause(hold_broker: InProcessBroker) -> None:
    """The control: plain SB3 after a pause records held ticks and actions that were never applied."""
    recorder, _ = train(hold_broker, fresh_start=False)
    assert len(recorder.rollouts) == ROLLOUTS
    firsts = first_steps_after_updates(recorder)
    assert max(info["frames"] for infos in firsts for info in infos) > 5
    assert any(info.get("action_applied") is False for infos in firsts for info in infos)


def test_fresh_start_records_no_unapplied_action_and_no_pause(hold_broker: InProcessBroker) -> None:
    recorder, fresh = train(hold_broker, fresh_start=True)
    assert fresh is not None
    assert len(recorder.rollouts) == ROLLOUTS
    assert fresh.fresh_starts == ROLLOUTS - 1  # every rollout after an update
    recorded = [info for rollout in recorder.rollouts for infos in rollout for info in infos]
    assert len(recorded) == ROLLOUTS * N_STEPS * 8
    assert not any(info.get("action_applied") is False for info in recorded)
    # The pause's ticks went to the unrecorded refresh step: the first recorded steps span only the time
    # PPO takes to pick an action, not the pause.
    frames = np.array([info["frames"] for infos in first_steps_after_updates(recorder) for info in infos])
    assert frames.max() < PAUSE_S / 0.02


def test_fresh_start_is_a_no_op_in_strict_stepping(inprocess_broker: Callable[..., InProcessBroker]) -> None:
    # The broker holds the picker (no trainer); the mover's trainer asks for lock-step.
    broker = inprocess_broker(expected_games=1, stepping="hold")
    game = spawn_python("-m", "broker", "sim-game", "--address", broker.address, "--movers", "4", "--pickers", "1")
    try:
        env = broker.vec_env("mover", stepping=StepOptions("barrier"))
        model = PPO("MultiInputPolicy", env, n_steps=8, n_epochs=1, batch_size=32, seed=0)
        fresh = FreshStartCallback(after_s=0.0)
        model.learn(total_timesteps=3 * 8 * env.num_envs, callback=fresh)
        env.close()
        assert not env.holding
        assert fresh.fresh_starts == 0
    finally:
        game.terminate()
        game.wait(timeout=15)


def test_fresh_start_refuses_off_policy_algorithms(inprocess_broker: Callable[..., InProcessBroker]) -> None:
    from stable_baselines3 import SAC

    broker = inprocess_broker(expected_games=1, stepping="hold")
    game = spawn_python("-m", "broker", "sim-game", "--address", broker.address, "--movers", "2", "--pickers", "1")
    try:
        env = broker.vec_env("mover")
        model = SAC("MultiInputPolicy", env, learning_starts=0)
        with pytest.raises(TypeError, match="on-policy"):
            model.learn(total_timesteps=4, callback=FreshStartCallback())
        env.close()
    finally:
        game.terminate()
        game.wait(timeout=15)
