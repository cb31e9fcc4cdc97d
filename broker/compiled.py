"""The per-step modules that ``setup.py`` compiles with mypyc, and the guard against a stale build.

Every message of every step runs through these modules, and at the sizes most games have (1 to 16 agents)
the broker's cost is Python per message, not bytes (docs/performance_history.md, "Compiled per-step modules").
Compiled, they need about half the CPU for their own work (7-32 % less of the broker's whole CPU in real runs,
where the kernel and the event loop have their share). They stay plain, typed Python: the same files run
uncompiled when the build skips mypyc (``GDRL_BROKER_PURE=1 pip install -e .``).

A compiled module shadows its source, since Python imports an extension module before a ``.py`` file of
the same name. So after a source changes (an edit, a ``git pull``) its build is stale until ``pip install
-e .`` runs again. The build records a digest of every source it compiled; on the first import of
``broker``, a source that differs from its digest makes every compiled module load from its source instead,
with a warning. So does a build left beside the source of a module that is no longer compiled (an earlier
version compiled it), which would otherwise shadow that source for good. They go together, because a compiled
module calls the others' functions directly, not through their modules. ``GDRL_BROKER_PURE=1`` at run time
does the same without the warning.

This file is also read by ``setup.py`` (run as a script, before anything is installed): standard library
only.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Final

# What every step runs through: the hub and its parts, the fast decode and encode, framing, body kinds, the
# stepping options, the checks, the connections, a peer's receive loop and writes, the polling of the loop and
# of the clients' sockets (a call after every read), and a godot_rl game's or script's per-step glue around
# legacy/_wire.c (the server stays interpreted apart from its way into the hub, entry.py; so do
# codec.py's msgspec structs and calls.py's generic records, which mypyc does not take).
COMPILED_MODULES: Final = (
    "broker.core.accumulate",
    "broker.core.batching",
    "broker.core.claims",
    "broker.core.effects",
    "broker.core.flow",
    "broker.core.holding",
    "broker.core.joining",
    "broker.core.metrics",
    "broker.core.seating",
    "broker.core.sessions",
    "broker.core.states",
    "broker.core.status",
    "broker.legacy.game_connection",
    "broker.legacy.godot_rl_game",
    "broker.legacy.godot_rl_trainer",
    "broker.legacy.wire",
    "broker.protocol.arrays",
    "broker.protocol.checks",
    "broker.protocol.connection",
    "broker.protocol.framing",
    "broker.protocol.gather",
    "broker.protocol.hot",
    "broker.protocol.kinds",
    "broker.protocol.ring",
    "broker.protocol.spaces",
    "broker.protocol.stepping",
    "broker.server.entry",
    "broker.server.peer",
    "broker.server.spinning",
    "broker.tuning",
)
# Hand-written C beside them, each module with its source: the per-step messages' codec without a Python object
# per field (broker/protocol/_native.c), and a godot_rl plugin game's per-step JSON read into arrays and written
# from them (broker/legacy/_wire.c). Built with them, guarded with them (their sources' digests too), and not
# importable whenever they run from source (their users then do their work in Python, with the same results).
NATIVE_MODULES: Final = {
    "broker.protocol._native": "protocol/_native.c",
    "broker.legacy._wire": "legacy/_wire.c",
}
GROUP_NAME: Final = "broker._compiled"  # the one shared library mypyc builds them into
DIGESTS_FILE: Final = "_compiled_sources.json"  # beside this file: each compiled source's sha256
PURE_ENV: Final = "GDRL_BROKER_PURE"

_PACKAGE_DIR: Final = Path(__file__).resolve().parent


def source_path(module: str, package_dir: Path = _PACKAGE_DIR) -> Path:
    """The ``.py`` file of one of ``COMPILED_MODULES`` (``broker.x.y`` -> ``<package_dir>/x/y.py``)."""
    return package_dir.joinpath(*module.split(".")[1:]).with_suffix(".py")


def native_source(module: str, package_dir: Path = _PACKAGE_DIR) -> Path:
    """The C source of one of ``NATIVE_MODULES``."""
    return package_dir / NATIVE_MODULES[module]


def digests(package_dir: Path = _PACKAGE_DIR) -> dict[str, str]:
    found = {m: hashlib.sha256(source_path(m, package_dir).read_bytes()).hexdigest() for m in COMPILED_MODULES}
    for module in NATIVE_MODULES:
        found[module] = hashlib.sha256(native_source(module, package_dir).read_bytes()).hexdigest()
    return found


def write_digests(package_dir: Path) -> None:
    """Called by the build when it compiles: what the compiled modules were built from."""
    text = json.dumps(digests(package_dir), indent=1, sort_keys=True) + "\n"
    (package_dir / DIGESTS_FILE).write_text(text, encoding="utf-8")


def extension_modules(package_dir: Path = _PACKAGE_DIR) -> dict[str, Path]:
    """Every module of the package that has a compiled build beside its source, with that build's path."""
    found: dict[str, Path] = {}
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        for path in package_dir.rglob(f"*{suffix}"):
            source = path.with_name(path.name[: -len(suffix)] + ".py")
            if source.is_file():  # not the shared library itself, which has no source
                parts = source.relative_to(package_dir).with_suffix("").parts
                found[".".join((package_dir.name, *parts))] = path
    return found


def stale_modules() -> list[str]:
    """Compiled modules whose source is not what they were built from (all of them, without digests)."""
    try:
        built = json.loads((_PACKAGE_DIR / DIGESTS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        built = {}
    now = digests()
    return [m for m in (*COMPILED_MODULES, *NATIVE_MODULES) if built.get(m) != now[m]]


class _SourceFirst(importlib.abc.MetaPathFinder):
    """Loads the named modules from their ``.py`` files, ahead of their compiled builds."""

    def __init__(self, modules: Sequence[str]) -> None:
        self.modules = frozenset(modules)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname in NATIVE_MODULES:  # C, with no source to run instead: its users take their Python way
            raise ModuleNotFoundError(f"{fullname} is off while the per-step modules run from source", name=fullname)
        if fullname not in self.modules:
            return None
        return importlib.util.spec_from_file_location(fullname, source_path(fullname))


def guard() -> None:
    """Run once, by ``broker/__init__.py``: decide between the compiled modules and their sources."""
    built = extension_modules()
    if not built:
        return  # a pure build
    # A build of a module that is no longer compiled (left by an earlier version) would shadow its source
    # for good: it runs from source too, and the warning says to delete it.
    leftovers = sorted(m for m in built if m not in COMPILED_MODULES)
    pure = os.environ.get(PURE_ENV) == "1"
    stale = [] if pure else stale_modules()
    if not pure and not stale and not leftovers:
        return
    problems = []
    if stale:
        problems.append(f"the compiled build is older than {', '.join(stale)}: run `pip install -e .` again")
    if leftovers:
        paths = ", ".join(str(built[m]) for m in leftovers)
        problems.append(f"{paths} {'is' if len(leftovers) == 1 else 'are'} left from an earlier build: delete")
    if problems and not pure:
        warnings.warn(
            f"godot-rl-broker: {'; '.join(problems)}. Meanwhile every per-step module runs from source (slower).",
            RuntimeWarning,
            stacklevel=3,
        )
    sys.meta_path.insert(0, _SourceFirst([*COMPILED_MODULES, *leftovers]))


def active() -> bool:
    """Whether the per-step modules running in this process are the compiled ones."""
    module = sys.modules.get("broker.core.flow")
    if module is None:
        import broker.core.flow as module
    return not str(getattr(module, "__file__", "")).endswith(".py")
