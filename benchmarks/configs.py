"""What one benchmark run measures, the presets, and the benchmark game's world (shared by every mode).

A configuration is agents per policy x observation kind x policies x games. Every mode steps the same
world: per agent an observation (8 or 64 float32, or an 84x84x3 uint8 image plus 8 floats, as the
godot_rl emulator sends), a continuous action of 2 floats, and episodes that end by time limit, staggered
so that about one row in ``HORIZON`` ends each step (those rows carry a final observation).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Final

import numpy as np

from broker.protocol.messages import StepData
from broker.protocol.spaces import BoxSpace, ContinuousAction, GroupSpec, PolicySpaces

HORIZON: Final = 50
IMAGE_SHAPE: Final = (84, 84, 3)
IMAGE_KEY: Final = "camera_2d"  # godot_rl decodes keys containing "2d" as hex-encoded uint8 images
ACTION_KEY: Final = "move"
ACTION_SIZE: Final = 2
OBS_KINDS: Final = ("vec8", "vec64", "img")
# The fair godot_rl baseline is the faster of its two ways to serve P policies (the first two modes).
GODOT_RL_MODES: Final = ("godot_rl_per_policy", "godot_rl_one_env")
# The modes with the broker between game and trainer (a process of its own, or the trainer's).
BROKER_MODES: Final = (
    "broker_tcp",
    "broker_socket",
    "broker_unix",
    "broker_plugin",
    "broker_script",
    "broker_variant",
    "inprocess",
)
MODES: Final = (
    *GODOT_RL_MODES,
    "godot_rl_emulator",
    *BROKER_MODES,
    "raw",
    "relay",
    "relay_asyncio",
    "inprocess_ceiling",
)
# Not run by default: the old baseline, the asyncio relay (a diagnosis: what the event loop costs), the
# Variant codec (what an addon game's bodies cost the broker) and godot_rl's scripts dialed by the broker (the
# migration guide's path B); asked for by name.
DEFAULT_MODES: Final = tuple(
    m for m in MODES if m not in ("godot_rl_emulator", "relay_asyncio", "broker_variant", "broker_script")
)
MODE_TITLES: Final = {
    "godot_rl_per_policy": "(a) godot_rl, one port and one trainer process per policy, lean plugin game",
    "godot_rl_one_env": "(a') godot_rl, all agents of all policies in one env, lean plugin game",
    "godot_rl_emulator": "(a'') godot_rl, all agents in one env, clients/plugin_emulator.py (the old baseline)",
    "broker_tcp": "(b) broker TCP",
    "broker_socket": "(b0) broker TCP, the trainers' batches through the socket (no shared-memory ring)",
    "broker_unix": "(c) broker Unix socket",
    "broker_plugin": "(b') broker TCP serving the lean plugin game (the broker's godot_rl JSON path)",
    "broker_variant": "(b'') broker TCP, the lean game's bodies as Godot Variants (the addon's codec)",
    "broker_script": "(b''') the lean plugin game through the broker to godot_rl's SB3 env, dialed by the broker",
    "inprocess": "(d) in-process VecEnv",
    "raw": "(e) raw one-hop ceiling",
    "relay": "(f) two-hop ceiling: raw frames through a relay that does nothing else",
    "relay_asyncio": "(f') two-hop ceiling through a uvloop asyncio relay: an asyncio broker's least cost",
    "inprocess_ceiling": "(g) in-process ceiling: a relay thread and a raw trainer thread per policy, one process",
}


@dataclass(frozen=True)
class BenchConfig:
    agents: int  # per policy per game
    obs: str  # one of OBS_KINDS
    policies: int
    games: int

    def __post_init__(self) -> None:
        if self.obs not in OBS_KINDS:
            raise ValueError(f"obs must be one of {OBS_KINDS}, got {self.obs!r}")
        if min(self.agents, self.policies, self.games) < 1:
            raise ValueError("agents, policies and games must be at least 1")

    @property
    def label(self) -> str:
        return f"{self.agents}ag x {self.obs} x {self.policies}pol x {self.games}game"

    @property
    def vector_size(self) -> int:
        return 64 if self.obs == "vec64" else 8

    @property
    def policy_names(self) -> list[str]:
        return [f"p{j}" for j in range(self.policies)]

    @property
    def agents_per_step(self) -> int:
        """Agent-steps in one lock-step of every game (all policies)."""
        return self.agents * self.policies * self.games

    def spaces(self) -> PolicySpaces:
        obs: list[tuple[str, Any]] = [("obs", BoxSpace((self.vector_size,), "float32", -1.0, 1.0))]
        if self.obs == "img":
            obs.append((IMAGE_KEY, BoxSpace(IMAGE_SHAPE, "uint8", 0.0, 255.0)))
        return PolicySpaces(tuple(obs), ((ACTION_KEY, ContinuousAction(ACTION_SIZE)),))

    def groups(self) -> list[GroupSpec]:
        spaces = self.spaces()
        return [GroupSpec(name, self.agents, spaces) for name in self.policy_names]

    def observation_bytes_per_agent(self) -> int:
        return 4 * self.vector_size + (int(np.prod(IMAGE_SHAPE)) if self.obs == "img" else 0)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "label": self.label}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> BenchConfig:
        return cls(int(obj["agents"]), str(obj["obs"]), int(obj["policies"]), int(obj["games"]))


ANCHOR: Final = BenchConfig(400, "vec64", 2, 1)  # the configuration of the throughput targets
ONE_AGENT: Final = BenchConfig(1, "vec64", 1, 1)  # one agent, in the sweep
# Issue 19's target configurations (agents x obs x policies x games).
LATENCY: Final = BenchConfig(1, "vec8", 1, 1)
SMALL: Final = BenchConfig(16, "vec64", 1, 1)
SEVERAL_GAMES: Final = BenchConfig(16, "vec64", 2, 4)
IMAGES: Final = BenchConfig(16, "img", 1, 1)
TARGET_CONFIGS: Final = (LATENCY, SMALL, SEVERAL_GAMES, ANCHOR, IMAGES)


@dataclass(frozen=True)
class Preset:
    configs: tuple[BenchConfig, ...]
    warmup_s: float  # stepping before the window, after every peer is in
    measure_s: float  # the measured window (at least MIN_STEPS steps)
    repeats: dict[BenchConfig, int]  # configurations measured more than once (median taken)


def _sweep() -> tuple[BenchConfig, ...]:
    """One axis at a time around the anchor (400 agents x 64 floats x 2 policies x 1 game)."""
    configs = [ANCHOR, ONE_AGENT, *TARGET_CONFIGS]
    configs += [BenchConfig(n, "vec64", 2, 1) for n in (1, 16, 200, 1600)]
    configs += [BenchConfig(400, obs, 2, 1) for obs in ("vec8", "img")]
    configs += [BenchConfig(n, "img", 2, 1) for n in (16, 200)]  # images: bytes scaling at a fixed shape
    configs += [BenchConfig(400, "vec64", p, 1) for p in (1, 8)]
    configs += [BenchConfig(400, "vec64", 2, 4)]
    return tuple(dict.fromkeys(configs))


PRESETS: Final = {
    # For the test suite: two tiny configurations, every mode, well under a minute.
    "smoke": Preset((BenchConfig(16, "vec8", 2, 1), BenchConfig(4, "img", 1, 2)), 0.3, 0.6, {}),
    # For CI: two target configurations, a couple of seconds each.
    "quick": Preset((ANCHOR, LATENCY), 0.5, 2.0, {}),
    # Issue 19's targets: every target configuration three times, modes interleaved.
    "targets": Preset(TARGET_CONFIGS, 1.0, 3.0, {c: 3 for c in TARGET_CONFIGS}),
    # For docs/performance.md: the sweep, target configurations three times.
    "full": Preset(_sweep(), 1.0, 3.0, {ANCHOR: 3, ONE_AGENT: 3}),
}
MIN_STEPS: Final = 5


# --- the benchmark game's world -------------------------------------------------------------------


class GroupWorld:
    """One policy's agents in one game: preallocated arrays, vectorized updates, no per-agent Python."""

    def __init__(self, config: BenchConfig, game_index: int) -> None:
        n = config.agents
        self.n = n
        self.vector = np.zeros((n, config.vector_size), np.float32)
        self.vector[:, 0] = game_index / 100
        self.vector[:, 1] = np.arange(n, dtype=np.float32) / max(n, 100)
        self.obs: dict[str, np.ndarray] = {"obs": self.vector}
        if config.obs == "img":
            pattern = (np.arange(int(np.prod(IMAGE_SHAPE))) * 7 % 256).astype(np.uint8).reshape(IMAGE_SHAPE)
            self.obs[IMAGE_KEY] = np.broadcast_to(pattern, (n, *IMAGE_SHAPE)).copy()
        self.reward = np.zeros(n, np.float32)
        self.terminated = np.zeros(n, np.bool_)
        self.truncated = np.zeros(n, np.bool_)
        self.age = (np.arange(n) + game_index * 7) % HORIZON
        self.final_index: np.ndarray | None = None
        self.final_obs: dict[str, np.ndarray] | None = None

    def step_data(self) -> StepData:
        return StepData(self.obs, self.reward, self.terminated, self.truncated, self.final_index, self.final_obs)

    def apply(self, move: np.ndarray, tick: int) -> None:
        vector = self.vector
        vector[:, 2] = move[:, 0]
        vector[:, 3] = np.clip(vector[:, 3] + 0.05 * move[:, 1], -1.0, 1.0)
        np.negative(np.abs(vector[:, 3]), out=self.reward)
        if IMAGE_KEY in self.obs:
            self.obs[IMAGE_KEY][:, 0, 0, 0] = tick % 256
        self.age += 1
        np.greater_equal(self.age, HORIZON, out=self.truncated)
        if self.truncated.any():
            rows = np.flatnonzero(self.truncated).astype(np.int32)
            self.final_index = rows
            self.final_obs = {k: v[rows] for k, v in self.obs.items()}  # fancy indexing copies
            vector[rows, 3] = 0.0
            self.age[rows] = 0
        else:
            self.final_index = self.final_obs = None


class BenchWorld:
    """Every group of one game."""

    def __init__(self, config: BenchConfig, game_index: int) -> None:
        self.config = config
        self.groups = {name: GroupWorld(config, game_index) for name in config.policy_names}
        self.tick = 0

    def step_data(self) -> dict[str, StepData]:
        return {name: group.step_data() for name, group in self.groups.items()}

    def apply(self, actions: dict[str, dict[str, np.ndarray]]) -> None:
        self.tick += 1
        for name, group in self.groups.items():
            group.apply(actions[name][ACTION_KEY], self.tick)
