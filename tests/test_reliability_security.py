"""Security and limits: loopback by default, a token for anything else (checked in every hello, never
logged), and the flags that bound connections, frame sizes, unsent bytes and the wait for a hello.

Only loopback addresses receive traffic here; binding 0.0.0.0 is tried only where it must be refused."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from broker.protocol import PROTOCOL_VERSION
from broker.protocol.messages import Hello, StepData
from broker.protocol.spaces import BoxSpace, DiscreteAction, GroupSpec, PolicySpaces
from broker.server.config import ServerConfig
from clients.errors import BrokerError
from clients.game import GameClient
from clients.sim_game import SimGame
from clients.status import fetch_status
from clients.vec_env import BrokerVecEnv
from tests.helpers import python_env
from tests.scripts.reliability_common import Broker, RawPeer, broker, log_events, peer_errors, wait_until

TOKEN = "tok-3f9a7c1e55d04b2e"


def _serve_without_token(*args: str) -> subprocess.CompletedProcess[str]:
    env = python_env()
    env.pop("GDRL_BROKER_TOKEN", None)
    return subprocess.run(
        [sys.executable, "-m", "broker", "serve", "--port", "0", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_binding_beyond_loopback_without_a_token_refuses_to_start(host: str) -> None:
    result = _serve_without_token("--host", host)
    assert result.returncode == 2, result
    assert f"binding {host} exposes the broker beyond this machine" in result.stderr
    assert "--token or GDRL_BROKER_TOKEN" in result.stderr
    assert "listening" not in result.stderr + result.stdout


def test_loopback_addresses_need_no_token_and_others_do() -> None:
    for host in ("127.0.0.1", "127.0.0.2", "localhost", "::1"):
        assert ServerConfig(host=host).is_loopback(), host
        ServerConfig(host=host).validate()
    for host in ("0.0.0.0", "::", "192.0.2.7", "example.org"):
        config = ServerConfig(host=host)
        assert not config.is_loopback(), host
        with pytest.raises(ValueError, match="--token or GDRL_BROKER_TOKEN"):
            config.validate()
        ServerConfig(host=host, token=TOKEN).validate()  # with a token it may start


def _hello_answer(b: Broker, hello: dict[str, Any]) -> dict[str, Any]:
    with RawPeer(b.address) as peer:
        peer.read_greeting()
        peer.send_message(hello)
        answer = peer.read_message()
        if answer is not None and answer["type"] == "welcome":  # an observer is welcomed, then told
            answer = peer.read_message()
        assert answer is not None
        if answer["type"] == "error":
            assert peer.read_message() is None  # then the connection closes
            wait_until(lambda: peer_errors(b.log(), peer), 10, "the auth_failed log line")
        return answer


@pytest.mark.parametrize("via", ["flag", "environment"])
def test_every_hello_must_carry_the_token_and_the_token_is_never_logged(
    tmp_path: Path, via: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = ("--token", TOKEN) if via == "flag" else ()
    env = {"GDRL_BROKER_TOKEN": TOKEN} if via == "environment" else {}
    client_token = TOKEN if via == "flag" else None  # environment: the clients read the same variable
    if via == "environment":
        monkeypatch.setenv("GDRL_BROKER_TOKEN", TOKEN)
    with broker(tmp_path, "--games", "1", "--log-level", "debug", "--log-json", *args, env=env) as b:
        sim = SimGame(2, 0)
        game_wire = Hello("game", PROTOCOL_VERSION, "g", groups=tuple(sim.group_specs())).to_wire()
        observer = Hello("observer", PROTOCOL_VERSION, "o").to_wire()
        for hello in (game_wire, observer, {**game_wire, "token": "tok-wrong-guess-0001"}, {**game_wire, "token": ""}):
            answer = _hello_answer(b, hello)
            assert answer == {"type": "error", "code": "auth_failed", "message": "missing or wrong token"}
        with pytest.raises(BrokerError) as refused:
            GameClient(b.address, sim.group_specs(), token="tok-wrong-guess-0002")
        assert refused.value.code == "auth_failed"
        # With the token, a game, a trainer and an observer are served as usual.
        game = GameClient(b.address, sim.group_specs(), token=client_token)
        trainer = BrokerVecEnv("mover", b.address, token=client_token)
        status = _hello_answer(b, {**observer, "token": TOKEN})
        assert status["type"] == "status" and TOKEN not in repr(status)
        playing = threading.Thread(target=_step_until_closed, args=(game, sim.first_step()["mover"], "mover"))
        playing.start()
        trainer.reset()
        trainer.step(np.zeros((2, 2), np.float32))
        trainer.close()
        log = b.log()
    playing.join(timeout=20)
    assert len([e for e in log_events(log) if e.get("code") == "auth_failed"]) == 5
    for secret in (TOKEN, "tok-wrong-guess"):
        assert secret not in log, f"{secret} leaked into the broker's log"


def test_connection_limit(tmp_path: Path) -> None:
    """--limit-connections counts admitted peers (after hello); silent ones have their own budget."""
    with broker(tmp_path, "--limit-connections", "4", "--log-json", "--status-interval", "0") as b:
        held = []
        for i in range(4):  # trainers of policies no game announced yet: admitted, waiting
            peer = RawPeer(b.address)
            assert peer.read_greeting()[0]["type"] == "handshake"
            peer.send_message(Hello("trainer", PROTOCOL_VERSION, f"t{i}", policy=f"p{i}").to_wire())
            assert (peer.read_message() or {})["type"] == "welcome"
            held.append(peer)
        with RawPeer(b.address) as fifth:
            fifth.send_message(Hello("trainer", PROTOCOL_VERSION, "t5", policy="p5").to_wire())
            error = fifth.error_then_close()
        assert error["code"] == "broker_full" and error["message"] == "connection limit 4 reached"
        wait_until(lambda: peer_errors(b.log(), fifth), 10, "the broker_full log line")
        # A real client is told the same, in those words.
        sim = SimGame(1, 0)
        with pytest.raises(BrokerError) as refused:
            GameClient(b.address, sim.group_specs(), timeout_reconnect=0)
        assert refused.value.code == "broker_full" and "connection limit 4" in refused.value.message
        held.pop().close()
        time.sleep(0.2)  # the broker sees the close
        GameClient(b.address, sim.group_specs()).close()  # room again
        for peer in held:
            peer.close()


def test_frame_size_limit_applies_to_honest_peers_too(tmp_path: Path) -> None:
    # A step of 64 agents x 64 floats is 16 KiB: over a 4 KiB limit.
    big = PolicySpaces((("obs", BoxSpace((64,), "float32", -1.0, 1.0)),), (("pick", DiscreteAction(2)),))
    with broker(tmp_path, "--max-frame-bytes", "4096", "--log-json", "--status-interval", "0") as b:
        client = GameClient(b.address, [GroupSpec("big", 64, big)], timeout_reconnect=0)
        zeros = np.zeros(64, np.bool_)
        data = StepData({"obs": np.zeros((64, 64), np.float32)}, np.zeros(64, np.float32), zeros, zeros)
        with pytest.raises(BrokerError) as refused:
            client.step({"big": data})
        assert refused.value.code == "frame_too_large" and "the limit is 4096" in refused.value.message
        assert any(e.get("code") == "frame_too_large" for e in log_events(b.log()))


def test_pending_bytes_limit_drops_a_peer_that_does_not_read(tmp_path: Path) -> None:
    """A trainer asks for its open batch again and again (each ``reset`` resends it) and never reads: once
    more than --max-pending-bytes wait for it, the broker drops it with slow_peer."""
    spaces = PolicySpaces((("obs", BoxSpace((1024,), "float32", -1.0, 1.0)),), (("pick", DiscreteAction(2)),))
    args = ("--max-pending-bytes", "65536", "--log-json", "--status-interval", "0")
    with broker(tmp_path, *args) as b:
        game = GameClient(b.address, [GroupSpec("big", 16, spaces)], timeout_reconnect=0)
        zeros = np.zeros(16, np.bool_)
        data = StepData({"obs": np.zeros((16, 1024), np.float32)}, np.zeros(16, np.float32), zeros, zeros)
        stepping = threading.Thread(target=_step_until_closed, args=(game, data, "big"), daemon=True)
        stepping.start()
        # The game's first step must be in before the resets: asked for with no batch open, they only wait.
        wait_until(lambda: fetch_status(b.address)["games"][0]["ticks"] >= 1, 10, "the game's first step")
        with RawPeer(b.address, rcvbuf=4096) as reader:
            reader.read_greeting()
            reader.send_message(Hello("trainer", PROTOCOL_VERSION, "slow", policy="big").to_wire())
            resets = 200  # each resends the open 64 KiB batch: far more than every buffer on the way holds
            reader.send(b"\x0c\x00\x00\x00\x81\xa4type\xa5reset" * resets)
            time.sleep(1.0)  # and read nothing meanwhile
            messages = reader.read_until_closed()
        assert messages[-1]["type"] == "error" and messages[-1]["code"] == "slow_peer", messages[-1]
        assert sum(m["type"] == "batch" for m in messages) < resets  # it stopped sending long before
        assert [e["code"] for e in peer_errors(b.log(), reader)] == ["slow_peer"]
        game.close()
        stepping.join(timeout=10)


def _step_until_closed(game: GameClient, data: StepData, group: str) -> None:
    """Step the same observations until the broker closes (or drops) the game."""
    try:
        while True:
            game.step({group: data})
    except BrokerError:
        pass


def test_hello_timeout(tmp_path: Path) -> None:
    with broker(tmp_path, "--timeout-hello", "2", "--log-json", "--status-interval", "0") as b:
        with RawPeer(b.address) as silent, RawPeer(b.address) as in_time:
            started = time.monotonic()
            time.sleep(1.0)
            # A peer that says hello within the time is served, however long it then stays.
            in_time.read_greeting()
            in_time.send_message(Hello("observer", PROTOCOL_VERSION, "o").to_wire())
            assert [m["type"] for m in in_time.read_until_closed()] == ["welcome", "status", "close"]
            error = silent.error_then_close()
            waited = time.monotonic() - started
        assert error == {"type": "error", "code": "hello_timeout", "message": "no hello within 2 s"}
        assert waited >= 1.9  # not before the configured time
        assert peer_errors(b.log(), silent)[0]["code"] == "hello_timeout"
        assert peer_errors(b.log(), in_time) == []
