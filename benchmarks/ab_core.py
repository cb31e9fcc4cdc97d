"""Before/after of the broker itself: this tree against an older commit, the same benchmark on both.

    python -m benchmarks.ab_core --old f74a595 --rounds 6 --preset quick --markdown ab.md
    python -m benchmarks.ab_core --old f74a595 --rounds 8 --config 400,vec64,2,1 --modes inprocess

The older commit is checked out into a temporary git worktree and this tree's ``benchmarks/`` is laid over it,
so both run the same games, trainers and ceilings and only the broker and clients differ (issue 18's
before/after: the old core is f74a595). An older commit that compiles its per-step modules (it has a
``setup.py``) is built in its worktree first, as the README's install builds it, so compiled code is compared
with compiled code; the table says whether each side ran compiled. Rounds alternate the trees in ABBA order,
so a machine that changes speed within a round is shared; each round runs ``benchmarks.run`` once per tree
with ``--repeats 1``. Per configuration and mode: the median agent-steps/s of each tree, the median of the
paired ratios (after/before, the figure to quote) and the median CPU per agent-step of all processes.

``--old pure`` compares this tree against itself run as plain Python (every process with
``GDRL_BROKER_PURE=1``): what compiling the per-step modules gives (broker/compiled.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from broker.compiled import PURE_ENV

ROOT = Path(__file__).resolve().parents[1]


def worktree(old: str, where: Path) -> Path:
    tree = where / "old"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), old], check=True)
    shutil.copytree(ROOT / "benchmarks", tree / "benchmarks", dirs_exist_ok=True)
    return tree


def build(tree: Path) -> None:
    """Compile the older tree's per-step modules in place, as the README's install would (if it has any)."""
    if not (tree / "setup.py").is_file() or os.environ.get(PURE_ENV) == "1":
        return
    # In place: with PYTHONPATH=tree the worktree's sources import their own compiled modules.
    print("building the older tree's compiled modules (a minute or two)", flush=True)
    command = [sys.executable, "setup.py", "--quiet", "build_ext", "--inplace"]
    subprocess.run(command, cwd=tree, check=True, stdout=subprocess.DEVNULL)


PURE = "pure"  # --old pure: this tree, uncompiled


def run_once(tree: Path, args: list[str], out: Path, pure: bool = False) -> dict[str, Any]:
    """One ``benchmarks.run`` on ``tree``: its JSON (``summary`` is empty, said on stderr, if the run failed)."""
    command = [sys.executable, "-m", "benchmarks.run", "--repeats", "1", "--out", str(out), *args]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    env.pop(PURE_ENV, None)
    if pure:
        env[PURE_ENV] = "1"  # inherited by every process benchmarks.run starts
    proc = subprocess.run(command, cwd=tree, env=env, check=False, stdout=subprocess.DEVNULL)
    if proc.returncode != 0 or not out.exists():
        print(f"benchmarks.run on {tree} failed (exit {proc.returncode}); this round has no pair", file=sys.stderr)
    return dict(json.loads(out.read_text())) if out.exists() else {"summary": []}


# Per configuration and mode, per side ("before", "after"): round -> (agent-steps/s, CPU us per agent-step of
# all processes, of the middle: the broker process, or in-process the broker's loop thread).
Rounds = dict[tuple[str, str], dict[str, dict[int, tuple[float, float, float]]]]
SIDES = ("before", "after")


def table(rows: Rounds, compiled: dict[str, set[bool]]) -> str:
    """Medians per side, and ratios paired by round: a round one side lacks (a failed run) pairs with nothing."""
    said = {side: "/".join(sorted(str(c).lower() for c in compiled.get(side, set()))) or "?" for side in SIDES}
    lines = [
        f"Compiled per-step modules: before {said['before']}, after {said['after']}.",
        "",
        "| configuration | mode | before: median agent-steps/s | after | after/before, median of paired rounds "
        "| paired ratios | CPU us per agent-step, all processes: before -> after | of them the broker's |",
        "|---|---|---:|---:|---:|---|---|---|",
    ]
    for (label, mode), sides in rows.items():
        before, after = sides.get("before", {}), sides.get("after", {})
        pairs = [after[i][0] / before[i][0] for i in sorted(before.keys() & after.keys()) if before[i][0] > 0]
        if not pairs:
            continue
        speed = {side: statistics.median(v[0] for v in runs.values()) for side, runs in sides.items()}
        cpu = {side: statistics.median(v[1] for v in runs.values()) for side, runs in sides.items()}
        broker = {side: statistics.median(v[2] for v in runs.values()) for side, runs in sides.items()}
        lines.append(
            f"| {label} | {mode} | {speed['before']:,.0f} | {speed['after']:,.0f} "
            f"| {statistics.median(pairs):.2f} | {', '.join(f'{p:.2f}' for p in pairs)} "
            f"| {cpu['before']:.3g} -> {cpu['after']:.3g} | {broker['before']:.3g} -> {broker['after']:.3g} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--old", required=True, help=f"the commit to compare against (before), or '{PURE}': this tree uncompiled"
    )
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--markdown", default=None, help="also write the table here")
    args, passed = parser.parse_known_args(argv)  # the rest goes to benchmarks.run (--preset, --config, --modes)
    rows: Rounds = {}
    compiled: dict[str, set[bool]] = {}  # per side: what benchmarks.run reported ("compiled" in its JSON)
    with tempfile.TemporaryDirectory(prefix="ab_core-") as tmp:
        pure = args.old == PURE
        old = ROOT if pure else worktree(args.old, Path(tmp))
        try:
            if not pure:
                build(old)
            for round_index in range(args.rounds):
                order = [("before", old), ("after", ROOT)]
                if round_index % 2:
                    order.reverse()
                for side, tree in order:
                    out = Path(tmp) / f"{side}-{round_index}.json"
                    result = run_once(tree, passed, out, pure=pure and side == "before")
                    if "compiled" in result:  # a failed run has none
                        compiled.setdefault(side, set()).add(bool(result["compiled"]))
                    for entry in result["summary"]:
                        runs = rows.setdefault((entry["config"]["label"], entry["mode"]), {}).setdefault(side, {})
                        cpu = entry["cpu_us_per_agent_step"]
                        runs[round_index] = (entry["agent_steps_per_s"], cpu["total"], cpu["middle"])
                print(f"round {round_index + 1} of {args.rounds} done", flush=True)
        finally:
            if not pure:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], check=False)
    text = table(rows, compiled)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
