"""Compatibility with unmodified godot_rl: plugin games on the broker's port, and godot_rl training
scripts that the broker serves as if it were a game. ``wire`` holds the JSON conversions; the
``godot_rl_*`` modules are sans-IO state machines; ``edge`` is the asyncio glue."""
