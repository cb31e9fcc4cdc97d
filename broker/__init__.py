"""godot-rl-broker: one port, many policies, between Godot RL games and independent trainers."""

__version__ = "0.1.0"
