"""``gdrl-broker serve --env-path GAME --n-parallel K``: the broker launches, supervises and stops games.

The game is a fake executable: a Python script that plays the plugin's JSON protocol through
clients.plugin_emulator, reads godot_rl's launch arguments like ``sync.gd`` does, and records them.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from broker.server.launcher import GameLauncher, LaunchSpec, game_argv, resolve_env_path
from clients.vec_env import BrokerVecEnv
from tests.helpers import ROOT, broker_process, python_env

FAKE_GAME = """#!{python}
import json, os, sys
sys.path.insert(0, {root!r})
from clients.plugin_emulator import PluginEmulator, config_from_args, godot_args

records = {records!r}
seed = int(godot_args(sys.argv[1:])["env_seed"])
launch = len([name for name in os.listdir(records) if name.startswith(f"seed{{seed}}-")])
with open(os.path.join(records, f"seed{{seed}}-{{launch}}.json"), "w") as f:
    json.dump({{"argv": sys.argv[1:], "pid": os.getpid()}}, f)
emulator = PluginEmulator(config_from_args([*sys.argv[1:], "--agents=2", f"--game_id={{seed * 10 + launch}}"]))
crash = seed == {crash_seed} and launch == 0
emulator.run(max_steps={crash_after} if crash else None)
if crash:
    os._exit(3)  # a crash: no goodbye on the socket
"""


def make_fake_game(folder: Path, crash_seed: int, crash_after: int) -> Path:
    records = folder / "records"
    records.mkdir()
    path = folder / "fake_game.x86_64"  # an exported Linux game's suffix; --env-path may omit it
    path.write_text(
        FAKE_GAME.format(
            python=sys.executable, root=str(ROOT), records=str(records), crash_seed=crash_seed, crash_after=crash_after
        )
    )
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_game_argv_follows_godot_rl() -> None:
    spec = LaunchSpec("game.x86_64", 3, port=11008, seed=10, speedup=8.0, action_repeat=4, headless=True)
    assert game_argv(spec, 2) == [
        "game.x86_64",
        "--port=11008",
        "--env_seed=12",
        "--disable-render-loop",
        "--headless",
        "--action_repeat=4",
        "--speedup=8",
    ]
    assert game_argv(LaunchSpec("g", speedup=1.5), 0) == ["g", "--port=11008", "--env_seed=0", "--speedup=1.5"]


def test_env_path_gets_the_export_suffix_like_godot_rl(tmp_path: Path) -> None:
    game = make_fake_game(tmp_path, crash_seed=-1, crash_after=0)
    assert resolve_env_path(str(game)) == str(game)
    if sys.platform.startswith("linux"):
        assert resolve_env_path(str(tmp_path / "fake_game")) == str(game)
    with pytest.raises(ValueError, match="no such game executable"):
        resolve_env_path(str(tmp_path / "missing"))


async def test_a_copy_that_keeps_exiting_is_relaunched_with_backoff(tmp_path: Path) -> None:
    script = tmp_path / "quits.sh"
    script.write_text("#!/bin/sh\nexit 2\n")
    script.chmod(0o755)
    launcher = GameLauncher(LaunchSpec(str(script), 1), backoff_initial=0.05, backoff_max=0.2)
    launcher.start()
    await asyncio.sleep(1.0)
    await launcher.stop()
    launches = launcher.launches[0]
    # Back-off 0.05, 0.1, 0.2, 0.2, ...: a handful of relaunches in a second, not hundreds.
    assert 3 <= launches <= 12, launches
    assert all(p.returncode is not None for p in launcher.processes.values())


def test_broker_launches_supervises_and_stops_games(tmp_path: Path) -> None:
    game = make_fake_game(tmp_path, crash_seed=5, crash_after=6)
    records = tmp_path / "records"
    args = ["--env-path", str(tmp_path / "fake_game"), "--n-parallel", "2", "--speedup", "4"]
    args += ["--action-repeat", "2", "--seed", "5", "--headless"]  # --games defaults to --n-parallel
    replaced: list[tuple[int, bool, bool]] = []
    with broker_process(tmp_path, "--stepping", "barrier", *args) as (broker, address):
        env = BrokerVecEnv("shared_policy", address, timeout_connect=30)
        assert env.num_envs == 4  # two copies, two agents each
        obs = env.reset()
        assert isinstance(obs, dict)
        first_ids = obs["obs"][:, 0].copy()
        assert sorted({round(float(v), 2) for v in first_ids}) == [0.5, 0.6]  # game ids 50 and 60
        for _ in range(30):
            env.step_async(np.full((4, 2), 0.1, np.float32))
            obs, _, dones, infos = env.step_wait()
            assert isinstance(obs, dict)
            replaced += [(row, bool(dones[row]), info["TimeLimit.truncated"]) for row, info in enumerate(infos)
                         if info.get("game_replaced")]  # fmt: skip
        crashed_rows = np.flatnonzero(np.isclose(first_ids, 0.5))  # game id 50: seed 5, first launch
        # The crashed copy's two agents: their episodes ended truncated, once.
        assert replaced == [(int(row), True, True) for row in crashed_rows]
        # The relaunched copy (game id 51) now feeds the rows the crashed one fed.
        assert sorted({round(float(v), 2) for v in obs["obs"][:, 0]}) == [0.51, 0.6]
        env.close()
        pids = [json.loads(p.read_text())["pid"] for p in records.iterdir()]
        broker.send_signal(signal.SIGTERM)
        assert broker.wait(timeout=30) == 0
    launched = {p.name: json.loads(p.read_text())["argv"] for p in sorted(records.iterdir())}
    assert sorted(launched) == ["seed5-0.json", "seed5-1.json", "seed6-0.json"]  # copy 0 crashed once
    port = address.rsplit(":", 1)[1]
    assert launched["seed6-0.json"] == [
        f"--port={port}",
        "--env_seed=6",
        "--disable-render-loop",
        "--headless",
        "--action_repeat=2",
        "--speedup=4",
    ]
    assert launched["seed5-1.json"][:2] == [f"--port={port}", "--env_seed=5"]  # same port for every copy
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(pid) for pid in pids), "games outlived the broker"
    log = "".join(p.read_text() for p in tmp_path.glob("broker-*.log"))
    assert "game exited; relaunching" in log and "code=3" in log
    assert game.exists()


def serve_with_env_path(cwd: Path, env_path: str, port_file: Path) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "broker", "serve", "--port", "0", "--port-file", str(port_file)]
    return subprocess.Popen(
        [*command, "--env-path", env_path], cwd=cwd, env=python_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )


def test_a_relative_env_path_is_launched_as_given(tmp_path: Path) -> None:
    """`--env-path ./my_game.x86_64` runs that file in the current folder, not a `my_game.x86_64` on PATH."""
    make_fake_game(tmp_path, crash_seed=-1, crash_after=0).rename(tmp_path / "my_game.x86_64")
    port_file = tmp_path / "port"
    broker = serve_with_env_path(tmp_path, "./my_game.x86_64", port_file)
    try:
        while not port_file.exists():
            assert broker.poll() is None, broker.stdout.read() if broker.stdout else ""
            time.sleep(0.05)
        env = BrokerVecEnv("shared_policy", f"127.0.0.1:{port_file.read_text()}", timeout_connect=60)
        assert env.num_envs == 2  # the launched copy joined with its two agents
        env.close()
    finally:
        broker.send_signal(signal.SIGTERM)
        output, _ = broker.communicate(timeout=30)
    assert b"cannot launch game" not in output, output.decode()
    assert str(tmp_path / "my_game.x86_64").encode() in output  # logged as the absolute path it ran


@pytest.mark.parametrize("problem", ["missing", "not executable"])
def test_an_env_path_that_cannot_run_is_one_error_at_start_up(tmp_path: Path, problem: str) -> None:
    game = tmp_path / "my_game.x86_64"
    if problem == "not executable":
        game.write_text("#!/bin/sh\nexit 0\n")
        game.chmod(0o644)
    broker = serve_with_env_path(tmp_path, "./my_game.x86_64", tmp_path / "port")
    output, _ = broker.communicate(timeout=60)  # not a retry loop: it ends by itself
    lines = output.decode().strip().splitlines()
    assert broker.returncode == 2 and len(lines) == 1, lines
    assert "--env-path ./my_game.x86_64" in lines[0]
    assert ("chmod +x" if problem == "not executable" else "no such game executable") in lines[0]
    assert not (tmp_path / "port").exists()  # it never listened
