"""``gdrl-broker demo``: a broker, simulated games and one ``gdrl-train`` process per policy, no Godot.

1. The broker runs in this process; ``--games`` simulated games (subprocesses) join it, each with the
   two groups ``mover`` (continuous actions) and ``picker`` (discrete actions).
2. A random policy plays both groups for ``--random-ticks`` ticks to measure the reward to beat.
3. One ``gdrl-train`` subprocess per policy trains it (PPO) at the same time through the one broker;
   their progress lines are shown prefixed with the policy name.
4. A table (steps, mean episode reward at start and end, random-policy reward, ONNX file) and a PNG of
   each policy's reward curve are written to ``--out``.

Ctrl-C (or SIGTERM) stops the trainers; they save their models and ONNX files, and the table is still shown.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import IO, Any

import numpy as np

from clients.sim_game import MOVER, PICKER

POLICIES = (MOVER, PICKER)
DEFAULT_OUT = "gdrl-demo-output"
STUCK_AFTER = 60.0  # seconds a trainer may run on after another finished (with barrier stepping it would wait forever)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--games", type=int, default=2, help="simulated game instances (default: 2)")
    parser.add_argument("--agents", type=int, default=8, help="agents per group in each game (default: 8)")
    parser.add_argument(
        "--timesteps",
        type=int,
        default=100_000,
        help="agent steps per policy, summed over its agents (default: 100000)",
    )
    parser.add_argument(
        "--random-ticks",
        type=int,
        default=400,
        help="game ticks of random play to measure the random policy's reward (default: 400)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of games and trainers (default: 0)")
    parser.add_argument("--port", type=int, default=0, help="broker port (default: 0, any free port)")
    parser.add_argument(
        "--out", default=DEFAULT_OUT, help=f"folder for models, ONNX, reports and the plot (default: ./{DEFAULT_OUT})"
    )
    parser.add_argument("--log-every", type=float, default=3.0, help="seconds between progress lines (default: 3)")


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def run_from_args(args: argparse.Namespace) -> int:
    from broker.log import configure_logging
    from clients.inprocess import InProcessBroker

    if args.games < 1 or args.agents < 1 or args.timesteps < 1 or args.random_ticks < 0:
        print("gdrl-broker demo: --games, --agents and --timesteps must be positive", file=sys.stderr)
        return 2
    configure_logging(level="warning")
    out = Path(args.out).resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    n_envs = args.games * args.agents
    print(
        f"demo: {args.games} simulated games x {args.agents} agents per group; policies {', '.join(POLICIES)} "
        f"({n_envs} agents each); {args.timesteps} steps per policy; output in {out}",
        flush=True,
    )
    games: list[subprocess.Popen[bytes]] = []
    trainers: dict[str, subprocess.Popen[str]] = {}
    relays: list[threading.Thread] = []
    codes: dict[str, int | None] = {}
    random_reward: dict[str, float | None] = {p: None for p in POLICIES}
    interrupted = False
    try:
        with InProcessBroker(
            expected_games=args.games, port=args.port, status_interval=0, local_trainers=len(POLICIES)
        ) as broker:
            print(f"demo: broker listening on {broker.address}", flush=True)
            games = [_start_game(broker.address, args, i, out) for i in range(args.games)]
            try:
                if args.random_ticks:
                    print(f"demo: measuring the random policy for {args.random_ticks} ticks ...", flush=True)
                    random_reward = measure_random(broker, POLICIES, args.random_ticks, args.seed)
                    text = ", ".join(f"{p} {_fmt(r)}" for p, r in random_reward.items())
                    print(f"demo: random policy mean episode reward: {text}", flush=True)
                print("demo: training, one gdrl-train process per policy ...", flush=True)
                trainers = {p: _start_trainer(p, broker.address, args, out) for p in POLICIES}
                relays = [_relay(p, proc, out / "logs" / f"train-{p}.log") for p, proc in trainers.items()]
                codes = _wait_trainers(trainers)
            except KeyboardInterrupt:
                interrupted = True
                print("\ndemo: stopping; trainers save their models ...", flush=True)
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                codes = _stop_trainers(trainers)
            for relay in relays:
                relay.join(timeout=10)
    finally:
        for game in games:
            _reap(game)
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    seconds = time.monotonic() - started
    rows = _collect(out, codes, random_reward)
    print(f"\ndemo {'stopped' if interrupted else 'finished'} in {seconds:.0f} s; outputs in {out}\n", flush=True)
    print(format_table(rows), flush=True)
    plot = plot_curves(out, rows)
    if plot:
        print(f"\nreward curves: {plot}", flush=True)
    (out / "demo.json").write_text(
        json.dumps({"seconds": round(seconds, 1), "interrupted": interrupted, "policies": rows}, indent=2)
    )
    print(f"summary: {out / 'demo.json'}", flush=True)
    if interrupted:
        return 0
    return 0 if all(codes.get(p) == 0 for p in POLICIES) else 1


# --- processes ----------------------------------------------------------------------------------


def _start_game(address: str, args: argparse.Namespace, index: int, out: Path) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "broker", "sim-game", "--address", address]
    command += ["--movers", str(args.agents), "--pickers", str(args.agents)]
    command += ["--seed", str(args.seed + index), "--name", f"sim-{index}"]
    # Own session: a terminal's Ctrl-C reaches only the demo; games end when the broker closes.
    with open(out / "logs" / f"sim-{index}.log", "wb") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _start_trainer(policy: str, address: str, args: argparse.Namespace, out: Path) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "clients.train", "--policy", policy, "--broker", address]
    command += ["--timesteps", str(args.timesteps), "--seed", str(args.seed)]
    command += ["--save-model-path", str(out / f"{policy}.zip"), "--onnx-export-path", str(out / f"{policy}.onnx")]
    command += ["--report-json", str(out / f"{policy}.json")]
    command += ["--progress", "lines", "--log-every", str(args.log_every)]
    return subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        start_new_session=True,  # the demo forwards Ctrl-C itself, as SIGTERM
    )


def _relay(policy: str, proc: subprocess.Popen[str], log_path: Path) -> threading.Thread:
    """Copy a trainer's output to our stdout, each line prefixed with its policy, and to its log file."""
    width = max(len(p) for p in POLICIES)

    def pump(stream: IO[str]) -> None:
        with open(log_path, "w") as log:
            for line in stream:
                log.write(line)
                print(f"{policy:>{width}} | {line.rstrip()}", flush=True)

    assert proc.stdout is not None
    thread = threading.Thread(target=pump, args=(proc.stdout,), name=f"relay-{policy}", daemon=True)
    thread.start()
    return thread


def _wait_trainers(trainers: dict[str, subprocess.Popen[str]]) -> dict[str, int | None]:
    """Wait for all trainers. If one fails, or one still runs long after another finished (with barrier
    stepping it would wait forever for the finished one's actions), the rest get SIGTERM: they save and exit."""
    first_done: float | None = None
    while True:
        codes = {p: proc.poll() for p, proc in trainers.items()}
        if all(code is not None for code in codes.values()):
            return codes
        if any(code not in (None, 0) for code in codes.values()):
            print("demo: a trainer failed; stopping the others", flush=True)
            return _stop_trainers(trainers)
        if first_done is None and any(code == 0 for code in codes.values()):
            first_done = time.monotonic()
        if first_done is not None and time.monotonic() - first_done > STUCK_AFTER:
            print("demo: a trainer still runs long after the others finished; stopping it", flush=True)
            return _stop_trainers(trainers)
        time.sleep(0.2)


def _stop_trainers(trainers: dict[str, subprocess.Popen[str]], timeout: float = 60.0) -> dict[str, int | None]:
    for proc in trainers.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    codes: dict[str, int | None] = {}
    for policy, proc in trainers.items():
        try:
            codes[policy] = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            codes[policy] = proc.wait()
    return codes


def _reap(proc: subprocess.Popen[Any], timeout: float = 15.0) -> None:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# --- random baseline ----------------------------------------------------------------------------


def measure_random(broker: Any, policies: tuple[str, ...], ticks: int, seed: int) -> dict[str, float | None]:
    """Mean return of the episodes that end within ``ticks`` game ticks of uniformly random actions.

    All policies are stepped together, so that barrier stepping (lock-step) works too.
    The envs then close, and the open batch goes to the policy's next trainer.
    """
    envs = {p: broker.vec_env(p, name=f"random[{p}]") for p in policies}
    try:
        finished = random_episode_returns(envs, ticks, seed)
    finally:
        for env in envs.values():
            env.close()
    return {p: (float(np.mean(r)) if r else None) for p, r in finished.items()}


def random_episode_returns(envs: dict[str, Any], ticks: int, seed: int = 0) -> dict[str, list[float]]:
    """Step every VecEnv together with uniformly random actions for ``ticks``; the returns of the episodes
    that ended, per policy."""
    returns = {p: np.zeros(env.num_envs) for p, env in envs.items()}
    finished: dict[str, list[float]] = {p: [] for p in envs}
    for i, env in enumerate(envs.values()):
        env.action_space.seed(seed + i)
        env.reset()
    for _ in range(ticks):
        for env in envs.values():
            env.step_async(np.stack([env.action_space.sample() for _ in range(env.num_envs)]))
        for p, env in envs.items():
            _obs, reward, done, _infos = env.step_wait()
            returns[p] += reward
            ended = np.flatnonzero(done)
            finished[p].extend(returns[p][ended].tolist())
            returns[p][ended] = 0.0
    return finished


# --- results ------------------------------------------------------------------------------------


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _collect(out: Path, codes: dict[str, int | None], random_reward: dict[str, float | None]) -> list[dict[str, Any]]:
    rows = []
    for policy in POLICIES:
        row: dict[str, Any] = {"policy": policy, "exit_code": codes.get(policy), "reward_random": random_reward[policy]}
        report_path = out / f"{policy}.json"
        if report_path.exists() and codes.get(policy) is not None:
            report = json.loads(report_path.read_text())
            for key in ("agents", "steps", "seconds", "episodes", "reward_start", "reward_end", "onnx_path"):
                row[key] = report.get(key)
            row["curve"] = report.get("curve", [])
        rows.append(row)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    header = f"{'policy':<8} {'agents':>6} {'steps':>8} {'reward start':>13} {'reward end':>11} {'random':>8}  onnx"
    lines = [header, "-" * len(header)]
    for row in rows:
        if "steps" not in row:
            why = "not trained" if row["exit_code"] is None else f"trainer failed (exit code {row['exit_code']})"
            lines.append(f"{row['policy']:<8} {why}, no report")
            continue
        lines.append(
            f"{row['policy']:<8} {row['agents']:>6} {row['steps']:>8} {_fmt(row['reward_start']):>13} "
            f"{_fmt(row['reward_end']):>11} {_fmt(row['reward_random']):>8}  {row.get('onnx_path') or '-'}"
        )
    lines.append("reward start/end: mean episode reward of the first/last training episodes (up to 100 each;")
    lines.append("short episodes end first, which lifts 'start'); random: random actions in the same games")
    return "\n".join(lines)


def plot_curves(out: Path, rows: list[dict[str, Any]]) -> Path | None:
    """One panel per policy: episode rewards (moving average) against steps, and the random policy's."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("demo: matplotlib is not installed, no plot (pip install 'godot-rl-broker[sb3]')", flush=True)
        return None
    drawn = [row for row in rows if row.get("curve")]
    if not drawn:
        return None
    fig, axes = plt.subplots(1, len(drawn), figsize=(6 * len(drawn), 4), squeeze=False)
    for ax, row in zip(axes[0], drawn, strict=True):
        curve = np.asarray(row["curve"], dtype=np.float64)
        steps, rewards = curve[:, 0], curve[:, 1]
        window = max(1, min(100, len(rewards) // 20))
        smooth = np.convolve(rewards, np.ones(window) / window, mode="valid")
        ax.plot(steps, rewards, ".", alpha=0.08, color="tab:blue", markersize=2)
        ax.plot(steps[window - 1 :], smooth, color="tab:blue", label=f"trained (mean of {window} episodes)")
        if row.get("reward_random") is not None:
            ax.axhline(row["reward_random"], color="tab:red", linestyle="--", label="random policy")
        ax.set_title(f"{row['policy']} ({row['agents']} agents)")
        ax.set_xlabel("agent steps")
        ax.set_ylabel("episode reward")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    fig.tight_layout()
    path = out / "reward_curves.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
