"""Team change (``gdrl-train --team-change``) on the simulated two-policy game, all real processes over
loopback: two independent trainers take turns, the broker playing the idle team from that team's own
latest snapshot; the rotation (broker/core/team_change.py) continues across a broker and trainer restart.
"""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from broker.core.team_change import Rotation, disagreement, start
from clients.errors import BrokerError
from clients.status import fetch_status, render_table, send_control
from tests.helpers import broker_process, python_env, spawn_python

TEAMS = ("mover", "picker")
EVERY = 120  # idle-team batches per turn: a few PPO rollouts of 32
TRAIN_FLAGS = (
    "--n-steps",
    "32",
    "--batch-size",
    "64",
    "--n-epochs",
    "2",
    "--progress",
    "off",
    "--timesteps",
    "10000000",
)


# --- the rotation rule (sans-IO) ----------------------------------------------------------------


def test_rotation_turns_over_after_every_idle_step_and_hands_over() -> None:
    r = Rotation(("mover", "picker"), every=3, learner="mover")
    assert r.idle == "picker" and not r.turn_over
    r = r.counted().counted()
    assert r.steps == 2 and not r.turn_over
    r = r.counted()
    assert r.turn_over and r.learner == "mover"  # over, but the learner has not stepped aside yet
    r = r.handed_over()
    assert (r.learner, r.idle, r.steps, r.turns, r.turn_over) == ("picker", "mover", 0, 1, False)
    assert r.handed_over().learner == "mover" and r.handed_over().turns == 2
    assert Rotation.from_dict(json.loads(json.dumps(r.to_dict()))) == r


def test_a_finished_learner_hands_over_for_good_until_a_trainer_of_its_team_returns() -> None:
    rotation = Rotation(TEAMS, 3, "mover").counted(1).handed_over(finished=True)
    assert (rotation.learner, rotation.finished, rotation.turns) == ("picker", ("mover",), 1)
    rotation = rotation.counted(10)
    assert not rotation.turn_over  # the idle team has nobody to learn it: picker learns on
    assert Rotation.from_dict(rotation.to_dict()) == rotation
    old = {k: v for k, v in rotation.to_dict().items() if k != "finished"}  # saved before 'finished' existed
    assert Rotation.from_dict(old).finished == ()
    back = rotation.resumed("mover")
    assert back.finished == () and back.turn_over
    with pytest.raises(ValueError, match="finished teams"):
        Rotation(TEAMS, 3, "mover", finished=("runner",))


def test_rotation_starts_from_the_most_advanced_saved_state_of_its_pair() -> None:
    fresh = start("picker", "mover", 50, [])
    assert fresh.learner == "picker" and fresh.turns == 0  # the first to ask learns first
    behind = Rotation(("mover", "picker"), 50, "picker", steps=0, turns=3)  # the learner's pool, saved at hand-over
    ahead = Rotation(("mover", "picker"), 50, "picker", steps=40, turns=3)  # the idle pool, saved every second
    other_pair = Rotation(("mover", "runner"), 50, "runner", turns=9)
    resumed = start("mover", "picker", 80, [behind, other_pair, ahead])
    assert (resumed.learner, resumed.steps, resumed.turns, resumed.every) == ("picker", 40, 3, 80)


def test_rotation_refuses_bad_states_and_disagreeing_trainers() -> None:
    with pytest.raises(ValueError, match="two different teams"):
        Rotation(("mover", "mover"), 5, "mover")
    with pytest.raises(ValueError, match="not one of"):
        Rotation(("mover", "picker"), 5, "runner")
    with pytest.raises(ValueError, match="at least 1"):
        Rotation(("mover", "picker"), 0, "mover")
    with pytest.raises(ValueError, match="not a team-change state"):
        Rotation.from_dict({"teams": ["mover", "picker"], "every": 5})
    r = Rotation(("mover", "picker"), 5, "mover")
    assert disagreement(r, "picker", "mover", 5) is None
    assert "disagree on the period" in str(disagreement(r, "picker", "mover", 7))
    assert "already changes turns with 'picker'" in str(disagreement(r, "mover", "runner", 5))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--team-change", "mover"], "--team-change must name another group than --policy"),
        (["--team-change", "picker", "--opponent", "blue"], "do not go together"),
        (["--team-change", "picker", "--team-change-every", "0"], "--team-change-every must be positive"),
    ],
)
def test_bad_team_change_flags_are_refused(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from clients.train import main

    with pytest.raises(SystemExit) as exc:
        main(["--policy", "mover", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


# --- two trainers taking turns through a real broker --------------------------------------------


@contextmanager
def game(address: str) -> Iterator[None]:
    proc = spawn_python("-m", "broker", "sim-game", "--address", address, "--movers", "2", "--pickers", "2")
    try:
        yield
    finally:
        proc.terminate()
        proc.wait(timeout=20)


@contextmanager
def trainers(
    address: str, tmp_path: Path, *extra: str, resume: bool = False
) -> Iterator[list[subprocess.Popen[bytes]]]:
    procs, logs = [], []
    for team, partner in (TEAMS, TEAMS[::-1]):
        flags = ["--policy", team, "--team-change", partner, "--team-change-every", str(EVERY)]
        flags += ["--pool-dir", str(tmp_path / f"pool-{team}"), "--save-model-path", str(tmp_path / f"{team}.zip")]
        if resume:
            flags += ["--resume-model-path", str(tmp_path / f"{team}.zip")]
        log = open(tmp_path / f"{team}-{time.monotonic_ns()}.log", "wb")
        logs.append(log)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "clients.train", "--broker", address, *TRAIN_FLAGS, *flags, *extra],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=python_env(),
                cwd=tmp_path,
            )
        )
    try:
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # saves its model, hands nothing over
        for proc in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        for log in logs:
            log.close()


def watch(address: str, until: Any, timeout: float = 150.0) -> list[dict[str, Any]]:
    """Status samples every 0.1 s until ``until(samples)``; each sample is which team is frozen, which one
    has a trainer session, and the broker's rotation."""
    samples: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = fetch_status(address)
        rotation = status.get("team_change", {}).get("mover & picker") or status.get("team_change", {}).get(
            "picker & mover"
        )
        if rotation is not None:
            samples.append(
                {
                    "frozen": sorted(t for t in TEAMS if t in status["frozen"]),
                    "trainers": {t: status["policies"][t].get("trainer") for t in TEAMS},
                    "rotation": rotation,
                }
            )
            if until(samples):
                return samples
        time.sleep(0.1)
    raise AssertionError(f"timed out; last samples: {samples[-5:]}")


def swaps(samples: list[dict[str, Any]]) -> int:
    frozen = [s["frozen"] for s in samples if len(s["frozen"]) == 1]
    return sum(1 for a, b in itertools.pairwise(frozen) if a != b)


def check_one_frozen(samples: list[dict[str, Any]]) -> None:
    """From the first freeze on, exactly one team is played by the broker at every sample; the other is its
    trainer's (the trainer is named by gdrl-train, never a frozen group), or waits for it during a hand-over."""
    first = next(i for i, s in enumerate(samples) if s["frozen"])
    for sample in samples[first:]:
        assert len(sample["frozen"]) == 1, sample
        (frozen,) = sample["frozen"]
        (live,) = [t for t in TEAMS if t != frozen]
        assert sample["trainers"][frozen] == f"frozen[{frozen}]", sample
        assert sample["trainers"][live] is None or "frozen" not in sample["trainers"][live], sample
        assert sample["rotation"]["frozen"] == [frozen] and sample["rotation"]["learner"] == live, sample


def test_two_trainers_take_turns_and_the_rotation_survives_a_restart(tmp_path: Path) -> None:
    with broker_process(tmp_path, "--stepping", "barrier") as (_, address), game(address):
        with trainers(address, tmp_path) as procs:
            samples = watch(address, lambda s: swaps(s) >= 3 and s[-1]["rotation"]["steps"] < EVERY // 2)
            assert all(p.poll() is None for p in procs), "a trainer exited"
        check_one_frozen(samples)
        last = samples[-1]["rotation"]
        assert last["turns"] >= 3
        status = fetch_status(address)
    # Both pools hold the rotation (the broker's shutdown wrote it last) and snapshots of their own team.
    saved = [json.loads((tmp_path / f"pool-{t}" / "pool.json").read_text())["team_change"] for t in TEAMS]
    assert saved[0] == saved[1] and saved[0]["turns"] >= last["turns"]
    for team in TEAMS:
        metas = [json.loads(p.read_text()) for p in (tmp_path / f"pool-{team}").glob("snapshot-*.json")]
        assert len(metas) >= 2 and {m["policy"] for m in metas} == {team}
        assert any(player.startswith(f"{team}@snapshot-") for player in status["elo"])
    assert set(TEAMS) <= set(status["elo"])  # the live policies are rated against the partner's snapshots

    # A new broker and resumed trainers continue from the pools: the same turn count, then more turns.
    with broker_process(tmp_path, "--stepping", "barrier") as (_, address), game(address):
        with trainers(address, tmp_path, resume=True):
            resumed = watch(address, lambda s: len(s) >= 1)
            first = resumed[0]["rotation"]
            assert first["turns"] >= saved[0]["turns"] and first["turns"] <= saved[0]["turns"] + 1, first
            if first["turns"] == saved[0]["turns"]:
                assert first["learner"] == saved[0]["learner"]
            more = watch(address, lambda s: s[-1]["rotation"]["turns"] >= saved[0]["turns"] + 2)
        check_one_frozen(more)
    assert swaps(more) >= 1


def test_team_change_refusals_reach_the_asker_only(tmp_path: Path) -> None:
    with broker_process(tmp_path) as (_, address), game(address):
        deadline = time.monotonic() + 20
        while set(TEAMS) - set(fetch_status(address)["policies"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        ask = {"team": "mover", "partner": "picker", "pool": str(tmp_path / "pool-mover"), "every": 100}
        with pytest.raises(BrokerError, match="unknown partner 'runner': the games have groups mover, picker"):
            send_control(address, "team_change", {**ask, "partner": "runner"})
        alien = tmp_path / "pool-alien"  # a pool written for other spaces
        alien.mkdir()
        (alien / "snapshot-000000.onnx").write_bytes(b"model")
        meta = {"steps": 0, "observation_space": {"obs": {"type": "box", "shape": [9]}}, "action_space": {}}
        (alien / "snapshot-000000.json").write_text(json.dumps(meta))
        with pytest.raises(BrokerError, match=r"has the observation space .* a pool of another group or game"):
            send_control(address, "team_change", {**ask, "pool": str(alien)})
        assert fetch_status(address)["team_change"] == {}  # nothing left of the refused request
        first = send_control(address, "team_change", ask)["team_change"]
        assert first["learner"] == "mover" and first["learns"]  # the first to ask learns first
        picker = {**ask, "team": "picker", "partner": "mover", "pool": str(tmp_path / "pool-picker")}
        with pytest.raises(BrokerError, match="disagree on the period: 'picker' asks --team-change-every 50"):
            send_control(address, "team_change", {**picker, "every": 50})
        with pytest.raises(BrokerError, match="'every' \\(a positive integer\\)"):
            send_control(address, "team_change", {**picker, "every": "often"})
        reply = send_control(address, "team_change", picker)["team_change"]
        assert reply["learner"] == "mover" and not reply["learns"] and reply["frozen"] == []  # no snapshot yet
        status = fetch_status(address)
        assert status["team_change"]["mover & picker"]["turns"] == 0
        assert "team change mover & picker: mover learns, turn 0, 0/100 steps" in render_table(status)


def test_a_trainer_that_reaches_its_timesteps_mid_turn_hands_the_turn_to_its_partner(tmp_path: Path) -> None:
    def start(team: str, partner: str, *extra: str) -> subprocess.Popen[bytes]:
        flags = ["--policy", team, "--team-change", partner, "--team-change-every", str(EVERY)]
        flags += ["--pool-dir", str(tmp_path / f"pool-{team}"), *TRAIN_FLAGS, *extra]  # a later flag wins
        with open(tmp_path / f"{team}.log", "wb") as log:
            command = [sys.executable, "-m", "clients.train", "--broker", address, *flags]
            return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=python_env(), cwd=tmp_path)

    with broker_process(tmp_path, "--stepping", "barrier") as (_, address), game(address):
        # mover asks first, so it learns first; 96 agent steps are 48 ticks of its 2 agents, inside its turn
        # of EVERY idle-team steps
        mover = start("mover", "picker", "--timesteps", "96")
        picker = None
        try:
            watch(address, lambda s: s[-1]["rotation"]["learner"] == "mover")
            picker = start("picker", "mover")
            assert mover.wait(timeout=180) == 0, (tmp_path / "mover.log").read_text()
            # picker learns on past a whole turn: nobody is left to take the next one
            handed = watch(address, lambda s: s[-1]["rotation"]["steps"] >= EVERY + 10)
            rotation = handed[-1]["rotation"]
            assert rotation["learner"] == "picker" and rotation["turns"] == 1, rotation
            assert rotation["finished"] == ["mover"] and rotation["frozen"] == ["mover"], rotation
            assert handed[-1]["trainers"]["mover"] == "frozen[mover]"
            picker_trainer = handed[-1]["trainers"]["picker"]
            assert picker_trainer is not None and "frozen" not in picker_trainer, handed[-1]
            assert picker.poll() is None, "the partner must be learning, not gone"
        finally:
            for proc in (mover, picker):
                if proc is not None and proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                    proc.wait(timeout=60)
