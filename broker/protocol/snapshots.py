"""The names in a self-play pool directory, shared by the trainer that writes snapshots and the broker that
plays them (docs/self_play.md): ``snapshot-NNNNNN.onnx``, then its metadata ``snapshot-NNNNNN.json``
(a snapshot counts once that exists), and the broker's ``pool.json``."""

from __future__ import annotations

SNAPSHOT_PREFIX = "snapshot-"
POOL_STATE_FILE = "pool.json"


def snapshot_name(index: int) -> str:
    return f"{SNAPSHOT_PREFIX}{index:06d}"


def snapshot_index(stem: str) -> int | None:
    """The index in a snapshot file's stem, or None if it is not one."""
    if not stem.startswith(SNAPSHOT_PREFIX):
        return None
    digits = stem[len(SNAPSHOT_PREFIX) :]
    return int(digits) if digits.isdigit() else None
