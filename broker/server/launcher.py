"""Launch and supervise game executables, every copy pointed at the broker's one port.

``gdrl-broker serve --env-path GAME --n-parallel K`` starts K copies with godot_rl's launch arguments
(``--port=P --env_seed=S``, ``--disable-render-loop --headless`` when headless, ``--action_repeat=A``,
``--speedup=X``), so an exported godot_rl game needs no change. Unlike godot_rl every copy gets the same
port: the broker tells the games apart, not the ports.

A copy that exits while the broker runs is relaunched after a backoff (1 s, doubling to 30 s, back to
1 s once a copy has run for ``healthy_after`` seconds). Its slot's episodes end truncated in the hub and
the trainers carry on. ``stop()`` ends every copy: SIGTERM, then SIGKILL after ``timeout_stop``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import structlog

from broker.protocol import DEFAULT_PORT

log = structlog.get_logger("gdrl.launcher")

PLATFORM_SUFFIX: Final = {"linux": ".x86_64", "darwin": ".app", "win32": ".exe"}


@dataclass(frozen=True)
class LaunchSpec:
    env_path: str
    n_parallel: int = 1
    port: int = DEFAULT_PORT
    seed: int = 0
    speedup: float | None = None
    action_repeat: int | None = None
    headless: bool = False
    extra_args: tuple[str, ...] = ()


def resolve_env_path(env_path: str) -> str:
    """The executable to run, as an absolute path: the path as given, else with the platform's export
    suffix (as godot_rl adds). Absolute, because a bare name (``./game`` turned into ``game`` by Path) would
    be looked up on PATH. Raises ValueError when there is no such file or it is not executable."""
    path = Path(env_path)
    found = path if path.is_file() else None
    suffix = PLATFORM_SUFFIX.get(sys.platform)
    if found is None and suffix:
        candidate = path.with_suffix(suffix)
        if suffix == ".app":
            candidate = candidate / "Contents" / "MacOS" / path.stem
        if candidate.is_file():
            found = candidate
    if found is None:
        raise ValueError(f"--env-path {env_path}: no such game executable (looked in {Path.cwd()})")
    if not os.access(found, os.X_OK):
        raise ValueError(f"--env-path {env_path}: {found} is not executable; make it so with: chmod +x {found}")
    return os.path.abspath(found)


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def game_argv(spec: LaunchSpec, index: int, executable: str | None = None) -> list[str]:
    """Copy ``index``'s command line, in godot_rl's order; the plugin reads ``--key=value`` pairs."""
    argv = [executable or spec.env_path, f"--port={spec.port}", f"--env_seed={spec.seed + index}"]
    if spec.headless:
        argv += ["--disable-render-loop", "--headless"]
    if spec.action_repeat is not None:
        argv.append(f"--action_repeat={spec.action_repeat}")
    if spec.speedup is not None:
        argv.append(f"--speedup={_number(spec.speedup)}")
    return argv + list(spec.extra_args)


class GameLauncher:
    def __init__(
        self,
        spec: LaunchSpec,
        *,
        backoff_initial: float = 1.0,
        backoff_max: float = 30.0,
        healthy_after: float = 30.0,
        timeout_stop: float = 5.0,
    ) -> None:
        if spec.n_parallel < 1:
            raise ValueError("--n-parallel must be at least 1")
        self.spec = spec
        self.executable = resolve_env_path(spec.env_path)
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.healthy_after = healthy_after
        self.timeout_stop = timeout_stop
        self.processes: dict[int, asyncio.subprocess.Process] = {}
        self.launches = [0] * spec.n_parallel
        self.stopping = False
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        log.info("launching games", path=self.executable, copies=self.spec.n_parallel, port=self.spec.port)
        for index in range(self.spec.n_parallel):
            task = asyncio.create_task(self._supervise(index), name=f"game copy {index}")
            task.add_done_callback(self._task_done)
            self._tasks.append(task)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("game supervisor failed", task=task.get_name(), error=repr(task.exception()))

    async def _supervise(self, index: int) -> None:
        delay = self.backoff_initial
        argv = game_argv(self.spec, index, self.executable)
        while not self.stopping:
            started = time.monotonic()
            try:
                # A session of its own, as godot_rl does, so a Ctrl-C reaches the broker, which then
                # closes the games in order.
                process = await asyncio.create_subprocess_exec(*argv, start_new_session=True)
            except OSError as exc:
                log.error("cannot launch game", copy=index, path=self.executable, error=str(exc), retry_in=delay)
            else:
                self.processes[index] = process
                self.launches[index] += 1
                log.info("game launched", copy=index, pid=process.pid, launch=self.launches[index])
                code = await process.wait()
                if self.stopping:
                    return
                ran = time.monotonic() - started
                if ran >= self.healthy_after:
                    delay = self.backoff_initial
                log.warning(
                    "game exited; relaunching",
                    copy=index,
                    pid=process.pid,
                    code=code,
                    ran_s=round(ran, 1),
                    retry_in=delay,
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.backoff_max)

    def stop_relaunching(self) -> None:
        """From now on an exiting copy stays down (the broker is closing the games)."""
        self.stopping = True

    async def stop(self) -> None:
        """End every copy: SIGTERM to its process group, SIGKILL after ``timeout_stop`` seconds."""
        self.stopping = True
        running = [p for p in self.processes.values() if p.returncode is None]
        for process in running:
            _signal_group(process, signal.SIGTERM)
        if running:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.gather(*(p.wait() for p in running)), self.timeout_stop)
        for process in running:
            if process.returncode is None:
                log.warning("game did not stop; killing it", pid=process.pid)
                _signal_group(process, signal.SIGKILL)
                await process.wait()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        log.info("games stopped", copies=len(self.processes))


def _signal_group(process: asyncio.subprocess.Process, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if hasattr(os, "killpg"):
            os.killpg(process.pid, sig)  # the game's own session: its children go too
        else:
            process.send_signal(sig)
