"""Local trainers over the broker's Unix domain socket, next to games on TCP; JSON-lines logging names the
peer, game and policy of every join, leave and error."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np

from clients.sim_game import run_sim_game
from clients.vec_env import BrokerVecEnv
from tests.helpers import broker_process


def test_trainers_on_the_unix_socket_and_json_logs(tmp_path: Path) -> None:
    unix_path = tmp_path / "broker.sock"
    args = ("--unix", str(unix_path), "--log-json", "--status-interval", "0")
    with broker_process(tmp_path, *args) as (_, tcp_address):
        game = threading.Thread(target=run_sim_game, args=(tcp_address, 3, 2), daemon=True)
        game.start()
        envs = {p: BrokerVecEnv(p, f"unix:{unix_path}", name=f"local-{p}") for p in ("mover", "picker")}
        assert envs["mover"].num_envs == 3 and envs["picker"].num_envs == 2
        for env in envs.values():
            env.reset()
        rewards = {p: 0.0 for p in envs}
        for _ in range(50):
            for policy, env in envs.items():
                _, reward, _, _ = env.step(np.array([env.action_space.sample() for _ in range(env.num_envs)]))
                rewards[policy] += float(np.abs(reward).sum())
        for env in envs.values():
            env.close()
        assert all(total > 0 for total in rewards.values())  # real game outcomes came through the socket
    game.join(timeout=10)
    assert not unix_path.exists()  # removed on shutdown
    lines = [json.loads(line) for p in tmp_path.glob("broker-*.log") for line in p.read_text().splitlines()]
    events = {(entry["event"], entry.get("policy")) for entry in lines}
    assert ("trainer joined", "mover") in events and ("trainer left", "picker") in events
    joined = next(e for e in lines if e["event"] == "game joined")
    assert (
        joined["game"] == 0
        and joined["peer"].startswith("127.0.0.1:")
        and joined["groups"] == {"mover": 3, "picker": 2}
    )
    trainer = next(e for e in lines if e["event"] == "trainer joined" and e["policy"] == "mover")
    assert trainer["peer"].startswith("unix#") and trainer["name"] == "local-mover"
    assert all("timestamp" in e and "level" in e for e in lines)
