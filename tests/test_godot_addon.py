"""Static checks of the Godot addon (no Godot binary here): every .gd file parses and lints (check.sh),
the addon's wire constants agree with the Python protocol, and the example project's resource paths exist.
The addon's behaviour is tested by its own GDScript suite (addons/godot_rl_broker/tests/run_tests.gd)
against the same vectors that tests/test_variant.py checks."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

from broker.protocol import PROTOCOL_VERSION
from broker.protocol.arrays import DTYPES
from broker.protocol.framing import DEFAULT_MAX_FRAME_BYTES

ADDON_ROOT = Path(__file__).resolve().parents[1] / "godot_addon"
ADDON = ADDON_ROOT / "addons" / "godot_rl_broker"
EXAMPLE = ADDON_ROOT / "examples" / "two_policies"


def gd_constant(text: str, name: str) -> str:
    match = re.search(rf"^const {name}: \w+ = (.+)$", text, re.MULTILINE)
    assert match, f"const {name} not found"
    return match.group(1)


def test_every_gd_file_parses_and_lints() -> None:
    # gdtoolkit (gdparse, gdlint) is a dev dependency, installed beside this Python.
    env = {**os.environ, "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")}
    result = subprocess.run(
        ["bash", str(ADDON_ROOT / "check.sh")], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Success: no problems found" in result.stdout + result.stderr


def test_wire_constants_match_the_protocol() -> None:
    wire = (ADDON / "wire.gd").read_text()
    assert int(gd_constant(wire, "PROTOCOL_VERSION")) == PROTOCOL_VERSION
    factors = gd_constant(wire, "DEFAULT_MAX_FRAME_BYTES").split("*")  # "64 * 1024 * 1024"
    assert math.prod(int(f) for f in factors) == DEFAULT_MAX_FRAME_BYTES
    block = wire[wire.index("const ITEM_SIZE") :].split("}", 1)[0]
    sizes = {name: int(size) for name, size in re.findall(r'"(\w+)": (\d+)', block)}
    assert sizes == {name: dtype.itemsize for name, dtype in DTYPES.items()}


def test_addon_layout() -> None:
    plugin = (ADDON / "plugin.cfg").read_text()
    assert 'script="plugin.gd"' in plugin and (ADDON / "plugin.gd").exists()
    for script, class_name in [
        ("broker_sync.gd", "BrokerSync"),
        ("controller/ai_controller_2d.gd", "AIController2D"),
        ("controller/ai_controller_3d.gd", "AIController3D"),
    ]:
        assert (ADDON / script).read_text().startswith(f"class_name {class_name}\n"), script
    for path in ADDON.rglob("*.gd"):
        text = path.read_text()
        assert "assert(" not in text, f"{path}: release exports strip assert; use push_error"
        in_tests = path.parent.name == "tests"  # the tests listen on loopback themselves
        assert "127.0.0.1" not in text or path.name == "broker_sync.gd" or in_tests, f"{path}: hard-coded address"
        if path.name != "broker_client.gd":
            assert "OS.delay_" not in text, f"{path}: no waiting outside the client's bounded wait"
    client = (ADDON / "broker_client.gd").read_text()
    # The one wait: wait_for_message(), bounded by BrokerSync.wait_for_actions_ms.
    assert client.count("OS.delay_usec(") == 1
    wait = client[client.index("func wait_for_message(") :].split("\nfunc ", 1)[0]
    assert "OS.delay_usec(" in wait and "give_up_at" in wait
    assert client.count("put_data(") == 1 and "set_no_delay(true)" in client


def resource_file(path: str) -> Path:
    relative = path.removeprefix("res://")
    if relative.startswith("addons/"):
        return ADDON_ROOT / relative  # copied into the example project by the user (docs/godot_addon.md)
    return EXAMPLE / relative


def test_example_project_resources_exist() -> None:
    project = (EXAMPLE / "project.godot").read_text()
    main_scene = re.search(r'run/main_scene="([^"]+)"', project)
    assert main_scene and resource_file(main_scene.group(1)).exists()
    assert resource_file(re.findall(r'"(res://addons/[^"]+plugin\.cfg)"', project)[0]).exists()
    scenes = list(EXAMPLE.glob("*.tscn"))
    assert len(scenes) >= 2
    for scene in scenes:
        for path in re.findall(r'\[ext_resource [^\]]*path="([^"]+)"', scene.read_text()):
            assert resource_file(path).exists(), f"{scene.name} refers to missing {path}"
    policies = set(re.findall(r'policy_name = "(\w+)"', (EXAMPLE / "lane.tscn").read_text()))
    assert policies == {"player", "platform"}
