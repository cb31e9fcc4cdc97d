"""Self-play on the simulated duel game, all real processes over loopback: ``gdrl-train --policy red
--opponent blue`` writes ONNX snapshots into a pool, the broker plays blue from it (swapping opponents),
counts Elo from the game's ``outcome`` infos, and a restarted broker and a resumed trainer continue the
ratings and the rotation from the pool."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from broker.core.elo import INITIAL_RATING, EloTable, outcome_score
from broker.status import prometheus_text
from clients.status import fetch_status
from tests.helpers import broker_process, python_env, spawn_python

TRAIN_FLAGS = ("--n-steps", "32", "--batch-size", "64", "--n-epochs", "2", "--progress", "off")


def train(address: str, tmp_path: Path, *flags: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "clients.train", "--broker", address, *TRAIN_FLAGS, *flags],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=python_env(),
        cwd=tmp_path,
    )


def pool_state(pool: Path) -> dict[str, Any]:
    return json.loads((pool / "pool.json").read_text())


def live_elo_logged(folder: Path) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values = []
    for run in folder.iterdir():
        events = EventAccumulator(str(run))
        events.Reload()
        if "self_play/elo" in events.Tags()["scalars"]:
            values += [e.value for e in events.Scalars("self_play/elo")]
    return values


def test_elo_rules() -> None:
    table = EloTable()
    table.record("red", 1.0, ["blue"])
    assert table.rating("red") == pytest.approx(INITIAL_RATING + 8) and table.rating("blue") == pytest.approx(1192)
    three = EloTable()
    three.record("red", 1.0, ["blue", "green"])  # K split over the two pairings
    assert three.rating("red") == pytest.approx(INITIAL_RATING + 8)
    assert three.rating("blue") == pytest.approx(1196) and three.rating("green") == pytest.approx(1196)
    assert outcome_score({"outcome": "draw"}, 5.0) == 0.5
    assert outcome_score({}, -0.5) == 0.0 and outcome_score(None, 2.0) == 1.0 and outcome_score(None, 0.0) == 0.5
    assert EloTable.from_dict(table.to_dict()).ratings == pytest.approx(table.ratings)


def test_self_play_snapshots_swaps_and_elo_survive_a_broker_restart(tmp_path: Path) -> None:
    pool = tmp_path / "pool-red"
    model = tmp_path / "red.zip"
    with broker_process(tmp_path) as (_, address):
        game = spawn_python("-m", "clients.duel_game", "--address", address, "--pairs", "8")
        try:
            done = train(
                address,
                tmp_path,
                "--policy", "red", "--opponent", "blue", "--pool-dir", str(pool), "--timesteps", "2560",
                "--snapshot-every", "512", "--swap-every", "40", "--window", "3", "--play-latest", "0.5",
                "--save-model-path", str(model), "--tensorboard-log", str(tmp_path / "tb"),
            )  # fmt: skip
            assert done.returncode == 0, done.stderr[-3000:]
        finally:
            game.terminate()
            game.wait(timeout=20)
        # After the game is gone: until then its frozen blue plays on against held red, and Elo moves.
        status = fetch_status(address)
    blue = status["frozen"]["blue"]
    assert live_elo_logged(tmp_path / "tb"), "the live policy's Elo is not in TensorBoard"
    metrics = prometheus_text(status)
    assert f'gdrl_elo_rating{{player="red"}} {status["elo"]["red"]}' in metrics
    assert f'gdrl_frozen_model_version{{policy="blue"}} {float(blue["version"])}' in metrics
    assert blue["pool"]["learner"] == "red" and blue["model"].startswith(str(pool))
    assert blue["version"] >= 2 and blue["pool"]["swaps"] >= 2 and blue["episodes"] > 20
    snapshots = sorted(p.name for p in pool.glob("snapshot-*.json"))
    assert len(snapshots) >= 4, snapshots  # the first one, then one per 512 steps
    saved = pool_state(pool)  # written by the broker's shutdown
    assert saved["swaps"] == blue["pool"]["swaps"] and saved["opponent"] == blue["pool"]["opponent"]
    ratings = saved["elo"]["ratings"]
    assert ratings["red"] != INITIAL_RATING and any(p.startswith("red@snapshot-") for p in ratings)
    assert ratings == pytest.approx(status["elo"], abs=0.01)

    # A new broker given the pool continues the ratings and the rotation before anything is played.
    with broker_process(tmp_path, "--self-play-pool", f"blue={pool}") as (_, address):
        restarted = fetch_status(address)
        assert restarted["elo"] == pytest.approx(ratings, abs=0.01)
        assert restarted["frozen"]["blue"]["pool"]["swaps"] == saved["swaps"]
        assert restarted["frozen"]["blue"]["pool"]["opponent"] == saved["opponent"]
        game = spawn_python("-m", "clients.duel_game", "--address", address, "--pairs", "8")
        try:
            resumed = train(
                address,
                tmp_path,
                "--policy", "red", "--opponent", "blue", "--pool-dir", str(pool), "--timesteps", "1024",
                "--snapshot-every", "512", "--swap-every", "40", "--window", "3",
                "--resume-model-path", str(model),
            )  # fmt: skip
            assert resumed.returncode == 0, resumed.stderr[-3000:]
            after = fetch_status(address)
        finally:
            game.terminate()
            game.wait(timeout=20)
    assert after["frozen"]["blue"]["pool"]["swaps"] > saved["swaps"]
    assert after["elo"]["red"] != pytest.approx(ratings["red"], abs=1e-6)  # more games, same rating carried on
    more = sorted(p.name for p in pool.glob("snapshot-*.json"))
    assert more[: len(snapshots)] == snapshots and len(more) > len(snapshots)  # numbering continued
    assert pool_state(pool)["elo"]["games"]["red"] > saved["elo"]["games"]["red"]


def test_self_play_refuses_groups_whose_spaces_differ(tmp_path: Path) -> None:
    with broker_process(tmp_path) as (_, address):
        game = spawn_python("-m", "broker", "sim-game", "--address", address, "--movers", "2", "--pickers", "2")
        try:
            done = train(address, tmp_path, "--policy", "picker", "--opponent", "mover", "--timesteps", "64")
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and "mover" in fetch_status(address).get("frozen", {}):
                time.sleep(0.1)
            assert "mover" not in fetch_status(address)["frozen"]
        finally:
            game.terminate()
            game.wait(timeout=20)
    assert done.returncode == 2
    assert "cannot start self-play against 'mover'" in done.stderr
    assert "self-play needs the same spaces" in done.stderr


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--opponent", "mover"], "--opponent must be another group than --policy"),
        (["--opponent", "blue", "--play-latest", "1.5"], "--play-latest must be within [0, 1]"),
        (["--opponent", "blue", "--window", "0"], "must be positive"),
        (["--opponent", "blue", "--inference", "--resume-model-path", __file__], "does not go with --inference"),
        (["--opponent", "blue", "--window", "5", "--keep", "3"], "--keep must be 0 (keep all) or at least --window"),
        (["--keep", "-1"], "--keep must not be negative"),
    ],
)
def test_bad_self_play_flags_are_refused(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from clients.train import main

    with pytest.raises(SystemExit) as exc:
        main(["--policy", "mover", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_prune_keeps_the_newest_and_the_one_playing(tmp_path: Path) -> None:
    from clients.self_play import prune, snapshot_indices

    for i in range(6):
        (tmp_path / f"snapshot-{i:06d}.onnx").write_bytes(b"model")
        (tmp_path / f"snapshot-{i:06d}.json").write_text(json.dumps({"index": i, "steps": i * 100}))
    (tmp_path / "pool.json").write_text(json.dumps({"opponent": "snapshot-000001"}))
    assert prune(tmp_path, 0) == [] and len(snapshot_indices(tmp_path)) == 6  # 0: keep all
    assert prune(tmp_path, 3) == ["snapshot-000000", "snapshot-000002", "snapshot-000003"]
    assert snapshot_indices(tmp_path) == [1, 4, 5]  # the one the broker plays stays
    assert sorted(p.name for p in tmp_path.glob("*.onnx")) == [f"snapshot-00000{i}.onnx" for i in (1, 4, 5)]
    assert prune(tmp_path, 1) == ["snapshot-000004"] and snapshot_indices(tmp_path) == [1, 5]
