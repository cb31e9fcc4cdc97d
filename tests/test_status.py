"""Live status: ``gdrl-broker status`` (table, JSON, Prometheus), the metrics endpoint and the log line."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from clients.sim_game import run_sim_game
from clients.vec_env import BrokerVecEnv
from tests.helpers import broker_process, python_env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_status(address: str, *flags: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "broker", "status", "--address", address, *flags],
        capture_output=True,
        text=True,
        timeout=30,
        env=python_env(),
        check=True,
    )
    return result.stdout


def test_status_reports_games_trainers_and_policies(tmp_path: Path) -> None:
    metrics_port = free_port()
    args = ("--games", "1", "--status-interval", "0.5", "--metrics-port", str(metrics_port))
    with broker_process(tmp_path, *args) as (_, address):
        game = threading.Thread(target=run_sim_game, args=(address, 4, 4), daemon=True)  # until the broker stops
        game.start()
        envs = {p: BrokerVecEnv(p, address, name=f"t-{p}") for p in ("mover", "picker")}
        for env in envs.values():
            env.reset()
        for _ in range(150):
            for env in envs.values():
                env.step(np.array([env.action_space.sample() for _ in range(env.num_envs)]))
        status = json.loads(run_status(address, "--json"))
        table = run_status(address)
        prometheus = run_status(address, "--prometheus")
        with socket.create_connection(("127.0.0.1", metrics_port), timeout=5) as conn:
            conn.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            response = b""
            while chunk := conn.recv(65536):
                response += chunk
        time.sleep(0.6)  # one more periodic status line
        for env in envs.values():
            env.close()
        game.join(timeout=10)
    log = "\n".join(p.read_text() for p in tmp_path.glob("broker-*.log"))
    assert [g["connected"] for g in status["games"]] == [True]
    movers, pickers = status["policies"]["mover"], status["policies"]["picker"]
    assert movers["agents"] == 4 and pickers["agents"] == 4
    assert movers["trainer"] == "t-mover" and movers["mode"] == "hold"
    # Its ring is mapped (this host), though batches this small go by the socket.
    assert movers["link"] == "tcp + ring" and movers["ring_batches"] == 0
    assert movers["env_steps"] >= 4 * 150 and movers["steps_per_s"] > 0
    assert movers["episodes"] > 0 and movers["mean_episode_reward"] is not None
    assert 0.0 <= movers["held_fraction"] <= 1.0 and movers["longest_hold"] >= 1
    assert "mover" in table and "picker" in table and "games 1/1" in table and "tcp + ring" in table
    assert 'gdrl_policy_ring_batches_total{policy="mover"} 0.0' in prometheus
    assert 'gdrl_policy_agents{policy="mover"} 4.0' in prometheus
    assert response.startswith(b"HTTP/1.1 200 OK") and b"gdrl_games_connected 1" in response
    assert "policy status" in log and "steps_per_s" in log and "ring_batches" in log  # the log says what status says


def test_status_says_how_each_trainer_is_reached(tmp_path: Path) -> None:
    """One trainer in the broker's process, one over its Unix socket with a ring: each policy's ``link``."""
    from clients.inprocess import InProcessBroker

    unix_path = str(tmp_path / "broker.sock")
    with InProcessBroker(expected_games=1, status_interval=0, unix_path=unix_path) as broker:
        game = threading.Thread(target=run_sim_game, args=(broker.address, 2, 2), daemon=True)
        game.start()
        mover = broker.vec_env("mover", name="t-mover")
        picker = BrokerVecEnv("picker", f"unix:{unix_path}", name="t-picker")
        try:
            for env in (mover, picker):
                env.reset()
            status = broker.call(broker.server.status)
        finally:
            mover.close()
            picker.close()
    movers, pickers = status["policies"]["mover"], status["policies"]["picker"]
    assert movers["link"] == "in-process" and "ring_batches" not in movers
    assert pickers["link"] == "unix + ring" and pickers["ring_batches"] == 0  # batches this small: the socket
