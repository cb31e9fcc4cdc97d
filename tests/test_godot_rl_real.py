"""The broker against the real ``godot-rl`` package from PyPI (its own GodotEnv and
StableBaselinesGodotEnv, unmodified): the broker dials godot_rl training scripts as their game
(``serve --godot-rl-trainer POLICY=HOST:PORT``).

Install beside our SB3/gymnasium with ``pip install --no-deps godot-rl==0.8.2`` (its pins are older
than ours; its core needs only numpy and gymnasium).
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from broker.server.dialer import GodotRlTrainerConnector
from clients.inprocess import InProcessBroker
from clients.plugin_emulator import EmulatorConfig, PluginEmulator, PolicyGroup
from tests.helpers import broker_process, spawn_python

godot_env = pytest.importorskip("godot_rl.core.godot_env", reason="needs `pip install --no-deps godot-rl==0.8.2`")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def stop(proc: subprocess.Popen[bytes], timeout: float = 30) -> int | None:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None


def test_sb3_scripts_built_on_godot_rl_train_through_the_broker(tmp_path: Path) -> None:
    ports = {"mover": free_port(), "picker": free_port()}
    scripts = {
        policy: spawn_python(
            "-m", "tests.scripts.godot_rl_sb3_train", "--port", str(port), "--timesteps", "3000",
            "--report", str(tmp_path / f"{policy}.json"),
            stdout=subprocess.DEVNULL,
        )
        for policy, port in ports.items()
    }  # fmt: skip
    targets = [arg for policy, port in ports.items() for arg in ("--godot-rl-trainer", f"{policy}=127.0.0.1:{port}")]
    try:
        with broker_process(tmp_path, "--stepping", "barrier", "--games", "2", *targets) as (_, address):
            games = [
                spawn_python("-m", "broker", "sim-game", "--address", address, "--seed", str(i), "--name", f"sim-{i}")
                for i in range(2)
            ]
            codes = {policy: stop(proc, timeout=300) for policy, proc in scripts.items()}
        game_codes = [stop(game) for game in games]  # told to close by the stopping broker
    finally:
        for proc in scripts.values():
            stop(proc, timeout=1)
    assert codes == {"mover": 0, "picker": 0}
    assert game_codes == [0, 0]
    mover = json.loads((tmp_path / "mover.json").read_text())
    picker = json.loads((tmp_path / "picker.json").read_text())
    assert mover["num_envs"] == 8 and picker["num_envs"] == 8  # 4 agents of each group in each of 2 games
    assert mover["action_space"] == "Box(-1.0, 1.0, (2,), float32)"
    assert picker["action_space"] == "MultiDiscrete([3])"  # godot_rl 0.8.2's form of one discrete key
    assert picker["first_obs_shapes"] == {"goal_side": [8], "obs": [8, 3]}
    for report in (mover, picker):
        assert report["timesteps"] >= 3000
        assert report["episodes"] > 20 and report["reward_std"] > 0.01
        assert report["truncated_with_obs"] > 0 and report["terminated"] > 0  # both kinds of episode end
    log = "".join(p.read_text() for p in tmp_path.glob("broker-*.log"))
    assert log.count("godot_rl trainer said close") == 2 and "peer error" not in log


def test_godot_env_talks_to_a_plugin_game_through_the_broker(tmp_path: Path) -> None:
    """Both compatibility halves at once: a plugin-protocol game on the broker's port, and godot_rl's
    own GodotEnv served by the broker. Images cross as hex twice, actions keep their keys, calls relay."""
    port = free_port()
    with broker_process(tmp_path, "--stepping", "barrier", "--godot-rl-trainer", f"shared_policy=127.0.0.1:{port}") as (
        broker,
        address,
    ):
        game = spawn_python(
            "-m", "clients.plugin_emulator", f"--port={address.rsplit(':', 1)[1]}", "--agents=3", "--action=mixed",
            "--image_key=cam_2d", "--image_shape=3,4,2", "--game_id=5", "--horizon=3", "--terminal_obs_info",
            stdout=subprocess.PIPE,
        )  # fmt: skip
        with warnings.catch_warnings():
            # godot_rl 0.8.2 drops its listening socket without closing it (it never closes it).
            warnings.simplefilter("ignore", ResourceWarning)
            env = godot_env.GodotEnv(env_path=None, port=port)
        try:
            assert env.num_envs == 3 and env.agent_policy_names == ["shared_policy"] * 3
            assert env.observation_space["cam_2d"].shape == (3, 4, 2)
            assert env.observation_space["cam_2d"].dtype == np.uint8
            obs, _ = env.reset()
            pattern = (np.arange(24) * 7 % 256).astype(np.uint8)
            for i, agent in enumerate(obs):
                assert agent["cam_2d"].reshape(-1)[:3].tolist() == [5, i, 0]  # decoded by godot_rl itself
                assert (agent["cam_2d"].reshape(-1)[3:] == pattern[3:]).all()
                assert agent["obs"][:2] == pytest.approx([0.05, i / 100])
            keys = list(env.action_spaces[0].keys())
            for t in range(1, 4):
                actions = []
                for i in range(3):
                    value = {"move": np.array([0.1 * (i + 1) * t, 0.0]), "jump": i % 2}
                    actions.append([value[k] for k in keys])
                obs, reward, done, _, info = env.step(actions, order_ij=True)
                assert [round(a["obs"][2], 5) for a in obs] == [round(0.1 * (i + 1) * t, 5) for i in range(3)]
                assert [a["cam_2d"].reshape(-1)[2] for a in obs] == [t, t, t]
                assert len(reward) == 3 and all(isinstance(r, float) for r in reward)
            # Horizon 3: the agents still out timed out, reported as truncated with their final obs.
            truncated = [i for i, agent_info in enumerate(info) if agent_info.get("TimeLimit.truncated")]
            assert truncated and all(done[i] for i in truncated)
            for i in truncated:
                final = info[i]["terminal_observation"]
                assert np.asarray(final["cam_2d"]).shape == (3, 4, 2) and final["cam_2d"][0][0][:2] == [5, i]
            assert env.call("ping") == [["ping", 5, 0], ["ping", 5, 1], ["ping", 5, 2]]  # relayed to the game
        finally:
            env.close()
        broker.send_signal(signal.SIGTERM)
        out, _ = game.communicate(timeout=30)
    assert game.returncode == 0 and json.loads(out) == {"steps": 3, "closed_by_broker": True}


def test_the_broker_waits_for_games_and_serves_the_next_script(
    inprocess_broker: Callable[..., InProcessBroker],
) -> None:
    """The script's env_info is answered only once the games are in; a script that closes is followed by
    the next one on the same address, which picks up where the first left off."""
    broker = inprocess_broker(stepping="barrier")
    port = free_port()
    connector = GodotRlTrainerConnector(broker.server, "shared_policy", "127.0.0.1", port, retry_max=0.5)
    broker.call(connector.start)
    envs: list[Any] = []

    def open_env() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)  # godot_rl drops its listening socket unclosed
            envs.append(godot_env.GodotEnv(env_path=None, port=port))

    opener = threading.Thread(target=open_env)
    opener.start()
    deadline = time.monotonic() + 20
    while "shared_policy" not in broker.server.hub.trainers and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "shared_policy" in broker.server.hub.trainers  # connected and registered ...
    time.sleep(0.5)
    assert opener.is_alive()  # ... but env_info waits for a game
    config = EmulatorConfig(groups=(PolicyGroup("shared_policy", 2, "discrete"),), port=broker.server.port, game_id=6)
    emulator = PluginEmulator(config)
    game = threading.Thread(target=emulator.run, daemon=True)
    game.start()
    opener.join(timeout=30)
    first = envs.pop()
    assert first.num_envs == 2
    first.reset()
    obs, *_ = first.step([[np.array(2)], [np.array(0)]], order_ij=True)  # MultiDiscrete([3]) in 0.8.2 form
    assert [round(a["obs"][2], 5) for a in obs] == [0.2, 0.0]
    first.close()
    opener = threading.Thread(target=open_env)
    opener.start()
    opener.join(timeout=30)
    second = envs.pop()
    obs, _ = second.reset()  # the batch the first script left open
    assert [round(a["obs"][2], 5) for a in obs] == [0.2, 0.0]
    obs, *_ = second.step([[np.array(1)], [np.array(1)]], order_ij=True)
    assert [round(a["obs"][2], 5) for a in obs] == [0.1, 0.1]
    second.close()
    asyncio.run_coroutine_threadsafe(connector.stop(), broker.loop).result(timeout=10)
    broker.close()
    game.join(timeout=20)
    emulator.close()
    assert emulator.stats.steps == 2 and emulator.stats.closed_by_broker and connector.connections >= 2
