extends AIController2D
## The player's agent: sees the goal, the platform and whether it is over the pit; moves left or
## right (one continuous action). policy_name "player" (set in lane.tscn).

## Whether the episode that just ended reached the goal (reported as is_success).
var reached_goal: bool = false


func get_obs() -> Dictionary:
	return {"obs": _player.player_obs()}


func get_reward() -> float:
	return reward


func get_action_space() -> Dictionary:
	return {"move": {"size": 1, "action_type": "continuous"}}


func set_action(action) -> void:
	_player.player_move = clampf(action["move"][0], -1.0, 1.0)


func get_info() -> Dictionary:
	if done:
		var info: Dictionary = {"is_success": reached_goal}
		reached_goal = false
		return info
	return {}
