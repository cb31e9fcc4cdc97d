"""The benchmark suite runs end to end in CI: every mode of every configuration of the "smoke" preset (tiny
configurations: images, several games) and of the "quick" preset (the two target configurations) is
measured, with real processes, and reports positive numbers. Speed itself is never asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks.configs import ACTION_KEY, MODES, PRESETS, BenchConfig, BenchWorld
from benchmarks.raw import check_same_bytes, step_frame
from benchmarks.run import BROKER_MODES
from tests.helpers import ROOT, python_env


def test_raw_ceiling_sends_the_protocols_own_step_bytes() -> None:
    """The ceiling is only a ceiling if it moves the same bytes: episode ends (final obs) included."""
    world = BenchWorld(BenchConfig(3, "img", 2, 1), game_index=1)
    frames = set()
    for tick in range(60):  # past the horizon: rows end, and final observations ride along
        check_same_bytes(world)
        frames.add(len(step_frame(world)))
        world.apply({name: {ACTION_KEY: np.full((3, 2), tick / 60, np.float32)} for name in ("p0", "p1")})
    assert len(frames) > 1  # some steps carried final observations


@pytest.mark.parametrize("preset_name", ["smoke", "quick"])
def test_preset_measures_every_mode_and_configuration(tmp_path: Path, preset_name: str) -> None:
    pytest.importorskip("godot_rl.core.godot_env", reason="the baseline needs `pip install --no-deps godot-rl==0.8.2`")
    out = tmp_path / f"{preset_name}.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--preset", preset_name, "--out", str(out), "--timeout", "150"],
        cwd=ROOT,
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    preset = PRESETS[preset_name]
    assert {(row["config"]["label"], row["mode"]) for row in result["summary"]} == {
        (config.label, mode) for config in preset.configs for mode in MODES
    }
    for row in result["summary"]:
        what = f"{row['config']['label']} / {row['mode']}"
        assert row["agent_steps_per_s"] > 0 and row["steps_per_s"] > 0, what
        assert row["latency_mean_ms"] > 0 and row["latency_p99_ms"] > 0, what
        assert row["game_bytes_per_step"] > 0 and row["cpu_us_per_step_total"] > 0, what
        assert row["trainers"] == (row["config"]["policies"] if row["mode"] in BROKER_MODES else 1), what
        if row["mode"] in BROKER_MODES:
            assert row["broker_peak_rss_mb"] > 0 and row["broker_cpu_cores"] >= 0, what
        if row["mode"] != "godot_rl":
            assert row["x_godot_rl"] > 0, what
    assert [t["goal"] for t in result["targets"]] == [20.0, 0.5, 0.8, 0.7, 1.0]
    if preset_name == "quick":  # its configurations are the targets': every ratio is measured (never judged here)
        assert all(t["ratio"] > 0 for t in result["targets"]), result["targets"]
    assert "targets:" in proc.stdout and "agent-steps/s" in proc.stdout
