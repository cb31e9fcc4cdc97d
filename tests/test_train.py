"""``gdrl-train`` as users run it: real broker and simulated-game subprocesses on loopback, real SB3 runs."""

from __future__ import annotations

import json
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import IO

import numpy as np
import onnxruntime as ort
import pytest

from clients.train import main
from clients.train_options import build_parser, parse_net_arch, saved_algorithm
from tests.helpers import broker_process, python_env, spawn_python

TRAIN = [sys.executable, "-m", "clients.train"]
ENDLESS = "--timesteps 100000000 --progress lines --log-every 0.2".split()  # runs until a signal stops it


@contextmanager
def sim_broker(tmp_path: Path, games: list[tuple[int, int]]) -> Iterator[str]:
    """A broker subprocess and one sim-game subprocess per (movers, pickers); yields the address."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with broker_process(tmp_path, "--games", str(len(games)), "--status-interval", "0") as (_broker, address):
            for i, (movers, pickers) in enumerate(games):
                with open(tmp_path / f"game-{i}-{time.monotonic_ns()}.log", "wb") as log:
                    command = f"-m broker sim-game --movers {movers} --pickers {pickers} --seed {i} --name sim-{i}"
                    procs.append(
                        spawn_python(*command.split(), "--address", address, stdout=log, stderr=subprocess.STDOUT)
                    )
            yield address
    finally:
        for proc in procs:  # the games end when the broker closes
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def trainer(*args: str) -> Watched:
    return Watched([*TRAIN, *args])


def run_train(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*TRAIN, *args], env=python_env(), capture_output=True, text=True, timeout=timeout)


class Watched:
    """A subprocess whose output lines are read on a thread (so a test can wait for one)."""

    def __init__(self, command: list[str]) -> None:
        self.proc = subprocess.Popen(
            command,
            env=python_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        assert self.proc.stdout is not None
        self.pump = threading.Thread(target=self._pump, args=(self.proc.stdout,), daemon=True)
        self.pump.start()

    def _pump(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.put(line)

    def wait_for(self, pattern: str, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            self.seen.append(line)
            if re.search(pattern, line):
                return line
        self.close()
        raise AssertionError(f"no line matching {pattern!r}; output:\n{''.join(self.seen)}")

    def lines_during(self, seconds: float) -> list[str]:
        """The output lines that arrive within the next ``seconds``."""
        got = []
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            try:
                got.append(self.lines.get(timeout=left))
            except queue.Empty:
                break
        self.seen += got
        return got

    def finish(self, timeout: float = 120) -> tuple[int, str]:
        """Wait for the exit (killing it after ``timeout``); returns the exit code and all output."""
        try:
            self.proc.wait(timeout=timeout)
        finally:
            self.close()
        return self.proc.returncode, "".join(self.seen)

    def close(self) -> None:
        """Kill the process if it still runs, and collect the rest of its output (idempotent)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.pump.join(timeout=10)
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        while not self.lines.empty():
            self.seen.append(self.lines.get())

    def __enter__(self) -> Watched:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@pytest.fixture(scope="module")
def mover_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with sim_broker(tmp_path_factory.mktemp("mover-broker"), [(4, 0)]) as address:
        yield address


@pytest.fixture(scope="module")
def picker_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with sim_broker(tmp_path_factory.mktemp("picker-broker"), [(0, 4)]) as address:
        yield address


# --- command line -------------------------------------------------------------------------------


def test_help_documents_every_flag() -> None:
    result = run_train("--help", timeout=60)
    assert result.returncode == 0
    flags = [s for action in build_parser()._actions for s in action.option_strings if s.startswith("--")]
    for flag in flags:
        assert flag in result.stdout, f"{flag} missing from --help"
    asked_for = """--policy --broker --token --timesteps --n-steps --batch-size --n-epochs --learning-rate --gamma
        --gae-lambda --clip-range --ent-coef --vf-coef --max-grad-norm --seed --save-model-path --resume-model-path
        --save-checkpoint-frequency --onnx-export-path --tensorboard-log --inference --policy-type --net-arch
        --report-json --algo --stepping"""
    assert set(asked_for.split()) <= set(flags)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--algo", "sac", "--n-epochs", "3"], "--n-epochs does not apply to SAC"),
        (["--algo", "dqn", "--clip-range", "0.1"], "--clip-range does not apply to DQN"),
        (["--inference"], "--inference runs a saved model"),
        (["--resume-model-path", "/nonexistent/model.zip"], "no model file at /nonexistent/model.zip"),
        (["--save-checkpoint-frequency", "100"], "needs --save-model-path"),
        (["--net-arch", "64,x"], "not a comma-separated list"),
        (["--algo", "dqn", "--net-arch", "pi=64;vf=64"], "DQN takes one list"),
        (["--ent-coef", "auto"], "--ent-coef must be a number"),
        (["--timesteps", "0"], "--timesteps must be positive"),
        (["--deadline-ms", "5"], "--deadline-ms and --hold-action need --stepping"),
        (["--policy-type", "no_such_module:Policy"], "cannot import"),
    ],
)
def test_bad_flags_are_refused_with_a_clear_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--policy", "mover", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_parse_net_arch() -> None:
    assert parse_net_arch("64,64", "ppo") == [64, 64]
    assert parse_net_arch("", "ppo") == []
    assert parse_net_arch("pi=32;vf=128,128", "ppo") == {"pi": [32], "vf": [128, 128]}
    assert parse_net_arch("pi=64,64;qf=256,256", "sac") == {"pi": [64, 64], "qf": [256, 256]}
    with pytest.raises(ValueError, match="positive"):
        parse_net_arch("64,0", "ppo")
    with pytest.raises(ValueError, match=r"pi=\.\.\.;qf="):
        parse_net_arch("pi=64;vf=64", "sac")


def test_no_broker_is_a_clear_error(tmp_path: Path) -> None:
    result = run_train("--policy", "mover", "--broker", "unix:" + str(tmp_path / "nothing"), "--connect-timeout", "1")
    assert result.returncode == 1
    assert "cannot join the broker" in result.stderr


@pytest.mark.parametrize("saved", ["ppo", "a2c", "sac", "dqn"])
def test_resume_refuses_a_model_of_another_algorithm(tmp_path: Path, saved: str) -> None:
    """`--algo a2c --resume-model-path mover.zip` on a PPO model would train it as A2C: refused at start."""
    import gymnasium as gym
    import stable_baselines3

    env = gym.make("Pendulum-v1" if saved == "sac" else "CartPole-v1")
    model = getattr(stable_baselines3, saved.upper())("MlpPolicy", env, seed=0, device="cpu")
    path = tmp_path / "mover.zip"
    model.save(path)
    assert saved_algorithm(path) == saved
    other = "a2c" if saved == "ppo" else "ppo"
    result = run_train("--policy", "mover", "--algo", other, "--resume-model-path", str(path))
    assert result.returncode == 2, result.stderr
    assert f"holds a {saved.upper()} model, but --algo is {other}; resume it with --algo {saved}" in result.stderr
    assert "cannot join the broker" not in result.stderr  # refused before connecting


# --- training -----------------------------------------------------------------------------------


def test_train_checkpoints_tensorboard_onnx_then_resume_then_inference(tmp_path: Path, mover_broker: str) -> None:
    from stable_baselines3 import PPO

    models = tmp_path / "models"
    common = ["--policy", "mover", "--broker", mover_broker, "--progress", "lines", "--log-every", "0.2"]
    first = run_train(
        *common,
        *"--timesteps 4096 --n-steps 64 --batch-size 128 --net-arch 32,32 --save-checkpoint-frequency 1024".split(),
        *("--save-model-path", str(models / "mover.zip"), "--tensorboard-log", str(tmp_path / "tb")),
        *("--onnx-export-path", str(models / "mover.onnx"), "--report-json", str(tmp_path / "first.json")),
    )
    assert first.returncode == 0, first.stderr
    assert re.search(r"\[mover\] steps \d+/4096 \(\d+%\) \d+ steps/s", first.stdout)
    assert "[mover] done: 4096 steps" in first.stdout
    assert "curve" not in first.stdout  # the curve goes to the JSON report only

    report = json.loads((tmp_path / "first.json").read_text())
    assert {"policy", "agents", "steps", "seconds", "episodes", "reward_start", "reward_end", "curve"} <= set(report)
    assert (report["policy"], report["agents"], report["steps"], report["algo"]) == ("mover", 4, 4096, "PPO")
    assert report["episodes"] == len(report["curve"]) > 0
    assert report["interrupted"] is False

    model = PPO.load(models / "mover.zip", device="cpu")
    assert model.num_timesteps == 4096
    hidden = [layer.out_features for layer in model.policy.mlp_extractor.policy_net if hasattr(layer, "out_features")]
    assert hidden == [32, 32]
    checkpoints = sorted((models / "mover_checkpoints").glob("mover_*_steps.zip"))
    assert len(checkpoints) == 4, checkpoints  # every 1024 agent steps
    assert list((tmp_path / "tb" / "mover_PPO_1").glob("events.out.tfevents.*"))
    session = ort.InferenceSession(str(models / "mover.onnx"), providers=["CPUExecutionProvider"])
    output, state_outs = session.run(None, {"obs": np.zeros((1, 4), np.float32), "state_ins": np.ones(1, np.float32)})
    assert output.shape == (1, 2) and state_outs.tolist() == [1.0]

    resumed = run_train(
        *common,
        *("--timesteps", "1024", "--resume-model-path", str(models / "mover.zip"), "--learning-rate", "1e-4"),
        *("--save-model-path", str(models / "mover2.zip"), "--report-json", str(tmp_path / "resumed.json")),
    )
    assert resumed.returncode == 0, resumed.stderr
    report = json.loads((tmp_path / "resumed.json").read_text())
    assert (report["steps"], report["total_steps"]) == (1024, 5120)
    assert PPO.load(models / "mover2.zip", device="cpu").learning_rate == 1e-4

    inference = run_train(
        *common,
        *("--inference", "--resume-model-path", str(models / "mover2.zip"), "--timesteps", "800"),
        *("--report-json", str(tmp_path / "inference.json")),
    )
    assert inference.returncode == 0, inference.stderr
    report = json.loads((tmp_path / "inference.json").read_text())
    assert report["mode"] == "inference" and report["steps"] == 800 and report["episodes"] > 0
    assert report["model_path"] is None  # inference saves nothing


@pytest.mark.parametrize(
    ("algo", "policy", "extra"),
    [
        ("a2c", "mover", ["--n-steps", "8"]),
        ("sac", "mover", ["--learning-starts", "100", "--batch-size", "64", "--buffer-size", "5000"]),
        ("ppo", "picker", ["--n-steps", "64", "--batch-size", "64"]),
        ("a2c", "picker", []),
        ("ppo", "mover", ["--policy-type", "stable_baselines3.common.policies:MultiInputActorCriticPolicy"]),
        ("dqn", "picker", ["--learning-starts", "200", "--batch-size", "64", "--buffer-size", "5000"]),
    ],
)
def test_each_algorithm_trains_where_the_actions_fit(
    tmp_path: Path, algo: str, policy: str, extra: list[str], request: pytest.FixtureRequest
) -> None:
    address = request.getfixturevalue(f"{policy}_broker")
    result = run_train(
        *("--policy", policy, "--broker", address, "--algo", algo, "--timesteps", "1200", "--net-arch", "32"),
        *("--onnx-export-path", str(tmp_path / "p.onnx"), "--report-json", str(tmp_path / "r.json"), *extra),
    )
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["algo"] == algo.upper() and report["steps"] >= 1200
    assert report["onnx_path"] == str(tmp_path / "p.onnx")
    ort.InferenceSession(str(tmp_path / "p.onnx"), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize(
    ("algo", "policy", "message"),
    [
        ("sac", "picker", "SAC needs continuous actions"),
        ("dqn", "mover", "DQN needs exactly one discrete action key"),
    ],
)
def test_algorithm_that_does_not_fit_the_actions_is_refused(
    algo: str, policy: str, message: str, request: pytest.FixtureRequest
) -> None:
    address = request.getfixturevalue(f"{policy}_broker")
    result = run_train("--policy", policy, "--broker", address, "--algo", algo)
    assert result.returncode == 2
    assert message in result.stderr
    assert "use --algo ppo or a2c" in result.stderr


def test_wrong_policy_type_is_refused(mover_broker: str) -> None:
    result = run_train("--policy", "mover", "--broker", mover_broker, "--policy-type", "MlpPolicy")
    assert result.returncode == 2
    assert "MultiInputPolicy" in result.stderr


# --- stopping -----------------------------------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_saves_model_and_onnx_and_exits_zero(tmp_path: Path, mover_broker: str, signum: int) -> None:
    with trainer(
        *("--policy", "mover", "--broker", mover_broker, *ENDLESS),
        *("--save-model-path", str(tmp_path / "m.zip"), "--onnx-export-path", str(tmp_path / "m.onnx")),
        *("--report-json", str(tmp_path / "r.json")),
    ) as watched:
        watched.wait_for(r"\[mover\] steps [1-9]")
        watched.proc.send_signal(signum)
        code, output = watched.finish()
    assert code == 0, output
    assert "stopped by signal" in output
    assert (tmp_path / "m.zip").exists() and (tmp_path / "m.onnx").exists()
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["interrupted"] is True and report["steps"] > 0


@pytest.mark.parametrize("stepping", ["barrier", "hold"])
def test_other_trainer_leaving_then_sigterm_still_saves(tmp_path: Path, stepping: str) -> None:
    """The picker trainer leaves. With --stepping barrier (lock-step) the game then waits for picker actions
    and the mover trainer blocks in recv; with hold the game holds the picker agents and the mover trains
    on. Either way SIGTERM gets the mover trainer out, saved, with exit code 0."""
    with sim_broker(tmp_path, [(2, 2)]) as address, ExitStack() as stack:
        trainers = {
            policy: stack.enter_context(
                trainer(
                    *("--policy", policy, "--broker", address, "--stepping", stepping, *ENDLESS),
                    *("--save-model-path", str(tmp_path / f"{policy}.zip")),
                    *("--report-json", str(tmp_path / f"{policy}.json")),
                )
            )
            for policy in ("mover", "picker")
        }
        for policy, watched in trainers.items():
            watched.wait_for(rf"\[{policy}\] steps [1-9]")
        trainers["picker"].proc.send_signal(signal.SIGTERM)
        code, output = trainers["picker"].finish()
        assert code == 0, output
        mover = trainers["mover"]
        mover.lines_during(1.0)  # progress lines already on their way
        progress = [line for line in mover.lines_during(2.0) if "[mover] steps" in line]
        if stepping == "barrier":
            assert progress == [], progress  # blocked: no more steps without the picker's actions
        else:
            assert progress, "hold mode: the mover should train on without the picker trainer"
        assert mover.proc.poll() is None
        mover.proc.send_signal(signal.SIGTERM)
        code, output = mover.finish()
        assert code == 0, output
    for policy in ("mover", "picker"):
        assert (tmp_path / f"{policy}.zip").exists()
        assert json.loads((tmp_path / f"{policy}.json").read_text())["interrupted"] is True


def test_inference_runs_until_ctrl_c(tmp_path: Path, mover_broker: str) -> None:
    model = str(tmp_path / "m.zip")
    trained = run_train("--policy", "mover", "--broker", mover_broker, "--timesteps", "512", "--save-model-path", model)
    assert trained.returncode == 0, trained.stderr
    with trainer(
        *("--policy", "mover", "--broker", mover_broker, "--inference", "--resume-model-path", model),
        *("--progress", "lines", "--log-every", "0.2", "--report-json", str(tmp_path / "r.json")),
    ) as watched:
        line = watched.wait_for(r"\[mover\] steps [1-9]")
        assert "/" not in line.split("steps")[1].split()[0]  # no total: it runs until stopped
        watched.proc.send_signal(signal.SIGINT)
        code, output = watched.finish()
    assert code == 0, output
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["mode"] == "inference" and report["interrupted"] is True and report["steps"] > 0
