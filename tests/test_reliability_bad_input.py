"""Bad input over real sockets: each bad peer gets a clear error frame and a log line, its connection
closes, and a game with two trainers keeps stepping through every attack; the broker's memory stays flat
over thousands of bad connections."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from broker.protocol import PROTOCOL_VERSION
from broker.protocol.arrays import encode_array
from broker.protocol.framing import encode_frame
from broker.protocol.messages import Hello, StepData
from broker.protocol.spaces import BoxSpace, DiscreteAction, GroupSpec, PolicySpaces
from clients.errors import BrokerError
from clients.game import GameClient
from tests.scripts.reliability_common import (
    Broker,
    RawPeer,
    broker,
    peer_errors,
    read_report,
    spawn,
    stop,
    wait_until,
)

VICTIM = PolicySpaces((("obs", BoxSpace((3,), "float32", -10.0, 10.0)),), (("pick", DiscreteAction(3)),))
VICTIM_AGENTS = 4
MAX_FRAME = 1 << 20
BAD_CONNECTIONS = 3000
RSS_GROWTH_LIMIT = 12 * 1024 * 1024  # allocator slack; one leaked buffer per connection would be far more


def msgpack_frame(message: dict[str, Any]) -> bytes:
    return encode_frame(msgpack.packb(message, use_bin_type=True))


def victim_hello(**changes: Any) -> dict[str, Any]:
    wire = Hello("game", PROTOCOL_VERSION, "bad-game", groups=(GroupSpec("victim", VICTIM_AGENTS, VICTIM),)).to_wire()
    wire.update(changes)
    return wire


def trainer_hello(policy: str) -> dict[str, Any]:
    return Hello("trainer", PROTOCOL_VERSION, "bad-trainer", policy=policy).to_wire()


def victim_step(tick: int, n: int = VICTIM_AGENTS, dtype: str = "float32") -> dict[str, Any]:
    data = StepData(
        {"obs": np.zeros((n, 3), dtype)}, np.zeros(n, np.float32), np.zeros(n, np.bool_), np.zeros(n, np.bool_)
    )
    return {"type": "step", "tick": tick, "groups": {"victim": data.to_wire()}}


def refused(b: Broker, payload: bytes, code: str, *, half_close: bool = False, read_greeting: bool = True) -> str:
    """Send ``payload`` on a fresh connection; the broker must answer with error ``code``, log it and close.
    Returns the error message."""
    with RawPeer(b.address) as peer:
        if read_greeting:
            assert peer.read_greeting()[0]["type"] == "handshake"
        peer.send(payload)
        if half_close:
            peer.sock.shutdown(socket.SHUT_WR)
        error = peer.error_then_close()
        assert peer.eof
    assert error["code"] == code, error
    logged = wait_until(lambda: peer_errors(b.log(), peer), 10, f"the log line for {code}")
    assert logged[0]["code"] == code and logged[0]["error"] == error["message"]
    return str(error["message"])


def session(b: Broker, hello: dict[str, Any]) -> RawPeer:
    """A raw connection that said ``hello`` and was welcomed."""
    peer = RawPeer(b.address)
    peer.read_greeting()
    peer.send_message(hello)
    welcome = peer.read_message()
    assert welcome is not None and welcome["type"] == "welcome", welcome
    return peer


def next_of(peer: RawPeer, kind: str) -> dict[str, Any]:
    while True:
        message = peer.read_message()
        assert message is not None, f"closed while waiting for {kind}"
        if message["type"] == kind:
            return message
        assert message["type"] == "waiting", message


def closed_with(peer: RawPeer, b: Broker, code: str) -> str:
    error = peer.error_then_close()
    assert error["code"] == code, error
    wait_until(lambda: peer_errors(b.log(), peer), 10, f"the log line for {code}")
    peer.close()
    return str(error["message"])


class Workload:
    """A game with two groups and a trainer for each, in their own processes, stepping all along."""

    def __init__(self, b: Broker, tmp_path: Path) -> None:
        self.reports = {p: tmp_path / f"{p}.json" for p in ("mover", "picker")}
        game_args = ["--address", b.address, "--name", "workload", "--report", str(tmp_path / "game.json")]
        self.game = spawn("tests.scripts.reliability_game", *game_args, log_path=tmp_path / "game.log")
        self.trainers = {}
        for policy, report in self.reports.items():
            args = ["--address", b.address, "--policy", policy, "--mode", "random", "--report", str(report)]
            log_path = tmp_path / f"{policy}.log"
            self.trainers[policy] = spawn("tests.scripts.reliability_trainer", *args, log_path=log_path)

    def steps(self) -> dict[str, int]:
        return {p: int(read_report(r).get("steps", 0)) for p, r in self.reports.items()}

    def advances(self, since: dict[str, int], by: int = 5, timeout: float = 60) -> dict[str, int]:
        """Wait until every trainer has taken ``by`` more steps: the attacks disturbed nobody else."""
        wait_until(lambda: all(n >= since[p] + by for p, n in self.steps().items()), timeout, "the workload to step")
        return self.steps()

    def stop(self) -> dict[str, dict[str, Any]]:
        codes = {p: stop(proc) for p, proc in self.trainers.items()}
        reports = {p: read_report(r) for p, r in self.reports.items()}
        assert codes == {"mover": 0, "picker": 0}, reports
        return reports


@pytest.fixture
def attacked(tmp_path: Path) -> Iterator[tuple[Broker, Workload]]:
    args = ("--games", "2", "--timeout-hello", "1", "--max-frame-bytes", str(MAX_FRAME), "--status-interval", "0")
    with broker(tmp_path, *args, "--log-json") as b:
        workload = Workload(b, tmp_path)
        try:
            yield b, workload
        finally:
            for proc in (*workload.trainers.values(), workload.game):
                stop(proc)


class VictimGame:
    """Slot 1's game, in a thread of this process: policy "victim", which the attackers train."""

    def __init__(self, address: str) -> None:
        self.client = GameClient(address, [GroupSpec("victim", VICTIM_AGENTS, VICTIM)], name="victim")
        self.ticks = 0
        self.error: BaseException | None = None
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        n = VICTIM_AGENTS
        data = StepData(
            {"obs": np.ones((n, 3), np.float32)}, np.zeros(n, np.float32), np.zeros(n, np.bool_), np.zeros(n, np.bool_)
        )
        try:
            while not self.stopping.is_set():
                self.client.step({"victim": data})
                self.ticks += 1
        except BaseException as exc:
            self.error = exc

    def leave(self) -> None:
        self.stopping.set()
        self.client.timeout_reconnect = 0  # a step cut short by our own close must not reconnect
        self.client.close("victim leaves")
        self.thread.join(timeout=10)


def test_bad_peers_are_refused_while_a_game_and_two_trainers_keep_stepping(
    attacked: tuple[Broker, Workload],
) -> None:
    b, workload = attacked
    victim = VictimGame(b.address)  # completes the layout: 2 slots
    steps = workload.advances({"mover": 0, "picker": 0}, by=10, timeout=120)

    # --- bytes that are not our protocol ---------------------------------------------------------------
    assert "undecodable msgpack" in refused(b, encode_frame(b"\x82\xa4type\xa5hello\xc1"), "malformed")
    assert "not a msgpack map" in refused(b, encode_frame(msgpack.packb([1, 2, 3])), "malformed")
    assert "not a msgpack map" in refused(b, encode_frame(b"\x00\x01\x02"), "malformed")
    assert "ended inside a frame" in refused(b, struct.pack("<I", 100) + b"x" * 10, "malformed", half_close=True)
    assert "no hello within 1 s" in refused(b, struct.pack("<I", 100) + b"x" * 10, "hello_timeout")
    assert "limit is 1048576" in refused(b, struct.pack("<I", 2**32 - 1), "frame_too_large")
    assert "limit is 1048576" in refused(b, struct.pack("<I", MAX_FRAME + 1), "frame_too_large")
    # A frame of exactly the limit is read (and then found to be no message).
    assert "not a msgpack map" in refused(b, encode_frame(bytes(MAX_FRAME)), "malformed")
    assert "protocol 2" in refused(b, msgpack_frame(victim_hello(protocol=2)), "version_mismatch")
    assert "'dance'" in refused(b, msgpack_frame({"type": "dance"}), "unknown_message")
    assert "not allowed" in refused(b, msgpack_frame({"type": "reset"}), "unexpected_message")
    welcome = {"type": "welcome", "protocol": 1, "peer_id": 3}  # the broker's own message, sent to it
    assert "not allowed" in refused(b, msgpack_frame(welcome), "unexpected_message")
    # The greeting need not be read: a peer that sends first is answered all the same.
    refused(b, msgpack_frame({"type": "dance"}), "unknown_message", read_greeting=False)
    steps = workload.advances(steps)

    # --- hellos with inconsistent spaces ------------------------------------------------------------------
    group = GroupSpec("victim", VICTIM_AGENTS, VICTIM).to_wire()
    low_above_high = {**group, "observation_space": {"obs": {"space": "box", "shape": [3], "low": 5.0, "high": -5.0}}}
    no_agents = {**group, "n_agents": 0}
    bad_dtype = {**group, "observation_space": {"obs": {"space": "box", "shape": [3], "dtype": "complex64"}}}
    no_actions = {**group, "action_space": {}}
    assert "above high" in refused(b, msgpack_frame(victim_hello(groups=[low_above_high])), "bad_spaces")
    assert "n_agents" in refused(b, msgpack_frame(victim_hello(groups=[no_agents])), "bad_spaces")
    assert "complex64" in refused(b, msgpack_frame(victim_hello(groups=[bad_dtype])), "bad_spaces")
    assert "action_space" in refused(b, msgpack_frame(victim_hello(groups=[no_actions])), "bad_spaces")
    assert "twice" in refused(b, msgpack_frame(victim_hello(groups=[group, group])), "bad_hello")
    assert "role" in refused(b, msgpack_frame({**victim_hello(), "role": "admin"}), "bad_hello")
    assert "slots are taken" in refused(b, msgpack_frame(victim_hello()), "broker_full")
    steps = workload.advances(steps)

    # --- a trainer's bad actions (policy "victim" of the game in slot 1) ----------------------------------
    assert "already has a trainer" in refused(b, msgpack_frame(trainer_hello("mover")), "policy_taken")
    assert "no game announces" in refused(b, msgpack_frame(trainer_hello("nobody")), "unknown_policy")
    good = {"pick": encode_array(np.zeros(VICTIM_AGENTS, np.int32))}
    bad_acts = [
        ({"pick": encode_array(np.zeros(VICTIM_AGENTS + 1, np.int32))}, "bad_actions", "shape [5]"),
        ({"pick": encode_array(np.zeros(VICTIM_AGENTS, np.float32))}, "bad_actions", "float32"),
        ({"pick": encode_array(np.full(VICTIM_AGENTS, 7, np.int32))}, "bad_actions", "[0, 3)"),
        ({"jump": encode_array(np.zeros(VICTIM_AGENTS, np.int32))}, "bad_actions", "jump"),
        ({"pick": {"dtype": "int32", "shape": [VICTIM_AGENTS], "data": b"\x00"}}, "malformed", "needs 16 bytes"),
    ]
    for actions, code, words in bad_acts:
        attacker = session(b, trainer_hello("victim"))
        next_of(attacker, "policy")
        attacker.send_message({"type": "reset"})
        batch = next_of(attacker, "batch")
        attacker.send_message({"type": "act", "step": batch["step"], "actions": actions})
        assert words in closed_with(attacker, b, code)
    attacker = session(b, trainer_hello("victim"))
    next_of(attacker, "policy")
    attacker.send_message({"type": "reset"})
    batch = next_of(attacker, "batch")
    attacker.send_message({"type": "act", "step": batch["step"] + 5, "actions": good})
    assert "open batch" in closed_with(attacker, b, "bad_actions")
    # After all that, an honest trainer of "victim" steps its game.
    honest = session(b, trainer_hello("victim"))
    next_of(honest, "policy")
    honest.send_message({"type": "reset"})
    ticks = victim.ticks
    for _ in range(3):
        batch = next_of(honest, "batch")
        honest.send_message({"type": "act", "step": batch["step"], "actions": good})
    wait_until(lambda: victim.ticks > ticks, 10, "the victim game to step")
    honest.close()
    steps = workload.advances(steps)

    # --- a game's bad steps (slot 1, freed by the victim game) ---------------------------------------------
    victim.leave()
    assert victim.error is None or isinstance(victim.error, BrokerError)
    other = {**group, "observation_space": {"obs": {"space": "box", "shape": [4], "low": -1.0, "high": 1.0}}}
    assert "'victim'" in refused(b, msgpack_frame(victim_hello(groups=[other])), "space_mismatch")
    bad_steps = [
        (victim_step(3), "expected tick 0"),
        (victim_step(0, n=VICTIM_AGENTS + 2), "rows"),
        (victim_step(0, dtype="float64"), "float64"),
        ({"type": "step", "tick": 0, "groups": {"victim": {"reward": 5}}}, "reward"),
        ({**victim_step(0), "groups": {"mover": victim_step(0)["groups"]["victim"]}}, "groups"),
    ]
    for step, words in bad_steps:
        attacker = session(b, victim_hello())
        attacker.send_message(step)
        message = closed_with(attacker, b, "malformed" if words == "reward" else "bad_step")
        assert words in message, message
    workload.advances(steps)
    reports = workload.stop()
    for policy, report in reports.items():
        assert report["error"] is None and report["problems"] == [] and report["end"] == "signal", (policy, report)


def test_silent_peers_time_out_and_memory_stays_flat_over_thousands_of_bad_connections(
    attacked: tuple[Broker, Workload],
) -> None:
    b, workload = attacked
    victim = VictimGame(b.address)
    steps = workload.advances({"mover": 0, "picker": 0}, by=10, timeout=120)

    # Fifty peers that connect and say nothing: each gets hello_timeout after --timeout-hello (1 s).
    silent = [RawPeer(b.address) for _ in range(50)]
    for peer in silent:
        assert peer.error_then_close()["code"] == "hello_timeout"
        peer.close()

    payloads = [
        encode_frame(b"\x82\xa4type\xa5hello\xc1"),
        struct.pack("<I", 2**31),
        msgpack_frame(victim_hello(protocol=9)),
        msgpack_frame({"type": "dance"}),
        msgpack_frame(victim_hello(groups=[{"policy": "victim", "n_agents": -1}])),
        struct.pack("<I", 64) + b"partial",  # then half-closed: ends inside a frame
        encode_frame(bytes(MAX_FRAME // 4)),  # a large frame each time, so a leak would show
    ]

    def hammer(count: int) -> None:
        for i in range(count):
            with RawPeer(b.address) as peer:
                peer.send(payloads[i % len(payloads)])
                if i % len(payloads) == 5:
                    peer.sock.shutdown(socket.SHUT_WR)
                assert peer.error_then_close()["type"] == "error"

    hammer(300)  # warm-up: allocator pools, log buffers
    time.sleep(0.5)
    before = b.rss()
    started = time.monotonic()
    hammer(BAD_CONNECTIONS)
    elapsed = time.monotonic() - started
    time.sleep(0.5)
    after = b.rss()
    steps_after = workload.advances(steps)
    print(
        f"\nbroker RSS {before / 2**20:.1f} MiB before, {after / 2**20:.1f} MiB after {BAD_CONNECTIONS} bad "
        f"connections in {elapsed:.1f} s; workload steps {steps} -> {steps_after}"
    )
    assert after - before < RSS_GROWTH_LIMIT, (before, after)
    errors = [e for e in b.log().splitlines() if '"peer error"' in e]
    assert len(errors) >= BAD_CONNECTIONS + 300 + 50  # every one was logged
    assert b.proc.poll() is None and victim.error is None
    victim.leave()
    for policy, report in workload.stop().items():
        assert report["error"] is None and report["problems"] == [], (policy, report)
