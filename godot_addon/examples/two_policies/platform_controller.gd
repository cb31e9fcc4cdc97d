extends AIController2D
## The platform's agent: sees where the player is; moves left, stays or moves right (one discrete
## action with 3 choices). policy_name "platform" (set in lane.tscn).


func get_obs() -> Dictionary:
	return {"obs": _player.platform_obs()}


func get_reward() -> float:
	return reward


func get_action_space() -> Dictionary:
	return {"move": {"size": 3, "action_type": "discrete"}}


func set_action(action) -> void:
	_player.platform_move = int(action["move"]) - 1
