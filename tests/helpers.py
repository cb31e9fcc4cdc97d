"""Shared test helpers: brokers as real subprocesses or in-process, on loopback ports chosen by the OS."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def python_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@contextmanager
def broker_process(tmp_path: Path, *args: str, timeout: float = 20.0) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """``gdrl-broker serve --port 0 ARGS`` as a subprocess; yields (process, "127.0.0.1:PORT")."""
    port_file = tmp_path / f"port-{time.monotonic_ns()}"
    log = open(tmp_path / f"broker-{time.monotonic_ns()}.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "broker", "serve", "--port", "0", "--port-file", str(port_file), *args],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=python_env(),
    )
    try:
        deadline = time.monotonic() + timeout
        while not port_file.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"broker did not start: {Path(log.name).read_text()}")
            time.sleep(0.02)
        yield proc, f"127.0.0.1:{port_file.read_text()}"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


def spawn_python(*args: str, **kwargs: object) -> subprocess.Popen[bytes]:
    """``python ARGS`` with this checkout importable."""
    return subprocess.Popen([sys.executable, *args], env=python_env(), **kwargs)  # type: ignore[call-overload]
