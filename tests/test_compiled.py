"""The compiled per-step modules (broker/compiled.py, setup.py): in use when built, and never stale.

The README's set-up compiles them; ``.ci/run`` sets ``GDRL_REQUIRE_COMPILED=1``, so there these tests fail
rather than skip when the build did not compile. The stale-build checks run on a copy of the installed
package, with one source changed, in a fresh interpreter.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import broker
from broker import compiled

PACKAGE_DIR = Path(broker.__file__).resolve().parent


def _compiled_build() -> bool:
    return set(compiled.extension_modules()) == set(compiled.COMPILED_MODULES)


@pytest.fixture
def compiled_build() -> None:
    if _compiled_build():
        return
    reason = "the package was built without mypyc (GDRL_BROKER_PURE=1, or no C compiler)"
    if os.environ.get("GDRL_REQUIRE_COMPILED") == "1":
        pytest.fail(f"GDRL_REQUIRE_COMPILED=1 but {reason}")
    pytest.skip(reason)


def _probe(package_parent: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``broker.compiled.active()`` in a fresh interpreter importing the package under ``package_parent``."""
    code = "import broker.compiled as c, broker.core.flow as f; print(c.active(), f.__file__)"
    full_env = {k: v for k, v in os.environ.items() if k != compiled.PURE_ENV}
    full_env.update(env or {}, PYTHONPATH=str(package_parent))
    return subprocess.run(
        [sys.executable, "-W", "always", "-c", code],
        cwd=package_parent,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _copy_package(tmp_path: Path) -> Path:
    shutil.copytree(PACKAGE_DIR, tmp_path / "broker", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def test_every_compiled_module_exists_and_is_listed_once() -> None:
    assert len(set(compiled.COMPILED_MODULES)) == len(compiled.COMPILED_MODULES)
    for module in compiled.COMPILED_MODULES:
        assert compiled.source_path(module).is_file(), module


def test_this_process_runs_the_compiled_modules(compiled_build: None) -> None:
    assert compiled.stale_modules() == []
    assert compiled.active()
    for module in compiled.COMPILED_MODULES:
        file = sys.modules[module].__file__ if module in sys.modules else __import__(module, fromlist=["_"]).__file__
        assert file is not None and not file.endswith(".py"), module


def test_the_compiled_send_effect_is_read_only_and_compares_by_value(compiled_build: None) -> None:
    """``Send`` is a plain class for its compiled constructor; its ``Final`` attributes keep it immutable."""
    from broker.core.effects import Send
    from broker.protocol.messages import Close

    class Peer:
        label = "game 0"

    peer = Peer()
    send = Send(peer, Close("bye"))
    with pytest.raises(AttributeError):
        send.peer = Peer()  # type: ignore[misc]
    with pytest.raises(AttributeError):
        send.message = Close("other")  # type: ignore[misc]
    assert send == Send(peer, Close("bye"))
    assert send != Send(peer, Close("other")) and send != Send(Peer(), Close("bye"))
    assert hash(send) == hash(Send(peer, Close("bye")))
    assert repr(send) == f"Send(peer={peer!r}, message=Close(reason='bye'))"


def test_a_copy_of_the_build_runs_compiled(compiled_build: None, tmp_path: Path) -> None:
    result = _probe(_copy_package(tmp_path))
    assert result.returncode == 0, result.stderr
    active, file = result.stdout.split()
    assert active == "True" and file.startswith(str(tmp_path)) and not file.endswith(".py")
    assert "RuntimeWarning" not in result.stderr


def test_a_changed_source_runs_every_module_from_source_with_a_warning(compiled_build: None, tmp_path: Path) -> None:
    root = _copy_package(tmp_path)
    changed = compiled.source_path("broker.core.states", root / "broker")
    changed.write_text(changed.read_text(encoding="utf-8") + "\n# changed after the build\n", encoding="utf-8")
    result = _probe(root)
    assert result.returncode == 0, result.stderr
    active, file = result.stdout.split()
    assert active == "False" and file == str(root / "broker" / "core" / "flow.py")
    assert "RuntimeWarning" in result.stderr and "broker.core.states" in result.stderr
    assert "pip install -e ." in result.stderr


def test_without_digests_the_build_counts_as_stale(compiled_build: None, tmp_path: Path) -> None:
    root = _copy_package(tmp_path)
    (root / "broker" / compiled.DIGESTS_FILE).unlink()
    result = _probe(root)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[0] == "False" and "RuntimeWarning" in result.stderr


def test_the_pure_switch_runs_from_source_without_a_warning(compiled_build: None, tmp_path: Path) -> None:
    result = _probe(_copy_package(tmp_path), {compiled.PURE_ENV: "1"})
    assert result.returncode == 0, result.stderr
    active, file = result.stdout.split()
    assert active == "False" and file.endswith("flow.py")
    assert "RuntimeWarning" not in result.stderr


def test_a_build_left_by_an_earlier_version_runs_from_source_with_a_warning(
    compiled_build: None, tmp_path: Path
) -> None:
    """A module compiled by an earlier version and no longer listed: its build must not shadow its source."""
    root = _copy_package(tmp_path)
    flow_build = compiled.extension_modules(root / "broker")["broker.core.flow"]
    suffix = flow_build.name[len("flow") :]
    leftover = root / "broker" / "core" / f"elo{suffix}"  # a build that is not elo's: importing it would fail
    shutil.copy(flow_build, leftover)
    code = "import broker.compiled as c, broker.core.elo as e; print(c.active(), e.__file__)"
    env = {k: v for k, v in os.environ.items() if k != compiled.PURE_ENV}
    result = subprocess.run(
        [sys.executable, "-W", "always", "-c", code],
        cwd=root,
        env={**env, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    active, file = result.stdout.split()
    assert active == "False" and file == str(root / "broker" / "core" / "elo.py")
    assert "RuntimeWarning" in result.stderr and str(leftover) in result.stderr and "delete" in result.stderr


def test_extension_modules_names_each_compiled_module_by_its_import_name(compiled_build: None) -> None:
    found = compiled.extension_modules()
    assert set(found) == set(compiled.COMPILED_MODULES)
    assert all(path.name.startswith(module.rsplit(".", 1)[1] + ".") for module, path in found.items())


def _native_probe(root: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    code = (
        "from broker.protocol import hot, spaces; from broker.legacy import wire; "
        "print(hot._NATIVE is not None, spaces._NATIVE is not None, wire._C is not None)"
    )
    full_env = {k: v for k, v in os.environ.items() if k != compiled.PURE_ENV}
    full_env.update(env or {}, PYTHONPATH=str(root))
    return subprocess.run(
        [sys.executable, "-W", "always", "-c", code], cwd=root, env=full_env, capture_output=True, text=True, timeout=60
    )


def test_the_c_codec_is_on_with_the_build_and_off_with_a_changed_source_or_the_pure_switch(
    compiled_build: None, tmp_path: Path
) -> None:
    root = _copy_package(tmp_path)
    on = _native_probe(root)
    assert on.returncode == 0 and on.stdout.split() == ["True"] * 3, on.stderr
    pure = _native_probe(root, {compiled.PURE_ENV: "1"})
    assert pure.returncode == 0 and pure.stdout.split() == ["False"] * 3, pure.stderr
    for module in compiled.NATIVE_MODULES:  # either C source changed: both C modules off, with the warning
        source = compiled.native_source(module, root / "broker")
        original = source.read_text(encoding="utf-8")
        source.write_text(original + "\n/* changed after the build */\n", encoding="utf-8")
        stale = _native_probe(root)
        assert stale.returncode == 0 and stale.stdout.split() == ["False"] * 3, stale.stderr
        assert "RuntimeWarning" in stale.stderr and module in stale.stderr
        source.write_text(original, encoding="utf-8")
