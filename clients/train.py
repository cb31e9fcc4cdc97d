"""``gdrl-train``: train (or run) one policy with Stable-Baselines3 against the broker.

One process per policy: ``gdrl-train --policy mover`` and ``gdrl-train --policy picker`` can train
at the same time through one broker. Every agent of the policy, in every game, is one env of an SB3
VecEnv (parameter sharing), so ``--timesteps`` counts agent steps summed over all agents.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import signal
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import numpy as np

from broker.protocol import DEFAULT_ADDRESS

DEFAULT_TIMESTEPS = 100_000

# Hyper-parameters: flag -> algorithms it applies to. Values not given keep our PPO defaults below or
# SB3's own defaults for the other algorithms.
HYPER_PARAMETERS: dict[str, tuple[str, ...]] = {
    "n_steps": ("ppo", "a2c"),
    "batch_size": ("ppo", "sac", "dqn"),
    "n_epochs": ("ppo",),
    "learning_rate": ("ppo", "a2c", "sac", "dqn"),
    "gamma": ("ppo", "a2c", "sac", "dqn"),
    "gae_lambda": ("ppo", "a2c"),
    "clip_range": ("ppo",),
    "ent_coef": ("ppo", "a2c", "sac"),
    "vf_coef": ("ppo", "a2c"),
    "max_grad_norm": ("ppo", "a2c", "dqn"),
    "buffer_size": ("sac", "dqn"),
    "learning_starts": ("sac", "dqn"),
}

# PPO defaults for many agents per policy: short rollouts per agent, several minibatches per update.
PPO_DEFAULTS: dict[str, float | int] = {
    "n_steps": 128,
    "batch_size": 256,
    "n_epochs": 4,
    "learning_rate": 3e-4,
    "gamma": 0.99,
    "gae_lambda": 0.95,
    "clip_range": 0.2,
    "ent_coef": 0.0,
    "vf_coef": 0.5,
    "max_grad_norm": 0.5,
}

ALGORITHM_CLASSES = {"ppo": "PPO", "a2c": "A2C", "sac": "SAC", "dqn": "DQN"}


EXAMPLES = """examples:
  gdrl-train --policy mover --save-model-path models/mover.zip --onnx-export-path models/mover.onnx
  gdrl-train --policy picker --algo dqn --timesteps 200000 --tensorboard-log logs
  gdrl-train --policy battle --net-arch 256,256 --n-steps 64 --batch-size 1024
  gdrl-train --policy mover --resume-model-path models/mover.zip --timesteps 50000 --save-model-path models/mover2.zip
  gdrl-train --policy mover --inference --resume-model-path models/mover.zip
"""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Show a flag's default only when it has a meaningful one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        meaningless = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if not meaningless and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gdrl-train",
        description="Train one policy (agent group) through the broker with Stable-Baselines3, or run a saved\n"
        "model with --inference. Ctrl-C or SIGTERM stops cleanly: the model (and ONNX, if asked) is saved\n"
        "and the exit code is 0.",
        formatter_class=_HelpFormatter,
        epilog=EXAMPLES,
    )
    conn = parser.add_argument_group("broker")
    conn.add_argument("--policy", required=True, help="policy (agent group) name to train")
    conn.add_argument("--broker", default=DEFAULT_ADDRESS, help="broker address: host:port or unix:/path")
    conn.add_argument("--token", default=None, help="shared token, if the broker requires one")
    conn.add_argument("--connect-timeout", type=float, default=60.0, help="seconds to keep trying to connect")
    conn.add_argument(
        "--stepping",
        choices=("hold", "barrier"),
        default=None,
        help="how games wait for this policy's actions (docs/protocol.md section 5): hold (a game waits at most "
        "--deadline-ms, then the agents keep their last action) or barrier (godot_rl's lock-step); "
        "default: the broker's --stepping",
    )
    conn.add_argument("--deadline-ms", type=float, default=None, help="with --stepping: how long a game tick waits")
    conn.add_argument(
        "--hold-action", choices=("repeat", "noop"), default=None, help="with --stepping hold: what held agents do"
    )
    conn.add_argument(
        "--no-fresh-start",
        action="store_true",
        help="PPO/A2C with hold stepping: after an update act on the observation from before it, as plain SB3 "
        "does (default: answer with the held actions and start the rollout from the newest observation)",
    )

    run = parser.add_argument_group("run")
    run.add_argument(
        "--algo",
        choices=sorted(ALGORITHM_CLASSES),
        default="ppo",
        help="ppo and a2c: any action space; sac: continuous actions (also binary discrete mixed with "
        "continuous); dqn: exactly one discrete action key",
    )
    run.add_argument(
        "--timesteps",
        type=int,
        default=None,
        help=f"agent steps summed over all agents of the policy (training default {DEFAULT_TIMESTEPS:,}; "
        "with --resume-model-path: steps added to the saved model's; with --inference: run this many, "
        "default until Ctrl-C)",
    )
    run.add_argument("--seed", type=int, default=0, help="random seed of the model")
    run.add_argument(
        "--inference",
        action="store_true",
        help="run the model of --resume-model-path deterministically, without learning",
    )
    run.add_argument("--device", default="auto", help="torch device (cpu, cuda, auto)")
    run.add_argument("--threads", type=int, default=1, help="torch CPU threads")

    model = parser.add_argument_group("model")
    model.add_argument(
        "--policy-type",
        default="MultiInputPolicy",
        help="SB3 policy name, or module:Class for your own; observations are always a gymnasium Dict",
    )
    model.add_argument(
        "--net-arch",
        default=None,
        help='hidden layers, e.g. "64,64" (actor and critic alike) or "pi=64,64;vf=256,256" '
        "(SAC: pi and qf); default: SB3's for the algorithm",
    )

    hyper = parser.add_argument_group(
        "hyper-parameters",
        "Not given: PPO uses the defaults shown, A2C/SAC/DQN use SB3's.\n"
        "A flag that does not apply to --algo is an error.",
    )
    hyper.add_argument("--n-steps", type=int, default=None, help="rollout length per agent (PPO 128; A2C)")
    hyper.add_argument("--batch-size", type=int, default=None, help="minibatch size (PPO 256; SAC, DQN)")
    hyper.add_argument("--n-epochs", type=int, default=None, help="epochs per PPO update (PPO 4)")
    hyper.add_argument("--learning-rate", type=float, default=None, help="learning rate (PPO 3e-4)")
    hyper.add_argument("--gamma", type=float, default=None, help="discount factor (PPO 0.99)")
    hyper.add_argument("--gae-lambda", type=float, default=None, help="GAE lambda (PPO 0.95; A2C)")
    hyper.add_argument("--clip-range", type=float, default=None, help="PPO clip range (PPO 0.2)")
    hyper.add_argument("--ent-coef", default=None, help="entropy coefficient (PPO 0.0; A2C; SAC: number or auto)")
    hyper.add_argument("--vf-coef", type=float, default=None, help="value loss coefficient (PPO 0.5; A2C)")
    hyper.add_argument("--max-grad-norm", type=float, default=None, help="gradient clipping (PPO 0.5; A2C, DQN)")
    hyper.add_argument("--buffer-size", type=int, default=None, help="replay buffer size (SAC, DQN)")
    hyper.add_argument("--learning-starts", type=int, default=None, help="steps before learning (SAC, DQN)")

    files = parser.add_argument_group("files")
    files.add_argument("--save-model-path", default=None, help="save the model here when done or stopped (.zip)")
    files.add_argument("--resume-model-path", default=None, help="load this model (.zip) and continue training it")
    files.add_argument(
        "--save-checkpoint-frequency",
        type=int,
        default=None,
        help="every this many agent steps save a checkpoint into <model>_checkpoints/ next to --save-model-path",
    )
    files.add_argument("--onnx-export-path", default=None, help="export the policy to ONNX here when done or stopped")
    files.add_argument(
        "--tensorboard-log", default=None, help="TensorBoard log folder; the run is named <policy>_<ALGO>_<n>"
    )
    files.add_argument("--report-json", default=None, help="write a JSON summary (with the reward curve) here")

    out = parser.add_argument_group("output")
    out.add_argument(
        "--progress",
        choices=("auto", "bar", "lines", "off"),
        default="auto",
        help="auto: a progress bar when stdout is a terminal, else a line every --log-every seconds",
    )
    out.add_argument("--log-every", type=float, default=5.0, help="seconds between progress lines")
    return parser


# --- options ------------------------------------------------------------------------------------


@dataclass
class Options:
    algo: str
    hyper: dict[str, Any]  # only what the algorithm takes
    policy_kwargs: dict[str, Any] = field(default_factory=dict)
    timesteps: int | None = None  # None: run until stopped (inference only)
    stepping: Any = None  # StepOptions, or None for the broker's default


def parse_net_arch(text: str, algo: str) -> list[int] | dict[str, list[int]]:
    def layers(part: str) -> list[int]:
        part = part.strip()
        if not part:
            return []
        try:
            sizes = [int(x) for x in part.split(",")]
        except ValueError:
            raise ValueError(f"--net-arch: {part!r} is not a comma-separated list of layer sizes") from None
        if any(n < 1 for n in sizes):
            raise ValueError(f"--net-arch: layer sizes must be positive, got {part!r}")
        return sizes

    if "=" not in text:
        return layers(text)
    heads = {"ppo": ("pi", "vf"), "a2c": ("pi", "vf"), "sac": ("pi", "qf")}.get(algo)
    if heads is None:
        raise ValueError(f"--net-arch: {algo.upper()} takes one list of layers, e.g. '64,64'")
    arch: dict[str, list[int]] = {}
    for part in text.split(";"):
        name, sep, value = part.partition("=")
        if not sep or name.strip() not in heads:
            raise ValueError(f"--net-arch: expected {heads[0]}=...;{heads[1]}=... for {algo.upper()}, got {text!r}")
        arch[name.strip()] = layers(value)
    return arch


def resolve_options(args: argparse.Namespace) -> Options:
    """Check flag combinations and build the algorithm's keyword arguments (raises ValueError)."""
    algo = args.algo
    hyper: dict[str, Any] = dict(PPO_DEFAULTS) if algo == "ppo" else {}
    for name, algos in HYPER_PARAMETERS.items():
        value = getattr(args, name)
        if value is None:
            continue
        if algo not in algos:
            takes = ", ".join(f"--{n.replace('_', '-')}" for n, a in HYPER_PARAMETERS.items() if algo in a)
            raise ValueError(f"--{name.replace('_', '-')} does not apply to {algo.upper()} (it takes {takes})")
        hyper[name] = value
    if "ent_coef" in hyper:
        text = str(hyper["ent_coef"])
        if algo == "sac" and text.startswith("auto"):
            hyper["ent_coef"] = text
        else:
            try:
                hyper["ent_coef"] = float(text)
            except ValueError:
                raise ValueError(f"--ent-coef must be a number, got {text!r}") from None
    if algo == "ppo" and hyper["batch_size"] < 2:
        raise ValueError("--batch-size must be at least 2 for PPO")
    policy_kwargs: dict[str, Any] = {}
    if args.net_arch is not None:
        policy_kwargs["net_arch"] = parse_net_arch(args.net_arch, algo)
    if args.resume_model_path:
        path = Path(args.resume_model_path)
        if not path.is_file() and not path.with_name(path.name + ".zip").is_file():
            raise ValueError(f"--resume-model-path: no model file at {path}")
        check_saved_algorithm(path if path.is_file() else path.with_name(path.name + ".zip"), algo)
    if args.inference:
        if not args.resume_model_path:
            raise ValueError("--inference runs a saved model: give it with --resume-model-path")
        timesteps = args.timesteps
    else:
        timesteps = DEFAULT_TIMESTEPS if args.timesteps is None else args.timesteps
    if timesteps is not None and timesteps < 1:
        raise ValueError("--timesteps must be positive")
    if args.save_checkpoint_frequency is not None:
        if args.save_checkpoint_frequency < 1:
            raise ValueError("--save-checkpoint-frequency must be positive")
        if not args.save_model_path:
            raise ValueError("--save-checkpoint-frequency needs --save-model-path (checkpoints go next to it)")
    if args.log_every <= 0:
        raise ValueError("--log-every must be positive")
    return Options(algo, hyper, policy_kwargs, timesteps, stepping_options(args))


# Attributes that only one algorithm saves in its zip's "data" (A2C's are all shared with PPO).
ALGORITHM_MARKERS: dict[str, str] = {"clip_range": "ppo", "target_entropy": "sac", "exploration_fraction": "dqn"}


def saved_algorithm(path: Path) -> str | None:
    """The algorithm of an SB3 zip (ppo, a2c, sac, dqn), read from its saved attributes; None if unknown."""
    try:
        with zipfile.ZipFile(path) as archive:
            data = json.loads(archive.read("data"))
    except (OSError, KeyError, ValueError, zipfile.BadZipFile):
        return None
    for key, algo in ALGORITHM_MARKERS.items():
        if key in data:
            return algo
    return "a2c" if "n_steps" in data and "gae_lambda" in data else None


def check_saved_algorithm(path: Path, algo: str) -> None:
    """Refuse to resume a model as another algorithm: SB3 would load it and train it wrongly."""
    saved = saved_algorithm(path)
    if saved is not None and saved != algo:
        raise ValueError(
            f"--resume-model-path {path} holds a {saved.upper()} model, but --algo is {algo}; "
            f"resume it with --algo {saved} (the default is ppo), or train a new {algo.upper()} model without it"
        )


def stepping_options(args: argparse.Namespace) -> Any:
    from broker.protocol.messages import StepOptions

    if args.stepping is None:
        if args.deadline_ms is not None or args.hold_action is not None:
            raise ValueError("--deadline-ms and --hold-action need --stepping (hold or barrier)")
        return None
    if args.deadline_ms is not None and args.deadline_ms < 0:
        raise ValueError("--deadline-ms must not be negative")
    return StepOptions(args.stepping, args.deadline_ms, args.hold_action or "repeat")


def action_space_problem(algo: str, action_space: Any, spaces_text: str) -> str | None:
    """Why ``algo`` cannot train this action space, or None."""
    from gymnasium import spaces

    if algo == "sac" and not isinstance(action_space, spaces.Box):
        other = " (or dqn)" if isinstance(action_space, spaces.Discrete) else ""
        return (
            f"SAC needs continuous actions, but this policy's actions ({spaces_text}) convert to "
            f"{action_space}; use --algo ppo or a2c{other}"
        )
    if algo == "dqn" and not isinstance(action_space, spaces.Discrete):
        other = " (or sac)" if isinstance(action_space, spaces.Box) else ""
        return (
            f"DQN needs exactly one discrete action key, but this policy's actions ({spaces_text}) convert to "
            f"{action_space}; use --algo ppo or a2c{other}"
        )
    return None


def resolve_policy_type(text: str) -> Any:
    if ":" not in text:
        return text
    module_name, _, class_name = text.partition(":")
    try:
        return getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--policy-type {text}: cannot import: {exc}") from exc


# --- progress -----------------------------------------------------------------------------------


class Tracker:
    """Records finished episodes and shows progress: a tqdm bar on a terminal, or periodic lines."""

    def __init__(
        self, policy: str, total: int | None, mode: str, log_every: float, stream: TextIO, base: int = 0
    ) -> None:
        self.policy = policy
        self.total = total
        self.log_every = log_every
        self.stream = stream
        if mode == "auto":
            mode = "bar" if stream.isatty() else "lines"
        self.mode = mode
        self.episodes: list[tuple[int, float]] = []
        self.started = time.monotonic()
        self.last_line = self.started
        self.base = base  # the model's step count when this run started
        self.steps = base
        self.bar: Any = None
        if mode == "bar":
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=policy, unit="step", file=stream, dynamic_ncols=True, smoothing=0.1)

    @property
    def done(self) -> int:
        return self.steps - self.base

    def mean_recent(self, count: int = 100) -> float | None:
        recent = [r for _, r in self.episodes[-count:]]
        return float(np.mean(recent)) if recent else None

    def update(self, num_timesteps: int, infos: list[dict[str, Any]]) -> None:
        for info in infos:
            episode = info.get("episode")
            if episode is not None:
                self.episodes.append((num_timesteps, float(episode["r"])))
        delta, self.steps = num_timesteps - self.steps, num_timesteps
        now = time.monotonic()
        if self.bar is not None:
            if self.bar.total is not None and self.done > self.bar.total:
                self.bar.total = self.done  # SB3 rounds up to whole rollouts
            self.bar.update(delta)
            mean = self.mean_recent()
            if mean is not None and now - self.last_line >= 0.5:
                self.last_line = now
                self.bar.set_postfix(reward=f"{mean:.3f}", episodes=len(self.episodes), refresh=False)
        elif self.mode == "lines" and now - self.last_line >= self.log_every:
            self.last_line = now
            self.print_line(now)

    def print_line(self, now: float) -> None:
        done = self.done
        rate = done / max(now - self.started, 1e-9)
        total = f"/{self.total}" if self.total else ""
        percent = f" ({100 * done / self.total:.0f}%)" if self.total else ""
        mean = self.mean_recent()
        reward = f"{mean:.3f}" if mean is not None else "n/a"
        print(
            f"[{self.policy}] steps {done}{total}{percent} {rate:.0f} steps/s, episodes {len(self.episodes)}, "
            f"mean episode reward {reward} (last 100)",
            file=self.stream,
            flush=True,
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def make_callback(tracker: Tracker) -> Any:
    from stable_baselines3.common.callbacks import BaseCallback

    class TrackerCallback(BaseCallback):
        def _on_step(self) -> bool:
            tracker.update(self.num_timesteps, self.locals["infos"])
            return True

    return TrackerCallback()


# --- running ------------------------------------------------------------------------------------


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        options = resolve_options(args)
        policy_type = resolve_policy_type(args.policy_type)
    except ValueError as exc:
        parser.error(str(exc))
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)  # SIGTERM stops like Ctrl-C: save, exit 0
    # Also when started from a non-interactive shell, which hands its background jobs SIGINT ignored:
    # an explicit SIGINT to a trainer means "save and stop" there too.
    previous_int = signal.signal(signal.SIGINT, _raise_interrupt)
    try:
        return _run(args, options, policy_type)
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)


def _fail(message: str) -> None:
    print(f"gdrl-train: {message}", file=sys.stderr, flush=True)


def _run(args: argparse.Namespace, options: Options, policy_type: Any) -> int:
    import stable_baselines3
    import torch
    from stable_baselines3.common.vec_env import VecMonitor

    from broker.log import configure_logging
    from clients.errors import BrokerError
    from clients.vec_env import BrokerVecEnv

    configure_logging()
    torch.set_num_threads(args.threads)
    try:
        broker_env = BrokerVecEnv(
            args.policy,
            args.broker,
            token=args.token,
            timeout_connect=args.connect_timeout,
            stepping=options.stepping,
        )
    except KeyboardInterrupt:
        _fail(f"stopped by signal while joining the broker at {args.broker} as trainer of '{args.policy}'")
        return 130
    except (BrokerError, OSError) as exc:
        _fail(f"cannot join the broker at {args.broker} as trainer of '{args.policy}': {exc}")
        return 1
    spaces_text = ", ".join(f"{k}: {s.to_wire()}" for k, s in broker_env.spaces.action)
    problem = action_space_problem(options.algo, broker_env.action_space, spaces_text)
    if problem:
        _fail(problem)
        broker_env.close()
        return 2
    env = VecMonitor(broker_env)
    algorithm = getattr(stable_baselines3, ALGORITHM_CLASSES[options.algo])
    tb_name = f"{args.policy}_{algorithm.__name__}"
    try:
        if args.resume_model_path:
            overrides = {} if args.inference else _explicit_hyper(args, options)
            model = algorithm.load(
                args.resume_model_path, env=env, device=args.device, tensorboard_log=args.tensorboard_log, **overrides
            )
            model.set_random_seed(args.seed)
        else:
            model = algorithm(
                policy_type,
                env,
                seed=args.seed,
                device=args.device,
                tensorboard_log=args.tensorboard_log,
                policy_kwargs=options.policy_kwargs or None,
                verbose=0,
                **options.hyper,
            )
    except KeyboardInterrupt:
        env.close()
        return 0
    except Exception as exc:  # SB3 reports bad policies, spaces and files with assorted exception types
        verb = "load" if args.resume_model_path else "build"
        _fail(f"cannot {verb} the {algorithm.__name__} model: {type(exc).__name__}: {exc}")
        env.close()
        return 2

    tracker = Tracker(args.policy, options.timesteps, args.progress, args.log_every, sys.stdout, model.num_timesteps)
    started = time.monotonic()
    interrupted = False
    broker_lost: str | None = None
    try:
        if args.inference:
            run_inference(model, env, tracker, options.timesteps)
        else:
            callbacks = [make_callback(tracker)]
            if options.algo in ("ppo", "a2c") and not args.no_fresh_start:
                from clients.callbacks import FreshStartCallback

                callbacks.append(FreshStartCallback())
            if args.save_checkpoint_frequency:
                callbacks.append(_checkpoint_callback(args, env.num_envs))
            assert options.timesteps is not None
            model.learn(
                total_timesteps=options.timesteps,
                callback=callbacks,
                tb_log_name=tb_name,
                reset_num_timesteps=not args.resume_model_path,
            )
    except KeyboardInterrupt:
        interrupted = True
    except BrokerError as exc:
        broker_lost = str(exc)
    finally:
        # Nothing interrupts the saving below.
        old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
        old_term = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        elapsed = time.monotonic() - started
        tracker.close()
        if interrupted:
            print(f"[{args.policy}] stopped by signal after {tracker.done} steps", flush=True)
        if broker_lost:
            _fail(f"lost the broker: {broker_lost}")
        return _finish(args, options, model, broker_env, tracker, elapsed, interrupted, broker_lost)
    finally:
        env.close()
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)


def _explicit_hyper(args: argparse.Namespace, options: Options) -> dict[str, Any]:
    """On resume, only the hyper-parameters given on the command line replace the saved ones."""
    return {name: options.hyper[name] for name in HYPER_PARAMETERS if getattr(args, name) is not None}


def _checkpoint_callback(args: argparse.Namespace, n_envs: int) -> Any:
    from stable_baselines3.common.callbacks import CheckpointCallback

    model_path = Path(args.save_model_path)
    folder = model_path.parent / f"{model_path.name.removesuffix('.zip')}_checkpoints"
    return CheckpointCallback(max(args.save_checkpoint_frequency // n_envs, 1), str(folder), name_prefix=args.policy)


def run_inference(model: Any, env: Any, tracker: Tracker, timesteps: int | None) -> None:
    """Deterministic actions until ``timesteps`` agent steps (None: until stopped); no learning."""
    obs = env.reset()
    steps = 0
    while timesteps is None or steps < timesteps:
        actions, _ = model.predict(obs, deterministic=True)
        obs, _rewards, _dones, infos = env.step(actions)
        steps += env.num_envs
        tracker.update(tracker.base + steps, infos)


def _finish(
    args: argparse.Namespace,
    options: Options,
    model: Any,
    broker_env: Any,
    tracker: Tracker,
    elapsed: float,
    interrupted: bool,
    broker_lost: str | None,
) -> int:
    code = 1 if broker_lost else 0
    model_path = onnx_path = None
    if args.save_model_path and not args.inference:
        model.save(args.save_model_path)
        model_path = str(Path(args.save_model_path).with_suffix(".zip"))
    if args.onnx_export_path:
        from clients.onnx_export import export_onnx

        try:
            export_onnx(model, args.onnx_export_path, broker_env.spaces, policy_name=args.policy)
            onnx_path = str(args.onnx_export_path)
        except (ValueError, TypeError, RuntimeError) as exc:
            _fail(f"ONNX export failed: {exc}")
            code = 1
    steps = tracker.done
    report = summarize(args.policy, broker_env.num_envs, tracker.episodes, steps, elapsed)
    report.update(
        algo=model.__class__.__name__,
        mode="inference" if args.inference else "train",
        total_steps=int(model.num_timesteps) if not args.inference else steps,
        interrupted=interrupted,
        error=broker_lost,
        model_path=model_path,
        onnx_path=onnx_path,
    )
    if args.report_json:
        path = Path(args.report_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2))
    print(summary_line(report), flush=True)
    return code


def summary_line(report: dict[str, Any]) -> str:
    def reward(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.3f}"

    rate = report["steps"] / report["seconds"] if report["seconds"] else math.nan
    parts = [
        f"[{report['policy']}] done: {report['steps']} steps in {report['seconds']} s ({rate:.0f} steps/s), "
        f"{report['agents']} agents, {report['episodes']} episodes, mean episode reward "
        f"{reward(report['reward_start'])} -> {reward(report['reward_end'])}"
    ]
    if report.get("model_path"):
        parts.append(f"model {report['model_path']}")
    if report.get("onnx_path"):
        parts.append(f"onnx {report['onnx_path']}")
    return "; ".join(parts)


def summarize(
    policy: str, n_envs: int, episodes: list[tuple[int, float]], steps: int, seconds: float
) -> dict[str, Any]:
    """Run summary; ``reward_start``/``reward_end`` average the first/last fifth of the episodes (at most 100)."""
    k = max(1, min(100, len(episodes) // 5))
    first = [r for _, r in episodes[:k]]
    last = [r for _, r in episodes[-k:]]
    return {
        "policy": policy,
        "agents": n_envs,
        "steps": steps,
        "seconds": round(seconds, 1),
        "episodes": len(episodes),
        "reward_start": float(np.mean(first)) if first else None,
        "reward_end": float(np.mean(last)) if last else None,
        "curve": [[t, r] for t, r in episodes],
    }


if __name__ == "__main__":
    sys.exit(main())
