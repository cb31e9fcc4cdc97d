"""The sans-IO layers stay sans-IO: broker.protocol and broker.core never import sockets or asyncio, and
import nothing from the edge or the clients."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {"asyncio", "socket", "selectors", "uvloop", "subprocess", "broker.server", "clients"}


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize(
    "path",
    sorted((ROOT / "broker" / "protocol").glob("*.py")) + sorted((ROOT / "broker" / "core").glob("*.py")),
    ids=lambda p: f"{p.parent.name}/{p.name}",
)
def test_sans_io_module_imports(path: Path) -> None:
    bad = {m for m in imported_modules(path) if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)}
    assert not bad, f"{path.name} imports {sorted(bad)}"
