"""Hostile input of issue #14 (part A: decoders and validation) over real sockets, against a broker
subprocess, while a tagged game and two tagged trainers step in lock-step in their own processes; the
trainers check every row's tick (nothing lost, nothing doubled) and the game checks every action.

Each attack comes on a fresh connection and must end with a stable error code for that peer (an error frame
to native peers; godot_rl plugin games cannot read one) and a log line naming it, both short, never
``internal``: values no codec could forward again (JSON integers beyond 64 bits, lone surrogates, uint64 or
deep msgpack infos), frames whose decoding would cost too much (63 MiB of empty maps, 10^5 nesting),
discrete actions beyond int32, NaN, numeric-string rewards and hellos of other versions.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from broker.protocol.arrays import encode_array
from broker.protocol.framing import encode_frame
from tests.scripts.reliability_common import (
    PEER_ERROR_EVENTS,
    Broker,
    RawPeer,
    broker,
    log_events,
    peer_errors,
    read_report,
    spawn,
    stop,
    wait_until,
)
from tests.test_reliability_bad_input import (
    VICTIM_AGENTS,
    VictimGame,
    closed_with,
    msgpack_frame,
    next_of,
    trainer_hello,
    victim_hello,
    victim_step,
)

MAX_TEXT = 1024  # an error frame and a log line about a bad peer stay this short, whatever it sent


class TaggedWorkload:
    """Slot 0: a tagged game (movers and pickers) and a tagged trainer per policy, lock-step (barrier)."""

    def __init__(self, b: Broker, tmp_path: Path) -> None:
        self.reports = {p: tmp_path / f"{p}.json" for p in ("mover", "picker")}
        self.game_report = tmp_path / "game.json"
        game_args = ["--address", b.address, "--kind", "tagged", "--exact", "--name", "workload"]
        self.game = spawn(
            "tests.scripts.reliability_game",
            *game_args,
            "--report",
            str(self.game_report),
            log_path=tmp_path / "game.log",
        )
        self.trainers = {}
        for policy, report in self.reports.items():
            args = ["--address", b.address, "--policy", policy, "--mode", "tagged", "--stepping", "barrier"]
            self.trainers[policy] = spawn(
                "tests.scripts.reliability_trainer", *args, "--report", str(report), log_path=tmp_path / f"{policy}.log"
            )

    def steps(self) -> dict[str, int]:
        return {p: int(read_report(r).get("steps", 0)) for p, r in self.reports.items()}

    def advances(self, since: dict[str, int], by: int = 5, timeout: float = 90) -> dict[str, int]:
        wait_until(lambda: all(n >= since[p] + by for p, n in self.steps().items()), timeout, "the workload to step")
        return self.steps()

    def stop(self) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
        codes = {p: stop(proc) for p, proc in self.trainers.items()}
        reports = {p: read_report(r) for p, r in self.reports.items()}
        stop(self.game)
        assert codes == {"mover": 0, "picker": 0}, reports
        return reports, read_report(self.game_report)


@pytest.fixture
def attacked(tmp_path: Path) -> Iterator[tuple[Broker, TaggedWorkload]]:
    args = ("--games", "2", "--timeout-hello", "5", "--status-interval", "0", "--log-json")
    with broker(tmp_path, *args) as b:
        workload = TaggedWorkload(b, tmp_path)
        try:
            yield b, workload
        finally:
            for proc in (*workload.trainers.values(), workload.game):
                stop(proc)


def is_peer_error(line: str) -> bool:
    return any(f'"{event}"' in line for event in PEER_ERROR_EVENTS)


def logged(b: Broker, peer: RawPeer, code: str) -> dict[str, Any]:
    events = wait_until(lambda: peer_errors(b.log(), peer), 15, f"the log line for {code}")
    assert events[0]["code"] == code, events
    line = next(line for line in b.log().splitlines() if f'"{peer.label}"' in line and is_peer_error(line))
    assert len(line) <= MAX_TEXT, len(line)
    return events[0]


def welcomed(b: Broker, hello: dict[str, Any]) -> RawPeer:
    """``session``, retried while the slot or policy of the previous peer is not yet released."""

    def attempt() -> RawPeer | None:
        peer = RawPeer(b.address)
        peer.read_greeting()
        peer.send_message(hello)
        answer = peer.read_message()
        if answer is not None and answer["type"] == "welcome":
            return peer
        peer.close()
        assert answer is not None and answer.get("code") in ("broker_full", "policy_taken"), answer
        return None

    peer: RawPeer = wait_until(attempt, 15, "a free slot or policy", interval=0.2)
    return peer


def refused_after_hello(b: Broker, hello: dict[str, Any], frame: bytes, code: str) -> str:
    """A native peer says ``hello``, is welcomed, then sends ``frame``: error ``code``, short, logged."""
    peer = welcomed(b, hello)
    started = time.monotonic()
    peer.send(frame)
    message = closed_with(peer, b, code)
    print(f"  {code}: answered {time.monotonic() - started:.2f} s after a {len(frame) / 2**20:.1f} MiB frame")
    assert len(message) <= MAX_TEXT
    logged(b, peer, code)
    return message


def batch_for_attacker(b: Broker) -> tuple[RawPeer, dict[str, Any]]:
    attacker = welcomed(b, trainer_hello("victim"))
    next_of(attacker, "policy")
    attacker.send_message({"type": "reset"})
    return attacker, next_of(attacker, "batch")


# --- godot_rl plugin games, raw JSON -----------------------------------------------------------------


def json_frame(text: str) -> bytes:
    return encode_frame(text.encode("ascii"))


def plugin_env_info(policy: str = '"victim"') -> str:
    names = ", ".join([policy] * VICTIM_AGENTS)
    return (
        '{"type": "env_info", "n_agents": 4, '
        '"observation_space": {"obs": {"size": [3], "space": "box", "low": -10.0, "high": 10.0}}, '
        '"action_space": {"pick": {"size": 3, "action_type": "discrete"}}, '
        f'"agent_policy_names": [{names}]}}'
    )


def plugin_obs() -> str:
    return "[" + ", ".join(['{"obs": [0.0, 0.0, 0.0]}'] * VICTIM_AGENTS) + "]"


def plugin_step(info: str = "{}", reward: str = "0.0") -> str:
    rewards = ", ".join([reward] + ["0.0"] * (VICTIM_AGENTS - 1))
    infos = ", ".join([info] + ["{}"] * (VICTIM_AGENTS - 1))
    dones = ", ".join(["false"] * VICTIM_AGENTS)
    return f'{{"type": "step", "obs": {plugin_obs()}, "reward": [{rewards}], "done": [{dones}], "info": [{infos}]}}'


def plugin_refused(b: Broker, frames: list[str], code: str) -> dict[str, Any]:
    """A plugin game (in slot 1) plays ``frames`` in turn (env_info, reset reply, step replies, each after
    the broker's request); the broker must log ``code`` for it and close its connection. Retried while
    the previous game's slot is not yet released (``broker_full``)."""
    for _ in range(50):
        with RawPeer(b.address) as peer:
            greeting = peer.read_greeting()
            assert greeting[1]["type"] == "env_info"
            for i, text in enumerate(frames):
                peer.send(json_frame(text))
                if i + 1 < len(frames):
                    request = peer.read_frame()
                    if request is None:
                        break  # refused (a full broker, say): the log line says why
                    assert json.loads(request)["type"] in ("reset", "action"), request
            event = wait_until(lambda: peer_errors(b.log(), peer), 15, f"the log line for {code}")[0]
            while peer.read_frame() is not None:  # then closed
                pass
        if event["code"] != "broker_full":
            break
        time.sleep(0.2)
    assert event["code"] == code, event
    line = next(line for line in b.log().splitlines() if f'"{peer.label}"' in line and is_peer_error(line))
    assert len(line) <= MAX_TEXT, len(line)
    return event


def test_hostile_values_and_frames_are_refused_at_the_edge_while_the_workload_steps(
    attacked: tuple[Broker, TaggedWorkload],
) -> None:
    b, workload = attacked
    victim = VictimGame(b.address)  # slot 1, policy "victim": completes the layout
    steps = workload.advances({"mover": 0, "picker": 0}, by=10, timeout=120)

    # --- hellos: any other version is version_mismatch, and a megabyte of junk gives a short answer -----
    for protocol in (2, "1", None):
        bad = {**victim_hello(protocol=protocol), "role": "admin", "groups": "nonsense"}
        with RawPeer(b.address) as peer:
            peer.send(msgpack_frame(bad))
            assert peer.error_then_close()["code"] == "version_mismatch"
            logged(b, peer, "version_mismatch")
    for junk in ({"type": "x" * 1_000_000}, {**victim_hello(), "role": "y" * 1_000_000}):
        with RawPeer(b.address) as peer:
            peer.send(msgpack_frame(junk))
            error = peer.error_then_close()
            assert error["code"] in ("unknown_message", "bad_hello") and len(json.dumps(error)) <= MAX_TEXT, error
            logged(b, peer, error["code"])
    with RawPeer(b.address) as peer:  # JSON before hello: a plugin game's first frame, nested 10^5 deep
        peer.send(json_frame('{"type": ' + "[" * 100_000))
        logged(b, peer, "malformed")
    steps = workload.advances(steps)

    # --- a trainer of "victim": actions beyond int32, NaN, a 63 MiB frame of empty maps ---------------------
    for dtype in (np.int64, np.uint64):
        attacker, batch = batch_for_attacker(b)
        wide = {"pick": encode_array(np.full(VICTIM_AGENTS, 2**32 + 2, dtype))}
        attacker.send_message({"type": "act", "step": batch["step"], "actions": wide})
        assert "[0, 3)" in closed_with(attacker, b, "bad_actions")
    attacker, batch = batch_for_attacker(b)
    attacker.send_message({"type": "act", "step": batch["step"], "actions": {"pick": "x" * 1_000_000}})
    assert len(closed_with(attacker, b, "malformed")) <= MAX_TEXT
    size = 63 * 2**20
    empty_maps = encode_frame(b"\x81\xa4type\xdd" + size.to_bytes(4, "big") + b"\x80" * size)
    message = refused_after_hello(b, trainer_hello("victim"), empty_maps, "malformed")
    assert "values" in message
    many = b"\x82\xa4type\xa5reset\xa1x\xdc\xff\xff" + (b"\xdc\xff\xff" + b"\x00" * 65535) * 900
    assert "values" in refused_after_hello(b, trainer_hello("victim"), encode_frame(many), "malformed")
    honest, batch = batch_for_attacker(b)  # the open batch is still served, and answered
    ticks = victim.ticks
    for _ in range(3):
        honest.send_message({"type": "act", "step": batch["step"], "actions": {"pick": encode_array(np.ones(4, "i4"))}})
        batch = next_of(honest, "batch")
    wait_until(lambda: victim.ticks > ticks, 15, "the victim game to step")
    honest.close()
    steps = workload.advances(steps)

    # --- native games in slot 1: infos no codec could forward, NaN observations and rewards -------------------
    victim.stopping.set()  # its thread ends after the current step, so it cannot reconnect; then it leaves
    victim.thread.join(timeout=15)
    victim.client.close("victim leaves")
    assert victim.error is None
    deep: Any = 1
    for _ in range(40):
        deep = {"d": deep}
    nan_obs = victim_step(0)
    nan_obs["groups"]["victim"]["obs"]["obs"] = encode_array(np.full((VICTIM_AGENTS, 3), np.nan, np.float32))
    nan_reward = victim_step(0)
    nan_reward["groups"]["victim"]["reward"] = encode_array(np.full(VICTIM_AGENTS, np.inf, np.float32))
    uint64_info, deep_info = victim_step(0), victim_step(0)
    uint64_info["groups"]["victim"]["infos"] = {0: {"n": 2**64 - 1}}
    deep_info["groups"]["victim"]["infos"] = {1: deep}
    for step, words in [
        (uint64_info, "64 signed bits"),
        (deep_info, "deeper"),
        (nan_obs, "finite"),
        (nan_reward, "finite"),
    ]:
        assert words in refused_after_hello(b, victim_hello(), msgpack_frame(step), "bad_step")
    steps = workload.advances(steps)

    # --- godot_rl plugin games in slot 1 (JSON) --------------------------------------------------------------
    reset = f'{{"type": "reset", "obs": {plugin_obs()}}}'
    cases = [
        ([plugin_env_info('"\\ud800"')], "malformed", "surrogate"),
        ([plugin_env_info(), reset, plugin_step(info='{"big": ' + "1" * 31 + "}")], "malformed", "64 bits"),
        ([plugin_env_info(), reset, plugin_step(info='{"s": "\\ud800"}')], "malformed", "surrogate"),
        ([plugin_env_info(), reset, plugin_step(info='{"\\udc00": 1}')], "malformed", "surrogate"),
        ([plugin_env_info(), reset, plugin_step(reward="1" * 400)], "malformed", "400 digits"),
        ([plugin_env_info(), reset, plugin_step(reward='"1.5"')], "bad_step", "expected numbers"),
        ([plugin_env_info(), reset, plugin_step(reward="NaN")], "bad_step", "finite"),
        ([plugin_env_info(), reset, plugin_step(info='{"d": ' + "[" * 40 + "]" * 40 + "}")], "malformed", "deeper"),
        ([plugin_env_info(), reset, plugin_step(info='{"d": ' + "[" * 20 + "]" * 20 + "}")], "bad_step", "deeper"),
    ]
    for frames, code, words in cases:
        event = plugin_refused(b, frames, code)
        assert words in event["error"], event
    # A plugin game that plays by the rules still takes the slot and steps.
    time.sleep(0.5)  # the last refused game's slot is released
    with RawPeer(b.address) as peer:
        peer.read_greeting()
        peer.send(json_frame(plugin_env_info()))
        assert json.loads(peer.read_frame() or b"{}")["type"] == "reset"
        peer.send(json_frame(reset))
        for _ in range(3):
            assert json.loads(peer.read_frame() or b"{}")["type"] == "action"
            peer.send(json_frame(plugin_step(info='{"fine": [1, 2.5, "text", {"k": null}]}')))
    workload.advances(steps)

    assert not [e for e in log_events(b.log()) if e.get("code") == "internal" or e.get("log_level") == "error"]
    reports, game = workload.stop()
    for policy, report in reports.items():
        assert report["error"] is None and report["problems"] == [] and report["end"] == "signal", (policy, report)
    assert game["mismatches"] == 0, game
    print(f"  workload: {workload.steps()} steps per trainer, game ticks {game['ticks']}, no tick lost or doubled")
