"""Benchmark orchestrator: every mode of every configuration of a preset, a table, and a JSON file.

    python -m benchmarks.run --preset quick --out results.json
    python -m benchmarks.run --preset targets --out results.json --markdown table.md    (issue 19's targets)
    python -m benchmarks.run --preset full --out results.json
    python -m benchmarks.run --preset smoke --modes raw,broker_tcp --out smoke.json

Modes (configs.MODES): godot_rl as its users run it, the real godot-rl package's GodotEnv +
StableBaselinesGodotEnv.step serving the lean plugin-protocol game (benchmarks/lean_plugin_game.py), for P policies
either (a) ``godot_rl_per_policy``: one port and one trainer process per policy, or (a') ``godot_rl_one_env``: all
agents of all policies in one env; every ``x godot_rl`` ratio is against the faster of the two. (a'')
``godot_rl_emulator`` (not run by default): the old baseline, one env serving clients/plugin_emulator.py. (b)
``broker_tcp``: ``gdrl-broker serve`` + the native game (lean_game.py) + one BrokerVecEnv process per policy over
TCP, batches of 32 KB or more through each trainer's shared-memory ring (the default); (b0) ``broker_socket``: the
same with the ring off, every batch through the socket; (b') ``broker_plugin``: the same serving the lean plugin
game instead (the broker's godot_rl JSON path); (b'')
``broker_variant`` (not run by default): the lean game's bodies as Godot Variants, the addon's codec; (b''')
``broker_script`` (not run by default): the lean plugin game through the broker to godot_rl's own env, one process
per policy, which the broker dials (``--godot-rl-trainer``: the migration guide's path B, keeping both the game and
the script); (c) ``broker_unix``: the same over the broker's Unix socket; (d) ``inprocess``: the broker inside the
trainer process, one InProcessBroker.vec_env thread per policy, games over TCP; (e) ``raw``: one trainer process
and the games exchanging the same msgpack bytes directly (the one-hop ceiling); (f) ``relay``: the same frames
through benchmarks/relay.py, which forwards them and does nothing else (the two-hop ceiling, the limit of any
broker); (f') ``relay_asyncio`` (not run by default): the same relay on a uvloop event loop, as the broker's server
reads and writes (what an asyncio broker costs at least); (g) ``inprocess_ceiling`` (several policies only): one
process held to one core, a relay thread and a raw trainer thread per policy handing frames over in memory under
one interpreter lock (benchmarks/inprocess_ceiling.py), the least any broker in the trainers' process does.

Every number is measured in this invocation; only ratios between modes are meaningful on a shared machine.

``--idle-poll`` runs every mode with the machine's idle cores polling instead of halting (benchmarks/idle.py: a
wake-up into a halted vCPU is a round trip through the host on this VM, and sleeping readers pay it); the JSON's
``machine`` says how the cores waited, and how often they halted and polled during the run, either way.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import queue
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from benchmarks.configs import (
    ANCHOR,
    DEFAULT_MODES,
    GODOT_RL_MODES,
    IMAGE_KEY,
    IMAGE_SHAPE,
    IMAGES,
    LATENCY,
    MODE_TITLES,
    MODES,
    PRESETS,
    SEVERAL_GAMES,
    SMALL,
    BenchConfig,
    Preset,
)
from benchmarks.idle import IdlePollingUnavailable, entries_between, idle_polling_if, idle_state
from benchmarks.measure import ProcSample, interpolate, sample_process
from broker.tuning import DEFAULT_MMAP_THRESHOLD, DEFAULT_TRIM_THRESHOLD

try:
    from broker.compiled import active as compiled_active
except ImportError:  # an older tree with this benchmarks/ laid over it (benchmarks.ab_core): never compiled

    def compiled_active() -> bool:
        return False


ROOT = Path(__file__).resolve().parents[1]
SAMPLE_INTERVAL_S = 0.1
STEPPING = "barrier"  # lock-step, like godot_rl and the raw ceiling: every step waits for every trainer


# The broker and its peers tune glibc's allocator (broker/tuning.py: large freed blocks are kept instead of
# mapped and unmapped for every message). Every process of every mode, godot_rl and the raw ceiling included,
# runs with the same settings, so the comparison is like for like; ``--glibc-defaults`` turns them off for all.
MALLOC_TUNING = {
    "MALLOC_MMAP_THRESHOLD_": str(DEFAULT_MMAP_THRESHOLD),
    "MALLOC_TRIM_THRESHOLD_": str(DEFAULT_TRIM_THRESHOLD),
}
GLIBC_DEFAULTS = {"GDRL_BROKER_MALLOC_TUNING": "0"}
_extra_env: dict[str, str] = dict(MALLOC_TUNING)
_lean_game_flags: list[str] = []  # ["--dense"]: every observation number non-zero in godot_rl's JSON
# Flags every lean game takes, plugin and native: ["--godot-wait"], each answer awaited as a Godot game does.
_game_wait_flags: list[str] = []
# The native modes' game (broker, in-process, raw, relay): "lean" (benchmarks/lean_game.py, prepared frames, as
# lean as the plugin game godot_rl is measured with) or "world" (bench_game.py / raw.py: a world that reacts).
_native_game: list[str] = ["lean"]


def python_env() -> dict[str, str]:
    env = {**os.environ, **_extra_env}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def broker_command() -> list[str]:
    # The module of the tree on PYTHONPATH (the same program as gdrl-broker), so that benchmarks/ab_core.py
    # can run an older tree, whose entry point lived elsewhere.
    return [sys.executable, "-m", "broker"]


class RunFailed(RuntimeError):
    pass


@dataclass
class Watched:
    role: str
    proc: subprocess.Popen[str]
    stderr_path: Path
    tid: int | None = None  # also sample this thread's CPU (the in-process broker's loop)
    samples: list[ProcSample] = field(default_factory=list)
    thread_samples: list[ProcSample] = field(default_factory=list)


class Run:
    """One mode x configuration: start the processes, collect trainer results, sample /proc, stop."""

    def __init__(self, mode: str, config: BenchConfig, warmup_s: float, measure_s: float, workdir: Path) -> None:
        self.mode = mode
        self.config = config
        self.warmup_s = warmup_s
        self.measure_s = measure_s
        self.workdir = workdir
        self.watched: list[Watched] = []
        self.events: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
        self.broker_idle_rss: int | None = None
        self.wire: dict[str, list[dict[str, Any]]] = {}  # game role -> its cumulative byte reports
        self._stop_sampling = threading.Event()
        self._lock = threading.Lock()

    # --- processes -------------------------------------------------------------------------------

    def spawn(self, role: str, args: list[str]) -> Watched:
        stderr_path = self.workdir / f"{role}.err"
        err = open(stderr_path, "w")
        proc = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=err, text=True, env=python_env(), cwd=ROOT, start_new_session=True
        )
        err.close()
        watched = Watched(role, proc, stderr_path)
        with self._lock:
            self.watched.append(watched)
        threading.Thread(target=self._read_events, args=(role, proc.stdout), daemon=True).start()
        return watched

    def _read_events(self, role: str, stream: IO[str] | None) -> None:
        assert stream is not None
        for line in stream:
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    self.events.put((role, json.loads(line)))

    def _sample_loop(self) -> None:
        while not self._stop_sampling.wait(SAMPLE_INTERVAL_S):
            self.sample_all()

    def sample_all(self) -> None:
        with self._lock:
            watched = list(self.watched)
        for w in watched:
            sample = sample_process(w.proc.pid)
            if sample is not None:
                w.samples.append(sample)
            if w.tid is not None:
                sample = sample_process(w.proc.pid, w.tid)
                if sample is not None:
                    w.thread_samples.append(sample)

    def wait_event(self, deadline: float, want: str = "ready") -> tuple[str, dict[str, Any]]:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RunFailed(f"timed out waiting for '{want}'")
            try:
                role, event = self.events.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                self._check_alive()
                continue
            if event.get("event") == "wire":
                self.wire.setdefault(role, []).append(event)
            if event.get("event") == want:
                return role, event

    def _drain_events(self) -> None:
        with contextlib.suppress(queue.Empty):
            while True:
                role, event = self.events.get_nowait()
                if event.get("event") == "wire":
                    self.wire.setdefault(role, []).append(event)

    def game_bytes_per_step(self) -> float | None:
        """Bytes in and out of every game per lock-step, from the games' own counts, setup excluded."""
        total = 0.0
        for role in (w.role for w in self.watched if w.role.startswith("game")):
            reports = self.wire.get(role)
            if not reports:
                return None
            first, last = reports[0], reports[-1]
            if last["ticks"] == first["ticks"]:
                first = {"ticks": 0, "bytes_in": 0, "bytes_out": 0}
            total += (last["bytes_in"] + last["bytes_out"] - first["bytes_in"] - first["bytes_out"]) / (
                last["ticks"] - first["ticks"]
            )
        return total

    def _check_alive(self) -> None:
        for w in self.watched:
            code = w.proc.poll()
            if code is not None:
                raise RunFailed(f"{w.role} exited with code {code}: {tail(w.stderr_path)}")

    def stop(self) -> None:
        """Trainers first (nothing waits on them then), games next, the broker last and gracefully."""

        def order(w: Watched) -> int:
            return 0 if w.role.startswith("trainer") else 2 if w.role == "broker" else 1

        for w in sorted(self.watched, key=order):
            if w.proc.poll() is not None:
                continue
            if w.role == "broker":
                w.proc.send_signal(signal.SIGTERM)
                try:
                    w.proc.wait(timeout=15)
                    continue
                except subprocess.TimeoutExpired:
                    pass
            with contextlib.suppress(ProcessLookupError):
                os.killpg(w.proc.pid, signal.SIGKILL)
            w.proc.wait(timeout=15)
        for w in self.watched:
            if w.proc.stdout is not None:
                w.proc.stdout.close()

    # --- modes -----------------------------------------------------------------------------------

    def start(self, deadline: float) -> int:
        """Start the mode's processes; return how many result events to expect."""
        config_json = json.dumps(self.config.to_json())
        timing = ["--warmup", str(self.warmup_s), "--measure", str(self.measure_s)]
        py = sys.executable
        if self.mode == "godot_rl_emulator":  # the old baseline: all agents in one env, the full emulator
            ports = [free_port() for _ in range(self.config.games)]
            trainer_args = ["--ports", ",".join(map(str, ports)), *timing]
            self.spawn("trainer", [py, "-m", "benchmarks.trainers", "godot_rl", *trainer_args])
            for i, port in enumerate(ports):
                self.spawn(f"game-{i}", [py, "-m", "benchmarks.plugin_game", *emulator_args(self.config, port, i)])
            return 1
        if self.mode in GODOT_RL_MODES:
            return self._start_godot_rl(config_json, timing)
        if self.mode in ("raw", "relay", "relay_asyncio"):
            trainer_port = free_port()
            self.spawn(
                "trainer",
                [py, "-m", "benchmarks.raw", "trainer", "--port", str(trainer_port), "--config", config_json, *timing],
            )
            self.wait_event(deadline)
            port = trainer_port
            if self.mode != "raw":
                port = free_port()
                relay_args = ["--port", str(port), "--trainer-port", str(trainer_port)]
                relay_args += ["--games", str(self.config.games)]
                relay_args += ["--asyncio"] if self.mode == "relay_asyncio" else []
                self.spawn("relay", [py, "-m", "benchmarks.relay", *relay_args])
                self.wait_event(deadline)
            self._spawn_raw_games(port, config_json)
            return 1
        if self.mode == "inprocess_ceiling":  # the in-process mode's ceiling: games connect raw, no hello
            ceiling = self.spawn(
                "trainer", [py, "-m", "benchmarks.inprocess_ceiling", "--config", config_json, *timing]
            )
            _, ready = self.wait_event(deadline)
            ceiling.tid = int(ready["broker_tid"])
            ceiling.role = "trainer+broker"
            self._spawn_raw_games(int(ready["port"]), config_json)
            return self.config.policies
        if self.mode == "inprocess":
            trainer = self.spawn(
                "trainer", [py, "-m", "benchmarks.trainers", "inprocess", "--config", config_json, *timing]
            )
            _, ready = self.wait_event(deadline)
            trainer.tid = int(ready["broker_tid"])
            trainer.role = "trainer+broker"
            self.sample_all()
            self.broker_idle_rss = trainer.samples[-1].rss_bytes if trainer.samples else None
            self._spawn_games(f"127.0.0.1:{ready['port']}", config_json)
            return self.config.policies
        # broker_tcp / broker_unix / broker_plugin / broker_variant
        port_file = self.workdir / "port"
        unix_path = self.workdir / "broker.sock"
        args = [*broker_command(), "serve", "--port", "0", "--port-file", str(port_file)]
        args += ["--games", str(self.config.games), "--status-interval", "0", "--log-level", "warning"]
        args += ["--stepping", STEPPING]
        if self.mode == "broker_unix":
            args += ["--unix", str(unix_path)]
        if self.mode == "broker_script":  # path B: godot_rl's own env per policy, listening; the broker dials it
            for name in self.config.policy_names:
                script_port = free_port()
                script_args = ["--ports", str(script_port), "--label", name, *timing]
                self.spawn(f"trainer-{name}", [py, "-m", "benchmarks.trainers", "godot_rl", *script_args])
                args += ["--godot-rl-trainer", f"{name}=127.0.0.1:{script_port}"]
        broker = self.spawn("broker", args)
        while not port_file.exists():
            if broker.proc.poll() is not None or time.monotonic() > deadline:
                raise RunFailed(f"broker did not start: {tail(broker.stderr_path)}")
            time.sleep(0.02)
        time.sleep(0.1)  # the Unix socket is bound right after the TCP port
        self.sample_all()
        self.broker_idle_rss = broker.samples[-1].rss_bytes if broker.samples else None
        address = f"unix:{unix_path}" if self.mode == "broker_unix" else f"127.0.0.1:{port_file.read_text()}"
        for name in self.config.policy_names if self.mode != "broker_script" else ():
            trainer_args = ["--address", address, "--policy", name, *timing]
            if self.mode == "broker_socket":
                trainer_args.append("--socket-only")
            self.spawn(f"trainer-{name}", [py, "-m", "benchmarks.trainers", "broker", *trainer_args])
        if self.mode in ("broker_plugin", "broker_script"):  # godot_rl plugin games: the broker speaks their JSON
            for i in range(self.config.games):
                args = ["--config", config_json, "--game-index", str(i), "--ports", port_file.read_text()]
                game_args = [*args, *_lean_game_flags, *_game_wait_flags]
                self.spawn(f"game-{i}", [py, "-m", "benchmarks.lean_plugin_game", *game_args])
        elif self.mode == "broker_variant":  # the addon's codec: Godot Variant bodies
            if _native_game[0] != "lean":
                raise RunFailed("broker_variant runs the lean game only (not with --world-game)")
            self._spawn_games(address, config_json, "--codec", "godot")
        else:
            self._spawn_games(address, config_json)
        return self.config.policies

    def _start_godot_rl(self, config_json: str, timing: list[str]) -> int:
        """godot_rl as its users run it, serving the lean plugin game (one process per game copy).

        ``godot_rl_per_policy``: one trainer process per policy, each a StableBaselinesGodotEnv over its own
        port per game; every game holds one connection per policy. ``godot_rl_one_env``: one trainer, every
        policy's agents in each game's one env."""
        py = sys.executable
        split = self.mode == "godot_rl_per_policy"
        servers = self.config.policy_names if split else ["all"]
        ports = {name: [free_port() for _ in range(self.config.games)] for name in servers}
        for name in servers:
            role = f"trainer-{name}" if split else "trainer"
            args = ["--ports", ",".join(map(str, ports[name])), "--label", name, *timing]
            self.spawn(role, [py, "-m", "benchmarks.trainers", "godot_rl", *args])
        for i in range(self.config.games):
            game_ports = ",".join(str(ports[name][i]) for name in servers)
            args = ["--config", config_json, "--game-index", str(i), "--ports", game_ports]
            args += [*(["--split"] if split else []), *_lean_game_flags, *_game_wait_flags]
            self.spawn(f"game-{i}", [py, "-m", "benchmarks.lean_plugin_game", *args])
        return len(servers)

    def _spawn_raw_games(self, port: int, config_json: str) -> None:
        """The ceilings' games: the same step frames, no hello (raw, relay, in-process ceiling)."""
        game = (
            ["benchmarks.lean_game", "--raw-port"]
            if _native_game[0] == "lean"
            else ["benchmarks.raw", "game", "--port"]
        )
        for i in range(self.config.games):
            game_args = [str(port), "--config", config_json, "--game-index", str(i), *_game_wait_flags]
            self.spawn(f"game-{i}", [sys.executable, "-m", *game, *game_args])

    def _spawn_games(self, address: str, config_json: str, *flags: str) -> None:
        for i in range(self.config.games):
            args = ["--address", address, "--config", config_json, "--game-index", str(i), *flags, *_game_wait_flags]
            game = "benchmarks.lean_game" if _native_game[0] == "lean" else "benchmarks.bench_game"
            self.spawn(f"game-{i}", [sys.executable, "-m", game, *args])

    # --- the whole run ---------------------------------------------------------------------------

    def execute(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        sampler = threading.Thread(target=self._sample_loop, daemon=True)
        sampler.start()
        try:
            expected = self.start(deadline)
            results: list[dict[str, Any]] = []
            while len(results) < expected:
                _, event = self.wait_event(deadline, "result")
                results.append(event)
            self.sample_all()
            self._drain_events()
            return self.metrics(results)
        finally:
            self._stop_sampling.set()
            sampler.join()
            self.stop()

    def metrics(self, results: list[dict[str, Any]]) -> dict[str, Any]:
        starts = [r["window"][0] for r in results]
        ends = [r["window"][1] for r in results]
        t0, t1 = max(starts), min(ends)
        if t1 - t0 < 0.2 * (max(ends) - min(starts)):  # windows barely overlap: use their union
            t0, t1 = min(starts), max(ends)
        span = t1 - t0
        steps = statistics.mean(r["steps_per_s"] for r in results) * span
        latencies = np.concatenate([np.asarray(r["latencies_ms"]) for r in results])

        def delta(w: Watched, what: str) -> float:
            return interpolate(w.samples, t1, what) - interpolate(w.samples, t0, what)

        cpu = {w.role: delta(w, "cpu_s") for w in self.watched}
        total_cpu = sum(cpu.values())
        broker = next((w for w in self.watched if w.role in ("broker", "trainer+broker")), None)
        out: dict[str, Any] = {
            "agent_steps_per_s": sum(r["agent_steps_per_s"] for r in results),
            "steps_per_s": statistics.mean(r["steps_per_s"] for r in results),
            "latency_mean_ms": float(latencies.mean()),
            "latency_p99_ms": float(np.percentile(latencies, 99)),
            "window_s": span,
            "trainers": len(results),
            "cpu_cores_total": total_cpu / span,
            "cpu_cores": {role: value / span for role, value in cpu.items()},
            # CPU per lock-step is far steadier than throughput on a shared machine: waiting costs no CPU.
            "cpu_us_per_step_total": total_cpu / steps * 1e6,
            "cpu_us_per_step": {role: value / steps * 1e6 for role, value in cpu.items()},
            "game_bytes_per_step": self.game_bytes_per_step(),
            "payload_obs_bytes_per_step": self.config.agents_per_step * self.config.observation_bytes_per_agent(),
            "wire_mb_per_s": None,
            "broker_cpu_cores": None,
            "broker_cpu_share": None,
            "broker_peak_rss_mb": None,
            "broker_rss_per_connection_kb": None,
            "broker_bytes_per_step": None,
        }
        if out["game_bytes_per_step"] is not None:  # bytes in and out of the games, per second
            out["wire_mb_per_s"] = out["game_bytes_per_step"] * out["steps_per_s"] / 1e6
        if broker is not None and broker.samples:
            last = broker.samples[-1]
            connections = self.config.games + (self.config.policies if broker.role == "broker" else 0)
            # In-process, the broker's daemon thread; its work on the trainers' threads counts with theirs.
            broker_cpu = (
                interpolate(broker.thread_samples, t1, "cpu_s") - interpolate(broker.thread_samples, t0, "cpu_s")
                if broker.tid is not None
                else cpu[broker.role]
            )
            out["broker_cpu_cores"] = broker_cpu / span
            out["broker_cpu_share"] = broker_cpu / total_cpu if total_cpu > 0 else None
            out["cpu_us_per_step"]["broker loop"] = broker_cpu / steps * 1e6
            out["broker_peak_rss_mb"] = last.hwm_bytes / 2**20
            if self.broker_idle_rss is not None:
                out["broker_rss_per_connection_kb"] = (last.rss_bytes - self.broker_idle_rss) / connections / 1024
            if broker.role == "broker":
                out["broker_bytes_per_step"] = delta(broker, "io_bytes") / steps
        out["cpu_us_per_agent_step"] = self.cpu_per_agent_step(out["cpu_us_per_step"])
        return out

    def cpu_per_agent_step(self, per_step: dict[str, float]) -> dict[str, float]:
        """CPU microseconds per agent-step of the games, the middle (broker or relay) and the trainers."""
        kinds = {"game": 0.0, "middle": 0.0, "trainers": 0.0}
        for role, us in per_step.items():
            if role.startswith("game"):
                kinds["game"] += us
            elif role in ("broker", "relay"):
                kinds["middle"] += us
            elif role == "trainer+broker":  # in-process: the broker's daemon thread, the trainers the rest
                loop = per_step.get("broker loop", 0.0)
                kinds["middle"] += loop
                kinds["trainers"] += us - loop
            elif role != "broker loop":  # the broker process's own figure, counted above
                kinds["trainers"] += us
        kinds["total"] = kinds["game"] + kinds["middle"] + kinds["trainers"]
        return {kind: us / self.config.agents_per_step for kind, us in kinds.items()}


def emulator_args(config: BenchConfig, port: int, game_index: int) -> list[str]:
    policies = ",".join(f"{name}:{config.agents}:continuous" for name in config.policy_names)
    args = [f"--port={port}", f"--policies={policies}", f"--obs_size={config.vector_size}"]
    args += ["--fast", "--horizon=50", f"--game_id={game_index}"]
    if config.obs == "img":
        args += [f"--image_key={IMAGE_KEY}", "--image_shape=" + ",".join(map(str, IMAGE_SHAPE))]
    return args


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no stderr)"


# --- presets, summary, table ----------------------------------------------------------------------


def run_preset(preset_name: str, preset: Preset, modes: list[str], timeout_s: float, log: IO[str]) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    started = time.monotonic()
    machine_before = machine_info()
    for config in preset.configs:
        for repeat in range(preset.repeats.get(config, 1)):
            for mode in modes_for(config, modes):  # interleaved, so a noisy spell hits all modes alike
                workdir = Path(tempfile.mkdtemp(prefix="gdrl-bench-"))
                record: dict[str, Any] = {"config": config.to_json(), "mode": mode, "repeat": repeat}
                try:
                    record.update(Run(mode, config, preset.warmup_s, preset.measure_s, workdir).execute(timeout_s))
                    print(
                        f"  {config.label:<34} {mode:<12} {record['agent_steps_per_s']:>12,.0f} agent-steps/s"
                        f"  mean {record['latency_mean_ms']:8.3f} ms  p99 {record['latency_p99_ms']:8.3f} ms",
                        file=log,
                        flush=True,
                    )
                except RunFailed as exc:
                    record["error"] = str(exc)
                    print(f"  {config.label:<34} {mode:<12} FAILED: {exc}", file=log, flush=True)
                finally:
                    shutil.rmtree(workdir, ignore_errors=True)
                runs.append(record)
    summary = summarize(runs, preset.configs, modes)
    machine_after = machine_info()
    return {
        "preset": preset_name,
        "modes": modes,
        "mode_titles": {m: MODE_TITLES[m] for m in modes},
        "stepping": STEPPING,
        "environment": dict(_extra_env),
        "lean_game_flags": list(_lean_game_flags),
        "game_wait": "godot" if _game_wait_flags else "blocking recv",
        "native_game": _native_game[0],
        "compiled": compiled_active(),  # the per-step modules, in every process of this run (broker/compiled.py)
        "warmup_s": preset.warmup_s,
        "measure_s": preset.measure_s,
        "duration_s": time.monotonic() - started,
        "machine": {
            "before": machine_before,
            "after": machine_after,
            "idle_entries_during_run": entries_between(machine_before["idle"], machine_after["idle"]),
        },
        "summary": summary,
        "godot_rl_baselines": godot_rl_baselines(summary, preset.configs),
        "targets": targets(summary),
        "runs": runs,
    }


RATIO_BASES = ("godot_rl", "raw", "relay", "inprocess_ceiling", "godot_rl_emulator")


# Modes measured only with several policies: with one, godot_rl's two ways are the same processes, and the
# in-process broker runs its loop on the trainer's own thread (one hop), so its ceiling is the raw one.
SEVERAL_POLICIES_ONLY = ("godot_rl_one_env", "inprocess_ceiling")


def modes_for(config: BenchConfig, modes: list[str]) -> list[str]:
    """The modes a configuration is measured in (SEVERAL_POLICIES_ONLY)."""
    return [m for m in modes if not (m in SEVERAL_POLICIES_ONLY and config.policies == 1)]


def _base_value(by_mode: dict[str, dict[str, Any]], base: str) -> float | None:
    """A baseline's agent-steps/s in one repeat; ``godot_rl`` is the faster of its two ways (GODOT_RL_MODES)."""
    if base == "godot_rl":
        values = [by_mode[m]["agent_steps_per_s"] for m in GODOT_RL_MODES if m in by_mode]
        return max(values) if values else None
    return by_mode[base]["agent_steps_per_s"] if base in by_mode else None


def summarize(runs: list[dict[str, Any]], configs: tuple[BenchConfig, ...], modes: list[str]) -> list[dict[str, Any]]:
    """Per configuration and mode: the run with the median throughput, and the median of the ratios to each
    baseline paired within a repeat (modes of one repeat ran back to back)."""
    rows = []
    for config in configs:
        ok = [r for r in runs if r["config"] == config.to_json() and "error" not in r]
        repeats: dict[int, dict[str, dict[str, Any]]] = {}
        for r in ok:
            repeats.setdefault(r["repeat"], {})[r["mode"]] = r
        for mode in modes_for(config, modes):
            mine = sorted((r for r in ok if r["mode"] == mode), key=lambda r: r["agent_steps_per_s"])
            if not mine:
                continue
            row = {k: v for k, v in mine[(len(mine) - 1) // 2].items() if k != "repeat"}
            row["repeats"] = len(mine)
            row["agent_steps_per_s_all"] = [r["agent_steps_per_s"] for r in mine]
            for base in RATIO_BASES:
                if base == mode:
                    continue
                ratios = []
                for by_mode in repeats.values():
                    value = _base_value(by_mode, base)
                    if mode in by_mode and value:
                        ratios.append(by_mode[mode]["agent_steps_per_s"] / value)
                if ratios:
                    row[f"x_{base}"] = statistics.median(ratios)
            rows.append(row)
    return rows


def _find(summary: list[dict[str, Any]], config: BenchConfig, mode: str) -> dict[str, Any] | None:
    return next((r for r in summary if r["config"] == config.to_json() and r["mode"] == mode), None)


# Issue 19 item 4: (configuration, mode, against, goal). "godot_rl" is the faster of GODOT_RL_MODES.
TARGETS = (
    (LATENCY, "broker_tcp", "relay", 0.8),
    (LATENCY, "broker_tcp", "godot_rl", 0.6),
    (LATENCY, "inprocess", "godot_rl", 1.2),
    (SMALL, "broker_tcp", "godot_rl", 1.0),
    (SMALL, "inprocess", "godot_rl", 1.5),
    (SEVERAL_GAMES, "broker_tcp", "godot_rl", 2.0),
    (SEVERAL_GAMES, "inprocess", "godot_rl", 3.0),
    (ANCHOR, "broker_tcp", "godot_rl", 10.0),
    (ANCHOR, "broker_tcp", "raw", 0.5),
    (ANCHOR, "inprocess", "raw", 0.8),
    (IMAGES, "broker_tcp", "godot_rl", 3.0),
)


def targets(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every target, met or missed; beside it what the two-hop ceiling reaches against the same baseline, and for
    an in-process target with several policies what the in-process ceiling reaches (one interpreter lock)."""
    out = []
    for config, mode, base, goal in TARGETS:
        row = _find(summary, config, mode)
        relay = _find(summary, config, "relay")
        ceiling = _find(summary, config, "inprocess_ceiling") if mode == "inprocess" else None
        ratio = row.get(f"x_{base}") if row else None
        out.append(
            {
                "config": config.label,
                "mode": mode,
                "against": base,
                "goal": goal,
                "ratio": ratio,
                "met": None if ratio is None else ratio >= goal,
                "relay_ratio": relay.get(f"x_{base}") if relay and base != "relay" else None,
                "inprocess_ceiling_ratio": ceiling.get(f"x_{base}") if ceiling else None,
                "cpu_us_per_agent_step": row["cpu_us_per_agent_step"] if row else None,
            }
        )
    return out


def godot_rl_baselines(summary: list[dict[str, Any]], configs: tuple[BenchConfig, ...]) -> list[dict[str, Any]]:
    """Per configuration, which of godot_rl's ways was faster (the baseline of every ``x_godot_rl``)."""
    out = []
    for config in configs:
        rows = [r for m in GODOT_RL_MODES if (r := _find(summary, config, m)) is not None]
        if rows:
            best = max(rows, key=lambda r: r["agent_steps_per_s"])
            out.append({"config": config.label, "faster": best["mode"], "agent_steps_per_s": best["agent_steps_per_s"]})
    return out


def machine_info() -> dict[str, Any]:
    import msgpack

    info: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "loadavg": os.getloadavg(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "msgpack": ".".join(map(str, msgpack.version)),
        "platform": platform.platform(),
        "idle": idle_state(),
    }
    with contextlib.suppress(Exception):
        from importlib.metadata import version

        info["godot_rl"] = version("godot_rl")
    return info


def _per_kb(row: dict[str, Any], key: str) -> float | None:
    value = row.get(key)
    return None if value is None else value / 1024


COLUMNS: tuple[tuple[str, Any, str], ...] = (
    ("agent-steps/s", lambda r: r["agent_steps_per_s"], "{:,.0f}"),
    ("x godot_rl", lambda r: r.get("x_godot_rl"), "{:.2f}"),
    ("x raw", lambda r: r.get("x_raw"), "{:.2f}"),
    ("x relay", lambda r: r.get("x_relay"), "{:.2f}"),
    ("x in-process ceiling", lambda r: r.get("x_inprocess_ceiling"), "{:.2f}"),
    ("mean ms", lambda r: r["latency_mean_ms"], "{:.3f}"),
    ("p99 ms", lambda r: r["latency_p99_ms"], "{:.3f}"),
    ("CPU us/step", lambda r: r["cpu_us_per_step_total"], "{:,.0f}"),
    ("CPU us/agent-step", lambda r: r["cpu_us_per_agent_step"]["total"], "us"),
    ("game", lambda r: r["cpu_us_per_agent_step"]["game"], "us"),
    ("broker/relay", lambda r: r["cpu_us_per_agent_step"]["middle"] or None, "us"),
    ("trainers", lambda r: r["cpu_us_per_agent_step"]["trainers"], "us"),
    ("broker CPU", lambda r: r["broker_cpu_cores"], "{:.2f}"),
    ("broker share", lambda r: r["broker_cpu_share"], "{:.2f}"),
    ("broker RSS MB", lambda r: r["broker_peak_rss_mb"], "{:.1f}"),
    ("KB/conn", lambda r: r["broker_rss_per_connection_kb"], "{:,.0f}"),
    ("game KB/step", lambda r: _per_kb(r, "game_bytes_per_step"), "{:,.1f}"),
    ("MB/s", lambda r: r.get("wire_mb_per_s"), "{:,.1f}"),
)


def micros(value: float) -> str:
    """CPU microseconds: three significant digits below 100, whole numbers above."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _cells(row: dict[str, Any]) -> list[str]:
    cells = [row["config"]["label"], row["mode"]]
    for _, get, spec in COLUMNS:
        value = get(row)
        cells.append("-" if value is None else micros(value) if spec == "us" else spec.format(value))
    return cells


def _measured_targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets of the configurations this run measured (the JSON keeps every target)."""
    measured = {row["config"]["label"] for row in result["summary"]}
    return [t for t in result["targets"] if t["config"] in measured]


def targets_table(result: dict[str, Any]) -> list[str]:
    """Issue 19 item 4 as a Markdown table: one row per configuration, a cell per mode, met/missed per goal."""
    cells: dict[str, dict[str, list[str]]] = {}
    for t in _measured_targets(result):
        ratio = "-" if t["ratio"] is None else f"{t['ratio']:.2f}x"
        verdict = "n/a" if t["met"] is None else ("met" if t["met"] else "missed")
        text = f"{ratio} {t['against']} (>= {t['goal']}x: {verdict})"
        if t["relay_ratio"] is not None:
            text += f", two-hop ceiling {t['relay_ratio']:.2f}x"
        if t["inprocess_ceiling_ratio"] is not None:
            text += f", in-process ceiling {t['inprocess_ceiling_ratio']:.2f}x"
        if t["cpu_us_per_agent_step"] is not None:
            text += f", CPU {micros(t['cpu_us_per_agent_step']['total'])} us/agent-step"
        cells.setdefault(t["config"], {}).setdefault(t["mode"], []).append(text)
    lines = ["| configuration | broker TCP | in-process |", "|---|---|---|"]
    for config, by_mode in cells.items():
        lines.append(
            f"| {config} | {'; '.join(by_mode.get('broker_tcp', []))} | {'; '.join(by_mode.get('inprocess', []))} |"
        )
    return lines


def idle_line(result: dict[str, Any]) -> str:
    """How the idle cores waited during the run: what decides the price of every wake-up (benchmarks/idle.py)."""
    machine = result.get("machine", {})
    entries = machine.get("idle_entries_during_run", {})
    way = "held polling (--idle-poll)" if result.get("idle_poll") else "as the machine has them"
    driver = machine.get("before", {}).get("idle", {}).get("driver")
    none_to_read = "none to read (no cpuidle driver: idle cores halt)" if driver == "none" else "not readable"
    counts = ", ".join(f"{name} {count:,}" for name, count in entries.items()) or none_to_read
    games = "; games wait as Godot's do (--godot-wait)" if result.get("game_wait") == "godot" else ""
    return f"idle cores: {way}; driver {driver}; idle-state entries during the run: {counts}{games}"


def format_table(result: dict[str, Any]) -> str:
    header = ["configuration", "mode", *(name for name, _, _ in COLUMNS)]
    rows = [_cells(row) for row in result["summary"]]
    widths = [max(len(line[i]) for line in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        left = [cells[i].ljust(widths[i]) for i in range(2)]
        return " ".join(left + [cells[i].rjust(widths[i]) for i in range(2, len(cells))])

    lines = [line(header), "-" * (sum(widths) + len(widths) - 1)]
    for i, cells in enumerate(rows):
        if i and cells[0] != rows[i - 1][0]:
            lines.append("")
        lines.append(line(cells))
    lines += ["", "targets:", *(targets_table(result) if _measured_targets(result) else ["(none measured)"])]
    lines += ["", "godot_rl baseline (the faster way):"]
    lines += [f"  {b['config']:<34} {b['faster']}" for b in result["godot_rl_baselines"]]
    lines += ["", idle_line(result)]
    failed = [r for r in result["runs"] if "error" in r]
    if failed:
        lines.append(
            f"{len(failed)} run(s) failed: " + "; ".join(f"{r['config']['label']} {r['mode']}" for r in failed)
        )
    return "\n".join(lines)


def format_markdown(result: dict[str, Any]) -> str:
    """The summary as a Markdown table (for docs/performance.md), then the targets."""
    header = ["configuration", "mode", *(name for name, _, _ in COLUMNS)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * 2 + "---:|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cells(row)) + " |" for row in result["summary"]]
    lines += ["", *targets_table(result), "", idle_line(result)]
    return "\n".join(lines)


def _parse_config(text: str) -> BenchConfig:
    parts = text.split(",")
    if len(parts) != 4:
        raise ValueError(f"--config wants AGENTS,OBS,POLICIES,GAMES, got {text!r}")
    return BenchConfig(int(parts[0]), parts[1], int(parts[2]), int(parts[3]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="quick")
    parser.add_argument(
        "--modes",
        default=",".join(DEFAULT_MODES),
        help=f"comma-separated subset of {','.join(MODES)}, or 'all' (default: all but godot_rl_emulator)",
    )
    parser.add_argument("--out", default=None, help="write the results here as JSON")
    parser.add_argument("--markdown", default=None, help="also write the table here as Markdown")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds allowed for one run")
    parser.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="AGENTS,OBS,POLICIES,GAMES",
        help="measure this configuration instead of the preset's (repeatable), e.g. 400,vec64,2,1",
    )
    parser.add_argument("--repeats", type=int, default=None, help="measure every configuration this many times")
    parser.add_argument("--measure", type=float, default=None, help="seconds in each measured window")
    parser.add_argument(
        "--glibc-defaults",
        action="store_true",
        help="run every process with glibc's default allocator settings (no tuning, broker's included)",
    )
    parser.add_argument(
        "--dense-json",
        action="store_true",
        help="the lean plugin game fills every observation number (default: the broker modes' values, mostly 0)",
    )
    parser.add_argument(
        "--godot-wait",
        action="store_true",
        help="every game waits for its answer as a Godot game does (looks, sleeps 10 us, looks again: sync.gd) "
        "instead of blocking in recv; the lean games only",
    )
    parser.add_argument(
        "--world-game",
        action="store_true",
        help="the native modes' game steps a world that reacts to the actions (bench_game.py, raw.py) instead of "
        "sending prepared frames (lean_game.py, as lean as the plugin game)",
    )
    parser.add_argument(
        "--idle-poll",
        action="store_true",
        help="hold every idle core polling instead of halting for the whole run (the CPU latency QoS device at "
        "0 us; needs root): how a machine whose idle cores wake fast behaves, for every mode alike",
    )
    args = parser.parse_args(argv)
    if args.world_game:
        _native_game[0] = "world"
    if args.godot_wait:
        if args.world_game:
            parser.error("--godot-wait is for the lean games, not --world-game")
        _game_wait_flags.append("--godot-wait")
    if args.dense_json:
        _lean_game_flags.append("--dense")
    if args.glibc_defaults:
        _extra_env.clear()
        _extra_env.update(GLIBC_DEFAULTS)
    modes = list(MODES) if args.modes == "all" else [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"unknown modes {unknown}; choose from {list(MODES)}")
    preset = PRESETS[args.preset]
    try:
        configs = tuple(_parse_config(text) for text in args.config) or preset.configs
    except ValueError as exc:
        parser.error(str(exc))
    repeats = {c: args.repeats for c in configs} if args.repeats else {c: preset.repeats.get(c, 1) for c in configs}
    preset = Preset(configs, preset.warmup_s, args.measure or preset.measure_s, repeats)
    print(f"preset {args.preset}: {len(configs)} configurations x {len(modes)} modes", flush=True)
    try:
        with idle_polling_if(args.idle_poll):
            result = run_preset(args.preset, preset, modes, args.timeout, sys.stdout)
    except IdlePollingUnavailable as exc:
        parser.error(str(exc))
    result["idle_poll"] = args.idle_poll
    print()
    print(format_table(result))
    print(f"\n{result['duration_s']:.0f} s in all")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(format_markdown(result) + "\n")
    return 1 if any("error" in r for r in result["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
