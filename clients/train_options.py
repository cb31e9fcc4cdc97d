"""``gdrl-train``'s options: one frozen dataclass (``TrainOptions``) whose fields carry their flag, group,
help and, for hyper-parameters, the algorithms they apply to and our PPO default; the parser is built from
it (``build_parser``), and the checks of a combination of options live beside it (``TrainOptions.check``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from functools import cached_property
from pathlib import Path
from typing import Any

from broker.cli import HelpFormatter
from broker.protocol import DEFAULT_ADDRESS, TOKEN_ENV
from broker.protocol.messages import HOLD_DEADLINE_DEFAULT_TEXT

DEFAULT_TIMESTEPS = 100_000
ALGORITHM_CLASSES = {"ppo": "PPO", "a2c": "A2C", "sac": "SAC", "dqn": "DQN"}
HYPER_GROUP = "hyper-parameters"
# Argument groups of --help, in order, with their descriptions.
GROUPS: dict[str, str | None] = {
    "broker": None,
    "run": None,
    "model": None,
    HYPER_GROUP: "Not given: PPO uses the defaults shown, A2C/SAC/DQN use SB3's.\n"
    "A flag that does not apply to --algo is an error.",
    "files": None,
    "self-play": "Train --policy against frozen snapshots of itself that the broker plays as --opponent, or "
    "take turns with the trainer of --team-change (docs/self_play.md; ML-Agents' names in brackets).",
    "output": None,
}


def _flag(group: str, default: Any = None, help: str = "", **argparse_kwargs: Any) -> Any:
    """A TrainOptions field: its default, and how ``build_parser`` offers it (``--name-with-dashes``)."""
    return field(default=default, metadata={"group": group, "help": help, "argparse": argparse_kwargs})


def _hyper(
    help: str, type: Callable[[str], Any] | None, algos: tuple[str, ...], ppo: Any = None, note: str = ""
) -> Any:
    """A hyper-parameter: the algorithms it applies to and our PPO default (for many agents per policy:
    short rollouts per agent, several minibatches per update). Not given: that default, or SB3's."""
    others = ", ".join(a.upper() for a in algos if a != "ppo")
    applies = "; ".join(part for part in (f"PPO {ppo}" if ppo is not None else "", others) if part)
    metadata = {
        "group": HYPER_GROUP,
        "help": f"{help} ({applies}){note}",
        "argparse": {"type": type} if type else {},
        "algos": algos,
        "ppo": ppo,
    }
    return field(default=None, metadata=metadata)


@dataclass(frozen=True)
class TrainOptions:
    """Every gdrl-train option, as given on the command line: one field per flag, whose metadata (group,
    help, type, choices) builds the parser. ``check()`` refuses bad combinations; the cached properties
    below are what the run uses."""

    # broker
    policy: str = _flag("broker", help="policy (agent group) name to train", required=True)
    broker: str = _flag("broker", DEFAULT_ADDRESS, "broker address: host:port or unix:/path")
    token: str | None = _flag("broker", help=f"shared token, if the broker requires one (default: env {TOKEN_ENV})")
    connect_timeout: float = _flag("broker", 60.0, "seconds to keep trying to connect", type=float)
    stepping: str | None = _flag(
        "broker",
        help="how games wait for this policy's actions (docs/protocol.md section 5): hold (a game waits at most "
        "--deadline-ms, then the agents keep their last action) or barrier (godot_rl's lock-step); "
        "default: the broker's --stepping",
        choices=("hold", "barrier"),
    )
    deadline_ms: float | None = _flag(
        "broker",
        help="with --stepping: how long a game tick waits; barrier default: no limit; hold default: "
        + HOLD_DEADLINE_DEFAULT_TEXT,
        type=float,
    )
    hold_action: str | None = _flag(
        "broker", help="with --stepping hold: what held agents do", choices=("repeat", "noop")
    )
    no_fresh_start: bool = _flag(
        "broker",
        False,
        "PPO/A2C with hold stepping: after an update act on the observation from before it, as plain SB3 "
        "does (default: answer with the held actions and start the rollout from the newest observation)",
        action="store_true",
    )
    # run
    algo: str = _flag(
        "run",
        "ppo",
        "ppo and a2c: any action space; sac: continuous actions (also binary discrete mixed with "
        "continuous); dqn: exactly one discrete action key",
        choices=sorted(ALGORITHM_CLASSES),
    )
    timesteps: int | None = _flag(
        "run",
        help=f"agent steps summed over all agents of the policy (training default {DEFAULT_TIMESTEPS:,}; "
        "with --resume-model-path: steps added to the saved model's; with --inference: run this many, "
        "default until Ctrl-C)",
        type=int,
    )
    seed: int = _flag("run", 0, "random seed of the model", type=int)
    inference: bool = _flag(
        "run", False, "run the model of --resume-model-path deterministically, without learning", action="store_true"
    )
    device: str = _flag("run", "auto", "torch device (cpu, cuda, auto)")
    threads: int = _flag("run", 1, "torch CPU threads", type=int)
    # model
    policy_type: str = _flag(
        "model",
        "MultiInputPolicy",
        "SB3 policy name, or module:Class for your own; observations are always a gymnasium Dict",
    )
    net_arch: str | None = _flag(
        "model",
        help='hidden layers, e.g. "64,64" (actor and critic alike) or "pi=64,64;vf=256,256" '
        "(SAC: pi and qf); default: SB3's for the algorithm",
    )
    # hyper-parameters
    n_steps: int | None = _hyper("rollout length per agent", int, ("ppo", "a2c"), 128)
    batch_size: int | None = _hyper("minibatch size", int, ("ppo", "sac", "dqn"), 256)
    n_epochs: int | None = _hyper("epochs per PPO update", int, ("ppo",), 4)
    learning_rate: float | None = _hyper("learning rate", float, ("ppo", "a2c", "sac", "dqn"), 3e-4)
    gamma: float | None = _hyper("discount factor", float, ("ppo", "a2c", "sac", "dqn"), 0.99)
    gae_lambda: float | None = _hyper("GAE lambda", float, ("ppo", "a2c"), 0.95)
    clip_range: float | None = _hyper("PPO clip range", float, ("ppo",), 0.2)
    ent_coef: str | float | None = _hyper(
        "entropy coefficient", None, ("ppo", "a2c", "sac"), 0.0, note="; SAC: a number or auto"
    )
    vf_coef: float | None = _hyper("value loss coefficient", float, ("ppo", "a2c"), 0.5)
    max_grad_norm: float | None = _hyper("gradient clipping", float, ("ppo", "a2c", "dqn"), 0.5)
    buffer_size: int | None = _hyper("replay buffer size", int, ("sac", "dqn"))
    learning_starts: int | None = _hyper("steps before learning", int, ("sac", "dqn"))
    # files
    save_model_path: str | None = _flag("files", help="save the model here when done or stopped (.zip)")
    resume_model_path: str | None = _flag("files", help="load this model (.zip) and continue training it")
    save_checkpoint_frequency: int | None = _flag(
        "files",
        help="every this many agent steps save a checkpoint into <model>_checkpoints/ next to --save-model-path",
        type=int,
    )
    onnx_export_path: str | None = _flag("files", help="export the policy to ONNX here when done or stopped")
    tensorboard_log: str | None = _flag("files", help="TensorBoard log folder; the run is named <policy>_<ALGO>_<n>")
    report_json: str | None = _flag("files", help="write a JSON summary (with the reward curve) here")
    # self-play
    opponent: str | None = _flag(
        "self-play", help="the group the broker plays from this policy's snapshots (same spaces as --policy)"
    )
    pool_dir: str | None = _flag("self-play", help="the snapshot pool directory (default: pool-<policy>)")
    snapshot_every: int = _flag(
        "self-play", 20_000, "agent steps between snapshots written to the pool [save_steps]", type=int
    )
    window: int = _flag("self-play", 10, "the opponent is drawn from the last this many snapshots [window]", type=int)
    play_latest: float = _flag(
        "self-play",
        0.5,
        "probability that a swap picks the latest snapshot, else one of the window [play_against_latest_model_ratio]",
        type=float,
    )
    swap_every: int = _flag(
        "self-play", 10_000, "opponent steps (the broker counts them) between swaps [swap_steps]", type=int
    )
    keep: int = _flag(
        "self-play",
        0,
        "keep at most this many snapshots, deleting the oldest (never the one playing); 0: all",
        type=int,
    )
    team_change: str | None = _flag(
        "self-play",
        help="asymmetric games: the partner group, whose own trainer takes turns with this one; the idle team "
        "is played from its latest snapshot in --pool-dir [team_change]",
    )
    team_change_every: int = _flag(
        "self-play", 10_000, "with --team-change: idle-team steps (the broker counts them) per turn", type=int
    )
    # output
    progress: str = _flag(
        "output",
        "auto",
        "auto: a progress bar when stdout is a terminal, else a line every --log-every seconds",
        choices=("auto", "bar", "lines", "off"),
    )
    log_every: float = _flag("output", 5.0, "seconds between progress lines", type=float)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TrainOptions:
        return cls(**vars(args))

    @cached_property
    def hyper(self) -> dict[str, Any]:
        """The algorithm's keyword arguments: our PPO defaults (PPO only), then what was given."""
        algo = self.algo
        hyper: dict[str, Any] = dict(PPO_DEFAULTS) if algo == "ppo" else {}
        for name, algos in HYPER_PARAMETERS.items():
            value = getattr(self, name)
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
        return hyper

    @cached_property
    def explicit_hyper(self) -> dict[str, Any]:
        """On resume, only the hyper-parameters given on the command line replace the saved ones."""
        return {name: self.hyper[name] for name in HYPER_PARAMETERS if getattr(self, name) is not None}

    @cached_property
    def policy_kwargs(self) -> dict[str, Any]:
        return {} if self.net_arch is None else {"net_arch": parse_net_arch(self.net_arch, self.algo)}

    @cached_property
    def total_timesteps(self) -> int | None:
        """Agent steps to run; None: until stopped (inference only)."""
        if self.inference:
            return self.timesteps
        return DEFAULT_TIMESTEPS if self.timesteps is None else self.timesteps

    @cached_property
    def step_options(self) -> Any:
        """StepOptions, or None for the broker's default."""
        from broker.protocol.messages import StepOptions

        if self.stepping is None:
            if self.deadline_ms is not None or self.hold_action is not None:
                raise ValueError("--deadline-ms and --hold-action need --stepping (hold or barrier)")
            return None
        if self.deadline_ms is not None and self.deadline_ms < 0:
            raise ValueError("--deadline-ms must not be negative")
        return StepOptions(self.stepping, self.deadline_ms, self.hold_action or "repeat")

    def check(self) -> None:
        """Refuse bad flag combinations (raises ValueError), in the order the flags are documented."""
        self.hyper  # noqa: B018 - computing them checks them
        self.policy_kwargs  # noqa: B018
        if self.resume_model_path:
            path = Path(self.resume_model_path)
            if not path.is_file() and not path.with_name(path.name + ".zip").is_file():
                raise ValueError(f"--resume-model-path: no model file at {path}")
            check_saved_algorithm(path if path.is_file() else path.with_name(path.name + ".zip"), self.algo)
        if self.inference and not self.resume_model_path:
            raise ValueError("--inference runs a saved model: give it with --resume-model-path")
        if self.total_timesteps is not None and self.total_timesteps < 1:
            raise ValueError("--timesteps must be positive")
        if self.save_checkpoint_frequency is not None:
            if self.save_checkpoint_frequency < 1:
                raise ValueError("--save-checkpoint-frequency must be positive")
            if not self.save_model_path:
                raise ValueError("--save-checkpoint-frequency needs --save-model-path (checkpoints go next to it)")
        if self.log_every <= 0:
            raise ValueError("--log-every must be positive")
        self.step_options  # noqa: B018
        if self.opponent is not None:
            if self.opponent == self.policy:
                raise ValueError("--opponent must be another group than --policy")
            if self.inference:
                raise ValueError("--opponent trains against snapshots: it does not go with --inference")
            if self.snapshot_every < 1 or self.window < 1 or self.swap_every < 1:
                raise ValueError("--snapshot-every, --window and --swap-every must be positive")
            if not 0.0 <= self.play_latest <= 1.0:
                raise ValueError("--play-latest must be within [0, 1]")
            if self.keep and self.keep < self.window:
                raise ValueError("--keep must be 0 (keep all) or at least --window")
        if self.keep < 0:
            raise ValueError("--keep must not be negative")
        if self.team_change is not None:
            from clients.team_change import check_options

            check_options(self)


OPTION_FIELDS = fields(TrainOptions)
# Hyper-parameter -> algorithms it applies to, and our PPO defaults: read from the fields above.
HYPER_PARAMETERS: dict[str, tuple[str, ...]] = {
    f.name: f.metadata["algos"] for f in OPTION_FIELDS if "algos" in f.metadata
}
PPO_DEFAULTS: dict[str, Any] = {f.name: f.metadata["ppo"] for f in OPTION_FIELDS if f.metadata.get("ppo") is not None}


EXAMPLES = """examples:
  gdrl-train --policy mover --save-model-path models/mover.zip --onnx-export-path models/mover.onnx
  gdrl-train --policy picker --algo dqn --timesteps 200000 --tensorboard-log logs
  gdrl-train --policy battle --net-arch 256,256 --n-steps 64 --batch-size 1024
  gdrl-train --policy mover --resume-model-path models/mover.zip --timesteps 50000 --save-model-path models/mover2.zip
  gdrl-train --policy mover --inference --resume-model-path models/mover.zip
"""


def build_parser() -> argparse.ArgumentParser:
    """The parser of TrainOptions: one flag per field, ``--name-with-dashes``, in the fields' groups."""
    parser = argparse.ArgumentParser(
        prog="gdrl-train",
        description="Train one policy (agent group) through the broker with Stable-Baselines3, or run a saved\n"
        "model with --inference. Ctrl-C or SIGTERM stops cleanly: the model (and ONNX, if asked) is saved\n"
        "and the exit code is 0.",
        formatter_class=HelpFormatter,
        epilog=EXAMPLES,
    )
    groups = {name: parser.add_argument_group(name, description) for name, description in GROUPS.items()}
    for option in OPTION_FIELDS:
        kwargs = dict(option.metadata["argparse"])
        if not kwargs.get("required"):
            kwargs["default"] = option.default
        flag = "--" + option.name.replace("_", "-")
        groups[option.metadata["group"]].add_argument(flag, help=option.metadata["help"], **kwargs)
    return parser


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


def resolve_options(args: argparse.Namespace) -> TrainOptions:
    """The parsed flags as TrainOptions, checked (raises ValueError)."""
    options = TrainOptions.from_args(args)
    options.check()
    return options


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
