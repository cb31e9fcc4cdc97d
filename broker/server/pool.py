"""A self-play snapshot pool: a directory the learner's trainer writes and the broker reads.

The trainer writes ``snapshot-NNNNNN.onnx`` and then ``snapshot-NNNNNN.json`` (its metadata; a snapshot
counts once its metadata exists, so a half-written model is never picked). The broker owns ``pool.json``:
the opponent now playing, steps since the last swap, swaps, and the Elo table, written atomically, so a
restarted broker continues the ratings and the rotation where they were.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from broker.core.elo import EloTable
from broker.protocol.snapshots import POOL_STATE_FILE, snapshot_index


@dataclass(frozen=True)
class Snapshot:
    index: int
    name: str  # snapshot-NNNNNN
    model_path: str
    steps: int


def list_snapshots(directory: str | Path) -> list[Snapshot]:
    """Complete snapshots (model and metadata written), oldest first."""
    out = []
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    for file in names:
        stem = file.removesuffix(".json")
        index = snapshot_index(stem)
        if index is None or stem == file:
            continue
        try:
            with open(os.path.join(directory, file), encoding="utf-8") as f:
                meta = json.load(f)
            steps = int(meta.get("steps", 0))
        except (ValueError, OSError, AttributeError):
            continue
        model = os.path.join(directory, stem + ".onnx")
        if os.path.exists(model):
            out.append(Snapshot(index, stem, model, steps))
    return sorted(out, key=lambda s: s.index)


@dataclass(frozen=True)
class PoolSettings:
    """How the opponent is chosen: ML-Agents' ghost trainer's knobs under our names (docs/self_play.md)."""

    directory: str
    learner: str  # the live policy whose snapshots these are
    window: int = 10
    play_latest: float = 0.5
    swap_every: int = 2000  # opponent env steps (batches answered) between swaps
    seed: int = 0

    def validate(self) -> None:
        if self.window < 1:
            raise ValueError("window must be at least 1")
        if not 0.0 <= self.play_latest <= 1.0:
            raise ValueError("play_latest must be within [0, 1]")
        if self.swap_every < 1:
            raise ValueError("swap_every must be at least 1")
        if not self.learner:
            raise ValueError("the learner policy must be named")

    def to_dict(self) -> dict[str, Any]:
        return {
            "directory": self.directory,
            "learner": self.learner,
            "window": self.window,
            "play_latest": self.play_latest,
            "swap_every": self.swap_every,
            "seed": self.seed,
        }


def saved_settings(directory: str) -> PoolSettings:
    """The settings a pool was last played with, from its ``pool.json`` (ValueError if there are none)."""
    path = Path(directory) / POOL_STATE_FILE
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))["settings"]
        settings = PoolSettings(
            directory=str(Path(directory).resolve()),
            learner=str(saved["learner"]),
            window=int(saved["window"]),
            play_latest=float(saved["play_latest"]),
            swap_every=int(saved["swap_every"]),
            seed=int(saved.get("seed", 0)),
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path} holds no pool settings ({type(exc).__name__}: {exc})") from None
    settings.validate()
    return settings


class SnapshotPool:
    def __init__(self, settings: PoolSettings) -> None:
        settings.validate()
        self.settings = settings
        self.directory = Path(settings.directory)
        self.opponent: str | None = None
        self.steps_since_swap = 0
        self.swaps = 0
        self.elo = EloTable()
        self.rng = random.Random(settings.seed)
        self.team_change: dict[str, Any] | None = None  # a --team-change rotation (broker/core/team_change.py)
        self.load_state()

    @property
    def state_path(self) -> Path:
        return self.directory / POOL_STATE_FILE

    def load_state(self) -> None:
        """Continue from ``pool.json`` if there is one (ValueError if it is unreadable)."""
        try:
            text = self.state_path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return
        except OSError as exc:
            raise ValueError(f"cannot read {self.state_path}: {exc}") from None
        try:
            state = json.loads(text)
            self.opponent = state.get("opponent")
            self.steps_since_swap = int(state.get("steps_since_swap", 0))
            self.swaps = int(state.get("swaps", 0))
            self.elo = EloTable.from_dict(state.get("elo", {}))
            self.team_change = state.get("team_change")
            self.rng.seed(f"{self.settings.seed}:{self.swaps}")  # the rotation goes on, not over again
        except (ValueError, TypeError, AttributeError) as exc:
            raise ValueError(f"{self.state_path} is not a pool state file: {exc}") from None

    def save_state(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        state = {
            "settings": self.settings.to_dict(),
            "opponent": self.opponent,
            "steps_since_swap": self.steps_since_swap,
            "swaps": self.swaps,
            "elo": self.elo.to_dict(),
        }
        if self.team_change is not None:
            state["team_change"] = self.team_change
        tmp = self.state_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(state, indent=1), encoding="utf-8")
        os.replace(tmp, self.state_path)  # readers never see a half-written file

    def snapshots(self) -> list[Snapshot]:
        return list_snapshots(self.directory)

    def due(self, snapshots: list[Snapshot]) -> bool:
        """Time to pick an opponent: none yet, the current one is gone, or ``swap_every`` steps played."""
        if not snapshots:
            return False
        if self.opponent not in {s.name for s in snapshots}:
            return True
        return self.steps_since_swap >= self.settings.swap_every

    def choose(self, snapshots: list[Snapshot]) -> Snapshot:
        """The latest with probability ``play_latest``, else one of the last ``window`` at random."""
        if self.rng.random() < self.settings.play_latest:
            pick = snapshots[-1]
        else:
            pick = self.rng.choice(snapshots[-self.settings.window :])
        self.opponent = pick.name
        self.steps_since_swap = 0
        self.swaps += 1
        return pick

    def player(self, snapshot: str) -> str:
        """The Elo player name of a snapshot of the learner."""
        return f"{self.settings.learner}@{snapshot}"
