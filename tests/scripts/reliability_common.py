"""Shared pieces of the reliability tests: a broker subprocess on a chosen port, raw sockets that speak
(or abuse) the wire protocol, process memory, and JSON reports that helper processes rewrite atomically."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from broker.protocol.framing import HEADER, encode_frame
from tests.helpers import python_env

LOOPBACK = "127.0.0.1"


@dataclass
class Broker:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def rss(self) -> int:
        return rss_bytes(self.proc.pid)


@contextmanager
def broker(
    tmp_path: Path, *args: str, port: int = 0, timeout: float = 30.0, env: dict[str, str] | None = None
) -> Iterator[Broker]:
    """``gdrl-broker serve ARGS`` on ``port`` (0: the OS picks one); SIGTERM (then SIGKILL) at exit."""
    proc, port_, log_path = start_broker(tmp_path, *args, port=port, timeout=timeout, env=env)
    try:
        yield Broker(proc, port_, log_path)
    finally:
        stop(proc, signal.SIGTERM, timeout=20)


def start_broker(
    tmp_path: Path, *args: str, port: int = 0, timeout: float = 30.0, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], int, Path]:
    """Start the broker (``env``: extra environment variables) and wait until it listens."""
    stamp = time.monotonic_ns()
    port_file = tmp_path / f"port-{stamp}"
    log_path = tmp_path / f"broker-{stamp}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "broker", "serve", "--port", str(port), "--port-file", str(port_file), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**python_env(), **(env or {})},
        )
    deadline = time.monotonic() + timeout
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc, signal.SIGKILL)
            raise RuntimeError(f"broker did not start: {log_path.read_text()}")
        time.sleep(0.02)
    return proc, int(port_file.read_text()), log_path


def stop(proc: subprocess.Popen[Any], sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
    """Signal ``proc`` (if it still runs) and reap it; SIGKILL after ``timeout``. Returns the exit code."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return int(proc.returncode)


def exit_code(proc: subprocess.Popen[Any], timeout: float = 20.0) -> int | str:
    """Wait for ``proc`` to end by itself; "hung" (and SIGKILL) if it does not within ``timeout``."""
    try:
        return int(proc.wait(timeout=timeout))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return "hung"


def spawn(module: str, *args: str, log_path: Path | None = None) -> subprocess.Popen[bytes]:
    """``python -m MODULE ARGS`` with this checkout importable; output to ``log_path`` (or discarded)."""
    out: Any = open(log_path, "wb") if log_path is not None else subprocess.DEVNULL
    try:
        return subprocess.Popen(
            [sys.executable, "-m", module, *args], stdout=out, stderr=subprocess.STDOUT, env=python_env()
        )
    finally:
        if log_path is not None:
            out.close()


def rss_bytes(pid: int) -> int:
    """Resident set size of a process, from /proc (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll ``predicate`` until it returns something truthy; raise AssertionError naming ``what`` on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


# --- reports written by helper processes ----------------------------------------------------------


def write_report(path: str | Path, report: dict[str, Any]) -> None:
    """Write JSON so that a reader never sees half a file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(report, f)
    os.replace(tmp, path)


def read_report(path: str | Path) -> dict[str, Any]:
    try:
        return dict(json.loads(Path(path).read_text()))
    except FileNotFoundError:
        return {}


# --- raw wire access --------------------------------------------------------------------------------


class RawPeer:
    """A bare TCP connection to the broker for sending arbitrary bytes and reading its frames."""

    def __init__(self, address: str, timeout: float = 10.0, rcvbuf: int | None = None) -> None:
        host, _, port = address.rpartition(":")
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:  # before connect, so the window stays small
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(timeout)
        self.sock.connect((host, int(port)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.local_port = int(self.sock.getsockname()[1])
        self.label = f"{LOOPBACK}:{self.local_port}"
        self._buffer = bytearray()
        self.eof = False

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send_message(self, message: dict[str, Any]) -> None:
        self.send(encode_frame(msgpack.packb(message, use_bin_type=True)))

    def read_frame(self) -> bytes | None:
        """The next frame body, or None at end of stream."""
        while True:
            if len(self._buffer) >= HEADER.size:
                (length,) = HEADER.unpack_from(self._buffer)
                if len(self._buffer) >= HEADER.size + length:
                    body = bytes(self._buffer[HEADER.size : HEADER.size + length])
                    del self._buffer[: HEADER.size + length]
                    return body
            if self.eof:
                return None
            try:
                data = self.sock.recv(1 << 16)
            except ConnectionResetError:
                data = b""
            if not data:
                self.eof = True
            self._buffer += data

    def read_greeting(self) -> list[dict[str, Any]]:
        return [json.loads(self.read_frame() or b"null") for _ in range(2)]

    def read_message(self) -> dict[str, Any] | None:
        body = self.read_frame()
        if body is None:
            return None
        return dict(msgpack.unpackb(body, raw=False, strict_map_key=False))

    def read_until_closed(self) -> list[dict[str, Any]]:
        """Every message until the broker closes the connection."""
        out = []
        while (message := self.read_message()) is not None:
            out.append(message)
        return out

    def error_then_close(self) -> dict[str, Any]:
        """The broker's last word: the error frame before it closed (the greeting is skipped if unread)."""
        messages = []
        while (body := self.read_frame()) is not None:
            if body[:1] != b"{":
                messages.append(dict(msgpack.unpackb(body, raw=False, strict_map_key=False)))
        errors = [m for m in messages if m.get("type") == "error"]
        assert errors, f"no error frame before close, got {messages}"
        return errors[-1]

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def log_events(log: str) -> list[dict[str, Any]]:
    """The JSON log lines of a broker started with ``--log-json`` (other lines are skipped)."""
    events = []
    for line in log.splitlines():
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except ValueError:
                continue
    return events


PEER_ERROR_EVENTS = ("peer error", "godot_rl game refused")


def peer_errors(log: str, peer: RawPeer) -> list[dict[str, Any]]:
    """The broker's "peer error" log events about this peer (a refused godot_rl plugin game's is logged as
    "godot_rl game refused", since it is told in the plugin's own words)."""
    return [e for e in log_events(log) if e.get("event") in PEER_ERROR_EVENTS and e.get("peer") == peer.label]
