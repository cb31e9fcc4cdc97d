"""Issue #13 item 8: an unmodified godot_rl plugin game (the real plugin, in a real Godot engine) that the
broker refuses for space_mismatch is told why in words the plugin prints, then quits; the log says it."""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import time
from pathlib import Path
from typing import BinaryIO

from broker.protocol.connection import GREETING
from tests.godot_engine import prepare_project, require_godot
from tests.helpers import ROOT, broker_process

PROJECT = ROOT / "tests" / "projects" / "godot_rl_plugin_game"


def start_game(godot: Path, project: Path, port: str, obs_size: int, log: BinaryIO) -> subprocess.Popen[bytes]:
    command = [str(godot), "--headless", "--path", str(project), f"--port={port}", f"--obs_size={obs_size}"]
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)


def test_real_plugin_game_refused_for_space_mismatch_prints_why_and_quits(tmp_path: Path) -> None:
    godot = require_godot()
    project = prepare_project(godot, PROJECT, tmp_path / "game", broker_addon=False, plugin_addon=True)
    with (
        broker_process(tmp_path, "--games", "2") as (_, address),
        (tmp_path / "first.log").open("wb") as first_log,
        (tmp_path / "odd.log").open("wb") as odd_log,
    ):
        port = address.rsplit(":", 1)[1]
        first = start_game(godot, project, port, 3, first_log)
        try:
            deadline = time.monotonic() + 120
            while "godot_rl game joined" not in broker_log(tmp_path) and time.monotonic() < deadline:
                time.sleep(0.2)
            odd = start_game(godot, project, port, 4, odd_log)
            odd.wait(timeout=120)  # the refused game quits: the plugin's own "close" handling
        finally:
            first.terminate()
            first.wait(timeout=30)
    printed = (tmp_path / "odd.log").read_text()
    assert "gdrl-broker refused this game (space_mismatch)" in printed, printed
    assert "'mover'" in printed and "received close message, closing game" in printed
    log = broker_log(tmp_path)
    assert "godot_rl game refused" in log and "space_mismatch" in log


def broker_log(tmp_path: Path) -> str:
    return "\n".join(p.read_text() for p in tmp_path.glob("broker-*.log"))


def read_frame(sock: socket.socket) -> dict[str, object]:
    header = sock.recv(4, socket.MSG_WAITALL)
    (length,) = struct.unpack("<I", header)
    return dict(json.loads(sock.recv(length, socket.MSG_WAITALL)))


def send_frame(sock: socket.socket, message: dict[str, object]) -> None:
    body = json.dumps(message).encode()
    sock.sendall(struct.pack("<I", len(body)) + body)


def env_info(obs_size: int) -> dict[str, object]:
    return {
        "type": "env_info",
        "observation_space": [{"obs": {"size": [obs_size], "space": "box"}}],
        "action_space": [{"move": {"size": 1, "action_type": "continuous"}}],
        "n_agents": 1,
        "agent_policy_names": ["mover"],
    }


def test_refused_plugin_game_gets_the_reason_as_a_call_then_close(tmp_path: Path) -> None:
    """The same exchange over a raw socket, byte for byte what the plugin reads (no engine needed)."""
    with broker_process(tmp_path, "--games", "2") as (_, address):
        host, port = address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as first:
            assert first.recv(len(GREETING), socket.MSG_WAITALL) == GREETING
            send_frame(first, env_info(3))
            assert read_frame(first) == {"type": "reset"}
            with socket.create_connection((host, int(port)), timeout=10) as odd:
                assert odd.recv(len(GREETING), socket.MSG_WAITALL) == GREETING
                send_frame(odd, env_info(4))
                call = read_frame(odd)
                assert call["type"] == "call"
                assert str(call["method"]).startswith("gdrl-broker refused this game (space_mismatch): ")
                send_frame(odd, {"type": "call", "returns": [None]})  # what the plugin answers
                assert read_frame(odd) == {"type": "close"}
                assert odd.recv(1) == b""
    assert "godot_rl game refused" in broker_log(tmp_path)
