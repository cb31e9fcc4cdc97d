"""The first hour of a new user (issue #13), done as the user did it: real processes, real sockets.

Every client pointed at something that is not a broker (a listener that never answers, ``python -m
http.server``, the broker's own ``--metrics-port``) or at nothing fails within its connect timeout with one
line naming the address and saying what to do; long waits say what they wait for.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from clients.errors import BrokerError
from clients.status import fetch_status
from clients.vec_env import BrokerVecEnv
from tests.helpers import broker_process, python_env, spawn_python

CONNECT_TIMEOUT = 4  # seconds each client is given; the runs below are bounded by HANG_GUARD only
HANG_GUARD = 120  # a client still running after this long hangs: that is the bug being tested


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_listening(port: int, proc: subprocess.Popen[bytes]) -> None:
    for _ in range(600):
        if proc.poll() is not None:
            raise RuntimeError(f"listener exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            subprocess.run(["sleep", "0.05"], check=True)
    raise RuntimeError(f"nothing listens on {port}")


SILENT_LISTENER = """
import socket, sys, time
server = socket.socket()
server.bind(("127.0.0.1", int(sys.argv[1])))
server.listen(64)
accepted = []
while True:
    conn, _ = server.accept()
    accepted.append(conn)  # accept and never answer
"""


@pytest.fixture(scope="module", params=["silent", "http.server", "metrics-port", "nothing"])
def not_a_broker(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(kind, "127.0.0.1:PORT") of something that is not a broker, as a real process."""
    kind = request.param
    port = free_port()
    if kind == "nothing":
        yield kind, f"127.0.0.1:{port}"
        return
    if kind == "metrics-port":
        with broker_process(tmp_path_factory.mktemp("metrics"), "--metrics-port", str(port)):
            yield kind, f"127.0.0.1:{port}"
        return
    if kind == "silent":
        proc = spawn_python("-c", SILENT_LISTENER, str(port))
    else:
        proc = spawn_python("-m", "http.server", str(port), "--bind", "127.0.0.1", stderr=subprocess.DEVNULL)
    try:
        wait_listening(port, proc)
        yield kind, f"127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


def expected_phrase(kind: str) -> str:
    return "start it with `gdrl-broker serve`" if kind == "nothing" else "is not a godot-rl-broker"


CLIENTS = {
    "gdrl-train": lambda address: ["-m", "clients.train", "--policy", "mover", "--broker", address,
                                   "--connect-timeout", str(CONNECT_TIMEOUT)],
    "sim-game": lambda address: ["-m", "broker", "sim-game", "--address", address,
                                 "--connect-timeout", str(CONNECT_TIMEOUT)],
    "status": lambda address: ["-m", "broker", "status", "--address", address, "--timeout", str(CONNECT_TIMEOUT)],
}  # fmt: skip


@pytest.mark.parametrize("client", sorted(CLIENTS))
def test_a_client_pointed_at_no_broker_fails_with_one_line(client: str, not_a_broker: tuple[str, str]) -> None:
    kind, address = not_a_broker
    result = subprocess.run(
        [sys.executable, *CLIENTS[client](address)],
        capture_output=True,
        text=True,
        env=python_env(),
        timeout=HANG_GUARD,
    )
    assert result.returncode != 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    last = lines[-1]
    assert address in last and expected_phrase(kind) in last, result.stderr
    # The failure is said once: any earlier lines are the periodic "retrying" notices.
    assert all("retrying" in line for line in lines[:-1]), result.stderr


def test_broker_vec_env_pointed_at_no_broker_raises_one_clear_error(not_a_broker: tuple[str, str]) -> None:
    kind, address = not_a_broker
    with pytest.raises(BrokerError) as raised:
        BrokerVecEnv("mover", address, timeout_connect=CONNECT_TIMEOUT)
    message = str(raised.value)
    assert address in message and expected_phrase(kind) in message and "\n" not in message


# --- long waits say what they wait for --------------------------------------------------------------


@pytest.mark.parametrize("client", ["gdrl-train", "sim-game"])
def test_with_no_broker_a_client_says_it_is_retrying_and_what_to_do(client: str) -> None:
    address = f"127.0.0.1:{free_port()}"
    command = CLIENTS[client](address)
    command[-1] = "8"  # the connect timeout: long enough for a few retries
    result = subprocess.run([sys.executable, *command], capture_output=True, text=True, env=python_env(), timeout=120)
    lines = result.stderr.strip().splitlines()
    notices = [line for line in lines if "retrying" in line]
    assert notices and all(address in line and "gdrl-broker serve" in line for line in notices), result.stderr
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "within 8 s" in lines[-1] and "gdrl-broker serve" in lines[-1], result.stderr


def read_until(stream: Iterator[bytes], wanted: str, count: int, seen: list[str]) -> None:
    """Read lines (into ``seen``) until ``count`` of them contain ``wanted``."""
    while sum(wanted in line for line in seen) < count:
        line = next(stream, None)
        assert line is not None, "".join(seen)
        seen.append(line.decode())


def test_a_trainer_waiting_for_games_says_so_periodically_and_exits_130_on_ctrl_c(tmp_path: Path) -> None:
    with broker_process(tmp_path, "--games", "2") as (_, address):
        trainer = spawn_python("-m", "clients.train", "--policy", "mover", "--broker", address, stderr=subprocess.PIPE)
        seen: list[str] = []
        try:
            assert trainer.stderr is not None
            read_until(iter(trainer.stderr.readline, b""), "waiting for games: 0/2", 3, seen)
            trainer.send_signal(signal.SIGINT)
            rest = trainer.communicate(timeout=60)[1].decode()
        finally:
            if trainer.poll() is None:
                trainer.kill()
                trainer.wait()
    assert trainer.returncode == 130, [*seen, rest]
    assert "stopped by signal while joining the broker" in rest and "Traceback" not in rest, rest
    assert any("waited_s=" in line for line in seen), seen  # the repeats say how long it has waited


def test_a_trainer_socket_waits_with_the_kernel_receive_timeout_and_stays_blocking(tmp_path: Path) -> None:
    """The waiting trainer's timed receive: a blocking socket with SO_RCVTIMEO (one system call a receive,
    no poll before each send and receive), which still ends in BrokerError("timeout") and can be lifted."""
    import struct

    from broker.protocol import PROTOCOL_VERSION
    from broker.protocol.messages import Hello
    from clients.errors import BrokerError
    from clients.transport import KERNEL_RECV_TIMEOUT, PeerSocket

    with broker_process(tmp_path, "--games", "2") as (_, address):
        sock = PeerSocket(address, Hello("trainer", PROTOCOL_VERSION, "waits", policy="mover"))
        try:
            sock.set_recv_timeout(0.3)
            assert sock.sock.gettimeout() is None
            if KERNEL_RECV_TIMEOUT:
                raw = sock.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16)
                assert struct.unpack("ll", raw) == (0, 300_000)
            started = time.monotonic()
            with pytest.raises(BrokerError) as exc:
                while True:
                    sock.recv()  # the broker's waiting notice may come first
            assert exc.value.code == "timeout" and time.monotonic() - started < 5
            sock.set_recv_timeout(None)
            if KERNEL_RECV_TIMEOUT:
                raw = sock.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16)
                assert struct.unpack("ll", raw) == (0, 0)
        finally:
            sock.close()


def test_sim_game_exits_non_zero_after_the_broker_is_gone_for_good(tmp_path: Path) -> None:
    with broker_process(tmp_path) as (broker, address):
        game = spawn_python(
            "-m", "broker", "sim-game", "--address", address, "--reconnect-timeout", "3", stderr=subprocess.PIPE
        )
        try:
            while not any(g["connected"] for g in fetch_status(address)["games"]):
                assert game.poll() is None
                time.sleep(0.05)
            broker.kill()
            broker.wait()
            stderr = game.communicate(timeout=120)[1].decode()
        finally:
            if game.poll() is None:
                game.kill()
                game.wait()
    assert game.returncode == 1, stderr
    assert "Traceback" not in stderr and "gave up reconnecting" in stderr.strip().splitlines()[-1], stderr


# --- small things -------------------------------------------------------------------------------------


def test_status_json_into_a_closed_pipe_ends_without_a_traceback(tmp_path: Path) -> None:
    """`gdrl-broker status --json | head`: the reader leaves before the output is written."""
    with broker_process(tmp_path, "--games", "3") as (_, address):
        read_end, write_end = os.pipe()
        os.close(read_end)  # like `head` after its lines: nobody reads any more
        status = spawn_python("-m", "broker", "status", "--json", "--address", address, stdout=write_end,
                              stderr=subprocess.PIPE)  # fmt: skip
        os.close(write_end)
        stderr = status.communicate(timeout=60)[1].decode()
    assert status.returncode == 0 and "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr


@pytest.mark.parametrize("command", ["sim-game", "serve", "status", "demo"])
def test_subcommand_help_shows_defaults(command: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "broker", command, "--help"], capture_output=True, text=True, env=python_env()
    )
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    expected = {
        "sim-game": ["'mover' group (default: 4)", "'picker' group (default: 4)", "127.0.0.1:11008)"],
        "serve": ["(default: 11008)", "(default: hold)"],
        "status": ["(default: 5.0)", "steps/s", "held"],
        "demo": ["(default: 2)"],
    }[command]
    assert all(phrase in text for phrase in expected), result.stdout


def test_demo_output_is_ignored_by_git() -> None:
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", "gdrl-demo-output/demo.json"],
        cwd=Path(__file__).resolve().parents[1],
    )
    assert ignored.returncode == 0


GODOT_RL_TRAINING_SCRIPT = """
import sys
from godot_rl.core.godot_env import GodotEnv
GodotEnv(env_path=None, port=int(sys.argv[1]))  # listens for "the game", as a godot_rl script does
"""


def test_a_trainer_pointed_at_a_godot_rl_script_is_told_it_is_not_a_broker() -> None:
    port = free_port()
    script = spawn_python("-c", GODOT_RL_TRAINING_SCRIPT, str(port), stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        address = f"127.0.0.1:{port}"
        with pytest.raises(BrokerError) as raised:
            BrokerVecEnv("mover", address, timeout_connect=60)  # retries until the script listens
    finally:
        script.kill()
        script.wait()
    assert raised.value.code == "not_a_broker"
    assert address in raised.value.message and "plain godot_rl server" in raised.value.message
