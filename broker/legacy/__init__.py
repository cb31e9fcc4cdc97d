"""Compatibility with unmodified godot_rl: plugin games on the broker's port, and godot_rl training
scripts that the broker serves as if it were a game. Sans-IO throughout: ``wire`` holds the JSON
conversions, ``godot_rl_game``/``godot_rl_trainer`` the state machines, ``game_connection`` a plugin
game's connection for the server, ``calls`` the bookkeeping of a relayed ``call``. The asyncio side
lives in ``broker/server/`` (``server.py``, ``legacy_games.py``, ``dialer.py``)."""
