"""The addon in a real Godot 4 engine (GODOT_BIN; see tests/godot_engine.py): its GDScript suite, and the
3D example played headless against a real broker by a real trainer (a BrokerVecEnv) on loopback."""

from __future__ import annotations

import re
import subprocess
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from clients.vec_env import BrokerVecEnv
from tests.godot_engine import ADDONS, EXAMPLES, PLUGIN_FIXTURE, ROOT, prepare_project, require_godot
from tests.helpers import broker_process

SUITE_TIMEOUT_S = 300
VECTORS = ROOT / "tests" / "vectors" / "protocol_v1_godot.json"
ADDON_TESTS = ADDONS / "godot_rl_broker" / "tests"
# arena.gd: the reacher is within this distance of the target when its episode is won.
REACH_DISTANCE, FLOOR_SIZE = 0.6, 8.0


@dataclass(frozen=True)
class EpisodeEnd:
    env: int
    truncated: bool
    reward: float
    final: tuple[float, ...]  # the observation the episode ended on


def test_addon_gdscript_suite_passes_in_the_engine(tmp_path: Path) -> None:
    godot = require_godot()
    project = prepare_project(godot, EXAMPLES / "two_policies", tmp_path / "project")
    result = subprocess.run(
        [
            str(godot),
            "--headless",
            "--path",
            str(project),
            "-s",
            "addons/godot_rl_broker/tests/run_tests.gd",
            "--",
            f"--vectors={VECTORS}",
        ],
        capture_output=True,
        text=True,
        timeout=SUITE_TIMEOUT_S,
    )
    output = result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    count = re.fullmatch(r"(\d+) passed, (\d+) failed", lines[-1].strip()) if lines else None
    assert count, f"the suite printed no 'N passed, N failed' line (exit {result.returncode}):\n{output}"
    passed, failed = int(count.group(1)), int(count.group(2))
    assert failed == 0 and result.returncode == 0, output
    declared = sum(len(re.findall(r"^func test_", p.read_text(), re.MULTILINE)) for p in ADDON_TESTS.glob("*.gd"))
    assert passed == declared, f"{passed} tests passed, {declared} are declared:\n{output}"


def _controller_members(path: Path) -> set[str]:
    """Top-level vars, functions and enums of a GDScript file."""
    pattern = r"^(?:@export\S* )?(?:var|func|enum) (\w+)"
    return set(re.findall(pattern, path.read_text(), re.MULTILINE))


@pytest.mark.parametrize("name", ["ai_controller_2d.gd", "ai_controller_3d.gd"])
def test_controller_base_classes_have_godot_rl_members_only(name: str) -> None:
    # A member godot_rl's own class lacks would clash with any user subclass that declares it.
    if not PLUGIN_FIXTURE.is_dir():
        pytest.fail(f"the godot_rl_agents plugin fixture is missing at {PLUGIN_FIXTURE}")
    ours = _controller_members(ADDONS / "godot_rl_broker" / "controller" / name)
    theirs = _controller_members(PLUGIN_FIXTURE / "controller" / name)
    assert ours == theirs, f"only ours: {sorted(ours - theirs)}, only godot_rl's: {sorted(theirs - ours)}"


@pytest.mark.timeout(600)
def test_three_d_example_steps_and_ends_episodes_through_a_real_broker(tmp_path: Path) -> None:
    """Two headless copies of the 3D example (2 reachers each, one policy) and a trainer on one broker port.

    The trainer steers every other reacher straight at its target (so its episodes are won: terminated) and
    holds the others still (so theirs run out of time: truncated). One copy names the broker `localhost`,
    the other passes a bare `--host` (an error, and the default host).
    """
    godot = require_godot()
    project = prepare_project(godot, EXAMPLES / "three_d", tmp_path / "three_d")
    games: list[subprocess.Popen[bytes]] = []
    logs = [tmp_path / "game-localhost.log", tmp_path / "game-bare-host.log"]
    with ExitStack() as files, broker_process(tmp_path, "--games", "2", "--stepping", "barrier") as (_, address):
        port = address.rsplit(":", 1)[1]
        try:
            for log, host_argument in zip(logs, ["--host=localhost", "--host"], strict=True):
                arguments = [host_argument, f"--port={port}", "--speedup=8", "--env_seed=3"]
                games.append(
                    subprocess.Popen(
                        [str(godot), "--headless", "--path", str(project), *arguments],
                        stdout=files.enter_context(log.open("wb")),
                        stderr=subprocess.STDOUT,
                    )
                )
            env = BrokerVecEnv("reacher", address, timeout_connect=120)
            try:
                ends = _play(env, steps=200)
            finally:
                env.close()
        finally:
            for game in games:
                game.terminate()
            for game in games:
                try:
                    game.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    game.kill()
                    game.wait()
    output = [log.read_text(errors="replace") for log in logs]
    assert "connecting to the broker at localhost:" in output[0], output[0]
    assert "--host needs a value" in output[1] and "at 127.0.0.1:" in output[1], output[1]
    seeking_wins = [end for end in ends if end.env % 2 == 0 and not end.truncated]
    still_timeouts = [end for end in ends if end.env % 2 == 1 and end.truncated]
    assert seeking_wins, f"no reacher steered at its target reached it: {ends}"
    assert still_timeouts, f"no still reacher's episode ran out of time: {ends}"
    for end in seeking_wins:
        assert end.reward > 0.9, end  # the +1 for reaching the target
        to_target = float(np.hypot(end.final[0], end.final[1])) * FLOOR_SIZE
        assert to_target < REACH_DISTANCE + 1e-3, f"final observation is not where the episode ended: {end}"
    for end in still_timeouts:
        assert abs(end.reward) < 1e-6, end  # no move, no progress, no outcome
    assert not any(end.env % 2 == 1 and not end.truncated for end in ends), "a still reacher fell"


def _play(env: BrokerVecEnv, steps: int) -> list[EpisodeEnd]:
    """Steps the env: even envs steer at their targets, odd ones stand still. Returns the episode ends."""
    assert env.num_envs == 4, env.num_envs  # 2 games x 2 reachers
    obs = env.reset()
    ends: list[EpisodeEnd] = []
    for _ in range(steps):
        assert isinstance(obs, dict) and obs["obs"].shape == (4, 4)
        actions = np.clip(obs["obs"][:, :2] * 20.0, -1.0, 1.0).astype(np.float32)
        actions[1::2] = 0.0
        obs, rewards, dones, infos = env.step(actions)
        for row in np.flatnonzero(dones):
            final = np.asarray(infos[row]["terminal_observation"]["obs"], dtype=np.float64)
            ends.append(
                EpisodeEnd(int(row), bool(infos[row]["TimeLimit.truncated"]), float(rewards[row]), tuple(final))
            )
    return ends
