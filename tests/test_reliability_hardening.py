"""Issue #14, the server's part: no single peer can freeze, flood or lock out the broker.

Real brokers on loopback while a tagged game and two tagged trainers step (every transition checked for
lost or doubled ticks): budgets before and after hello, a trickling peer, infos that grow while held, a large
hostile frame (the longest gap the legitimate trainers see is reported, not asserted), memory given back,
unencodable batches and status answers, and the token kept out of the process list.
"""

from __future__ import annotations

import asyncio
import json
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import structlog

from broker.core.batching import DROPPED_INFO, UnencodableMessage
from broker.log import configure_logging
from broker.protocol import PROTOCOL_VERSION
from broker.protocol.framing import encode_frame
from broker.protocol.messages import Batch, Hello, Message, StepData
from broker.protocol.spaces import BoxSpace, DiscreteAction, GroupSpec, PolicySpaces
from broker.server.config import ServerConfig
from broker.server.server import BrokerServer
from clients.errors import BrokerError
from clients.game import GameClient
from clients.status import fetch_status
from clients.transport import PeerSocket
from tests.hub_driver import LinkHub as Hub
from tests.scripts.reliability_common import (
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

MIB = 2**20
SPACES = PolicySpaces((("obs", BoxSpace((3,), "float32", -10.0, 10.0)),), (("pick", DiscreteAction(3)),))


class TaggedWorkload:
    """A tagged game (4 movers, 4 pickers) and a tag-checking trainer per policy, each in its process, in
    lock-step (barrier) mode: every tick is one transition, so a lost or doubled tick shows."""

    def __init__(self, b: Broker, tmp_path: Path) -> None:
        self.reports = {p: tmp_path / f"{p}.json" for p in ("mover", "picker")}
        game_args = ["--address", b.address, "--kind", "tagged", "--exact", "--report", str(tmp_path / "game.json")]
        self.game = spawn("tests.scripts.reliability_game", *game_args, log_path=tmp_path / "game.log")
        self.trainers = {
            p: spawn(
                "tests.scripts.reliability_trainer",
                *("--address", b.address, "--policy", p, "--mode", "tagged", "--report", str(r)),
                log_path=tmp_path / f"{p}.log",
            )
            for p, r in self.reports.items()
        }

    def steps(self) -> dict[str, int]:
        return {p: int(read_report(r).get("steps", 0)) for p, r in self.reports.items()}

    def advances(self, since: dict[str, int], by: int = 20, timeout: float = 120) -> dict[str, int]:
        wait_until(lambda: all(n >= since[p] + by for p, n in self.steps().items()), timeout, "the workload to step")
        return self.steps()

    def finish(self) -> dict[str, dict[str, Any]]:
        """Stop the trainers; every transition they saw advanced by exactly its frames."""
        codes = {p: stop(proc) for p, proc in self.trainers.items()}
        reports = {p: read_report(r) for p, r in self.reports.items()}
        assert codes == {"mover": 0, "picker": 0}, reports
        for policy, report in reports.items():
            assert report["error"] is None and report["problems"] == [], (policy, report)
            assert report.get("lost", 0) == 0 and report.get("duplicated", 0) == 0, (policy, report)
        stop(self.game)
        return reports

    def kill(self) -> None:
        for proc in (*self.trainers.values(), self.game):
            stop(proc)


@pytest.fixture
def stepping(tmp_path: Path) -> Iterator[tuple[Broker, TaggedWorkload]]:
    """Slot 0: the tagged game. Slot 1: a raw game announcing policy "intruder" that never steps, whose
    free trainer seat the hostile peers take (mover and picker rounds need slot 0 only)."""
    args = ("--games", "2", "--stepping", "barrier", "--limit-before-hello", "16", "--timeout-frame", "2")
    with broker(tmp_path, *args, "--status-interval", "0", "--log-json") as b:
        placeholder = RawPeer(b.address, timeout=300)
        placeholder.read_greeting()
        placeholder.send_message(game_hello("intruder"))
        assert (placeholder.read_message() or {})["type"] == "welcome"
        workload = TaggedWorkload(b, tmp_path)
        try:
            yield b, workload
        finally:
            workload.kill()
            placeholder.close()


def game_hello(policy: str, n: int = 4) -> dict[str, Any]:
    return Hello("game", PROTOCOL_VERSION, "hostile", groups=(GroupSpec(policy, n, SPACES),)).to_wire()


def trainer_hello(policy: str) -> dict[str, Any]:
    return Hello("trainer", PROTOCOL_VERSION, "raw-trainer", policy=policy).to_wire()


def test_silent_connections_are_shed_and_a_trickling_peer_is_cut_while_the_workload_steps(
    stepping: tuple[Broker, TaggedWorkload],
) -> None:
    b, workload = stepping
    steps = workload.advances({"mover": 0, "picker": 0})
    # 16 silent connections fill the before-hello budget; each new one sheds the oldest, so they can
    # never lock out a real peer.
    silent = [RawPeer(b.address) for _ in range(16)]
    newcomer = RawPeer(b.address)
    shed = silent[0].error_then_close()
    assert shed["code"] == "broker_full" and "the oldest is shed" in shed["message"], shed
    # A real peer gets in although the budget is spent, and is served (an observer: status, then close).
    status = fetch_status(b.address)
    assert status["connections_before_hello"] == 15, status  # the status client itself shed one more
    # A peer that said hello and then trickles a frame, byte by byte, is cut after --timeout-frame (2 s).
    trickler = RawPeer(b.address)
    trickler.read_greeting()
    trickler.send_message(trainer_hello("intruder"))
    frame = encode_frame(msgpack.packb({"type": "reset"}))
    started = time.monotonic()
    for byte in frame[:-1]:
        if trickler.eof:
            break
        try:
            trickler.send(bytes([byte]))
        except OSError:
            break
        time.sleep(0.3)
    messages = trickler.read_until_closed()
    assert messages[-1]["code"] == "slow_peer" and "still incomplete 2 s after" in messages[-1]["message"], messages
    assert time.monotonic() - started >= 1.9
    assert peer_errors(b.log(), trickler)[0]["code"] == "slow_peer"
    for peer in (*silent, newcomer, trickler):
        peer.close()
    workload.advances(steps)
    workload.finish()


def test_admitted_peers_have_their_own_limit_and_a_trainer_retries_broker_full(tmp_path: Path) -> None:
    with broker(tmp_path, "--limit-connections", "2", "--log-json", "--status-interval", "0") as b:
        # Two admitted trainers (no game yet, so they wait) spend the budget of admitted peers ...
        held = []
        for policy in ("a", "b"):
            peer = RawPeer(b.address)
            peer.read_greeting()
            peer.send_message(trainer_hello(policy))
            assert (peer.read_message() or {})["type"] == "welcome"
            held.append(peer)
        # ... while silent connections do not count against it.
        silent = [RawPeer(b.address) for _ in range(5)]
        with pytest.raises(BrokerError) as refused:
            GameClient(b.address, [GroupSpec("c", 1, SPACES)], timeout_reconnect=0)
        assert refused.value.code == "broker_full" and refused.value.message == "connection limit 2 reached"
        # A trainer's first connect retries broker_full with backoff, and gets in once there is room.
        result: dict[str, Any] = {}

        def connect() -> None:
            try:
                hello = Hello("trainer", PROTOCOL_VERSION, "late", policy="c")
                result["socket"] = PeerSocket(b.address, hello)
            except BrokerError as exc:
                result["error"] = exc

        thread = threading.Thread(target=connect)
        thread.start()
        wait_until(lambda: sum(e.get("code") == "broker_full" for e in log_events(b.log())) >= 3, 30, "refused retries")
        held.pop().close()
        thread.join(timeout=30)
        assert "socket" in result, result
        assert result["socket"].welcome.peer_id > 0
        result["socket"].close()
        for peer in (*held, *silent):
            peer.close()


def test_infos_with_new_keys_every_tick_stay_bounded_and_memory_is_given_back(tmp_path: Path) -> None:
    """A game whose policy has no trainer sends 200 fresh info keys per agent every tick: held ticks do not
    merge them, so the broker's memory stays flat, and drops back after the game leaves."""
    with broker(tmp_path, "--status-interval", "0", "--log-json") as b:
        n = 16
        client = GameClient(b.address, [GroupSpec("held", n, SPACES)], timeout_reconnect=0)
        zeros = np.zeros(n, np.bool_)
        before = b.rss()
        samples = []
        for tick in range(1500):
            infos = {row: {f"k{tick}_{j}": "v" * 32 for j in range(200)} for row in range(n)}
            data = StepData({"obs": np.zeros((n, 3), np.float32)}, np.zeros(n, np.float32), zeros, zeros, infos=infos)
            client.step({"held": data})
            if tick % 300 == 299:
                samples.append(b.rss())
        client.close("done")
        time.sleep(1.5)  # the broker sees the close, and trims its heap
        after = b.rss()
        print(
            f"\nbroker RSS {before / MIB:.1f} MiB before, during "
            f"{[round(s / MIB, 1) for s in samples]} MiB, {after / MIB:.1f} MiB after the game left"
        )
        # Merged, these infos would be 1500 x 16 x 200 keys (several GiB); one tick's worth is ~2 MiB.
        assert max(samples) - before < 64 * MIB, samples
        assert after - before < 16 * MIB, (before, after)


def test_a_large_hostile_frame_costs_other_peers_no_ticks_and_memory_is_given_back(
    stepping: tuple[Broker, TaggedWorkload],
) -> None:
    b, workload = stepping
    steps = workload.advances({"mover": 0, "picker": 0}, by=50)
    gaps_before = {p: read_report(r).get("longest_gap_s", 0.0) for p, r in workload.reports.items()}
    before = b.rss()
    # After hello (as the trainer of "intruder"), one 4 MiB frame of 4 Mi empty maps: the costliest msgpack
    # to decode per byte (without part A's element limits, seconds of decoding and hundreds of MiB).
    hostile = RawPeer(b.address, timeout=120)
    hostile.read_greeting()
    hostile.send_message(trainer_hello("intruder"))
    count = 4 << 20
    body = b"\x82\xa4type\xa3act\xa7actions\xdd" + struct.pack(">I", count) + b"\x80" * count
    hostile.send(encode_frame(body))
    answer = hostile.read_until_closed()
    peak = b.rss()
    hostile.close()
    time.sleep(1.5)
    after = b.rss()
    steps = workload.advances(steps, by=50)
    reports = workload.finish()
    gaps = {p: r.get("longest_gap_s") for p, r in reports.items()}
    print(
        f"\nhostile frame answered {[m.get('code', m['type']) for m in answer]}; longest gap seen by the "
        f"trainers {gaps} s (before the attack {gaps_before}); broker RSS {before / MIB:.1f} MiB before, "
        f"{peak / MIB:.1f} at the peak, {after / MIB:.1f} after"
    )
    assert answer and answer[-1]["type"] == "error", answer
    assert after - before < 32 * MIB, (before, peak, after)


# --- the send side: a batch or status that cannot be encoded --------------------------------------


class PickyLink:
    """A trainer link whose codec cannot carry integers beyond 64 bits (as msgpack cannot)."""

    label = "picky-trainer"

    def __init__(self) -> None:
        self.sent: list[Message] = []
        self.closed_with: Any = None

    @staticmethod
    def encodable(value: Any) -> bool:
        try:
            msgpack.packb(value)
        except Exception:
            return False
        return True

    def send(self, message: Message) -> None:
        if isinstance(message, Batch) and not self.encodable(message.data.infos):
            raise UnencodableMessage("integer out of range", self.encodable)
        self.sent.append(message)

    def close(self, error: Any = None) -> None:
        self.closed_with = error


class GameLink:
    def __init__(self, label: str) -> None:
        self.label = label
        self.sent: list[Message] = []

    def send(self, message: Message) -> None:
        self.sent.append(message)

    def close(self, error: Any = None) -> None:
        raise AssertionError(f"{self.label} closed with {error}")


def test_an_unencodable_info_is_dropped_and_blamed_on_its_game_and_the_policy_goes_on() -> None:
    hub = Hub(expected_games=2, clock=lambda: 0.0)
    trainer_link = PickyLink()
    trainer = hub.add_trainer(trainer_link, Hello("trainer", PROTOCOL_VERSION, "t", policy="p"))
    hello = Hello("game", PROTOCOL_VERSION, "g", groups=(GroupSpec("p", 2, SPACES),))
    honest, culprit = GameLink("honest"), GameLink("culprit")
    g0, g1 = hub.add_game(honest, hello), hub.add_game(culprit, hello)
    hub.trainer_reset(trainer)
    zeros = np.zeros(2, np.bool_)

    def step(infos: dict[int, dict[str, Any]]) -> StepData:
        return StepData({"obs": np.zeros((2, 3), np.float32)}, np.ones(2, np.float32), zeros, zeros, infos=infos)

    from broker.protocol.messages import GameStep, TrainerAct

    for tick in range(3):
        hub.game_step(g0, GameStep(tick, {"p": step({0: {"ok": tick}})}))
        hub.game_step(g1, GameStep(tick, {"p": step({1: {"big": 10**30}})}))
        batches = [m for m in trainer_link.sent if isinstance(m, Batch)]
        assert len(batches) == tick + 1 and batches[-1].step == tick + 1  # never frozen, never skipped
        assert batches[-1].data.infos == {0: {"ok": tick}, 3: DROPPED_INFO}
        hub.trainer_act(trainer, TrainerAct(batches[-1].step, {"pick": np.zeros(4, np.int64)}))
    assert trainer_link.closed_with is None
    assert sum(1 for m in honest.sent if type(m).__name__ == "GameActions") == 3


def test_status_answers_even_when_a_name_cannot_be_encoded() -> None:
    """A policy named with a lone surrogate (part A refuses such hellos; this guards the answer itself)."""

    async def scenario() -> dict[str, Any]:
        server = BrokerServer(ServerConfig(port=0, status_interval=0))
        await server.start()
        hello = Hello("game", PROTOCOL_VERSION, "g\ud800", groups=(GroupSpec("bad\ud800name", 1, SPACES),))
        server.enter(GameLink("g"), hello)
        try:
            return await asyncio.to_thread(fetch_status, f"127.0.0.1:{server.port}")
        finally:
            await server.shutdown()

    status = asyncio.run(scenario())
    assert list(status["policies"]) == ["bad\\ud800name"], status
    assert status["games"][0]["name"] == "g\\ud800"


# --- logging and the token --------------------------------------------------------------------------


def test_json_log_lines_carry_the_traceback_and_long_values_are_capped(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging(json_lines=True)
    try:
        empty: dict[str, int] = {}
        try:
            empty["missing"]
        except KeyError:
            structlog.get_logger("test").exception("internal error", peer="p", value="x" * 100_000)
        line = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    finally:
        with capsys.disabled():  # bind the session's stderr again, not this test's capture (closed after it)
            configure_logging()
    assert "Traceback" in line["exception"] and "KeyError: 'missing'" in line["exception"], line
    assert len(line["value"]) < 2100 and line["value"].endswith("(100000 chars)")


def test_token_file_keeps_the_token_out_of_the_process_list(tmp_path: Path) -> None:
    secret = "s3cret-from-a-file"
    token_file = tmp_path / "token"
    token_file.write_text(secret + "\n")
    with broker(tmp_path, "--token-file", str(token_file), "--status-interval", "0") as b:
        cmdline = Path(f"/proc/{b.proc.pid}/cmdline").read_bytes().decode()
        assert secret not in cmdline and str(token_file) in cmdline
        assert fetch_status(b.address, secret)["connections"] >= 1
        with pytest.raises(BrokerError) as refused:
            fetch_status(b.address, "wrong")
        assert refused.value.code == "auth_failed"
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(RuntimeError, match="is empty"):
        with broker(tmp_path, "--token-file", str(empty), timeout=10):
            pass


def test_an_unencodable_info_reaches_a_real_trainer_as_a_dropped_info_over_a_socket() -> None:
    """The server's own link: encoding fails before anything is written, the hub drops that info, the
    trainer (a raw msgpack peer on loopback) gets the batch and the game its actions."""

    async def scenario() -> tuple[dict[str, Any], list[Message]]:
        server = BrokerServer(ServerConfig(port=0, status_interval=0))
        await server.start()
        game_link = GameLink("in-process game")
        hello = Hello("game", PROTOCOL_VERSION, "g", groups=(GroupSpec("p", 1, SPACES),))
        server.enter(game_link, hello)

        def trainer() -> dict[str, Any]:
            with RawPeer(f"127.0.0.1:{server.port}") as peer:
                peer.read_greeting()
                peer.send_message(trainer_hello("p"))
                assert [(peer.read_message() or {})["type"] for _ in range(2)] == ["welcome", "policy"]
                peer.send_message({"type": "reset"})
                batch = peer.read_message() or {}
                while batch.get("type") == "waiting":
                    batch = peer.read_message() or {}
                pick = {"dtype": "int64", "shape": [1], "data": np.zeros(1, np.int64).tobytes()}
                peer.send_message({"type": "act", "step": batch["step"], "actions": {"pick": pick}})
                time.sleep(0.3)
                return batch

        from broker.protocol.messages import GameStep

        thread_result = asyncio.create_task(asyncio.to_thread(trainer))
        while server.hub.policies["p"].trainer is None or not server.hub.policies["p"].trainer.wants_batch:
            await asyncio.sleep(0.02)
        zeros = np.zeros(1, np.bool_)
        data = StepData(
            {"obs": np.zeros((1, 3), np.float32)}, np.ones(1, np.float32), zeros, zeros, infos={0: {"big": 10**30}}
        )
        server.enter(game_link, GameStep(0, {"p": data}))
        try:
            return await thread_result, game_link.sent
        finally:
            await server.shutdown()

    batch, game_sent = asyncio.run(scenario())
    assert batch["type"] == "batch" and batch["step"] == 1, batch
    assert batch["infos"] == {0: DROPPED_INFO}, batch.get("infos")
    assert any(type(m).__name__ == "GameActions" for m in game_sent)
