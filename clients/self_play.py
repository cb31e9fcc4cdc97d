"""The learner's side of self-play (``gdrl-train --policy red --opponent blue``): snapshots of the policy
into a pool directory (ONNX + metadata), and the broker asked to play the opponent group from that pool.

The broker owns the rotation (which snapshot plays, when to swap) and the Elo table; both persist in the
pool, so a restarted broker or a resumed trainer (``--resume-model-path``) continue them. Snapshot
numbers continue from the pool's highest. docs/self_play.md has the whole picture.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from stable_baselines3.common.callbacks import BaseCallback

from broker.protocol.snapshots import POOL_STATE_FILE, SNAPSHOT_PREFIX, snapshot_index, snapshot_name
from broker.protocol.spaces import PolicySpaces
from clients.status import fetch_status, send_control


def snapshot_indices(pool: Path) -> list[int]:
    """Indices of the pool's complete snapshots (their metadata written), ascending."""
    indices = (snapshot_index(path.stem) for path in pool.glob(f"{SNAPSHOT_PREFIX}*.json"))
    return sorted(i for i in indices if i is not None)


def write_snapshot(pool: Path, model: Any, spaces: PolicySpaces, policy: str) -> Path:
    """Write the policy as the pool's next snapshot; the metadata last, so the broker never picks a
    half-written model."""
    from clients.onnx_export import export_onnx

    indices = snapshot_indices(pool)
    index = (indices[-1] + 1) if indices else 0
    stem = pool / snapshot_name(index)
    tmp = stem.with_suffix(".onnx.tmp")
    export_onnx(model, tmp, spaces, policy_name=policy, check=False)
    os.replace(tmp, stem.with_suffix(".onnx"))
    meta = {
        "index": index,
        "policy": policy,
        "steps": int(model.num_timesteps),
        "written_at": time.time(),
        "observation_space": spaces.observation_wire(),
        "action_space": spaces.action_wire(),
    }
    stem.with_suffix(".json.tmp").write_text(json.dumps(meta, indent=1))
    os.replace(stem.with_suffix(".json.tmp"), stem.with_suffix(".json"))
    return stem.with_suffix(".onnx")


def prune(pool: Path, keep: int) -> list[str]:
    """Delete the oldest snapshots beyond ``keep`` (0: keep them all), never the one the broker plays now
    (``pool.json``'s opponent); the metadata first, so the broker stops counting a snapshot before its model
    goes. Their Elo ratings stay in the table. Returns the names deleted."""
    if keep < 1:
        return []
    try:
        playing = json.loads((pool / POOL_STATE_FILE).read_text(encoding="utf-8")).get("opponent")
    except (OSError, ValueError, AttributeError):
        playing = None
    names = [snapshot_name(i) for i in snapshot_indices(pool)]
    removed: list[str] = []
    for name in names[:-1]:  # never the newest
        if len(names) - len(removed) <= keep:
            break
        if name != playing:
            (pool / f"{name}.json").unlink(missing_ok=True)
            (pool / f"{name}.onnx").unlink(missing_ok=True)
            removed.append(name)
    return removed


class SelfPlay:
    def __init__(
        self,
        address: str,
        token: str | None,
        policy: str,
        opponent: str,
        pool: str | Path,
        spaces: PolicySpaces,
        window: int,
        play_latest: float,
        swap_every: int,
        seed: int = 0,
        keep: int = 0,
    ) -> None:
        self.address, self.token = address, token
        self.keep = keep
        self.policy, self.opponent = policy, opponent
        self.pool = Path(pool).resolve()
        self.spaces = spaces
        self.request = {
            "group": opponent,
            "learner": policy,
            "pool": str(self.pool),
            "window": window,
            "play_latest": play_latest,
            "swap_every": swap_every,
            "seed": seed,
        }
        self.snapshots_written = 0

    def start(self, model: Any) -> dict[str, Any]:
        """A first snapshot if the pool has none, then the broker asked to play the opponent from the pool
        (BrokerError ``bad_control`` with the broker's reason, e.g. the two groups' spaces differ)."""
        self.pool.mkdir(parents=True, exist_ok=True)
        if not snapshot_indices(self.pool):
            self.snapshot(model)
        return send_control(self.address, "self_play", self.request, self.token)

    def snapshot(self, model: Any) -> Path:
        path = write_snapshot(self.pool, model, self.spaces, self.policy)
        self.snapshots_written += 1
        prune(self.pool, self.keep)
        return path

    def check_in(self) -> float | None:
        """The live policy's rating from the broker (None if none yet, or the broker cannot be asked). A
        broker that no longer plays the opponent (it was restarted) is asked again: the pool continues."""
        try:
            status = fetch_status(self.address, self.token)
            if self.opponent not in status.get("frozen", {}):
                send_control(self.address, "self_play", self.request, self.token)
        except Exception:
            return None
        rating = status.get("elo", {}).get(self.policy)
        return float(rating) if rating is not None else None


class SelfPlayCallback(BaseCallback):
    """Every ``every`` agent steps: a snapshot into the pool, and the live Elo to TensorBoard."""

    def __init__(self, self_play: SelfPlay, every: int, verbose: int = 0) -> None:
        super().__init__(verbose)
        self.self_play = self_play
        self.every = every
        self.last = 0

    def _on_training_start(self) -> None:
        self.last = int(self.model.num_timesteps)

    def _on_step(self) -> bool:
        if self.model.num_timesteps - self.last >= self.every:
            self.last = int(self.model.num_timesteps)
            self.self_play.snapshot(self.model)
            rating = self.self_play.check_in()
            if rating is not None:
                self.logger.record("self_play/elo", rating)
            self.logger.record("self_play/snapshots", self.self_play.snapshots_written)
        return True
