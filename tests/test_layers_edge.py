"""The edge's layering (issue 18 item 1): broker/legacy is sans-IO and never reaches into the server; the
server builds on legacy's sans-IO classes only; asyncio code of the godot_rl side lives in broker/server."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LEGACY = sorted((ROOT / "broker" / "legacy").glob("*.py"))
SERVER = sorted((ROOT / "broker" / "server").glob("*.py"))
IO_MODULES = ("asyncio", "socket", "selectors", "uvloop", "threading")


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports (``from a.b import c`` counts as ``a.b`` and ``a.b.c``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def offending(path: Path, prefixes: tuple[str, ...]) -> list[str]:
    return sorted(m for m in imports(path) if any(m == p or m.startswith(p + ".") for p in prefixes))


@pytest.mark.parametrize("path", LEGACY, ids=lambda p: p.name)
def test_legacy_does_no_io(path: Path) -> None:
    assert not offending(path, IO_MODULES), f"{path.name} imports I/O: timers and sockets belong to broker/server"


@pytest.mark.parametrize("path", LEGACY, ids=lambda p: p.name)
def test_legacy_does_not_import_the_server(path: Path) -> None:
    assert not offending(path, ("broker.server", "broker.cli")), f"{path.name} reaches up into the server"


@pytest.mark.parametrize("path", SERVER, ids=lambda p: p.name)
def test_the_server_uses_only_legacy_s_sans_io_modules(path: Path) -> None:
    used = {m.split(".")[2] for m in offending(path, ("broker.legacy",)) if m.count(".") >= 2}
    for module in sorted(used):
        source = ROOT / "broker" / "legacy" / f"{module}.py"
        assert source.exists(), f"{path.name} imports broker.legacy.{module}, which is not a module"
        assert not offending(source, IO_MODULES), f"{path.name} uses broker.legacy.{module}, which does I/O"


def test_no_legacy_edge_module_and_the_daemon_finds_the_dialer_in_the_server() -> None:
    assert not (ROOT / "broker" / "legacy" / "edge.py").exists()
    daemon = imports(ROOT / "broker" / "server" / "daemon.py")
    assert "broker.server.dialer.GodotRlTrainerConnector" in daemon
    for path in (ROOT / "broker" / "cli.py", ROOT / "broker" / "server" / "daemon.py"):
        assert not offending(path, ("broker.legacy",))


def test_plugin_game_connections_have_one_way_in() -> None:
    """PeerProtocol has no injected send/close callables and no untyped legacy handler."""
    source = (ROOT / "broker" / "server" / "server.py").read_text()
    for name in ("legacy_send", "legacy_close", "legacy_handler", "handle_legacy", "send_raw"):
        assert name not in source, f"server.py still has {name}"
