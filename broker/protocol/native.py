"""The C codec of the per-step messages (``_native.c``), or None: a pure build, or a process whose per-step
modules run from source (``GDRL_BROKER_PURE=1``, a stale build: broker/compiled.py keeps it from importing).
Its users (hot.py, spaces.py) then take their Python way, with the same results."""

from __future__ import annotations

from typing import Any, Final


def _load() -> Any:
    try:
        from broker.protocol import _native
    except ImportError:
        return None
    return _native


NATIVE: Final[Any] = _load()
