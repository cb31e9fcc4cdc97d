"""The benchmark suite runs end to end in CI: every mode of every configuration of the "smoke" preset (tiny
configurations: images, several games, two policies) and of the "quick" preset (two target configurations)
is measured, with real processes, and reports positive numbers. Speed itself is never asserted.

The fair baseline's game (benchmarks/lean_plugin_game.py) is checked against the real godot_rl: its frames
decode to what the game holds, its env_info is the plugin emulator's, and SB3 trains on it through godot_rl's
own VecEnv, one port per policy."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks import idle
from benchmarks.configs import (
    ACTION_KEY,
    ACTION_SIZE,
    BROKER_MODES,
    DEFAULT_MODES,
    GODOT_RL_MODES,
    HORIZON,
    IMAGE_KEY,
    IMAGE_SHAPE,
    MODES,
    PRESETS,
    BenchConfig,
    BenchWorld,
)
from benchmarks.idle import (
    QOS_DEVICE,
    IdlePollingUnavailable,
    entries_between,
    hold_idle_polling,
    idle_state,
    qos_latency_us,
    request_keeps_cores_polling,
)
from benchmarks.inprocess_ceiling import Ceiling
from benchmarks.lean_game import StepFrames
from benchmarks.lean_plugin_game import SessionSpec, godot_float
from benchmarks.raw import HEADER, FrameReader, _view, check_same_bytes, connect_retry, step_frame
from benchmarks.relay import Forwarder, run_asyncio
from benchmarks.run import modes_for
from broker import compiled
from broker.protocol.codec import BodyKind, body_kind, decode_body
from broker.protocol.messages import GameStep
from clients.plugin_emulator import EmulatorConfig, PluginEmulator, PolicyGroup
from tests.godot_engine import require_godot
from tests.helpers import ROOT, python_env, spawn_python

# a process (or, in-process, a thread) between game and trainer
MIDDLE_MODES = (*BROKER_MODES, "relay", "relay_asyncio", "inprocess_ceiling")
PER_POLICY_MODES = (*BROKER_MODES, "inprocess_ceiling", "godot_rl_per_policy")  # one trainer per policy


def run_benchmark(module: str, *args: str, timeout: float) -> str:
    """Run a benchmark program as a user would, from the repository; it must exit 0. Its standard output."""
    proc = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


def test_raw_ceiling_sends_the_protocols_own_step_bytes() -> None:
    """The ceiling is only a ceiling if it moves the same bytes: episode ends (final obs) included."""
    world = BenchWorld(BenchConfig(3, "img", 2, 1), game_index=1)
    frames = set()
    for tick in range(60):  # past the horizon: rows end, and final observations ride along
        check_same_bytes(world)
        frames.add(len(step_frame(world)))
        world.apply({name: {ACTION_KEY: np.full((3, 2), tick / 60, np.float32)} for name in ("p0", "p1")})
    assert len(frames) > 1  # some steps carried final observations


def test_inprocess_ceiling_hands_each_policy_its_groups_and_answers_every_game() -> None:
    """The in-process ceiling's relay thread reads every game's step, hands each policy's trainer its groups of
    every game (here the test takes them from the inboxes, as the trainer threads would) and, once every policy
    has answered, writes each game one actions frame carrying every policy's actions."""
    config = BenchConfig(3, "vec8", 2, 2)
    ceiling = Ceiling(config, warmup_s=0.0, measure_s=1.0)
    relay = threading.Thread(target=ceiling.relay, daemon=True)
    relay.start()
    worlds = [BenchWorld(config, game_index=i) for i in range(config.games)]
    games = [connect_retry(ceiling.port) for _ in worlds]
    try:
        for tick in range(3):
            for game, world in zip(games, worlds, strict=True):
                game.sendall(step_frame(world))
            for name in config.policy_names:
                groups = ceiling.inboxes[name].get(timeout=10)
                sent = sorted(w.step_data()[name].obs["obs"].tobytes() for w in worlds)
                assert sorted(_view(g["obs"]["obs"]).tobytes() for g in groups) == sent, (tick, name)
                ceiling.answers.put((name, ceiling.actions[name]))
            for game, world in zip(games, worlds, strict=True):
                game.settimeout(10)
                answer = FrameReader(game).read()
                assert answer["type"] == "actions" and answer["tick"] == tick
                assert set(answer["groups"]) == set(config.policy_names)
                for name, group in answer["groups"].items():
                    actions = _view(group[ACTION_KEY])
                    assert actions.shape == (config.agents, ACTION_SIZE)
                    assert np.array_equal(actions, ceiling.actions[name])
                world.apply({name: {ACTION_KEY: _view(g[ACTION_KEY])} for name, g in answer["groups"].items()})
    finally:
        for game in games:
            game.close()
    relay.join(timeout=10)
    assert not relay.is_alive()  # the games gone end the relay


def test_inprocess_ceiling_runs_its_threads_on_one_core() -> None:
    """The in-process ceiling holds its process to one core before its threads start, so they inherit it (run
    in a child: the test's own process keeps its cores)."""
    probe = (
        "import json, os, threading\n"
        "from benchmarks.inprocess_ceiling import one_core\n"
        "allowed = sorted(os.sched_getaffinity(0))\n"
        "core = one_core()\n"
        "seen = {}\n"
        "thread = threading.Thread(target=lambda: seen.update(thread=sorted(os.sched_getaffinity(0))))\n"
        "thread.start(); thread.join()\n"
        "print(json.dumps({'allowed': allowed, 'core': core, 'process': sorted(os.sched_getaffinity(0)), **seen}))\n"
    )
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no thread affinity on this platform")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    report = json.loads(done.stdout)
    if len(report["allowed"]) < 2:
        assert report["core"] is None and report["process"] == report["allowed"]
        return
    assert report["core"] == max(report["allowed"])
    assert report["process"] == [report["core"]] and report["thread"] == [report["core"]]


@pytest.mark.parametrize("codec", [BodyKind.MSGPACK, BodyKind.GODOT])
def test_lean_native_game_sends_the_worlds_steps_with_each_tick(codec: BodyKind) -> None:
    """The native modes' lean game sends, at every tick, the protocol's step of the world's phase (stepped with
    zero actions) with that tick, in msgpack or as Godot Variants (broker_variant): what the broker decodes is
    what the world held, episode ends included."""
    config = BenchConfig(3, "img", 2, 1)
    frames = StepFrames(config, game_index=1, codec=codec)
    world = BenchWorld(config, game_index=1)
    zeros = {name: {ACTION_KEY: np.zeros((3, 2), np.float32)} for name in ("p0", "p1")}
    finals = 0
    for tick in (*range(HORIZON), 300, 2**20, 2**31 - 1):
        frame = bytes(frames.frame(tick))
        (length,) = HEADER.unpack_from(frame)
        assert length == len(frame) - HEADER.size
        body = frame[HEADER.size :]
        assert body_kind(body) is codec
        step = GameStep.from_wire(decode_body(codec, body))
        assert step.tick == tick
        if tick < HORIZON:
            expected = world.step_data()
            for name, data in step.groups.items():
                assert np.array_equal(data.obs["obs"], expected[name].obs["obs"])
                assert np.array_equal(data.obs[IMAGE_KEY], expected[name].obs[IMAGE_KEY])
                assert np.array_equal(data.truncated, expected[name].truncated)
                finals += data.final_index is not None
            world.apply(zeros)
    assert finals  # some phases carry final observations


def test_relay_forwards_frames_unchanged() -> None:
    """The two-hop ceiling moves the very frames it reads, small ones and ones larger than its buffer."""
    game, relay_in = socket.socketpair()
    relay_out, trainer = socket.socketpair()
    forwarder = Forwarder(capacity=64)
    frames = [HEADER.pack(len(body)) + body for body in (b"x", bytes(range(256)) * 40, b"", b"tail")]
    expected = b"".join(frames)
    with game, relay_in, relay_out, trainer:
        game.sendall(expected)  # 10 KiB: fits the socket buffers, so one thread can play every side
        for _ in frames:
            forwarder.forward(relay_in, relay_out)
        received = b""
        while len(received) < len(expected):
            received += trainer.recv(1 << 16)
    assert received == expected


def test_asyncio_relay_forwards_frames_unchanged_both_ways() -> None:
    """The asyncio two-hop ceiling (relay_asyncio) moves whole frames unchanged in both directions: frames that
    come split over reads, several in one read, and one sent before the relay has joined the pair."""
    trainer_listener = socket.create_server(("127.0.0.1", 0))
    trainer_port = trainer_listener.getsockname()[1]
    port = free_port()
    relay = threading.Thread(target=run_asyncio, args=(port, trainer_port, 1), daemon=True)
    relay.start()
    game = connect_retry(port)
    frames = [HEADER.pack(len(body)) + body for body in (b"x", bytes(range(256)) * 400, b"", b"tail")]
    expected = b"".join(frames)
    with game, trainer_listener:
        game.sendall(frames[0])  # possibly before the relay joins the pair
        trainer, _ = trainer_listener.accept()
        with trainer:
            trainer.settimeout(10)
            game.sendall(expected[len(frames[0]) : 1000])  # a frame split over writes, then the rest at once
            time.sleep(0.05)
            game.sendall(expected[1000:])
            received = b""
            while len(received) < len(expected):
                received += trainer.recv(1 << 16)
            assert received == expected
            trainer.sendall(expected)  # and back
            back = b""
            while len(back) < len(expected):
                back += game.recv(1 << 16)
            assert back == expected
    relay.join(timeout=10)
    assert not relay.is_alive()  # a peer gone ends the relay


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def lean_game(config: BenchConfig, ports: list[int], *flags: str) -> subprocess.Popen[bytes]:
    """The lean game as the benchmark runs it, checking every action frame godot_rl sends."""
    args = ["--config", json.dumps(config.to_json()), "--ports", ",".join(map(str, ports)), "--check-actions"]
    return spawn_python("-m", "benchmarks.lean_plugin_game", *args, *flags, stdout=subprocess.PIPE)


def godot_rl_vec_env(port: int) -> Any:
    """godot_rl's own SB3 VecEnv on ``port``, as a user's training script opens it."""
    from godot_rl.wrappers.stable_baselines_wrapper import StableBaselinesGodotEnv

    with contextlib.redirect_stdout(sys.stderr):
        return StableBaselinesGodotEnv(env_path=None, port=port)


def finished(game: subprocess.Popen[bytes]) -> dict[str, Any]:
    out, _ = game.communicate(timeout=60)
    assert game.returncode == 0, out
    return dict(json.loads(out.decode().strip().splitlines()[-1]))


def test_lean_game_frames_decode_in_godot_rl_to_what_the_game_holds() -> None:
    """All agents of two policies in one env, with images: godot_rl's own decoding (hex images included)
    gives back the game's observations, rewards and staggered dones, and the plugin's env_info."""
    pytest.importorskip("godot_rl.core.godot_env", reason="needs `pip install --no-deps godot-rl==0.8.2`")
    config = BenchConfig(3, "img", 2, 1)
    spec = SessionSpec(config, 0, config.policy_names)
    emulator = PluginEmulator(
        EmulatorConfig(
            groups=(PolicyGroup("p0", 3), PolicyGroup("p1", 3)),
            obs_size=8,
            image_key=IMAGE_KEY,
            image_shape=IMAGE_SHAPE,
        )
    )
    assert spec.env_info() == emulator.env_info()  # the plugin's env_info, list form with policy names
    port = free_port()
    game = lean_game(config, [port])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)  # godot_rl 0.8.2 never closes its listening socket
        venv = godot_rl_vec_env(port)
    try:
        env = venv.envs[0]
        assert venv.num_envs == 6 and env.agent_policy_names == ["p0"] * 3 + ["p1"] * 3
        assert env.observation_space[IMAGE_KEY].shape == IMAGE_SHAPE and env.observation_space["obs"].shape == (8,)
        expected = spec.observations()
        want_vectors = np.array([row["obs"] for row in expected])
        want_images = np.stack([row[IMAGE_KEY] for row in expected])
        obs = venv.reset()
        assert np.array_equal(obs["obs"], want_vectors) and np.array_equal(obs[IMAGE_KEY], want_images)
        ended = np.zeros(6, int)
        rng = np.random.default_rng(0)
        for tick in range(1, HORIZON + 1):
            obs, reward, done, infos = venv.step(rng.uniform(-1, 1, (6, 2)).astype(np.float32))
            assert np.array_equal(obs["obs"], want_vectors) and np.array_equal(obs[IMAGE_KEY], want_images)
            assert reward == pytest.approx(spec.reward_at(tick), rel=1e-6)
            assert done.tolist() == spec.done_at(tick).tolist() and infos == [{}] * 6
            ended += done
        assert ended.tolist() == [1] * 6  # each agent's episode ended once per horizon, staggered
    finally:
        with contextlib.redirect_stdout(sys.stderr):
            venv.close()
    assert finished(game) == {"event": "finished", "actions": HORIZON}  # every action frame checked


def test_sb3_trains_on_the_lean_game_through_godot_rl_one_port_per_policy() -> None:
    """Two policies as a multi-policy godot_rl game must serve them: one connection per policy, each to its
    own godot_rl env. SB3's PPO trains p0 while p1's env steps in lock-step beside it."""
    pytest.importorskip("godot_rl.core.godot_env", reason="needs `pip install --no-deps godot-rl==0.8.2`")
    from stable_baselines3 import PPO
    from stable_baselines3.common.vec_env import VecMonitor

    config = BenchConfig(4, "vec8", 2, 1)
    ports = [free_port(), free_port()]
    game = lean_game(config, ports, "--split")
    envs: dict[int, Any] = {}

    def open_env(index: int) -> None:
        envs[index] = godot_rl_vec_env(ports[index])

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)  # godot_rl 0.8.2 never closes its listening socket
        openers = [threading.Thread(target=open_env, args=(i,)) for i in range(2)]
        for opener in openers:
            opener.start()
        for opener in openers:
            opener.join(timeout=120)
    assert set(envs) == {0, 1}
    assert [envs[i].envs[0].agent_policy_names for i in range(2)] == [["p0"] * 4, ["p1"] * 4]
    trained = threading.Event()
    p1_steps: list[int] = []
    p1_obs_ok: list[bool] = []
    want_p1 = np.array([row["obs"] for row in SessionSpec(config, 0, ["p1"]).observations()])

    def step_p1() -> None:
        env = envs[1]
        env.reset()
        rng = np.random.default_rng(1)
        while not trained.is_set():
            obs, *_ = env.step(rng.uniform(-1, 1, (4, 2)).astype(np.float32))
            p1_obs_ok.append(bool(np.array_equal(obs["obs"], want_p1)))
            p1_steps.append(1)
        with contextlib.suppress(OSError), contextlib.redirect_stdout(sys.stderr):
            env.close()

    stepper = threading.Thread(target=step_p1)
    stepper.start()
    try:
        model = PPO("MultiInputPolicy", VecMonitor(envs[0]), n_steps=16, batch_size=32, n_epochs=1)
        model.learn(total_timesteps=128)
        assert model.num_timesteps >= 128
    finally:
        trained.set()
        with contextlib.suppress(OSError), contextlib.redirect_stdout(sys.stderr):
            envs[0].close()
        stepper.join(timeout=60)
    assert len(p1_steps) >= 128 // 4 and all(p1_obs_ok)  # lock-step: p1 stepped with every p0 step
    assert finished(game)["actions"] >= 128 // 4


def test_lean_game_writes_floats_as_godot_does(tmp_path: Path) -> None:
    """The real engine's JSON.stringify of the same float32 values (as a Godot game's observations are) gives
    the very numbers the lean game sends: signs, zeros and magnitudes from 1e-20 to 1e6."""
    godot = require_godot()
    rng = np.random.default_rng(3)
    magnitudes = 10.0 ** rng.uniform(-8, 6, 60) * rng.choice([-1, 1], 60)
    values = np.concatenate([rng.uniform(-1, 1, 60), magnitudes, [0, 1, -1, 10, -10, 0.5, 1e-20]]).astype(np.float32)
    script = tmp_path / "stringify.gd"
    script.write_text(
        "extends SceneTree\n"
        "func _init():\n"
        "\tvar values := []\n"
        f'\tfor f in "{values.tobytes().hex()}".hex_decode().to_float32_array():\n'
        "\t\tvalues.append(f)\n"
        '\tprint("JSON:" + JSON.stringify(values, "", false))\n'
        "\tquit()\n"
    )
    out = subprocess.run(
        [str(godot), "--headless", "--script", str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120
    ).stdout
    written = next(line for line in out.splitlines() if line.startswith("JSON:"))[len("JSON:") :]
    assert written == "[" + ",".join(godot_float(float(v)) for v in values) + "]"


def test_lean_game_refuses_what_the_plugin_would_not_handle() -> None:
    """A server that is not godot_rl (no 0.7 handshake), or an action list of the wrong length, stops the lean
    game with a clear message instead of a benchmark of the wrong thing."""
    config = BenchConfig(2, "vec8", 1, 1)
    for script, expected in (
        ([{"type": "hello"}], "expected the 0.7 handshake first"),
        (
            [
                {"type": "handshake", "major_version": "0", "minor_version": "7"},
                {"type": "env_info"},
                {"type": "action", "action": [{"move": [0.0, 0.0]}]},
            ],
            "action must list 2 agents",
        ),
    ):
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen(1)
            listener.settimeout(60)
            game = spawn_python(
                "-m", "benchmarks.lean_plugin_game", "--config", json.dumps(config.to_json()),
                "--ports", str(listener.getsockname()[1]), "--check-actions", stderr=subprocess.PIPE,
            )  # fmt: skip
            conn, _ = listener.accept()
            with conn:
                for message in script:
                    body = json.dumps(message).encode()
                    conn.sendall(len(body).to_bytes(4, "little") + body)
                _, err = game.communicate(timeout=60)
        assert game.returncode == 2 and expected in err.decode(), err


@pytest.mark.parametrize(("preset_name", "modes"), [("smoke", "all"), ("quick", "default")])
def test_preset_measures_every_mode_and_configuration(tmp_path: Path, preset_name: str, modes: str) -> None:
    pytest.importorskip("godot_rl.core.godot_env", reason="the baseline needs `pip install --no-deps godot-rl==0.8.2`")
    out = tmp_path / f"{preset_name}.json"
    args = ["--preset", preset_name, "--out", str(out), "--timeout", "150"]
    if modes == "all":
        args += ["--modes", "all"]
    stdout = run_benchmark("benchmarks.run", *args, timeout=900)
    result = json.loads(out.read_text())
    preset = PRESETS[preset_name]
    modes_run = list(MODES) if modes == "all" else list(DEFAULT_MODES)
    assert {(row["config"]["label"], row["mode"]) for row in result["summary"]} == {
        (config.label, mode) for config in preset.configs for mode in modes_for(config, modes_run)
    }
    for row in result["summary"]:
        what = f"{row['config']['label']} / {row['mode']}"
        assert row["agent_steps_per_s"] > 0 and row["steps_per_s"] > 0, what
        assert row["latency_mean_ms"] > 0 and row["latency_p99_ms"] > 0, what
        assert row["game_bytes_per_step"] > 0 and row["cpu_us_per_step_total"] > 0, what
        per_policy = row["mode"] in PER_POLICY_MODES
        assert row["trainers"] == (row["config"]["policies"] if per_policy else 1), what
        cpu = row["cpu_us_per_agent_step"]  # every process's CPU per agent-step, by kind
        assert cpu["game"] > 0 and cpu["trainers"] > 0, what
        assert (cpu["middle"] > 0) == (row["mode"] in MIDDLE_MODES), what
        assert cpu["total"] == pytest.approx(cpu["game"] + cpu["middle"] + cpu["trainers"]), what
        if row["mode"] in BROKER_MODES:
            assert row["broker_peak_rss_mb"] > 0 and row["broker_cpu_cores"] >= 0, what
        assert row["x_godot_rl"] > 0 and row["x_raw" if row["mode"] != "raw" else "x_relay"] > 0, what
    # Every x_godot_rl is against the faster of godot_rl's two ways, which itself stands at 1.
    for config in preset.configs:
        ways = [r for r in result["summary"] if r["config"] == config.to_json() and r["mode"] in GODOT_RL_MODES]
        assert max(r["x_godot_rl"] for r in ways) == pytest.approx(1.0), config.label
    assert [t["goal"] for t in result["targets"]] == [0.8, 0.6, 1.2, 1.0, 1.5, 2.0, 3.0, 10.0, 0.5, 0.8, 3.0]
    measured = {config.label for config in preset.configs}
    for target in result["targets"]:  # every target of a configuration in the run is measured (never judged here)
        assert (target["ratio"] is not None and target["ratio"] > 0) == (target["config"] in measured), target
    assert "targets:" in stdout and "agent-steps/s" in stdout


def test_before_after_harness_runs_both_trees_and_pairs_their_rounds(tmp_path: Path) -> None:
    """benchmarks.ab_core: the older tree (here HEAD itself, which every checkout has) runs this tree's benchmarks in
    a temporary worktree, built as this tree was (compiled or not); every configuration and mode gets a figure
    from both trees in every round, paired."""
    table = tmp_path / "ab.md"
    args = ["--old", "HEAD", "--rounds", "2", "--config", "2,vec8,1,1", "--modes", "broker_tcp,inprocess"]
    run_benchmark("benchmarks.ab_core", *args, "--measure", "1", "--markdown", str(table), timeout=900)
    said, _, header, _, *lines = table.read_text().splitlines()
    built = str(compiled.active()).lower()
    assert said == f"Compiled per-step modules: before {built}, after {built}.", said
    assert header.startswith("| configuration | mode |"), header
    rows = [line.split(" | ") for line in lines]
    assert sorted(row[1] for row in rows) == ["broker_tcp", "inprocess"], table.read_text()
    for row in rows:
        before, after = (float(cell.replace(",", "")) for cell in row[2:4])
        assert before > 0 and after > 0, row
        assert len(row[5].split(", ")) == 2, row  # one paired ratio per round
    worktrees = subprocess.run(["git", "-C", str(ROOT), "worktree", "list"], capture_output=True, text=True).stdout
    assert "ab_core-" not in worktrees  # the temporary worktree is gone


def test_trainers_in_one_process_report_whole_lines() -> None:
    """In-process trainers (a thread per policy) end their windows together; each report must still reach the
    orchestrator as a whole JSON line, or it waits for a result that never parses."""
    program = (
        "import threading\n"
        "from benchmarks.measure import emit\n"
        "def report(who):\n"
        "    for i in range(300):\n"
        "        emit({'event': 'result', 'who': who, 'i': i, 'pad': 'x' * 20000})\n"
        "threads = [threading.Thread(target=report, args=(w,)) for w in ('p0', 'p1')]\n"
        "[t.start() for t in threads]\n"
        "[t.join() for t in threads]\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, env=python_env(), cwd=ROOT, timeout=60
    )
    assert out.returncode == 0, out.stderr
    events = [json.loads(line) for line in out.stdout.splitlines()]
    assert sorted((e["who"], e["i"]) for e in events) == sorted((w, i) for w in ("p0", "p1") for i in range(300))


def test_hotpath_measures_each_side_and_moves_the_servers_bytes() -> None:
    """The in-memory profile of a lock-step (benchmarks/hotpath.py) runs every side through the real sans-IO
    connections and hub; the broker's frames are the server's (send_buffers, joined), as many bytes as the
    batch's arrays at least."""
    out = run_benchmark(
        "benchmarks.hotpath", "--agents", "40", "--obs", "vec64", "--policies", "2", "--steps", "30", timeout=120
    )
    lines = out.strip().splitlines()
    assert "broker path" in lines[0] and "raw one-hop" in lines[0]
    figures = dict(
        (part.rsplit(" ", 1)[0].strip(), float(part.rsplit(" ", 1)[1].replace(",", "")))
        for part in lines[1].split(":", 1)[1].split(", ")
    )
    assert figures["broker us"] > 0 and figures["game us"] > 0 and figures["trainers us"] > 0
    assert figures["broker->trainer frames"] == 2.0 and figures["game->broker frames"] == 1.0
    assert figures["broker->trainer bytes"] > 2 * 40 * 64 * 4  # two policies' observation rows


def test_wakeup_cost_times_every_transport_and_reader() -> None:
    """benchmarks/wakeup_cost.py measures a send to a reader asleep in recv and to one polling, over TCP and a
    Unix socket: one row per case, each with a positive CPU figure and round trip."""
    out = run_benchmark("benchmarks.wakeup_cost", "--rounds", "200", "--sizes", "80,4096", timeout=120)
    said, *table = out.splitlines()
    assert said.startswith("idle cores: driver "), said
    rows = [line.strip("|").split("|") for line in table[2:]]
    cases = {(cells[0].strip(), cells[1].strip(), cells[2].strip()) for cells in rows}
    assert cases == {(t, r, s) for t in ("tcp", "unix") for r in ("blocked", "polling") for s in ("80", "4,096")}
    for cells in rows:
        send_us, trip_us = float(cells[3]), float(cells[4])
        assert 0 < send_us and trip_us > 0


def _wake_up_often(rounds: int = 300) -> None:
    """Ping-pong with a thread asleep in recv: each round trip leaves a core idle and wakes it again."""
    left, right = socket.socketpair()

    def echo() -> None:
        while data := right.recv(1):
            right.sendall(data)

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    for _ in range(rounds):
        left.sendall(b"x")
        assert left.recv(1) == b"x"
    left.close()
    thread.join(timeout=10)
    right.close()


def test_idle_polling_keeps_every_core_out_of_deeper_idle_states_until_released() -> None:
    """benchmarks/idle.py: while the CPU latency request of 0 us is held, the kernel says so and no core enters
    an idle state deeper than the shallowest (POLL on x86), however often threads sleep and wake; afterwards the
    request is gone. Without the right to hold it (not root, not Linux) the refusal says what is needed."""
    if not os.access(QOS_DEVICE, os.W_OK):
        with pytest.raises(IdlePollingUnavailable, match="needs Linux and root"), hold_idle_polling():
            pass
        return
    assert qos_latency_us() != 0, "another process holds the CPU latency request: this test cannot tell"
    if not request_keeps_cores_polling():  # no cpuidle driver: the request would change nothing, and says so
        with pytest.raises(IdlePollingUnavailable, match="no cpuidle driver"), hold_idle_polling():
            pass
        assert qos_latency_us() != 0  # refused, and nothing left held
        return
    with hold_idle_polling():
        assert qos_latency_us() == 0
        time.sleep(0.05)  # a core halted when the request came leaves that state at its next wake-up
        before = idle_state()
        _wake_up_often()
        during = entries_between(before, idle_state())
    assert qos_latency_us() != 0
    if during:  # a cpuidle driver's states (none to read where idle=poll keeps cores polling without one)
        shallowest, *deeper = during  # in the kernel's order, shallowest first
        assert during[shallowest] > 0 and all(during[name] == 0 for name in deeper), during


def test_idle_polling_is_refused_where_the_kernel_would_not_heed_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Without a cpuidle driver a CPU latency request changes nothing (idle cores halt in the kernel's default
    idle routine), so holding one is refused with that reason, and nothing is left held; with a driver, or where
    idle=poll keeps the cores polling anyway, it is held until the block ends. (Files stand in for the kernel's.)"""
    device = tmp_path / "cpu_dma_latency"
    device.write_bytes(struct.pack("=i", 2_000_000_000))
    cpuidle = tmp_path / "cpuidle"
    cpuidle.mkdir()
    (cpuidle / "current_driver").write_text("none\n")
    cmdline = tmp_path / "cmdline"
    cmdline.write_text("console=ttyS0 quiet\n")
    monkeypatch.setattr(idle, "QOS_DEVICE", device)
    monkeypatch.setattr(idle, "CPUIDLE", cpuidle)
    monkeypatch.setattr(idle, "KERNEL_COMMAND_LINE", cmdline)

    def held() -> int:
        return int(struct.unpack("=i", device.read_bytes()[:4])[0])

    with pytest.raises(IdlePollingUnavailable, match="no cpuidle driver"), hold_idle_polling():
        pass
    assert held() == 2_000_000_000  # refused before anything was asked of the kernel
    cmdline.write_text("console=ttyS0 idle=poll quiet\n")
    with hold_idle_polling():
        assert held() == 0
    cmdline.write_text("console=ttyS0 quiet\n")
    (cpuidle / "current_driver").write_text("haltpoll\n")
    device.write_bytes(struct.pack("=i", 2_000_000_000))
    with hold_idle_polling():
        assert held() == 0


class _LookCounter:
    """A socket that counts the looks made without blocking (``MSG_DONTWAIT``) and how many found nothing."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.looks = 0
        self.empty = 0

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        if flags & socket.MSG_DONTWAIT:
            self.looks += 1
            try:
                return self.sock.recv_into(buffer, nbytes, flags)
            except BlockingIOError:
                self.empty += 1
                raise
        return self.sock.recv_into(buffer, nbytes, flags)


def test_a_game_waiting_as_godot_does_looks_sleeps_and_looks_again_until_its_answer_comes() -> None:
    """``--godot-wait``: the lean games wait for each answer as sync.gd does (look without blocking, sleep
    10 us, look again), never blocked in ``recv``; the frame read is the one sent, whenever it comes."""
    game_side, trainer_side = socket.socketpair()
    looks = _LookCounter(game_side)
    reader = FrameReader(looks, godot_wait=True)  # type: ignore[arg-type]
    body = b"actions for tick 7"
    sender = threading.Timer(0.05, lambda: trainer_side.sendall(HEADER.pack(len(body)) + body))
    sender.start()
    try:
        assert bytes(reader.read_frame()) == body
        assert looks.empty >= 2 and looks.looks == looks.empty + 1  # it looked, slept, looked again, then read it
        trainer_side.sendall(HEADER.pack(len(body)) + body)  # already there: read at the first look
        before = looks.looks
        assert bytes(reader.read_frame()) == body and looks.looks == before + 1
    finally:
        sender.join()
        game_side.close()
        trainer_side.close()


def test_benchmark_runs_every_mode_with_games_waiting_as_godot_does_when_asked(tmp_path: Path) -> None:
    """``benchmarks.run --godot-wait`` runs every game of every mode (the plugin game godot_rl serves, the native
    game of the broker's modes and of both ceilings) waiting as a Godot game does, and says so."""
    pytest.importorskip("godot_rl.core.godot_env", reason="the baseline needs `pip install --no-deps godot-rl==0.8.2`")
    out = tmp_path / "godot_wait.json"
    modes = "godot_rl_per_policy,broker_tcp,broker_plugin,inprocess,raw,relay,inprocess_ceiling"
    args = ["--config", "2,vec8,2,1", "--modes", modes, "--measure", "0.5", "--out", str(out), "--godot-wait"]
    stdout = run_benchmark("benchmarks.run", *args, timeout=600)
    result = json.loads(out.read_text())
    assert result["game_wait"] == "godot"
    assert {row["mode"] for row in result["summary"]} == set(modes.split(","))
    assert all(row["agent_steps_per_s"] > 0 and row["cpu_us_per_agent_step"]["game"] > 0 for row in result["summary"])
    assert "games wait as Godot's do (--godot-wait)" in stdout
    refused = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--godot-wait", "--world-game", "--config", "1,vec8,1,1"],
        capture_output=True,
        text=True,
        env=python_env(),
        cwd=ROOT,
        timeout=120,
    )
    assert refused.returncode == 2 and "--godot-wait is for the lean games" in refused.stderr


def test_benchmark_runs_every_mode_with_idle_cores_polling_when_asked(tmp_path: Path) -> None:
    """``benchmarks.run --idle-poll`` holds the idle cores polling for the whole run and says so in its JSON and
    table, with how often the cores entered each idle state meanwhile; where it may not, it refuses with why."""
    out = tmp_path / "idle.json"
    args = ["--config", "2,vec8,1,1", "--modes", "raw,broker_tcp", "--measure", "0.5", "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", *args, "--idle-poll"],
        capture_output=True,
        text=True,
        env=python_env(),
        cwd=ROOT,
        timeout=600,
    )
    if not os.access(QOS_DEVICE, os.W_OK):
        assert proc.returncode == 2 and "idle polling needs Linux and root" in proc.stderr, proc.stderr
        return
    if not request_keeps_cores_polling():
        assert proc.returncode == 2 and "no cpuidle driver" in proc.stderr, proc.stderr
        return
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["idle_poll"] is True
    assert {row["mode"] for row in result["summary"]} == {"raw", "broker_tcp"}
    assert all(row["agent_steps_per_s"] > 0 for row in result["summary"])
    entries = result["machine"]["idle_entries_during_run"]
    if entries:  # only the shallowest idle state, in the kernel's order
        shallowest, *deeper = entries
        assert entries[shallowest] > 0 and all(entries[name] == 0 for name in deeper), entries
    assert "idle cores: held polling (--idle-poll)" in proc.stdout
    assert qos_latency_us() != 0  # released with the run
