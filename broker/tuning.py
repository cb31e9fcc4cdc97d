"""Process-wide allocator settings for a process that moves large frames every step.

Frames of hundreds of KiB to tens of MiB are allocated and freed on every step. With glibc's defaults each
one above the mmap threshold is mmap'd and unmapped again (or the heap is trimmed and regrown), and the
page faults on the fresh pages cost more than copying the bytes. Serving them from the heap and keeping
freed heap memory makes every later step reuse warm pages. The cost: up to 256 MiB of freed memory stays
with the process. ``GDRL_BROKER_MALLOC_TUNING=0`` in the environment leaves the allocator alone.

``trim_heap`` gives that kept memory back (glibc's ``malloc_trim``): the broker calls it when a peer that
sent large frames, or any game, has left, so RSS returns near where it was (issue #14).

``SpinBudget``: how long a process waiting for a message first asks for it without sleeping (the clients'
sockets, clients/transport.py; the in-process broker's loop, broker/server/spinning.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from typing import Final

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

# glibc's largest allowed mmap threshold on 64-bit systems (HEAP_MAX / 2).
DEFAULT_MMAP_THRESHOLD = 32 << 20
# Freed heap memory kept by the process instead of being returned to the OS.
DEFAULT_TRIM_THRESHOLD = 256 << 20

_tuned = False

# How long a wait for a message first asks for it without sleeping, yielding the core between asks. A peer
# asleep costs its sender a wake-up (20-35 us of CPU and latency each on a 2-core VM, four a lock-step through
# the broker), which an answer that comes within the spin does not (docs/performance_history.md, "Waiting without
# sleeping"). 0: never.
SPIN_WAIT_S: Final = 200e-6


class SpinBudget:
    """How long the next wait may spin. Adaptive, so that spinning costs little where answers take longer (a
    busy broker, more busy processes than cores): after a spin that found nothing the next 1, 3, 7, ... up to
    ``MAX_SKIPS`` waits block at once; a spin that found its answer lets the next one spin too."""

    MAX_SKIPS: Final = 31

    def __init__(self, spin_s: float = SPIN_WAIT_S) -> None:
        self.spin_s = spin_s
        self._skip = 0  # waits left that block at once
        self._skips_after_miss = 0

    def next_spin(self) -> float:
        """Seconds the next wait may spin; 0: block at once."""
        if self.spin_s <= 0:
            return 0.0
        if self._skip:
            self._skip -= 1
            return 0.0
        return self.spin_s

    def found(self) -> None:
        self._skips_after_miss = 0

    def missed(self) -> None:
        self._skip = self._skips_after_miss = min(2 * self._skips_after_miss + 1, self.MAX_SKIPS)


def tune_allocator(mmap_threshold: int = DEFAULT_MMAP_THRESHOLD, trim_threshold: int = DEFAULT_TRIM_THRESHOLD) -> bool:
    """Apply the settings once per process; False where the C library is not glibc (musl, macOS, Windows)."""
    global _tuned
    if _tuned:
        return True
    if not sys.platform.startswith("linux") or os.environ.get("GDRL_BROKER_MALLOC_TUNING") == "0":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    _tuned = bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(M_TRIM_THRESHOLD, trim_threshold))
    return _tuned


def trim_heap() -> bool:
    """Return freed heap memory to the OS; False where the C library has no ``malloc_trim``."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    trim(0)
    return True
