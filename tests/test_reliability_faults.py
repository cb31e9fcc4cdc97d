"""Faults survived, with real processes on loopback: a trainer killed mid-step and resumed from its
checkpoint, a game killed and replaced, the broker killed (or stopped) and restarted, the broker gone for
good, a restarted broker with another layout, and a second trainer for a taken policy."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from clients.errors import BrokerError
from clients.game import GameClient
from clients.sim_game import SimGame
from clients.transport import BrokerGoneError
from clients.vec_env import BrokerVecEnv
from tests.scripts.reliability_common import (
    broker,
    exit_code,
    log_events,
    read_report,
    spawn,
    start_broker,
    stop,
    wait_until,
)

GAME = "tests.scripts.reliability_game"
TRAINER = "tests.scripts.reliability_trainer"
QUIET = ("--status-interval", "0", "--log-json")


def _game(tmp_path: Path, address: str, name: str, *extra: str) -> tuple[Any, Path]:
    report = tmp_path / f"{name}.json"
    proc = spawn(
        GAME, "--address", address, "--name", name, "--report", str(report), *extra, log_path=tmp_path / f"{name}.log"
    )
    return proc, report


def _trainer(tmp_path: Path, address: str, name: str, policy: str, *extra: str) -> tuple[Any, Path]:
    report = tmp_path / f"{name}.json"
    proc = spawn(
        TRAINER, "--address", address, "--policy", policy, "--report", str(report), *extra,
        log_path=tmp_path / f"{name}.log",
    )  # fmt: skip
    return proc, report


def _value(report: Path, key: str) -> Callable[[], Any]:
    return lambda: read_report(report).get(key, 0)


def _above(report: Path, key: str, minimum: float) -> Callable[[], bool]:
    """For wait_until: the report's ``key`` has passed ``minimum``."""
    return lambda: bool(read_report(report).get(key, 0) > minimum)


def _log(tmp_path: Path, name: str) -> str:
    path = tmp_path / f"{name}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def test_trainer_killed_mid_step_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    with broker(tmp_path, "--games", "1", *QUIET) as b:
        game, game_report = _game(tmp_path, b.address, "game")
        picker, picker_report = _trainer(tmp_path, b.address, "picker", "picker", "--mode", "random")
        checkpoint = tmp_path / "mover.zip"
        first, first_report = _trainer(
            tmp_path, b.address, "mover1", "mover", "--mode", "ppo", "--timesteps", "1000000",
            "--checkpoint", str(checkpoint),
        )  # fmt: skip
        saved = wait_until(_value(first_report, "checkpoint_timesteps"), 180, "the first trainer's checkpoint")
        # Kill it while it steps: after the checkpoint, once it has taken more steps.
        wait_until(_above(first_report, "num_timesteps", saved), 60, "the first trainer to step on")
        first.send_signal(signal.SIGKILL)
        assert first.wait(timeout=10) == -signal.SIGKILL
        ticks_at_kill = read_report(game_report)["ticks"]

        second, second_report = _trainer(
            tmp_path, b.address, "mover2", "mover", "--mode", "ppo", "--timesteps", "256", "--resume", str(checkpoint)
        )
        assert second.wait(timeout=240) == 0, _log(tmp_path, "mover2")
        resumed = read_report(second_report)
        assert resumed["end"] == "done" and resumed["error"] is None and resumed["problems"] == []
        assert resumed["start_timesteps"] >= saved > 0  # it went on from the checkpoint...
        assert resumed["num_timesteps"] >= resumed["start_timesteps"] + 256  # ...and trained further

        # The broker, the game and the other policy's trainer never stopped.
        assert b.proc.poll() is None and game.poll() is None and picker.poll() is None
        wait_until(_above(game_report, "ticks", ticks_at_kill + 64), 60, "the game to play on")
        assert stop(picker) == 0
        picker_result = read_report(picker_report)
        assert picker_result["end"] == "signal" and picker_result["error"] is None and picker_result["steps"] > 0
        events = log_events(b.log())
    assert exit_code(game) == 0 and read_report(game_report)["end"] == "closed"
    movers = [e for e in events if e.get("policy") == "mover" and e.get("event") in ("trainer joined", "trainer left")]
    assert [e["event"] for e in movers][:3] == ["trainer joined", "trainer left", "trainer joined"]


def test_killed_game_ends_its_rows_truncated_and_a_new_game_takes_the_slot(tmp_path: Path) -> None:
    with broker(tmp_path, "--games", "2", *QUIET) as b:
        games = [_game(tmp_path, b.address, f"game{i}", "--seed", str(i)) for i in range(2)]
        trainers = {
            p: _trainer(tmp_path, b.address, p, p, "--mode", "random", "--seed", str(i))
            for i, p in enumerate(("mover", "picker"))
        }
        for policy, (_, report) in trainers.items():
            wait_until(_above(report, "steps", 20), 120, f"{policy} to step")
        victim, _ = games[1]
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=10)
        time.sleep(0.5)  # the trainers now wait for the missing slot; nothing raises
        assert all(proc.poll() is None for proc, _ in trainers.values())
        replacement, replacement_report = _game(tmp_path, b.address, "game2", "--seed", "7")
        for policy, (_, report) in trainers.items():
            wait_until(_above(report, "replaced_steps", 0), 60, f"{policy} to see the replacement")
        steps = {p: read_report(r)["steps"] for p, (_, r) in trainers.items()}
        for policy, (_, report) in trainers.items():
            wait_until(_above(report, "steps", steps[policy] + 20), 60, f"{policy} to go on")
        codes = {p: stop(proc) for p, (proc, _) in trainers.items()}
        reports = {p: read_report(r) for p, (_, r) in trainers.items()}
    assert codes == {"mover": 0, "picker": 0}, reports
    for policy, result in reports.items():
        # Exactly the lost game's 4 agents of this policy ended once, truncated, with a terminal observation.
        assert result["replaced_steps"] == 1 and result["replaced_rows"] == 4, (policy, result)
        assert result["problems"] == [] and result["error"] is None and result["end"] == "signal", result
    assert read_report(replacement_report)["ticks"] > 20
    assert exit_code(replacement) == 0 and exit_code(games[0][0]) == 0  # told to close by the stopping broker


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_broker_restart_games_and_trainers_reconnect(tmp_path: Path, how: str) -> None:
    """SIGKILL: the clients lose the connection and reconnect by default. SIGTERM: an orderly shutdown
    ends clients by default; these ones opt in with --reconnect-on-shutdown, as for a planned restart."""
    opt_in = ("--reconnect-on-shutdown",) if how == "SIGTERM" else ()
    proc, port, _ = start_broker(tmp_path, "--games", "1", *QUIET)
    address = f"127.0.0.1:{port}"
    game, game_report = _game(tmp_path, address, "game", *opt_in)
    mover, mover_report = _trainer(
        tmp_path, address, "mover", "mover", "--mode", "ppo", "--timesteps", "100000", *opt_in
    )
    picker, picker_report = _trainer(tmp_path, address, "picker", "picker", "--mode", "random", *opt_in)
    restarted = None
    try:
        wait_until(_above(mover_report, "num_timesteps", 127), 180, "the mover trainer to learn")
        stop(proc, getattr(signal, how), timeout=20)
        time.sleep(1.5)  # the broker stays away for a while; the clients keep trying
        assert game.poll() is None and mover.poll() is None and picker.poll() is None
        restarted, _, _ = start_broker(tmp_path, "--games", "1", *QUIET, port=port)
        back = time.monotonic()
        for name, report in (("game", game_report), ("mover", mover_report), ("picker", picker_report)):
            wait_until(_above(report, "reconnects", 0), 60, f"{name} to reconnect")
        reconnected_after = time.monotonic() - back
        at_restart = read_report(mover_report)["num_timesteps"]
        wait_until(_above(mover_report, "num_timesteps", at_restart + 127), 120, "training to go on")
        # Stopped by us, not by the broker: a client that reconnects after a shutdown would just try again.
        codes = [stop(client) for client in (mover, picker, game)]
    finally:
        for client in (mover, picker, game):
            stop(client, signal.SIGKILL)  # only if still running: a failed check left it behind
        if restarted is not None:
            stop(restarted)
        stop(proc, signal.SIGKILL)
    assert codes == [0, 0, 0], _log(tmp_path, "game")
    game_result, mover_result, picker_result = (read_report(r) for r in (game_report, mover_report, picker_report))
    assert game_result["reconnects"] == 1 and game_result["end"] == "signal", game_result
    for result in (mover_result, picker_result):
        # One interrupted step, every env ended truncated at the last observation SB3 had seen.
        assert result["reconnects"] == 1 and result["reconnect_steps"] == 1, result
        assert result["problems"] == [] and result["error"] is None, result
    print(f"{how}: clients reconnected {reconnected_after:.1f} s after the broker was back")


def _play(client: GameClient, game: SimGame, errors: list[BaseException]) -> None:
    data = game.first_step()
    try:
        while True:
            data = game.apply(client.step(data))
    except BaseException as exc:
        errors.append(exc)


def _train(env: BrokerVecEnv, errors: list[BaseException], started: threading.Event) -> None:
    rng = np.random.default_rng(0)
    try:
        env.reset()
        started.set()
        while True:
            n = env.num_envs
            actions = rng.uniform(-1, 1, (n, 2)) if env.policy == "mover" else rng.integers(0, 3, n)
            env.step(actions)
    except BaseException as exc:
        errors.append(exc)


def _threads(*targets: tuple[Callable[..., None], tuple[Any, ...]]) -> list[threading.Thread]:
    threads = [threading.Thread(target=fn, args=args, daemon=True) for fn, args in targets]
    for thread in threads:
        thread.start()
    return threads


def test_broker_gone_for_good_is_a_clear_error_after_timeout_reconnect(tmp_path: Path) -> None:
    proc, port, _ = start_broker(tmp_path, "--games", "1", *QUIET)
    address = f"127.0.0.1:{port}"
    try:
        sim = SimGame(2, 2)
        game = GameClient(address, sim.group_specs(), timeout_reconnect=2.0)
        eager = BrokerVecEnv("picker", address, timeout_reconnect=0)  # 0: no reconnecting at all
        patient = BrokerVecEnv("mover", address, timeout_reconnect=2.0)
        errors: dict[str, list[BaseException]] = {"game": [], "mover": [], "picker": []}
        started = [threading.Event(), threading.Event()]
        threads = _threads(
            (_play, (game, sim, errors["game"])),
            (_train, (patient, errors["mover"], started[0])),
            (_train, (eager, errors["picker"], started[1])),
        )
        assert all(event.wait(60) for event in started)
        time.sleep(0.5)
        stop(proc, signal.SIGKILL)
        for thread in threads:
            thread.join(timeout=30)
        assert not any(thread.is_alive() for thread in threads), errors
    finally:
        stop(proc, signal.SIGKILL)
    for name in ("game", "mover"):
        (error,) = errors[name]
        assert isinstance(error, BrokerGoneError) and error.code == "connection_lost", repr(error)
        assert f"the broker at {address} was gone for 2 s" in error.message, error.message
        assert error.seconds >= 2.0
    (error,) = errors["picker"]
    assert isinstance(error, BrokerError) and not isinstance(error, BrokerGoneError) and error.code == "connection_lost"


def test_reconnected_trainer_refuses_a_different_layout(tmp_path: Path) -> None:
    proc, port, _ = start_broker(tmp_path, "--games", "1", *QUIET)
    address = f"127.0.0.1:{port}"
    second = None
    try:
        old = SimGame(4, 0)
        old_client = GameClient(address, old.group_specs(), timeout_reconnect=0)  # does not come back
        env = BrokerVecEnv("mover", address, timeout_reconnect=30)
        errors: dict[str, list[BaseException]] = {"old": [], "new": [], "mover": []}
        started = threading.Event()
        threads = _threads((_play, (old_client, old, errors["old"])), (_train, (env, errors["mover"], started)))
        assert started.wait(60)
        stop(proc, signal.SIGKILL)
        second, _, _ = start_broker(tmp_path, "--games", "1", *QUIET, port=port)
        new = SimGame(6, 0)  # the restarted broker's game has 6 movers, not 4
        threads += _threads(
            (_play, (GameClient(address, new.group_specs()), new, errors["new"])),
        )
        threads[1].join(timeout=60)
        assert not threads[1].is_alive()
    finally:
        if second is not None:
            stop(second)
        stop(proc, signal.SIGKILL)
    (error,) = errors["mover"]
    assert isinstance(error, BrokerError) and error.code == "space_mismatch", repr(error)
    assert "has 6 envs" in error.message and "built for 4 envs" in error.message, error.message


def test_second_trainer_for_a_taken_policy_is_refused(tmp_path: Path) -> None:
    with broker(tmp_path, "--games", "1", *QUIET) as b:
        sim = SimGame(3, 0)
        game = GameClient(b.address, sim.group_specs())
        holder = BrokerVecEnv("mover", b.address)
        with pytest.raises(BrokerError) as refused:
            BrokerVecEnv("mover", b.address, name="intruder")
        assert refused.value.code == "policy_taken"
        assert "policy 'mover' already has a trainer" in refused.value.message, refused.value.message
        # The holder is undisturbed: it steps with the game.
        errors: list[BaseException] = []
        thread = _threads((_play, (game, sim, errors)))[0]
        holder.reset()
        for _ in range(5):
            holder.step(np.zeros((3, 2), np.float32))
        holder.close()
        # Once the holder has gone, the policy is free again.
        again = BrokerVecEnv("mover", b.address)
        again.reset()
        again.close()
        log = b.log()
    thread.join(timeout=20)
    (ended,) = errors  # the game was told to close when the broker stopped
    assert isinstance(ended, BrokerError) and ended.code == "closed", repr(ended)
    assert any(e.get("code") == "policy_taken" for e in log_events(log))
