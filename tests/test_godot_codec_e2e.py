"""A game speaking the Godot addon's codec (Variant bodies) and a msgpack game share one broker process
over loopback; one trainer per policy (BrokerVecEnv) drives both. Every observation carries its game's tag,
its agent index and its tick, every action is computed from them, so a value that reaches the wrong game,
agent or tick shows up as a mismatch. Episode ends (final obs, infos) cross the Godot codec too."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from broker.protocol.codec import BodyKind
from broker.protocol.messages import StepData
from broker.protocol.spaces import (
    BoxSpace,
    ContinuousAction,
    DiscreteAction,
    DiscreteSpace,
    GroupSpec,
    PolicySpaces,
)
from clients.errors import BrokerError
from clients.game import GameClient
from clients.vec_env import BrokerVecEnv
from tests.helpers import broker_process

TICKS = 30  # actions each game receives
N_MOVERS, N_PICKERS = 2, 3
PHASES, CHOICES = 7, 5
MOVER = PolicySpaces((("obs", BoxSpace((3,), "float32", -100.0, 100.0)),), (("move", ContinuousAction(2)),))
PICKER = PolicySpaces(
    (("obs", BoxSpace((2,), "float32", -100.0, 100.0)), ("phase", DiscreteSpace(PHASES))),
    (("pick", DiscreteAction(CHOICES)),),
)
GROUPS = [GroupSpec("mover", N_MOVERS, MOVER), GroupSpec("picker", N_PICKERS, PICKER)]
GAMES = {1: BodyKind.GODOT, 2: BodyKind.MSGPACK}  # game tag -> codec


# --- what the trainers compute, and so what each game must receive --------------------------------


def mover_action(obs: np.ndarray) -> np.ndarray:
    """[tag/10 + agent/100, (tick % 10)/10] from rows [tag, agent, tick]."""
    return np.stack([obs[:, 0] / 10 + obs[:, 1] / 100, (obs[:, 2] % 10) / 10], axis=1).astype(np.float32)


def picker_action(obs: np.ndarray, phase: np.ndarray) -> np.ndarray:
    return ((obs[:, 0].astype(np.int64) * 3 + obs[:, 1].astype(np.int64) + phase) % CHOICES).astype(np.int64)


# --- one game ------------------------------------------------------------------------------------


class TaggedGame:
    """Observations [tag, agent, tick]; mover 0 terminates every 5 ticks, picker 1 is truncated every 7."""

    def __init__(self, tag: int) -> None:
        self.tag = tag
        self.tick = 0

    def observe(self) -> dict[str, StepData]:
        mover_obs = np.array([[self.tag, a, self.tick] for a in range(N_MOVERS)], np.float32)
        picker_obs = np.array([[self.tag, a] for a in range(N_PICKERS)], np.float32)
        phase = np.full(N_PICKERS, self.tick % PHASES, np.int32)
        terminated = np.zeros(N_MOVERS, bool)
        truncated = np.zeros(N_PICKERS, bool)
        mover = StepData({"obs": mover_obs}, np.full(N_MOVERS, 0.5, np.float32), terminated, np.zeros(N_MOVERS, bool))
        picker = StepData(
            {"obs": picker_obs, "phase": phase}, np.zeros(N_PICKERS, np.float32), np.zeros(N_PICKERS, bool), truncated
        )
        if self.tick and self.tick % 5 == 0:  # mover 0's episode ended on a marked observation
            terminated[0] = True
            mover = replace(
                mover,
                final_index=np.array([0], np.int32),
                final_obs={"obs": np.array([[self.tag, 0, -1]], np.float32)},
                infos={0: {"is_success": True, "tag": self.tag}},
            )
        if self.tick and self.tick % 7 == 0:
            truncated[1] = True
            picker = replace(
                picker,
                final_index=np.array([1], np.int32),
                final_obs={"obs": np.array([[self.tag, -1]], np.float32), "phase": np.array([0], np.int32)},
            )
        return {"mover": mover, "picker": picker}


def run_game(address: str, tag: int, report: dict[str, Any]) -> None:
    game = TaggedGame(tag)
    client = GameClient(address, GROUPS, name=f"tagged-{tag}", codec=GAMES[tag], timeout_connect=30)
    report.update(game_index=client.game_index, codec=client.socket.connection.codec.value, checked={}, held=0)
    checked: dict[str, int] = report["checked"]
    mismatches: list[str] = report.setdefault("mismatches", [])
    try:
        for _ in range(TICKS):
            sent = game.observe()
            actions = client.step(sent)
            fresh = report["held"] == 0  # after a held tick, an action may answer an older tick
            for policy in ("mover", "picker"):
                if policy not in actions:
                    report["held"] += 1  # held: the agents keep their previous action
                    continue
                got = actions[policy]
                if policy == "mover":
                    expected = mover_action(sent["mover"].obs["obs"])
                    columns = slice(None) if fresh else slice(0, 1)
                    ok = got["move"].shape == (N_MOVERS, 2) and np.allclose(
                        got["move"][:, columns], expected[:, columns], atol=1e-6
                    )
                else:
                    expected = picker_action(sent["picker"].obs["obs"], sent["picker"].obs["phase"])
                    ok = got["pick"].shape == (N_PICKERS,) and (not fresh or bool((got["pick"] == expected).all()))
                if not ok:
                    mismatches.append(f"tick {game.tick} {policy}: got {got}, expected {expected}")
                checked[policy] = checked.get(policy, 0) + 1
            game.tick += 1
    finally:
        client.close()


# --- one trainer ---------------------------------------------------------------------------------


def run_trainer(address: str, policy: str, report: dict[str, Any]) -> None:
    env = BrokerVecEnv(policy, address, timeout_connect=30)
    problems: list[str] = report.setdefault("problems", [])
    report.update(n_envs=env.num_envs, episode_ends=0, successes=0)
    layout = [(g.game_index, g.offset, g.n_agents) for g in env.policy_info.games]
    report["layout"] = layout
    try:
        obs: Any = env.reset()
        assert isinstance(obs, dict)
        report["tags"] = {game_index: int(obs["obs"][offset, 0]) for game_index, offset, _ in layout}
        for step in range(TICKS):
            assert isinstance(obs, dict)
            for game_index, offset, n in layout:  # every row in its game's block, in agent order
                rows = obs["obs"][offset : offset + n]
                if len(set(rows[:, 0].tolist())) != 1 or rows[:, 1].tolist() != list(range(n)):
                    problems.append(f"step {step}: game {game_index} rows {rows.tolist()}")
            if policy == "mover":
                actions = mover_action(obs["obs"])
            else:
                actions = picker_action(obs["obs"], obs["phase"])
            if step == TICKS - 1:  # the games' last actions; no batch follows them
                env.step_async(actions)
                break
            obs, _, dones, infos = env.step(actions)
            for row in np.flatnonzero(dones).tolist():
                report["episode_ends"] += 1
                final = infos[row]["terminal_observation"]["obs"]
                if final[-1] != -1 or final[0] != obs["obs"][row, 0]:
                    problems.append(f"step {step}: row {row} final obs {final.tolist()}")
                report["successes"] += int(infos[row].get("is_success", False))
                truncated = infos[row]["TimeLimit.truncated"]
                if truncated != (policy == "picker"):
                    problems.append(f"step {step}: row {row} truncated={truncated}")
    finally:
        env.close()


def test_godot_codec_game_and_msgpack_game_share_a_broker(tmp_path: Path) -> None:
    reports: dict[str, dict[str, Any]] = {}
    errors: list[str] = []

    def guarded(name: str, target: Any, *args: Any) -> threading.Thread:
        def run() -> None:
            try:
                target(*args, reports.setdefault(name, {}))
            except (BrokerError, AssertionError, OSError) as exc:
                errors.append(f"{name}: {exc!r}")

        return threading.Thread(target=run, name=name, daemon=True)

    with broker_process(tmp_path, "--stepping", "barrier", "--games", "2") as (_, address):
        threads = [guarded(f"game{tag}", run_game, address, tag) for tag in GAMES]
        threads += [guarded(policy, run_trainer, address, policy) for policy in ("mover", "picker")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        hung = [t.name for t in threads if t.is_alive()]
    assert not hung and not errors, (hung, errors, reports)
    assert {reports[f"game{tag}"]["codec"] for tag in GAMES} == {"godot", "msgpack"}
    assert sorted(reports[f"game{tag}"]["game_index"] for tag in GAMES) == [0, 1]
    for tag in GAMES:
        game = reports[f"game{tag}"]
        assert game["mismatches"] == [], game
        assert game["checked"]["mover"] + game["held"] >= TICKS and game["checked"]["picker"] >= 1
    mover, picker = reports["mover"], reports["picker"]
    assert mover["problems"] == [] and picker["problems"] == [], (mover, picker)
    assert mover["n_envs"] == 2 * N_MOVERS and picker["n_envs"] == 2 * N_PICKERS
    game_of_tag = {reports[f"game{tag}"]["game_index"]: tag for tag in GAMES}
    assert mover["tags"] == game_of_tag and picker["tags"] == game_of_tag  # rows sit in their game's block
    # Ticks 5, 10, ... 25 end mover 0 in both games; ticks 7, 14, 21, 28 truncate picker 1.
    assert mover["episode_ends"] == 2 * 5 and mover["successes"] == 2 * 5
    assert picker["episode_ends"] == 2 * 4
