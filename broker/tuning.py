"""Process-wide allocator settings for a process that moves large frames every step.

Frames of hundreds of KiB to tens of MiB are allocated and freed on every step. With glibc's defaults each
one above the mmap threshold is mmap'd and unmapped again (or the heap is trimmed and regrown), and the
page faults on the fresh pages cost more than copying the bytes. Serving them from the heap and keeping
freed heap memory makes every later step reuse warm pages. The cost: up to 256 MiB of freed memory stays
with the process. ``GDRL_BROKER_MALLOC_TUNING=0`` in the environment leaves the allocator alone.

``trim_heap`` gives that kept memory back (glibc's ``malloc_trim``): the broker calls it when a peer that
sent large frames, or any game, has left, so RSS returns near where it was (issue #14).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

# glibc's largest allowed mmap threshold on 64-bit systems (HEAP_MAX / 2).
DEFAULT_MMAP_THRESHOLD = 32 << 20
# Freed heap memory kept by the process instead of being returned to the OS.
DEFAULT_TRIM_THRESHOLD = 256 << 20

_tuned = False


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
