"""Frozen groups: the broker plays a group itself from an ONNX file (``--frozen``, or ``gdrl-broker freeze``
at run time), batched over every agent in every game, off the event loop; reloads a changed file; says
so in status; refuses a bad file with a clear error while everything else goes on."""

from __future__ import annotations

import math
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from stable_baselines3 import PPO

from broker.protocol.messages import StepData
from clients.errors import BrokerError
from clients.game import GameClient
from clients.inprocess import InProcessBroker
from clients.onnx_export import export_onnx
from clients.sim_game import MOVER, PICKER, SimGame, mover_spaces, picker_spaces
from clients.status import fetch_status, render_table, send_control
from tests.helpers import broker_process, spawn_python
from tests.test_onnx_export import make_model

N_PICKERS = 6


def picker_model(path: Path, seed: int = 1) -> Path:
    """A fresh PPO policy for the picker group with spread weights (clear-cut, varied decisions)."""
    import torch

    model = make_model(PPO, picker_spaces(), 0)
    torch.manual_seed(seed)
    with torch.no_grad():  # as make_model spreads them, from this seed
        for param in model.policy.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 2.0 / math.sqrt(math.prod(param.shape[1:])))
            else:
                param.normal_(0.0, 0.1)
    export_onnx(model, path, picker_spaces(), policy_name=PICKER)
    return path


def onnx_actions(path: Path, obs: dict[str, np.ndarray]) -> np.ndarray:
    """What onnxruntime itself picks for these observations (argmax of the logits, as the plugin does)."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    n = len(obs["obs"])
    feeds = {k: v.reshape(n, -1).astype(np.float32) for k, v in obs.items()}
    feeds["state_ins"] = np.zeros(n, np.float32)
    return np.argmax(session.run(["output"], feeds)[0], axis=1)


class RecordingGame:
    """A sim game of pickers in a thread, recording every observation it sent and the actions it got."""

    class Stop(Exception):
        pass

    def __init__(self, address: str, seed: int) -> None:
        self.game = SimGame(n_movers=0, n_pickers=N_PICKERS, seed=seed)
        self.records: list[tuple[dict[str, np.ndarray], np.ndarray, bool]] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.client = GameClient(address, self.game.group_specs(), name=f"recorder-{seed}")
        self._last: dict[str, StepData] = self.game.first_step()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _apply(self, actions: dict[str, dict[str, np.ndarray]]) -> dict[str, StepData]:
        if self.stop.is_set():
            raise self.Stop
        held = PICKER in self.client.held
        obs = {k: v.copy() for k, v in self._last[PICKER].obs.items()}
        self.records.append((obs, actions[PICKER]["move"].copy(), held))
        self._last = self.game.apply(actions)
        return self._last

    def _run(self) -> None:
        try:
            self.client.play(self._last, self._apply)
        except self.Stop:
            pass
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            self.client.close()

    def answered(self) -> list[tuple[dict[str, np.ndarray], np.ndarray]]:
        return [(obs, act) for obs, act, held in list(self.records) if not held]

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=30)
        assert self.error is None, self.error


def wait_for(predicate: Any, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def assert_actions_are_onnxruntimes(
    path: Path, pairs: list[tuple[dict[str, np.ndarray], np.ndarray]], varied: bool = True
) -> None:
    assert pairs, "no answered ticks to compare"
    obs = {k: np.concatenate([o[k] for o, _ in pairs]) for k in pairs[0][0]}
    got = np.concatenate([a for _, a in pairs])
    want = onnx_actions(path, obs)
    if varied:
        assert len(np.unique(want)) >= 2, "the model always picks the same action: the comparison would be void"
    np.testing.assert_array_equal(got, want)


def test_frozen_group_is_answered_by_onnx_across_games(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from broker.server.onnx_model import OnnxModel

    threads: set[str] = set()
    real_act = OnnxModel.act

    def act(self: OnnxModel, obs: dict[str, np.ndarray], spaces: Any) -> dict[str, np.ndarray]:
        threads.add(threading.current_thread().name)
        return real_act(self, obs, spaces)

    monkeypatch.setattr(OnnxModel, "act", act)
    model = picker_model(tmp_path / "picker.onnx")
    with InProcessBroker(expected_games=2, stepping="barrier", frozen=(f"{PICKER}={model}",)) as broker:
        games = [RecordingGame(broker.address, seed) for seed in (1, 2)]
        try:
            wait_for(lambda: all(len(g.answered()) >= 40 for g in games), what="40 answered ticks per game")
        finally:
            for game in games:
                game.close()
        status = broker.call(broker.server.status)
    for game in games:
        assert_actions_are_onnxruntimes(model, game.answered())
    frozen = status["frozen"][PICKER]
    assert frozen["model"] == str(model) and frozen["version"] == 1 and frozen["error"] is None
    # one inference per batch, each over both games' agents
    assert frozen["agent_steps"] == frozen["batches"] * 2 * N_PICKERS and frozen["batches"] >= 40
    assert status["policies"][PICKER]["trainer"] == f"frozen[{PICKER}]"
    assert status["policies"][PICKER]["link"] == "frozen" and "ring_batches" not in status["policies"][PICKER]
    assert threads and all(name.startswith("gdrl-frozen") for name in threads), threads  # never the loop's


def test_changed_model_file_is_reloaded_and_a_bad_one_keeps_the_old(tmp_path: Path) -> None:
    # Seeds whose models both pick varied actions (seed 2's picks one action for 92 % of observations, so a
    # window of ticks could hold nothing else and the comparison below would be void).
    first, second = picker_model(tmp_path / "a.onnx", seed=1), picker_model(tmp_path / "b.onnx", seed=5)
    live = tmp_path / "live.onnx"
    shutil.copy(first, live)
    with InProcessBroker(expected_games=1, stepping="barrier", frozen=(f"{PICKER}={live}",)) as broker:
        game = RecordingGame(broker.address, 3)
        try:
            wait_for(lambda: len(game.answered()) >= 10, what="ticks on the first model")
            shutil.copy(second, live.with_suffix(".tmp"))
            os.replace(live.with_suffix(".tmp"), live)
            wait_for(lambda: broker.call(broker.server.status)["frozen"][PICKER]["version"] == 2, what="reload")
            mark = len(game.records) + 2  # an inference in flight at the swap still answered with the old model
            wait_for(lambda: len(game.records) >= mark + 20, what="ticks on the second model")
            after = [(o, a) for o, a, held in game.records[mark:] if not held]
            live.write_bytes(b"not an onnx model")
            wait_for(lambda: broker.call(broker.server.status)["frozen"][PICKER]["error"] is not None, what="error")
            mark = len(game.records)
            wait_for(lambda: len(game.records) >= mark + 10, what="ticks after the bad file")
            kept = [(o, a) for o, a, held in game.records[mark:] if not held]
        finally:
            game.close()
        frozen = broker.call(broker.server.status)["frozen"][PICKER]
    assert_actions_are_onnxruntimes(second, after + kept)
    assert_actions_are_onnxruntimes(second, kept, varied=False)  # the broken file did not replace the model
    # and the second model is not the first: on the same observations they differ somewhere
    obs = {k: np.concatenate([o[k] for o, _ in after + kept]) for k in after[0][0]}
    assert not np.array_equal(onnx_actions(first, obs), onnx_actions(second, obs))
    assert frozen["version"] == 2 and "not a loadable ONNX model" in frozen["error"]


def test_freeze_at_run_time_status_and_refusals(tmp_path: Path) -> None:
    """Over loopback: a broker subprocess, a sim game with both groups, ``gdrl-broker freeze`` for the
    picker; bad files and wrong spaces are refused to the control peer only."""
    model = picker_model(tmp_path / "picker.onnx")
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\x00" * 64)
    with broker_process(tmp_path) as (_, address):  # hold: the mover has no trainer and is held
        game = spawn_python("-m", "broker", "sim-game", "--address", address, "--movers", "2", "--pickers", "3")
        try:
            with pytest.raises(BrokerError) as refused:
                send_control(address, "freeze", {"group": PICKER, "path": str(garbage)})
            assert refused.value.code == "bad_control" and "not a loadable ONNX model" in refused.value.message
            with pytest.raises(BrokerError) as missing:
                send_control(address, "freeze", {"group": PICKER, "path": str(tmp_path / "none.onnx")})
            assert "no model file" in missing.value.message
            wait_for(lambda: PICKER in fetch_status(address)["policies"], what="the game's groups")
            with pytest.raises(BrokerError) as wrong:
                send_control(address, "freeze", {"group": MOVER, "path": str(model)})  # picker's spaces
            assert "takes observations" in wrong.value.message
            result = send_control(address, "freeze", {"group": PICKER, "path": str(model)})
            assert result["frozen"][PICKER]["version"] == 1
            wait_for(lambda: fetch_status(address)["frozen"][PICKER]["episodes"] > 0, what="a frozen episode")
            status = fetch_status(address)
            # a plain frozen group plays, as its file, against the games' other policies
            assert status["frozen"][PICKER]["player"] == "picker.onnx"
            assert set(status["elo"]) == {"picker.onnx", MOVER}
            table = render_table(status)
            assert "frozen v1" in table and f"frozen {PICKER}: model {model}" in table
            assert MOVER not in status["frozen"]  # refused requests left nothing behind
            with pytest.raises(BrokerError) as twice:
                send_control(address, "freeze", {"group": PICKER, "path": str(model)})
            assert "already" in twice.value.message
            send_control(address, "unfreeze", {"group": PICKER})
            assert fetch_status(address)["policies"][PICKER]["trainer"] is None
            assert game.poll() is None  # the game played on through all of it
        finally:
            game.terminate()
            game.wait(timeout=20)


def test_serve_refuses_a_bad_frozen_file(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.onnx"
    garbage.write_text("nope")
    proc = spawn_python("-m", "broker", "serve", "--port", "0", "--frozen", f"{PICKER}={garbage}", stderr=-1, stdout=-1)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert f"--frozen {PICKER}: {garbage} is not a loadable ONNX model" in err.decode()
    mover = make_model(PPO, mover_spaces(), 0)  # an ONNX file without our layout metadata
    plain = tmp_path / "plain.onnx"
    export_onnx(mover, plain, mover_spaces())
    import onnx

    proto = onnx.load(str(plain))
    del proto.metadata_props[:]
    onnx.save(proto, str(plain))
    proc = spawn_python("-m", "broker", "serve", "--port", "0", "--frozen", f"{MOVER}={plain}", stderr=-1, stdout=-1)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "no gdrl_layout metadata" in err.decode()


def test_frozen_throughput_benchmark_runs(tmp_path: Path) -> None:
    """The benchmark's smoke: both cases answer the group and the ratio is reported (speed not judged)."""
    import json
    import subprocess
    import sys

    from tests.helpers import python_env

    out = tmp_path / "frozen.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.frozen_throughput",
            "--agents",
            "16",
            "--warmup-s",
            "0.2",
            "--measure-s",
            "1",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=python_env(),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(out.read_text())
    assert results["frozen"]["ticks"] > 0 and results["trainer"]["ticks"] > 0
    assert results["frozen_over_trainer"] > 0


def test_control_requests_are_checked(tmp_path: Path) -> None:
    """One request per control connection; unknown commands and missing arguments get bad_control; the
    token is required of control peers as of any peer."""
    from broker.protocol import PROTOCOL_VERSION
    from broker.protocol.messages import Control, Hello
    from clients.transport import PeerSocket

    with InProcessBroker(expected_games=1, token="s3cret") as broker:
        with pytest.raises(BrokerError) as no_token:
            send_control(broker.address, "unfreeze", {"group": PICKER})
        assert no_token.value.code == "auth_failed"
        with pytest.raises(BrokerError) as unknown:
            send_control(broker.address, "reboot", {}, token="s3cret")
        assert unknown.value.code == "bad_control" and "unknown control command 'reboot'" in unknown.value.message
        with pytest.raises(BrokerError) as missing:
            send_control(broker.address, "freeze", {"group": PICKER}, token="s3cret")
        assert "needs 'path'" in missing.value.message
        with pytest.raises(BrokerError) as bad_pool:
            send_control(broker.address, "self_play", {"group": "b", "learner": "a", "pool": str(tmp_path),
                                                       "play_latest": 2.0}, token="s3cret")  # fmt: skip
        assert "play_latest must be within [0, 1]" in bad_pool.value.message
        sock = PeerSocket(broker.address, Hello("control", PROTOCOL_VERSION, "twice", "s3cret"), timeout_recv=10)
        sock.send(Control("unfreeze", {"group": PICKER}))
        sock.send(Control("unfreeze", {"group": PICKER}))
        with pytest.raises(BrokerError) as twice:
            while True:
                sock.recv()
        assert twice.value.code in ("unexpected_message", "bad_control")
        sock.close()
        assert broker.call(broker.server.status)["frozen"] == {}
