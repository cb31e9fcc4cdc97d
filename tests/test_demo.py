"""``gdrl-broker demo`` end to end: broker, simulated games and two gdrl-train subprocesses in one command."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort

from clients.demo import DEFAULT_OUT, add_arguments
from tests.helpers import python_env
from tests.test_train import Watched

DEMO = [sys.executable, "-m", "broker", "demo"]


def processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes that contain ``text`` (to prove nothing was left behind)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(cmdline)
    return found


def test_default_output_folder_is_in_the_current_directory() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).out == DEFAULT_OUT == "gdrl-demo-output"


def test_demo_trains_both_policies_and_writes_table_plot_and_onnx(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = subprocess.run(
        [*DEMO, "--timesteps", "16000", "--random-ticks", "200", "--log-every", "1", "--out", str(out)],
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=400,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    text = result.stdout
    assert re.search(r"^ mover \| \[mover\] steps \d+/16000", text, re.MULTILINE), text
    assert re.search(r"^picker \| \[picker\] steps \d+/16000", text, re.MULTILINE), text
    assert "demo finished" in text
    for policy in ("mover", "picker"):
        row = re.search(
            rf"^{policy}\s+16\s+16384\s+(-?\d+\.\d+)\s+(-?\d+\.\d+)\s+(-?\d+\.\d+)\s+(\S+\.onnx)$", text, re.M
        )
        assert row, text
        assert Path(row.group(4)) == out / f"{policy}.onnx"

    summary = json.loads((out / "demo.json").read_text())
    for row in summary["policies"]:
        assert row["exit_code"] == 0
        assert row["reward_end"] > row["reward_random"], row  # margins: tests/test_learning.py
        assert (out / f"{row['policy']}.zip").exists()
        session = ort.InferenceSession(str(out / f"{row['policy']}.onnx"), providers=["CPUExecutionProvider"])
        names = [i.name for i in session.get_inputs()]
        feeds = {
            i.name: np.zeros([1 if isinstance(d, str) else d for d in i.shape], np.float32)
            for i in session.get_inputs()
        }
        output, _ = session.run(["output", "state_outs"], feeds)
        assert names[-1] == "state_ins" and output.shape == ((1, 2) if row["policy"] == "mover" else (1, 3))

    plot = Path(re.search(r"^reward curves: (.+)$", text, re.M).group(1))  # type: ignore[union-attr]
    assert plot == out / "reward_curves.png"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    assert matplotlib.image.imread(plot).shape[:2] == (400, 1200)


def test_sigterm_stops_the_demo_cleanly_with_models_saved(tmp_path: Path) -> None:
    out = tmp_path / "out"
    command = [*DEMO, "--timesteps", "100000000", "--random-ticks", "50", "--log-every", "0.5", "--out", str(out)]
    with Watched(command) as demo:
        address = demo.wait_for(r"broker listening on").split()[-1]
        demo.wait_for(r"^ mover \| \[mover\] steps [1-9]")
        demo.wait_for(r"^picker \| \[picker\] steps [1-9]")
        demo.proc.send_signal(signal.SIGTERM)
        code, output = demo.finish(timeout=120)
    assert code == 0, output
    assert "demo: stopping; trainers save their models" in output
    assert "demo stopped" in output
    assert re.search(r"^mover\s+16\s+\d+", output, re.M) and re.search(r"^picker\s+16\s+\d+", output, re.M), output
    for policy in ("mover", "picker"):
        assert (out / f"{policy}.zip").exists() and (out / f"{policy}.onnx").exists()
        assert json.loads((out / f"{policy}.json").read_text())["interrupted"] is True
    assert (out / "reward_curves.png").exists()
    # Games and trainers run in their own sessions; none may outlive the demo.
    assert processes_mentioning(address) == [] and processes_mentioning(str(out)) == []
