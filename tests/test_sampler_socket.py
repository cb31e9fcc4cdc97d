"""Samplers over real loopback sockets: a broker subprocess, sim-game subprocesses, a sampler and a
per-policy trainer sharing the broker on different games, the refusals as clients see them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from clients.errors import BrokerError
from clients.sampler import SamplerLink
from clients.sim_game import MOVER, PICKER
from clients.spaces import ActionCodec
from clients.vec_env import BrokerVecEnv
from tests.test_train import sim_broker


def random_actions(link: SamplerLink, policy: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    codec = ActionCodec(link.policies[policy].spaces)
    codec.space.seed(int(rng.integers(1 << 30)))
    return codec.to_wire(np.stack([codec.space.sample() for _ in range(link.policies[policy].n_envs)]))


def test_a_sampler_and_a_per_policy_trainer_share_one_broker(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    with sim_broker(tmp_path, [(2, 3), (2, 3), (2, 3)]) as address:
        sampler = SamplerLink(address, 2, name="sampler-a", timeout_claim=60)
        assert len(sampler.games) == 2 and list(sampler.policies) == [MOVER, PICKER]
        assert [sampler.policies[p].n_envs for p in (MOVER, PICKER)] == [4, 6]
        trainer = BrokerVecEnv(MOVER, address, name="ppo-mover")  # the layout completes with the third game
        try:
            assert trainer.num_envs == 2 and [g.game_index for g in trainer.policy_info.games] == [
                ({0, 1, 2} - set(sampler.games)).pop()
            ]
            with pytest.raises(BrokerError) as refused:
                SamplerLink(address, 1, timeout_claim=1.0)
            assert refused.value.code == "policy_trained" and "'mover'" in refused.value.message
            trainer.reset()
            rewards = {MOVER: 0.0, PICKER: 0.0}
            for _ in range(30):
                batches = sampler.wait()
                for policy, batch in batches.items():
                    assert batch.policy == policy and batch.data.reward.shape == (sampler.policies[policy].n_envs,)
                    assert batch.data.frames is not None  # hold stepping: each transition's ticks
                    rewards[policy] += float(batch.data.reward.sum())
                    sampler.act(policy, random_actions(sampler, policy, rng))
                trainer.step(np.stack([trainer.action_space.sample() for _ in range(trainer.num_envs)]))
            assert rewards[MOVER] != 0.0 and rewards[PICKER] != 0.0  # the games moved under our actions
        finally:
            trainer.close()
        games = sampler.games
        sampler.close()
        with pytest.raises(BrokerError) as none_left:
            SamplerLink(address, 3, timeout_claim=1.0)
        assert none_left.value.code in ("no_free_game", "policy_trained")
        again = SamplerLink(address, 2, name="sampler-b", timeout_claim=30)  # its predecessor's games
        try:
            assert again.games == games
            assert set(again.wait()) == {MOVER, PICKER}
        finally:
            again.close()


def test_a_sampler_started_before_its_broker_and_games_claims_them_once_they_are_up(tmp_path: Path) -> None:
    """An env runner may start before its node's broker, and before the games have joined it: the sampler
    keeps trying (connection refused, then no_free_game) until its claim is met."""
    import socket
    import subprocess
    import threading
    import time

    from tests.godot_engine import stop
    from tests.helpers import spawn_python

    with socket.socket() as probe:  # a port nobody listens on yet
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    address = f"127.0.0.1:{port}"
    claimed: list[SamplerLink] = []
    failed: list[BaseException] = []

    def claim() -> None:
        try:
            claimed.append(SamplerLink(address, 2, name="early-runner", timeout_claim=60))
        except BaseException as exc:  # reported by the assertion below
            failed.append(exc)

    runner = threading.Thread(target=claim)
    runner.start()
    time.sleep(1.0)  # the sampler is retrying a refused connection now
    procs = []
    with open(tmp_path / "broker.log", "wb") as log:
        broker = spawn_python("-m", "broker", "serve", "--port", str(port), "--games", "2", "--status-interval", "0",
                              stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        time.sleep(1.0)  # the broker is up with no game: the claim is refused as no_free_game, and retried
        for i in range(2):
            with open(tmp_path / f"game-{i}.log", "wb") as log:
                procs.append(spawn_python("-m", "broker", "sim-game", "--address", address, "--seed", str(i),
                                          stdout=log, stderr=subprocess.STDOUT))  # fmt: skip
        runner.join(timeout=90)
        assert not failed, failed
        (sampler,) = claimed
        assert sampler.games == [0, 1] and list(sampler.policies) == [MOVER, PICKER]
        sampler.close()
    finally:
        for proc in [broker, *procs]:
            stop(proc)


def test_in_barrier_stepping_a_sampler_gone_mid_tick_does_not_stall_the_game_for_the_next(tmp_path: Path) -> None:
    """An RLlib env runner that dies with a batch unanswered, in lock-step: the next one that claims its
    game must get batches (the game's unanswered tick is released, then it waits for the newcomer)."""
    import threading

    from broker.protocol.messages import StepOptions

    rng = np.random.default_rng(1)
    barrier = StepOptions(mode="barrier")
    with sim_broker(tmp_path, [(2, 3)]) as address:
        first = SamplerLink(address, 1, name="runner-1", stepping=barrier, timeout_claim=60)
        first.wait()
        first.act(MOVER, random_actions(first, MOVER, rng))  # the picker's batch stays unanswered
        first.close()
        second = SamplerLink(address, 1, name="runner-2", stepping=barrier, timeout_claim=30)
        got: list[dict] = []
        waiter = threading.Thread(target=lambda: got.append(second.wait()), daemon=True)
        waiter.start()
        waiter.join(timeout=60)
        try:
            assert got and set(got[0]) == {MOVER, PICKER}, "the game stalled for the next sampler"
            for _ in range(5):  # and it steps on in lock-step with the newcomer
                for policy in (MOVER, PICKER):
                    second.act(policy, random_actions(second, policy, rng))
                batches = second.wait()
                assert batches[MOVER].data.frames is None  # barrier: no hold frames
        finally:
            second.close()
