"""The hand-written C modules (broker/compiled.py's ``NATIVE_MODULES``), each as a module or None: a pure build, or
a process whose per-step modules run from source (``GDRL_BROKER_PURE=1``, a stale build: broker/compiled.py keeps
them from importing). Their users then take their Python way, with the same results."""

from __future__ import annotations

import importlib
from typing import Any, Final


def load_c(module: str) -> Any:
    """``module`` (one of ``NATIVE_MODULES``), or None when it cannot be imported here."""
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


NATIVE: Final[Any] = load_c("broker.protocol._native")  # the per-step messages' codec (hot.py, spaces.py)
