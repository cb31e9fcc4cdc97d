"""Unmodified godot_rl plugin games (the JSON protocol, played by clients.plugin_emulator) on the broker's
one port, over real loopback sockets: beside native games, trained by BrokerVecEnv trainers."""

from __future__ import annotations

import json
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from broker.legacy.godot_rl_game import GodotRlGame
from broker.legacy.wire import MessageDecoder
from broker.protocol.connection import GREETING
from broker.protocol.messages import GameActions, GameStep, Hello, StepData
from broker.protocol.spaces import GroupSpec
from clients.errors import BrokerError
from clients.game import GameClient
from clients.inprocess import InProcessBroker
from clients.plugin_emulator import EmulatorConfig, PluginEmulator, PolicyGroup, policy_spaces
from clients.vec_env import BrokerVecEnv
from tests.helpers import broker_process, spawn_python


@contextmanager
def emulator_thread(config: EmulatorConfig) -> Iterator[tuple[PluginEmulator, list[BaseException]]]:
    """A plugin game on a thread; yields it and the errors it raised (checked by the caller)."""
    emulator = PluginEmulator(config)
    errors: list[BaseException] = []

    def play() -> None:
        try:
            emulator.run()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=play, name="plugin-emulator", daemon=True)
    thread.start()
    try:
        yield emulator, errors
    finally:
        thread.join(timeout=20)
        emulator.close()
        assert not thread.is_alive(), "the plugin emulator did not finish"


def step(env: BrokerVecEnv, actions: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, list[Any]]:
    env.step_async(actions)
    obs, reward, done, infos = env.step_wait()
    assert isinstance(obs, dict)
    return obs, reward, done, infos


# --- training ---------------------------------------------------------------------------------------


def test_plugin_game_with_two_policy_names_trains_two_policies(tmp_path: Path) -> None:
    with broker_process(tmp_path, "--stepping", "barrier") as (_, address):
        port = address.rsplit(":", 1)[1]
        game = spawn_python(
            "-m",
            "clients.plugin_emulator",
            f"--port={port}",
            "--policies=runner:3:continuous,turner:3:discrete",
            "--interleave",  # Godot order: runner, turner, runner, turner, ...
            "--game_id=7",
            "--horizon=30",
            "--terminal_obs_info",
            stdout=subprocess.PIPE,
        )
        trainers = {
            policy: spawn_python(
                "-m", "tests.scripts.legacy_ppo_trainer", "--address", address, "--policy", policy,
                "--timesteps", "3000", "--report", str(tmp_path / f"{policy}.json"),
            )
            for policy in ("runner", "turner")
        }  # fmt: skip
        try:
            codes = {policy: proc.wait(timeout=300) for policy, proc in trainers.items()}
        finally:
            for proc in trainers.values():
                if proc.poll() is None:
                    proc.kill()
    # The broker stopped: it told the plugin game to close, and the game quit by itself.
    out, _ = game.communicate(timeout=30)
    assert codes == {"runner": 0, "turner": 0}
    assert game.returncode == 0 and json.loads(out)["closed_by_broker"] is True
    runner = json.loads((tmp_path / "runner.json").read_text())
    turner = json.loads((tmp_path / "turner.json").read_text())
    for report in (runner, turner):
        assert report["n_envs"] == 3 and report["timesteps"] >= 3000
        assert report["episodes"] > 10 and report["reward_std"] > 0.01
        assert {round(row[0], 4) for row in report["first_obs"]["obs"]} == {0.07}  # game id 7
    # Agent indices in Godot's order prove the split by agent_policy_names.
    assert [round(row[1] * 100) for row in runner["first_obs"]["obs"]] == [0, 2, 4]
    assert [round(row[1] * 100) for row in turner["first_obs"]["obs"]] == [1, 3, 5]
    assert runner["action_space"].startswith("Box") and turner["action_space"].startswith("Discrete")


# --- routing and formats ----------------------------------------------------------------------------


def native_game(address: str, spaces_group: GroupSpec, stop: threading.Event, errors: list[BaseException]) -> None:
    """A native game whose observations say who it is (game code 0.5) and echo its agents' last action."""
    try:
        client = GameClient(address, [spaces_group], name="native")
        n = spaces_group.n_agents
        echo = np.zeros(n, np.float32)
        while not stop.is_set():
            obs = np.zeros((n, 8), np.float32)
            obs[:, 0], obs[:, 1], obs[:, 2] = 0.5, np.arange(n) / 100, echo
            zeros = np.zeros(n, np.bool_)
            actions = client.step({spaces_group.policy: StepData({"obs": obs}, np.zeros(n, np.float32), zeros, zeros)})
            echo = actions[spaces_group.policy]["move"][:, 0].copy()
    except BrokerError as exc:
        if exc.code not in ("closed", "connection_lost"):
            errors.append(exc)
    except BaseException as exc:
        errors.append(exc)


def test_plugin_and_native_games_share_the_port_and_one_policy(
    inprocess_broker: Callable[..., InProcessBroker],
) -> None:
    broker = inprocess_broker(expected_games=2, stepping="barrier")
    config = EmulatorConfig(groups=(PolicyGroup("shared", 3, "mixed"),), port=broker.server.port, game_id=7)
    native_spec = GroupSpec("shared", 2, policy_spaces(config, "shared"))
    stop = threading.Event()
    native_errors: list[BaseException] = []
    native = threading.Thread(target=native_game, args=(broker.address, native_spec, stop, native_errors))
    native.start()
    with emulator_thread(config) as (emulator, errors):
        env = broker.vec_env("shared")
        assert env.num_envs == 5 and str(env.action_space) == "Box(-1.0, 1.0, (3,), float32)"  # move(2) + jump
        obs = env.reset()
        assert isinstance(obs, dict)
        who = {(round(float(o[0]), 2), round(float(o[1]) * 100)) for o in obs["obs"]}
        assert who == {(0.07, 0), (0.07, 1), (0.07, 2), (0.5, 0), (0.5, 1)}
        for game in env.policy_info.games:  # each game's rows are contiguous, at the announced offset
            rows = obs["obs"][game.offset : game.offset + game.n_agents]
            assert len({float(r[0]) for r in rows}) == 1
            assert [round(float(r[1]) * 100) for r in rows] == list(range(game.n_agents))
        for t in range(1, 6):
            move = (np.arange(5) + 1) / 10 * (-1) ** t  # a different action for every row, every step
            actions = np.stack([move, -move, np.where(np.arange(5) % 2 == 0, 1.0, -1.0)], axis=1)
            obs, _, _, _ = step(env, actions.astype(np.float32))
            np.testing.assert_allclose(obs["obs"][:, 2], move, atol=1e-6)  # each agent echoes its own action
        env.close()
        stop.set()
        broker.close()
    native.join(timeout=20)
    assert not errors and not native_errors, (errors, native_errors)
    assert emulator.stats.steps == 5 and emulator.stats.closed_by_broker


def test_older_plugin_variant_with_a_token_required(inprocess_broker: Callable[..., InProcessBroker]) -> None:
    # Plugin games carry no token; over loopback they are still welcome when the broker asks for one.
    broker = inprocess_broker(token="s3cret", stepping="barrier")
    config = EmulatorConfig(
        groups=(PolicyGroup("shared_policy", 3, "discrete"),), variant="old", port=broker.server.port, game_id=3
    )
    with emulator_thread(config) as (emulator, errors):
        env = broker.vec_env("shared_policy")
        first = env.reset()
        assert isinstance(first, dict)
        assert [round(float(o[1]) * 100) for o in first["obs"]] == [0, 1, 2]
        for t in range(4):
            obs, reward, _, _ = step(env, np.array([0, 1, 2]) if t % 2 else np.array([2, 2, 0]))
            np.testing.assert_allclose(obs["obs"][:, 2], [0.0, 0.1, 0.2] if t % 2 else [0.2, 0.2, 0.0], atol=1e-6)
        assert reward.dtype == np.float32
        env.close()
        broker.close()
    assert not errors and emulator.stats.closed_by_broker
    assert emulator.stats.messages[:4] == ["handshake", "env_info", "reset", "action"]


def test_images_sent_as_hex_reach_the_trainer_as_uint8(inprocess_broker: Callable[..., InProcessBroker]) -> None:
    broker = inprocess_broker(stepping="barrier")
    config = EmulatorConfig(
        groups=(PolicyGroup("seer", 2, "discrete"),),
        image_key="front_2d",
        image_shape=(3, 6, 5),
        port=broker.server.port,
        game_id=9,
    )
    pattern = (np.arange(90) * 7 % 256).astype(np.uint8)
    with emulator_thread(config) as (_, errors):
        env = broker.vec_env("seer")
        space = env.observation_space["front_2d"]  # type: ignore[index]
        assert space.dtype == np.uint8 and space.shape == (3, 6, 5) and space.high.max() == 255
        obs = env.reset()
        assert isinstance(obs, dict)
        for tick in range(4):
            images = obs["front_2d"]
            assert images.dtype == np.uint8 and images.shape == (2, 3, 6, 5)
            flat = images.reshape(2, -1)
            assert flat[:, :3].tolist() == [[9, 0, tick], [9, 1, tick]]  # game, agent, tick
            assert (flat[:, 3:] == pattern[3:]).all()
            obs, _, _, _ = step(env, np.array([1, 1]))
        env.close()
        broker.close()
    assert not errors


# --- hold: the adapter against the emulator, over a real socket pair ---------------------------------


def test_held_groups_repeat_last_actions_to_a_plugin_game() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    config = EmulatorConfig(
        groups=(PolicyGroup("a", 2, "continuous"), PolicyGroup("b", 2, "discrete")), port=port, interleave=True
    )
    with emulator_thread(config) as (emulator, errors):
        conn, _ = listener.accept()
        decoder = MessageDecoder()

        def receive() -> dict[str, Any]:
            while (message := decoder.next_message()) is None:
                decoder.feed(conn.recv(65536))
            return message

        adapter = GodotRlGame()
        conn.sendall(GREETING)
        hello = adapter.receive(receive())
        assert isinstance(hello, Hello) and [g.policy for g in hello.groups] == ["a", "b"]
        conn.sendall(adapter.reset_request())
        assert isinstance(adapter.receive(receive()), GameStep)

        def act(tick: int, groups: dict[str, dict[str, np.ndarray]]) -> np.ndarray:
            conn.sendall(adapter.actions_request(GameActions(tick, groups)))
            result = adapter.receive(receive())
            assert isinstance(result, GameStep)
            # Godot order a, b, a, b: the echo column shows what each agent last executed.
            return np.stack([result.groups["a"].obs["obs"][:, 2], result.groups["b"].obs["obs"][:, 2]], 1).ravel()

        a_actions = {"move": np.array([[0.5, 0.0], [-0.25, 0.0]], np.float32)}
        b_actions = {"turn": np.array([2, 1], np.int32)}
        np.testing.assert_allclose(act(0, {"a": a_actions}), [0.5, 0.0, -0.25, 0.0])  # b held: zeros
        np.testing.assert_allclose(act(1, {"a": a_actions, "b": b_actions}), [0.5, 0.2, -0.25, 0.1])
        np.testing.assert_allclose(act(2, {"b": {"turn": np.array([0, 0], np.int32)}}), [0.5, 0.0, -0.25, 0.0])
        np.testing.assert_allclose(act(3, {}), [0.5, 0.0, -0.25, 0.0])  # both held
        conn.sendall(adapter.close_request())
        conn.close()
    listener.close()
    assert not errors and emulator.stats.steps == 4 and emulator.stats.closed_by_broker


# --- bad input ------------------------------------------------------------------------------------------


def raw_plugin_connection(port: int) -> socket.socket:
    """A socket that has read the broker's two greeting frames, as the plugin does."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    received = b""
    while len(received) < len(GREETING):
        received += sock.recv(len(GREETING) - len(received))
    assert received == GREETING
    return sock


def wait_closed(sock: socket.socket) -> bool:
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return False
    return True


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        (b'{"type": "env_info", "n_agents": ', "malformed"),  # cut short
        (
            b'{"type": "env_info", "n_agents": 1, "observation_space": {"o": {"size": [2], "space": "box"}}}',
            "bad_hello",
        ),
        (b'{"type": "step", "obs": []}', "unexpected_message"),  # a step before anything was asked
    ],
)
def test_malformed_plugin_messages_close_only_that_connection(tmp_path: Path, frame: bytes, code: str) -> None:
    with broker_process(tmp_path, "--stepping", "barrier", "--games", "1") as (broker, address):
        port = int(address.rsplit(":", 1)[1])
        with emulator_thread(EmulatorConfig(port=port, game_id=4)) as (emulator, errors):
            env = BrokerVecEnv("shared_policy", address)
            env.reset()
            bad = raw_plugin_connection(port)
            bad.sendall(struct.pack("<I", len(frame)) + frame)
            assert wait_closed(bad), "the broker kept a connection that sent garbage"
            bad.close()
            for _ in range(5):  # the good game and its trainer carry on
                obs, _, _, _ = step(env, np.full((4, 2), 0.3, np.float32))
            np.testing.assert_allclose(obs["obs"][:, 0], 0.04)
            env.close()
            broker.send_signal(signal.SIGTERM)  # the broker tells the game to close
            broker.wait(timeout=20)
    assert not errors and emulator.stats.steps == 5
    log = "".join(p.read_text() for p in tmp_path.glob("broker-*.log"))
    # Frame-level errors are a "peer error"; a decoded plugin message the broker refuses is told to the game first.
    errors_logged = [line for line in log.splitlines() if "peer error" in line or "godot_rl game refused" in line]
    assert len(errors_logged) == 1 and f"code={code}" in errors_logged[0], log


def test_a_plugin_game_that_drops_mid_episode_is_replaced(inprocess_broker: Callable[..., InProcessBroker]) -> None:
    broker = inprocess_broker(stepping="barrier")
    config = EmulatorConfig(groups=(PolicyGroup("p", 2, "continuous"),), port=broker.server.port, game_id=1)
    first = PluginEmulator(config)
    first.connect()
    env = broker.vec_env("p")
    done = threading.Event()

    def play_then_vanish() -> None:
        first.run(max_steps=3)
        first.close()  # the game crashed: no goodbye
        done.set()

    threading.Thread(target=play_then_vanish, daemon=True).start()
    env.reset()
    for _ in range(3):
        step(env, np.zeros((2, 2), np.float32))
    assert done.wait(10)
    time.sleep(0.2)
    config.game_id = 2
    with emulator_thread(config) as (_, errors):
        obs, _, dones, infos = step(env, np.zeros((2, 2), np.float32))
        assert dones.tolist() == [True, True] and all(i["TimeLimit.truncated"] and i["game_replaced"] for i in infos)
        np.testing.assert_allclose(obs["obs"][:, 0], 0.02)  # the new game's observations
        env.close()
        broker.close()
    assert not errors
