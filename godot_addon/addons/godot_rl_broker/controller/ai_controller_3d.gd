class_name AIController3D
extends Node3D
## An agent for BrokerSync, with the API of godot_rl_agents' AIController3D, so controllers written
## for that plugin run unchanged.
##
## Extend it and implement get_obs(), get_reward(), get_action_space() and set_action(action).
## Set done = true (and needs_reset = true) when an episode ends; the game resets the agent when it
## sees needs_reset (calling reset()). Agents with the same policy_name form one agent group,
## trained by one trainer. If the godot_rl_agents addon is installed too, delete this addon's
## controller/ folder: BrokerSync drives godot_rl's own AIController2D/3D the same way.
##
## Its members are exactly those of godot_rl_agents' own, so no subclass written for that
## plugin clashes with a member it does not know. BrokerSync reads the rest by duck typing: a
## `truncated` flag or get_obs_done() that your controller declares (godot_rl plugin PR #65).

enum ControlModes {
	INHERIT_FROM_SYNC,  ## Use the BrokerSync node's mode.
	HUMAN,  ## Play it yourself (heuristic is "human").
	TRAINING,  ## Actions from the policy's trainer, through the broker.
	ONNX_INFERENCE,  ## Actions from an exported .onnx policy (needs Godot .NET).
	RECORD_EXPERT_DEMOS,  ## Not supported by BrokerSync: runs as HUMAN.
}

## How this agent is driven; INHERIT_FROM_SYNC takes the BrokerSync node's control_mode.
@export var control_mode: ControlModes = ControlModes.INHERIT_FROM_SYNC
## The .onnx policy for this agent in ONNX_INFERENCE mode (else BrokerSync's file for its policy).
@export var onnx_model_path: String = ""
## Physics ticks after which needs_reset is raised; BrokerSync reports that episode as truncated.
@export var reset_after: int = 1000

@export_group("Record expert demos mode options")
## Kept for scenes made with godot_rl_agents; BrokerSync does not record demos.
@export var expert_demo_save_path: String = ""
## Kept for scenes made with godot_rl_agents; BrokerSync does not record demos.
@export var remove_last_episode_key: InputEvent
## Kept for scenes made with godot_rl_agents; BrokerSync does not record demos.
@export var action_repeat: int = 1

@export_group("Multi-policy mode options")
## The agent group: every agent with this name shares one policy, its spaces and its trainer.
@export var policy_name: String = "shared_policy"

## godot_rl's ONNXModel when godot_rl_agents' Sync drives this agent (unused by BrokerSync).
var onnx_model = null
## "human" when a person plays this agent, "model" when a policy does.
var heuristic: String = "human"
## Set to true when the episode ends; the BrokerSync node reports it once, then clears it.
var done: bool = false
var reward: float = 0.0
var n_steps: int = 0
var needs_reset: bool = false

var _player: Node3D


# The signatures below are godot_rl_agents' own (some untyped), so every override written for that
# plugin still matches its parent here.
func _ready():
	add_to_group("AGENT")


func _physics_process(_delta):
	n_steps += 1
	if n_steps > reset_after:
		needs_reset = true


func init(player: Node3D):
	_player = player


#region Methods to implement in your controller


## The observation: a Dictionary of key -> values (e.g. {"obs": [0.1, -0.5]}).
func get_obs() -> Dictionary:
	push_error("%s: get_obs() is not implemented" % str(get_path()))
	return {"obs": []}


## The reward since the last call; BrokerSync calls zero_reward() after reading it.
func get_reward() -> float:
	return reward


## The actions, in the order the policy outputs them, e.g. {"move": {"size": 2, "action_type":
## "continuous"}, "jump": {"size": 2, "action_type": "discrete"}}.
func get_action_space() -> Dictionary:
	push_error("%s: get_action_space() is not implemented" % str(get_path()))
	return {}


## Apply an action: {key: Array of floats (continuous) or int (discrete)}.
func set_action(action) -> void:
	push_error("%s: set_action(%s) is not implemented" % [str(get_path()), str(action)])


#endregion

#region Methods to implement sometimes


## The action a human player took (godot_rl's demo recorder; unused by BrokerSync).
func get_action() -> Array:
	push_error("%s: get_action() is not implemented" % str(get_path()))
	return []


## Extra information for the trainer, e.g. {"is_success": true}; sent when not empty.
func get_info() -> Dictionary:
	return {}


## The observation spaces: override for several keys, images ("2d" keys) or discrete values.
func get_obs_space():
	var obs: Dictionary = get_obs()
	return {"obs": {"size": [len(obs["obs"])], "space": "box"}}


#endregion


func reset():
	n_steps = 0
	needs_reset = false


func reset_if_done():
	if done:
		reset()


func set_heuristic(h):
	heuristic = h


func get_done():
	return done


func set_done_false():
	done = false


func zero_reward():
	reward = 0.0
