"""Graceful shutdown: SIGTERM or SIGINT to a broker that serves games and trainers. Games are told to
close and exit 0, trainers get a clear "broker shutting down" error, peers that ignore the goodbye are cut
off after the shutdown timeout, and the broker exits 0; nothing hangs."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import numpy as np
import pytest

from broker.protocol import PROTOCOL_VERSION
from broker.protocol.framing import encode_frame
from broker.protocol.messages import GameStep, Hello, StepData
from broker.protocol.spaces import BoxSpace, DiscreteAction, GroupSpec, PolicySpaces
from broker.server.config import ServerConfig
from tests.scripts.reliability_common import (
    RawPeer,
    exit_code,
    log_events,
    read_report,
    spawn,
    start_broker,
    stop,
    wait_until,
)

TIMEOUT_SHUTDOWN = ServerConfig().timeout_shutdown  # what the broker gives peers to leave
MARGIN = 15.0  # process start-up and teardown on a busy machine; a hang is far longer


DEAF = PolicySpaces((("obs", BoxSpace((256,), "float32", -1.0, 1.0)),), (("pick", DiscreteAction(2)),))


def deaf_game(address: str) -> RawPeer:
    """Slot 2's game (policy "deaf"): it sends its first step, then never reads again."""
    game = RawPeer(address, rcvbuf=4096)
    game.read_greeting()
    game.send_message(Hello("game", PROTOCOL_VERSION, "deaf", groups=(GroupSpec("deaf", 1, DEAF),)).to_wire())
    no = np.zeros(1, np.bool_)
    first = StepData({"obs": np.zeros((1, 256), np.float32)}, np.zeros(1, np.float32), no, no)
    game.send_message(GameStep(0, {"deaf": first}).to_wire())
    return game


def deaf_trainer(address: str) -> RawPeer:
    """The trainer of "deaf": it takes one batch, then asks for it again and again and reads nothing,
    so megabytes wait for it when the broker says goodbye."""
    trainer = RawPeer(address, rcvbuf=4096)
    trainer.read_greeting()
    trainer.send_message(Hello("trainer", PROTOCOL_VERSION, "deaf", policy="deaf").to_wire())
    reset = encode_frame(b"\x81\xa4type\xa5reset")
    trainer.send(reset)
    while (message := trainer.read_message()) is not None and message["type"] != "batch":
        pass
    trainer.send(reset * 8000)  # each resends the open 1 KiB batch
    return trainer


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_stops_broker_games_and_trainers_within_the_timeout(tmp_path: Path, signum: int) -> None:
    proc, port, log_path = start_broker(tmp_path, "--games", "3", "--status-interval", "0", "--log-json")
    address = f"127.0.0.1:{port}"
    games = []
    for i in range(2):
        args = ["--address", address, "--seed", str(i), "--report", str(tmp_path / f"game{i}.json")]
        games.append(spawn("tests.scripts.reliability_game", *args, log_path=tmp_path / f"game{i}.log"))
    # The user-facing trainer for one policy, the test trainer for the other.
    train_args = ["--policy", "mover", "--broker", address, "--timesteps", "10000000", "--progress", "lines"]
    gdrl_train = spawn("clients.train", *train_args, "--log-every", "1", log_path=tmp_path / "gdrl-train.log")
    picker_report = tmp_path / "picker.json"
    picker_args = ["--address", address, "--policy", "picker", "--mode", "random", "--report", str(picker_report)]
    picker = spawn("tests.scripts.reliability_trainer", *picker_args, log_path=tmp_path / "picker.log")
    stalled = [deaf_game(address)]  # completes the layout of 3 slots
    try:
        wait_until(lambda: read_report(picker_report).get("steps", 0) > 50, 180, "the trainers to step")
        wait_until(lambda: "steps/s" in (tmp_path / "gdrl-train.log").read_text(), 120, "gdrl-train to report")
        stalled.append(deaf_trainer(address))
        time.sleep(0.5)
        proc.send_signal(signum)
        signalled = time.monotonic()
        broker_code = exit_code(proc, TIMEOUT_SHUTDOWN + MARGIN)
        broker_took = time.monotonic() - signalled
        game_codes = [exit_code(game, MARGIN) for game in games]
        trainer_codes = {"gdrl-train": exit_code(gdrl_train, MARGIN), "picker": exit_code(picker, MARGIN)}
        everyone_took = time.monotonic() - signalled
        for peer in stalled:  # cut off: the connection is gone, whatever was left unread
            peer.sock.settimeout(10)
            peer.read_until_closed()
            assert peer.eof
    finally:
        for peer in stalled:
            peer.close()
        for p in (*games, gdrl_train, picker, proc):
            stop(p, signal.SIGKILL)
    print(f"\nbroker exited {broker_took:.1f} s after the signal; everyone within {everyone_took:.1f} s")
    assert broker_code == 0, log_path.read_text()
    assert broker_took >= TIMEOUT_SHUTDOWN - 0.5  # it did wait for the deaf peers, then cut them off
    events = log_events(log_path.read_text())
    assert events[-1]["event"] == "broker stopped" and events[-1]["reason"] == "broker shutting down"
    # Games: told to close, in those words, and exited 0.
    assert game_codes == [0, 0]
    for i in range(2):
        report = read_report(tmp_path / f"game{i}.json")
        assert report["end"] == "closed" and report["message"] == "broker shutting down", report
    # Trainers: a clear error, not a hang and not a traceback.
    train_log = (tmp_path / "gdrl-train.log").read_text()
    assert trainer_codes["gdrl-train"] == 1, train_log
    assert "gdrl-train: lost the broker: shutting_down: broker shutting down" in train_log
    assert "Traceback" not in train_log
    assert trainer_codes["picker"] == 3
    picker_result = read_report(picker_report)
    assert picker_result["error"] == "shutting_down" and picker_result["message"] == "broker shutting down"
