extends AIController2D
## A one-agent game for the unmodified godot_rl plugin. --obs_size=N changes its observation
## size, so two copies can disagree on one policy's spaces (the broker must refuse, and say why).

var obs_size := 3


func _ready():
	super._ready()
	for argument in OS.get_cmdline_args():
		if argument.begins_with("--obs_size="):
			obs_size = argument.split("=")[1].to_int()


func get_obs() -> Dictionary:
	var values := []
	for i in range(obs_size):
		values.append(0.1 * i)
	return {"obs": values}


func get_reward() -> float:
	return reward


func get_action_space() -> Dictionary:
	return {"move": {"size": 1, "action_type": "continuous"}}


func set_action(_action) -> void:
	pass
