"""Timing of steps inside a trainer, and process numbers read from /proc (Linux).

Windows are in ``time.monotonic()`` seconds, which on Linux is CLOCK_MONOTONIC, the same clock in every
process, so the orchestrator can read another process's CPU time over a trainer's window.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class Meter:
    """Warm up, then time every step of a window; print one JSON line when the window closes."""

    def __init__(self, warmup_s: float, measure_s: float, min_steps: int, n_envs: int, what: str) -> None:
        self.warmup_s = warmup_s
        self.measure_s = measure_s
        self.min_steps = min_steps
        self.n_envs = n_envs
        self.what = what
        self.latencies: list[float] = []
        self.warm_steps = 0
        self.first_step: float | None = None
        self.window_start: float | None = None
        self.done = False

    def record(self, started: float, ended: float) -> None:
        """One step, from ``started`` to ``ended`` (perf_counter seconds)."""
        if self.done:
            return
        now = time.monotonic()
        if self.window_start is None:
            if self.first_step is None:
                self.first_step = now
            self.warm_steps += 1
            if self.warm_steps >= self.min_steps and now - self.first_step >= self.warmup_s:
                self.window_start = now
            return
        self.latencies.append(ended - started)
        if len(self.latencies) >= self.min_steps and now - self.window_start >= self.measure_s:
            self.done = True
            emit({"event": "result", **self.summary(now)})

    def summary(self, window_end: float) -> dict[str, Any]:
        assert self.window_start is not None
        latencies = np.asarray(self.latencies)
        elapsed = window_end - self.window_start
        return {
            "what": self.what,
            "n_envs": self.n_envs,
            "steps": len(latencies),
            "window": [self.window_start, window_end],
            "steps_per_s": len(latencies) / elapsed,
            "agent_steps_per_s": self.n_envs * len(latencies) / elapsed,
            "latency_mean_ms": float(latencies.mean() * 1e3),
            "latency_p99_ms": float(np.percentile(latencies, 99) * 1e3),
            "latencies_ms": [round(x * 1e3, 4) for x in latencies.tolist()],
        }


_EMITTING = threading.Lock()


def emit(event: dict[str, Any]) -> None:
    """Report to the orchestrator: one JSON line on stdout. One writer at a time: the in-process trainers
    (a thread per policy) end their windows in the same lock-step, and two lines written at once can
    interleave, so the orchestrator would find neither."""
    line = json.dumps(event) + "\n"
    with _EMITTING:
        sys.stdout.write(line)
        sys.stdout.flush()


@dataclass
class ProcSample:
    t: float  # monotonic
    cpu_s: float  # user + system, all threads (or the one thread sampled)
    rss_bytes: int
    hwm_bytes: int
    io_bytes: int  # rchar + wchar: bytes through read/write calls, sockets included


def _stat_cpu(path: str) -> float:
    with open(path) as f:
        text = f.read()
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime


def _schedstat_cpu(pid: int, tid: int | None) -> float | None:
    """CPU seconds from the scheduler's nanosecond counters, summed over the process's threads (or of one
    thread). /proc/PID/stat counts in clock ticks (10 ms): a lean game uses less than one tick in a window."""
    tids = [tid] if tid is not None else [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    total = 0
    try:
        for t in tids:
            with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                total += int(f.read().split()[0])
    except FileNotFoundError:
        if tid is not None or not os.path.exists(f"/proc/{pid}/task/{tids[0]}/schedstat"):
            return None  # no schedstat on this kernel
        return _schedstat_cpu(pid, None)  # a thread ended between listing and reading: count again
    return total / 1e9


def _status_kb(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":", 1)
                out[key] = int(value.split()[0]) * 1024
    return out


def _io_bytes(pid: int) -> int:
    total = 0
    try:
        with open(f"/proc/{pid}/io") as f:
            for line in f:
                if line.startswith(("rchar:", "wchar:")):
                    total += int(line.split()[1])
    except OSError:  # not readable on some kernels; bytes are then not reported
        return -1
    return total


def sample_process(pid: int, tid: int | None = None) -> ProcSample | None:
    """CPU (of one thread if ``tid``), RSS, peak RSS and I/O bytes of a process; None once it is gone."""
    try:
        now = time.monotonic()
        cpu = _schedstat_cpu(pid, tid)
        if cpu is None:
            cpu = _stat_cpu(f"/proc/{pid}/task/{tid}/stat" if tid is not None else f"/proc/{pid}/stat")
        status = _status_kb(pid)
        return ProcSample(now, cpu, status.get("VmRSS", 0), status.get("VmHWM", 0), _io_bytes(pid))
    except (OSError, ValueError, IndexError):
        return None


def interpolate(samples: list[ProcSample], t: float, field: str) -> float:
    """A sampled counter at time ``t``, linearly between the samples around it."""
    if not samples:
        return float("nan")
    samples = sorted(samples, key=lambda s: s.t)
    times = [s.t for s in samples]
    values = [float(getattr(s, field)) for s in samples]
    return float(np.interp(t, times, values))
