"""The fence between the layers, read from the source (AST), so a wrong import fails here and not in review.

* broker.protocol and broker.core are sans-IO: no sockets, asyncio or subprocesses, nothing from the server,
  the godot_rl edge or the clients; dependencies point one way (protocol <- core).
* asyncio lives in broker/server/ only (clients are blocking: SB3 is synchronous).
* broker/legacy/ is sans-IO, and broker/server/ takes no asyncio code from it.
* The broker never imports the clients; clients use only the broker's public API.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {"asyncio", "socket", "selectors", "uvloop", "subprocess", "broker.server", "broker.legacy", "clients"}
ASYNC_IO = ("asyncio", "uvloop")
# Where asyncio may be imported. broker/legacy/ has its own rule (test_legacy_is_sans_io).
ASYNC_HOMES = ("broker/server/", "broker/legacy/")
# What clients may import from the broker: the wire, the public server API (the names in
# broker/server/__init__.py's __all__), and the broker's top-level helpers that do no I/O of their own.
CLIENT_VISIBLE = (
    "broker",
    "broker.protocol",
    "broker.server",
    "broker.log",
    "broker.tuning",
    "broker.cli",
    "broker.status",
)
# ``python -m broker`` is the gdrl-broker program, whose peer subcommands live in clients/: this one entry
# point (never imported by the library) may import clients.cli, and nothing else of clients.
PROGRAM_ENTRY = "broker/__main__.py"


@dataclass(frozen=True)
class Import:
    path: str  # relative to the repository, e.g. "broker/cli.py"
    line: int
    module: str  # the module imported, or imported from
    name: str | None = None  # the name taken by ``from module import name``

    @property
    def targets(self) -> set[str]:
        """The module, and the submodule ``module.name`` if ``name`` is one."""
        found = {self.module}
        if self.name is not None and _is_module(f"{self.module}.{self.name}"):
            found.add(f"{self.module}.{self.name}")
        return found

    def __str__(self) -> str:
        what = f"from {self.module} import {self.name}" if self.name else f"import {self.module}"
        return f"{self.path}:{self.line}: {what}"


def _is_module(dotted: str) -> bool:
    base = ROOT.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _package_of(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).parts[:-1])  # a module's package is its folder


def imports_of(path: Path) -> list[Import]:
    """Every import in ``path``, those under ``if TYPE_CHECKING:`` and inside functions included."""
    rel = path.relative_to(ROOT).as_posix()
    found: list[Import] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [Import(rel, node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative: resolve against this file's package
                package = _package_of(path).split(".")
                base = ".".join(package[: len(package) - node.level + 1])
                module = f"{base}.{module}" if module else base
            found += [Import(rel, node.lineno, module, alias.name) for alias in node.names]
    return found


def sources(*folders: str) -> list[Path]:
    return sorted(path for folder in folders for path in (ROOT / folder).rglob("*.py"))


def under(module: str, prefixes: tuple[str, ...] | set[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def offending(paths: list[Path], prefixes: tuple[str, ...] | set[str]) -> list[str]:
    return [str(i) for path in paths for i in imports_of(path) if any(under(t, prefixes) for t in i.targets)]


def public_server_api() -> set[str]:
    tree = ast.parse((ROOT / "broker" / "server" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


# --- the sans-IO core ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    sorted((ROOT / "broker" / "protocol").glob("*.py")) + sorted((ROOT / "broker" / "core").glob("*.py")),
    ids=lambda p: f"{p.parent.name}/{p.name}",
)
def test_sans_io_module_imports(path: Path) -> None:
    bad = {t for i in imports_of(path) for t in i.targets if under(t, FORBIDDEN)}
    assert not bad, f"{path.name} imports {sorted(bad)}"


def test_protocol_and_core_depend_one_way() -> None:
    """protocol imports nothing else of the broker; core only protocol (and itself)."""
    allowed = {"broker/protocol": ("broker.protocol",), "broker/core": ("broker.protocol", "broker.core")}
    bad = [
        str(i)
        for folder, ok in allowed.items()
        for path in sources(folder)
        for i in imports_of(path)
        if under(i.module, ("broker",)) and not under(i.module, ok)
    ]
    assert not bad, "imports against the layer order (protocol <- core):\n" + "\n".join(bad)


# --- asyncio in one place --------------------------------------------------------------------------


def test_asyncio_only_in_server() -> None:
    paths = [p for p in sources("broker", "clients") if not p.relative_to(ROOT).as_posix().startswith(ASYNC_HOMES)]
    bad = offending(paths, ASYNC_IO)
    assert not bad, "asyncio outside broker/server/:\n" + "\n".join(bad)


def test_legacy_is_sans_io() -> None:
    bad = offending(sources("broker/legacy"), ("asyncio", "uvloop", "socket", "selectors", "broker.server"))
    assert not bad, "broker/legacy/ must be sans-IO and must not import the server:\n" + "\n".join(bad)


def _asyncio_code_in_legacy() -> dict[str, set[str]]:
    """Per broker.legacy module: every name it defines, if the module imports asyncio (its classes and
    functions are the asyncio glue); else its classes that derive from an asyncio class."""
    found: dict[str, set[str]] = {}
    for path in sources("broker/legacy"):
        tree = ast.parse(path.read_text())
        module = _package_of(path) + ("" if path.name == "__init__.py" else f".{path.stem}")
        uses_asyncio = any(under(t, ASYNC_IO) for i in imports_of(path) for t in i.targets)
        defined = [n for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
        found[module] = {
            n.name
            for n in defined
            if uses_asyncio or (isinstance(n, ast.ClassDef) and any("asyncio" in ast.unparse(base) for base in n.bases))
        }
    return found


def test_server_takes_no_asyncio_code_from_legacy() -> None:
    asyncio_code = _asyncio_code_in_legacy()
    bad = [
        f"{i} (asyncio code of {i.module})"
        for path in sources("broker/server")
        for i in imports_of(path)
        if under(i.module, ("broker.legacy",)) and (i.name in asyncio_code.get(i.module, set()) or i.name == "*")
    ]
    assert not bad, "broker/server/ drives legacy/ sans-IO objects, never legacy asyncio code:\n" + "\n".join(bad)


# --- broker and clients ----------------------------------------------------------------------------


def test_broker_never_imports_clients() -> None:
    paths = [p for p in sources("broker") if p.relative_to(ROOT).as_posix() != PROGRAM_ENTRY]
    bad = offending(paths, ("clients",))
    assert not bad, "the broker imports the clients:\n" + "\n".join(bad)


def test_the_program_entry_takes_only_the_program_from_clients() -> None:
    taken = {(i.module, i.name) for i in imports_of(ROOT / PROGRAM_ENTRY)}
    assert taken == {("clients.cli", "main")}, f"{PROGRAM_ENTRY} may import clients.cli's main only: {taken}"


def test_clients_use_only_the_public_broker_api() -> None:
    public = public_server_api()
    assert {"ServerConfig", "BrokerServer", "attach_trainer"} <= public, public
    bad = []
    for path in sources("clients"):
        for i in imports_of(path):
            if not under(i.module, ("broker",)):
                continue
            hidden = [t for t in i.targets if t not in CLIENT_VISIBLE and not under(t, ("broker.protocol",))]
            private_server_name = i.module == "broker.server" and i.name not in public  # None: the whole package
            if hidden or private_server_name:
                bad.append(str(i))
    assert not bad, f"clients reach broker internals (public server API: {sorted(public)}):\n" + "\n".join(bad)


def test_the_fence_sees_imports() -> None:
    """The reader the rules rely on finds what is there (so the rules above are not vacuous)."""
    found = imports_of(ROOT / "clients" / "inprocess.py")
    assert any(i.module == "broker.server" and i.name == "attach_trainer" for i in found), found
    assert Import("clients/x.py", 1, "broker", "core").targets == {"broker", "broker.core"}  # a submodule
    assert Import("clients/x.py", 1, "broker", "__version__").targets == {"broker"}  # a plain name
    assert offending([ROOT / "broker" / "server" / "daemon.py"], ASYNC_IO), "daemon.py imports asyncio"
    [entry] = offending([ROOT / PROGRAM_ENTRY], ("clients",))
    assert entry.startswith(f"{PROGRAM_ENTRY}:") and entry.endswith(": from clients.cli import main"), entry


def test_the_program_is_the_clients_cli_and_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    """One parser: ``gdrl-broker`` (console script and ``python -m broker``) is clients.cli.main, which adds
    the peers' subcommands to broker.cli's parser; broker.cli alone knows ``serve`` only."""
    from broker import cli as broker_cli
    from clients import cli

    script = re.search(r'^gdrl-broker = "(.*)"$', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert script is not None and script.group(1) == "clients.cli:main"  # tomllib is 3.11+; this runs on 3.10
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "{serve,sim-game,demo,status,freeze,unfreeze}" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        broker_cli.main(["--help"])
    assert "{serve}" in capsys.readouterr().out
