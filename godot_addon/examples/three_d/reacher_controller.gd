extends AIController3D
## The reacher's agent: sees the target relative to itself and its place on the floor; moves on the
## floor (one continuous action of 2 values). policy_name "reacher" (set in arena.tscn).


func get_obs() -> Dictionary:
	return {"obs": _player.observation()}


func get_reward() -> float:
	return reward


func get_action_space() -> Dictionary:
	return {"move": {"size": 2, "action_type": "continuous"}}


func set_action(action) -> void:
	_player.move = Vector2(
		clampf(action["move"][0], -1.0, 1.0), clampf(action["move"][1], -1.0, 1.0)
	)
