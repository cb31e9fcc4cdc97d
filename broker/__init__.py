"""godot-rl-broker: one port, many policies, between Godot RL games and independent trainers."""

__version__ = "0.1.0"

from broker.compiled import guard as _guard

_guard()  # a stale compiled build runs from source instead (broker/compiled.py)
