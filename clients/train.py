"""``gdrl-train``: train (or run) one policy with Stable-Baselines3 against the broker.

One process per policy: ``gdrl-train --policy mover`` and ``gdrl-train --policy picker`` can train
at the same time through one broker. Every agent of the policy, in every game, is one env of an SB3
VecEnv (parameter sharing), so ``--timesteps`` counts agent steps summed over all agents.
"""

from __future__ import annotations

import json
import math
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import numpy as np

from clients.errors import BrokerError
from clients.train_options import (
    ALGORITHM_CLASSES,
    TrainOptions,
    action_space_problem,
    build_parser,
    resolve_options,
    resolve_policy_type,
)

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
        policy_type = resolve_policy_type(options.policy_type)
    except ValueError as exc:
        parser.error(str(exc))
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)  # SIGTERM stops like Ctrl-C: save, exit 0
    # Also when started from a non-interactive shell, which hands its background jobs SIGINT ignored:
    # an explicit SIGINT to a trainer means "save and stop" there too.
    previous_int = signal.signal(signal.SIGINT, _raise_interrupt)
    try:
        return _run(options, policy_type)
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)


def _fail(message: str) -> None:
    print(f"gdrl-train: {message}", file=sys.stderr, flush=True)


class _Stop(Exception):
    """Leave ``_run`` with this exit code; what went wrong was already said."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def _run(options: TrainOptions, policy_type: Any) -> int:
    import torch
    from stable_baselines3.common.vec_env import VecMonitor

    from broker.log import configure_logging

    configure_logging()
    torch.set_num_threads(options.threads)
    try:
        broker_env = _join(options)
        env = VecMonitor(broker_env)
        try:
            model = _build_model(options, policy_type, env)
            self_play, team_change, first_turn = _start_opponents(options, model, broker_env.spaces)
        except _Stop:
            env.close()
            raise
    except _Stop as stop:
        return stop.code
    tracker = Tracker(
        options.policy, options.total_timesteps, options.progress, options.log_every, sys.stdout, model.num_timesteps
    )
    started = time.monotonic()
    interrupted = False
    broker_lost: str | None = None
    try:
        if options.inference:
            run_inference(model, env, tracker, options.total_timesteps)
        else:
            _learn(options, model, env, tracker, self_play, team_change, first_turn)
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
            print(f"[{options.policy}] stopped by signal after {tracker.done} steps", flush=True)
        if broker_lost:
            _fail(f"lost the broker: {broker_lost}")
        return _finish(options, model, broker_env, tracker, elapsed, interrupted, broker_lost)
    finally:
        env.close()
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)


def _join(options: TrainOptions) -> Any:
    """The broker session, its action space checked against --algo."""
    try:
        broker_env = connect(options)
    except KeyboardInterrupt:
        _fail(f"stopped by signal while joining the broker at {options.broker} as trainer of '{options.policy}'")
        raise _Stop(130) from None
    except (BrokerError, OSError) as exc:
        _fail(f"cannot join the broker at {options.broker} as trainer of '{options.policy}': {exc}")
        raise _Stop(1) from None
    spaces_text = ", ".join(f"{k}: {s.to_wire()}" for k, s in broker_env.spaces.action)
    problem = action_space_problem(options.algo, broker_env.action_space, spaces_text)
    if problem:
        _fail(problem)
        broker_env.close()
        raise _Stop(2)
    return broker_env


def _algorithm(options: TrainOptions) -> Any:
    import stable_baselines3

    return getattr(stable_baselines3, ALGORITHM_CLASSES[options.algo])


def _build_model(options: TrainOptions, policy_type: Any, env: Any) -> Any:
    """A new model, or the one of --resume-model-path (with the hyper-parameters given now, when training)."""
    algorithm = _algorithm(options)
    try:
        if options.resume_model_path:
            overrides = {} if options.inference else options.explicit_hyper
            model = algorithm.load(
                options.resume_model_path,
                env=env,
                device=options.device,
                tensorboard_log=options.tensorboard_log,
                **overrides,
            )
            model.set_random_seed(options.seed)
            return model
        return algorithm(
            policy_type,
            env,
            seed=options.seed,
            device=options.device,
            tensorboard_log=options.tensorboard_log,
            policy_kwargs=options.policy_kwargs or None,
            verbose=0,
            **options.hyper,
        )
    except KeyboardInterrupt:
        raise _Stop(0) from None
    except Exception as exc:  # SB3 reports bad policies, spaces and files with assorted exception types
        verb = "load" if options.resume_model_path else "build"
        _fail(f"cannot {verb} the {algorithm.__name__} model: {type(exc).__name__}: {exc}")
        raise _Stop(2) from None


def _start_opponents(options: TrainOptions, model: Any, spaces: Any) -> tuple[Any, Any, Any]:
    """Self-play (--opponent) and team change (--team-change), each started with the broker if asked for:
    (self_play, team_change, the first turn)."""
    self_play = team_change = first_turn = None
    if options.opponent is not None:
        from clients.self_play import SelfPlay

        self_play = SelfPlay(
            options.broker,
            options.token,
            options.policy,
            options.opponent,
            options.pool_dir or f"pool-{options.policy}",
            spaces,
            options.window,
            options.play_latest,
            options.swap_every,
            options.seed,
            options.keep,
        )
        try:
            self_play.start(model)
        except (BrokerError, OSError, ValueError) as exc:
            _fail(f"cannot start self-play against '{options.opponent}': {exc}")
            raise _Stop(2) from None
    if options.team_change is not None:
        from clients.team_change import TeamChange

        team_change = TeamChange.of_options(options, spaces)
        try:
            first_turn = team_change.start(model)
        except (BrokerError, OSError, ValueError) as exc:
            _fail(f"cannot take turns with '{options.team_change}': {exc}")
            raise _Stop(2) from None
    return self_play, team_change, first_turn


def _learn(
    options: TrainOptions, model: Any, env: Any, tracker: Tracker, self_play: Any, team_change: Any, first_turn: Any
) -> None:
    callbacks = [make_callback(tracker)]
    if options.algo in ("ppo", "a2c") and not options.no_fresh_start:
        from clients.callbacks import FreshStartCallback

        callbacks.append(FreshStartCallback())
    if options.save_checkpoint_frequency:
        callbacks.append(_checkpoint_callback(options, env.num_envs))
    if self_play is not None:
        from clients.self_play import SelfPlayCallback

        callbacks.append(SelfPlayCallback(self_play, options.snapshot_every))
    assert options.total_timesteps is not None
    tb_name = f"{options.policy}_{_algorithm(options).__name__}"
    if team_change is not None:
        from clients.team_change import learn_options_in_turns

        learn_options_in_turns(model, team_change, first_turn, options, callbacks, tb_name)
    else:
        model.learn(
            total_timesteps=options.total_timesteps,
            callback=callbacks,
            tb_log_name=tb_name,
            reset_num_timesteps=not options.resume_model_path,
        )


def connect(options: TrainOptions) -> Any:
    """This trainer's session with the broker, as a VecEnv."""
    from clients.vec_env import BrokerVecEnv

    return BrokerVecEnv(
        options.policy,
        options.broker,
        token=options.token,
        timeout_connect=options.connect_timeout,
        stepping=options.step_options,
    )


def _checkpoint_callback(options: TrainOptions, n_envs: int) -> Any:
    from stable_baselines3.common.callbacks import CheckpointCallback

    assert options.save_model_path and options.save_checkpoint_frequency  # check() made sure
    model_path = Path(options.save_model_path)
    folder = model_path.parent / f"{model_path.name.removesuffix('.zip')}_checkpoints"
    every = max(options.save_checkpoint_frequency // n_envs, 1)
    return CheckpointCallback(every, str(folder), name_prefix=options.policy)


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
    options: TrainOptions,
    model: Any,
    broker_env: Any,
    tracker: Tracker,
    elapsed: float,
    interrupted: bool,
    broker_lost: str | None,
) -> int:
    code = 1 if broker_lost else 0
    model_path = onnx_path = None
    if options.save_model_path and not options.inference:
        model.save(options.save_model_path)
        model_path = str(Path(options.save_model_path).with_suffix(".zip"))
    if options.onnx_export_path:
        from clients.onnx_export import export_onnx

        try:
            export_onnx(model, options.onnx_export_path, broker_env.spaces, policy_name=options.policy)
            onnx_path = str(options.onnx_export_path)
        except (ValueError, TypeError, RuntimeError) as exc:
            _fail(f"ONNX export failed: {exc}")
            code = 1
    steps = tracker.done
    report = summarize(options.policy, broker_env.num_envs, tracker.episodes, steps, elapsed)
    report.update(
        algo=model.__class__.__name__,
        mode="inference" if options.inference else "train",
        total_steps=int(model.num_timesteps) if not options.inference else steps,
        interrupted=interrupted,
        error=broker_lost,
        model_path=model_path,
        onnx_path=onnx_path,
    )
    if options.report_json:
        path = Path(options.report_json)
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
